//! Staging and committing a delta: the receiver's side, as a transaction.
//!
//! **Staging** happens while the old version is still active: each verified segment is
//! decoded against the active (base) weights, into absolute new bits plus the old bits of
//! the same positions (the undo log), and its digest change is computed from them. Nothing
//! is written. The parts of a segment decode in parallel (rayon): they are independent, and
//! a base-conditioned part costs about a nanosecond per element of its range. Frames that
//! arrived together stage in one parallel map over all their segments' parts
//! (`Stager::stage_frames`), since one segment may hold fewer parts than a receiver has cores. **Sealing** checks the whole: manifest signature, every segment present with
//! the hash the manifest names, per-tensor change counts, base version and base digest, and
//! `pre + Σ changes = post`. **Committing** a sealed delta only overwrites bits (a scatter)
//! and can no longer fail; it returns the undo log so a caller whose engine-side update
//! fails can restore the exact previous bits. Applying twice is harmless (overwrite
//! semantics), and a commit against any other base is refused with both versions named.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use rayon::prelude::*;
use thiserror::Error;

use crate::delta::container::{Frame, FrameKind};
use crate::delta::digest::{DigestKey, StateDigest};
use crate::delta::manifest::{Manifest, SignatureError, SignedManifest, TrustPolicy, hex};
use crate::delta::segment::{CompactChanges, EncodedPart, Segment};
use crate::error::DecodeError;

/// Read and write access to BF16 tensors by name.
pub trait Weights {
    fn tensor(&self, name: &str) -> Option<&[u16]>;
    fn tensor_mut(&mut self, name: &str) -> Option<&mut [u16]>;
}

impl Weights for BTreeMap<String, Vec<u16>> {
    fn tensor(&self, name: &str) -> Option<&[u16]> {
        self.get(name).map(Vec::as_slice)
    }
    fn tensor_mut(&mut self, name: &str) -> Option<&mut [u16]> {
        self.get_mut(name).map(Vec::as_mut_slice)
    }
}

impl Weights for HashMap<String, Vec<u16>> {
    fn tensor(&self, name: &str) -> Option<&[u16]> {
        self.get(name).map(Vec::as_slice)
    }
    fn tensor_mut(&mut self, name: &str) -> Option<&mut [u16]> {
        self.get_mut(name).map(Vec::as_mut_slice)
    }
}

/// The digest of a whole weight set (a full pass; done once per anchor, not per delta).
pub fn full_digest<W: Weights>(model_id: &str, weights: &W, names: &[String]) -> StateDigest {
    let key = DigestKey::for_model(model_id);
    let mut total = StateDigest::default();
    for name in names {
        if let Some(t) = weights.tensor(name) {
            let tk = key.tensor(name);
            let d = t
                .par_chunks(1 << 20)
                .enumerate()
                .map(|(i, c)| tk.range((i << 20) as u64, c))
                .reduce(StateDigest::default, |mut a, b| {
                    a.merge(b);
                    a
                });
            total.merge(d);
        }
    }
    total
}

/// Why a delta could not be staged or sealed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum StageError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("segment belongs to another delta")]
    WrongDelta,
    #[error("segment {seq} arrived twice with different contents")]
    ConflictingSegment { seq: u32 },
    #[error("the delta names tensor {0}, which the base does not have")]
    UnknownTensor(String),
    #[error("part {start}..+{len} of tensor {tensor} runs past its {numel} elements")]
    RangeOutOfBounds {
        tensor: String,
        start: u64,
        len: u64,
        numel: u64,
    },
    #[error(
        "wrong base: the delta turns version {expected_version} (digest {expected_digest}) into a newer one, but the weights are at version {actual_version} (digest {actual_digest})"
    )]
    WrongBase {
        expected_version: u64,
        actual_version: u64,
        expected_digest: StateDigest,
        actual_digest: StateDigest,
    },
    #[error("the delta is for model {expected}, the weights are of model {actual}")]
    WrongModel { expected: String, actual: String },
    #[error("no manifest received")]
    NoManifest,
    #[error("segments missing: {0:?}")]
    MissingSegments(Vec<u32>),
    #[error("segment {seq} does not match the manifest ({detail})")]
    ManifestMismatch { seq: u32, detail: String },
    #[error("refused manifest")]
    Signature(#[from] SignatureError),
    #[error(
        "state digest after the delta would be {computed}, the manifest says {expected}: the base has drifted or the delta is corrupt"
    )]
    DigestMismatch {
        expected: StateDigest,
        computed: StateDigest,
    },
}

