//! The hub's own copy of each published checkpoint: what it diffs and serves from.
//!
//! The hub reads checkpoints through memory maps (the encoder reads BF16 in place). A map of
//! a file that its owner rewrites in place is undefined behaviour and, when the file shrinks,
//! a SIGBUS that kills the hub. The trainer owns the file it publishes and may write its next
//! step into the same path, so the hub never maps it: a publish first copies the checkpoint
//! into `<store>/snapshot/` (a file, or a sharded directory's `*.safetensors` and `*.json`),
//! diffs against its copy of the previous version, and keeps only the newest copy.
//!
//! Cost: one sequential write of the checkpoint per publish (16 GB at 8B; on XFS or btrfs the
//! kernel's `copy_file_range` behind `std::fs::copy` shares extents instead, at no cost). The
//! copy is made durable (fsync) only after the diff, when the kernel has had the whole
//! encode to write it back, and before the version is recorded: a restarted hub finds the
//! newest version's copy whole, or rebuilds it from an anchor and the chain.
//!
//! The initial checkpoint (`--init`) is the operator's, named on every start and checked
//! against the ledger's stamp; it is not copied. A copy that is lost or damaged while the hub
//! is down is rebuilt at start from the newest anchor and the delta chain (`durable`), into
//! the same directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The directory of the hub's copies.
pub(crate) fn dir(store: &Path) -> PathBuf {
    store.join("snapshot")
}

/// Where version `version`'s copy lives once sealed (same extension as `source`: a file, or a
/// directory for a sharded checkpoint).
fn final_path(store: &Path, version: u64, source: &Path) -> PathBuf {
    if source.is_dir() {
        dir(store).join(format!("v{version:08}"))
    } else {
        dir(store).join(format!("v{version:08}.safetensors"))
    }
}

/// A copy being made or not yet sealed: removed when dropped unless [`Copy::seal`]ed.
#[derive(Debug)]
pub(crate) struct Copy {
    partial: PathBuf,
    target: PathBuf,
    sealed: bool,
}

impl Copy {
    /// The copy's path while it is partial (what the diff opens).
    pub(crate) fn path(&self) -> &Path {
        &self.partial
    }

    /// Makes the copy durable and gives it its final name; returns that name. Maps opened on
    /// the partial path stay valid (a rename keeps the inode).
    pub(crate) fn seal(mut self) -> Result<PathBuf> {
        for f in files_of(&self.partial)? {
            std::fs::File::open(&f)
                .and_then(|h| h.sync_all())
                .with_context(|| format!("sync {}", f.display()))?;
        }
        std::fs::rename(&self.partial, &self.target).with_context(|| {
            format!(
                "rename {} to {}",
                self.partial.display(),
                self.target.display()
            )
        })?;
        if let Some(parent) = self.target.parent() {
            std::fs::File::open(parent)
                .and_then(|d| d.sync_all())
                .with_context(|| format!("sync {}", parent.display()))?;
        }
        self.sealed = true;
        Ok(self.target.clone())
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        if !self.sealed {
            remove(&self.partial);
        }
    }
}

/// Copies the checkpoint at `source` (a file or a sharded directory) into the store as the
/// partial copy of `version`. Blocking: call from a blocking thread.
pub(crate) fn copy_in(store: &Path, version: u64, source: &Path) -> Result<Copy> {
    let d = dir(store);
    std::fs::create_dir_all(&d).with_context(|| format!("create {}", d.display()))?;
    let target = final_path(store, version, source);
    let partial = target.with_extension("partial");
    remove(&partial);
    let copy = Copy {
        partial,
        target,
        sealed: false,
    };
    if source.is_dir() {
        std::fs::create_dir(&copy.partial)
            .with_context(|| format!("create {}", copy.partial.display()))?;
        for f in files_of(source)? {
            let name = f.file_name().unwrap_or_default();
            std::fs::copy(&f, copy.partial.join(name))
                .with_context(|| format!("copy {} into the store", f.display()))?;
        }
    } else {
        std::fs::copy(source, &copy.partial)
            .with_context(|| format!("copy {} into the store", source.display()))?;
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
/// `keep` (the snapshot the hub resumes from).
pub(crate) fn tidy(store: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir(store)) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p != keep {
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

fn remove(path: &Path) {
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
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_the_hubs_own_file_and_a_rewrite_of_the_source_does_not_touch_it() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        std::fs::write(&source, b"version one").unwrap();
        let copy = copy_in(store.path(), 1, &source).unwrap();
        assert_eq!(std::fs::read(copy.path()).unwrap(), b"version one");
        let sealed = copy.seal().unwrap();
        // The trainer rewrites its file in place (shorter): the hub's copy is unchanged.
        std::fs::write(&source, b"v2").unwrap();
        assert_eq!(std::fs::read(&sealed).unwrap(), b"version one");
        assert_eq!(sealed, dir(store.path()).join("v00000001.safetensors"));
    }

    #[test]
    fn an_unsealed_copy_is_removed_and_release_never_touches_files_outside_the_store() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        std::fs::write(&source, b"weights").unwrap();
        let partial = {
            let copy = copy_in(store.path(), 2, &source).unwrap();
            copy.path().to_owned()
        };
        assert!(!partial.exists(), "a dropped partial copy is removed");
        release(store.path(), &source);
        assert!(source.exists(), "the trainer's file is never removed");
        let sealed = copy_in(store.path(), 3, &source).unwrap().seal().unwrap();
        let newer = copy_in(store.path(), 4, &source).unwrap().seal().unwrap();
        release(store.path(), &sealed);
        assert!(!sealed.exists() && newer.exists());
    }

    #[test]
    fn a_sharded_checkpoint_is_copied_as_a_directory() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let shards = trainer.path().join("ckpt");
        std::fs::create_dir(&shards).unwrap();
        std::fs::write(shards.join("a.safetensors"), b"A").unwrap();
        std::fs::write(shards.join("model.safetensors.index.json"), b"{}").unwrap();
        std::fs::write(shards.join("notes.txt"), b"not a checkpoint file").unwrap();
        let sealed = copy_in(store.path(), 5, &shards).unwrap().seal().unwrap();
        assert!(sealed.is_dir());
        assert_eq!(std::fs::read(sealed.join("a.safetensors")).unwrap(), b"A");
        assert!(sealed.join("model.safetensors.index.json").exists());
        assert!(!sealed.join("notes.txt").exists());
        tidy(store.path(), &sealed);
        assert!(sealed.exists());
    }
}
