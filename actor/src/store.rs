//! The actor's weight store: a snapshot plus a journal of the deltas applied since.
//!
//! Persisting a version by rewriting the weights file costs O(model) I/O per step (4–5 s for a
//! 3.5 GB checkpoint, measured), and an in-place or memory-mapped file would not be much
//! cheaper: at 1% density every 4 KiB page of BF16 holds ~20 changes, so nearly every page
//! is written back anyway. The journal instead keeps each verified delta as received —
//! ~1.3 bytes per change, ~1/100 of the model — so a step costs O(delta) I/O:
//!
//! - `current.safetensors`: the snapshot, its version in the metadata (written atomically);
//! - `journal/vNNNNNNNN.sdc`: the deltas after it, each written atomically before the actor
//!   reports the version active.
//!
//! On start the snapshot is loaded and the journal replayed in order, each delta staged and
//! sealed again (signature, base version and digest, post digest), so a corrupted journal
//! stops the replay at the last good version instead of yielding wrong weights. When the
//! journal holds `MAX_JOURNAL` versions or 1/8 of the snapshot's bytes, the snapshot is
//! rewritten and the journal cleared (a crash in between leaves journal entries at or below
//! the snapshot's version, which the next start deletes).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use starling_checkpoint::deltafile::{Model, read_manifest, write_frames};
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::writer::SafetensorsWriter;
use starling_proto::delta::apply::{VersionedWeights, full_digest};
use starling_proto::delta::manifest::TrustPolicy;

/// Journal length that triggers a snapshot rewrite.
pub const MAX_JOURNAL: usize = 16;

const SNAPSHOT: &str = "current.safetensors";

/// Tensor names and shapes, in name order.
pub type Layout = Vec<(String, Vec<u64>)>;

/// An opened store.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    layout: Layout,
    snapshot_bytes: u64,
    snapshot_version: u64,
    /// Versions in the journal, with their file sizes.
    journal: Vec<(u64, u64)>,
    /// Journal bytes that trigger a snapshot rewrite (default: 1/8 of the snapshot).
    max_journal_bytes: u64,
}

/// What a store holds: the weights and their version after the replay.
#[derive(Debug)]
pub struct Loaded {
    pub store: Store,
    pub state: VersionedWeights<Model>,
    pub layout: Layout,
    /// Journal entries replayed.
    pub replayed: usize,
}

impl Store {
    fn journal_dir(dir: &Path) -> PathBuf {
        dir.join("journal")
    }

    fn journal_file(dir: &Path, version: u64) -> PathBuf {
        Self::journal_dir(dir).join(starling_checkpoint::deltafile::delta_file_name(version))
    }

    /// Opens the store in `dir` (starting from `init` when it holds no snapshot yet) and
    /// replays its journal.
    pub fn open(dir: &Path, init: &Path, model_id: &str, trust: &TrustPolicy) -> Result<Loaded> {
        Self::open_inner(dir, init, model_id, trust, true)
    }

