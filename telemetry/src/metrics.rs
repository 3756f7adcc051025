//! The `starling_*` metric families and their OpenMetrics text encoding.
//!
//! One [`Metrics`] per process, cloned into every task that records (clones share the same
//! series). The families are fixed here rather than registered ad hoc by each component, so
//! the hub, relays and actors expose the same names and one dashboard serves all three:
//!
//! | family | type | labels |
//! |---|---|---|
//! | `starling_bytes_sent_total`, `starling_bytes_received_total` | counter | `peer` |
//! | `starling_segments_sent_total`, `starling_segments_received_total` | counter | `peer` |
//! | `starling_refetches_total` | counter | `peer` |
//! | `starling_versions_staged_total` | counter | |
//! | `starling_versions_active` | gauge | |
//! | `starling_worker_connected` | gauge (0/1; actors) | |
//! | `starling_transfer_seconds` | histogram, 10 ms .. 327.68 s | |
//! | `starling_apply_seconds` | histogram, 100 µs .. 26.2 s | |
//! | `starling_control_rtt_seconds` | histogram, 100 µs .. 13.1 s | |
//! | `starling_jobs_leased_total`, `starling_leases_expired_total` | counter | |
//! | `starling_results_accepted_total` | counter | |
//! | `starling_results_refused_total` | counter | `reason` (a fixed set of codes) |
//! | `starling_rollout_tokens_total` | counter | |
//!
//! A per-peer family appears in the exposition once it has its first series.
//!
//! **Label cardinality is bounded.** The `peer` label is the name of a cluster member (a relay
//! or an actor, as named in its certificate), so a real cluster has hundreds of values at most.
//! Every series costs memory for the life of the process and bytes in every scrape, though, so
//! the bound is enforced rather than assumed: the first [`MAX_PEERS`] distinct names get their
//! own series, and every later name is counted under `peer="other"` ([`OTHER_PEER`]). Series
//! are never removed, so a peer that reconnects continues its counters instead of restarting
//! them (Prometheus would read a restart as a counter reset).
//!
//! Recording is a few atomic operations plus, for per-peer families, a short mutex-guarded
//! lookup of the peer's name; it never blocks on I/O and never fails.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// The most distinct `peer` label values; later peers are folded into [`OTHER_PEER`].
pub const MAX_PEERS: usize = 4096;

/// The `peer` label value that counts every peer beyond the first [`MAX_PEERS`].
pub const OTHER_PEER: &str = "other";

/// Histogram buckets: `start × 2^k` for `k` in `0..count`.
///
/// Doubling keeps the relative error of a quantile estimate the same across the range, and
/// `start × 2^k` is exact in binary floating point, so the `le` labels print as written here.
#[derive(Debug, Clone, Copy)]
struct Buckets {
    start: f64,
    count: u16,
}

impl Buckets {
    /// A version's transfer: tens of milliseconds inside a region up to minutes for a large
    /// delta over a slow WAN link (10 ms .. 327.68 s).
    const TRANSFER: Buckets = Buckets {
        start: 0.01,
        count: 16,
    };
    /// A commit overwrites a few percent of the weights in memory: well under a millisecond
    /// for a small model up to seconds for a large one (100 µs .. 26.2 s).
    const APPLY: Buckets = Buckets {
        start: 1e-4,
        count: 19,
    };
    /// A control round trip: a LAN (~100 µs) up to a congested intercontinental link
    /// (100 µs .. 13.1 s).
    const CONTROL_RTT: Buckets = Buckets {
        start: 1e-4,
        count: 18,
    };

    fn histogram(self) -> Histogram {
        Histogram::new(exponential_buckets(self.start, 2.0, self.count))
    }
}

/// The label set of the per-peer families.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabel {
    peer: String,
}

/// The label set of refusal counts: a reason code from a fixed, small set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

/// The peer names that have their own series: at most `cap` of them, first come first served.
#[derive(Debug)]
struct PeerNames {
    admitted: Mutex<HashSet<String>>,
    cap: usize,
}

