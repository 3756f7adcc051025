//! Receiving one version: which segments are here, which are missing, and when to ask again.
//!
//! A version arrives as one or more *transmissions*, each striped over several streams
//! (`Announce { transmission, stripes }`). A stream can end early (a frame failed its hash,
//! the stream was reset); the frames after the damage on that stream are lost, those on
//! the other stripes are not. Once every stripe of every transmission seen so far has
//! ended and the version is still incomplete, [`Reception::refetch_due`] says what to
//! `Fetch`: the segments the manifest names that are missing, or everything when the
//! manifest itself is missing. Deciding on stream ends rather than on a timer means a slow
//! link never triggers a spurious retransmission (which would double WAN bytes).
//!
//! A segment numbered at or beyond the manifest's count (frames are only checked against
//! their own hashes, so a source can send one) would leave the version forever incomplete;
//! whichever of it and the manifest comes second is answered [`Added::Beyond`], and the
//! receiver starts the version over as one that failed verification from the source that
//! sent the segment.
//!
//! Pure: frames come in already parsed ([`FrameInfo`], from [`FrameInfo::parse`] at the edge
//! where the bytes arrive), and the caller passes the time in.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use starling_proto::DecodeError;
use starling_proto::delta::container::FrameKind;
use starling_proto::delta::manifest::SignedManifest;
use starling_proto::delta::segment::Segment;

/// What a receiver needs to know of a verified frame to account for it: parsed once, where
/// the frame arrived, so the receiving core never touches bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameInfo {
    /// Segment `seq` of the announced delta.
    Segment { seq: u32 },
    /// The manifest of the announced delta, naming `segments` segments.
    Manifest { segments: usize },
    /// A trailer (files only; a stream never needs one).
    Trailer,
}

impl FrameInfo {
    /// Parses a verified frame's body (its hash already checked) of the delta `delta_id`: a
    /// segment or a manifest of another delta is refused.
    pub fn parse(kind: FrameKind, body: &[u8], delta_id: [u8; 32]) -> Result<Self, DecodeError> {
        match kind {
            FrameKind::Segment => {
                let (id, seq) = Segment::peek_id(body)?;
                if id != delta_id {
                    return Err(DecodeError::malformed(
                        "segment",
                        "belongs to another delta than announced",
                    ));
                }
                Ok(Self::Segment { seq })
            }
            FrameKind::Manifest => {
                let m = SignedManifest::decode_body(body)?;
                if m.manifest.delta_id() != delta_id {
                    return Err(DecodeError::malformed(
                        "manifest",
                        "belongs to another delta than announced",
                    ));
                }
                Ok(Self::Manifest {
                    segments: m.manifest.segments.len(),
                })
            }
            FrameKind::Trailer => Ok(Self::Trailer),
        }
    }
}

/// The receiving state of one version.
#[derive(Debug)]
pub struct Reception {
    pub version: u64,
    pub base: u64,
    pub delta_id: [u8; 32],
    /// When its first stream started here.
    pub started: Instant,
    seqs: BTreeSet<u32>,
    /// The segments of `seqs` that came before the current source (see
    /// [`Reception::reset_requests`]).
    carried: BTreeSet<u32>,
    segment_count: Option<usize>,
    /// transmission → (stripes, stripes ended)
    transmissions: BTreeMap<u32, (u16, u16)>,
    fetch_outstanding: bool,
}

/// What a frame added.
#[derive(Debug, PartialEq, Eq)]
pub enum Added {
    New,
    Duplicate,
    /// A segment numbered at or beyond the manifest's count: this one (the manifest is here),
    /// or one here before the manifest that just came. The version cannot complete from what
    /// is here; nothing of the frame was noted. `from_current`: such a segment came from the
    /// current source (else only from one before it, see
    /// [`reset_requests`](Reception::reset_requests)).
    Beyond {
        from_current: bool,
    },
}

impl Reception {
    pub fn new(version: u64, base: u64, delta_id: [u8; 32], now: Instant) -> Self {
        Self {
            version,
            base,
            delta_id,
            started: now,
            seqs: BTreeSet::new(),
            carried: BTreeSet::new(),
            segment_count: None,
            transmissions: BTreeMap::new(),
            fetch_outstanding: false,
        }
    }

    /// Registers a stripe of a transmission (its `Announce`).
    pub fn stream_started(&mut self, transmission: u32, stripes: u16) {
        if !self.transmissions.contains_key(&transmission) {
            self.fetch_outstanding = false;
        }
        self.transmissions
            .entry(transmission)
            .or_insert((stripes.max(1), 0));
    }

    /// Notes a verified frame of this delta ([`Added::Beyond`]: not noted, see there).
    pub fn frame(&mut self, info: FrameInfo) -> Added {
        match info {
            FrameInfo::Segment { seq } => {
                if self.segment_count.is_some_and(|n| seq as usize >= n) {
                    return Added::Beyond { from_current: true };
                }
                if self.seqs.insert(seq) {
                    Added::New
                } else {
                    Added::Duplicate
                }
            }
            FrameInfo::Manifest { segments } => {
                if self.segment_count.is_some() {
                    return Added::Duplicate;
                }
                if self.seqs.last().is_some_and(|&s| s as usize >= segments) {
                    let from_current = self
                        .seqs
                        .iter()
                        .any(|&s| s as usize >= segments && !self.carried.contains(&s));
                    return Added::Beyond { from_current };
                }
                self.segment_count = Some(segments);
                Added::New
            }
            FrameInfo::Trailer => Added::Duplicate,
        }
    }

