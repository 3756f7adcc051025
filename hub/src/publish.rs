//! Publishing a version: a trainer's checkpoint in, a version out (`POST /v1/versions` from
//! `crate::api`, `Publish` over QUIC from `crate::serve`).
//!
//! [`publish`] copies the checkpoint into the store and checks it (`crate::ingest`); then,
//! under the publish lock ([`crate::hub::State`]), diffs it against the last published one
//! and **offers every segment to subscribers the moment the encoder emits it**
//! (cut-through), while the same bytes go to the delta file in the store. The version
//! completes — recorded in the ledger, on the board, subscribers get `Commit`, it becomes the
//! listed latest — only once the file is durable (fsync, rename). A failed diff aborts the
//! version; receivers drop it. Anchors (full checkpoints) are written in the background
//! ([`write_anchor`]).
//!
//! The hub diffs its own copy of each published checkpoint (`crate::snapshot`), never the
//! trainer's file, so the trainer may delete or rewrite that file as soon as the publish
//! returns.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::{Context, Result};
use starling_checkpoint::deltafile::{DeltaFileError, DiffOptions, diff_checkpoints};
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::scan::nonfinite;
use starling_checkpoint::writer::AtomicFile;
use starling_ledger::Digest;
use starling_proto::delta::container::{FrameKind, split_frames};
use starling_proto::delta::manifest::delta_id;
use starling_transport::book::{LiveVersion, VersionBook, WireFrame};
use tracing::Instrument;

use crate::board::FaultKind;
use crate::clock::{now, now_ms};
use crate::durable;
use crate::hub::{Hub, State};
use crate::ingest::{Allow, PublishError, PublishRequest};

/// Writes the anchor of `version` from `checkpoint` (off the async runtime).
pub(crate) async fn write_anchor(hub: &Arc<Hub>, checkpoint: PathBuf, version: u64) -> Result<()> {
    let anchors = hub.anchors.clone();
    let seal = tokio::task::spawn_blocking(move || anchors.write(&checkpoint, version))
        .await
        .context("anchor task")??;
    tracing::info!(version, bytes = seal.size, "anchor written");
    println!("anchor {version}");
    Ok(())
}

/// A version the hub published, as recorded.
#[derive(Debug, Clone)]
pub(crate) struct Published {
    pub(crate) version: u64,
    pub(crate) base: u64,
    pub(crate) changes: u64,
    pub(crate) bytes: u64,
    /// Its state digest (the manifest's post digest): this version's, whatever was
    /// published after it.
    pub(crate) digest: [u8; 16],
    pub(crate) step: Option<u64>,
    /// Whether the trainer's file was taken (handover), not copied.
    pub(crate) handed_over: bool,
    /// How its weights were checked for NaN and ±Inf.
    pub(crate) nonfinite_check: Finite,
}

/// Publishes the checkpoint `req` names (`crate::ingest` for every check it passes first).
/// The work runs as a task of the hub: a caller that goes away (an HTTP client that
/// disconnects) does not cancel a publish halfway.
pub(crate) async fn publish(
    hub: &Arc<Hub>,
    req: PublishRequest,
) -> std::result::Result<Published, PublishError> {
    let owner = hub.clone();
    let path = req.path.clone();
    let task = hub
        .tasks
        .spawn(async move { publish_checked(&owner, req).await });
    let result = match task.await {
        Ok(r) => r,
        Err(e) => Err(PublishError::Internal(anyhow::anyhow!("publish task: {e}"))),
    };
    if let Err(e) = &result {
        tracing::warn!(path = %path.display(), code = e.code(), "publish refused: {e}");
        hub.board.fault(
            FaultKind::PublishFailed,
            None,
            None,
            &format!("{}: {e}", path.display()),
            now_ms(),
        );
    }
    result
}

