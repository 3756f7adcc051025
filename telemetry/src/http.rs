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
//!
//! What one client can cost is bounded ([`HttpLimits`], `docs/api.md` § Bounds): at most
//! `max_connections` connections are served at once, and at most `max_per_address` of them
//! from one IP address, so one host reopening idle connections cannot take every slot (one
//! more is answered `503 too_many_connections` and closed); a request's line and headers must arrive within
//! `header_timeout` of the connection opening or of the previous response (so an idle
//! keep-alive connection closes after it too) and fit `max_header_bytes`; a request must be
//! answered — its body read, its handler run — within `request_timeout` (`408 timeout`
//! otherwise), except on the routes a binary names as long-running; a response its client
//! stops reading for `write_timeout` ends the connection. Bodies are never read by this layer:
//! each route reads its own, after its own checks.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::task::AbortOnDropHandle;

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

/// Binds `addr` and serves [`serve`]'s routes on it in a task that lives as long as the
/// returned handle (a relay's or an actor's server, which has no drain of its own: dropping
/// the handle aborts it). Returns the bound address; a failure to serve later is logged.
pub async fn spawn(
    addr: SocketAddr,
    metrics: Metrics,
    extra: Router,
) -> io::Result<(SocketAddr, AbortOnDropHandle<()>)> {
    let (listener, at) = bind(addr).await?;
    let task = tokio::spawn(async move {
        if let Err(e) = serve(listener, metrics, extra).await {
            tracing::error!("HTTP server stopped: {e}");
        }
    });
    Ok((at, AbortOnDropHandle::new(task)))
}

/// What one HTTP client can hold and for how long (see the module docs).
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Connections served at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Connections served at once from one IP address; one more from it is answered 503 and
    /// closed.
    pub max_per_address: usize,
    /// The request line and headers must arrive within this of the connection opening or of
    /// the previous response: the header timeout and the keep-alive idle timeout.
    pub header_timeout: Duration,
    /// The largest request line and headers.
    pub max_header_bytes: usize,
    /// A request must be answered (body read, handler run, response started) within this.
    pub request_timeout: Duration,
    /// A response the client does not read for this long ends the connection.
    pub write_timeout: Duration,
    /// `(method, path)` of routes whose answer legitimately takes longer than
    /// `request_timeout` (the hub's publish, which answers once a whole checkpoint is
    /// encoded and recorded). They bound reading their bodies themselves.
    pub untimed: Vec<(axum::http::Method, String)>,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 256,
            max_per_address: 64,
            header_timeout: Duration::from_secs(10),
            max_header_bytes: 64 << 10,
            request_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            untimed: Vec::new(),
        }
    }
}

/// Connections being refused at once beyond [`HttpLimits::max_connections`] (each gets its
/// 503 within a second); past this they are closed without an answer.
const MAX_REFUSING: usize = 64;

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

/// Serves [`router`]`(metrics, extra)` on `listener` with the default [`HttpLimits`] until
/// the process exits or the task is aborted. Returns only if the listener fails.
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
    serve_with(listener, metrics, extra, HttpLimits::default(), shutdown).await
}

