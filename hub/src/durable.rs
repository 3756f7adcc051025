//! The hub's state across restarts: what `serve` finds in the ledger when it starts, and what
//! it records there as it publishes.
//!
//! The ledger is the source of truth. A version is a ledger row written (committed) after its
//! delta file is durable and before `Commit` is announced, so a version announced to anyone
//! exists in the ledger and in the store, and a restarted hub resumes at the newest row. A
//! number the hub was encoding when it died was never announced; it is given to the next
//! publish, and receivers that staged part of it drop those frames (their delta id differs).
//!
//! The run's identity is checked at start: the model id, and, when `--init` is given, that it
//! is a checkpoint of the run — the one the ledger was seeded with, or any version it records,
//! with that version's digest; an `--init` that contradicts the ledger is refused, naming both
//! versions and digests. Once the ledger holds the run, `--init` is not needed: the weights
//! come from the store (the hub's copy of the newest version, else an anchor and the delta
//! chain), and the model's own files (`config.json`, the tokenizer, the chat template) from
//! the store's copy of them made when the run was seeded (`STORE/model`). The seed file may
//! then be deleted, once the hub has written its first anchor (`anchor 0` on its stdout). The
//! snapshot to diff the next publish against is the latest version's source file when it is
//! unchanged since it was published (same length and modification time); otherwise it is
//! rebuilt from the newest anchor and the delta chain in the store, so a trainer that rewrote
//! its file cannot make the hub diff against the wrong base.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use starling_checkpoint::deltafile::{apply_to_file, checkpoint_digest};
use starling_checkpoint::safetensors::Checkpoint;
use starling_ledger::{Digest, Ledger, Version, VersionRecord};
use starling_proto::delta::digest::StateDigest;
use starling_proto::delta::manifest::{TrustPolicy, hex};

use crate::clock::now;

/// A file as the hub saw it: path, length and modification time, to tell later whether it is
/// still the same bytes without hashing it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FileStamp {
    pub(crate) path: PathBuf,
    pub(crate) len: u64,
    pub(crate) mtime_ns: u128,
}

impl FileStamp {
    /// Stamps `path` (a file, or a sharded directory through its index and shards).
    pub(crate) fn of(path: &Path) -> Result<FileStamp> {
        let mut len = 0u64;
        let mut mtime_ns = 0u128;
        let mut add = |p: &Path| -> Result<()> {
            let m = std::fs::metadata(p).with_context(|| format!("stat {}", p.display()))?;
            len = len.wrapping_add(m.len());
            let t = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            mtime_ns = mtime_ns.max(t);
            Ok(())
        };
        if path.is_dir() {
            for e in std::fs::read_dir(path).with_context(|| format!("list {}", path.display()))? {
                let p = e?.path();
                if p.extension()
                    .is_some_and(|x| x == "safetensors" || x == "json")
                {
                    add(&p)?;
                }
            }
        } else {
            add(path)?;
        }
        Ok(FileStamp {
            path: path.to_owned(),
            len,
            mtime_ns,
        })
    }

    /// Whether the file still looks as stamped.
    pub(crate) fn unchanged(&self) -> bool {
        FileStamp::of(&self.path).is_ok_and(|now| now == *self)
    }
}

/// What the hub records with each version (the `meta` column).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct VersionMeta {
    /// The checkpoint it was published from.
    pub(crate) source: Option<FileStamp>,
    /// Its delta file in the store (none for the initial version).
    pub(crate) delta: Option<PathBuf>,
    pub(crate) changes: u64,
    pub(crate) bytes: u64,
    /// The trainer's step, if it said.
    pub(crate) step: Option<u64>,
}

impl VersionMeta {
    pub(crate) fn parse(text: &str) -> VersionMeta {
        serde_json::from_str(text).unwrap_or_default()
    }

    pub(crate) fn to_text(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }
}

/// The files of a model directory the hub reads its limits and text side from.
const MODEL_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];

