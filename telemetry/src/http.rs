//! The HTTP server of a Starling binary: `GET /metrics` for Prometheus, `GET /healthz` for
//! liveness probes, and whatever routes the binary adds (`/v1/status` everywhere; the hub adds
//! its API, its events and its dashboard).
//!
//! Every error this server answers is JSON, `{"code", "message"}` with a status code: an
//! unknown route (404 `not_found`), a known route with another method (405
//! `method_not_allowed`); the binaries' own routes answer the same shape ([`json_error`]).
//! `/metrics` negotiates its format: OpenMetrics 1.0 when the scraper asks for it (Prometheus
//! does), else the classic Prometheus text format 0.0.4 (`promtool check metrics`, `curl`).
//!
//! Plain HTTP/1.1 without TLS, like any Prometheus exporter: it listens on the cluster's
//! private network, apart from the data plane (QUIC with mutual TLS). Scrapes encode the
//! current values on request; nothing is cached or sampled in the background, so the server
//! owns no task besides its accept loop and its connections.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;

use crate::Metrics;

/// The content type of [`Metrics::encode`]'s output: the OpenMetrics text format.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of [`Metrics::encode_prometheus`]'s output: the text format 0.0.4.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The largest request body any route of any binary takes (the hub's batch JSON). A request
/// that declares more is refused with a JSON 413 before its body is read; a body that grows
/// past a route's own limit while streaming is cut off by that route's `DefaultBodyLimit`.
pub const MAX_REQUEST_BODY: u64 = 64 << 20;

/// A JSON error response: `{"code": code, "message": message}` with `status`.
pub fn json_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"code": code, "message": message.into()});
    (status, Json(body)).into_response()
}

/// Binds a listener on `addr` and returns it with the address it is bound to (the port
/// chosen by the system when `addr` has port 0).
pub async fn bind(addr: SocketAddr) -> io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// The routes [`serve`] answers: `GET /metrics`, `GET /healthz` and `extra`'s routes. Any
/// other path is a JSON 404, another method on a known path a JSON 405.
///
/// # Panics
///
/// If `extra` has a route for `/metrics` or `/healthz`, or a fallback of its own (axum
/// rejects both when merging). That is a bug in the binary, found the first time it starts.
pub fn router(metrics: Metrics, extra: Router) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .route("/healthz", get(healthz))
        .with_state(metrics)
        .merge(extra)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(refuse_oversized))
}

/// Answers a request whose declared body exceeds [`MAX_REQUEST_BODY`] with a JSON 413 at once,
/// without reading it (and without waiting for it to arrive).
async fn refuse_oversized(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > MAX_REQUEST_BODY => json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("a request body of {n} bytes; the limit is {MAX_REQUEST_BODY}"),
        ),
        _ => next.run(request).await,
    }
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

async fn scrape(State(metrics): State<Metrics>, headers: HeaderMap) -> impl IntoResponse {
    let open_metrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if open_metrics {
        (
            [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
            metrics.encode(),
        )
    } else {
        (
            [(header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)],
            metrics.encode_prometheus(),
        )
    }
}

async fn not_found() -> Response {
    json_error(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such route; see docs/api.md and docs/observability.md",
    )
}

async fn method_not_allowed() -> Response {
    json_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method; see docs/api.md",
    )
}

async fn healthz() -> &'static str {
    "ok"
}