/// As [`serve_until`], within `limits`.
pub async fn serve_with(
    listener: TcpListener,
    metrics: Metrics,
    extra: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let limits = Arc::new(limits);
    let app = router(metrics, extra).layer(axum::middleware::from_fn_with_state(
        limits.clone(),
        request_timeout,
    ));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_header_size(limits.max_header_bytes)
        .keep_alive(true);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let per_address = Arc::new(PerAddress::default());
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection is a task of this set: none outlives the server.
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: the listener itself is fine.
                    tracing::warn!("accepting an HTTP connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let slot = match (
            per_address.take(host_of(peer.ip()), limits.max_per_address),
            slots.clone().try_acquire_owned(),
        ) {
            (Some(mine), Ok(slot)) => (mine, slot),
            (mine, _) => {
                let why = match mine {
                    None => format!(
                        "this server serves at most {} connections at once from one address; \
                         retry later",
                        limits.max_per_address
                    ),
                    Some(_) => format!(
                        "this server serves at most {} connections at once; retry later",
                        limits.max_connections
                    ),
                };
                if let Ok(permit) = refusing.clone().try_acquire_owned() {
                    connections.spawn(async move {
                        refuse_connection(stream, why).await;
                        drop(permit);
                    });
                }
                continue;
            }
        };
        let io = hyper_util::rt::TokioIo::new(WriteStall::new(stream, limits.write_timeout));
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection(io, service);
        let mut stop = stop_rx.clone();
        connections.spawn(async move {
            let _slot = slot;
            tokio::pin!(conn);
            let served = tokio::select! {
                r = conn.as_mut() => r,
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = served {
                tracing::debug!("HTTP connection ended: {e}");
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Who a peer address counts as: an IPv4 address (also when mapped into IPv6) itself, an
/// IPv6 address by its /64, the block one host is usually given (so a host cannot step past
/// its bound by changing the low bits of its address).
fn host_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let net = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(std::net::Ipv6Addr::from(net))
        }
        v4 => v4,
    }
}

/// The connections served per peer address.
#[derive(Debug, Default)]
struct PerAddress(std::sync::Mutex<std::collections::HashMap<IpAddr, usize>>);

/// One served connection's place among its address's; dropping it frees the place.
#[derive(Debug)]
struct AddressSlot {
    owner: Arc<PerAddress>,
    ip: IpAddr,
}

impl PerAddress {
    /// A place for one more connection from `ip`, if it holds fewer than `max`.
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<AddressSlot> {
        let mut live = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = live.entry(ip).or_default();
        if *n >= max.max(1) {
            return None;
        }
        *n += 1;
        Some(AddressSlot {
            owner: self.clone(),
            ip,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut live = self
            .owner
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = live.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                live.remove(&self.ip);
            }
        }
    }
}

/// The answer of a connection beyond [`HttpLimits::max_connections`] or
/// [`HttpLimits::max_per_address`]: a JSON 503 saying `why`, written without reading the
/// request, then the connection is closed (within about a second).
async fn refuse_connection(mut stream: TcpStream, why: String) {
    let body = serde_json::json!({
        "code": "too_many_connections",
        "message": why,
    })
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        // Read (and drop) what the client sent, briefly, so that closing does not reset the
        // connection before the client reads the answer.
        let mut sink = [0u8; 4096];
        let mut left = 64usize << 10;
        while left > 0 {
            let n = tokio::io::AsyncReadExt::read(&mut stream, &mut sink).await?;
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n);
        }
        io::Result::Ok(())
    })
    .await;
}

/// Answers `408 timeout` for a request not answered within [`HttpLimits::request_timeout`]
/// (its handler is dropped), except on the routes named in [`HttpLimits::untimed`].
async fn request_timeout(
    axum::extract::State(limits): axum::extract::State<Arc<HttpLimits>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let untimed = limits
        .untimed
        .iter()
        .any(|(m, p)| m == request.method() && p == request.uri().path());
    if untimed {
        return next.run(request).await;
    }
    match tokio::time::timeout(limits.request_timeout, next.run(request)).await {
        Ok(r) => r,
        Err(_) => {
            let mut r = json_error(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!(
                    "the request was not answered within {} s (its body too slow, or the server \
                     too busy)",
                    limits.request_timeout.as_secs_f64()
                ),
            );
            r.headers_mut().insert(
                header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            r
        }
    }
}

/// A stream whose writes fail (`TimedOut`) once one has waited `limit` without progress: a
/// client that stops reading a response cannot hold its connection and the response's
/// memory forever.
#[derive(Debug)]
struct WriteStall<T> {
    inner: T,
    limit: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> WriteStall<T> {
    fn new(inner: T, limit: Duration) -> Self {
        WriteStall {
            inner,
            limit,
            stalled: None,
        }
    }

    /// Maps a pending write to `TimedOut` once it has been pending for `limit`.
    fn guard<R>(&mut self, cx: &mut Context<'_>, p: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match p {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.limit;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                if timer.as_mut().poll(cx).is_ready() {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client did not read the response",
                    )))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteStall<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteStall<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.guard(cx, p)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.guard(cx, p)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_flush(cx);
        this.guard(cx, p)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.guard(cx, p)
    }
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

#[cfg(test)]
mod tests {
    use super::host_of;
    use std::net::IpAddr;

    #[test]
    fn a_host_is_its_ipv4_address_or_its_ipv6_slash_64() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("address");
        assert_eq!(host_of(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(host_of(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(host_of(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(
            host_of(ip("2001:db8:1:2:ffff::9")),
            host_of(ip("2001:db8:1:2::7"))
        );
        assert_ne!(
            host_of(ip("2001:db8:1:3::1")),
            host_of(ip("2001:db8:1:2::1"))
        );
        assert_eq!(host_of(ip("::1")), ip("::"));
    }
}
