//! The streaming delta encoder.
//!
//! The caller feeds tensors in order, range by range (so a multi-GB tensor never has to be
//! in memory at once); the encoder diffs and codes fixed-size parts in parallel (rayon),
//! folds each part's digest change into the running post-state digest, packs parts into
//! segments of about [`EncoderConfig::segment_target_bytes`], and hands back every segment
//! frame **as soon as it is full**, so that it can be written or sent while later tensors
//! are still being diffed. `finish` produces the signed manifest and the trailer.

use ed25519_dalek::SigningKey;
use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::delta::codec::IndexCodec;
use crate::delta::container::{
    FILE_HEADER_LEN, FrameKind, Trailer, build_frame, encode_frame, file_header,
};
use crate::delta::diff::{RangeDiff, count_nonfinite, diff_range_into, diff_range_ranked_into};
use crate::delta::digest::{DigestKey, StateDigest};
use crate::delta::manifest::{
    Dtype, Manifest, SegmentEntry, SignedManifest, TensorEntry, delta_id,
};
use crate::delta::segment::{
    CodecChoice, EncodedPart, MAX_PART_ELEMS, MAX_PARTS_PER_SEGMENT, Segment,
};

/// Knobs of the encoder.
#[derive(Debug, Clone)]
pub struct EncoderConfig {
    /// Elements per part: the unit of parallel diffing and of codec choice.
    pub part_elems: u64,
    /// A segment is closed once its parts' payloads reach this many bytes.
    pub segment_target_bytes: usize,
    pub choice: CodecChoice,
}

impl Default for EncoderConfig {
    fn default() -> Self {
        Self {
            part_elems: 1 << 22,
            segment_target_bytes: 2 << 20,
            choice: CodecChoice::default(),
        }
    }
}

/// What the delta starts from and turns into.
#[derive(Debug, Clone)]
pub struct DeltaHeader {
    pub model_id: String,
    pub base_version: u64,
    pub version: u64,
    pub created_unix_ms: u64,
    /// State digest of the base weights when known (the hub keeps it current in
    /// O(changes)); `None` makes the encoder compute it from the base ranges it is fed,
    /// in the same parallel pass as the diff.
    pub pre_digest: Option<StateDigest>,
}

/// A finished segment frame, ready to write or send.
#[derive(Debug, Clone)]
pub struct SegmentFrame {
    pub seq: u32,
    pub changes: u64,
    pub hash: [u8; 32],
    /// The whole frame (kind, length, body, hash).
    pub bytes: Vec<u8>,
}

/// What `finish` returns.
#[derive(Debug, Clone)]
pub struct FinishedDelta {
    /// Segments still pending at the end.
    pub segments: Vec<SegmentFrame>,
    pub manifest: SignedManifest,
    pub manifest_frame: Vec<u8>,
    pub trailer_frame: Vec<u8>,
}

thread_local! {
    /// Each worker's diff buffer, reused from part to part.
    static DIFF_BUF: std::cell::RefCell<RangeDiff> = std::cell::RefCell::new(RangeDiff::default());
}

/// A whole tensor in both versions, by name and shape.
#[derive(Debug, Clone)]
pub struct TensorPair<'a> {
    pub name: &'a str,
    pub shape: Vec<u64>,
    pub old: &'a [u16],
    pub new: &'a [u16],
}

/// One range of one tensor to encode.
#[derive(Debug)]
struct Work<'a> {
    tensor: usize,
    start: u64,
    old: &'a [u16],
    new: &'a [u16],
}

/// What encoding one part produced: its tensor (by index), the coded part (none when nothing
/// changed), the digest change, the base range's digest (when the encoder computes it) and the
/// NaN and ±Inf counts among the changed new bits.
struct PartOutcome {
    tensor: usize,
    part: Option<EncodedPart>,
    digest: StateDigest,
    pre: StateDigest,
    nonfinite: (u64, u64),
}

