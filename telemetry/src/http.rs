//! The HTTP server of a Starling binary: `GET /metrics` for Prometheus, `GET /healthz` for
//! liveness probes, and whatever routes the binary adds (the hub adds its API).
//!
//! Plain HTTP/1.1 without TLS, like any Prometheus exporter: it listens on the cluster's
//! private network, apart from the data plane (QUIC with mutual TLS). Scrapes encode the
//! current values on request; nothing is cached or sampled in the background, so the server
//! owns no task besides its accept loop and its connections.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::Metrics;

/// The content type of [`Metrics::encode`]'s output: the OpenMetrics text format.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Binds a listener on `addr` and returns it with the address it is bound to (the port
/// chosen by the system when `addr` has port 0).
pub async fn bind(addr: SocketAddr) -> io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// The routes [`serve`] answers: `GET /metrics`, `GET /healthz` and `extra`'s routes. Any
/// other path is 404, or whatever fallback `extra` sets.
///
/// # Panics
///
/// If `extra` has a route for `/metrics` or `/healthz` (axum rejects overlapping routes when
/// merging). That is a bug in the binary, found the first time it starts.
pub fn router(metrics: Metrics, extra: Router) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .route("/healthz", get(healthz))
        .with_state(metrics)
        .merge(extra)
}

/// Serves [`router`]`(metrics, extra)` on `listener` until the process exits or the task is
/// aborted. Returns only if the listener fails.
///
/// # Panics
///
/// As [`router`].
pub async fn serve(listener: TcpListener, metrics: Metrics, extra: Router) -> io::Result<()> {
    serve_until(listener, metrics, extra, std::future::pending()).await
}

/// As [`serve`], but stops accepting when `shutdown` completes and returns once the open
/// connections have finished their requests. Callers that need a bound on the drain wrap
/// this in `tokio::time::timeout`.
pub async fn serve_until(
    listener: TcpListener,
    metrics: Metrics,
    extra: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    axum::serve(listener, router(metrics, extra))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn scrape(State(metrics): State<Metrics>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        metrics.encode(),
    )
}

async fn healthz() -> &'static str {
    "ok"
}
