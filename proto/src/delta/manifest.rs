//! The manifest of a delta checkpoint: what it turns into what, tensor by tensor, and which
//! segments it consists of, signed by the hub so that relays can forward but never forge.
//!
//! The signature covers the exact manifest bytes (with a domain-separation prefix); the
//! manifest names every segment by its BLAKE3, so a valid signature authenticates the
//! whole delta.
//!
//! [`hex()`], [`parse_hex`] and [`HexError`] are re-exported from [`crate::hex_text`], where
//! they were moved so that the digest's `Display` does not import the manifest.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use thiserror::Error;

use crate::delta::digest::StateDigest;
use crate::delta::segment::MAX_NAME_LEN;
use crate::error::DecodeError;
pub use crate::hex_text::{HexError, hex, parse_hex};
use crate::wire::{Reader, put_bytes, put_varint};

/// Version of the manifest encoding (bumped with the container format).
pub const MANIFEST_VERSION: u16 = 1;
const SIGNATURE_CONTEXT: &[u8] = b"starling delta manifest v1\0";
const MAX_TENSORS: u64 = 1 << 24;
const MAX_SEGMENTS: u64 = 1 << 26;
const MAX_RANK: u64 = 16;

/// Element type of a tensor in the delta (BF16 only in format version 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Dtype {
    Bf16 = 1,
}

/// One tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Elements whose bits change.
    pub changes: u64,
    /// Bitmask of the codecs used by this tensor's parts (see `EncodedPart::codec_mask`).
    pub codec_mask: u32,
    /// Sequence numbers of the segments holding parts of this tensor, ascending.
    pub segments: Vec<u32>,
    /// BLAKE3 of the tensor's bytes (little-endian BF16) after the delta, when computed.
    pub post_blake3: Option<[u8; 32]>,
}

impl TensorEntry {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// One segment of the delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentEntry {
    pub seq: u32,
    /// Length of the whole segment frame in bytes.
    pub frame_len: u64,
    pub changes: u64,
    /// BLAKE3 of the segment frame (see `container::frame_hash`).
    pub hash: [u8; 32],
}

/// What a delta turns into what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub model_id: String,
    pub base_version: u64,
    pub version: u64,
    /// Milliseconds since the Unix epoch, supplied by the caller (proto reads no clock).
    pub created_unix_ms: u64,
    pub pre_digest: StateDigest,
    pub post_digest: StateDigest,
    pub tensors: Vec<TensorEntry>,
    pub segments: Vec<SegmentEntry>,
}

/// The id every segment of a delta carries: known before the first segment is encoded
/// (the base digest is not: a fresh encoder computes it in the same pass as the diff).
pub fn delta_id(model_id: &str, base_version: u64, version: u64, created_unix_ms: u64) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key("starling delta id v1");
    h.update(&(model_id.len() as u64).to_le_bytes());
    h.update(model_id.as_bytes());
    h.update(&base_version.to_le_bytes());
    h.update(&version.to_le_bytes());
    h.update(&created_unix_ms.to_le_bytes());
    *h.finalize().as_bytes()
}

impl Manifest {
    pub fn delta_id(&self) -> [u8; 32] {
        delta_id(
            &self.model_id,
            self.base_version,
            self.version,
            self.created_unix_ms,
        )
    }

    pub fn total_changes(&self) -> u64 {
        self.tensors.iter().map(|t| t.changes).sum()
    }

