//! Delta checkpoints on disk: diff two checkpoints into a `.sdc`, read one frame by frame,
//! verify or apply one to a checkpoint.
//!
//! The diff streams: each tensor is taken in chunks from both checkpoints (in place from
//! their mappings), fed to the encoder, and every finished segment frame is written to the
//! output at once, so memory stays at a few chunks whatever the model size. The output is atomic: after any
//! error no `.sdc` (and no partial safetensors from `apply`) exists at the destination.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use ed25519_dalek::SigningKey;
use rayon::prelude::*;
use starling_proto::delta::apply::{StageError, VersionedWeights, full_digest};
use starling_proto::delta::container::{
    FILE_HEADER_LEN, FRAME_HEADER_LEN, Frame, FrameKind, Trailer, check_file_header, file_header,
    frame_hash, parse_frame, parse_frame_header,
};
use starling_proto::delta::digest::{DigestKey, StateDigest};
use starling_proto::delta::encode::{
    DeltaEncoder, DeltaHeader, EncoderConfig, NonFiniteChanges, TensorPair,
};
use starling_proto::delta::manifest::{Manifest, TrustPolicy, hex};
use starling_proto::delta::segment::MAX_PART_ELEMS;
use starling_proto::{DecodeError, delta::manifest::SignedManifest};
use thiserror::Error;

use crate::safetensors::{Checkpoint, CheckpointError, TensorInfo};
use crate::writer::{AtomicFile, SafetensorsWriter};

/// Why a delta operation failed.
#[derive(Debug, Error)]
pub enum DeltaFileError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("delta file {path}")]
    Decode {
        path: PathBuf,
        #[source]
        source: DecodeError,
    },
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error("tensor {name} after the delta has BLAKE3 {actual}, the manifest says {expected}")]
    TensorHashMismatch {
        name: String,
        expected: String,
        actual: String,
    },
    /// [`DiffOptions::refuse_nonfinite_changes`]: changed elements became NaN or ±Inf. The
    /// manifest was not written, so no receiver can commit what was emitted before.
    #[error("{} tensor(s) have changed elements that became NaN or ±Inf", .0.len())]
    NonFinite(Vec<NonFiniteChanges>),
}

/// Options of a diff.
#[derive(Debug, Clone)]
pub struct DiffOptions {
    pub model_id: String,
    pub base_version: u64,
    pub version: u64,
    pub created_unix_ms: u64,
    pub encoder: EncoderConfig,
    /// Elements read and encoded per window (a batch of small tensors or a chunk of a large
    /// one): address space ≈ 4 bytes × this, plus encoder buffers. `None` sizes it to the
    /// thread pool ([`window_elems`]); tests set it small to exercise chunking. A large
    /// tensor's parts restart at each window, so a window that is not a whole number of
    /// parts changes the delta's bytes (never what it decodes to).
    pub chunk_elems: Option<usize>,
    /// Record each new tensor's BLAKE3 in the manifest (for audits; costs a hash pass).
    pub tensor_hashes: bool,
    pub signing_key: Option<SigningKey>,
    /// The base's state digest when the caller knows it (the hub chains each manifest's
    /// post digest); `None` makes the encoder hash every base element on the way.
    pub pre_digest: Option<StateDigest>,
    /// Fail with [`DeltaFileError::NonFinite`], before the manifest, when a changed element
    /// became NaN or ±Inf. For a base known to hold none this checks the whole new checkpoint
    /// in the diff's own pass: the hub's publish uses it instead of a separate scan.
    pub refuse_nonfinite_changes: bool,
}

impl DiffOptions {
    pub fn new(model_id: &str, base_version: u64, version: u64, created_unix_ms: u64) -> Self {
        Self {
            model_id: model_id.to_owned(),
            base_version,
            version,
            created_unix_ms,
            encoder: EncoderConfig::default(),
            chunk_elems: None,
            tensor_hashes: true,
            signing_key: None,
            pre_digest: None,
            refuse_nonfinite_changes: false,
        }
    }
}

/// What a diff produced.
#[derive(Debug, Clone)]
pub struct DiffSummary {
    pub manifest: Manifest,
    pub signed: bool,
    pub delta_bytes: u64,
    pub dense_bf16_bytes: u64,
}

/// Writes frames to the caller's sink and counts the bytes.
struct Emitter<'s> {
    sink: &'s mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    written: u64,
}

impl Emitter<'_> {
    fn emit(&mut self, b: &[u8]) -> Result<(), DeltaFileError> {
        self.written += b.len() as u64;
        (self.sink)(b).map_err(|source| DeltaFileError::Io {
            op: "write",
            path: PathBuf::from("<delta output>"),
            source,
        })
    }
}

/// A range of one tensor in BF16 bits: borrowed from the checkpoint's mapping when it can be,
/// else read into an owned buffer.
fn bf16_range<'c>(
    ckpt: &'c Checkpoint,
    t: &TensorInfo,
    start: u64,
    len: usize,
) -> Result<Cow<'c, [u16]>, CheckpointError> {
    if let Some(s) = ckpt.bf16_range(t, start, len) {
        return Ok(Cow::Borrowed(s));
    }
    let mut v = vec![0u16; len];
    ckpt.read_bf16(t, start, &mut v)?;
    Ok(Cow::Owned(v))
}

