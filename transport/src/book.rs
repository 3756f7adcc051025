//! The versions a server (hub or relay) can send, each one *growing* while it is produced.
//!
//! Cut-through needs a version to be sendable before it is whole: the hub offers each
//! segment the moment the encoder emits it, a relay each segment the moment it arrived and
//! its hash checked. A [`LiveVersion`] is that shared, append-only list of wire frames plus
//! its progress (streaming, complete, aborted); every subscriber's sender reads from it at
//! its own pace, so a slow subscriber holds no copy and delays nobody else. A version is
//! *complete* only once its producer says so (the hub: every byte durable in its store; a
//! relay: the whole version verified, signature included) — only then do senders send
//! `Commit`, and only complete versions count as the book's `latest`.
//!
//! [`VersionBook`] indexes live versions by number, keeps the newest `retain` complete ones,
//! and wakes subscribers when a version starts or completes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use starling_proto::DecodeError;
use starling_proto::delta::container::{FRAME_HEADER_LEN, FrameKind, parse_frame_header};
use starling_proto::delta::segment::Segment;
use thiserror::Error;
use tokio::sync::watch;

/// A frame's bytes: in memory while its version streams, or a range of the delta file the
/// server owns once the version is complete and durable ([`LiveVersion::spill`]), so that
/// the retained versions of a server cost page cache, not heap.
#[derive(Debug, Clone)]
pub enum FrameBytes {
    Owned(Vec<u8>),
    Mapped {
        map: Arc<memmap2::Mmap>,
        range: std::ops::Range<usize>,
    },
}

impl FrameBytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            Self::Mapped { map, range } => &map[range.clone()],
        }
    }
}

impl std::ops::Deref for FrameBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// Maps a delta file of the caller's own store for [`LiveVersion::spill`] and
/// [`VersionBook::load_delta_mapped`].
pub fn map_store_file(path: &std::path::Path) -> std::io::Result<Arc<memmap2::Mmap>> {
    let file = std::fs::File::open(path)?;
    // SAFETY: a store's delta files are written once under a temporary name, made durable
    // and renamed into place, and never written again while the process runs (pruning
    // unlinks, which leaves the mapping intact); every read through the map is bounds-checked
    // against its length (`split_frames`, `WireFrame::parse_bytes`).
    #[allow(unsafe_code)]
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    Ok(Arc::new(map))
}

/// One frame as it goes on the wire (header, body, BLAKE3), shared by every sender.
#[derive(Debug)]
pub struct WireFrame {
    pub kind: FrameKind,
    /// The segment number (segments only).
    pub seq: Option<u32>,
    pub bytes: FrameBytes,
}

impl WireFrame {
    /// Indexes an encoded frame. The caller has checked (or produced) its hash.
    pub fn parse(bytes: Vec<u8>) -> Result<Self, DecodeError> {
        Self::parse_bytes(FrameBytes::Owned(bytes))
    }

    /// [`WireFrame::parse`] of bytes in memory or in a mapped file.
    pub fn parse_bytes(bytes: FrameBytes) -> Result<Self, DecodeError> {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h.copy_from_slice(
            bytes
                .get(..FRAME_HEADER_LEN)
                .ok_or(DecodeError::Truncated {
                    what: "frame header",
                })?,
        );
        let (kind, total) = parse_frame_header(&h)?;
        if total != bytes.len() {
            return Err(DecodeError::malformed(
                "frame",
                "length differs from its header",
            ));
        }
        let seq = match kind {
            FrameKind::Segment => Some(Segment::peek_id(&bytes[FRAME_HEADER_LEN..])?.1),
            _ => None,
        };
        Ok(Self { kind, seq, bytes })
    }
}

/// Where a live version stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Frames are still being added.
    Streaming,
    /// Every frame is present and the producer vouched for the whole (durable / verified).
    Complete,
    /// Abandoned (the producer failed): receivers drop what they staged of it.
    Aborted,
}

#[derive(Debug)]
struct LiveState {
    frames: Vec<Arc<WireFrame>>,
    progress: Progress,
}

/// One version, sendable while it grows.
#[derive(Debug)]
pub struct LiveVersion {
    pub version: u64,
    pub base: u64,
    pub delta_id: [u8; 32],
    pub started: Instant,
    state: watch::Sender<LiveState>,
}

/// What a sender reads next from a live version.
#[derive(Debug)]
pub enum Next {
    Frame(Arc<WireFrame>),
    End(Progress),
}