    pub fn total_elements(&self) -> u64 {
        self.tensors.iter().map(TensorEntry::numel).sum()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// The canonical bytes (what the signature covers).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MANIFEST_VERSION.to_le_bytes());
        put_bytes(&mut out, self.model_id.as_bytes());
        put_varint(&mut out, self.base_version);
        put_varint(&mut out, self.version);
        put_varint(&mut out, self.created_unix_ms);
        out.extend_from_slice(&self.pre_digest.to_bytes());
        out.extend_from_slice(&self.post_digest.to_bytes());
        put_varint(&mut out, self.tensors.len() as u64);
        for t in &self.tensors {
            put_bytes(&mut out, t.name.as_bytes());
            out.push(t.dtype as u8);
            put_varint(&mut out, t.shape.len() as u64);
            for &d in &t.shape {
                put_varint(&mut out, d);
            }
            put_varint(&mut out, t.changes);
            put_varint(&mut out, u64::from(t.codec_mask));
            put_varint(&mut out, t.segments.len() as u64);
            let mut prev = 0u32;
            for &s in &t.segments {
                put_varint(&mut out, u64::from(s - prev));
                prev = s;
            }
            match &t.post_blake3 {
                Some(h) => {
                    out.push(1);
                    out.extend_from_slice(h);
                }
                None => out.push(0),
            }
        }
        put_varint(&mut out, self.segments.len() as u64);
        for s in &self.segments {
            put_varint(&mut out, u64::from(s.seq));
            put_varint(&mut out, s.frame_len);
            put_varint(&mut out, s.changes);
            out.extend_from_slice(&s.hash);
        }
        out
    }

    /// Parses canonical manifest bytes, checking every invariant a reader relies on:
    /// tensors sorted by unique name, segments numbered 0..n, shapes without overflow,
    /// per-tensor changes within the tensor size.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes);
        let v = r.u16_le("manifest version")?;
        if v != MANIFEST_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                found: v,
                supported: MANIFEST_VERSION,
            });
        }
        let model_id = r.str("model id", MAX_NAME_LEN)?.to_owned();
        let base_version = r.varint("base version")?;
        let version = r.varint("version")?;
        let created_unix_ms = r.varint("creation time")?;
        let pre_digest = StateDigest::from_bytes(r.array("pre digest")?);
        let post_digest = StateDigest::from_bytes(r.array("post digest")?);
        let n = r.varint_at_most("tensor count", MAX_TENSORS)?;
        let mut tensors: Vec<TensorEntry> = Vec::with_capacity((n as usize).min(bytes.len() / 8));
        for _ in 0..n {
            let name = r.str("tensor name", MAX_NAME_LEN)?.to_owned();
            let dtype = match r.u8("dtype")? {
                1 => Dtype::Bf16,
                id => return Err(DecodeError::UnknownCodec { what: "dtype", id }),
            };
            let rank = r.varint_at_most("tensor rank", MAX_RANK)?;
            let mut shape = Vec::with_capacity(rank as usize);
            let mut numel: u64 = 1;
            for _ in 0..rank {
                let d = r.varint("tensor dimension")?;
                numel = numel.checked_mul(d).ok_or_else(|| {
                    DecodeError::malformed(
                        "manifest",
                        format!("tensor {name} has more than 2^64 elements"),
                    )
                })?;
                shape.push(d);
            }
            let changes = r.varint_at_most("tensor changes", numel)?;
            let codec_mask = r.varint_at_most("codec mask", u64::from(u32::MAX))? as u32;
            let ns = r.varint_at_most("tensor segment count", MAX_SEGMENTS)?;
            let mut segs = Vec::with_capacity((ns as usize).min(r.remaining()));
            let mut prev: u64 = 0;
            for i in 0..ns {
                let d = r.varint("tensor segment")?;
                if i > 0 && d == 0 {
                    return Err(DecodeError::malformed(
                        "manifest",
                        "tensor segments not ascending",
                    ));
                }
                prev = prev
                    .checked_add(d)
                    .filter(|&s| s <= u64::from(u32::MAX))
                    .ok_or_else(|| {
                        DecodeError::malformed("manifest", "segment number overflows")
                    })?;
                segs.push(prev as u32);
            }
            let post_blake3 = match r.u8("tensor hash flag")? {
                0 => None,
                1 => Some(r.array("tensor hash")?),
                f => {
                    return Err(DecodeError::malformed(
                        "manifest",
                        format!("tensor hash flag {f}"),
                    ));
                }
            };
            if let Some(last) = tensors.last()
                && last.name >= name
            {
                return Err(DecodeError::malformed(
                    "manifest",
                    "tensors not sorted by unique name",
                ));
            }
            tensors.push(TensorEntry {
                name,
                dtype,
                shape,
                changes,
                codec_mask,
                segments: segs,
                post_blake3,
            });
        }
        let ns = r.varint_at_most("segment count", MAX_SEGMENTS)?;
        let mut segments = Vec::with_capacity((ns as usize).min(r.remaining() / 34 + 1));
        for i in 0..ns {
            let seq = r.varint("segment number")?;
            if seq != i {
                return Err(DecodeError::malformed(
                    "manifest",
                    "segments not numbered 0..n",
                ));
            }
            segments.push(SegmentEntry {
                seq: seq as u32,
                frame_len: r.varint("segment length")?,
                changes: r.varint("segment changes")?,
                hash: r.array("segment hash")?,
            });
        }
        r.finish("manifest")?;
        if let Some(t) = tensors
            .iter()
            .find(|t| t.segments.iter().any(|&s| u64::from(s) >= ns))
        {
            return Err(DecodeError::malformed(
                "manifest",
                format!("tensor {} names a segment that does not exist", t.name),
            ));
        }
        Ok(Self {
            model_id,
            base_version,
            version,
            created_unix_ms,
            pre_digest,
            post_digest,
            tensors,
            segments,
        })
    }
}