/// A small tensor, whole in both checkpoints, waiting to be encoded with others.
struct WholeTensor<'c> {
    old_info: &'c TensorInfo,
    new_info: &'c TensorInfo,
    old: Cow<'c, [u16]>,
    new: Cow<'c, [u16]>,
}

/// Encodes a batch of whole tensors in parallel (hashing the new tensors alongside) and
/// emits the segments that filled up.
fn flush_batch(
    batch: &mut Vec<WholeTensor<'_>>,
    (old, new): (&Checkpoint, &Checkpoint),
    enc: &mut DeltaEncoder,
    out: &mut Emitter<'_>,
    hashes: bool,
) -> Result<(), DeltaFileError> {
    let pairs: Vec<TensorPair<'_>> = batch
        .iter()
        .map(|t| TensorPair {
            name: &t.new_info.name,
            shape: t.new_info.shape.clone(),
            old: &t.old,
            new: &t.new,
        })
        .collect();
    let (frames, digests) = rayon::join(
        || enc.push_tensors(&pairs),
        || {
            hashes.then(|| {
                batch
                    .par_iter()
                    .map(|t| *blake3::hash(bytemuck::cast_slice(&t.new)).as_bytes())
                    .collect::<Vec<_>>()
            })
        },
    );
    for f in frames {
        out.emit(&f.bytes)?;
    }
    for (i, t) in batch.iter().enumerate() {
        if let Some(d) = &digests {
            enc.set_tensor_hash(&t.new_info.name, d[i]);
        }
    }
    for t in batch.drain(..) {
        let len = t.new.len();
        drop((t.old, t.new));
        old.release(t.old_info, 0, len);
        new.release(t.new_info, 0, len);
    }
    Ok(())
}

/// Parts each pool thread gets per window when [`DiffOptions::chunk_elems`] is `None`.
///
/// The encoder waits for a window's last part before it reads the next window, so threads
/// that finish early idle until then: about half a part each. With this many parts per
/// thread that is a few percent of the window, where a fixed 16 M-element window (four 4 M
/// parts) left 12 of 16 threads idle on every large tensor.
pub const WINDOW_PARTS_PER_THREAD: usize = 8;

/// The largest window [`window_elems`] picks (2 GiB of BF16 per checkpoint), so that a
/// 100-thread hub still releases its mappings as it goes.
pub const MAX_WINDOW_ELEMS: usize = 1 << 30;

/// The smallest window [`window_elems`] picks: batches of small tensors are worth no less.
pub const MIN_WINDOW_ELEMS: usize = 1 << 24;

/// Elements per window of a diff on a pool of `threads`, with parts of `part_elems`:
/// [`WINDOW_PARTS_PER_THREAD`] parts per thread, within [`MIN_WINDOW_ELEMS`] ..=
/// [`MAX_WINDOW_ELEMS`], and a whole number of parts (at least one).
///
/// A large tensor's parts restart at each window, so a whole number of parts keeps the
/// delta's bytes the same on any pool: the window changes when the work waits, never what
/// is written.
pub fn window_elems(threads: usize, part_elems: u64) -> usize {
    Windows::for_pool(threads, part_elems, MIN_WINDOW_ELEMS, MAX_WINDOW_ELEMS).target
}

/// The encoder's part length for `part_elems` (it clamps it the same way).
fn part_len(part_elems: u64) -> usize {
    usize::try_from(part_elems.clamp(1, MAX_PART_ELEMS)).unwrap_or(usize::MAX)
}

/// `elems` rounded down to a whole number of parts of `part`, at least one.
fn on_part_grid(elems: usize, part: usize) -> usize {
    (elems / part).max(1).saturating_mul(part)
}

/// The windows of one diff, in order. With [`DiffOptions::chunk_elems`] set, all of that
/// size. Sized to the pool, they start at [`MIN_WINDOW_ELEMS`] (on the part grid), so the
/// first segment leaves as soon as with a fixed small window and relays and actors start on
/// it; once two such windows' worth is read they double up to [`window_elems`], so the
/// threads idle at fewer window ends while the pipeline runs.
struct Windows {
    size: usize,
    target: usize,
    /// Elements read after which the windows start to grow.
    grow_after: usize,
    read: usize,
}

impl Windows {
    fn new(opts: &DiffOptions) -> Self {
        match opts.chunk_elems {
            Some(c) => Self {
                size: c.max(1),
                target: c.max(1),
                grow_after: 0,
                read: 0,
            },
            None => Self::for_pool(
                rayon::current_num_threads(),
                opts.encoder.part_elems,
                MIN_WINDOW_ELEMS,
                MAX_WINDOW_ELEMS,
            ),
        }
    }

