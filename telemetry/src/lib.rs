//! Telemetry for every Starling binary: Prometheus metrics and the HTTP server that exposes them.
//!
//! - [`metrics`]: [`Metrics`], the fixed set of `starling_*` families that the hub, relays and
//!   actors record into (bytes and segments per peer, refetches, versions, transfer, apply and
//!   control round-trip times), encoded in the OpenMetrics text format.
//! - [`http`]: [`http::serve`], which answers `GET /metrics` and `GET /healthz` and whatever
//!   routes the binary adds (the hub adds its API).
//!
//! Invariants: recording never blocks on I/O and never fails; the number of label values is
//! bounded ([`metrics::MAX_PEERS`]), so a scrape stays small however many peers come and go.

pub mod http;
pub mod metrics;

pub use metrics::Metrics;