/// How a manifest is signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestSignature {
    Unsigned,
    Ed25519 {
        public_key: [u8; 32],
        signature: [u8; 64],
    },
}

/// A manifest with its canonical bytes and signature: the body of a manifest frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedManifest {
    pub manifest: Manifest,
    pub bytes: Vec<u8>,
    pub signature: ManifestSignature,
}

/// Which manifests a reader accepts.
#[derive(Debug, Clone, Default)]
pub enum TrustPolicy {
    /// Unsigned manifests are accepted; a signature that is present must still verify
    /// against the key it names (catching corruption, not forgery).
    #[default]
    AnySigner,
    /// Only manifests signed by one of these keys.
    Keys(Vec<VerifyingKey>),
}

impl TrustPolicy {
    /// Only manifests signed by the ed25519 public key `key`.
    pub fn trusting(key: &[u8; 32]) -> Result<Self, SignatureError> {
        let key = VerifyingKey::from_bytes(key).map_err(|_| SignatureError::Invalid)?;
        Ok(Self::Keys(vec![key]))
    }
}

/// Why a manifest's signature was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SignatureError {
    #[error("the manifest is unsigned but a trusted key is configured")]
    Unsigned,
    #[error("the manifest is signed by {0}, which is not a trusted key")]
    UntrustedKey(String),
    #[error("the manifest signature does not verify")]
    Invalid,
}

impl SignedManifest {
    pub fn sign(manifest: Manifest, key: Option<&SigningKey>) -> Self {
        let bytes = manifest.encode();
        let signature = match key {
            None => ManifestSignature::Unsigned,
            Some(k) => ManifestSignature::Ed25519 {
                public_key: k.verifying_key().to_bytes(),
                signature: k.sign(&signed_message(&bytes)).to_bytes(),
            },
        };
        Self {
            manifest,
            bytes,
            signature,
        }
    }

    pub fn encode_body(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes.len() + 120);
        put_bytes(&mut out, &self.bytes);
        match &self.signature {
            ManifestSignature::Unsigned => out.push(0),
            ManifestSignature::Ed25519 {
                public_key,
                signature,
            } => {
                out.push(1);
                out.extend_from_slice(public_key);
                out.extend_from_slice(signature);
            }
        }
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let bytes = r.bytes("manifest", body.len())?.to_vec();
        let signature = match r.u8("signature kind")? {
            0 => ManifestSignature::Unsigned,
            1 => ManifestSignature::Ed25519 {
                public_key: r.array("public key")?,
                signature: r.array("signature")?,
            },
            id => {
                return Err(DecodeError::UnknownCodec {
                    what: "signature kind",
                    id,
                });
            }
        };
        r.finish("manifest frame")?;
        let manifest = Manifest::decode(&bytes)?;
        Ok(Self {
            manifest,
            bytes,
            signature,
        })
    }

    /// Checks the signature under `policy`.
    pub fn verify(&self, policy: &TrustPolicy) -> Result<(), SignatureError> {
        let (pk, sig) = match (&self.signature, policy) {
            (ManifestSignature::Unsigned, TrustPolicy::AnySigner) => return Ok(()),
            (ManifestSignature::Unsigned, TrustPolicy::Keys(_)) => {
                return Err(SignatureError::Unsigned);
            }
            (
                ManifestSignature::Ed25519 {
                    public_key,
                    signature,
                },
                _,
            ) => (public_key, signature),
        };
        let key = VerifyingKey::from_bytes(pk).map_err(|_| SignatureError::Invalid)?;
        if let TrustPolicy::Keys(trusted) = policy
            && !trusted.contains(&key)
        {
            return Err(SignatureError::UntrustedKey(hex(pk)));
        }
        key.verify(&signed_message(&self.bytes), &Signature::from_bytes(sig))
            .map_err(|_| SignatureError::Invalid)
    }

    pub fn is_signed(&self) -> bool {
        matches!(self.signature, ManifestSignature::Ed25519 { .. })
    }
}

