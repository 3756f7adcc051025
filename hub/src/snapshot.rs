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
//! **Handover** (`"handover": true`, `starling-hub publish --handover`): a trainer that writes
//! a new file per step and has no further use for it can give it to the hub instead. The hub
//! then renames the file it opened into the store ([`take_in`]): no copy, no second write of
//! the checkpoint, which at 8B is 16 GB and several seconds per step before the first segment.
//! It takes the file only when it can own it outright, and copies it otherwise (the reason is
//! logged): a single file (a sharded directory can hold files the hub never validated), on the
//! store's file system, with no other hard link, and still the very inode that was opened and
//! validated once renamed. A trainer that hands a file over must not write to it again, by
//! path or by a descriptor it kept. A handed-over file that is not published (a refused check,
//! a failed encode, a hub that died before sealing it) goes back to where it came from if that
//! name is free, else to `<store>/returned/`: a handover loses nothing the trainer gave.
//!
//! The initial checkpoint (`--init`) is the operator's, named on every start and checked
//! against the ledger's stamp; it is not copied. A copy that is lost or damaged while the hub
//! is down is rebuilt at start from the newest anchor and the delta chain (`durable`), into
//! the same directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use starling_checkpoint::deltafile::{version_file_name, version_stem};
use starling_checkpoint::safetensors::Checkpoint;

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

/// Where handed-over files that could not go back to their own name are put.
fn returned_dir(store: &Path) -> PathBuf {
    store.join("returned")
}

/// A copy being made or not yet sealed: removed when dropped unless [`Copy::seal`]ed; a
/// handed-over file is given back instead.
#[derive(Debug)]
pub(crate) struct Copy {
    partial: PathBuf,
    sharded: bool,
    sealed: bool,
    /// Where a handed-over file came from (`None` for a copy).
    origin: Option<PathBuf>,
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

    /// Makes the copy durable and gives it `version`'s name in `store`; returns that name.
    /// Maps opened on the partial path stay valid (a rename keeps the inode).
    pub(crate) fn seal(mut self, store: &Path, version: u64) -> Result<PathBuf> {
        let target = final_path(store, version, self.sharded);
        for f in files_of(&self.partial)? {
            std::fs::File::open(&f)
                .and_then(|h| h.sync_all())
                .with_context(|| format!("sync {}", f.display()))?;
        }
        remove(&target);
        std::fs::rename(&self.partial, &target).with_context(|| {
            format!("rename {} to {}", self.partial.display(), target.display())
        })?;
        if let Some(parent) = target.parent() {
            std::fs::File::open(parent)
                .and_then(|d| d.sync_all())
                .with_context(|| format!("sync {}", parent.display()))?;
        }
        self.sealed = true;
        if self.origin.is_some() {
            remove(&origin_note(&self.partial));
        }
        Ok(target)
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
                give_back(&store, &self.partial, &origin);
            }
            None => remove(&self.partial),
        }
    }
}

/// Why a handed-over checkpoint was copied instead of taken.
#[derive(Debug)]
pub(crate) enum Taken {
    /// The hub owns the trainer's file now.
    Moved(Copy),
    /// Nothing moved; the reason, for the log.
    NotTaken(String),
}

/// The note beside a handed-over file naming where it came from, so that a hub restarted
/// before sealing it can give it back ([`tidy`]).
fn origin_note(partial: &Path) -> PathBuf {
    let mut name = partial.as_os_str().to_owned();
    name.push(".origin");
    PathBuf::from(name)
}

/// Takes the opened, validated single-file checkpoint `source` into the store by renaming it
/// (the module docs say when). [`Taken::NotTaken`] leaves everything where it was, and the
/// caller copies instead. Blocking.
pub(crate) fn take_in(store: &Path, source: &Checkpoint) -> Result<Taken> {
    use std::os::unix::fs::MetadataExt;
    if source.index().is_some() {
        return Ok(Taken::NotTaken(
            "a sharded checkpoint is copied, not taken".into(),
        ));
    }
    let [(path, file, _)] = source.files().collect::<Vec<_>>()[..] else {
        return Ok(Taken::NotTaken("not a single file".into()));
    };
    let opened = file
        .metadata()
        .with_context(|| format!("stat {}", path.display()))?;
    if opened.nlink() == 0 {
        return Ok(Taken::NotTaken(
            "it was removed or replaced after it was opened".into(),
        ));
    }
    if opened.nlink() != 1 {
        return Ok(Taken::NotTaken(format!(
            "it has {} hard links: another name could still write it",
            opened.nlink()
        )));
    }
    let d = dir(store);
    std::fs::create_dir_all(&d).with_context(|| format!("create {}", d.display()))?;
    let n = INCOMING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = d.join(format!("incoming-{}-{n}.partial", std::process::id()));
    remove(&partial);
    let note = origin_note(&partial);
    std::fs::write(
        &note,
        std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()),
    )
    .with_context(|| format!("write {}", note.display()))?;
    if let Err(e) = std::fs::rename(path, &partial) {
        remove(&note);
        return Ok(Taken::NotTaken(format!(
            "it cannot be renamed into the store: {e}"
        )));
    }
    let copy = Copy {
        partial,
        sharded: false,
        sealed: false,
        origin: Some(path.to_owned()),
    };
    // The name may have been pointed at another file between the open and the rename: what
    // the hub now holds must be the inode it validated, and no one else's to write.
    let now = std::fs::symlink_metadata(&copy.partial)
        .with_context(|| format!("stat {}", copy.partial.display()))?;
    let same = now.file_type().is_file()
        && (now.dev(), now.ino()) == (opened.dev(), opened.ino())
        && now.nlink() == 1;
    if !same {
        // Dropping the copy gives the file back.
        return Ok(Taken::NotTaken(
            "the file changed while it was handed over".into(),
        ));
    }
    Ok(Taken::Moved(copy))
}

