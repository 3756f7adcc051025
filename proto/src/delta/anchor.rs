//! Anchors: full checkpoints the hub keeps every few versions so that a receiver further
//! behind than the retained deltas can restore (anchor + the deltas after it) instead of
//! replaying the whole history.
//!
//! An anchor travels as a plain safetensors file. What makes it trustworthy is its
//! [`AnchorSeal`]: the model, version, size and BLAKE3 of the file, signed with the same
//! ed25519 key as delta manifests (under its own context string, so a manifest signature can
//! never be replayed as an anchor's or vice versa). A receiver hashes the file as it arrives
//! and accepts it only if the seal verifies under its trust policy and matches the bytes.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

use crate::delta::manifest::{SignatureError, TrustPolicy};

const ANCHOR_CONTEXT: &[u8] = b"starling anchor v1\0";

/// The signed description of one anchor file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnchorSeal {
    pub version: u64,
    pub size: u64,
    pub hash: [u8; 32],
    /// Signature over the context, the model id and the fields above.
    pub signature: [u8; 64],
}

fn message(model_id: &str, version: u64, size: u64, hash: &[u8; 32]) -> Vec<u8> {
    let mut m = Vec::with_capacity(ANCHOR_CONTEXT.len() + model_id.len() + 56);
    m.extend_from_slice(ANCHOR_CONTEXT);
    m.extend_from_slice(&(model_id.len() as u64).to_le_bytes());
    m.extend_from_slice(model_id.as_bytes());
    m.extend_from_slice(&version.to_le_bytes());
    m.extend_from_slice(&size.to_le_bytes());
    m.extend_from_slice(hash);
    m
}

impl AnchorSeal {
    /// Seals an anchor of `model_id` at `version` whose file has `size` bytes and BLAKE3
    /// `hash`.
    pub fn sign(key: &SigningKey, model_id: &str, version: u64, size: u64, hash: [u8; 32]) -> Self {
        let signature = key
            .sign(&message(model_id, version, size, &hash))
            .to_bytes();
        Self {
            version,
            size,
            hash,
            signature,
        }
    }

    /// Checks the signature under `policy`. With [`TrustPolicy::AnySigner`] there is no key
    /// to check against, so an anchor is refused: a full checkpoint replaces everything a
    /// receiver holds, and is only taken from a known signer.
    pub fn verify(&self, model_id: &str, policy: &TrustPolicy) -> Result<(), SignatureError> {
        let TrustPolicy::Keys(keys) = policy else {
            return Err(SignatureError::Unsigned);
        };
        let m = message(model_id, self.version, self.size, &self.hash);
        let sig = Signature::from_bytes(&self.signature);
        if keys
            .iter()
            .any(|k: &VerifyingKey| k.verify(&m, &sig).is_ok())
        {
            Ok(())
        } else {
            Err(SignatureError::Invalid)
        }
    }
}

/// A seal as stored beside its anchor file: version, size (u64 LE each), hash, signature.
pub const SEAL_LEN: usize = 8 + 8 + 32 + 64;

impl AnchorSeal {
    /// The seal's stored form ([`SEAL_LEN`] bytes).
    pub fn to_bytes(&self) -> [u8; SEAL_LEN] {
        let mut b = [0u8; SEAL_LEN];
        b[0..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        b[16..48].copy_from_slice(&self.hash);
        b[48..].copy_from_slice(&self.signature);
        b
    }

    /// Reads a stored seal; `None` unless `b` is exactly [`SEAL_LEN`] bytes. Says nothing of
    /// the signature: [`AnchorSeal::verify`] it.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let b: &[u8; SEAL_LEN] = b.try_into().ok()?;
        let (version, rest) = b.split_at(8);
        let (size, rest) = rest.split_at(8);
        let (hash, signature) = rest.split_at(32);
        Some(Self {
            version: u64::from_le_bytes(version.try_into().ok()?),
            size: u64::from_le_bytes(size.try_into().ok()?),
            hash: hash.try_into().ok()?,
            signature: signature.try_into().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_verifies_only_for_its_model_fields_and_key() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let other = SigningKey::from_bytes(&[8; 32]);
        let trust = TrustPolicy::Keys(vec![key.verifying_key()]);
        let seal = AnchorSeal::sign(&key, "m", 10, 1234, [3; 32]);
        assert_eq!(seal.verify("m", &trust), Ok(()));
        assert_eq!(seal.verify("n", &trust), Err(SignatureError::Invalid));
        for tampered in [
            AnchorSeal {
                version: 11,
                ..seal
            },
            AnchorSeal { size: 1235, ..seal },
            AnchorSeal {
                hash: [4; 32],
                ..seal
            },
        ] {
            assert_eq!(tampered.verify("m", &trust), Err(SignatureError::Invalid));
        }
        let forged = AnchorSeal::sign(&other, "m", 10, 1234, [3; 32]);
        assert_eq!(forged.verify("m", &trust), Err(SignatureError::Invalid));
        assert_eq!(
            seal.verify("m", &TrustPolicy::AnySigner),
            Err(SignatureError::Unsigned)
        );
    }

    #[test]
    fn a_seal_survives_its_stored_form_and_a_wrong_length_is_refused() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let seal = AnchorSeal::sign(&key, "m", 8, 1234, [9; 32]);
        assert_eq!(AnchorSeal::from_bytes(&seal.to_bytes()), Some(seal));
        assert_eq!(AnchorSeal::from_bytes(&seal.to_bytes()[1..]), None);
        assert_eq!(AnchorSeal::from_bytes(&[0; SEAL_LEN + 1]), None);
    }
}
