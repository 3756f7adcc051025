//! The relay's own status (`GET /v1/status`, `docs/observability.md`): its link to the hub,
//! the versions it holds, and the region's actors it serves. The hub's status shows the whole
//! run; this one answers "what does this relay see" when the two disagree.
//!
//! Recording never blocks: a short critical section under a `std` mutex, called from the
//! relay's tasks (the subscriber observer's hooks and the follower's loop).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use serde_json::{Value, json};
use starling_transport::book::VersionBook;
use starling_transport::fanout::SubscriberObserver;

/// Subscribers tracked (a region has tens of actors; the bound is for hostile churn).
const MAX_SUBSCRIBERS: usize = 4096;

use starling_telemetry::unix_ms as now_ms;

/// What the relay reports about itself.
#[derive(Debug)]
pub(crate) struct RelayStatus {
    name: String,
    region: String,
    hub: SocketAddr,
    book: Arc<VersionBook>,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    hub_connected: bool,
    hub_since_ms: u64,
    rtt: Option<Duration>,
    /// The newest version verified and cached here, and when (Unix ms).
    cached: Option<(u64, u64)>,
    /// The newest version whose every byte arrived here (before its verification), and when
    /// (Unix ms): the end of its WAN transfer.
    received: Option<(u64, u64)>,
    subscribers: BTreeMap<String, Subscriber>,
}

#[derive(Debug, Default)]
struct Subscriber {
    connected: bool,
    /// What it held when it subscribed, the newest version sent to it whole, the newest it
    /// reported active: the most of these is what it has.
    subscribed_after: u64,
    delivered: u64,
    active_version: Option<u64>,
    bytes_sent: u64,
}

impl RelayStatus {
    pub(crate) fn new(name: &str, region: &str, hub: SocketAddr, book: Arc<VersionBook>) -> Self {
        RelayStatus {
            name: name.to_owned(),
            region: region.to_owned(),
            hub,
            book,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The subscription to the hub went up or down.
    pub(crate) fn hub_connected(&self, connected: bool) {
        let mut i = self.inner();
        i.hub_connected = connected;
        i.hub_since_ms = now_ms();
    }

    /// `version` was verified and cached now.
    pub(crate) fn cached(&self, version: u64) {
        let mut i = self.inner();
        if i.cached.is_none_or(|(v, _)| v < version) {
            i.cached = Some((version, now_ms()));
        }
    }

    /// Every byte of `version` arrived now (its verification and caching follow).
    pub(crate) fn received(&self, version: u64) {
        let mut i = self.inner();
        if i.received.is_none_or(|(v, _)| v <= version) {
            i.received = Some((version, now_ms()));
        }
    }

    /// A control round trip to the hub took `rtt`.
    pub(crate) fn rtt(&self, rtt: Duration) {
        self.inner().rtt = Some(rtt);
    }

    /// Whether every actor subscribed now has been sent every version up to `latest` (or
    /// held it already).
    pub(crate) fn all_delivered(&self, latest: u64) -> bool {
        self.inner().subscribers.values().all(|s| {
            !s.connected
                || s.subscribed_after
                    .max(s.delivered)
                    .max(s.active_version.unwrap_or(0))
                    >= latest
        })
    }

    fn json(&self) -> Value {
        let i = self.inner();
        let subscribers: Vec<Value> = i
            .subscribers
            .iter()
            .map(|(name, s)| {
                json!({
                    "name": name, "connected": s.connected,
                    "active_version": s.active_version, "bytes_sent": s.bytes_sent,
                })
            })
            .collect();
        json!({
            "role": "relay",
            "name": self.name,
            "region": self.region,
            "now_ms": now_ms(),
            "hub": {
                "addr": self.hub.to_string(),
                "connected": i.hub_connected,
                "since_ms": i.hub_since_ms,
                "rtt_ms": i.rtt.map(|r| r.as_secs_f64() * 1e3),
            },
            "version": self.book.latest(),
            "oldest_version": self.book.oldest(),
            // The newest version this process verified and cached itself (not one restored
            // from its disk cache at start), and when.
            "cached_version": i.cached.map(|(v, _)| v),
            "cached_at_ms": i.cached.map(|(_, at)| at),
            // The newest version received whole from upstream, before its verification.
            "received_version": i.received.map(|(v, _)| v),
            "received_at_ms": i.received.map(|(_, at)| at),
            "subscribers": subscribers,
        })
    }
}

impl SubscriberObserver for RelayStatus {
    fn subscribed(&self, peer: &str, after: u64) {
        let mut i = self.inner();
        if i.subscribers.len() >= MAX_SUBSCRIBERS && !i.subscribers.contains_key(peer) {
            return;
        }
        let s = i.subscribers.entry(peer.to_owned()).or_default();
        s.connected = true;
        s.subscribed_after = after;
        s.delivered = 0;
    }

    fn left(&self, peer: &str) {
        if let Some(s) = self.inner().subscribers.get_mut(peer) {
            s.connected = false;
        }
    }

    fn sent(&self, peer: &str, _version: u64, bytes: u64) {
        if let Some(s) = self.inner().subscribers.get_mut(peer) {
            s.bytes_sent += bytes;
        }
    }

    fn delivered(&self, peer: &str, version: u64) {
        if let Some(s) = self.inner().subscribers.get_mut(peer) {
            s.delivered = s.delivered.max(version);
        }
    }

    fn active(&self, peer: &str, version: u64) {
        if let Some(s) = self.inner().subscribers.get_mut(peer) {
            s.active_version = Some(version);
        }
    }
}

/// `GET /v1/status`.
pub(crate) fn router(status: Arc<RelayStatus>) -> Router {
    Router::new()
        .route(
            "/v1/status",
            get(|State(s): State<Arc<RelayStatus>>| async move { axum::Json(s.json()) }),
        )
        .with_state(status)
}
