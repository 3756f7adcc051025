//! The `starling_<component>_*` metric families and their text encodings.
//!
//! One [`Metrics`] per process, made for its [`Component`] and cloned into every task that
//! records (clones share the same series). The families are fixed here rather than registered
//! ad hoc by each component, so names stay consistent; each binary exposes only the families
//! that apply to it, under its own prefix (`starling_hub_`, `starling_relay_`,
//! `starling_actor_`), with units in the name (Prometheus conventions):
//!
//! | family (after the prefix) | type | hub | relay | actor | labels |
//! |---|---|---|---|---|---|
//! | `delta_sent_bytes_total`, `delta_sent_segments_total` | counter | ✓ | ✓ | | `peer` |
//! | `delta_received_bytes_total`, `delta_received_segments_total` | counter | | ✓ | ✓ | `peer` |
//! | `refetches_total` | counter | | ✓ | ✓ | `peer` |
//! | `sources_dropped_total` | counter | | | ✓ | `peer` |
//! | `versions_staged_total` | counter | | ✓ | ✓ | |
//! | `published_version` / `newest_version` / `active_version` | gauge | ✓ | ✓ | ✓ | |
//! | `connected_peers` | gauge | ✓ | | | `role` |
//! | `upstream_connected` | gauge (0/1) | | ✓ | | |
//! | `worker_connected` | gauge (0/1) | | | ✓ | |
//! | `transfer_seconds` | histogram, 10 ms .. 327.68 s | | ✓ | ✓ | |
//! | `apply_seconds` | histogram, 100 µs .. 26.2 s | | | ✓ | |
//! | `control_rtt_seconds` | histogram, 100 µs .. 13.1 s | | ✓ | ✓ | |
//! | `delta_bytes` | histogram, 1 KiB .. 64 GiB | ✓ | | | |
//! | `publish_seconds` | histogram, 10 ms .. 327.68 s | ✓ | | | |
//! | `jobs_leased_total`, `leases_expired_total`, `leases_extended_total` | counter | ✓ | | | |
//! | `leases_released_total` | counter | ✓ | | | `reason` (a fixed set of codes) |
//! | `worker_refusals_total` | counter | ✓ | | | `reason` (a fixed set of codes) |
//! | `subscriptions_refused_total` | counter | ✓ | ✓ | | |
//! | `results_accepted_total`, `rollout_tokens_total` | counter | ✓ | | | |
//! | `results_refused_total` | counter | ✓ | | | `reason` (a fixed set of codes) |
//!
//! A per-peer family appears in the exposition once it has its first series. Recording into a
//! family the component does not expose is allowed and costs nothing visible (the transport
//! code shared by hub and relay records the same events in both).
//!
//! Two encodings: [`Metrics::encode`] writes OpenMetrics 1.0 (what Prometheus asks for when it
//! scrapes), [`Metrics::encode_prometheus`] the classic text format 0.0.4 (what `promtool
//! check metrics`, `curl` and older scrapers read), where a counter family is named with its
//! `_total` suffix and there are no `# UNIT` or `# EOF` lines.
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

/// Which binary a [`Metrics`] belongs to: its prefix and the families it exposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Component {
    /// `starling-hub`.
    Hub,
    /// `starling-relay`.
    Relay,
    /// `starling-actor`.
    Actor,
}

impl Component {
    /// The metric name prefix, e.g. `starling_hub`.
    pub fn prefix(self) -> &'static str {
        match self {
            Component::Hub => "starling_hub",
            Component::Relay => "starling_relay",
            Component::Actor => "starling_actor",
        }
    }

    /// The component's name, e.g. `hub`.
    pub fn name(self) -> &'static str {
        match self {
            Component::Hub => "hub",
            Component::Relay => "relay",
            Component::Actor => "actor",
        }
    }
}

/// Histogram buckets: `start × factor^k` for `k` in `0..count`.
///
/// Geometric buckets keep the relative error of a quantile estimate the same across the
/// range, and powers of two times the start are exact in binary floating point, so the `le`
/// labels print as written here.
#[derive(Debug, Clone, Copy)]
struct Buckets {
    start: f64,
    factor: f64,
    count: u16,
}