/// The model directory of the initial checkpoint: `--init` itself when it is a directory (a
/// Hugging Face model directory such as `starling model import` writes), else the file's
/// directory.
pub fn model_dir(init: &Path) -> PathBuf {
    if init.is_dir() {
        init.to_owned()
    } else {
        init.parent().map(Path::to_owned).unwrap_or_default()
    }
}

/// The store's copy of the run's model files (`STORE/model`).
pub(crate) fn model_files(store: &Path) -> PathBuf {
    store.join("model")
}

/// Copies the model files found in `from` into the store's copy (each made durable and
/// renamed into place), so that later starts need nothing outside the store. Blocking.
pub(crate) fn keep_model_files(store: &Path, from: &Path) -> Result<()> {
    let to = model_files(store);
    std::fs::create_dir_all(&to).with_context(|| format!("create {}", to.display()))?;
    for name in MODEL_FILES {
        let src = from.join(name);
        if !src.is_file() {
            continue;
        }
        let bytes = std::fs::read(&src).with_context(|| format!("read {}", src.display()))?;
        let mut out = starling_checkpoint::writer::AtomicFile::create(&to.join(name))
            .with_context(|| format!("create {}", to.join(name).display()))?;
        out.write_all(&bytes)
            .with_context(|| format!("write {}", to.join(name).display()))?;
        out.commit()
            .with_context(|| format!("write {}", to.join(name).display()))?;
    }
    Ok(())
}

/// The initial checkpoint the ledger was seeded with (`run_meta` key `init`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct InitRecord {
    version: u64,
    digest: String,
    source: FileStamp,
}

/// Where the hub stands after start-up.
#[derive(Debug)]
pub(crate) struct Resumed {
    /// The newest published version.
    pub(crate) version: u64,
    /// The checkpoint holding its weights (the next publish's base).
    pub(crate) snapshot: PathBuf,
    /// Its state digest.
    pub(crate) digest: StateDigest,
    /// The oldest version whose delta is in the store (the chain starts after it).
    pub(crate) first_delta: u64,
    /// The trainer's step the newest version was published with, if it said.
    pub(crate) step: Option<u64>,
    /// The version the run was seeded with.
    pub(crate) seeded: u64,
}

pub(crate) fn to_ledger_version(v: u64) -> Result<Version> {
    Version::new(v).map_err(|e| anyhow::anyhow!("version {v}: {e}"))
}

async fn digest_of(path: &Path, model_id: &str) -> Result<StateDigest> {
    let (path, model_id) = (path.to_owned(), model_id.to_owned());
    tokio::task::spawn_blocking(move || -> Result<StateDigest> {
        let c = Checkpoint::open(&path).with_context(|| format!("open {}", path.display()))?;
        Ok(checkpoint_digest(&c, &model_id)?)
    })
    .await
    .context("digest task")?
}