async fn publish_checked(
    hub: &Arc<Hub>,
    req: PublishRequest,
) -> std::result::Result<Published, PublishError> {
    let internal = PublishError::Internal;
    let allow_nonfinite = req.allows(Allow::Nonfinite);
    // Off the runtime and before the publish lock: a FIFO, a stalled mount or a slow disk
    // holds this request only, never the hub or another publish.
    let copy = {
        let (store, dirs, layout, source) = (
            hub.cfg.store.clone(),
            hub.cfg.publish_dirs.clone(),
            hub.layout.clone(),
            req.path.clone(),
        );
        // Never taken by a handover: the hub's own store and its initial checkpoint.
        let off_limits: Vec<PathBuf> = [Some(&hub.cfg.store), hub.cfg.init.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|p| std::fs::canonicalize(p).ok())
            .collect();
        let handover = req.handover;
        tokio::task::spawn_blocking(move || {
            let t = std::time::Instant::now();
            let opened = crate::ingest::open_source(&dirs, &layout, &source)?;
            let taken = if handover {
                let allowed = |p: &Path| dirs.contains(p);
                match crate::handover::take_in(&store, &opened, &allowed, &off_limits)
                    .map_err(internal)?
                {
                    crate::handover::Taken::Moved(copy) => Some(copy),
                    crate::handover::Taken::NotTaken(why) => {
                        tracing::info!(path = %source.display(), "handover declined, copying: {why}");
                        None
                    }
                }
            } else {
                None
            };
            let copy = match taken {
                Some(copy) => copy,
                None => crate::snapshot::copy_in(&store, &opened).map_err(internal)?,
            };
            drop(opened);
            let copy_ms = t.elapsed().as_millis() as u64;
            crate::ingest::check_copy(copy.path(), &source, &layout)?;
            // Where a publish's time goes before its first segment (a user waits for it).
            tracing::info!(
                copy_ms,
                handed_over = copy.handed_over(),
                "checkpoint in the store"
            );
            Ok::<_, PublishError>(copy)
        })
        .await
        .map_err(|e| internal(anyhow::anyhow!("copy task: {e}")))??
    };
    // One publish at a time: the state lock is held across the diff.
    let state = hub.state.lock().await;
    if !req.allows(Allow::StepBackwards) {
        crate::ingest::check_step(req.step, state.step, state.version)?;
    }
    if !req.allows(Allow::Unchanged) {
        let (base, new, source, version) = (
            state.snapshot.clone(),
            copy.path().to_owned(),
            req.path.clone(),
            state.version,
        );
        tokio::task::spawn_blocking(move || {
            let t = std::time::Instant::now();
            let r = crate::ingest::check_changed(&base, &new, &source, version);
            tracing::info!(
                changed_check_ms = t.elapsed().as_millis() as u64,
                "compared with the latest version"
            );
            r
        })
        .await
        .map_err(|e| internal(anyhow::anyhow!("compare task: {e}")))??;
    }
    // NaN and ±Inf (`crate::ingest`, step 4): every element when the latest version is not
    // known to be finite, else only the changed ones, by the diff.
    let finite = if allow_nonfinite {
        Finite::Allowed
    } else if hub.newest_finite.load(Ordering::Acquire) {
        Finite::CheckChanges
    } else {
        let (new, source) = (copy.path().to_owned(), req.path.clone());
        tokio::task::spawn_blocking(move || {
            let t = std::time::Instant::now();
            let r = crate::ingest::check_finite(&new, &source);
            tracing::info!(
                nonfinite_check_ms = t.elapsed().as_millis() as u64,
                "scanned every element for NaN and ±Inf"
            );
            r
        })
        .await
        .map_err(|e| internal(anyhow::anyhow!("scan task: {e}")))??;
        Finite::Scanned
    };
    // Accepted: from here on the version streams to subscribers as it is encoded.
    publish_locked(hub, state, copy, req.step, finite)
        .await
        .map_err(|e| match e.downcast::<DeltaFileError>() {
            Ok(DeltaFileError::NonFinite(bad)) => crate::ingest::nonfinite_changes(&req.path, &bad),
            Ok(other) => internal(other.into()),
            Err(e) => internal(e),
        })
}

