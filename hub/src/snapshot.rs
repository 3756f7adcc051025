//! The hub's own copy of each published checkpoint: what it diffs and serves from.
//!
//! The hub reads checkpoints through memory maps (the encoder reads BF16 in place). A map of
//! a file that its owner rewrites in place is undefined behaviour and, when the file shrinks,
//! a SIGBUS that kills the hub. The trainer owns the file it publishes and may write its next
//! step into the same path, so the hub never maps it: a publish first copies the checkpoint
//! into `<store>/snapshot/` (one file, or a sharded checkpoint's index and the shards it
//! names), diffs against its copy of the previous version, and keeps only the newest copy.
//!
//! The copy is made from the files the hub opened and validated (`crate::ingest`), never by
//! opening the path again, and moves exactly the bytes their headers declare: a file that
//! grows, or is swapped for a link, while it is copied cannot make the hub copy more or
//! something else. Copies are made before the publish lock is taken, under a name of their
//! own (`incoming-N.partial`), and get their version's name when sealed.
//!
//! Cost: one sequential write of the checkpoint per publish (16 GB at 8B; on XFS or btrfs the
//! kernel's `copy_file_range` behind `std::fs::copy` shares extents instead, at no cost). The
//! copy is made durable (fsync) only after the diff, when the kernel has had the whole
//! encode to write it back, and before the version is recorded: a restarted hub finds the
//! newest version's copy whole, or rebuilds it from an anchor and the chain.
//!
//! **Handover** (`crate::handover`): a trainer that writes a new file per step can give it to
//! the hub, which then renames it into `<store>/snapshot/` instead of copying it; the rest of
//! this module treats it as a copy, except that a handed-over file the hub does not publish is
//! given back rather than removed, until the version is recorded ([`Sealed::recorded`]).
//!
//! The initial checkpoint (`--init`) is the operator's, named on every start and checked
//! against the ledger's stamp; it is not copied. A copy that is lost or damaged while the hub
//! is down is rebuilt at start from the newest anchor and the delta chain (`durable`), into
//! the same directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use starling_checkpoint::deltafile::{version_file_name, version_stem};
use starling_checkpoint::safetensors::Checkpoint;

use crate::handover::{self, Origin};

/// The directory of the hub's copies.
pub(crate) fn dir(store: &Path) -> PathBuf {
    store.join("snapshot")
}

/// Where version `version`'s copy lives once sealed: a file, or a directory for a sharded
/// checkpoint.
fn final_path(store: &Path, version: u64, sharded: bool) -> PathBuf {
    if sharded {
        dir(store).join(version_stem(version))
    } else {
        dir(store).join(version_file_name(version, "safetensors"))
    }
}

/// A copy being made or not yet sealed: removed when dropped unless [`Copy::seal`]ed; a
/// handed-over file is given back instead.
#[derive(Debug)]
pub(crate) struct Copy {
    partial: PathBuf,
    sharded: bool,
    sealed: bool,
    /// Where a handed-over file came from (`None` for a copy).
    origin: Option<Origin>,
}

impl Copy {
    /// The copy's path while it is partial (what the diff opens).
    pub(crate) fn path(&self) -> &Path {
        &self.partial
    }

    /// Whether the trainer's file itself was taken (rather than copied).
    pub(crate) fn handed_over(&self) -> bool {
        self.origin.is_some()
    }

    /// A trainer's file just renamed to `partial` (`crate::handover`).
    pub(crate) fn handed_over_at(partial: PathBuf, origin: Origin) -> Self {
        Self {
            partial,
            sharded: false,
            sealed: false,
            origin: Some(origin),
        }
    }

    /// Makes the copy durable and gives it `version`'s name in `store`. A handed-over file
    /// stays the trainer's to get back until [`Sealed::recorded`]: its note moves with it.
    pub(crate) fn seal(mut self, store: &Path, version: u64) -> Result<Sealed> {
        let target = final_path(store, version, self.sharded);
        for f in files_of(&self.partial)? {
            std::fs::File::open(&f)
                .and_then(|h| h.sync_all())
                .with_context(|| format!("sync {}", f.display()))?;
        }
        // A copy left by a publish that failed after its seal goes; a handed-over file whose
        // give-back failed then (its note is still there) is never overwritten.
        if handover::note_of(&target).exists() {
            anyhow::bail!(
                "{} holds a handed-over checkpoint that could not be given back: move it and its \
                 .origin note away",
                target.display()
            );
        }
        remove(&target);
        let note = match &self.origin {
            Some(origin) => {
                let note = handover::note_of(&target);
                handover::write_note(&note, origin.path())?;
                Some(note)
            }
            None => None,
        };
        if let Err(e) = std::fs::rename(&self.partial, &target) {
            if let Some(n) = &note {
                remove(n);
            }
            return Err(e).with_context(|| {
                format!("rename {} to {}", self.partial.display(), target.display())
            });
        }
        // From here the file is at `target`, and `Sealed` answers for it.
        self.sealed = true;
        let sealed = Sealed {
            path: target,
            origin: self.origin.take(),
            note,
            store: store.to_owned(),
        };
        if sealed.origin.is_some() {
            remove(&handover::note_of(&self.partial));
        }
        if let Some(parent) = sealed.path.parent() {
            std::fs::File::open(parent)
                .and_then(|d| d.sync_all())
                .with_context(|| format!("sync {}", parent.display()))?;
        }
        Ok(sealed)
    }
}