    /// Windows for a pool of `threads` and parts of `part_elems`, from `min` (and at least one
    /// part) growing to [`WINDOW_PARTS_PER_THREAD`] parts per thread within `min ..= max`.
    fn for_pool(threads: usize, part_elems: u64, min: usize, max: usize) -> Self {
        let part = part_len(part_elems);
        let target = on_part_grid(
            WINDOW_PARTS_PER_THREAD
                .saturating_mul(threads.max(1))
                .saturating_mul(part)
                .clamp(min, max),
            part,
        );
        let first = on_part_grid(min, part).min(target);
        Self {
            size: first,
            target,
            grow_after: first.saturating_mul(2),
            read: 0,
        }
    }

    fn size(&self) -> usize {
        self.size
    }

    /// After a window of `elems` elements: once `grow_after` are read, the next window is
    /// twice this one, up to the target.
    fn advance(&mut self, elems: usize) {
        self.read = self.read.saturating_add(elems);
        if self.read >= self.grow_after {
            self.size = self.size.saturating_mul(2).min(self.target);
        }
    }
}

/// Diffs `old` → `new` and streams the frames of the delta into `sink` as they are made
/// (file header first). `progress` is told the elements scanned so far. Returns the signed
/// manifest and the bytes written.
///
/// Tensors smaller than a read chunk are taken whole and encoded together, in parallel across
/// tensors; larger ones are streamed chunk by chunk (parallel within the chunk). BF16 tensors
/// are read in place from the checkpoints' mappings and released chunk by chunk, so memory
/// stays at a few chunks whatever the model size. The tensor hashes (BLAKE3 of each new
/// tensor) run beside the encoder, not before it.
pub fn diff_checkpoints(
    old: &Checkpoint,
    new: &Checkpoint,
    opts: &DiffOptions,
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    progress: &dyn Fn(u64),
) -> Result<(SignedManifest, u64), DeltaFileError> {
    diff_in_windows(old, new, opts, Windows::new(opts), sink, progress)
}

/// [`diff_checkpoints`] with these windows.
fn diff_in_windows(
    old: &Checkpoint,
    new: &Checkpoint,
    opts: &DiffOptions,
    mut windows: Windows,
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    progress: &dyn Fn(u64),
) -> Result<(SignedManifest, u64), DeltaFileError> {
    old.check_same_layout(new)?;
    let header = DeltaHeader {
        model_id: opts.model_id.clone(),
        base_version: opts.base_version,
        version: opts.version,
        created_unix_ms: opts.created_unix_ms,
        pre_digest: opts.pre_digest,
    };
    let mut enc = DeltaEncoder::new(header, opts.encoder.clone());
    let mut out = Emitter { sink, written: 0 };
    out.emit(&enc.file_header())?;
    let mut scanned = 0u64;
    let mut batch: Vec<WholeTensor<'_>> = Vec::new();
    let mut batch_elems = 0usize;
    let pair = (old, new);
    for (to, tn) in old.tensors().iter().zip(new.tensors()) {
        let numel = to.numel();
        let chunk = windows.size();
        if numel <= chunk as u64 {
            let n = numel as usize;
            batch.push(WholeTensor {
                old_info: to,
                new_info: tn,
                old: bf16_range(old, to, 0, n)?,
                new: bf16_range(new, tn, 0, n)?,
            });
            batch_elems += n;
            scanned += numel;
            if batch_elems >= chunk {
                flush_batch(&mut batch, pair, &mut enc, &mut out, opts.tensor_hashes)?;
                windows.advance(batch_elems);
                batch_elems = 0;
                progress(scanned);
            }
            continue;
        }
        if !batch.is_empty() {
            flush_batch(&mut batch, pair, &mut enc, &mut out, opts.tensor_hashes)?;
            windows.advance(batch_elems);
            batch_elems = 0;
        }
        enc.begin_tensor(&to.name, &to.shape);
        let mut hasher = opts.tensor_hashes.then(blake3::Hasher::new);
        let mut start = 0u64;
        while start < numel {
            let n = (numel - start).min(windows.size() as u64) as usize;
            let a = bf16_range(old, to, start, n)?;
            let b = bf16_range(new, tn, start, n)?;
            let (frames, ()) = rayon::join(
                || enc.push_range(&a, &b),
                || {
                    if let Some(h) = hasher.as_mut() {
                        h.update(bytemuck::cast_slice(&b));
                    }
                },
            );
            drop((a, b));
            old.release(to, start, n);
            new.release(tn, start, n);
            for f in frames {
                out.emit(&f.bytes)?;
            }
            start += n as u64;
            scanned += n as u64;
            windows.advance(n);
            progress(scanned);
        }
        if let Some(h) = hasher {
            enc.set_tensor_hash(&to.name, *h.finalize().as_bytes());
        }
    }
    flush_batch(&mut batch, pair, &mut enc, &mut out, opts.tensor_hashes)?;
    progress(scanned);
    if opts.refuse_nonfinite_changes {
        let bad = enc.nonfinite_changes();
        if !bad.is_empty() {
            return Err(DeltaFileError::NonFinite(bad));
        }
    }
    let fin = enc.finish(opts.signing_key.as_ref());
    for f in &fin.segments {
        out.emit(&f.bytes)?;
    }
    out.emit(&fin.manifest_frame)?;
    out.emit(&fin.trailer_frame)?;
    Ok((fin.manifest, out.written))
}