/// Learns whether the newest version (`version`, the hub's copy at `snapshot`) holds NaN or
/// ±Inf, by a scan in the background after a start: when it holds none, the next publish
/// checks only the elements it changes (`crate::ingest`, step 4) instead of scanning its whole
/// checkpoint before the first segment. A publish that runs first does the full scan itself.
pub(crate) async fn learn_finite(hub: Arc<Hub>, snapshot: PathBuf, version: u64) {
    let scanned = tokio::task::spawn_blocking(move || {
        let t = std::time::Instant::now();
        let found = Checkpoint::open(&snapshot).and_then(|c| nonfinite(&c));
        (found, t.elapsed())
    })
    .await;
    let (found, took) = match scanned {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(version, "NaN scan of the newest version: {e}");
            return;
        }
    };
    match found {
        Ok(bad) if bad.is_empty() => {
            let state = hub.state.lock().await;
            if state.version == version {
                hub.newest_finite.store(true, Ordering::Release);
            }
            drop(state);
            tracing::info!(
                version,
                scan_ms = took.as_millis() as u64,
                "the newest version holds no NaN or ±Inf: publishes check only what they change"
            );
        }
        Ok(bad) => tracing::info!(
            version,
            tensors = bad.len(),
            "the newest version holds NaN or ±Inf: the next publish scans every element"
        ),
        Err(e) => tracing::warn!(version, "NaN scan of the newest version: {e}"),
    }
}

/// How a publish is checked for NaN and ±Inf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finite {
    /// The request allows them: not checked.
    Allowed,
    /// Every element was scanned before the diff.
    Scanned,
    /// The base is known finite: the diff refuses a changed element that became NaN or ±Inf.
    CheckChanges,
}

impl Finite {
    /// The name the publish answer gives (`nonfinite_check`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Scanned => "every_element",
            Self::CheckChanges => "changed_elements",
        }
    }
}