/// Puts the handed-over file at `partial` back at `origin` if that name is free (a hard link
/// then an unlink: a rename that never replaces), else into `<store>/returned/`.
fn give_back(store: &Path, partial: &Path, origin: &Path) {
    let note = origin_note(partial);
    if std::fs::hard_link(partial, origin).is_ok() {
        remove(partial);
        remove(&note);
        tracing::info!(path = %origin.display(), "a handed-over checkpoint was given back");
        return;
    }
    let returned = returned_dir(store);
    let name = origin.file_name().unwrap_or_default().to_string_lossy();
    let n = INCOMING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let to = returned.join(format!("{name}.{}-{n}", std::process::id()));
    match std::fs::create_dir_all(&returned).and_then(|()| std::fs::rename(partial, &to)) {
        Ok(()) => {
            remove(&note);
            tracing::warn!(
                origin = %origin.display(),
                path = %to.display(),
                "a handed-over checkpoint could not go back to its name (taken again): it is kept here"
            );
        }
        Err(e) => tracing::error!(
            origin = %origin.display(),
            path = %partial.display(),
            "a handed-over checkpoint could not be given back ({e}); it stays where it is"
        ),
    }
}

/// Numbers the copies this process makes, so concurrent publishes never share a file.
static INCOMING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Copies the opened checkpoint `source` into the store as a partial copy: each of its files,
/// from the open file, exactly the length its header declares; a sharded checkpoint's index
/// as it was read. Blocking: call from a blocking thread.
pub(crate) fn copy_in(store: &Path, source: &Checkpoint) -> Result<Copy> {
    let d = dir(store);
    std::fs::create_dir_all(&d).with_context(|| format!("create {}", d.display()))?;
    let n = INCOMING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let sharded = source.index().is_some();
    let copy = Copy {
        partial: d.join(format!("incoming-{}-{n}.partial", std::process::id())),
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
/// `keep` (the snapshot the hub resumes from). A handed-over file left partial goes back to
/// the trainer (the module docs).
pub(crate) fn tidy(store: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir(store)) else {
        return;
    };
    let paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    for p in &paths {
        if p.extension().is_some_and(|x| x == "origin") {
            let partial = p.with_extension("");
            match std::fs::read(p) {
                Ok(origin) if partial.exists() => {
                    use std::os::unix::ffi::OsStringExt;
                    let origin = PathBuf::from(std::ffi::OsString::from_vec(origin));
                    give_back(store, &partial, &origin);
                }
                _ => remove(p),
            }
        }
    }
    for p in paths {
        if p != keep && p.exists() {
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
    use starling_checkpoint::writer::SafetensorsWriter;

    fn checkpoint(path: &Path, value: u16) {
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
        let sealed = copy.seal(store.path(), 1).unwrap();
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
            .unwrap();
        let newer = copy_in(store.path(), &opened)
            .unwrap()
            .seal(store.path(), 4)
            .unwrap();
        release(store.path(), &sealed);
        assert!(!sealed.exists() && newer.exists());
    }

    #[test]
    fn a_sharded_checkpoint_is_copied_as_its_index_and_the_shards_it_names() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let shards = trainer.path().join("ckpt");
        std::fs::create_dir(&shards).unwrap();
        checkpoint(&shards.join("a.safetensors"), 3);
        std::fs::write(
            shards.join("model.safetensors.index.json"),
            br#"{"weight_map": {"w": "a.safetensors"}}"#,
        )
        .unwrap();
        checkpoint(&shards.join("unlisted.safetensors"), 4);
        std::fs::write(shards.join("notes.txt"), b"not a checkpoint file").unwrap();
        let opened = Checkpoint::open(&shards).unwrap();
        let sealed = copy_in(store.path(), &opened)
            .unwrap()
            .seal(store.path(), 5)
            .unwrap();
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

    fn moved(t: Taken) -> Copy {
        match t {
            Taken::Moved(c) => c,
            Taken::NotTaken(why) => panic!("not taken: {why}"),
        }
    }

    fn declined(t: Taken) -> String {
        match t {
            Taken::Moved(c) => panic!("taken: {}", c.path().display()),
            Taken::NotTaken(why) => why,
        }
    }

    #[test]
    fn a_handed_over_file_is_renamed_into_the_store_not_copied() {
        use std::os::unix::fs::MetadataExt;
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        checkpoint(&source, 5);
        let bytes = std::fs::read(&source).unwrap();
        let ino = std::fs::metadata(&source).unwrap().ino();
        let opened = Checkpoint::open(&source).unwrap();
        let copy = moved(take_in(store.path(), &opened).unwrap());
        assert!(copy.handed_over());
        assert!(!source.exists(), "the trainer's name is gone");
        assert_eq!(
            std::fs::metadata(copy.path()).unwrap().ino(),
            ino,
            "same inode"
        );
        assert!(origin_note(copy.path()).exists());
        let sealed = copy.seal(store.path(), 1).unwrap();
        assert_eq!(std::fs::read(&sealed).unwrap(), bytes);
        let left: Vec<_> = std::fs::read_dir(dir(store.path()))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(left, vec![sealed], "no note or partial left once sealed");
    }

    #[test]
    fn a_handed_over_file_that_is_not_published_goes_back_where_it_came_from() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        checkpoint(&source, 6);
        let bytes = std::fs::read(&source).unwrap();
        let opened = Checkpoint::open(&source).unwrap();
        drop(moved(take_in(store.path(), &opened).unwrap()));
        assert_eq!(std::fs::read(&source).unwrap(), bytes, "given back");
        assert_eq!(std::fs::read_dir(dir(store.path())).unwrap().count(), 0);

        // Its name taken meanwhile: kept under returned/, the new file untouched.
        let copy = moved(take_in(store.path(), &opened).unwrap());
        std::fs::write(&source, b"the trainer's next file").unwrap();
        drop(copy);
        assert_eq!(std::fs::read(&source).unwrap(), b"the trainer's next file");
        let returned: Vec<_> = std::fs::read_dir(returned_dir(store.path()))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(returned.len(), 1);
        assert_eq!(std::fs::read(&returned[0]).unwrap(), bytes);
        assert_eq!(std::fs::read_dir(dir(store.path())).unwrap().count(), 0);
    }

    #[test]
    fn a_hub_restarted_before_sealing_gives_a_handed_over_file_back() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        checkpoint(&source, 7);
        let bytes = std::fs::read(&source).unwrap();
        let opened = Checkpoint::open(&source).unwrap();
        let copy = moved(take_in(store.path(), &opened).unwrap());
        // The hub dies: nothing runs its drop.
        std::mem::forget(copy);
        assert!(!source.exists());
        let keep = dir(store.path()).join("v00000000.safetensors");
        checkpoint(&keep, 1);
        tidy(store.path(), &keep);
        assert_eq!(
            std::fs::read(&source).unwrap(),
            bytes,
            "given back at start"
        );
        let left: Vec<_> = std::fs::read_dir(dir(store.path()))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(left, vec![keep]);
    }

    #[test]
    fn a_file_the_hub_cannot_own_outright_is_left_where_it_is() {
        let store = tempfile::tempdir().unwrap();
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        checkpoint(&source, 8);
        let bytes = std::fs::read(&source).unwrap();

        // Another hard link could still write it.
        let other = trainer.path().join("latest.safetensors");
        std::fs::hard_link(&source, &other).unwrap();
        let opened = Checkpoint::open(&source).unwrap();
        let why = declined(take_in(store.path(), &opened).unwrap());
        assert!(why.contains("2 hard links"), "{why}");
        assert_eq!(std::fs::read(&source).unwrap(), bytes);
        std::fs::remove_file(&other).unwrap();

        // The name pointed at another file after the open: nothing is taken, the other file
        // keeps the name. (A swap between this check and the rename is caught by comparing
        // the renamed inode with the opened one, and given back the same way.)
        let opened = Checkpoint::open(&source).unwrap();
        let swapped = trainer.path().join("swapped.safetensors");
        checkpoint(&swapped, 9);
        let swapped_bytes = std::fs::read(&swapped).unwrap();
        std::fs::rename(&swapped, &source).unwrap();
        let why = declined(take_in(store.path(), &opened).unwrap());
        assert!(why.contains("removed or replaced"), "{why}");
        assert_eq!(std::fs::read(&source).unwrap(), swapped_bytes);
        assert!(std::fs::read_dir(dir(store.path())).map_or(true, |d| d.count() == 0));

        // A sharded checkpoint is copied, not taken.
        let shards = trainer.path().join("ckpt");
        std::fs::create_dir(&shards).unwrap();
        checkpoint(&shards.join("a.safetensors"), 3);
        std::fs::write(
            shards.join("model.safetensors.index.json"),
            br#"{"weight_map": {"w": "a.safetensors"}}"#,
        )
        .unwrap();
        let opened = Checkpoint::open(&shards).unwrap();
        let why = declined(take_in(store.path(), &opened).unwrap());
        assert!(why.contains("sharded"), "{why}");
        assert!(shards.join("a.safetensors").exists());
    }
}