/// Decodes one part against its base range into absolute positions, new and old bits, and
/// its digest change.
fn stage_part(
    key: &DigestKey,
    p: &EncodedPart,
    range: &[u16],
    buffers: Option<&StagingBuffers>,
) -> Result<(StagedPart, StateDigest), StageError> {
    // `p.changes` is the sender's word: it only picks among vectors already held.
    let mut changes = buffers.map_or_else(CompactChanges::default, |b| {
        b.take(usize::try_from(p.changes).unwrap_or(usize::MAX))
    });
    p.decode_changes_compact_into(range, &mut changes)?;
    let CompactChanges {
        positions,
        new,
        old,
    } = changes;
    if positions.len() as u64 != p.changes {
        return Err(DecodeError::malformed(
            "part",
            format!(
                "{} changes decoded, {} declared",
                positions.len(),
                p.changes
            ),
        )
        .into());
    }
    let digest = key.tensor(&p.tensor).delta(p.start, &positions, &old, &new);
    Ok((
        StagedPart {
            tensor: p.tensor.clone(),
            start: p.start,
            positions,
            new,
            old,
        },
        digest,
    ))
}

/// The staged changes of one part: where it starts in the tensor, positions relative to that
/// (a part covers at most 2²⁶ elements, so 4 bytes each), new and old bits.
#[derive(Debug, Clone)]
struct StagedPart {
    tensor: String,
    start: u64,
    positions: Vec<u32>,
    new: Vec<u16>,
    old: Vec<u16>,
}

#[derive(Debug)]
struct StagedSegment {
    hash: [u8; 32],
    frame_len: u64,
    changes: u64,
    per_tensor: Vec<(String, u64)>,
    parts: Vec<StagedPart>,
    digest_delta: StateDigest,
}

/// The receiver's staging area for the next version on top of a known base.
#[derive(Debug)]
pub struct Stager {
    model_id: String,
    base_version: u64,
    base_digest: StateDigest,
    key: DigestKey,
    delta_id: Option<[u8; 32]>,
    manifest: Option<SignedManifest>,
    segments: BTreeMap<u32, StagedSegment>,
    buffers: Option<Arc<StagingBuffers>>,
}

impl Stager {
    /// Stages on top of weights of `model_id` at `base_version` with `base_digest`.
    pub fn new(model_id: &str, base_version: u64, base_digest: StateDigest) -> Self {
        Self {
            model_id: model_id.to_owned(),
            base_version,
            base_digest,
            key: DigestKey::for_model(model_id),
            delta_id: None,
            manifest: None,
            segments: BTreeMap::new(),
            buffers: None,
        }
    }

    /// Stages into vectors taken from `buffers` (what an earlier version's undo log handed
    /// back) before allocating new ones.
    pub fn with_buffers(mut self, buffers: Arc<StagingBuffers>) -> Self {
        self.buffers = Some(buffers);
        self
    }

    fn check_delta_id(&mut self, id: [u8; 32]) -> Result<(), StageError> {
        match self.delta_id {
            None => self.delta_id = Some(id),
            Some(d) if d != id => return Err(StageError::WrongDelta),
            Some(_) => {}
        }
        Ok(())
    }

    /// Stages one verified frame (segment or manifest; trailers are ignored). `base` must be
    /// the weights this stager was created for. A repeated identical segment is a no-op.
    pub fn stage_frame<W: Weights>(
        &mut self,
        frame: Frame<'_>,
        base: &W,
    ) -> Result<(), StageError> {
        match frame.kind {
            FrameKind::Segment => {
                let seg = Segment::decode_body(frame.body)?;
                self.stage_segment(&seg, frame.hash, frame.total_len() as u64, base)
            }
            FrameKind::Manifest => self.stage_manifest(SignedManifest::decode_body(frame.body)?),
            FrameKind::Trailer => Ok(()),
        }
    }

    /// Takes the manifest: checks that it is for this model and this base.
    pub fn stage_manifest(&mut self, m: SignedManifest) -> Result<(), StageError> {
        let man = &m.manifest;
        if man.model_id != self.model_id {
            return Err(StageError::WrongModel {
                expected: man.model_id.clone(),
                actual: self.model_id.clone(),
            });
        }
        if man.base_version != self.base_version || man.pre_digest != self.base_digest {
            return Err(StageError::WrongBase {
                expected_version: man.base_version,
                actual_version: self.base_version,
                expected_digest: man.pre_digest,
                actual_digest: self.base_digest,
            });
        }
        self.check_delta_id(man.delta_id())?;
        self.manifest = Some(m);
        Ok(())
    }