async fn publish_locked(
    hub: &Arc<Hub>,
    mut state: tokio::sync::MutexGuard<'_, State>,
    copy: crate::snapshot::Copy,
    step: Option<u64>,
    finite: Finite,
) -> Result<Published> {
    let started = std::time::Instant::now();
    let base = state.version;
    let version = base + 1;
    let old = state.snapshot.clone();
    let previous = old.clone();
    let dest = durable::delta_path(&hub.cfg.store, version);
    let new = copy.path().to_owned();
    let created = now_ms();
    let span = tracing::info_span!("publish", version);
    let mut opts = DiffOptions::new(&hub.cfg.model_id, base, version, created);
    opts.signing_key = Some(hub.signing.clone());
    opts.encoder.segment_target_bytes = hub.cfg.segment_bytes;
    opts.tensor_hashes = hub.cfg.tensor_hashes;
    opts.refuse_nonfinite_changes = finite == Finite::CheckChanges;
    if hub.cfg.full_broadcast {
        opts.encoder.choice = starling_proto::delta::segment::CodecChoice::only_dense(
            starling_proto::delta::codec::DenseCodec::PlanesZstd,
        );
    }
    opts.pre_digest = Some(state.digest);
    let id = delta_id(&hub.cfg.model_id, base, version, created);
    // Cut-through: subscribers hear of the version with its first frame and get each frame
    // the moment the encoder emits it; a diff that fails before its first segment (a NaN
    // among the changes, most often) has sent nothing. Store-and-forward (for comparison):
    // the version is offered once its file is durable.
    let cut_through = hub.cfg.cut_through;
    let book = hub.book.clone();
    let dest2 = dest.clone();
    let (codecs, links, board) = (hub.codecs.clone(), hub.board.links(), hub.board.clone());
    let full_broadcast = hub.cfg.full_broadcast;
    let diffed = tokio::task::spawn_blocking(move || -> Result<_> {
        let o =
            Checkpoint::open(&old).with_context(|| format!("open snapshot {}", old.display()))?;
        let n = Checkpoint::open(&new).with_context(|| format!("open {}", new.display()))?;
        // The codec set for this version, from a sample of its own pair and the links.
        let t = std::time::Instant::now();
        let sample = (!full_broadcast)
            .then(|| crate::codecs::sample(&o, &n))
            .flatten();
        tracing::info!(
            sample_ms = t.elapsed().as_millis() as u64,
            "sampled the codec sets"
        );
        let elements = o.numel();
        let decision = codecs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .decide(version, elements, sample.as_ref(), &links);
        tracing::info!(codecs = decision.set.name(), "{}", decision.why);
        if !full_broadcast {
            opts.encoder.choice = decision.set.choice();
        } else {
            codecs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .sent_dense(version);
        }
        let encode_started = std::time::Instant::now();
        let mut file =
            AtomicFile::create(&dest2).with_context(|| format!("create {}", dest2.display()))?;
        let mut first = true;
        let mut live: Option<Arc<LiveVersion>> = None;
        let (signed, bytes) = diff_checkpoints(
            &o,
            &n,
            &opts,
            &mut |b| {
                file.write_all(b)?;
                if first && b.first() == Some(&(FrameKind::Segment as u8)) {
                    first = false;
                    board.first_segment(version, now_ms());
                    println!("first-segment {version}");
                }
                if cut_through && offered(b) {
                    if live.is_none() {
                        live = Some(
                            book.begin(version, base, id)
                                .map_err(std::io::Error::other)?,
                        );
                    }
                    if let Some(live) = &live {
                        offer(live, b);
                    }
                }
                Ok(())
            },
            &|_| {},
        )?;
        codecs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .observe(
                decision.set,
                elements,
                sample.as_ref(),
                signed.manifest.total_changes(),
                encode_started.elapsed().as_secs_f64(),
            );
        // Durable before it is listed: fsync, rename, fsync the directory.
        file.commit()
            .with_context(|| format!("write {}", dest2.display()))?;
        Ok((signed.manifest, bytes, live))
    })
    .instrument(span.clone())
    .await
    .context("diff task")
    .and_then(|r| r);
    let (manifest, bytes, live) = match diffed {
        Ok(d) => d,
        Err(e) => {
            hub.book.abort(version);
            return Err(e);
        }
    };
    let store = hub.cfg.store.clone();
    let handed_over = copy.handed_over();
    let sealed = tokio::task::spawn_blocking(move || copy.seal(&store, version))
        .await
        .context("seal task")
        .and_then(|r| r);
    // Until the ledger records the version, a handed-over file goes back to the trainer on any
    // early return (`Sealed`'s drop).
    let (sealed, source) = match sealed.and_then(|s| Ok((durable::FileStamp::of(s.path())?, s))) {
        Ok((stamp, s)) => (s, stamp),
        Err(e) => {
            hub.book.abort(version);
            return Err(e).context("keep the hub's copy of the checkpoint");
        }
    };
    if live.is_none() {
        let live = hub.book.begin(version, base, id)?;
        let file = tokio::fs::read(&dest)
            .await
            .with_context(|| format!("read {}", dest.display()))?;
        for f in split_frames(&file)? {
            offer(&live, f);
        }
    }
    // In the ledger before anyone hears of it: a version announced is a version recorded.
    let meta = durable::VersionMeta {
        source: Some(source),
        delta: Some(dest.clone()),
        changes: manifest.total_changes(),
        bytes,
        step,
    };
    let recorded = hub
        .ledger
        .publish_version(
            durable::to_ledger_version(version)?,
            Some(durable::to_ledger_version(base)?),
            Digest(manifest.post_digest.to_bytes()),
            &meta.to_text(),
            now(),
        )
        .await;
    if let Err(e) = recorded {
        hub.book.abort(version);
        return Err(e).context("record the version in the ledger");
    }
    let snapshot = sealed.recorded();
    // On the board before `Commit` can go out, so a subscriber's delivery always finds it.
    let elapsed = started.elapsed();
    hub.board.published(
        version,
        base,
        bytes,
        manifest.total_changes(),
        step,
        u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        hub.checkpoint_bytes,
        now_ms(),
    );
    hub.book.complete(version)?;
    // From now on its subscribers read it from the durable file, not from memory.
    spill(&hub.book, version, &dest).await;
    hub.metrics.set_active(version);
    hub.metrics.observe_publish(bytes, elapsed);
    state.version = version;
    state.snapshot = snapshot.clone();
    state.digest = manifest.post_digest;
    state.step = step;
    hub.newest_finite
        .store(finite != Finite::Allowed, Ordering::Release);
    drop(state);
    if !hub.pins().contains(&previous) {
        crate::snapshot::release(&hub.cfg.store, &previous);
    }
    if hub.cfg.anchor_every > 0 && version.is_multiple_of(hub.cfg.anchor_every) {
        // In the background: the next publish need not wait for a full-checkpoint write.
        // From the hub's copy, pinned until the anchor is written (a publish meanwhile does
        // not release it; this task does, once it is no longer the newest).
        let (owner, path) = (hub.clone(), snapshot);
        hub.pins().insert(path.clone());
        hub.tasks.spawn(async move {
            let hub = owner;
            let written = write_anchor(&hub, path.clone(), version).await;
            hub.pins().remove(&path);
            if let Ok(state) = hub.state.try_lock()
                && state.snapshot != path
            {
                crate::snapshot::release(&hub.cfg.store, &path);
            }
            if let Err(e) = written {
                tracing::error!(version, "anchor not written: {e:#}");
                hub.board.fault(
                    FaultKind::AnchorFailed,
                    None,
                    Some(version),
                    &format!("{e:#}"),
                    now_ms(),
                );
            }
        });
    }
    span.in_scope(|| {
        tracing::info!(
            changes = manifest.total_changes(),
            bytes,
            encode_ms = elapsed.as_millis() as u64,
            "published"
        )
    });
    Ok(Published {
        version,
        base,
        changes: manifest.total_changes(),
        bytes,
        digest: manifest.post_digest.to_bytes(),
        step,
        handed_over,
        nonfinite_check: finite,
    })
}

