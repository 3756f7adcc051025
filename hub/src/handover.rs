//! Publishing by handover: the hub takes the trainer's checkpoint file by renaming it into its
//! store instead of copying it (`"handover": true`, `starling-hub publish --handover`;
//! `docs/api.md`, "Handover").
//!
//! Why: the copy of `crate::snapshot` is a second write of the whole checkpoint per step (16 GB
//! at 8B) before the first delta segment. A trainer that writes a new file per step and never
//! reads it again can give it away instead.
//!
//! The hub takes a file only when it can own it outright, and copies it otherwise ([`take_in`]
//! says why, for the log):
//! - a single file: a sharded directory can hold files the hub never validated;
//! - not the hub's own (under its store, or its `--init`);
//! - one name (no other hard link that could still write it), which is still the very inode
//!   the hub opened and validated;
//! - on the store's file system (a rename, never a copy in disguise).
//!
//! Every step goes through descriptors, not paths looked up again: the file's directory is
//! opened and checked to be inside a publish directory by the path of its descriptor, the name
//! is checked against the opened inode in that directory, and the rename is made from that
//! directory with `RENAME_NOREPLACE`. A directory swapped for a link meanwhile can neither
//! redirect the move nor the give-back.
//!
//! **Nothing the trainer gave is lost.** A handed-over file that is not published (a refused
//! check, a failed encode, a ledger that refused the version, a hub that died before recording
//! it) goes back to its name if that is free, else into `<store>/returned/`. A durable note
//! beside the file (`<file>.origin`, the original path) lets a restarted hub give back what a
//! dead one held ([`reclaim`]).
//!
//! What it cannot enforce: a trainer that kept a descriptor open for writing can still write
//! the file (the documented contract is that it does not), and the file keeps its owner.

use std::collections::HashSet;
use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rustix::fs::{AtFlags, CWD, FileType, Mode, OFlags, RenameFlags};
use starling_checkpoint::safetensors::Checkpoint;

use crate::snapshot::{Copy, dir, incoming_name, remove};

/// Where a handed-over file came from: its directory (an `O_PATH` descriptor, checked once)
/// and its name there; the path for messages and the durable note.
#[derive(Debug)]
pub(crate) struct Origin {
    dir: Option<OwnedFd>,
    name: OsString,
    path: PathBuf,
}

impl Origin {
    /// The original path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// What [`take_in`] did.
#[derive(Debug)]
pub(crate) enum Taken {
    /// The hub owns the trainer's file now.
    Moved(Copy),
    /// Nothing moved; the reason, for the log.
    NotTaken(String),
}

/// The note beside a handed-over file naming where it came from.
pub(crate) fn note_of(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".origin");
    PathBuf::from(name)
}

/// Writes `note` (naming `origin`) durably: the note and its directory are synced before the
/// file it speaks for moves.
pub(crate) fn write_note(note: &Path, origin: &Path) -> Result<()> {
    use std::io::Write;
    let mut f =
        std::fs::File::create(note).with_context(|| format!("create {}", note.display()))?;
    f.write_all(origin.as_os_str().as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("write {}", note.display()))?;
    sync_parent(note)
}

fn sync_parent(path: &Path) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("sync {}", parent.display()))?;
    }
    Ok(())
}

/// The real path of an open descriptor (its `/proc/self/fd` link).
fn real_path(fd: impl AsFd) -> Option<PathBuf> {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd())).ok()
}

