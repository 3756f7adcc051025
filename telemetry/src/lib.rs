//! Telemetry for every Starling binary: logs, Prometheus metrics and the HTTP server that
//! exposes them.
//!
//! - [`logging`]: [`logging::init`], structured logs on stderr (human or JSON, `RUST_LOG`
//!   filtering), and the `--log-format`/`--log` flags every binary takes.
//! - [`metrics`]: [`Metrics`], the fixed set of `starling_<component>_*` families that the hub,
//!   relays and actors record into (bytes and segments per peer, refetches, versions, transfer,
//!   apply and control round-trip times, jobs and results), encoded as OpenMetrics or the
//!   Prometheus text format.
//! - [`http`]: [`http::serve`], which answers `GET /metrics` and `GET /healthz` and whatever
//!   routes the binary adds (`/v1/status`; the hub adds its API, events and dashboard), with
//!   JSON errors for unknown routes and methods.
//!
//! Invariants: recording never blocks on I/O and never fails; the number of label values is
//! bounded ([`metrics::MAX_PEERS`]), so a scrape stays small however many peers come and go.

pub mod http;
pub mod logging;
pub mod metrics;

pub use metrics::{Component, Metrics};
