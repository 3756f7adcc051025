//! The delta checkpoint container (`.sdc`): a file header, then frames.
//!
//! ```text
//! file    = header frame* manifest-frame trailer-frame
//! header  = magic(8) = 89 'S' 'D' 'C' 0D 0A 1A 0A, format version u16 LE, flags u16 LE, reserved u32 LE
//! frame   = kind u8, body length u32 LE, body, BLAKE3(kind ‖ length ‖ body) (32 bytes)
//! ```
//! Segment frames come in the order they were encoded; the same frame bytes travel on the
//! wire, so a receiver verifies a segment exactly as a file reader does. The manifest frame
//! follows the segments (it names their hashes, which exist only once they are encoded);
//! the trailer frame points back at it for random access. See `docs/format.md`.

use std::collections::BTreeMap;

use crate::delta::manifest::{SignedManifest, TrustPolicy};
use crate::delta::segment::Segment;
use crate::error::DecodeError;
use crate::wire::Reader;

pub const MAGIC: [u8; 8] = [0x89, b'S', b'D', b'C', 0x0D, 0x0A, 0x1A, 0x0A];
pub const FORMAT_VERSION: u16 = 1;
pub const FILE_HEADER_LEN: usize = 16;
/// kind + length prefix.
pub const FRAME_HEADER_LEN: usize = 5;
pub const FRAME_HASH_LEN: usize = 32;
pub const FRAME_OVERHEAD: usize = FRAME_HEADER_LEN + FRAME_HASH_LEN;
/// Bound on a segment body (segments target 1–4 MB; anything far above is hostile).
pub const MAX_SEGMENT_BODY: usize = 64 << 20;
/// Bound on a manifest body (a trillion-parameter MoE has ~10⁵ tensors: a few MB).
pub const MAX_MANIFEST_BODY: usize = 256 << 20;
const TRAILER_BODY_LEN: usize = 20;
/// Total length of the trailer frame at the end of a file.
pub const TRAILER_FRAME_LEN: usize = FRAME_OVERHEAD + TRAILER_BODY_LEN;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Segment = 1,
    Manifest = 2,
    Trailer = 3,
}

impl FrameKind {
    pub fn from_id(id: u8) -> Result<Self, DecodeError> {
        match id {
            1 => Ok(Self::Segment),
            2 => Ok(Self::Manifest),
            3 => Ok(Self::Trailer),
            id => Err(DecodeError::UnknownCodec {
                what: "frame kind",
                id,
            }),
        }
    }

    fn max_body(self) -> usize {
        match self {
            Self::Segment => MAX_SEGMENT_BODY,
            Self::Manifest => MAX_MANIFEST_BODY,
            Self::Trailer => TRAILER_BODY_LEN,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Segment => "segment frame",
            Self::Manifest => "manifest frame",
            Self::Trailer => "trailer frame",
        }
    }
}

/// The 16-byte file header.
pub fn file_header() -> [u8; FILE_HEADER_LEN] {
    let mut h = [0u8; FILE_HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h
}

/// Checks a file header.
pub fn check_file_header(b: &[u8]) -> Result<(), DecodeError> {
    if b.len() < FILE_HEADER_LEN {
        return Err(DecodeError::Truncated {
            what: "file header",
        });
    }
    if b[..8] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let v = u16::from_le_bytes([b[8], b[9]]);
    if v != FORMAT_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            found: v,
            supported: FORMAT_VERSION,
        });
    }
    if b[10..16] != [0; 6] {
        return Err(DecodeError::malformed("file header", "unknown flags set"));
    }
    Ok(())
}

/// The hash a frame ends with (and the manifest names segments by).
pub fn frame_hash(kind: FrameKind, body: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&[kind as u8]);
    h.update(&(body.len() as u32).to_le_bytes());
    h.update(body);
    *h.finalize().as_bytes()
}

#[cfg(test)]
mod build_tests {
    use super::*;