/// Serves a complete version from its delta file in the store instead of from memory (see
/// `LiveVersion::spill`). Should that fail, the version stays served from memory.
/// On a blocking thread: checking the file against the frames reads the whole delta.
async fn spill(book: &VersionBook, version: u64, file: &Path) {
    let Some(live) = book.get(version) else {
        return;
    };
    let file = file.to_owned();
    let spilled = tokio::task::spawn_blocking(move || {
        starling_transport::book::map_store_file(&file)
            .map_err(|e| anyhow::anyhow!("map {}: {e}", file.display()))
            .and_then(|map| Ok(live.spill(map)?))
    })
    .await
    .context("spill task")
    .and_then(|r| r);
    if let Err(e) = spilled {
        tracing::warn!(version, "version stays in memory: {e:#}");
    }
}

/// Whether subscribers get this encoded frame: segments and the manifest (the file header
/// and the trailer only matter in a file).
fn offered(frame: &[u8]) -> bool {
    frame
        .first()
        .is_some_and(|&k| k == FrameKind::Segment as u8 || k == FrameKind::Manifest as u8)
}

/// Offers one encoded frame to subscribers ([`offered`]).
fn offer(live: &LiveVersion, frame: &[u8]) {
    if offered(frame) {
        match WireFrame::parse(frame.to_vec()) {
            Ok(f) => live.push(f),
            Err(e) => tracing::error!("encoder emitted an unparsable frame: {e}"),
        }
    }
}
