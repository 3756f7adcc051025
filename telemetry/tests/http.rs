//! The metrics server over real sockets: a hand-written HTTP/1.1 client against `serve`.
//!
//! By hand on purpose, not through `http_client`: these tests decide every byte the server
//! sees and when (headers that never finish, a body that stalls, connections held open, a
//! client that stops reading), which a well-behaved client does not do.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use starling_telemetry::Metrics;
use starling_telemetry::http::{self, METRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE};
use starling_telemetry::metrics::Component;
use starling_telemetry::metrics::MAX_PEERS;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Bound on any one exchange with the server, so that a hang fails the test.
const TIMEOUT: Duration = Duration::from_secs(10);

/// A server on 127.0.0.1 with an ephemeral port, stopped (aborted) when dropped.
struct Server {
    addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(metrics: Metrics, extra: Router) -> Self {
        let (listener, addr) = http::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind the metrics listener");
        let task = tokio::spawn(http::serve(listener, metrics, extra));
        Self { addr, task }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether the body has `line` as a whole line.
    fn has_line(&self, line: &str) -> bool {
        self.body.lines().any(|l| l == line)
    }
}

/// Sends one request on a fresh connection (`Connection: close`) and reads the whole response.
async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Response {
    request_with(addr, method, path, "", body).await
}

/// A connection to `addr` from the loopback address `from` (any of 127.0.0.0/8 on Linux).
async fn connect_from(from: &str, addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(format!("{from}:0").parse().expect("address"))
        .expect("bind");
    socket.connect(addr).await.expect("connect")
}

/// `GET /healthz` on a fresh connection from `from`: the status and body.
async fn healthz_from(from: &str, addr: SocketAddr) -> Response {
    tokio::time::timeout(TIMEOUT, async {
        let mut stream = connect_from(from, addr).await;
        let head = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await.expect("write head");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read response");
        parse(&String::from_utf8(raw).expect("response is UTF-8"))
    })
    .await
    .expect("response within the timeout")
}

/// [`request`] with extra header lines (each ending in `\r\n`).
async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> Response {
    tokio::time::timeout(TIMEOUT, async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\
             {headers}Connection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.expect("write head");
        stream.write_all(body.as_bytes()).await.expect("write body");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read response");
        parse(&String::from_utf8(raw).expect("response is UTF-8"))
    })
    .await
    .expect("response within the timeout")
}

/// Parses a response with a `Content-Length` body (what axum sends for a complete body).
fn parse(raw: &str) -> Response {
    let (head, body) = raw.split_once("\r\n\r\n").expect("end of headers");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let mut parts = status_line.splitn(3, ' ');
    assert_eq!(parts.next(), Some("HTTP/1.1"), "{status_line}");
    let status = parts
        .next()
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (n, v) = l.split_once(':').expect("header line");
            (n.trim().to_owned(), v.trim().to_owned())
        })
        .collect();
    let response = Response {
        status,
        headers,
        body: body.to_owned(),
    };
    let len: usize = response
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .expect("content-length");
    assert_eq!(len, response.body.len(), "body length");
    response
}