/// Opens the run recorded in `ledger`, or seeds it from `init` (version `init_version`) when
/// the ledger is empty. Once the ledger holds a run, `init` is optional: given, it must be
/// one of the run's checkpoints.
pub(crate) async fn resume(
    ledger: &Ledger,
    store: &Path,
    model_id: &str,
    init: Option<&Path>,
    init_version: u64,
    trust: &TrustPolicy,
) -> Result<Resumed> {
    match ledger.run_meta("model_id").await? {
        Some(m) if m != model_id => bail!(
            "the ledger belongs to model {m:?}, but --model-id is {model_id:?}: use the same \
             model id, or a fresh --store/--ledger for a new run"
        ),
        Some(_) => {}
        None => ledger.set_run_meta("model_id", model_id).await?,
    }
    let latest = ledger.latest_versions(1).await?.into_iter().next();
    let recorded: Option<InitRecord> = ledger
        .run_meta("init")
        .await?
        .and_then(|t| serde_json::from_str(&t).ok());
    let Some(latest) = latest else {
        // An empty ledger: the initial checkpoint becomes the first version.
        let Some(init) = init else {
            bail!(
                "the ledger holds no run yet: start the hub with --init CHECKPOINT (the run's \
                 first version; a safetensors file or a model directory)"
            );
        };
        let digest = digest_of(init, model_id).await?;
        let stamp = FileStamp::of(init)?;
        let meta = VersionMeta {
            source: Some(stamp.clone()),
            ..VersionMeta::default()
        };
        let record = InitRecord {
            version: init_version,
            digest: hex(&digest.to_bytes()),
            source: stamp,
        };
        // The model's own files first: a restart must find them in the store.
        let (s, from) = (store.to_owned(), model_dir(init));
        tokio::task::spawn_blocking(move || keep_model_files(&s, &from))
            .await
            .context("model files task")??;
        ledger
            .publish_version(
                to_ledger_version(init_version)?,
                None,
                Digest(digest.to_bytes()),
                &meta.to_text(),
                now(),
            )
            .await
            .context("record the initial version")?;
        ledger
            .set_run_meta("init", &serde_json::to_string(&record)?)
            .await?;
        return Ok(Resumed {
            version: init_version,
            snapshot: init.to_owned(),
            digest,
            first_delta: init_version,
            step: None,
            seeded: init_version,
        });
    };
    if let Some(init) = init {
        check_init(
            ledger,
            recorded.as_ref(),
            init,
            init_version,
            model_id,
            &latest,
        )
        .await?;
        if !model_files(store).join("config.json").exists() {
            // A store from before the hub kept the model's files: keep them now.
            let (s, from) = (store.to_owned(), model_dir(init));
            tokio::task::spawn_blocking(move || keep_model_files(&s, &from))
                .await
                .context("model files task")??;
        }
    }
    let version = latest.version.number();
    let digest = StateDigest::from_bytes(latest.digest.0);
    let meta = VersionMeta::parse(&latest.meta);
    let step = meta.step;
    let snapshot = match meta.source.filter(FileStamp::unchanged) {
        Some(source) => source.path,
        None => {
            tracing::warn!(
                version,
                "the checkpoint this version was published from changed since; rebuilding it \
                 from the store's anchor and deltas"
            );
            rebuild(store, version, digest, trust).await?
        }
    };
    let first_delta = oldest_delta(store, version);
    Ok(Resumed {
        version,
        snapshot,
        digest,
        first_delta,
        step,
        seeded: recorded.map_or(first_delta, |r| r.version),
    })
}

/// The most versions searched for the one an `--init` names on a restart.
const MAX_VERSIONS_SEARCHED: u32 = 1 << 20;

/// Refuses an `--init` that is not a checkpoint of the run: the seed file as it was, or the
/// weights of a version the ledger records (by its state digest).
async fn check_init(
    ledger: &Ledger,
    recorded: Option<&InitRecord>,
    init: &Path,
    init_version: u64,
    model_id: &str,
    latest: &VersionRecord,
) -> Result<()> {
    if let Some(rec) = recorded
        && rec.version == init_version
        && FileStamp::of(init).is_ok_and(|s| s == rec.source)
    {
        // The seed file, untouched.
        return Ok(());
    }
    let given = hex(&digest_of(init, model_id).await?.to_bytes());
    let wanted = if latest.version.number() == init_version {
        Some(hex(&latest.digest.0))
    } else if let Some(rec) = recorded.filter(|r| r.version == init_version) {
        Some(rec.digest.clone())
    } else {
        ledger
            .latest_versions(MAX_VERSIONS_SEARCHED)
            .await?
            .into_iter()
            .find(|r| r.version.number() == init_version)
            .map(|r| hex(&r.digest.0))
    };
    match wanted {
        Some(w) if w == given => {
            if let Some(rec) = recorded.filter(|r| r.version == init_version) {
                // The seed's weights in another file (or touched): remember the new stamp.
                let rec = InitRecord {
                    source: FileStamp::of(init)?,
                    ..rec.clone()
                };
                ledger
                    .set_run_meta("init", &serde_json::to_string(&rec)?)
                    .await?;
            }
            Ok(())
        }
        Some(w) => bail!(
            "--init {} (version {init_version}, digest {given}) contradicts the ledger, where \
             version {init_version} has digest {w}: name that version's checkpoint, or start \
             without --init (the ledger and the store hold the run, now at version {} with \
             digest {}), or use a fresh --store/--ledger for a new run",
            init.display(),
            latest.version.number(),
            hex(&latest.digest.0),
        ),
        None => bail!(
            "--init {} (version {init_version}) contradicts the ledger, which records no version \
             {init_version} (it is at version {}, digest {}): start without --init, or use a \
             fresh --store/--ledger for a new run",
            init.display(),
            latest.version.number(),
            hex(&latest.digest.0),
        ),
    }
}