/// A sealed copy under its version's name, until the version is recorded. Dropped before
/// [`Sealed::recorded`], a handed-over file goes back to the trainer; a copy stays (the next
/// publish of that number replaces it).
#[derive(Debug)]
pub(crate) struct Sealed {
    path: PathBuf,
    origin: Option<Origin>,
    note: Option<PathBuf>,
    store: PathBuf,
}

impl Sealed {
    /// The sealed file (or directory).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The version is in the ledger: the file is the hub's for good. Returns its path.
    pub(crate) fn recorded(mut self) -> PathBuf {
        self.origin = None;
        if let Some(n) = self.note.take() {
            remove(&n);
        }
        self.path.clone()
    }
}

impl Drop for Sealed {
    fn drop(&mut self) {
        if let Some(origin) = self.origin.take() {
            handover::give_back(&self.store, &self.path, &origin);
        }
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        if self.sealed {
            return;
        }
        match self.origin.take() {
            Some(origin) => {
                let store = self
                    .partial
                    .parent()
                    .and_then(Path::parent)
                    .map(Path::to_owned)
                    .unwrap_or_default();
                handover::give_back(&store, &self.partial, &origin);
            }
            None => remove(&self.partial),
        }
    }
}

/// Numbers the copies this process makes, so concurrent publishes never share a file.
static INCOMING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A fresh name for a partial copy in the snapshot directory.
pub(crate) fn incoming_name() -> std::ffi::OsString {
    let n = INCOMING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("incoming-{}-{n}.partial", std::process::id()).into()
}

/// Copies the opened checkpoint `source` into the store as a partial copy: each of its files,
/// from the open file, exactly the length its header declares; a sharded checkpoint's index
/// as it was read. Blocking: call from a blocking thread.
pub(crate) fn copy_in(store: &Path, source: &Checkpoint) -> Result<Copy> {
    let d = dir(store);
    std::fs::create_dir_all(&d).with_context(|| format!("create {}", d.display()))?;
    let sharded = source.index().is_some();
    let copy = Copy {
        partial: d.join(incoming_name()),
        sharded,
        sealed: false,
        origin: None,
    };
    remove(&copy.partial);
    let one = |from: &std::fs::File, len: u64, what: &Path, to: &Path| -> Result<()> {
        use std::io::{Read, Seek};
        let mut from = from;
        from.seek(std::io::SeekFrom::Start(0))
            .with_context(|| format!("read {}", what.display()))?;
        let mut out =
            std::fs::File::create(to).with_context(|| format!("create {}", to.display()))?;
        let copied = std::io::copy(&mut from.take(len), &mut out)
            .with_context(|| format!("copy {} into the store", what.display()))?;
        if copied != len {
            anyhow::bail!(
                "{} shrank while it was copied ({copied} of {len} bytes)",
                what.display()
            );
        }
        Ok(())
    };
    if let Some((index, bytes)) = source.index() {
        std::fs::create_dir(&copy.partial)
            .with_context(|| format!("create {}", copy.partial.display()))?;
        std::fs::write(copy.partial.join(index), bytes)
            .with_context(|| format!("write {}", copy.partial.join(index).display()))?;
        for (path, file, len) in source.files() {
            let name = path.file_name().unwrap_or_default();
            one(file, len, path, &copy.partial.join(name))?;
        }
    } else {
        for (path, file, len) in source.files() {
            one(file, len, path, &copy.partial)?;
        }
    }
    Ok(copy)
}

/// Removes the copy at `path` if it is one of the hub's (never the operator's `--init`, never
/// anything outside the store's snapshot directory).
pub(crate) fn release(store: &Path, path: &Path) {
    if path.parent() == Some(dir(store).as_path()) {
        remove(path);
    }
}