    fn open_inner(
        dir: &Path,
        init: &Path,
        model_id: &str,
        trust: &TrustPolicy,
        tidy: bool,
    ) -> Result<Loaded> {
        std::fs::create_dir_all(Self::journal_dir(dir))
            .with_context(|| format!("create {}", dir.display()))?;
        let stored = dir.join(SNAPSHOT);
        let path = if stored.exists() {
            stored
        } else {
            init.to_owned()
        };
        let c = Checkpoint::open(&path).with_context(|| format!("open {}", path.display()))?;
        let layout: Layout = c
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let snapshot_version = c.version().unwrap_or(0);
        let snapshot_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let weights = c.read_all()?;
        let names: Vec<String> = weights.keys().cloned().collect();
        let digest = full_digest(model_id, &weights, &names);
        let mut state = VersionedWeights::new(model_id, weights, snapshot_version, digest);
        let mut store = Store {
            dir: dir.to_owned(),
            layout: layout.clone(),
            snapshot_bytes,
            snapshot_version,
            journal: Vec::new(),
            max_journal_bytes: snapshot_bytes / 8,
        };
        if tidy {
            store.drop_journal_through(snapshot_version);
        }
        let mut replayed = 0;
        loop {
            let v = state.version() + 1;
            let f = Self::journal_file(dir, v);
            if !f.exists() {
                break;
            }
            if let Err(e) = replay(&mut state, &f, trust) {
                tracing::warn!(
                    journal = %f.display(),
                    "journal entry refused: {e:#}; stopping the replay at {}",
                    v - 1
                );
                break;
            }
            let size = std::fs::metadata(&f).map(|m| m.len()).unwrap_or(0);
            store.journal.push((v, size));
            replayed += 1;
        }
        // Anything left beyond the replayed chain is unusable: remove it.
        let last = state.version();
        for e in std::fs::read_dir(Self::journal_dir(dir))?.flatten() {
            if tidy && journal_version(&e.path()).is_some_and(|v| v > last) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(Loaded {
            store,
            state,
            layout,
            replayed,
        })
    }

    /// Makes `version` (just committed in `state`, from these wire `frames`) durable: a
    /// journal entry, or a new snapshot when the journal is long enough.
    pub fn record(
        &mut self,
        version: u64,
        frames: &[&[u8]],
        state: &VersionedWeights<Model>,
    ) -> Result<()> {
        let f = Self::journal_file(&self.dir, version);
        let size = write_frames(&f, frames).with_context(|| format!("write {}", f.display()))?;
        self.journal.push((version, size));
        let bytes: u64 = self.journal.iter().map(|(_, s)| s).sum();
        if self.journal.len() >= MAX_JOURNAL || bytes > self.max_journal_bytes {
            self.snapshot(state)?;
        }
        Ok(())
    }

    /// Rewrites the snapshot at the state's version and clears the journal.
    pub fn snapshot(&mut self, state: &VersionedWeights<Model>) -> Result<()> {
        let path = self.dir.join(SNAPSHOT);
        let mut out = SafetensorsWriter::create(&path, &self.layout, Some(state.version()))
            .context("write snapshot")?;
        for t in state.weights().values() {
            out.write(t).context("write snapshot")?;
        }
        out.finish().context("write snapshot")?;
        self.snapshot_version = state.version();
        self.snapshot_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        self.max_journal_bytes = self.snapshot_bytes / 8;
        self.drop_journal_through(state.version());
        Ok(())
    }

    /// Installs a verified anchor file as the snapshot (renamed into place) and clears the
    /// journal.
    pub fn install_snapshot(&mut self, file: &Path, version: u64) -> Result<()> {
        let path = self.dir.join(SNAPSHOT);
        std::fs::rename(file, &path).context("install snapshot")?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        self.snapshot_version = version;
        self.snapshot_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        self.max_journal_bytes = self.snapshot_bytes / 8;
        self.journal.clear();
        for e in std::fs::read_dir(Self::journal_dir(&self.dir))?.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        Ok(())
    }

    fn drop_journal_through(&mut self, version: u64) {
        self.journal.retain(|(v, _)| *v > version);
        let Ok(entries) = std::fs::read_dir(Self::journal_dir(&self.dir)) else {
            return;
        };
        for e in entries.flatten() {
            if journal_version(&e.path()).is_some_and(|v| v <= version) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn journal_version(p: &Path) -> Option<u64> {
    starling_checkpoint::deltafile::delta_file_version(p)
}

/// Segments of a journal entry staged together on replay.
const REPLAY_BATCH: usize = 16;

/// Stages, seals and commits one journal entry on `state` (every check of a live delta).
fn replay(state: &mut VersionedWeights<Model>, delta: &Path, trust: &TrustPolicy) -> Result<()> {
    let (manifest, segments) = read_manifest(delta)?;
    let mut stager = state.stager();
    stager.stage_manifest(manifest)?;
    // Segments a batch at a time: their parts decode in one parallel map over every core,
    // and only a batch's segments are held decoded beside the entry's bytes.
    let frames: Vec<_> = segments.iter().map(|f| f.as_frame()).collect();
    for batch in frames.chunks(REPLAY_BATCH) {
        stager.stage_frames(batch, state.weights())?;
    }
    let sealed = stager.seal(trust)?;
    state.commit(sealed)?;
    Ok(())
}

/// Loads a store's weights and version (snapshot, else `init`, + journal) without changing
/// it, e.g. to check it from outside.
pub fn load(dir: &Path, init: &Path, model_id: &str, trust: &TrustPolicy) -> Result<(Model, u64)> {
    let loaded = Store::open_inner(dir, init, model_id, trust, false)?;
    let v = loaded.state.version();
    Ok((loaded.state.into_inner(), v))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;
    use starling_checkpoint::deltafile::{DiffOptions, diff_to_file};
    use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};
    use starling_proto::delta::container::split_frames;

    #[test]
    fn the_journal_replays_compacts_and_stops_at_a_damaged_entry() {
        let dir = tempfile::tempdir().unwrap();
        let steps = generate_to_dir(
            &ModelSpec::preset("tiny").unwrap(),
            3,
            &TrainConfig::default(),
            &dir.path().join("ckpt"),
            &|_| {},
        )
        .unwrap();
        let key = SigningKey::from_bytes(&[3; 32]);
        let trust = TrustPolicy::Keys(vec![key.verifying_key()]);
        let store_dir = dir.path().join("store");
        let mut loaded = Store::open(&store_dir, &steps[0], "tiny", &trust).unwrap();
        assert_eq!(loaded.state.version(), 0);
        loaded.store.max_journal_bytes = u64::MAX; // keep all three in the journal
        for k in 1..=3u64 {
            let delta = dir.path().join(format!("d{k}.sdc"));
            let mut opts = DiffOptions::new("tiny", k - 1, k, 1000 + k);
            opts.signing_key = Some(key.clone());
            let old = Checkpoint::open(&steps[k as usize - 1]).unwrap();
            let new = Checkpoint::open(&steps[k as usize]).unwrap();
            diff_to_file(&old, &new, &delta, &opts, &|_| {}).unwrap();
            replay(&mut loaded.state, &delta, &trust).unwrap();
            let file = std::fs::read(&delta).unwrap();
            let frames = split_frames(&file).unwrap();
            loaded.store.record(k, &frames, &loaded.state).unwrap();
        }
        let want = Checkpoint::open(&steps[3]).unwrap().read_all().unwrap();
        let (got, v) = load(&store_dir, &steps[0], "tiny", &trust).unwrap();
        assert_eq!(
            (v, &got),
            (3, &want),
            "snapshot + journal replay to version 3"
        );

        // A damaged entry stops the replay at the version before it, and the entries from
        // there on are removed (they can no longer be reached).
        assert!(
            !store_dir.join(SNAPSHOT).exists(),
            "nothing was compacted yet"
        );
        let j2 = Store::journal_file(&store_dir, 2);
        let mut b = std::fs::read(&j2).unwrap();
        let mid = b.len() / 2;
        b[mid] ^= 0x40;
        std::fs::write(&j2, b).unwrap();
        let again = Store::open(&store_dir, &steps[0], "tiny", &trust).unwrap();
        assert_eq!(again.state.version(), 1);
        assert!(!j2.exists() && !Store::journal_file(&store_dir, 3).exists());

        // Compaction: the snapshot moves to the state's version and the journal empties.
        let mut s = Store::open(&store_dir, &steps[0], "tiny", &trust).unwrap();
        let v = s.state.version();
        s.store.snapshot(&s.state).unwrap();
        let after = Store::open(&store_dir, &steps[0], "tiny", &trust).unwrap();
        assert_eq!((after.state.version(), after.replayed), (v, 0));
        assert_eq!(after.store.snapshot_version, v);
    }
}