/// Takes the opened, validated single-file checkpoint `source` into the store by renaming it
/// (the module docs say when). `allowed` is the publish directories' check of a real path;
/// `off_limits` the hub's own files and directories (its store, its `--init`).
/// [`Taken::NotTaken`] leaves everything where it was, and the caller copies instead. Blocking.
pub(crate) fn take_in(
    store: &Path,
    source: &Checkpoint,
    allowed: &dyn Fn(&Path) -> bool,
    off_limits: &[PathBuf],
) -> Result<Taken> {
    let not = |why: &str| Ok(Taken::NotTaken(why.to_owned()));
    if source.index().is_some() {
        return not("a sharded checkpoint is copied, not taken");
    }
    let [(_, file, _)] = source.files().collect::<Vec<_>>()[..] else {
        return not("not a single file");
    };
    let opened = file.metadata().context("stat the opened checkpoint")?;
    match opened.nlink() {
        0 => return not("it was removed or replaced after it was opened"),
        1 => {}
        n => {
            return Ok(Taken::NotTaken(format!(
                "it has {n} hard links: another name could still write it"
            )));
        }
    }
    let Some(real) = real_path(file) else {
        return not("its path could not be read back from its descriptor");
    };
    if off_limits.iter().any(|p| real.starts_with(p)) {
        return not("it is the hub's own (under its store, or its --init)");
    }
    let (Some(parent), Some(name)) = (real.parent(), real.file_name()) else {
        return not("it has no parent directory");
    };
    // The directory, by a descriptor checked once: everything below goes through it.
    let from_dir = match rustix::fs::open(
        parent,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(d) => d,
        Err(e) => return Ok(Taken::NotTaken(format!("its directory: {e}"))),
    };
    if real_path(&from_dir).as_deref() != Some(parent) || !allowed(parent) {
        return not("its directory moved while it was handed over");
    }
    let same = |dirfd: &OwnedFd, name: &std::ffi::OsStr| {
        rustix::fs::statat(dirfd, name, AtFlags::SYMLINK_NOFOLLOW).is_ok_and(|st| {
            FileType::from_raw_mode(st.st_mode) == FileType::RegularFile
                && (st.st_dev, st.st_ino) == (opened.dev(), opened.ino())
                && st.st_nlink == 1
        })
    };
    if !same(&from_dir, name) {
        return not("its name no longer leads to the file that was opened");
    }
    let d = dir(store);
    std::fs::create_dir_all(&d).with_context(|| format!("create {}", d.display()))?;
    let to_dir = rustix::fs::open(
        &d,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("open {}", d.display()))?;
    let partial_name = incoming_name();
    let partial = d.join(&partial_name);
    remove(&partial);
    let note = note_of(&partial);
    write_note(&note, &real)?;
    if let Err(e) = rustix::fs::renameat_with(
        &from_dir,
        name,
        &to_dir,
        &partial_name,
        RenameFlags::NOREPLACE,
    ) {
        remove(&note);
        return Ok(Taken::NotTaken(format!(
            "it cannot be renamed into the store: {e}"
        )));
    }
    // Whatever now holds the name in the store goes back if it is not the opened file
    // (the copy's drop gives it back, through the same directory descriptor).
    let moved_same = same(&to_dir, partial_name.as_ref());
    let origin = Origin {
        dir: Some(from_dir),
        name: name.to_owned(),
        path: real.clone(),
    };
    let copy = Copy::handed_over_at(partial, origin);
    if !moved_same {
        return not("the file changed while it was handed over");
    }
    Ok(Taken::Moved(copy))
}

/// Puts the handed-over file at `from` (in the store) back at `origin` if that name is free,
/// else into `<store>/returned/`, and removes its note. False if it could do neither (the file
/// and its note then stay where they are, for an operator). Blocking.
pub(crate) fn give_back(store: &Path, from: &Path, origin: &Origin) -> bool {
    let back = match &origin.dir {
        Some(dir) => {
            rustix::fs::renameat_with(CWD, from, dir, &origin.name, RenameFlags::NOREPLACE)
        }
        None => rustix::fs::renameat_with(CWD, from, CWD, &origin.path, RenameFlags::NOREPLACE),
    };
    let note = note_of(from);
    if back.is_ok() {
        remove(&note);
        tracing::info!(path = %origin.path.display(), "a handed-over checkpoint was given back");
        return true;
    }
    let returned = store.join("returned");
    let name = origin.name.to_string_lossy();
    let to = returned.join(format!("{name}.{}", incoming_name().to_string_lossy()));
    match std::fs::create_dir_all(&returned).and_then(|()| std::fs::rename(from, &to)) {
        Ok(()) => {
            remove(&note);
            tracing::warn!(
                origin = %origin.path.display(),
                path = %to.display(),
                "a handed-over checkpoint could not go back to its name (taken again \
                 meanwhile): it is kept here"
            );
            true
        }
        Err(e) => {
            tracing::error!(
                origin = %origin.path.display(),
                path = %from.display(),
                "a handed-over checkpoint could not be given back ({e}); it stays where it is"
            );
            false
        }
    }
}