/// Removes copies left partial by a hub that died while publishing, and every copy but
/// `keep` (the snapshot the hub resumes from). A handed-over file it left unrecorded goes back
/// to the trainer instead (`crate::handover::reclaim`).
pub(crate) fn tidy(store: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir(store)) else {
        return;
    };
    let paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    let stay = handover::reclaim(store, &paths, keep);
    for p in paths {
        if p != keep && !stay.contains(&p) && p.exists() {
            remove(&p);
        }
    }
}

/// A checkpoint's files: itself, or a directory's `*.safetensors` and `*.json`.
fn files_of(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for e in std::fs::read_dir(path).with_context(|| format!("list {}", path.display()))? {
        let p = e
            .with_context(|| format!("list {}", path.display()))?
            .path();
        if p.extension()
            .is_some_and(|x| x == "safetensors" || x == "json")
        {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

pub(crate) fn remove(path: &Path) {
    let r = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    if let Err(e) = r
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), "could not remove an old snapshot copy: {e}");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use starling_checkpoint::writer::SafetensorsWriter;

    /// A sharded checkpoint `<dir>/ckpt`: an index naming one shard, `a.safetensors`.
    pub(crate) fn sharded(dir: &Path) -> PathBuf {
        let shards = dir.join("ckpt");
        std::fs::create_dir(&shards).unwrap();
        checkpoint(&shards.join("a.safetensors"), 3);
        std::fs::write(
            shards.join("model.safetensors.index.json"),
            br#"{"weight_map": {"w": "a.safetensors"}}"#,
        )
        .unwrap();
        shards
    }

    /// A one-tensor checkpoint at `path`, every element `value` (also `crate::handover`'s).
    pub(crate) fn checkpoint(path: &Path, value: u16) {
        let layout = vec![("w".to_owned(), vec![4u64])];
        let mut w = SafetensorsWriter::create(path, &layout, None).unwrap();
        w.write(&[value; 4]).unwrap();
        w.finish().unwrap();
    }

    #[test]
    fn a_copy_is_the_hubs_own_file_and_a_rewrite_of_the_source_does_not_touch_it() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        checkpoint(&source, 1);
        let opened = Checkpoint::open(&source).unwrap();
        let copy = copy_in(store.path(), &opened).unwrap();
        assert_eq!(
            std::fs::read(copy.path()).unwrap(),
            std::fs::read(&source).unwrap()
        );
        let before = std::fs::read(&source).unwrap();
        let sealed = copy.seal(store.path(), 1).unwrap().recorded();
        // The trainer rewrites its file (shorter): the hub's copy is unchanged.
        std::fs::write(&source, b"v2").unwrap();
        assert_eq!(std::fs::read(&sealed).unwrap(), before);
        assert_eq!(sealed, dir(store.path()).join("v00000001.safetensors"));
    }

    #[test]
    fn an_unsealed_copy_is_removed_and_release_never_touches_files_outside_the_store() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        checkpoint(&source, 2);
        let opened = Checkpoint::open(&source).unwrap();
        let partial = {
            let copy = copy_in(store.path(), &opened).unwrap();
            copy.path().to_owned()
        };
        assert!(!partial.exists(), "a dropped partial copy is removed");
        release(store.path(), &source);
        assert!(source.exists(), "the trainer's file is never removed");
        let sealed = copy_in(store.path(), &opened)
            .unwrap()
            .seal(store.path(), 3)
            .unwrap()
            .recorded();
        let newer = copy_in(store.path(), &opened)
            .unwrap()
            .seal(store.path(), 4)
            .unwrap()
            .recorded();
        release(store.path(), &sealed);
        assert!(!sealed.exists() && newer.exists());
    }

    #[test]
    fn a_sharded_checkpoint_is_copied_as_its_index_and_the_shards_it_names() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let shards = sharded(trainer.path());
        checkpoint(&shards.join("unlisted.safetensors"), 4);
        std::fs::write(shards.join("notes.txt"), b"not a checkpoint file").unwrap();
        let opened = Checkpoint::open(&shards).unwrap();
        let sealed = copy_in(store.path(), &opened)
            .unwrap()
            .seal(store.path(), 5)
            .unwrap()
            .recorded();
        assert!(sealed.is_dir());
        assert_eq!(
            std::fs::read(sealed.join("a.safetensors")).unwrap(),
            std::fs::read(shards.join("a.safetensors")).unwrap()
        );
        assert!(sealed.join("model.safetensors.index.json").exists());
        assert!(!sealed.join("unlisted.safetensors").exists());
        assert!(!sealed.join("notes.txt").exists());
        assert_eq!(Checkpoint::open(&sealed).unwrap().tensors().len(), 1);
        tidy(store.path(), &sealed);
        assert!(sealed.exists());
    }
}