/// The encoder state of one delta.
#[derive(Debug)]
pub struct DeltaEncoder {
    cfg: EncoderConfig,
    header: DeltaHeader,
    key: DigestKey,
    delta_id: [u8; 32],
    /// Σ over changes of h(new) − h(old).
    change_digest: StateDigest,
    /// Digest of the base, when the encoder computes it.
    computed_pre: Option<StateDigest>,
    tensors: Vec<TensorEntry>,
    /// Element count fed so far for the current (last) tensor.
    fed: u64,
    pending: Vec<EncodedPart>,
    pending_bytes: usize,
    segments: Vec<SegmentEntry>,
    /// Bytes of the file so far (header + emitted frames), for the trailer.
    offset: u64,
    /// Per tensor (by index), changed elements whose new bits are NaN and ±Inf.
    nonfinite: BTreeMap<usize, (u64, u64)>,
}

/// A tensor with changed elements that became NaN or ±Inf
/// ([`DeltaEncoder::nonfinite_changes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteChanges {
    pub tensor: String,
    /// Changed elements whose new bits are a NaN (any payload, either sign).
    pub nan: u64,
    /// Changed elements whose new bits are +Inf or −Inf.
    pub inf: u64,
}

impl DeltaEncoder {
    pub fn new(header: DeltaHeader, mut cfg: EncoderConfig) -> Self {
        cfg.part_elems = cfg.part_elems.clamp(1, MAX_PART_ELEMS);
        let key = DigestKey::for_model(&header.model_id);
        let id = delta_id(
            &header.model_id,
            header.base_version,
            header.version,
            header.created_unix_ms,
        );
        Self {
            change_digest: StateDigest::default(),
            computed_pre: header.pre_digest.is_none().then(StateDigest::default),
            cfg,
            header,
            key,
            delta_id: id,
            tensors: Vec::new(),
            fed: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            segments: Vec::new(),
            offset: FILE_HEADER_LEN as u64,
            nonfinite: BTreeMap::new(),
        }
    }

    /// The tensors so far with changed elements whose new bits are NaN or ±Inf. A sender
    /// whose base is known to hold none has then checked the whole new checkpoint: an element
    /// that did not change kept its finite bits. Counted in the diff's own pass over the
    /// changes, so it costs no read of the checkpoint.
    pub fn nonfinite_changes(&self) -> Vec<NonFiniteChanges> {
        self.nonfinite
            .iter()
            .map(|(&t, &(nan, inf))| NonFiniteChanges {
                tensor: self.tensors[t].name.clone(),
                nan,
                inf,
            })
            .collect()
    }

    /// The 16-byte file header to write before the first frame.
    pub fn file_header(&self) -> [u8; FILE_HEADER_LEN] {
        file_header()
    }

    pub fn delta_id(&self) -> [u8; 32] {
        self.delta_id
    }

    /// Starts the next tensor. Tensors must come in strictly ascending name order.
    ///
    /// # Panics
    /// If names are not ascending or the previous tensor was not fed completely (caller
    /// bugs: the checkpoint reader sorts tensors and feeds whole ones).
    pub fn begin_tensor(&mut self, name: &str, shape: &[u64]) {
        if let Some(t) = self.tensors.last() {
            assert!(
                t.name.as_str() < name,
                "tensors must be fed in ascending name order"
            );
            assert_eq!(
                self.fed,
                t.numel(),
                "tensor {} was not fed completely",
                t.name
            );
        }
        self.tensors.push(TensorEntry {
            name: name.to_owned(),
            dtype: Dtype::Bf16,
            shape: shape.to_vec(),
            changes: 0,
            codec_mask: 0,
            segments: Vec::new(),
            post_blake3: None,
        });
        self.fed = 0;
    }

    /// Records the BLAKE3 of a begun tensor's new bytes (for anchors and audits).
    pub fn set_tensor_hash(&mut self, name: &str, hash: [u8; 32]) {
        if let Some(t) = self.tensors.iter_mut().rev().find(|t| t.name == name) {
            t.post_blake3 = Some(hash);
        }
    }

    /// Diffs and codes the next range of the current tensor (`old`, `new` equally long,
    /// continuing where the last call stopped) and returns the segments that filled up.
    ///
    /// # Panics
    /// If no tensor was begun, lengths differ, or the range runs past the tensor.
    pub fn push_range(&mut self, old: &[u16], new: &[u16]) -> Vec<SegmentFrame> {
        assert_eq!(
            old.len(),
            new.len(),
            "old and new ranges must be equally long"
        );
        let t = self.tensors.last().expect("begin_tensor before push_range");
        assert!(
            self.fed + old.len() as u64 <= t.numel(),
            "range runs past tensor {}",
            t.name
        );
        let work = vec![Work {
            tensor: self.tensors.len() - 1,
            start: self.fed,
            old,
            new,
        }];
        self.fed += old.len() as u64;
        self.encode_work(work)
    }