impl PeerNames {
    fn new(cap: usize) -> Self {
        Self {
            admitted: Mutex::new(HashSet::new()),
            cap,
        }
    }

    /// The label to record `peer` under: its own name if it has (or can still get) a series,
    /// [`OTHER_PEER`] otherwise.
    fn label(&self, peer: &str) -> PeerLabel {
        // Nothing panics while the lock is held, but a poisoned set is still a valid set.
        let mut admitted = self.admitted.lock().unwrap_or_else(PoisonError::into_inner);
        let own = peer != OTHER_PEER
            && (admitted.contains(peer)
                || (admitted.len() < self.cap && admitted.insert(peer.to_owned())));
        PeerLabel {
            peer: if own { peer } else { OTHER_PEER }.to_owned(),
        }
    }
}

/// The metrics of one Starling process. Cheap to clone: clones share the same series.
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    peers: PeerNames,
    bytes_sent: Family<PeerLabel, Counter>,
    bytes_received: Family<PeerLabel, Counter>,
    segments_sent: Family<PeerLabel, Counter>,
    segments_received: Family<PeerLabel, Counter>,
    refetches: Family<PeerLabel, Counter>,
    versions_staged: Counter,
    versions_active: Gauge,
    worker_connected: Gauge,
    transfer: Histogram,
    apply: Histogram,
    control_rtt: Histogram,
    jobs_leased: Counter,
    leases_expired: Counter,
    results_accepted: Counter,
    results_refused: Family<ReasonLabel, Counter>,
    rollout_tokens: Counter,
}

impl Metrics {
    /// All `starling_*` families, empty.
    pub fn new() -> Self {
        Self::with_peer_cap(MAX_PEERS)
    }

    fn with_peer_cap(cap: usize) -> Self {
        let inner = Inner {
            registry: Registry::with_prefix("starling"),
            peers: PeerNames::new(cap),
            bytes_sent: Family::default(),
            bytes_received: Family::default(),
            segments_sent: Family::default(),
            segments_received: Family::default(),
            refetches: Family::default(),
            versions_staged: Counter::default(),
            versions_active: Gauge::default(),
            worker_connected: Gauge::default(),
            transfer: Buckets::TRANSFER.histogram(),
            apply: Buckets::APPLY.histogram(),
            control_rtt: Buckets::CONTROL_RTT.histogram(),
            jobs_leased: Counter::default(),
            leases_expired: Counter::default(),
            results_accepted: Counter::default(),
            results_refused: Family::default(),
            rollout_tokens: Counter::default(),
        };
        Self {
            inner: Arc::new(inner.registered()),
        }
    }

    /// `bytes` in `segments` segments (delta frames) were sent to `peer`.
    pub fn sent(&self, peer: &str, bytes: u64, segments: u64) {
        let m = &*self.inner;
        let label = m.peers.label(peer);
        m.bytes_sent.get_or_create(&label).inc_by(bytes);
        m.segments_sent.get_or_create(&label).inc_by(segments);
    }

    /// `bytes` in `segments` segments (delta frames) were received from `peer`.
    pub fn received(&self, peer: &str, bytes: u64, segments: u64) {
        let m = &*self.inner;
        let label = m.peers.label(peer);
        m.bytes_received.get_or_create(&label).inc_by(bytes);
        m.segments_received.get_or_create(&label).inc_by(segments);
    }

    /// Something received from `peer` failed verification and is fetched again.
    pub fn refetch(&self, peer: &str) {
        let m = &*self.inner;
        m.refetches.get_or_create(&m.peers.label(peer)).inc();
    }

    /// A version was staged: complete and verified, ready to commit.
    pub fn staged(&self) {
        self.inner.versions_staged.inc();
    }

    /// `version` is now the one active (actor), served (relay) or published (hub).
    ///
    /// The gauge is an `i64`; versions beyond `i64::MAX` read as `i64::MAX`.
    pub fn set_active(&self, version: u64) {
        let v = i64::try_from(version).unwrap_or(i64::MAX);
        self.inner.versions_active.set(v);
    }