    /// Stages verified frames that arrived together, with the parts of all their segments
    /// decoded in one parallel map: a segment holds only as many parts as its bytes allow
    /// (about ten at 7.8% density and 2 MB), so a receiver with more cores than that idles on
    /// a segment at a time once frames queue up behind a slow staging. On success the stager
    /// holds what [`stage_frame`](Self::stage_frame) one by one leaves. On an error none of
    /// the batch's segments is staged; a manifest among them may be, and the delta id the
    /// first checks pinned stays (as it does one by one), so the error may name another frame
    /// than one by one would.
    pub fn stage_frames<W: Weights>(
        &mut self,
        frames: &[Frame<'_>],
        base: &W,
    ) -> Result<(), StageError> {
        let mut segments = Vec::with_capacity(frames.len());
        for frame in frames {
            match frame.kind {
                FrameKind::Segment => segments.push((
                    Segment::decode_body(frame.body)?,
                    frame.hash,
                    frame.total_len() as u64,
                )),
                FrameKind::Manifest => {
                    self.stage_manifest(SignedManifest::decode_body(frame.body)?)?;
                }
                FrameKind::Trailer => {}
            }
        }
        self.stage_segments(segments.iter().map(|(s, h, l)| (s, *h, *l)), base)
    }

    /// Decodes and stages one segment against `base`.
    pub fn stage_segment<W: Weights>(
        &mut self,
        seg: &Segment,
        hash: [u8; 32],
        frame_len: u64,
        base: &W,
    ) -> Result<(), StageError> {
        self.stage_segments([(seg, hash, frame_len)], base)
    }

    /// Stages segments (each with its frame's hash and length) against `base`, decoding the
    /// parts of all of them in parallel; all or none.
    fn stage_segments<'s, W: Weights>(
        &mut self,
        segments: impl IntoIterator<Item = (&'s Segment, [u8; 32], u64)>,
        base: &W,
    ) -> Result<(), StageError> {
        // The segments not staged yet, each once (a repeated identical one is a no-op, a
        // different one under a staged or batched number a conflict).
        let mut fresh: Vec<(&Segment, [u8; 32], u64)> = Vec::new();
        for (seg, hash, frame_len) in segments {
            self.check_delta_id(seg.delta_id)?;
            let known = self.segments.get(&seg.seq).map(|s| s.hash).or_else(|| {
                fresh
                    .iter()
                    .find(|(s, ..)| s.seq == seg.seq)
                    .map(|&(_, h, _)| h)
            });
            match known {
                Some(h) if h == hash => {}
                Some(_) => return Err(StageError::ConflictingSegment { seq: seg.seq }),
                None => fresh.push((seg, hash, frame_len)),
            }
        }
        // Locate every part's base range first (cheap, in order), then decode the parts in
        // parallel: decoding is the costly step (the base-conditioned mask codec scans its
        // whole range), and parts are independent.
        let parts = fresh.iter().flat_map(|(seg, ..)| &seg.parts);
        let mut ranges: Vec<&[u16]> = Vec::with_capacity(parts.clone().count());
        for p in parts.clone() {
            let tensor = base
                .tensor(&p.tensor)
                .ok_or_else(|| StageError::UnknownTensor(p.tensor.clone()))?;
            let numel = tensor.len() as u64;
            let end = p.start.checked_add(p.len).filter(|&e| e <= numel);
            let Some(end) = end else {
                return Err(StageError::RangeOutOfBounds {
                    tensor: p.tensor.clone(),
                    start: p.start,
                    len: p.len,
                    numel,
                });
            };
            ranges.push(&tensor[p.start as usize..end as usize]);
        }
        let (key, buffers) = (&self.key, self.buffers.as_deref());
        let parts: Vec<&EncodedPart> = parts.collect();
        let mut staged = parts
            .into_par_iter()
            .zip(ranges.into_par_iter())
            .map(|(p, range)| stage_part(key, p, range, buffers))
            .collect::<Result<Vec<(StagedPart, StateDigest)>, StageError>>()?
            .into_iter();
        for (seg, hash, frame_len) in fresh {
            let mut parts = Vec::with_capacity(seg.parts.len());
            let mut digest_delta = StateDigest::default();
            let mut per_tensor: Vec<(String, u64)> = Vec::new();
            // The segment's parts first: `zip` takes from its first iterator first, and a
            // staged part taken past the segment's end would be lost to the next segment.
            for (p, (part, d)) in seg.parts.iter().zip(staged.by_ref()) {
                digest_delta.merge(d);
                match per_tensor.last_mut() {
                    Some((t, n)) if *t == p.tensor => *n += p.changes,
                    _ => per_tensor.push((p.tensor.clone(), p.changes)),
                }
                parts.push(part);
            }
            self.segments.insert(
                seg.seq,
                StagedSegment {
                    hash,
                    frame_len,
                    changes: seg.changes(),
                    per_tensor,
                    parts,
                    digest_delta,
                },
            );
        }
        Ok(())
    }

    /// Changed elements in the segments staged so far.
    pub fn changes(&self) -> u64 {
        self.segments.values().map(|s| s.changes).sum()
    }

    /// Segments the manifest names that are not staged yet.
    pub fn missing(&self) -> Vec<u32> {
        self.manifest
            .as_ref()
            .map(|m| {
                m.manifest
                    .segments
                    .iter()
                    .map(|s| s.seq)
                    .filter(|s| !self.segments.contains_key(s))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn manifest(&self) -> Option<&SignedManifest> {
        self.manifest.as_ref()
    }

    /// Checks the staged delta as a whole and seals it for commit.
    pub fn seal(self, trust: &TrustPolicy) -> Result<SealedDelta, StageError> {
        let m = self.manifest.ok_or(StageError::NoManifest)?;
        m.verify(trust)?;
        let man = &m.manifest;
        let missing: Vec<u32> = man
            .segments
            .iter()
            .map(|s| s.seq)
            .filter(|s| !self.segments.contains_key(s))
            .collect();
        if !missing.is_empty() {
            return Err(StageError::MissingSegments(missing));
        }
        if self.segments.len() != man.segments.len() {
            let extra = self
                .segments
                .keys()
                .copied()
                .find(|&s| s as usize >= man.segments.len())
                .unwrap_or(0);
            return Err(StageError::ManifestMismatch {
                seq: extra,
                detail: "the manifest does not name it".into(),
            });
        }
        let mut per_tensor: HashMap<&str, u64> = HashMap::new();
        let mut digest = self.base_digest;
        for (entry, (seq, s)) in man.segments.iter().zip(&self.segments) {
            if entry.hash != s.hash || entry.frame_len != s.frame_len || entry.changes != s.changes
            {
                return Err(StageError::ManifestMismatch {
                    seq: *seq,
                    detail: "hash, length or change count differs".into(),
                });
            }
            for (t, n) in &s.per_tensor {
                *per_tensor.entry(t.as_str()).or_default() += n;
            }
            digest.merge(s.digest_delta);
        }
        for t in &man.tensors {
            let got = per_tensor.remove(t.name.as_str()).unwrap_or(0);
            if got != t.changes {
                return Err(StageError::Decode(DecodeError::malformed(
                    "delta",
                    format!(
                        "tensor {} has {got} staged changes, the manifest says {}",
                        t.name, t.changes
                    ),
                )));
            }
        }
        if let Some((t, _)) = per_tensor.into_iter().next() {
            return Err(StageError::Decode(DecodeError::malformed(
                "delta",
                format!("segments change tensor {t}, which the manifest does not list"),
            )));
        }
        if digest != man.post_digest {
            return Err(StageError::DigestMismatch {
                expected: man.post_digest,
                computed: digest,
            });
        }
        let manifest = m.manifest;
        let parts = self.segments.into_values().flat_map(|s| s.parts).collect();
        Ok(SealedDelta { manifest, parts })
    }
}

/// A fully verified delta, ready to commit on the base it was staged against.
#[derive(Debug)]
pub struct SealedDelta {
    manifest: Manifest,
    parts: Vec<StagedPart>,
}

impl SealedDelta {
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}

/// Weights together with the version and digest they are at: the only way to commit.
#[derive(Debug)]
pub struct VersionedWeights<W> {
    pub model_id: String,
    weights: W,
    version: u64,
    digest: StateDigest,
}

/// The vectors of staged parts, handed from one version's undo log to the next version's
/// staging ([`Stager::with_buffers`], [`StagingBuffers::recycle`]).
///
/// Without it an undo log is freed once its version is loaded, and whether the next version's
/// staging gets that memory back or faults the same amount of fresh, zeroed pages in (8 bytes
/// per change, a large share of staging's time; on a VM whose host takes back freed guest
/// memory, more than the decoding) is up to the allocator: glibc trims idle memory, mimalloc
/// purges it after about a second in some cases (`docs/benchmarks.md`). Held here, one
/// version's staging memory waits for the next.
#[derive(Debug, Default)]
pub struct StagingBuffers {
    /// Sets of vectors, empty, by increasing capacity of their positions.
    free: Mutex<Vec<CompactChanges>>,
}

impl StagingBuffers {
    pub fn new() -> Self {
        Self::default()
    }

    fn free(&self) -> std::sync::MutexGuard<'_, Vec<CompactChanges>> {
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The set whose positions hold `changes` with the least to spare, else new empty
    /// vectors (growing a held one would copy its stale bytes; it stays for another part).
    fn take(&self, changes: usize) -> CompactChanges {
        let mut free = self.free();
        let fits = free.partition_point(|c| c.positions.capacity() < changes);
        if fits < free.len() {
            free.remove(fits)
        } else {
            CompactChanges::default()
        }
    }

    /// Keeps the vectors of `log`'s parts for the next staging, in place of what was held:
    /// each at most 1.25× what its part used, so what stays held is about one version's
    /// staged changes. The next staging takes from it first; a part that none holds gets new
    /// vectors, and what it does not take stays held until the next `recycle`.
    pub fn recycle(&self, log: UndoLog) {
        self.keep(log.parts);
    }

    /// As [`recycle`](Self::recycle), for a sealed delta that will not be committed.
    pub fn recycle_sealed(&self, sealed: SealedDelta) {
        self.keep(sealed.parts);
    }

    fn keep(&self, parts: Vec<StagedPart>) {
        let mut sets: Vec<CompactChanges> = parts
            .into_iter()
            .map(|p| {
                let mut c = CompactChanges {
                    positions: p.positions,
                    new: p.new,
                    old: p.old,
                };
                // What is held tracks what the last version used: a vector that grew for
                // an earlier, denser version gives the excess back.
                let keep = c.positions.len() + c.positions.len() / 4;
                c.positions.clear();
                c.positions.shrink_to(keep);
                c.new.clear();
                c.new.shrink_to(keep);
                c.old.clear();
                c.old.shrink_to(keep);
                c
            })
            .collect();
        sets.sort_by_key(|c| c.positions.capacity());
        *self.free() = sets;
    }

    /// Bytes of vector capacity held.
    pub fn bytes(&self) -> usize {
        self.free()
            .iter()
            .map(|c| 4 * c.positions.capacity() + 2 * (c.new.capacity() + c.old.capacity()))
            .sum()
    }
}

/// What a commit replaced, to restore it if the engine-side update fails.
#[derive(Debug)]
pub struct UndoLog {
    version: u64,
    digest: StateDigest,
    parts: Vec<StagedPart>,
}

impl UndoLog {
    pub fn changes(&self) -> usize {
        self.parts.iter().map(|p| p.positions.len()).sum()
    }

    /// The version and digest the commit started from.
    pub fn base(&self) -> (u64, StateDigest) {
        (self.version, self.digest)
    }

    /// What the commit wrote, part by part: the tensor, the part's first flat position in it,
    /// the changed positions relative to that (ascending within a part; a tensor's parts
    /// cover disjoint ranges) and the new bits there. What an engine that holds its own copy
    /// of the weights needs to follow the commit sparsely.
    pub fn written(&self) -> impl Iterator<Item = (&str, u64, &[u32], &[u16])> {
        self.parts.iter().map(|p| {
            (
                p.tensor.as_str(),
                p.start,
                p.positions.as_slice(),
                p.new.as_slice(),
            )
        })
    }

    /// The change from `old` (version `version`, digest `digest`) to `new`, as a commit
    /// between them would have written it: one part per tensor whose bits differ. For a
    /// receiver that gets whole checkpoints (the no-transfer baseline) and an engine that
    /// follows sparsely. `None` when the two do not hold the same tensors at the same lengths.
    pub fn between(
        version: u64,
        digest: StateDigest,
        old: &BTreeMap<String, Vec<u16>>,
        new: &BTreeMap<String, Vec<u16>>,
    ) -> Option<Self> {
        if old.len() != new.len() {
            return None;
        }
        let mut parts = Vec::new();
        for ((name, a), (name_b, b)) in old.iter().zip(new) {
            if name != name_b || a.len() != b.len() {
                return None;
            }
            // One part per 2²⁶ elements, as a decoder's parts are at most that long.
            let span = crate::delta::segment::MAX_PART_ELEMS as usize;
            for (k, (a, b)) in a.chunks(span).zip(b.chunks(span)).enumerate() {
                let positions: Vec<u32> = (0..a.len())
                    .filter(|&i| a[i] != b[i])
                    .map(|i| i as u32)
                    .collect();
                if positions.is_empty() {
                    continue;
                }
                let new_bits = positions.iter().map(|&i| b[i as usize]).collect();
                let old_bits = positions.iter().map(|&i| a[i as usize]).collect();
                parts.push(StagedPart {
                    tensor: name.clone(),
                    start: (k * span) as u64,
                    positions,
                    new: new_bits,
                    old: old_bits,
                });
            }
        }
        Some(Self {
            version,
            digest,
            parts,
        })
    }
}

impl<W: Weights> VersionedWeights<W> {
    /// Wraps weights whose version and digest the caller vouches for (e.g. a verified
    /// anchor, whose digest was computed with [`full_digest`]).
    pub fn new(model_id: &str, weights: W, version: u64, digest: StateDigest) -> Self {
        Self {
            model_id: model_id.to_owned(),
            weights,
            version,
            digest,
        }
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn digest(&self) -> StateDigest {
        self.digest
    }

    pub fn weights(&self) -> &W {
        &self.weights
    }

    pub fn into_inner(self) -> W {
        self.weights
    }

    /// A stager for the next delta on top of these weights.
    pub fn stager(&self) -> Stager {
        Stager::new(&self.model_id, self.version, self.digest)
    }

    /// Applies a sealed delta: checks the base, then overwrites. Cannot half-apply: every
    /// check happens before the first write, and the writes cannot fail.
    pub fn commit(&mut self, sealed: SealedDelta) -> Result<UndoLog, StageError> {
        let m = &sealed.manifest;
        if m.model_id != self.model_id {
            return Err(StageError::WrongModel {
                expected: m.model_id.clone(),
                actual: self.model_id.clone(),
            });
        }
        if m.base_version != self.version || m.pre_digest != self.digest {
            return Err(StageError::WrongBase {
                expected_version: m.base_version,
                actual_version: self.version,
                expected_digest: m.pre_digest,
                actual_digest: self.digest,
            });
        }
        // Bounds were checked at staging against these very weights (same version and
        // digest), but check again: a commit must never panic halfway.
        for p in &sealed.parts {
            let numel = self
                .weights
                .tensor(&p.tensor)
                .map(<[u16]>::len)
                .ok_or_else(|| StageError::UnknownTensor(p.tensor.clone()))?;
            let end = p
                .positions
                .last()
                .map_or(p.start, |&l| p.start.saturating_add(u64::from(l) + 1));
            if end > numel as u64 {
                return Err(StageError::RangeOutOfBounds {
                    tensor: p.tensor.clone(),
                    start: p.start,
                    len: end - p.start,
                    numel: numel as u64,
                });
            }
        }
        for p in &sealed.parts {
            if let Some(t) = self.weights.tensor_mut(&p.tensor) {
                scatter(&mut t[p.start as usize..], &p.positions, &p.new);
            }
        }
        let undo = UndoLog {
            version: self.version,
            digest: self.digest,
            parts: sealed.parts,
        };
        self.version = m.version;
        self.digest = m.post_digest;
        Ok(undo)
    }

    /// Restores the bits, version and digest a commit replaced.
    pub fn rollback(&mut self, undo: UndoLog) {
        for p in &undo.parts {
            if let Some(t) = self.weights.tensor_mut(&p.tensor) {
                scatter(&mut t[p.start as usize..], &p.positions, &p.old);
            }
        }
        self.version = undo.version;
        self.digest = undo.digest;
    }
}

/// Overwrites `values` at `positions`. Positions were bounds-checked by the caller.
#[inline]
pub fn scatter<P: Copy + Into<u64>>(tensor: &mut [u16], positions: &[P], values: &[u16]) {
    for (&p, &v) in positions.iter().zip(values) {
        tensor[p.into() as usize] = v;
    }
}

/// Hex of a digest, for messages.
pub fn digest_hex(d: StateDigest) -> String {
    hex(&d.to_bytes())
}