/// The state digest of a whole checkpoint under `model_id`'s key: what a delta from it
/// declares as its `pre_digest`. One parallel pass, read in place and released as it goes;
/// the hub runs it once for its initial snapshot and then chains each manifest's post digest.
pub fn checkpoint_digest(ckpt: &Checkpoint, model_id: &str) -> Result<StateDigest, DeltaFileError> {
    const CHUNK: usize = 1 << 22;
    let key = DigestKey::for_model(model_id);
    let mut total = StateDigest::default();
    for t in ckpt.tensors() {
        let tk = key.tensor(&t.name);
        let numel = t.numel();
        let mut start = 0u64;
        while start < numel {
            let n = (numel - start).min(16 * CHUNK as u64) as usize;
            let bits = bf16_range(ckpt, t, start, n)?;
            let d = bits
                .par_chunks(CHUNK)
                .enumerate()
                .map(|(i, c)| tk.range(start + (i * CHUNK) as u64, c))
                .reduce(StateDigest::default, |mut a, b| {
                    a.merge(b);
                    a
                });
            total.merge(d);
            drop(bits);
            ckpt.release(t, start, n);
            start += n as u64;
        }
    }
    Ok(total)
}

/// Diffs two checkpoints into a `.sdc` file, atomically.
pub fn diff_to_file(
    old: &Checkpoint,
    new: &Checkpoint,
    dest: &Path,
    opts: &DiffOptions,
    progress: &dyn Fn(u64),
) -> Result<DiffSummary, DeltaFileError> {
    let io = |op, source| DeltaFileError::Io {
        op,
        path: dest.to_owned(),
        source,
    };
    let mut out = AtomicFile::create(dest).map_err(|e| io("create", e))?;
    let (signed, delta_bytes) =
        diff_checkpoints(old, new, opts, &mut |b| out.write_all(b), progress)?;
    out.commit().map_err(|e| io("write", e))?;
    Ok(DiffSummary {
        dense_bf16_bytes: 2 * signed.manifest.total_elements(),
        signed: signed.is_signed(),
        manifest: signed.manifest,
        delta_bytes,
    })
}

/// Writes received wire frames (segments and a manifest, each a whole frame with its hash,
/// in any order) as a `.sdc` file, atomically: segments by sequence number, the manifest,
/// and a trailer that points at it. What relays cache and actors journal.
pub fn write_frames(dest: &Path, frames: &[&[u8]]) -> Result<u64, DeltaFileError> {
    let decode_err = |source| DeltaFileError::Decode {
        path: dest.to_owned(),
        source,
    };
    let io = |op, source| DeltaFileError::Io {
        op,
        path: dest.to_owned(),
        source,
    };
    let mut segments = Vec::new();
    let mut manifest = None;
    for f in frames {
        let frame = parse_frame(f).map_err(decode_err)?;
        match frame.kind {
            FrameKind::Segment => {
                let (_, seq) = starling_proto::delta::segment::Segment::peek_id(frame.body)
                    .map_err(decode_err)?;
                segments.push((seq, *f));
            }
            FrameKind::Manifest => manifest = Some(*f),
            FrameKind::Trailer => {}
        }
    }
    let manifest = manifest.ok_or_else(|| {
        decode_err(DecodeError::Truncated {
            what: "delta without its manifest",
        })
    })?;
    segments.sort_by_key(|(seq, _)| *seq);
    let mut out = AtomicFile::create(dest).map_err(|e| io("create", e))?;
    out.write_all(&file_header()).map_err(|e| io("write", e))?;
    let mut at = FILE_HEADER_LEN as u64;
    for (_, f) in &segments {
        out.write_all(f).map_err(|e| io("write", e))?;
        at += f.len() as u64;
    }
    out.write_all(manifest).map_err(|e| io("write", e))?;
    let trailer = Trailer {
        manifest_offset: at,
        manifest_frame_len: manifest.len() as u64,
        segment_count: segments.len() as u32,
    };
    let trailer = trailer.encode_frame();
    out.write_all(&trailer).map_err(|e| io("write", e))?;
    out.commit().map_err(|e| io("write", e))?;
    Ok(at + (manifest.len() + trailer.len()) as u64)
}

/// One frame read from a stream, owned.
#[derive(Debug, Clone)]
pub struct OwnedFrame {
    pub kind: FrameKind,
    pub body: Vec<u8>,
    pub hash: [u8; 32],
}

impl OwnedFrame {
    pub fn as_frame(&self) -> Frame<'_> {
        Frame {
            kind: self.kind,
            body: &self.body,
            hash: self.hash,
        }
    }
}

