//! Telemetry for every Starling binary: what lets a process be watched from outside —
//! Prometheus metrics, status documents and the HTTP server that exposes them.
//!
//! Being a process (logs, the fatal-error exit, signals, the service runner, error chains) is
//! `starling-process`'s job, not this crate's; this crate does not depend on it.
//!
//! - [`metrics`]: [`Metrics`], the fixed set of `starling_<component>_*` families that the hub,
//!   relays and actors record into (bytes and segments per peer, refetches, versions, transfer,
//!   apply and control round-trip times, jobs and results), encoded as OpenMetrics or the
//!   Prometheus text format.
//! - [`http_client`]: a blocking HTTP/1.1 client for the local JSON APIs processes call.
//! - [`http`]: [`http::serve`], which answers `GET /metrics` and `GET /healthz` and whatever
//!   routes the binary adds (`/v1/status`; the hub adds its API, events and dashboard), with
//!   JSON errors for unknown routes and methods.
//!
//! Invariants: recording never blocks on I/O and never fails; the number of label values is
//! bounded ([`metrics::MAX_PEERS`]), so a scrape stays small however many peers come and go.

pub mod http;
pub mod http_client;
pub mod metrics;

pub use metrics::{Component, Metrics};

/// Milliseconds since the Unix epoch, as status documents report times (0 before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