    /// Whether the actor's rollout worker is registered with the hub (`Work` sent on a live
    /// job connection); a harness waits for it before submitting work.
    pub fn set_worker_connected(&self, connected: bool) {
        self.inner.worker_connected.set(i64::from(connected));
    }

    /// A version took `elapsed` from its first segment arriving to being complete.
    pub fn observe_transfer(&self, elapsed: Duration) {
        self.inner.transfer.observe(elapsed.as_secs_f64());
    }

    /// A commit took `elapsed`.
    pub fn observe_apply(&self, elapsed: Duration) {
        self.inner.apply.observe(elapsed.as_secs_f64());
    }

    /// A control message was answered after `rtt`.
    pub fn observe_control_rtt(&self, rtt: Duration) {
        self.inner.control_rtt.observe(rtt.as_secs_f64());
    }

    /// Jobs leased to actors.
    pub fn leased(&self, jobs: u64) {
        self.inner.jobs_leased.inc_by(jobs);
    }

    /// Leases that expired (their jobs returned to the pool or failed).
    pub fn expired(&self, leases: u64) {
        self.inner.leases_expired.inc_by(leases);
    }

    /// A result accepted, with the tokens it generated.
    pub fn accepted(&self, tokens: u64) {
        self.inner.results_accepted.inc();
        self.inner.rollout_tokens.inc_by(tokens);
    }