fn signed_message(bytes: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGNATURE_CONTEXT.len() + bytes.len());
    m.extend_from_slice(SIGNATURE_CONTEXT);
    m.extend_from_slice(bytes);
    m
}

/// The ed25519 public key of a 32-byte signing seed.
pub fn public_key_of(seed: &[u8; 32]) -> [u8; 32] {
    SigningKey::from_bytes(seed).verifying_key().to_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        Manifest {
            model_id: "tiny".into(),
            base_version: 4,
            version: 5,
            created_unix_ms: 1_700_000_000_000,
            pre_digest: StateDigest(1),
            post_digest: StateDigest(2),
            tensors: vec![
                TensorEntry {
                    name: "a".into(),
                    dtype: Dtype::Bf16,
                    shape: vec![2, 3],
                    changes: 1,
                    codec_mask: 0b1010,
                    segments: vec![0],
                    post_blake3: Some([9; 32]),
                },
                TensorEntry {
                    name: "b".into(),
                    dtype: Dtype::Bf16,
                    shape: vec![4],
                    changes: 0,
                    codec_mask: 0,
                    segments: vec![],
                    post_blake3: None,
                },
            ],
            segments: vec![SegmentEntry {
                seq: 0,
                frame_len: 100,
                changes: 1,
                hash: [3; 32],
            }],
        }
    }

    #[test]
    fn manifest_round_trips_and_golden_prefix() {
        let m = sample();
        let b = m.encode();
        // version 1, model id "tiny", base 4, version 5.
        assert_eq!(&b[..9], &[1, 0, 4, b't', b'i', b'n', b'y', 4, 5]);
        assert_eq!(Manifest::decode(&b).expect("decodes"), m);
        for cut in 0..b.len() {
            assert!(Manifest::decode(&b[..cut]).is_err());
        }
    }

    #[test]
    fn signatures_verify_and_refuse_tampering() {
        let key = SigningKey::from_bytes(&[42; 32]);
        let other = SigningKey::from_bytes(&[43; 32]);
        let s = SignedManifest::sign(sample(), Some(&key));
        let trusted = TrustPolicy::Keys(vec![key.verifying_key()]);
        assert_eq!(s.verify(&trusted), Ok(()));
        assert_eq!(s.verify(&TrustPolicy::AnySigner), Ok(()));
        let body = s.encode_body();
        assert_eq!(SignedManifest::decode_body(&body).expect("decodes"), s);
        // Unsigned refused when a key is trusted; a foreign signer refused.
        let u = SignedManifest::sign(sample(), None);
        assert_eq!(u.verify(&trusted), Err(SignatureError::Unsigned));
        assert_eq!(u.verify(&TrustPolicy::AnySigner), Ok(()));
        let f = SignedManifest::sign(sample(), Some(&other));
        assert!(matches!(
            f.verify(&trusted),
            Err(SignatureError::UntrustedKey(_))
        ));
        // Tampered bytes with the original signature do not verify.
        let mut t = s.clone();
        t.manifest.version = 6;
        t.bytes = t.manifest.encode();
        assert_eq!(t.verify(&trusted), Err(SignatureError::Invalid));
    }

    #[test]
    fn unsorted_tensors_and_dangling_segments_are_refused() {
        let mut m = sample();
        m.tensors.swap(0, 1);
        assert!(Manifest::decode(&m.encode()).is_err());
        let mut m = sample();
        m.tensors[0].segments = vec![3];
        assert!(Manifest::decode(&m.encode()).is_err());
    }
}