/// Reads and verifies the frames of a `.sdc` one at a time (bounded memory per frame).
#[derive(Debug)]
pub struct FrameReader<R> {
    r: R,
    done: bool,
    offset: u64,
    manifest_at: Option<(u64, u64)>,
    segments: u32,
}

impl<R: Read> FrameReader<R> {
    /// Reads and checks the file header.
    pub fn new(mut r: R) -> Result<Self, DecodeError> {
        let mut h = [0u8; FILE_HEADER_LEN];
        read_fully(&mut r, &mut h, "file header")?;
        check_file_header(&h)?;
        Ok(Self {
            r,
            done: false,
            offset: FILE_HEADER_LEN as u64,
            manifest_at: None,
            segments: 0,
        })
    }

    /// The next verified frame; `None` after a trailer that matches what came before it
    /// and is followed by nothing.
    pub fn next_frame(&mut self) -> Result<Option<OwnedFrame>, DecodeError> {
        if self.done {
            return Ok(None);
        }
        let mut h = [0u8; FRAME_HEADER_LEN];
        read_fully(&mut self.r, &mut h, "frame header")?;
        let (kind, total) = parse_frame_header(&h)?;
        let mut body = vec![0u8; total - FRAME_HEADER_LEN - 32];
        read_fully(&mut self.r, &mut body, "frame body")?;
        let mut hash = [0u8; 32];
        read_fully(&mut self.r, &mut hash, "frame hash")?;
        if frame_hash(kind, &body) != hash {
            return Err(DecodeError::HashMismatch { what: "frame" });
        }
        match kind {
            FrameKind::Segment => self.segments += 1,
            FrameKind::Manifest => self.manifest_at = Some((self.offset, total as u64)),
            FrameKind::Trailer => {
                let t = Trailer::decode_body(&body)?;
                if Some((t.manifest_offset, t.manifest_frame_len)) != self.manifest_at
                    || t.segment_count != self.segments
                {
                    return Err(DecodeError::Malformed {
                        what: "trailer",
                        detail: "does not match the frames before it".into(),
                    });
                }
                let mut extra = [0u8; 1];
                if self
                    .r
                    .read(&mut extra)
                    .map_err(|_| DecodeError::Truncated {
                        what: "end of file",
                    })?
                    != 0
                {
                    return Err(DecodeError::TrailingBytes {
                        what: "delta checkpoint",
                        trailing: 1,
                    });
                }
                self.done = true;
            }
        }
        self.offset += total as u64;
        Ok(Some(OwnedFrame { kind, body, hash }))
    }
}

fn read_fully(r: &mut impl Read, buf: &mut [u8], what: &'static str) -> Result<(), DecodeError> {
    r.read_exact(buf)
        .map_err(|_| DecodeError::Truncated { what })
}

/// A model in memory: tensor name → BF16 bits.
pub type Model = std::collections::BTreeMap<String, Vec<u16>>;

/// Result of verifying or applying a delta.
#[derive(Debug, Clone)]
pub struct ApplySummary {
    pub manifest: Manifest,
    pub changes: u64,
    pub post_digest: StateDigest,
    pub tensors_hash_checked: usize,
}

/// Stages, seals and commits `delta` on `base` in memory; returns the new weights.
pub fn apply_in_memory(
    base: &Checkpoint,
    delta: &Path,
    trust: &TrustPolicy,
    base_version: Option<u64>,
) -> Result<(VersionedWeights<Model>, ApplySummary), DeltaFileError> {
    // The manifest is the last frame but one; staging needs to know the model and base
    // first, so read every frame (each verified), then stage (segments are small next to
    // the model).
    let (manifest, segments) = read_manifest(delta)?;
    let model_id = manifest.manifest.model_id.clone();
    let weights = base.read_all()?;
    let names: Vec<String> = weights.keys().cloned().collect();
    let digest = full_digest(&model_id, &weights, &names);
    let version = base_version
        .or(base.version())
        .unwrap_or(manifest.manifest.base_version);
    let mut state = VersionedWeights::new(&model_id, weights, version, digest);
    let mut stager = state.stager();
    stager.stage_manifest(manifest)?;
    for f in &segments {
        stager.stage_frame(f.as_frame(), state.weights())?;
    }
    let sealed = stager.seal(trust)?;
    let m = sealed.manifest().clone();
    let undo = state.commit(sealed)?;
    // Audit: full BLAKE3 of every tensor the manifest carries a hash for.
    let mut checked = 0;
    for t in &m.tensors {
        if let (Some(expected), Some(data)) = (t.post_blake3, state.weights().get(&t.name)) {
            let actual = blake3::hash(bytemuck::cast_slice(data));
            if *actual.as_bytes() != expected {
                return Err(DeltaFileError::TensorHashMismatch {
                    name: t.name.clone(),
                    expected: hex(&expected),
                    actual: actual.to_hex().to_string(),
                });
            }
            checked += 1;
        }
    }
    let summary = ApplySummary {
        changes: undo.changes() as u64,
        post_digest: state.digest(),
        tensors_hash_checked: checked,
        manifest: m,
    };
    Ok((state, summary))
}