impl LiveVersion {
    fn new(version: u64, base: u64, delta_id: [u8; 32]) -> Self {
        let (state, _) = watch::channel(LiveState {
            frames: Vec::new(),
            progress: Progress::Streaming,
        });
        Self {
            version,
            base,
            delta_id,
            started: Instant::now(),
            state,
        }
    }

    /// Appends a frame and wakes the senders. A segment whose number is already present is
    /// dropped (a retransmission); frames after the end are ignored.
    pub fn push(&self, frame: WireFrame) {
        self.state.send_if_modified(|s| {
            if s.progress != Progress::Streaming {
                return false;
            }
            if let Some(seq) = frame.seq
                && s.frames.iter().any(|f| f.seq == Some(seq))
            {
                return false;
            }
            s.frames.push(Arc::new(frame));
            true
        });
    }

    fn end(&self, progress: Progress) {
        self.state.send_if_modified(|s| {
            if s.progress != Progress::Streaming {
                return false;
            }
            s.progress = progress;
            true
        });
    }

    pub fn progress(&self) -> Progress {
        self.state.borrow().progress
    }

    pub fn frame_count(&self) -> usize {
        self.state.borrow().frames.len()
    }

    /// Bytes of every frame added so far.
    pub fn bytes(&self) -> u64 {
        self.state
            .borrow()
            .frames
            .iter()
            .map(|f| f.bytes.len() as u64)
            .sum()
    }

    /// A cursor over the frames, waiting for new ones while the version streams.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            rx: self.state.subscribe(),
        }
    }

    /// Waits until the version is complete or aborted.
    pub async fn finished(&self) -> Progress {
        let mut rx = self.state.subscribe();
        loop {
            let p = rx.borrow_and_update().progress;
            if p != Progress::Streaming || rx.changed().await.is_err() {
                return p;
            }
        }
    }

    /// The frames present now (for a retransmission of a complete version).
    pub fn snapshot(&self) -> Vec<Arc<WireFrame>> {
        self.state.borrow().frames.clone()
    }

    /// Serves a complete version from `map`, its durable delta file (`.sdc`: the file header,
    /// these frames in this order, a trailer), instead of from memory: each frame is checked
    /// to be the same bytes and then replaced by its range of the file. Senders in the middle
    /// of a transmission keep the frames they hold; the memory goes when they are done.
    /// The file must never be rewritten while mapped (the server owns it; files in a store
    /// are written once, under a temporary name, then renamed).
    pub fn spill(&self, map: Arc<memmap2::Mmap>) -> Result<(), LoadError> {
        let base = map.as_ptr() as usize;
        let mut mapped = Vec::new();
        for f in starling_proto::delta::container::split_frames(&map)? {
            let start = f.as_ptr() as usize - base;
            let w = WireFrame::parse_bytes(FrameBytes::Mapped {
                map: map.clone(),
                range: start..start + f.len(),
            })?;
            if w.kind != FrameKind::Trailer {
                mapped.push(Arc::new(w));
            }
        }
        let mut result = Ok(());
        self.state.send_if_modified(|s| {
            let same = s.progress == Progress::Complete
                && s.frames.len() == mapped.len()
                && s.frames
                    .iter()
                    .zip(&mapped)
                    .all(|(a, b)| a.kind == b.kind && a.seq == b.seq && *a.bytes == *b.bytes);
            if same {
                s.frames = std::mem::take(&mut mapped);
            } else {
                result = Err(LoadError::Differs {
                    version: self.version,
                });
            }
            // The same frames at the same positions: nobody needs waking.
            false
        });
        result
    }
}

/// Reads a live version's frames by index.
#[derive(Debug)]
pub struct Cursor {
    rx: watch::Receiver<LiveState>,
}

impl Cursor {
    /// Frame `index`, waiting for it while the version streams; `End` when the version
    /// finished without one.
    pub async fn get(&mut self, index: usize) -> Next {
        loop {
            {
                let s = self.rx.borrow_and_update();
                if let Some(f) = s.frames.get(index) {
                    return Next::Frame(f.clone());
                }
                if s.progress != Progress::Streaming {
                    return Next::End(s.progress);
                }
            }
            if self.rx.changed().await.is_err() {
                return Next::End(Progress::Aborted);
            }
        }
    }
}

/// Why the book refused a change.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BookError {
    #[error("version {version} cannot start: the book is complete up to {latest}")]
    Stale { version: u64, latest: u64 },
    #[error("version {version} cannot complete before {expected}")]
    OutOfOrder { version: u64, expected: u64 },
    #[error("version {0} was never started")]
    Unknown(u64),
    #[error("version book lock poisoned")]
    Poisoned,
}

