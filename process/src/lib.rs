//! The shell every Starling binary runs in: what it takes to be a process, apart from what
//! the process does.
//!
//! - [`logging`]: [`logging::init`], structured logs on stderr (human or JSON, `RUST_LOG`
//!   filtering), the `--log-format`/`--log` flags every binary takes, and [`logging::fatal`],
//!   the one way to report the error that ends the process.
//! - [`signal`]: [`signal::shutdown_signal`], the moment the process is asked to stop
//!   (SIGTERM or SIGINT).
//! - [`service`]: [`service::run_service`], a service binary's `main`: a runtime, a
//!   [`CancellationToken`](tokio_util::sync::CancellationToken) cancelled at the first
//!   signal so the service drains, and the exit code.
//! - [`error_chain`]: an error and its causes as one line, for the places that keep an error
//!   as text.
//!
//! Why a crate of its own: the hub, relays, actors and the `starling` command all start, log,
//! stop and fail the same way, and none of that is about the QUIC transport or about being
//! watched (`starling-telemetry`: metrics, status, their HTTP server). It stays at the bottom
//! of the graph: it depends on no other Starling crate (tests aside), so any crate can use it.
//!
//! Invariants: logging is set up at most once per process, and once JSON logs are on, every
//! line on stderr is JSON ([`logging::fatal`] included); [`service::run_service`] cancels its
//! token only on a signal, and a second signal ends the process without waiting for the drain.

mod error_chain;
pub mod logging;
pub mod service;
pub mod signal;

pub use error_chain::error_chain;