/// Applies `delta` to `base` and writes the result to `dest` atomically.
pub fn apply_to_file(
    base: &Checkpoint,
    delta: &Path,
    dest: &Path,
    trust: &TrustPolicy,
    base_version: Option<u64>,
) -> Result<ApplySummary, DeltaFileError> {
    let (state, summary) = apply_in_memory(base, delta, trust, base_version)?;
    let io = |source| DeltaFileError::Io {
        op: "write",
        path: dest.to_owned(),
        source,
    };
    let layout: Vec<(String, Vec<u64>)> = base
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    let mut w =
        SafetensorsWriter::create(dest, &layout, Some(summary.manifest.version)).map_err(io)?;
    for data in state.weights().values() {
        w.write(data).map_err(io)?;
    }
    w.finish().map_err(io)?;
    Ok(summary)
}

/// Reads a `.sdc`: its manifest and its segment frames, every frame verified on the way.
pub fn read_manifest(delta: &Path) -> Result<(SignedManifest, Vec<OwnedFrame>), DeltaFileError> {
    let decode_err = |source| DeltaFileError::Decode {
        path: delta.to_owned(),
        source,
    };
    let file = File::open(delta).map_err(|source| DeltaFileError::Io {
        op: "open",
        path: delta.to_owned(),
        source,
    })?;
    let mut frames =
        FrameReader::new(BufReader::with_capacity(1 << 20, file)).map_err(decode_err)?;
    let mut segs = Vec::new();
    let mut manifest = None;
    while let Some(f) = frames.next_frame().map_err(decode_err)? {
        match f.kind {
            FrameKind::Manifest => {
                manifest = Some(SignedManifest::decode_body(&f.body).map_err(decode_err)?)
            }
            FrameKind::Segment => segs.push(f),
            FrameKind::Trailer => {}
        }
    }
    let m = manifest.ok_or(StageError::NoManifest)?;
    Ok((m, segs))
}

/// The stem of every name that holds `version` in a store: `vNNNNNNNN` (eight digits at least,
/// so names sort by version); a sharded snapshot's directory is named just that.
pub fn version_stem(version: u64) -> String {
    format!("v{version:08}")
}

/// The name of the file that holds `version` in a store, with extension `ext`:
/// `vNNNNNNNN.EXT`. The one spelling of the naming every store uses: the hub's deltas, anchors
/// and snapshot, a relay's cache and anchor, an actor's journal, a shared weights directory.
pub fn version_file_name(version: u64, ext: &str) -> String {
    format!("{}.{ext}", version_stem(version))
}

/// The version a file named `vNNNNNNNN.EXT` ([`version_file_name`]) is for, if `name` is one.
pub fn version_of_file_name(name: &str, ext: &str) -> Option<u64> {
    name.strip_prefix('v')?
        .strip_suffix(ext)?
        .strip_suffix('.')?
        .parse()
        .ok()
}

/// [`version_file_name`] of a delta file (`.sdc`).
pub fn delta_file_name(version: u64) -> String {
    version_file_name(version, "sdc")
}

/// The version a delta file is named for (`vNNNNNNNN.sdc`, as the hub's store, relays' caches
/// and actors' journals name them), if `path` is one.
pub fn delta_file_version(path: &Path) -> Option<u64> {
    version_of_file_name(path.file_name()?.to_str()?, "sdc")
}

/// The versions of the delta files in `dir` (none if it cannot be read).
pub fn delta_files(dir: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| delta_file_version(&e.path()).map(|v| (v, e.path())))
        .collect()
}