    #[test]
    fn built_frames_equal_encoded_frames() {
        let (f, h) = build_frame(FrameKind::Segment, 4, |out| out.extend_from_slice(b"body"));
        assert_eq!(f, encode_frame(FrameKind::Segment, b"body"));
        assert_eq!(h, frame_hash(FrameKind::Segment, b"body"));
    }
}

/// Wraps a body into a frame.
///
/// # Panics
/// If the body exceeds the kind's bound (an encoder bug, never input).
pub fn encode_frame(kind: FrameKind, body: &[u8]) -> Vec<u8> {
    assert!(
        body.len() <= kind.max_body(),
        "{} body of {} bytes",
        kind.name(),
        body.len()
    );
    let mut out = Vec::with_capacity(body.len() + FRAME_OVERHEAD);
    out.push(kind as u8);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out.extend_from_slice(&frame_hash(kind, body));
    out
}

/// Builds a frame in place: `write_body` appends the body after a reserved header, then
/// the length is patched in and the hash appended (no second copy of the body).
///
/// # Panics
/// If the body exceeds the kind's bound (an encoder bug, never input).
pub fn build_frame(
    kind: FrameKind,
    capacity: usize,
    write_body: impl FnOnce(&mut Vec<u8>),
) -> (Vec<u8>, [u8; 32]) {
    let mut out = Vec::with_capacity(capacity + FRAME_OVERHEAD);
    out.push(kind as u8);
    out.extend_from_slice(&[0; 4]);
    write_body(&mut out);
    let len = out.len() - FRAME_HEADER_LEN;
    assert!(
        len <= kind.max_body(),
        "{} body of {len} bytes",
        kind.name()
    );
    out[1..5].copy_from_slice(&(len as u32).to_le_bytes());
    let hash = *blake3::hash(&out).as_bytes();
    out.extend_from_slice(&hash);
    (out, hash)
}

/// Parses a frame header (kind and body length), bounding the length by the kind.
/// Returns the kind and the total frame length: the cheap "is it all buffered?" check
/// before anything is allocated.
pub fn parse_frame_header(b: &[u8; FRAME_HEADER_LEN]) -> Result<(FrameKind, usize), DecodeError> {
    let kind = FrameKind::from_id(b[0])?;
    let len = u32::from_le_bytes([b[1], b[2], b[3], b[4]]) as usize;
    if len > kind.max_body() {
        return Err(DecodeError::TooLarge {
            what: kind.name(),
            value: len as u64,
            limit: kind.max_body() as u64,
        });
    }
    Ok((kind, FRAME_OVERHEAD + len))
}

/// A verified frame borrowed from a buffer.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    pub kind: FrameKind,
    pub body: &'a [u8],
    pub hash: [u8; 32],
}

impl Frame<'_> {
    pub fn total_len(&self) -> usize {
        self.body.len() + FRAME_OVERHEAD
    }
}

/// Parses and verifies one frame at the start of `buf`.
pub fn parse_frame(buf: &[u8]) -> Result<Frame<'_>, DecodeError> {
    let header: [u8; FRAME_HEADER_LEN] = buf
        .get(..FRAME_HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(DecodeError::Truncated {
            what: "frame header",
        })?;
    let (kind, total) = parse_frame_header(&header)?;
    if buf.len() < total {
        return Err(DecodeError::Truncated { what: kind.name() });
    }
    let body = &buf[FRAME_HEADER_LEN..total - FRAME_HASH_LEN];
    let mut hash = [0u8; 32];
    hash.copy_from_slice(&buf[total - FRAME_HASH_LEN..total]);
    if frame_hash(kind, body) != hash {
        return Err(DecodeError::HashMismatch { what: kind.name() });
    }
    Ok(Frame { kind, body, hash })
}

/// The trailer: where the manifest frame starts and how long it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    pub manifest_offset: u64,
    pub manifest_frame_len: u64,
    pub segment_count: u32,
}