    /// A result refused, by reason code (callers pass codes from a fixed set).
    pub fn refused(&self, reason: &str) {
        self.inner
            .results_refused
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Every family in the OpenMetrics text exposition format, ending in `# EOF`.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // The encoder fails only when its writer does (or for a histogram without buckets,
        // which `Buckets` never builds), and writing to a `String` cannot fail.
        text::encode(&mut out, &self.inner.registry)
            .expect("encoding metrics into a String cannot fail");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Inner {
    /// Registers every family under the `starling_` prefix. Counters get `_total` and
    /// histograms registered with a unit get `_seconds` from the encoder.
    fn registered(mut self) -> Self {
        let r = &mut self.registry;
        r.register(
            "bytes_sent",
            "Bytes of delta frames sent, by receiving peer",
            self.bytes_sent.clone(),
        );
        r.register(
            "bytes_received",
            "Bytes of delta frames received, by sending peer",
            self.bytes_received.clone(),
        );
        r.register(
            "segments_sent",
            "Delta segments sent, by receiving peer",
            self.segments_sent.clone(),
        );
        r.register(
            "segments_received",
            "Delta segments received, by sending peer",
            self.segments_received.clone(),
        );
        r.register(
            "refetches",
            "Fetches repeated because what a peer sent failed verification, by peer",
            self.refetches.clone(),
        );
        r.register(
            "versions_staged",
            "Versions received completely and verified, ready to commit",
            self.versions_staged.clone(),
        );
        r.register(
            "versions_active",
            "The version now active (actor), served (relay) or published (hub)",
            self.versions_active.clone(),
        );
        r.register(
            "worker_connected",
            "1 while the actor's rollout worker is registered on a live job connection to the hub",
            self.worker_connected.clone(),
        );
        r.register_with_unit(
            "transfer",
            "Time from a version's first segment to the version being complete",
            Unit::Seconds,
            self.transfer.clone(),
        );
        r.register_with_unit(
            "apply",
            "Time to commit a staged version",
            Unit::Seconds,
            self.apply.clone(),
        );
        r.register_with_unit(
            "control_rtt",
            "Round-trip time of control messages",
            Unit::Seconds,
            self.control_rtt.clone(),
        );
        r.register(
            "jobs_leased",
            "Rollout jobs (groups) leased to actors",
            self.jobs_leased.clone(),
        );
        r.register(
            "leases_expired",
            "Leases that expired before a result was accepted",
            self.leases_expired.clone(),
        );
        r.register(
            "results_accepted",
            "Rollout results (groups) accepted, exactly once per job",
            self.results_accepted.clone(),
        );
        r.register(
            "results_refused",
            "Rollout results refused, by reason",
            self.results_refused.clone(),
        );
        r.register(
            "rollout_tokens",
            "Tokens generated in accepted rollouts",
            self.rollout_tokens.clone(),
        );
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of `text` that start with `prefix`.
    fn lines_with<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(prefix)).collect()
    }

    #[test]
    fn every_family_is_described() {
        // A per-peer family is left out of the exposition until it has a series.
        let empty = Metrics::new().encode();
        assert_eq!(lines_with(&empty, "# TYPE ").len(), 10);
        assert!(!empty.contains("starling_bytes_sent"));

        let m = Metrics::new();
        m.sent("relay-eu", 0, 0);
        m.received("hub", 0, 0);
        m.refetch("hub");
        m.refused("digest");
        let text = m.encode();
        let types = lines_with(&text, "# TYPE ");
        assert_eq!(
            types,
            [
                "# TYPE starling_bytes_sent counter",
                "# TYPE starling_bytes_received counter",
                "# TYPE starling_segments_sent counter",
                "# TYPE starling_segments_received counter",
                "# TYPE starling_refetches counter",
                "# TYPE starling_versions_staged counter",
                "# TYPE starling_versions_active gauge",
                "# TYPE starling_worker_connected gauge",
                "# TYPE starling_transfer_seconds histogram",
                "# TYPE starling_apply_seconds histogram",
                "# TYPE starling_control_rtt_seconds histogram",
                "# TYPE starling_jobs_leased counter",
                "# TYPE starling_leases_expired counter",
                "# TYPE starling_results_accepted counter",
                "# TYPE starling_results_refused counter",
                "# TYPE starling_rollout_tokens counter",
            ]
        );
        assert!(text.contains("\nstarling_results_refused_total{reason=\"digest\"} 1\n"));
        assert_eq!(lines_with(&text, "# HELP ").len(), types.len());
        assert_eq!(
            lines_with(&text, "# UNIT "),
            [
                "# UNIT starling_transfer_seconds seconds",
                "# UNIT starling_apply_seconds seconds",
                "# UNIT starling_control_rtt_seconds seconds",
            ]
        );
        // Families without labels have a series from the start.
        assert!(empty.contains("\nstarling_versions_staged_total 0\n"));
        assert!(empty.contains("\nstarling_versions_active 0\n"));
        assert!(empty.contains("\nstarling_transfer_seconds_count 0\n"));
        assert!(empty.ends_with("# EOF\n"));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn counters_and_gauge_encode_exact_values() {
        let m = Metrics::new();
        m.sent("relay-eu", 1000, 2);
        m.sent("relay-eu", 500, 1);
        m.sent("actor-7", 42, 1);
        m.received("hub", 7_000_000_000, 900);
        m.refetch("hub");
        m.refetch("hub");
        m.staged();
        m.set_active(41);
        m.set_active(42);
        let text = m.encode();
        for line in [
            r#"starling_bytes_sent_total{peer="relay-eu"} 1500"#,
            r#"starling_bytes_sent_total{peer="actor-7"} 42"#,
            r#"starling_segments_sent_total{peer="relay-eu"} 3"#,
            r#"starling_segments_sent_total{peer="actor-7"} 1"#,
            r#"starling_bytes_received_total{peer="hub"} 7000000000"#,
            r#"starling_segments_received_total{peer="hub"} 900"#,
            r#"starling_refetches_total{peer="hub"} 2"#,
            "starling_versions_staged_total 1",
            "starling_versions_active 42",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn histograms_encode_buckets_count_and_sum() {
        let m = Metrics::new();
        m.observe_transfer(Duration::from_millis(250));
        m.observe_transfer(Duration::from_millis(500));
        m.observe_transfer(Duration::from_secs(1000)); // beyond the last bucket
        m.observe_apply(Duration::from_micros(50));
        m.observe_control_rtt(Duration::from_millis(3));
        let text = m.encode();

        let transfer = lines_with(&text, "starling_transfer_seconds_");
        assert_eq!(transfer.len(), 2 + 16 + 1, "sum, count, 16 buckets, +Inf");
        for line in [
            "starling_transfer_seconds_sum 1000.75",
            "starling_transfer_seconds_count 3",
            r#"starling_transfer_seconds_bucket{le="0.01"} 0"#,
            r#"starling_transfer_seconds_bucket{le="0.16"} 0"#,
            r#"starling_transfer_seconds_bucket{le="0.32"} 1"#,
            r#"starling_transfer_seconds_bucket{le="0.64"} 2"#,
            r#"starling_transfer_seconds_bucket{le="327.68"} 2"#,
            r#"starling_transfer_seconds_bucket{le="+Inf"} 3"#,
            "starling_apply_seconds_count 1",
            r#"starling_apply_seconds_bucket{le="0.0001"} 1"#,
            r#"starling_apply_seconds_bucket{le="26.2144"} 1"#,
            "starling_control_rtt_seconds_count 1",
            r#"starling_control_rtt_seconds_bucket{le="0.0016"} 0"#,
            r#"starling_control_rtt_seconds_bucket{le="0.0032"} 1"#,
            r#"starling_control_rtt_seconds_bucket{le="13.1072"} 1"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert_eq!(
            lines_with(&text, "starling_apply_seconds_bucket").len(),
            19 + 1
        );
        assert_eq!(
            lines_with(&text, "starling_control_rtt_seconds_bucket").len(),
            18 + 1
        );
    }

    #[test]
    fn peers_beyond_the_cap_are_folded_into_other() {
        let m = Metrics::new();
        for i in 0..MAX_PEERS + 10 {
            m.sent(&format!("actor-{i}"), 100, 1);
        }
        // An admitted peer keeps its own series after the cap is reached.
        m.sent("actor-0", 1, 1);
        m.received("actor-5", 1, 1);
        m.refetch(&format!("actor-{}", MAX_PEERS + 3));
        // Names count once across families: a received-only peer past the cap is "other" too.
        m.received("late-relay", 8, 1);
        let text = m.encode();

        let sent = lines_with(&text, "starling_bytes_sent_total{");
        assert_eq!(sent.len(), MAX_PEERS + 1);
        assert!(sent.contains(&r#"starling_bytes_sent_total{peer="actor-0"} 101"#));
        assert!(sent.contains(&r#"starling_bytes_sent_total{peer="other"} 1000"#));
        assert!(!text.contains(&format!("actor-{}\"", MAX_PEERS)));
        for line in [
            r#"starling_segments_sent_total{peer="other"} 10"#,
            r#"starling_bytes_received_total{peer="actor-5"} 1"#,
            r#"starling_bytes_received_total{peer="other"} 8"#,
            r#"starling_refetches_total{peer="other"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?}");
        }
    }

    #[test]
    fn a_peer_named_other_takes_no_slot() {
        let m = Metrics::with_peer_cap(1);
        m.sent(OTHER_PEER, 1, 1);
        m.sent("relay-us", 2, 1);
        m.sent("relay-eu", 4, 1);
        let text = m.encode();
        assert!(text.contains("\nstarling_bytes_sent_total{peer=\"relay-us\"} 2\n"));
        assert!(text.contains("\nstarling_bytes_sent_total{peer=\"other\"} 5\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        // Peer names come from verified certificates, but a scrape must stay parseable anyway.
        let m = Metrics::new();
        m.refetch("evil\"} 1\nstarling_x");
        let text = m.encode();
        assert!(text.contains(r#"starling_refetches_total{peer="evil\"} 1\nstarling_x"} 1"#));
    }

    #[test]
    fn clones_share_series_and_versions_saturate() {
        let m = Metrics::new();
        let clone = m.clone();
        clone.staged();
        m.staged();
        clone.set_active(u64::MAX);
        let text = m.encode();
        assert!(text.contains("\nstarling_versions_staged_total 2\n"));
        assert!(text.contains(&format!("\nstarling_versions_active {}\n", i64::MAX)));
    }
}