/// Deletes the delta files in `dir` up to `version` (best effort: what cannot be deleted
/// stays, and is ignored by readers that start after `version`).
pub fn remove_deltas_through(dir: &Path, version: u64) {
    for (v, path) in delta_files(dir) {
        if v <= version {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_files_are_found_by_name_and_removed_through_a_version() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in [
            "v00000003.sdc",
            "v00000004.sdc",
            "v00000009.sdc",
            "vx.sdc",
            "v00000005.tmp",
        ] {
            std::fs::write(dir.path().join(name), b"x").expect("write");
        }
        let mut found: Vec<u64> = delta_files(dir.path())
            .into_iter()
            .map(|(v, _)| v)
            .collect();
        found.sort_unstable();
        assert_eq!(found, [3, 4, 9]);
        remove_deltas_through(dir.path(), 4);
        let left: Vec<u64> = delta_files(dir.path())
            .into_iter()
            .map(|(v, _)| v)
            .collect();
        assert_eq!(left, [9]);
        assert!(dir.path().join("vx.sdc").exists() && dir.path().join("v00000005.tmp").exists());
        assert_eq!(delta_file_version(Path::new("/a/v00000012.sdc")), Some(12));
    }

    #[test]
    fn store_names_spell_and_parse_one_way() {
        assert_eq!(version_stem(7), "v00000007");
        assert_eq!(version_file_name(7, "seal"), "v00000007.seal");
        assert_eq!(delta_file_name(123_456_789), "v123456789.sdc");
        assert!(version_file_name(9, "sdc") < version_file_name(10, "sdc"));
        for v in [0, 7, 99_999_999, 123_456_789] {
            let name = version_file_name(v, "safetensors");
            assert_eq!(version_of_file_name(&name, "safetensors"), Some(v));
        }
        assert_eq!(version_of_file_name("v00000007.seal", "safetensors"), None);
        assert_eq!(
            version_of_file_name("v00000007safetensors", "safetensors"),
            None
        );
        assert_eq!(version_of_file_name("w00000007.sdc", "sdc"), None);
        assert_eq!(version_of_file_name("v.sdc", "sdc"), None);
    }
    use crate::writer::SafetensorsWriter;

    /// Writes a checkpoint of three tensors (one bigger than the diff's read chunk, so both
    /// the batched and the chunked paths run) from a seed and a change rate.
    fn write_checkpoint(dir: &Path, name: &str, seed: u64, changed_every: usize) -> PathBuf {
        let layout = vec![
            ("a.small".to_owned(), vec![7, 13]),
            ("b.big".to_owned(), vec![3000]),
            ("c.tail".to_owned(), vec![5]),
        ];
        let path = dir.join(name);
        let mut w = SafetensorsWriter::create(&path, &layout, None).expect("create");
        for (i, (_, shape)) in layout.iter().enumerate() {
            let n = shape.iter().product::<u64>() as usize;
            let data: Vec<u16> = (0..n)
                .map(|j| {
                    let base = (j as u16).wrapping_mul(31).wrapping_add(i as u16);
                    if changed_every > 0 && j % changed_every == 0 {
                        base ^ (seed as u16 | 1)
                    } else {
                        base
                    }
                })
                .collect();
            w.write(&data).expect("write");
        }
        w.finish().expect("finish");
        path
    }

    #[test]
    fn windows_hold_parts_for_every_thread_within_bounds() {
        let part = 1 << 22;
        assert_eq!(window_elems(2, part), 8 * 2 * (1 << 22));
        assert_eq!(window_elems(16, part), 8 * 16 * (1 << 22));
        assert_eq!(window_elems(1000, part), MAX_WINDOW_ELEMS);
        assert_eq!(window_elems(1, 1000), MIN_WINDOW_ELEMS / 1000 * 1000);
        // Parts as long as the encoder makes them (it clamps to MAX_PART_ELEMS).
        assert_eq!(window_elems(0, u64::MAX), 8 * MAX_PART_ELEMS as usize);
        assert_eq!(window_elems(3, 3_000_000), 8 * 3 * 3_000_000);
        assert_eq!(window_elems(1, 1_000_000), 16 * 1_000_000);
        assert_eq!(window_elems(64, 3_000_000), 357 * 3_000_000);
    }

    /// The windows a diff with `opts` gets on a pool of `threads`.
    fn pool_windows(opts: &DiffOptions, threads: usize) -> Windows {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
            .install(|| Windows::new(opts))
    }

    #[test]
    fn windows_start_small_and_double_to_the_pools_size() {
        let mut w = pool_windows(&DiffOptions::new("m", 0, 1, 0), 16);
        let mut sizes = Vec::new();
        for _ in 0..8 {
            sizes.push(w.size() >> 22);
            w.advance(w.size());
        }
        // In 4 M-element parts: 4, 4, then doubling to 8 per thread.
        assert_eq!(sizes, [4, 4, 8, 16, 32, 64, 128, 128]);
        // Small batches read first do not use up the small windows.
        let mut w = pool_windows(&DiffOptions::new("m", 0, 1, 0), 16);
        w.advance(1000);
        w.advance(1000);
        assert_eq!(w.size(), MIN_WINDOW_ELEMS);
        let mut fixed = DiffOptions::new("m", 0, 1, 0);
        fixed.chunk_elems = Some(1000);
        let mut w = Windows::new(&fixed);
        for _ in 0..3 {
            w.advance(1000);
        }
        assert_eq!(w.size(), 1000);
    }

    #[test]
    fn the_delta_is_the_same_bytes_whatever_the_window_and_the_pool() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (old, new) = open_pair(dir.path(), 7);
        let mut opts = DiffOptions::new("m", 0, 1, 42);
        opts.encoder.part_elems = 256;
        let diff_with = |windows: Windows, threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            let mut bytes = Vec::new();
            pool.install(|| {
                diff_in_windows(
                    &old,
                    &new,
                    &opts,
                    windows,
                    &mut |b| {
                        bytes.extend_from_slice(b);
                        Ok(())
                    },
                    &|_| {},
                )
            })
            .expect("diff");
            bytes
        };
        let diff = |chunk: Option<usize>, threads: usize| {
            let mut opts = opts.clone();
            opts.chunk_elems = chunk;
            diff_with(pool_windows(&opts, threads), threads)
        };
        let whole = diff(None, 1);
        assert!(whole.len() > 200, "the pair differs");
        assert_ne!(
            diff(Some(1000), 2),
            whole,
            "the check can fail: windows off the part grid cut other parts"
        );
        // Parts restart at each window, so any multiple of the part length gives these bytes.
        for (chunk, threads) in [(None, 3), (Some(256), 1), (Some(512), 3), (Some(2560), 2)] {
            assert_eq!(
                diff(chunk, threads),
                whole,
                "window {chunk:?} on {threads} threads"
            );
        }
        // So do pool-sized windows small enough to grow within this pair, on any pool.
        for threads in [1, 2, 3] {
            let windows = Windows::for_pool(threads, 256, 256, MAX_WINDOW_ELEMS);
            assert_eq!(
                diff_with(windows, threads),
                whole,
                "growing windows on {threads} threads"
            );
        }
    }

    /// An unchanged base and a step from it (seed 5, every `changed_every`-th element
    /// changed), written with [`write_checkpoint`] into `dir` and opened.
    fn open_pair(dir: &Path, changed_every: usize) -> (Checkpoint, Checkpoint) {
        let old = write_checkpoint(dir, "old.safetensors", 0, 0);
        let new = write_checkpoint(dir, "new.safetensors", 5, changed_every);
        (
            Checkpoint::open(&old).expect("old"),
            Checkpoint::open(&new).expect("new"),
        )
    }

    #[test]
    fn a_diff_told_to_refuse_nonfinite_changes_stops_before_its_manifest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let old_path = write_checkpoint(dir.path(), "old.safetensors", 0, 0);
        let old = Checkpoint::open(&old_path).expect("old");
        let mut weights = old.read_all().expect("read");
        // NaN and Inf in the chunked tensor (far into it) and in a batched one.
        let big = weights.get_mut("b.big").expect("b");
        big[2500] = 0x7fc0;
        big[2999] = 0xff80;
        weights.get_mut("c.tail").expect("c")[1] = 0xffc3;
        let new_path = dir.path().join("new.safetensors");
        let layout: Vec<(String, Vec<u64>)> = old
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let mut w = SafetensorsWriter::create(&new_path, &layout, None).expect("create");
        for bits in weights.values() {
            w.write(bits).expect("write");
        }
        w.finish().expect("finish");
        let new = Checkpoint::open(&new_path).expect("new");

        let mut opts = DiffOptions::new("m", 0, 1, 42);
        opts.chunk_elems = Some(1000);
        opts.refuse_nonfinite_changes = true;
        let mut kinds = Vec::new();
        let got = diff_checkpoints(
            &old,
            &new,
            &opts,
            &mut |b| {
                kinds.push(b.first().copied());
                Ok(())
            },
            &|_| {},
        );
        let Err(DeltaFileError::NonFinite(bad)) = got else {
            panic!("not refused: {got:?}");
        };
        let named: Vec<(&str, u64, u64)> = bad
            .iter()
            .map(|t| (t.tensor.as_str(), t.nan, t.inf))
            .collect();
        assert_eq!(named, [("b.big", 1, 1), ("c.tail", 1, 0)]);
        assert!(
            !kinds.contains(&Some(FrameKind::Manifest as u8)),
            "no manifest: nothing emitted can be committed"
        );
        // Not asked to refuse (an allowed NaN step): the same pair diffs.
        opts.refuse_nonfinite_changes = false;
        diff_checkpoints(&old, &new, &opts, &mut |_| Ok(()), &|_| {}).expect("diffs");
    }

    #[test]
    fn mapped_diff_with_a_known_base_digest_equals_the_hashing_diff_and_applies_exactly() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (old, new) = open_pair(dir.path(), 17);
        let base = old.tensors().iter().find(|t| t.name == "b.big").expect("b");
        assert!(
            old.bf16_range(base, 10, 100).is_some(),
            "BF16 is read in place"
        );

        let mut opts = DiffOptions::new("m", 0, 1, 42);
        opts.chunk_elems = Some(1000);
        let hashed =
            diff_to_file(&old, &new, &dir.path().join("a.sdc"), &opts, &|_| {}).expect("diff");
        opts.pre_digest = Some(checkpoint_digest(&old, "m").expect("digest"));
        let chained =
            diff_to_file(&old, &new, &dir.path().join("b.sdc"), &opts, &|_| {}).expect("diff");
        assert_eq!(hashed.manifest.pre_digest, opts.pre_digest.expect("set"));
        assert_eq!(
            std::fs::read(dir.path().join("a.sdc")).expect("read"),
            std::fs::read(dir.path().join("b.sdc")).expect("read"),
            "a chained base digest gives the same delta, byte for byte"
        );
        assert!(chained.manifest.total_changes() > 0);

        let (applied, _) = apply_in_memory(
            &old,
            &dir.path().join("b.sdc"),
            &TrustPolicy::AnySigner,
            Some(0),
        )
        .expect("apply");
        assert_eq!(applied.weights(), &new.read_all().expect("read new"));
        assert_eq!(
            applied.digest(),
            checkpoint_digest(&new, "m").expect("digest")
        );
    }
}