impl Buckets {
    /// A version's transfer: tens of milliseconds inside a region up to minutes for a large
    /// delta over a slow WAN link (10 ms .. 327.68 s). Also a publish's encode.
    const TRANSFER: Buckets = Buckets {
        start: 0.01,
        factor: 2.0,
        count: 16,
    };
    /// A commit overwrites a few percent of the weights in memory: well under a millisecond
    /// for a small model up to seconds for a large one (100 µs .. 26.2 s).
    const APPLY: Buckets = Buckets {
        start: 1e-4,
        factor: 2.0,
        count: 19,
    };
    /// A control round trip: a LAN (~100 µs) up to a congested intercontinental link
    /// (100 µs .. 13.1 s).
    const CONTROL_RTT: Buckets = Buckets {
        start: 1e-4,
        factor: 2.0,
        count: 18,
    };
    /// A delta's size: a toy model's kilobytes up to a 1T model's tens of GB (1 KiB .. 64 GiB).
    const DELTA_BYTES: Buckets = Buckets {
        start: 1024.0,
        factor: 4.0,
        count: 14,
    };

    fn histogram(self) -> Histogram {
        Histogram::new(exponential_buckets(self.start, self.factor, self.count))
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

/// The label set of connected-peer counts: a role from a fixed set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabel {
    role: String,
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
    component: Component,
    registry: Registry,
    peers: PeerNames,
    bytes_sent: Family<PeerLabel, Counter>,
    bytes_received: Family<PeerLabel, Counter>,
    segments_sent: Family<PeerLabel, Counter>,
    segments_received: Family<PeerLabel, Counter>,
    refetches: Family<PeerLabel, Counter>,
    sources_dropped: Family<PeerLabel, Counter>,
    versions_staged: Counter,
    version: Gauge,
    connected_peers: Family<RoleLabel, Gauge>,
    upstream_connected: Gauge,
    worker_connected: Gauge,
    transfer: Histogram,
    apply: Histogram,
    control_rtt: Histogram,
    delta_bytes: Histogram,
    publish: Histogram,
    jobs_leased: Counter,
    leases_expired: Counter,
    leases_released: Family<ReasonLabel, Counter>,
    leases_extended: Counter,
    worker_refusals: Family<ReasonLabel, Counter>,
    subscriptions_refused: Counter,
    results_accepted: Counter,
    results_refused: Family<ReasonLabel, Counter>,
    rollout_tokens: Counter,
}

impl Metrics {
    /// The families of `component`, empty.
    pub fn new(component: Component) -> Self {
        Self::with_peer_cap(component, MAX_PEERS)
    }

    fn with_peer_cap(component: Component, cap: usize) -> Self {
        let inner = Inner {
            component,
            registry: Registry::with_prefix(component.prefix()),
            peers: PeerNames::new(cap),
            bytes_sent: Family::default(),
            bytes_received: Family::default(),
            segments_sent: Family::default(),
            segments_received: Family::default(),
            refetches: Family::default(),
            sources_dropped: Family::default(),
            versions_staged: Counter::default(),
            version: Gauge::default(),
            connected_peers: Family::default(),
            upstream_connected: Gauge::default(),
            worker_connected: Gauge::default(),
            transfer: Buckets::TRANSFER.histogram(),
            apply: Buckets::APPLY.histogram(),
            control_rtt: Buckets::CONTROL_RTT.histogram(),
            delta_bytes: Buckets::DELTA_BYTES.histogram(),
            publish: Buckets::TRANSFER.histogram(),
            jobs_leased: Counter::default(),
            leases_expired: Counter::default(),
            leases_released: Family::default(),
            leases_extended: Counter::default(),
            worker_refusals: Family::default(),
            subscriptions_refused: Counter::default(),
            results_accepted: Counter::default(),
            results_refused: Family::default(),
            rollout_tokens: Counter::default(),
        };
        Self {
            inner: Arc::new(inner.registered()),
        }
    }