impl Trailer {
    pub fn encode_frame(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(TRAILER_BODY_LEN);
        body.extend_from_slice(&self.manifest_offset.to_le_bytes());
        body.extend_from_slice(&self.manifest_frame_len.to_le_bytes());
        body.extend_from_slice(&self.segment_count.to_le_bytes());
        encode_frame(FrameKind::Trailer, &body)
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let t = Self {
            manifest_offset: r.u64_le("trailer")?,
            manifest_frame_len: r.u64_le("trailer")?,
            segment_count: r.u32_le("trailer")?,
        };
        r.finish("trailer")?;
        Ok(t)
    }
}

/// Collects the frames of one delta, in any order, and checks that they form a whole:
/// the state a streaming receiver keeps, and what a file reader uses after reading frames.
#[derive(Debug, Default)]
pub struct DeltaAssembler {
    manifest: Option<SignedManifest>,
    segments: BTreeMap<u32, (Segment, [u8; 32], u64)>,
    delta_id: Option<[u8; 32]>,
}

/// A verified, complete delta: every segment the manifest names, with matching hashes.
#[derive(Debug, Clone)]
pub struct Delta {
    pub manifest: SignedManifest,
    pub segments: Vec<Segment>,
}

impl DeltaAssembler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a verified frame. Segments of another delta and conflicting duplicates are
    /// refused; an identical duplicate is a no-op (retransmissions are harmless).
    pub fn add(&mut self, frame: Frame<'_>) -> Result<(), DecodeError> {
        match frame.kind {
            FrameKind::Segment => {
                let seg = Segment::decode_body(frame.body)?;
                self.check_delta_id(seg.delta_id)?;
                if let Some((_, h, _)) = self.segments.get(&seg.seq) {
                    if *h != frame.hash {
                        return Err(DecodeError::malformed(
                            "delta",
                            format!("two different segments numbered {}", seg.seq),
                        ));
                    }
                    return Ok(());
                }
                self.segments
                    .insert(seg.seq, (seg, frame.hash, frame.total_len() as u64));
            }
            FrameKind::Manifest => {
                let m = SignedManifest::decode_body(frame.body)?;
                self.check_delta_id(m.manifest.delta_id())?;
                if let Some(old) = &self.manifest
                    && old.bytes != m.bytes
                {
                    return Err(DecodeError::malformed("delta", "two different manifests"));
                }
                self.manifest = Some(m);
            }
            FrameKind::Trailer => {}
        }
        Ok(())
    }

    fn check_delta_id(&mut self, id: [u8; 32]) -> Result<(), DecodeError> {
        match self.delta_id {
            None => {
                self.delta_id = Some(id);
                Ok(())
            }
            Some(d) if d == id => Ok(()),
            Some(_) => Err(DecodeError::malformed(
                "delta",
                "frames of two different deltas",
            )),
        }
    }

    pub fn manifest(&self) -> Option<&SignedManifest> {
        self.manifest.as_ref()
    }

    /// Sequence numbers the manifest names that have not arrived (all, if no manifest yet).
    pub fn missing(&self) -> Vec<u32> {
        match &self.manifest {
            None => Vec::new(),
            Some(m) => m
                .manifest
                .segments
                .iter()
                .map(|s| s.seq)
                .filter(|s| !self.segments.contains_key(s))
                .collect(),
        }
    }

    /// Checks completeness and the signature, and returns the delta.
    pub fn finish(self, trust: &TrustPolicy) -> Result<Delta, AssembleError> {
        let manifest = self.manifest.ok_or(AssembleError::NoManifest)?;
        manifest.verify(trust).map_err(AssembleError::Signature)?;
        let m = &manifest.manifest;
        if self.segments.len() != m.segments.len() {
            let missing: Vec<u32> = m
                .segments
                .iter()
                .map(|s| s.seq)
                .filter(|s| !self.segments.contains_key(s))
                .collect();
            if missing.is_empty() {
                return Err(AssembleError::Decode(DecodeError::malformed(
                    "delta",
                    "segments the manifest does not name",
                )));
            }
            return Err(AssembleError::MissingSegments(missing));
        }
        let mut segments = Vec::with_capacity(self.segments.len());
        for (entry, (seq, (seg, hash, len))) in m.segments.iter().zip(self.segments) {
            if entry.seq != seq
                || entry.hash != hash
                || entry.frame_len != len
                || entry.changes != seg.changes()
            {
                return Err(AssembleError::Decode(DecodeError::malformed(
                    "delta",
                    format!("segment {seq} does not match the manifest"),
                )));
            }
            segments.push(seg);
        }
        Ok(Delta { manifest, segments })
    }
}