    /// Diffs and codes several *whole* tensors at once, in parallel across tensors as well
    /// as within them (many small tensors would otherwise leave cores idle). Names must be
    /// ascending and follow the tensors fed before.
    ///
    /// # Panics
    /// As [`begin_tensor`](Self::begin_tensor) and [`push_range`](Self::push_range).
    pub fn push_tensors(&mut self, tensors: &[TensorPair<'_>]) -> Vec<SegmentFrame> {
        let mut work = Vec::new();
        for &TensorPair {
            name,
            ref shape,
            old,
            new,
        } in tensors
        {
            self.begin_tensor(name, shape);
            assert_eq!(
                old.len(),
                new.len(),
                "old and new ranges must be equally long"
            );
            assert_eq!(
                old.len() as u64,
                self.tensors.last().map_or(0, TensorEntry::numel),
                "tensor {name} is not whole"
            );
            self.fed = old.len() as u64;
            work.push(Work {
                tensor: self.tensors.len() - 1,
                start: 0,
                old,
                new,
            });
        }
        self.encode_work(work)
    }

    fn encode_work(&mut self, work: Vec<Work<'_>>) -> Vec<SegmentFrame> {
        let part = self.cfg.part_elems as usize;
        let choice = &self.cfg.choice;
        let compute_pre = self.computed_pre.is_some();
        // The exponent-class mask codec needs every change's rank in its class: count the
        // classes in the diff's own pass over the ranges.
        let ranked = choice
            .index
            .iter()
            .any(|c| matches!(c, IndexCodec::ExpClassGapsRc | IndexCodec::ExpClassGapsRans));
        let keys: Vec<_> = work
            .iter()
            .map(|w| self.key.tensor(&self.tensors[w.tensor].name))
            .collect();
        let names: Vec<&str> = work
            .iter()
            .map(|w| self.tensors[w.tensor].name.as_str())
            .collect();
        // Flatten into (work item, part) jobs so small tensors and big ones share the pool.
        let jobs: Vec<(usize, usize)> = work
            .iter()
            .enumerate()
            .flat_map(|(wi, w)| (0..w.old.len().div_ceil(part)).map(move |pi| (wi, pi)))
            .collect();
        // One part per task: rayon's adaptive splitting otherwise leaves runs of parts that
        // one thread works through while the others, with nothing left to steal, idle.
        let results: Vec<PartOutcome> = jobs
            .par_iter()
            .with_max_len(1)
            .map(|&(wi, pi)| {
                let w = &work[wi];
                let lo = pi * part;
                let hi = (lo + part).min(w.old.len());
                let (o, n) = (&w.old[lo..hi], &w.new[lo..hi]);
                let s = w.start + lo as u64;
                let tkey = &keys[wi];
                let pre = if compute_pre {
                    tkey.range(s, o)
                } else {
                    StateDigest::default()
                };
                DIFF_BUF.with(|buf| {
                    let d = &mut *buf.borrow_mut();
                    if ranked {
                        diff_range_ranked_into(o, n, d);
                    } else {
                        diff_range_into(o, n, d);
                    }
                    if d.is_empty() {
                        return PartOutcome {
                            tensor: w.tensor,
                            part: None,
                            digest: StateDigest::default(),
                            pre,
                            nonfinite: (0, 0),
                        };
                    }
                    PartOutcome {
                        tensor: w.tensor,
                        digest: tkey.delta(s, &d.positions, &d.old, &d.new),
                        nonfinite: count_nonfinite(&d.new),
                        part: Some(EncodedPart::encode(names[wi], s, o, n, d, choice)),
                        pre,
                    }
                })
            })
            .collect();
        let mut out = Vec::new();
        for PartOutcome {
            tensor: ti,
            part: p,
            digest: d,
            pre,
            nonfinite: (nan, inf),
        } in results
        {
            if let Some(c) = self.computed_pre.as_mut() {
                c.merge(pre);
            }
            if nan + inf > 0 {
                let e = self.nonfinite.entry(ti).or_default();
                *e = (e.0 + nan, e.1 + inf);
            }
            let Some(p) = p else { continue };
            self.change_digest.merge(d);
            let t = &mut self.tensors[ti];
            t.changes += p.changes;
            t.codec_mask |= p.codec_mask();
            self.pending_bytes += p.payload_len() + p.tensor.len() + 32;
            self.pending.push(p);
            if self.pending_bytes >= self.cfg.segment_target_bytes
                || self.pending.len() as u64 >= MAX_PARTS_PER_SEGMENT
            {
                out.push(self.close_segment());
            }
        }
        out
    }

    fn close_segment(&mut self) -> SegmentFrame {
        let seq = self.segments.len() as u32;
        let parts = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        for p in &parts {
            let t = self
                .tensors
                .iter_mut()
                .rev()
                .find(|t| t.name == p.tensor)
                .expect("parts belong to begun tensors");
            if t.segments.last() != Some(&seq) {
                t.segments.push(seq);
            }
        }
        let seg = Segment {
            delta_id: self.delta_id,
            seq,
            parts,
        };
        let changes = seg.changes();
        let (bytes, hash) = build_frame(FrameKind::Segment, seg.body_len_hint(), |out| {
            seg.write_body(out)
        });
        self.segments.push(SegmentEntry {
            seq,
            frame_len: bytes.len() as u64,
            changes,
            hash,
        });
        self.offset += bytes.len() as u64;
        SegmentFrame {
            seq,
            changes,
            hash,
            bytes,
        }
    }

    /// Closes the last segment and produces the signed manifest and the trailer.
    pub fn finish(mut self, signing_key: Option<&SigningKey>) -> FinishedDelta {
        if let Some(t) = self.tensors.last() {
            assert_eq!(
                self.fed,
                t.numel(),
                "tensor {} was not fed completely",
                t.name
            );
        }
        let mut segments = Vec::new();
        if !self.pending.is_empty() {
            segments.push(self.close_segment());
        }
        let pre_digest = self
            .header
            .pre_digest
            .or(self.computed_pre)
            .unwrap_or_default();
        let mut post_digest = pre_digest;
        post_digest.merge(self.change_digest);
        let manifest = Manifest {
            model_id: self.header.model_id,
            base_version: self.header.base_version,
            version: self.header.version,
            created_unix_ms: self.header.created_unix_ms,
            pre_digest,
            post_digest,
            tensors: self.tensors,
            segments: self.segments,
        };
        let signed = SignedManifest::sign(manifest, signing_key);
        let manifest_frame = encode_frame(FrameKind::Manifest, &signed.encode_body());
        let trailer_frame = Trailer {
            manifest_offset: self.offset,
            manifest_frame_len: manifest_frame.len() as u64,
            segment_count: signed.manifest.segments.len() as u32,
        }
        .encode_frame();
        FinishedDelta {
            segments,
            manifest: signed,
            manifest_frame,
            trailer_frame,
        }
    }
}

/// Encodes a whole in-memory model pair into `.sdc` bytes (tests, benches, small tools).
/// Tensors may come in any order.
pub fn encode_in_memory(
    header: DeltaHeader,
    cfg: EncoderConfig,
    tensors: &[TensorPair<'_>],
    signing_key: Option<&SigningKey>,
) -> (Vec<u8>, SignedManifest) {
    let mut batch = tensors.to_vec();
    batch.sort_by_key(|t| t.name);
    let mut enc = DeltaEncoder::new(header, cfg);
    let mut out = enc.file_header().to_vec();
    for f in enc.push_tensors(&batch) {
        out.extend_from_slice(&f.bytes);
    }
    let fin = enc.finish(signing_key);
    for f in &fin.segments {
        out.extend_from_slice(&f.bytes);
    }
    out.extend_from_slice(&fin.manifest_frame);
    out.extend_from_slice(&fin.trailer_frame);
    (out, fin.manifest)
}

/// Pairs every tensor of two name → bits maps as 1-D tensors (tests, benches, tools).
pub fn flat_pairs<'a>(
    old: &'a std::collections::BTreeMap<String, Vec<u16>>,
    new: &'a std::collections::BTreeMap<String, Vec<u16>>,
) -> Vec<TensorPair<'a>> {
    old.iter()
        .filter_map(|(n, o)| {
            new.get(n).map(|v| TensorPair {
                name: n,
                shape: vec![o.len() as u64],
                old: o,
                new: v,
            })
        })
        .collect()
}