/// The store's file for the delta of `version`.
pub(crate) fn delta_path(store: &Path, version: u64) -> PathBuf {
    store
        .join("deltas")
        .join(starling_checkpoint::deltafile::delta_file_name(version))
}

/// The newest version at or before `version` whose anchor is in the store.
fn newest_anchor(store: &Path, version: u64) -> Option<(u64, PathBuf)> {
    let dir = store.join("anchors");
    let mut best = None;
    for e in std::fs::read_dir(&dir).ok()?.flatten() {
        let name = e.file_name();
        let v = name
            .to_str()
            .and_then(|n| starling_checkpoint::deltafile::version_of_file_name(n, "safetensors"));
        if let Some(v) = v.filter(|&v| v <= version)
            && dir
                .join(starling_checkpoint::deltafile::version_file_name(v, "seal"))
                .exists()
            && best.as_ref().is_none_or(|(b, _)| v > *b)
        {
            best = Some((v, e.path()));
        }
    }
    best
}

/// The oldest version whose delta the store holds, below `latest` (so the book can serve the
/// chain from there).
fn oldest_delta(store: &Path, latest: u64) -> u64 {
    let mut v = latest;
    while v > 0 && delta_path(store, v).exists() {
        v -= 1;
    }
    v
}

/// Rebuilds the weights of `version` from the newest anchor and the delta chain after it, into
/// a file the hub owns (`store/snapshot/vN.safetensors`), and checks the result's digest.
async fn rebuild(
    store: &Path,
    version: u64,
    digest: StateDigest,
    trust: &TrustPolicy,
) -> Result<PathBuf> {
    let (store, trust) = (store.to_owned(), trust.clone());
    tokio::task::spawn_blocking(move || -> Result<PathBuf> {
        let Some((anchor, mut current)) = newest_anchor(&store, version) else {
            bail!(
                "version {version}'s checkpoint changed since it was published and the store \
                 holds no anchor to rebuild it from: restore that file, or start a new run"
            );
        };
        let dir = store.join("snapshot");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let mut post = None;
        for v in anchor + 1..=version {
            let delta = delta_path(&store, v);
            let dest = dir.join(starling_checkpoint::deltafile::version_file_name(
                v,
                "safetensors",
            ));
            let base = Checkpoint::open(&current)
                .with_context(|| format!("open {}", current.display()))?;
            let summary = apply_to_file(&base, &delta, &dest, &trust, Some(v - 1))
                .with_context(|| format!("apply {} to version {}", delta.display(), v - 1))?;
            post = Some(summary.post_digest);
            if current.starts_with(&dir) {
                let _ = std::fs::remove_file(&current);
            }
            current = dest;
        }
        if let Some(p) = post
            && p != digest
        {
            bail!(
                "rebuilt version {version} has digest {p}, the ledger says {digest}: the store \
                 is damaged"
            );
        }
        Ok(current)
    })
    .await
    .context("rebuild task")?
}