/// At start: gives back every handed-over file a dead hub left unrecorded (a note beside a
/// file that is not `keep`), and forgets the notes of files it recorded (`keep`). Returns the
/// paths that must not be removed: files that could not be given back, and their notes.
pub(crate) fn reclaim(store: &Path, paths: &[PathBuf], keep: &Path) -> HashSet<PathBuf> {
    let mut stay = HashSet::new();
    for note in paths
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "origin"))
    {
        let file = note.with_extension("");
        if file == keep || !file.exists() {
            remove(note);
            continue;
        }
        let Ok(bytes) = std::fs::read(note) else {
            stay.extend([file, note.clone()]);
            continue;
        };
        let path = PathBuf::from(OsString::from_vec(bytes));
        let origin = Origin {
            dir: None,
            name: path.file_name().unwrap_or_default().to_owned(),
            path,
        };
        if !give_back(store, &file, &origin) {
            stay.extend([file, note.clone()]);
        }
    }
    stay
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::snapshot::tests::{checkpoint, sharded};
    use crate::snapshot::tidy;

    fn take(store: &Path, source: &Checkpoint) -> Taken {
        take_in(store, source, &|_| true, &[store.to_owned()]).unwrap()
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

    fn listing(d: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(d)
            .map(|r| r.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// A trainer's directory with one checkpoint; its bytes.
    fn trainer_file(value: u16) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
        let trainer = tempfile::tempdir().unwrap();
        let source = trainer.path().join("step.safetensors");
        checkpoint(&source, value);
        let bytes = std::fs::read(&source).unwrap();
        (trainer, source, bytes)
    }

    #[test]
    fn a_handed_over_file_is_renamed_into_the_store_and_kept_once_recorded() {
        let store = tempfile::tempdir().unwrap();
        let (_t, source, bytes) = trainer_file(5);
        let ino = std::fs::metadata(&source).unwrap().ino();
        let opened = Checkpoint::open(&source).unwrap();
        let copy = moved(take(store.path(), &opened));
        assert!(copy.handed_over());
        assert!(!source.exists(), "the trainer's name is gone");
        assert_eq!(
            std::fs::metadata(copy.path()).unwrap().ino(),
            ino,
            "same inode"
        );
        assert!(
            note_of(copy.path()).exists(),
            "a durable note names the origin"
        );
        let sealed = copy.seal(store.path(), 1).unwrap();
        assert!(
            note_of(sealed.path()).exists(),
            "the note moves with the file"
        );
        let path = sealed.recorded();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        assert_eq!(
            listing(&dir(store.path())),
            vec![path],
            "no note or partial left"
        );
        assert!(!source.exists());
    }

    #[test]
    fn a_handed_over_file_that_is_not_recorded_goes_back_where_it_came_from() {
        let store = tempfile::tempdir().unwrap();
        let (_t, source, bytes) = trainer_file(6);
        // Refused before its seal.
        let opened = Checkpoint::open(&source).unwrap();
        drop(moved(take(store.path(), &opened)));
        assert_eq!(std::fs::read(&source).unwrap(), bytes, "given back");
        assert!(listing(&dir(store.path())).is_empty());
        // Sealed, then the ledger refused the version.
        let opened = Checkpoint::open(&source).unwrap();
        let sealed = moved(take(store.path(), &opened))
            .seal(store.path(), 2)
            .unwrap();
        assert!(!source.exists());
        drop(sealed);
        assert_eq!(
            std::fs::read(&source).unwrap(),
            bytes,
            "given back after its seal"
        );
        assert!(listing(&dir(store.path())).is_empty());

        // Its name taken meanwhile: kept under returned/, the new file untouched.
        let opened = Checkpoint::open(&source).unwrap();
        let copy = moved(take(store.path(), &opened));
        std::fs::write(&source, b"the trainer's next file").unwrap();
        drop(copy);
        assert_eq!(std::fs::read(&source).unwrap(), b"the trainer's next file");
        let returned = listing(&store.path().join("returned"));
        assert_eq!(returned.len(), 1);
        assert_eq!(std::fs::read(&returned[0]).unwrap(), bytes);
        assert!(listing(&dir(store.path())).is_empty());
    }

    #[test]
    fn a_hub_restarted_before_recording_gives_handed_over_files_back() {
        let store = tempfile::tempdir().unwrap();
        let (_t1, before_seal, bytes1) = trainer_file(7);
        let (_t2, after_seal, bytes2) = trainer_file(8);
        let (_t3, recorded, _) = trainer_file(9);
        // The hub dies with one file partial, one sealed and not recorded, and one recorded
        // whose note it had not removed yet: nothing runs their drops.
        let o1 = Checkpoint::open(&before_seal).unwrap();
        std::mem::forget(moved(take(store.path(), &o1)));
        let o2 = Checkpoint::open(&after_seal).unwrap();
        std::mem::forget(
            moved(take(store.path(), &o2))
                .seal(store.path(), 4)
                .unwrap(),
        );
        let o3 = Checkpoint::open(&recorded).unwrap();
        let kept = moved(take(store.path(), &o3))
            .seal(store.path(), 3)
            .unwrap();
        let keep = kept.path().to_owned();
        std::mem::forget(kept);
        assert!(!before_seal.exists() && !after_seal.exists() && !recorded.exists());
        // The ledger's newest version is 3.
        tidy(store.path(), &keep);
        assert_eq!(std::fs::read(&before_seal).unwrap(), bytes1);
        assert_eq!(std::fs::read(&after_seal).unwrap(), bytes2);
        assert!(!recorded.exists(), "a recorded version stays the hub's");
        assert_eq!(listing(&dir(store.path())), vec![keep]);
    }

    #[test]
    fn a_file_the_hub_cannot_own_outright_is_left_where_it_is() {
        let store = tempfile::tempdir().unwrap();
        let (trainer, source, bytes) = trainer_file(10);

        // Another hard link could still write it.
        let other = trainer.path().join("latest.safetensors");
        std::fs::hard_link(&source, &other).unwrap();
        let opened = Checkpoint::open(&source).unwrap();
        let why = declined(take(store.path(), &opened));
        assert!(why.contains("2 hard links"), "{why}");
        assert_eq!(std::fs::read(&source).unwrap(), bytes);
        std::fs::remove_file(&other).unwrap();

        // The name pointed at another file after the open: nothing is taken.
        let opened = Checkpoint::open(&source).unwrap();
        let swapped = trainer.path().join("swapped.safetensors");
        checkpoint(&swapped, 11);
        let swapped_bytes = std::fs::read(&swapped).unwrap();
        std::fs::rename(&swapped, &source).unwrap();
        let why = declined(take(store.path(), &opened));
        assert!(why.contains("removed or replaced"), "{why}");
        assert_eq!(std::fs::read(&source).unwrap(), swapped_bytes);

        // Outside the publish directories once resolved, or the hub's own: not taken.
        let opened = Checkpoint::open(&source).unwrap();
        let why = declined(take_in(store.path(), &opened, &|_| false, &[]).unwrap());
        assert!(why.contains("directory moved"), "{why}");
        let why = declined(
            take_in(
                store.path(),
                &opened,
                &|_| true,
                &[trainer.path().to_owned()],
            )
            .unwrap(),
        );
        assert!(why.contains("the hub's own"), "{why}");
        assert!(source.exists());

        // A sharded checkpoint is copied, not taken.
        let shards = sharded(trainer.path());
        let opened = Checkpoint::open(&shards).unwrap();
        let why = declined(take(store.path(), &opened));
        assert!(why.contains("sharded"), "{why}");
        assert!(shards.join("a.safetensors").exists());
        assert!(listing(&dir(store.path())).is_empty());
    }
}