/// Why frames did not make a delta.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AssembleError {
    #[error("no manifest")]
    NoManifest,
    #[error("segments missing: {0:?}")]
    MissingSegments(Vec<u32>),
    #[error("refused manifest signature")]
    Signature(#[from] crate::delta::manifest::SignatureError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// The whole frames (header, body, hash) of a `.sdc` in memory, after its file header, each
/// one's hash checked: what a server re-offers from a stored delta.
pub fn split_frames(file: &[u8]) -> Result<Vec<&[u8]>, DecodeError> {
    check_file_header(file)?;
    let mut out = Vec::new();
    let mut at = FILE_HEADER_LEN;
    while at < file.len() {
        let len = parse_frame(&file[at..])?.total_len();
        out.push(&file[at..at + len]);
        at += len;
    }
    Ok(out)
}

/// Reads a whole `.sdc` from memory: header, every frame verified, trailer consistent,
/// then assembled and checked against the manifest.
pub fn read_delta(bytes: &[u8], trust: &TrustPolicy) -> Result<Delta, AssembleError> {
    check_file_header(bytes)?;
    let mut pos = FILE_HEADER_LEN;
    let mut asm = DeltaAssembler::new();
    let mut manifest_at: Option<(u64, u64)> = None;
    let mut segment_frames = 0u32;
    loop {
        let frame = parse_frame(&bytes[pos..])?;
        match frame.kind {
            FrameKind::Trailer => {
                let t = Trailer::decode_body(frame.body)?;
                if Some((t.manifest_offset, t.manifest_frame_len)) != manifest_at
                    || t.segment_count != segment_frames
                {
                    return Err(DecodeError::malformed(
                        "trailer",
                        "does not match the frames before it",
                    )
                    .into());
                }
                if pos + frame.total_len() != bytes.len() {
                    return Err(DecodeError::TrailingBytes {
                        what: "delta checkpoint",
                        trailing: bytes.len() - pos - frame.total_len(),
                    }
                    .into());
                }
                break;
            }
            FrameKind::Manifest => manifest_at = Some((pos as u64, frame.total_len() as u64)),
            FrameKind::Segment => segment_frames += 1,
        }
        pos += frame.total_len();
        asm.add(frame)?;
    }
    asm.finish(trust)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_golden_bytes() {
        let f = encode_frame(FrameKind::Trailer, &[0; 20]);
        assert_eq!(&f[..5], &[3, 20, 0, 0, 0]);
        assert_eq!(f.len(), TRAILER_FRAME_LEN);
        let parsed = parse_frame(&f).expect("parses");
        assert_eq!(parsed.body, &[0; 20]);
    }

    #[test]
    fn every_flipped_bit_and_every_truncation_of_a_frame_is_detected() {
        let f = encode_frame(FrameKind::Segment, b"some body bytes");
        for i in 0..f.len() {
            for bit in 0..8 {
                let mut g = f.clone();
                g[i] ^= 1 << bit;
                assert!(parse_frame(&g).is_err(), "flip at {i}:{bit}");
            }
        }
        for cut in 0..f.len() {
            assert!(parse_frame(&f[..cut]).is_err());
        }
    }

    #[test]
    fn oversized_lengths_are_refused_before_allocation() {
        let mut h = [1u8, 0, 0, 0, 0];
        h[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            parse_frame_header(&h),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn header_checks() {
        assert_eq!(check_file_header(&file_header()), Ok(()));
        let mut h = file_header();
        h[0] = b'P';
        assert_eq!(check_file_header(&h), Err(DecodeError::BadMagic));
        let mut h = file_header();
        h[8] = 9;
        assert!(matches!(
            check_file_header(&h),
            Err(DecodeError::UnsupportedVersion { found: 9, .. })
        ));
    }
}