#[tokio::test]
async fn metrics_are_scraped_with_exact_values() {
    let metrics = Metrics::new(Component::Relay);
    let server = Server::start(metrics.clone(), Router::new()).await;

    metrics.sent("relay-eu", 1_048_576, 4);
    metrics.sent("relay-eu", 1_048_576, 4);
    metrics.received("hub", 123, 1);
    metrics.refetch("hub");
    metrics.staged();
    metrics.staged();
    metrics.set_active(17);
    metrics.observe_transfer(Duration::from_millis(1500));
    metrics.observe_transfer(Duration::from_millis(250));
    metrics.observe_apply(Duration::from_micros(250));
    metrics.observe_control_rtt(Duration::from_micros(500));
    metrics.observe_control_rtt(Duration::from_millis(2));

    let accept = "Accept: application/openmetrics-text; version=1.0.0,text/plain;q=0.5\r\n";
    let r = request_with(server.addr, "GET", "/metrics", accept, "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some(METRICS_CONTENT_TYPE));
    for line in [
        r#"starling_relay_delta_sent_bytes_total{peer="relay-eu"} 2097152"#,
        r#"starling_relay_delta_sent_segments_total{peer="relay-eu"} 8"#,
        r#"starling_relay_delta_received_bytes_total{peer="hub"} 123"#,
        r#"starling_relay_delta_received_segments_total{peer="hub"} 1"#,
        r#"starling_relay_refetches_total{peer="hub"} 1"#,
        "starling_relay_versions_staged_total 2",
        "starling_relay_newest_version 17",
        "starling_relay_transfer_seconds_count 2",
        "starling_relay_transfer_seconds_sum 1.75",
        r#"starling_relay_transfer_seconds_bucket{le="0.32"} 1"#,
        r#"starling_relay_transfer_seconds_bucket{le="2.56"} 2"#,
        "starling_relay_control_rtt_seconds_count 2",
        "starling_relay_control_rtt_seconds_sum 0.0025",
    ] {
        assert!(r.has_line(line), "missing {line:?} in\n{}", r.body);
    }
    assert!(r.body.ends_with("# EOF\n"));

    // Without an OpenMetrics Accept header: the classic text format, same samples.
    let plain = request(server.addr, "GET", "/metrics", "").await;
    assert_eq!(plain.header("content-type"), Some(PROMETHEUS_CONTENT_TYPE));
    assert!(plain.has_line("# TYPE starling_relay_versions_staged_total counter"));
    assert!(plain.has_line("starling_relay_versions_staged_total 2"));
    assert!(!plain.body.contains("# EOF"));

    // A second scrape sees later values: nothing is cached.
    metrics.set_active(18);
    let r = request(server.addr, "GET", "/metrics", "").await;
    assert!(r.has_line("starling_relay_newest_version 18"), "{}", r.body);
}

#[tokio::test]
async fn healthz_unknown_paths_and_extra_routes() {
    let extra = Router::new().route(
        "/v1/versions",
        post(|body: String| async move { format!("published {body}") }),
    );
    let server = Server::start(Metrics::new(Component::Relay), extra).await;

    let r = request(server.addr, "GET", "/healthz", "").await;
    assert_eq!((r.status, r.body.as_str()), (200, "ok"));

    let r = request(server.addr, "POST", "/v1/versions", "v42").await;
    assert_eq!((r.status, r.body.as_str()), (200, "published v42"));

    let r = request(server.addr, "GET", "/nope", "").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(r.body.contains(r#""code":"not_found""#), "{}", r.body);
    assert_eq!(
        request(server.addr, "GET", "/metrics/x", "").await.status,
        404
    );
    // Known paths, wrong methods.
    assert_eq!(
        request(server.addr, "POST", "/metrics", "").await.status,
        405
    );
    let r = request(server.addr, "GET", "/v1/versions", "").await;
    assert_eq!(r.status, 405);
    assert!(
        r.body.contains(r#""code":"method_not_allowed""#),
        "{}",
        r.body
    );
}

#[tokio::test]
async fn scrape_holds_at_most_max_peers_plus_other() {
    let metrics = Metrics::new(Component::Relay);
    let server = Server::start(metrics.clone(), Router::new()).await;
    for i in 0..MAX_PEERS + 100 {
        metrics.received(&format!("actor-{i}"), 10, 1);
    }

    let r = request(server.addr, "GET", "/metrics", "").await;
    assert_eq!(r.status, 200);
    let series = r
        .body
        .lines()
        .filter(|l| l.starts_with("starling_relay_delta_received_bytes_total{"))
        .count();
    assert_eq!(series, MAX_PEERS + 1);
    assert!(r.has_line(r#"starling_relay_delta_received_bytes_total{peer="actor-0"} 10"#));
    assert!(r.has_line(r#"starling_relay_delta_received_bytes_total{peer="other"} 1000"#));
    assert!(r.has_line(r#"starling_relay_delta_received_segments_total{peer="other"} 100"#));
}

#[tokio::test]
async fn serve_until_returns_after_shutdown() {
    let (listener, addr) = http::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(http::serve_until(
        listener,
        Metrics::new(Component::Relay),
        Router::new(),
        async move {
            // A dropped sender is a shutdown too.
            let _ = stopped.await;
        },
    ));
    assert_eq!(request(addr, "GET", "/healthz", "").await.status, 200);

    stop.send(()).expect("server is running");
    let result = tokio::time::timeout(TIMEOUT, task)
        .await
        .expect("server stops within the timeout")
        .expect("server task does not panic");
    assert!(result.is_ok(), "{result:?}");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "listener is closed after shutdown"
    );
}

/// A server with `limits` and `extra` routes, stopped (aborted) when dropped.
async fn start_limited(limits: http::HttpLimits, extra: Router) -> Server {
    let (listener, addr) = http::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let task = tokio::spawn(http::serve_with(
        listener,
        Metrics::new(Component::Hub),
        extra,
        limits,
        std::future::pending(),
    ));
    Server { addr, task }
}

/// Reads until the peer closes the connection (or resets it); returns what arrived and how
/// long that took.
async fn read_until_closed(stream: &mut TcpStream) -> (Vec<u8>, Duration) {
    let started = std::time::Instant::now();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return (got, started.elapsed()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test]
async fn a_request_whose_headers_never_finish_is_closed_after_the_header_timeout() {
    let limits = http::HttpLimits {
        header_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let server = start_limited(limits, Router::new()).await;
    // Half a request, then silence (a slowloris client).
    let mut s = TcpStream::connect(server.addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let (_, took) = tokio::time::timeout(Duration::from_secs(20), read_until_closed(&mut s))
        .await
        .expect("the server closes the connection");
    assert!(took >= Duration::from_millis(800), "closed after {took:?}");

    // An idle keep-alive connection is closed by the same timeout after its response.
    let mut s = TcpStream::connect(server.addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let (got, _) = tokio::time::timeout(Duration::from_secs(20), read_until_closed(&mut s))
        .await
        .expect("the idle connection is closed");
    assert!(
        String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"),
        "the request itself was answered"
    );
}

#[tokio::test]
async fn one_address_cannot_take_every_connection() {
    let limits = http::HttpLimits {
        max_connections: 8,
        max_per_address: 2,
        header_timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let server = start_limited(limits, Router::new()).await;
    // One host holds its two connections idle (within their header timeout).
    let held_a = connect_from("127.0.0.1", server.addr).await;
    let _held_b = connect_from("127.0.0.1", server.addr).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Its third is refused, naming the bound per address.
    let r = healthz_from("127.0.0.1", server.addr).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.body.contains("too_many_connections"), "{}", r.body);
    assert!(
        r.body
            .contains("at most 2 connections at once from one address"),
        "{}",
        r.body
    );
    // Another address is served: the server has slots left, and they are not that host's.
    let r = healthz_from("127.0.0.2", server.addr).await;
    assert_eq!(r.status, 200, "{r:?}");
    // A place freed is the host's again.
    drop(held_a);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = healthz_from("127.0.0.1", server.addr).await;
        if r.status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no place came free: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn connections_beyond_the_cap_get_503_and_the_others_are_served() {
    let limits = http::HttpLimits {
        max_connections: 2,
        header_timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let server = start_limited(limits, Router::new()).await;
    // Two connections hold both slots (idle, within their header timeout).
    let held_a = TcpStream::connect(server.addr).await.expect("connect");
    let held_b = TcpStream::connect(server.addr).await.expect("connect");
    // The accept loop takes them in order; give it a moment to register both.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = request(server.addr, "GET", "/healthz", "").await;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.body.contains("too_many_connections"), "{}", r.body);
    // A slot freed is a slot served.
    drop(held_a);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = request(server.addr, "GET", "/healthz", "").await;
        if r.status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no slot came free: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(held_b);
}

#[tokio::test]
async fn a_body_slower_than_the_request_timeout_is_answered_408_unless_the_route_is_untimed() {
    let limits = http::HttpLimits {
        request_timeout: Duration::from_secs(1),
        untimed: vec![(axum::http::Method::POST, "/slow-ok".to_owned())],
        ..Default::default()
    };
    let extra = Router::new()
        .route("/echo", post(|body: String| async move { body }))
        .route(
            "/slow-ok",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                "done"
            }),
        );
    let server = start_limited(limits, extra).await;
    let mut s = TcpStream::connect(server.addr).await.expect("connect");
    s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .expect("write");
    let (got, took) = tokio::time::timeout(Duration::from_secs(20), read_until_closed(&mut s))
        .await
        .expect("answered");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"timeout\""), "{text}");
    assert!(
        took >= Duration::from_millis(800),
        "answered after {took:?}"
    );
    // A route named untimed may take longer than the request timeout.
    let r = request(server.addr, "POST", "/slow-ok", "").await;
    assert_eq!((r.status, r.body.as_str()), (200, "done"));
}

#[tokio::test]
async fn a_client_that_stops_reading_a_response_loses_its_connection() {
    const BODY: usize = 64 << 20;
    let limits = http::HttpLimits {
        write_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let extra = Router::new().route("/big", axum::routing::get(|| async { vec![b'x'; BODY] }));
    let server = start_limited(limits, extra).await;
    let mut s = TcpStream::connect(server.addr).await.expect("connect");
    s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    // Read nothing for a while: the server's writes stall on full socket buffers.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (got, _) = tokio::time::timeout(Duration::from_secs(20), read_until_closed(&mut s))
        .await
        .expect("the connection ends");
    assert!(
        got.len() < BODY,
        "the whole {BODY}-byte response was kept for a client that did not read it"
    );
}