    /// The component these metrics belong to.
    pub fn component(&self) -> Component {
        self.inner.component
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

    /// `peer` broke a bound (sent more than a version can hold, announced a version far
    /// ahead) and is not used for a while.
    pub fn source_dropped(&self, peer: &str) {
        let m = &*self.inner;
        m.sources_dropped.get_or_create(&m.peers.label(peer)).inc();
    }

    /// A version was staged: complete and verified, ready to commit.
    pub fn staged(&self) {
        self.inner.versions_staged.inc();
    }

    /// `version` is now the one active (actor), newest served (relay) or published (hub).
    ///
    /// The gauge is an `i64`; versions beyond `i64::MAX` read as `i64::MAX`.
    pub fn set_active(&self, version: u64) {
        let v = i64::try_from(version).unwrap_or(i64::MAX);
        self.inner.version.set(v);
    }

    /// A peer of `role` (`relay`, `actor`, `worker`, `trainer`) connected (`+1`) or left
    /// (`-1`); hub only.
    pub fn peer_connected(&self, role: &'static str, delta: i64) {
        self.inner
            .connected_peers
            .get_or_create(&RoleLabel {
                role: role.to_owned(),
            })
            .inc_by(delta);
    }

    /// Whether the relay's subscription to the hub is live.
    pub fn set_upstream_connected(&self, connected: bool) {
        self.inner.upstream_connected.set(i64::from(connected));
    }

    /// Whether the actor's rollout worker is registered with the hub (`Work` sent on a live
    /// job connection); a harness waits for it before submitting work.
    pub fn set_worker_connected(&self, connected: bool) {
        self.inner.worker_connected.set(i64::from(connected));
    }

    /// Whether [`Metrics::set_worker_connected`] last said connected.
    pub fn worker_connected(&self) -> bool {
        self.inner.worker_connected.get() != 0
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

    /// A version was published: its delta is `bytes` long and took `elapsed` to diff and
    /// write.
    pub fn observe_publish(&self, bytes: u64, elapsed: Duration) {
        self.inner.delta_bytes.observe(bytes as f64);
        self.inner.publish.observe(elapsed.as_secs_f64());
    }

    /// Jobs leased to actors.
    pub fn leased(&self, jobs: u64) {
        self.inner.jobs_leased.inc_by(jobs);
    }

    /// Leases that expired (their jobs returned to the pool or failed).
    pub fn expired(&self, leases: u64) {
        self.inner.leases_expired.inc_by(leases);
    }

    /// Jobs the hub took back before their lease ran out, by reason (callers pass codes from a
    /// fixed set: `connection_closed` for leases of a closed job connection, `unclaimed` for
    /// shares not claimed within the claim timeout, `silent` for shares of silent actors).
    pub fn released(&self, reason: &str, jobs: u64) {
        if jobs > 0 {
            self.inner
                .leases_released
                .get_or_create(&ReasonLabel {
                    reason: reason.to_owned(),
                })
                .inc_by(jobs);
        }
    }

    /// Leases extended because their actor reported progress.
    pub fn extended(&self, leases: u64) {
        self.inner.leases_extended.inc_by(leases);
    }

    /// A worker connection closed for a limit it reached, by reason (a fixed set:
    /// `heartbeat_rate`, `staging_time_rate`, `progress_rate`, `claim_rate`, `submit_rate`, `connections`).
    pub fn worker_refused(&self, reason: &str) {
        self.inner
            .worker_refusals
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// A subscription refused because its certificate holds as many as it may.
    pub fn subscription_refused(&self) {
        self.inner.subscriptions_refused.inc();
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

    /// Every family in the Prometheus text format 0.0.4: [`Metrics::encode`] with counter
    /// families named by their samples' `_total` name, and without `# UNIT` and `# EOF`.
    pub fn encode_prometheus(&self) -> String {
        to_prometheus_text(&self.encode())
    }
}

/// Rewrites OpenMetrics text (as [`Metrics::encode`] writes it) into the Prometheus text format
/// 0.0.4. The two differ, for what this crate writes, in three ways: a counter's `# HELP` and
/// `# TYPE` name the family without `_total` in OpenMetrics and with it in 0.0.4; `# UNIT`
/// lines and the closing `# EOF` exist only in OpenMetrics.
fn to_prometheus_text(open_metrics: &str) -> String {
    let counters: HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|tag| {
            let rest = line.strip_prefix(tag)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{tag}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(l.trim_end()),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

impl Inner {
    /// Registers the families of the component under its prefix. Counters get `_total` and
    /// families registered with a unit get it (`_seconds`, `_bytes`) from the encoder.
    fn registered(mut self) -> Self {
        use Component::{Actor, Hub, Relay};
        let c = self.component;
        let on = |set: &[Component]| set.contains(&c);
        let r = &mut self.registry;
        if on(&[Hub, Relay]) {
            r.register_with_unit(
                "delta_sent",
                "Bytes of delta frames sent, by receiving peer",
                Unit::Bytes,
                self.bytes_sent.clone(),
            );
            r.register(
                "delta_sent_segments",
                "Delta segments sent, by receiving peer",
                self.segments_sent.clone(),
            );
            r.register(
                "subscriptions_refused",
                "Subscription connections refused because their certificate held as many as it may",
                self.subscriptions_refused.clone(),
            );
        }
        if on(&[Relay, Actor]) {
            r.register_with_unit(
                "delta_received",
                "Bytes of delta frames received, by sending peer",
                Unit::Bytes,
                self.bytes_received.clone(),
            );
            r.register(
                "delta_received_segments",
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
            if on(&[Actor]) {
                r.register(
                    "sources_dropped",
                    "Sources dropped for a while for breaking a bound (oversized or far-ahead versions), by peer",
                    self.sources_dropped.clone(),
                );
            }
            r.register_with_unit(
                "transfer",
                "Time from a version's first segment to the version being complete",
                Unit::Seconds,
                self.transfer.clone(),
            );
            r.register_with_unit(
                "control_rtt",
                "Round-trip time of control messages to the upstream source",
                Unit::Seconds,
                self.control_rtt.clone(),
            );
        }
        let (name, help) = match c {
            Hub => ("published_version", "The newest published version"),
            Relay => (
                "newest_version",
                "The newest version this relay holds complete and verified",
            ),
            Actor => ("active_version", "The version the actor generates with"),
        };
        r.register(name, help, self.version.clone());
        match c {
            Hub => {
                r.register(
                    "connected_peers",
                    "Peers with a live connection to the hub, by role (relay, actor, worker)",
                    self.connected_peers.clone(),
                );
                r.register_with_unit(
                    "delta",
                    "Size of each published delta checkpoint",
                    Unit::Bytes,
                    self.delta_bytes.clone(),
                );
                r.register_with_unit(
                    "publish",
                    "Time to diff, encode and durably write a published version",
                    Unit::Seconds,
                    self.publish.clone(),
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
                    "leases_released",
                    "Jobs taken back before their lease ran out, by reason",
                    self.leases_released.clone(),
                );
                r.register(
                    "leases_extended",
                    "Leases extended by their actor's progress",
                    self.leases_extended.clone(),
                );
                r.register(
                    "worker_refusals",
                    "Worker connections refused or closed for a per-actor limit, by reason",
                    self.worker_refusals.clone(),
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
            }
            Relay => r.register(
                "upstream_connected",
                "1 while the relay's subscription to the hub is live",
                self.upstream_connected.clone(),
            ),
            Actor => {
                r.register(
                    "worker_connected",
                    "1 while the actor's rollout worker is registered on a live job connection to the hub",
                    self.worker_connected.clone(),
                );
                r.register_with_unit(
                    "apply",
                    "Time to commit a staged version",
                    Unit::Seconds,
                    self.apply.clone(),
                );
            }
        }
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

    fn relay() -> Metrics {
        Metrics::new(Component::Relay)
    }

    #[test]
    fn every_family_of_a_component_is_described() {
        // A per-peer family is left out of the exposition until it has a series.
        let empty = relay().encode();
        assert_eq!(lines_with(&empty, "# TYPE ").len(), 6);
        assert!(!empty.contains("starling_relay_delta_sent_bytes"));
        assert!(empty.contains("# TYPE starling_relay_subscriptions_refused counter"));

        let m = relay();
        m.sent("eu-a1", 0, 0);
        m.received("hub", 0, 0);
        m.refetch("hub");
        let text = m.encode();
        let types = lines_with(&text, "# TYPE ");
        assert_eq!(
            types,
            [
                "# TYPE starling_relay_delta_sent_bytes counter",
                "# TYPE starling_relay_delta_sent_segments counter",
                "# TYPE starling_relay_subscriptions_refused counter",
                "# TYPE starling_relay_delta_received_bytes counter",
                "# TYPE starling_relay_delta_received_segments counter",
                "# TYPE starling_relay_refetches counter",
                "# TYPE starling_relay_versions_staged counter",
                "# TYPE starling_relay_transfer_seconds histogram",
                "# TYPE starling_relay_control_rtt_seconds histogram",
                "# TYPE starling_relay_newest_version gauge",
                "# TYPE starling_relay_upstream_connected gauge",
            ]
        );
        assert_eq!(lines_with(&text, "# HELP ").len(), types.len());
        assert_eq!(
            lines_with(&text, "# UNIT "),
            [
                "# UNIT starling_relay_delta_sent_bytes bytes",
                "# UNIT starling_relay_delta_received_bytes bytes",
                "# UNIT starling_relay_transfer_seconds seconds",
                "# UNIT starling_relay_control_rtt_seconds seconds",
            ]
        );
        // Families without labels have a series from the start.
        assert!(empty.contains("\nstarling_relay_versions_staged_total 0\n"));
        assert!(empty.contains("\nstarling_relay_newest_version 0\n"));
        assert!(empty.contains("\nstarling_relay_transfer_seconds_count 0\n"));
        assert!(empty.ends_with("# EOF\n"));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn each_component_exposes_only_its_families() {
        let hub = Metrics::new(Component::Hub);
        hub.refused("stale");
        hub.peer_connected("relay", 1);
        hub.received("x", 1, 1); // shared transport code records this on every side
        let text = hub.encode();
        for family in [
            "starling_hub_published_version gauge",
            "starling_hub_connected_peers gauge",
            "starling_hub_delta_bytes histogram",
            "starling_hub_publish_seconds histogram",
            "starling_hub_jobs_leased counter",
            "starling_hub_leases_expired counter",
            "starling_hub_results_accepted counter",
            "starling_hub_results_refused counter",
            "starling_hub_rollout_tokens counter",
        ] {
            assert!(text.contains(&format!("# TYPE {family}\n")), "{family}");
        }
        assert!(text.contains("\nstarling_hub_results_refused_total{reason=\"stale\"} 1\n"));
        assert!(text.contains("\nstarling_hub_connected_peers{role=\"relay\"} 1\n"));
        assert!(!text.contains("received"), "{text}");
        assert!(!text.contains("starling_relay_") && !text.contains("starling_actor_"));

        let actor = Metrics::new(Component::Actor).encode();
        for family in [
            "starling_actor_active_version gauge",
            "starling_actor_worker_connected gauge",
            "starling_actor_apply_seconds histogram",
            "starling_actor_versions_staged counter",
        ] {
            assert!(actor.contains(&format!("# TYPE {family}\n")), "{family}");
        }
        assert!(!actor.contains("jobs_leased") && !actor.contains("upstream_connected"));
    }

    #[test]
    fn prometheus_text_names_counters_with_total_and_drops_openmetrics_lines() {
        let m = Metrics::new(Component::Hub);
        m.sent("eu-relay", 10, 1);
        m.observe_publish(4096, Duration::from_millis(30));
        let text = m.encode_prometheus();
        for line in [
            "# HELP starling_hub_delta_sent_bytes_total Bytes of delta frames sent, by receiving peer.",
            "# TYPE starling_hub_delta_sent_bytes_total counter",
            r#"starling_hub_delta_sent_bytes_total{peer="eu-relay"} 10"#,
            "# TYPE starling_hub_delta_bytes histogram",
            "# TYPE starling_hub_published_version gauge",
            r#"starling_hub_delta_bytes_bucket{le="4096.0"} 1"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(!text.contains("# UNIT") && !text.contains("# EOF"));
        // Every TYPE line names a family whose samples follow under that name.
        for t in lines_with(&text, "# TYPE ") {
            let name = t.split(' ').nth(2).expect("a TYPE line has a name");
            assert!(
                text.lines()
                    .any(|l| !l.starts_with('#') && l.starts_with(name)),
                "{name} has no samples"
            );
        }
    }

    #[test]
    fn counters_and_gauge_encode_exact_values() {
        let m = relay();
        m.sent("relay-eu", 1000, 2);
        m.sent("relay-eu", 500, 1);
        m.sent("actor-7", 42, 1);
        m.received("hub", 7_000_000_000, 900);
        m.refetch("hub");
        m.refetch("hub");
        m.staged();
        m.set_active(41);
        m.set_active(42);
        m.set_upstream_connected(true);
        let text = m.encode();
        for line in [
            r#"starling_relay_delta_sent_bytes_total{peer="relay-eu"} 1500"#,
            r#"starling_relay_delta_sent_bytes_total{peer="actor-7"} 42"#,
            r#"starling_relay_delta_sent_segments_total{peer="relay-eu"} 3"#,
            r#"starling_relay_delta_sent_segments_total{peer="actor-7"} 1"#,
            r#"starling_relay_delta_received_bytes_total{peer="hub"} 7000000000"#,
            r#"starling_relay_delta_received_segments_total{peer="hub"} 900"#,
            r#"starling_relay_refetches_total{peer="hub"} 2"#,
            "starling_relay_versions_staged_total 1",
            "starling_relay_newest_version 42",
            "starling_relay_upstream_connected 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn histograms_encode_buckets_count_and_sum() {
        let m = Metrics::new(Component::Actor);
        m.observe_transfer(Duration::from_millis(250));
        m.observe_transfer(Duration::from_millis(500));
        m.observe_transfer(Duration::from_secs(1000)); // beyond the last bucket
        m.observe_apply(Duration::from_micros(50));
        m.observe_control_rtt(Duration::from_millis(3));
        let text = m.encode();

        let transfer = lines_with(&text, "starling_actor_transfer_seconds_");
        assert_eq!(transfer.len(), 2 + 16 + 1, "sum, count, 16 buckets, +Inf");
        for line in [
            "starling_actor_transfer_seconds_sum 1000.75",
            "starling_actor_transfer_seconds_count 3",
            r#"starling_actor_transfer_seconds_bucket{le="0.01"} 0"#,
            r#"starling_actor_transfer_seconds_bucket{le="0.16"} 0"#,
            r#"starling_actor_transfer_seconds_bucket{le="0.32"} 1"#,
            r#"starling_actor_transfer_seconds_bucket{le="0.64"} 2"#,
            r#"starling_actor_transfer_seconds_bucket{le="327.68"} 2"#,
            r#"starling_actor_transfer_seconds_bucket{le="+Inf"} 3"#,
            "starling_actor_apply_seconds_count 1",
            r#"starling_actor_apply_seconds_bucket{le="0.0001"} 1"#,
            r#"starling_actor_apply_seconds_bucket{le="26.2144"} 1"#,
            "starling_actor_control_rtt_seconds_count 1",
            r#"starling_actor_control_rtt_seconds_bucket{le="0.0016"} 0"#,
            r#"starling_actor_control_rtt_seconds_bucket{le="0.0032"} 1"#,
            r#"starling_actor_control_rtt_seconds_bucket{le="13.1072"} 1"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert_eq!(
            lines_with(&text, "starling_actor_apply_seconds_bucket").len(),
            19 + 1
        );
        assert_eq!(
            lines_with(&text, "starling_actor_control_rtt_seconds_bucket").len(),
            18 + 1
        );
    }

    #[test]
    fn peers_beyond_the_cap_are_folded_into_other() {
        let m = relay();
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

        let sent = lines_with(&text, "starling_relay_delta_sent_bytes_total{");
        assert_eq!(sent.len(), MAX_PEERS + 1);
        assert!(sent.contains(&r#"starling_relay_delta_sent_bytes_total{peer="actor-0"} 101"#));
        assert!(sent.contains(&r#"starling_relay_delta_sent_bytes_total{peer="other"} 1000"#));
        assert!(!text.contains(&format!("actor-{}\"", MAX_PEERS)));
        for line in [
            r#"starling_relay_delta_sent_segments_total{peer="other"} 10"#,
            r#"starling_relay_delta_received_bytes_total{peer="actor-5"} 1"#,
            r#"starling_relay_delta_received_bytes_total{peer="other"} 8"#,
            r#"starling_relay_refetches_total{peer="other"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?}");
        }
    }

    #[test]
    fn a_peer_named_other_takes_no_slot() {
        let m = Metrics::with_peer_cap(Component::Hub, 1);
        m.sent(OTHER_PEER, 1, 1);
        m.sent("relay-us", 2, 1);
        m.sent("relay-eu", 4, 1);
        let text = m.encode();
        assert!(text.contains("\nstarling_hub_delta_sent_bytes_total{peer=\"relay-us\"} 2\n"));
        assert!(text.contains("\nstarling_hub_delta_sent_bytes_total{peer=\"other\"} 5\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        // Peer names come from verified certificates, but a scrape must stay parseable anyway.
        let m = relay();
        m.refetch("evil\"} 1\nstarling_x");
        let text = m.encode();
        assert!(text.contains(r#"starling_relay_refetches_total{peer="evil\"} 1\nstarling_x"} 1"#));
    }

    #[test]
    fn clones_share_series_and_versions_saturate() {
        let m = relay();
        let clone = m.clone();
        clone.staged();
        m.staged();
        clone.set_active(u64::MAX);
        let text = m.encode();
        assert!(text.contains("\nstarling_relay_versions_staged_total 2\n"));
        assert!(text.contains(&format!("\nstarling_relay_newest_version {}\n", i64::MAX)));
    }
}