    /// Notes that one stripe of `transmission` ended (cleanly or broken); returns what to
    /// `Fetch` if that was the last stripe outstanding and the version is incomplete (see
    /// [`Reception::refetch_due`]).
    pub fn stream_ended(&mut self, transmission: u32, stripes: u16) -> Option<Vec<u32>> {
        let e = self
            .transmissions
            .entry(transmission)
            .or_insert((stripes.max(1), 0));
        e.1 = e.1.saturating_add(1);
        self.refetch_due()
    }

    /// The segment numbers received so far.
    pub fn have(&self) -> Vec<u32> {
        self.seqs.iter().copied().collect()
    }

    /// Every segment the manifest names, and the manifest, are here.
    pub fn complete(&self) -> bool {
        self.segment_count
            .is_some_and(|n| self.seqs.len() == n && self.seqs.iter().all(|&s| (s as usize) < n))
    }

    /// The segment numbers still missing (empty when the manifest is: then all are).
    pub fn missing(&self) -> Vec<u32> {
        match self.segment_count {
            None => Vec::new(),
            Some(n) => (0..n as u32).filter(|s| !self.seqs.contains(s)).collect(),
        }
    }

    /// When every stripe seen has ended and the version is incomplete: what to `Fetch`
    /// (empty = the whole version). At most one request is outstanding at a time; a new
    /// transmission arriving clears it.
    pub fn refetch_due(&mut self) -> Option<Vec<u32>> {
        if self.complete() || self.fetch_outstanding || self.transmissions.is_empty() {
            return None;
        }
        if self.transmissions.values().any(|&(n, ended)| ended < n) {
            return None;
        }
        self.fetch_outstanding = true;
        Some(self.missing())
    }

    /// Forgets every frame received (what was staged of them failed) and notes that the whole
    /// version was asked for again; the transmissions under way stay counted, so a stripe
    /// that ends later still counts towards [`refetch_due`](Self::refetch_due).
    pub fn restart(&mut self) {
        self.seqs.clear();
        self.carried.clear();
        self.segment_count = None;
        self.fetch_outstanding = true;
    }

    /// Forgets outstanding requests (after switching to another source); what is here so far
    /// is noted as carried over from the sources before.
    pub fn reset_requests(&mut self) {
        self.fetch_outstanding = false;
        self.transmissions.clear();
        self.carried.clone_from(&self.seqs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fetch_is_due_once_every_stripe_ended_and_only_for_what_is_missing() {
        let mut r = Reception::new(3, 2, [1; 32], Instant::now());
        r.stream_started(0, 2);
        r.stream_started(0, 2);
        assert_eq!(r.frame(FrameInfo::Segment { seq: 0 }), Added::New);
        assert_eq!(r.frame(FrameInfo::Segment { seq: 0 }), Added::Duplicate);
        assert_eq!(r.frame(FrameInfo::Manifest { segments: 3 }), Added::New);
        assert_eq!(r.stream_ended(0, 2), None, "one stripe still runs");
        assert_eq!(r.stream_ended(0, 2), Some(vec![1, 2]));
        assert_eq!(r.refetch_due(), None, "one request at a time");
        r.stream_started(1, 1);
        r.frame(FrameInfo::Segment { seq: 1 });
        assert_eq!(r.stream_ended(1, 1), Some(vec![2]));
        r.frame(FrameInfo::Segment { seq: 2 });
        assert!(r.complete());
        assert_eq!(r.have(), vec![0, 1, 2]);
    }

    #[test]
    fn a_segment_beyond_the_manifests_count_is_refused_whichever_comes_first() {
        // The manifest first: the segment beyond is refused and not noted.
        let mut r = Reception::new(1, 0, [1; 32], Instant::now());
        r.stream_started(0, 1);
        r.frame(FrameInfo::Manifest { segments: 2 });
        assert_eq!(
            r.frame(FrameInfo::Segment { seq: 2 }),
            Added::Beyond { from_current: true }
        );
        r.frame(FrameInfo::Segment { seq: 0 });
        r.frame(FrameInfo::Segment { seq: 1 });
        assert!(r.complete());
        assert_eq!(r.have(), vec![0, 1]);

        // The segment first: the manifest is refused, the version cannot complete.
        let mut r = Reception::new(1, 0, [1; 32], Instant::now());
        r.stream_started(0, 1);
        assert_eq!(r.frame(FrameInfo::Segment { seq: 7 }), Added::New);
        assert_eq!(
            r.frame(FrameInfo::Manifest { segments: 2 }),
            Added::Beyond { from_current: true }
        );
        // After a change of source, the segment beyond came from the one before.
        r.reset_requests();
        r.frame(FrameInfo::Segment { seq: 0 });
        assert_eq!(
            r.frame(FrameInfo::Manifest { segments: 2 }),
            Added::Beyond {
                from_current: false
            }
        );
        r.frame(FrameInfo::Segment { seq: 5 });
        assert_eq!(
            r.frame(FrameInfo::Manifest { segments: 2 }),
            Added::Beyond { from_current: true }
        );
        // Started over, it completes.
        r.restart();
        r.frame(FrameInfo::Segment { seq: 0 });
        r.frame(FrameInfo::Segment { seq: 1 });
        assert_eq!(r.frame(FrameInfo::Manifest { segments: 2 }), Added::New);
        assert!(r.complete());
    }

    #[test]
    fn without_the_manifest_everything_is_fetched() {
        let mut r = Reception::new(1, 0, [1; 32], Instant::now());
        r.stream_started(0, 1);
        r.frame(FrameInfo::Segment { seq: 5 });
        assert_eq!(r.stream_ended(0, 1), Some(Vec::new()));
    }
}