/// Why a stored delta file could not be added to a book.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("unreadable delta")]
    Decode(#[from] DecodeError),
    #[error("delta does not verify")]
    Verify(#[from] starling_proto::delta::container::AssembleError),
    #[error("the file holds version {found}, the book needs {expected}")]
    WrongVersion { found: u64, expected: u64 },
    #[error(transparent)]
    Book(#[from] BookError),
    #[error("the delta file of version {version} is not what was sent (or it is not complete)")]
    Differs { version: u64 },
}

#[derive(Debug)]
struct BookState {
    latest: u64,
    versions: BTreeMap<u64, Arc<LiveVersion>>,
}

/// The versions a server can send, newest last.
#[derive(Debug)]
pub struct VersionBook {
    inner: Mutex<BookState>,
    /// Bumped whenever a version starts, completes or aborts.
    changes: watch::Sender<u64>,
    retain: usize,
}

/// What a subscriber waiting for a version gets.
#[derive(Debug)]
pub enum Lookup {
    Live(Arc<LiveVersion>),
    /// Older than anything retained.
    Gone,
}

impl VersionBook {
    /// An empty book whose holder is complete up to `latest`; keeps the newest `retain`.
    pub fn new(latest: u64, retain: usize) -> Self {
        let (changes, _) = watch::channel(0);
        Self {
            inner: Mutex::new(BookState {
                latest,
                versions: BTreeMap::new(),
            }),
            changes,
            retain: retain.max(1),
        }
    }

    /// The newest complete version.
    pub fn latest(&self) -> u64 {
        self.inner.lock().map(|s| s.latest).unwrap_or(0)
    }

    /// The oldest version still retained (`latest + 1` when none is).
    pub fn oldest(&self) -> u64 {
        self.inner
            .lock()
            .map(|s| {
                s.versions
                    .keys()
                    .next()
                    .copied()
                    .unwrap_or(s.latest.saturating_add(1))
            })
            .unwrap_or(0)
    }

    pub fn get(&self, version: u64) -> Option<Arc<LiveVersion>> {
        self.inner
            .lock()
            .ok()
            .and_then(|s| s.versions.get(&version).cloned())
    }

    /// Starts version `version` (which must follow the complete ones). A started but
    /// unfinished version of the same number is aborted and replaced: its producer failed.
    pub fn begin(
        &self,
        version: u64,
        base: u64,
        delta_id: [u8; 32],
    ) -> Result<Arc<LiveVersion>, BookError> {
        let live = Arc::new(LiveVersion::new(version, base, delta_id));
        {
            let mut s = self.inner.lock().map_err(|_| BookError::Poisoned)?;
            if version <= s.latest {
                return Err(BookError::Stale {
                    version,
                    latest: s.latest,
                });
            }
            if let Some(old) = s.versions.insert(version, live.clone()) {
                old.end(Progress::Aborted);
            }
        }
        self.changes.send_modify(|n| *n += 1);
        Ok(live)
    }

    /// Marks `version` complete: it becomes `latest` and senders send `Commit`.
    pub fn complete(&self, version: u64) -> Result<(), BookError> {
        {
            let mut s = self.inner.lock().map_err(|_| BookError::Poisoned)?;
            if version != s.latest + 1 {
                return Err(BookError::OutOfOrder {
                    version,
                    expected: s.latest + 1,
                });
            }
            let live = s
                .versions
                .get(&version)
                .ok_or(BookError::Unknown(version))?
                .clone();
            live.end(Progress::Complete);
            s.latest = version;
            while s.versions.len() > self.retain {
                let Some((&oldest, _)) = s.versions.iter().next() else {
                    break;
                };
                if oldest >= s.latest {
                    break;
                }
                s.versions.remove(&oldest);
            }
        }
        self.changes.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Adds a stored, complete delta file (`.sdc` bytes) as the next version, after verifying
    /// it as a whole under `trust`. Returns its version.
    pub fn load_delta(
        &self,
        bytes: &[u8],
        trust: &starling_proto::delta::manifest::TrustPolicy,
    ) -> Result<u64, LoadError> {
        let expected = self.load_frames(bytes, trust, |f| Ok(FrameBytes::Owned(f.to_vec())))?;
        self.complete(expected)?;
        Ok(expected)
    }

    /// [`VersionBook::load_delta`] of a delta file the caller owns, mapped: its frames are
    /// served from the file, not copied into memory.
    pub fn load_delta_mapped(
        &self,
        map: Arc<memmap2::Mmap>,
        trust: &starling_proto::delta::manifest::TrustPolicy,
    ) -> Result<u64, LoadError> {
        let base = map.as_ptr() as usize;
        let expected = self.load_frames(&map, trust, |f| {
            let start = f.as_ptr() as usize - base;
            Ok(FrameBytes::Mapped {
                map: map.clone(),
                range: start..start + f.len(),
            })
        })?;
        self.complete(expected)?;
        Ok(expected)
    }

    /// Verifies a whole delta file and starts its version with its frames (not completed).
    fn load_frames(
        &self,
        bytes: &[u8],
        trust: &starling_proto::delta::manifest::TrustPolicy,
        keep: impl Fn(&[u8]) -> Result<FrameBytes, LoadError>,
    ) -> Result<u64, LoadError> {
        let expected = self.latest() + 1;
        let delta = starling_proto::delta::container::read_delta(bytes, trust)?;
        let m = &delta.manifest.manifest;
        if m.version != expected {
            return Err(LoadError::WrongVersion {
                found: m.version,
                expected,
            });
        }
        let live = self.begin(expected, m.base_version, m.delta_id())?;
        for f in starling_proto::delta::container::split_frames(bytes)? {
            let w = WireFrame::parse_bytes(keep(f)?)?;
            if w.kind != FrameKind::Trailer {
                live.push(w);
            }
        }
        Ok(expected)
    }

    /// Restarts the chain at `version` (a relay that restored an anchor of it): every version
    /// up to it is dropped (one still streaming is aborted), `version` becomes the newest
    /// complete one, and a subscriber still waiting for an older version learns it is gone
    /// (it restores the anchor in turn). Never moves the chain back.
    pub fn restart_at(&self, version: u64) -> Result<(), BookError> {
        {
            let mut s = self.inner.lock().map_err(|_| BookError::Poisoned)?;
            if version <= s.latest {
                return Err(BookError::Stale {
                    version,
                    latest: s.latest,
                });
            }
            let kept = s.versions.split_off(&(version + 1));
            for old in std::mem::replace(&mut s.versions, kept).into_values() {
                if old.progress() == Progress::Streaming {
                    old.end(Progress::Aborted);
                }
            }
            s.latest = version;
        }
        self.changes.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Abandons an unfinished version (its producer failed); receivers drop it.
    pub fn abort(&self, version: u64) {
        if let Ok(mut s) = self.inner.lock()
            && let Some(live) = s.versions.get(&version)
            && live.progress() == Progress::Streaming
        {
            live.end(Progress::Aborted);
            s.versions.remove(&version);
        }
        self.changes.send_modify(|n| *n += 1);
    }

    /// Waits until `version` has started here (or is known to be gone).
    pub async fn wait_for(&self, version: u64) -> Lookup {
        let mut rx = self.changes.subscribe();
        loop {
            rx.borrow_and_update();
            if let Ok(s) = self.inner.lock() {
                if let Some(v) = s.versions.get(&version) {
                    return Lookup::Live(v.clone());
                }
                if version <= s.latest {
                    return Lookup::Gone;
                }
            }
            if rx.changed().await.is_err() {
                return Lookup::Gone;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use starling_proto::delta::container::encode_frame;

    fn seg(delta_id: [u8; 32], seq: u8) -> WireFrame {
        let mut body = delta_id.to_vec();
        body.push(seq);
        body.push(0);
        WireFrame::parse(encode_frame(FrameKind::Segment, &body)).unwrap()
    }

    #[tokio::test]
    async fn a_cursor_sees_frames_as_they_are_pushed_and_the_end() {
        let book = VersionBook::new(0, 4);
        let live = book.begin(1, 0, [7; 32]).unwrap();
        let mut c = live.cursor();
        live.push(seg([7; 32], 0));
        assert!(matches!(c.get(0).await, Next::Frame(f) if f.seq == Some(0)));
        let waiter = tokio::spawn(async move { c.get(1).await });
        tokio::task::yield_now().await;
        live.push(seg([7; 32], 1));
        assert!(matches!(waiter.await.unwrap(), Next::Frame(f) if f.seq == Some(1)));
        live.push(seg([7; 32], 1));
        assert_eq!(
            live.frame_count(),
            2,
            "a retransmitted segment is not added twice"
        );
        book.complete(1).unwrap();
        assert!(matches!(
            live.cursor().get(2).await,
            Next::End(Progress::Complete)
        ));
        assert_eq!(book.latest(), 1);
    }

    #[tokio::test]
    async fn a_restart_at_an_anchor_drops_older_versions_and_tells_their_waiters() {
        let book = VersionBook::new(0, 8);
        book.begin(1, 0, [1; 32]).unwrap();
        book.complete(1).unwrap();
        let streaming = book.begin(2, 1, [2; 32]).unwrap();
        book.restart_at(5).unwrap();
        assert_eq!((book.latest(), book.oldest()), (5, 6));
        assert_eq!(streaming.progress(), Progress::Aborted);
        assert!(matches!(book.wait_for(3).await, Lookup::Gone));
        assert!(matches!(book.restart_at(5), Err(BookError::Stale { .. })));
        book.begin(6, 5, [6; 32]).unwrap();
        book.complete(6).unwrap();
        assert_eq!(book.latest(), 6);
    }

    /// A file as the store holds it: the file header, the frames, a trailer-kind frame.
    fn store_file(dir: &std::path::Path, frames: &[&WireFrame], flip: bool) -> Arc<memmap2::Mmap> {
        let mut bytes = starling_proto::delta::container::file_header().to_vec();
        for f in frames {
            bytes.extend_from_slice(&f.bytes);
        }
        if flip {
            let at = bytes.len() - 40;
            bytes[at] ^= 1;
        }
        bytes.extend_from_slice(&encode_frame(FrameKind::Trailer, b"end"));
        let path = dir.join("v1.sdc");
        std::fs::write(&path, bytes).unwrap();
        map_store_file(&path).unwrap()
    }

    #[tokio::test]
    async fn a_complete_version_is_served_from_its_file_with_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let book = VersionBook::new(0, 4);
        let live = book.begin(1, 0, [7; 32]).unwrap();
        let (a, b) = (seg([7; 32], 0), seg([7; 32], 1));
        let file = store_file(dir.path(), &[&a, &b], false);
        live.push(seg([7; 32], 0));
        live.push(seg([7; 32], 1));
        // Not while it streams: the file may not hold every frame yet.
        assert!(matches!(
            live.spill(file.clone()),
            Err(LoadError::Differs { version: 1 })
        ));
        book.complete(1).unwrap();
        live.spill(file).unwrap();
        let mut c = live.cursor();
        for (i, want) in [a, b].iter().enumerate() {
            let Next::Frame(f) = c.get(i).await else {
                panic!("frame {i} missing");
            };
            assert!(matches!(f.bytes, FrameBytes::Mapped { .. }));
            assert_eq!(*f.bytes, *want.bytes);
        }
        assert!(matches!(c.get(2).await, Next::End(Progress::Complete)));
    }

    #[tokio::test]
    async fn a_file_that_differs_from_what_was_sent_is_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let book = VersionBook::new(0, 4);
        let live = book.begin(1, 0, [7; 32]).unwrap();
        let a = seg([7; 32], 0);
        let file = store_file(dir.path(), &[&a], true);
        live.push(seg([7; 32], 0));
        book.complete(1).unwrap();
        assert!(live.spill(file).is_err());
        let Next::Frame(f) = live.cursor().get(0).await else {
            panic!("frame missing");
        };
        assert!(matches!(f.bytes, FrameBytes::Owned(_)), "still from memory");
    }

    #[tokio::test]
    async fn versions_complete_in_order_and_old_ones_are_dropped() {
        let book = VersionBook::new(0, 2);
        book.begin(1, 0, [1; 32]).unwrap();
        book.begin(2, 1, [2; 32]).unwrap();
        assert_eq!(
            book.complete(2),
            Err(BookError::OutOfOrder {
                version: 2,
                expected: 1
            })
        );
        book.complete(1).unwrap();
        book.complete(2).unwrap();
        assert_eq!(
            book.begin(2, 1, [3; 32]).unwrap_err(),
            BookError::Stale {
                version: 2,
                latest: 2
            }
        );
        book.begin(3, 2, [3; 32]).unwrap();
        book.complete(3).unwrap();
        assert!(book.get(1).is_none());
        assert_eq!(book.oldest(), 2);
        assert!(matches!(book.wait_for(1).await, Lookup::Gone));
    }

    #[tokio::test]
    async fn restarting_a_version_aborts_the_unfinished_one() {
        let book = Arc::new(VersionBook::new(0, 4));
        let first = book.begin(1, 0, [1; 32]).unwrap();
        let waiter = {
            let b = book.clone();
            tokio::spawn(async move { b.wait_for(2).await })
        };
        let second = book.begin(1, 0, [9; 32]).unwrap();
        assert_eq!(first.finished().await, Progress::Aborted);
        assert_eq!(second.progress(), Progress::Streaming);
        book.complete(1).unwrap();
        book.begin(2, 1, [2; 32]).unwrap();
        assert!(matches!(waiter.await.unwrap(), Lookup::Live(v) if v.version == 2));
    }
}
