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

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use starling_proto::DecodeError;
use starling_proto::container::FrameKind;
use starling_proto::manifest::SignedManifest;
use starling_proto::segment::Segment;

/// The receiving state of one version.
#[derive(Debug)]
pub struct Reception {
    pub version: u64,
    pub base: u64,
    pub delta_id: [u8; 32],
    pub started: Instant,
    seqs: BTreeSet<u32>,
    segment_count: Option<usize>,
    /// transmission → (stripes, stripes ended)
    transmissions: BTreeMap<u32, (u16, u16)>,
    fetch_outstanding: bool,
    pub bytes: u64,
}

/// What a frame added.
#[derive(Debug, PartialEq, Eq)]
pub enum Added {
    New,
    Duplicate,
}

impl Reception {
    pub fn new(version: u64, base: u64, delta_id: [u8; 32]) -> Self {
        Self {
            version,
            base,
            delta_id,
            started: Instant::now(),
            seqs: BTreeSet::new(),
            segment_count: None,
            transmissions: BTreeMap::new(),
            fetch_outstanding: false,
            bytes: 0,
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

    /// Notes a verified frame (its hash already checked). Segments of another delta are
    /// refused; the manifest is parsed for the number of segments it names.
    pub fn frame(&mut self, kind: FrameKind, body: &[u8]) -> Result<Added, DecodeError> {
        self.bytes += body.len() as u64;
        match kind {
            FrameKind::Segment => {
                let (id, seq) = Segment::peek_id(body)?;
                if id != self.delta_id {
                    return Err(DecodeError::malformed(
                        "segment",
                        "belongs to another delta than announced",
                    ));
                }
                Ok(if self.seqs.insert(seq) {
                    Added::New
                } else {
                    Added::Duplicate
                })
            }
            FrameKind::Manifest => {
                if self.segment_count.is_some() {
                    return Ok(Added::Duplicate);
                }
                let m = SignedManifest::decode_body(body)?;
                if m.manifest.delta_id() != self.delta_id {
                    return Err(DecodeError::malformed(
                        "manifest",
                        "belongs to another delta than announced",
                    ));
                }
                self.segment_count = Some(m.manifest.segments.len());
                Ok(Added::New)
            }
            FrameKind::Trailer => Ok(Added::Duplicate),
        }
    }

    /// Notes that one stripe of `transmission` ended, cleanly or with `error` (logged);
    /// returns what to `Fetch` if that was the last stripe outstanding and the version is
    /// incomplete (see [`Reception::refetch_due`]).
    pub fn stream_ended(
        &mut self,
        transmission: u32,
        stripes: u16,
        error: Option<String>,
    ) -> Option<Vec<u32>> {
        if let Some(e) = error {
            tracing::warn!(version = self.version, "a stream broke: {e}");
        }
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

    /// Forgets outstanding requests (after switching to another source).
    pub fn reset_requests(&mut self) {
        self.fetch_outstanding = false;
        self.transmissions.clear();
    }
}
