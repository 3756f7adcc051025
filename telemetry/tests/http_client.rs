//! `http_client` against real local servers: a JSON round trip (also a chunked answer), an
//! error status returned as a response, an oversized body refused, an address nobody listens
//! on, and a server that never answers; answers streamed as lines (each handed over as it
//! arrives, a server gone quiet mid-answer given up after the idle bound, an error status read
//! whole, the limit counted over the whole stream).
//!
//! The servers are a few lines over a `std` listener that write canned answers by hand, so
//! each test decides exactly what the client receives (a length that is too large, a chunked
//! body, silence).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::ControlFlow;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use starling_telemetry::http_client::{self, DEFAULT_BODY_LIMIT, HttpClientError, Limits};

/// A request as the server read it.
#[derive(Debug, Default)]
struct Seen {
    line: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one request (head and `Content-Length` body).
fn read_request(conn: &TcpStream) -> Seen {
    let mut r = BufReader::new(conn);
    let mut seen = Seen::default();
    r.read_line(&mut seen.line).expect("request line");
    seen.line = seen.line.trim_end().to_owned();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).expect("header line");
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').expect("a header");
        seen.headers.push((k.to_owned(), v.trim().to_owned()));
    }
    let len: usize = seen
        .header("content-length")
        .map_or(0, |v| v.parse().expect("a length"));
    let mut body = vec![0; len];
    r.read_exact(&mut body).expect("body");
    seen.body = String::from_utf8(body).expect("UTF-8 body");
    seen
}

/// A server that answers one connection with what `answer` makes of its request, and hands
/// back that request.
fn serve_once(
    answer: impl FnOnce(&Seen) -> Vec<u8> + Send + 'static,
) -> (String, JoinHandle<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        let seen = read_request(&conn);
        // The client may stop reading (an oversized body) and close: not this test's failure.
        let _ = conn.write_all(&answer(&seen));
        seen
    });
    (addr, server)
}

fn answer(status: &str, extra_headers: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra_headers}connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

const TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn json_round_trip() {
    let (addr, server) = serve_once(|seen| {
        let echo = serde_json::json!({"got": seen.body, "auth": seen.header("authorization")});
        answer("201 Created", "", echo.to_string().as_bytes())
    });
    let r = http_client::request(
        &addr,
        "POST",
        "/v1/batches?x=1",
        &[("authorization", "Bearer t0k")],
        Some(r#"{"a":1}"#),
        Limits::timeout(TIMEOUT),
    )
    .expect("an answer");
    assert_eq!(r.status, 201);
    assert!(r.ok());
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(v["got"], r#"{"a":1}"#);
    assert_eq!(v["auth"], "Bearer t0k");
    let seen = server.join().expect("server");
    assert_eq!(seen.line, "POST /v1/batches?x=1 HTTP/1.1");
    assert_eq!(seen.header("content-type"), Some("application/json"));
    assert_eq!(seen.header("host"), Some(addr.as_str()));
}

#[test]
fn chunked_answer_is_joined() {
    let (addr, server) = serve_once(|_| {
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n3\r\n{\"a\r\n3\r\n\":1\r\n1\r\n}\r\n0\r\n\r\n"
            .to_vec()
    });
    let r = http_client::request(&addr, "GET", "/", &[], None, Limits::timeout(TIMEOUT))
        .expect("an answer");
    assert_eq!((r.status, r.body.as_str()), (200, "{\"a\":1}"));
    let seen = server.join().expect("server");
    assert_eq!(seen.line, "GET / HTTP/1.1");
    assert_eq!(
        seen.header("content-type"),
        None,
        "no body, no content type"
    );
}

#[test]
fn error_status_is_a_response() {
    for status in ["404 Not Found", "409 Conflict", "503 Service Unavailable"] {
        let (addr, server) = serve_once(move |_| {
            answer(
                status,
                "",
                br#"{"error":{"code":"nope","message":"no such thing"}}"#,
            )
        });
        let r = http_client::request(&addr, "GET", "/x", &[], None, Limits::timeout(TIMEOUT))
            .expect("an error status is still an answer");
        assert_eq!(r.status.to_string(), status[..3]);
        assert!(!r.ok());
        assert!(r.body.contains("no such thing"), "{}", r.body);
        server.join().expect("server");
    }
}

#[test]
fn redirect_is_not_followed() {
    let (addr, server) =
        serve_once(|_| answer("307 Temporary Redirect", "location: /elsewhere\r\n", b"{}"));
    let r = http_client::request(
        &addr,
        "POST",
        "/",
        &[],
        Some("{}"),
        Limits::timeout(TIMEOUT),
    )
    .expect("an answer");
    assert_eq!(r.status, 307);
    server.join().expect("server");
}

/// The body limit of the oversized-body test.
const LIMIT: usize = 64 << 10;

/// An answer one byte over [`LIMIT`] with a `Content-Length`.
fn declared_over_limit(_: &Seen) -> Vec<u8> {
    answer("200 OK", "", &vec![b'x'; LIMIT + 1])
}

/// An answer over [`LIMIT`] in chunks, its length declared nowhere.
fn chunked_over_limit(_: &Seen) -> Vec<u8> {
    let mut out =
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    for _ in 0..=LIMIT / 1024 {
        out.extend_from_slice(b"400\r\n");
        out.extend_from_slice(&[b'y'; 1024]);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

#[test]
fn oversized_body_is_refused() {
    let limit = LIMIT;
    // Exactly the limit is read.
    let (addr, server) = serve_once(move |_| answer("200 OK", "", &vec![b'x'; limit]));
    let r = http_client::request(
        &addr,
        "GET",
        "/",
        &[],
        None,
        Limits::timeout(TIMEOUT).body_limit(limit as u64),
    )
    .expect("a body of exactly the limit");
    assert_eq!(r.body.len(), limit);
    server.join().expect("server");

    // One byte more is refused, declared by `Content-Length` or not (chunked).
    let servers: [fn(&Seen) -> Vec<u8>; 2] = [declared_over_limit, chunked_over_limit];
    for make in servers {
        let (addr, server) = serve_once(make);
        let e = http_client::request(
            &addr,
            "GET",
            "/",
            &[],
            None,
            Limits::timeout(TIMEOUT).body_limit(limit as u64),
        )
        .expect_err("over the limit");
        assert!(
            matches!(&e, HttpClientError::TooLarge { limit: l, .. } if *l == limit as u64),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("larger than the limit of 65536 bytes"),
            "{e}"
        );
        server.join().expect("server");
    }
}

#[test]
fn default_limit_applies() {
    let big = DEFAULT_BODY_LIMIT as usize + 1;
    let (addr, server) = serve_once(move |_| answer("200 OK", "", &vec![b'z'; big]));
    let e = http_client::request(&addr, "GET", "/", &[], None, Limits::timeout(TIMEOUT))
        .expect_err("over the default limit");
    assert!(matches!(e, HttpClientError::TooLarge { .. }), "{e:?}");
    server.join().expect("server");
}

#[test]
fn nobody_listening_is_unreachable() {
    // A port that was just free: bound, then released.
    let addr = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .to_string();
    let e = http_client::request(&addr, "GET", "/", &[], None, Limits::timeout(TIMEOUT))
        .expect_err("nobody listens");
    match e {
        HttpClientError::Unreachable { addr: a, source } => {
            assert_eq!(a, addr);
            assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
        }
        other => panic!("not Unreachable: {other:?}"),
    }
}

#[test]
fn silent_server_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    // Reads the request, then holds the connection without a byte of answer until the client
    // has gone.
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        read_request(&conn);
        let _ = conn.read_to_end(&mut Vec::new());
    });
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let e = http_client::request(
        &addr,
        "POST",
        "/",
        &[],
        Some("{}"),
        Limits::timeout(timeout),
    )
    .expect_err("no answer");
    let took = started.elapsed();
    assert!(
        matches!(&e, HttpClientError::TimedOut { after, .. } if *after == timeout),
        "{e:?}"
    );
    assert!(took >= timeout && took < TIMEOUT, "took {took:?}");
    server.join().expect("server");
}

#[test]
fn trickling_server_times_out_overall() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    // An answer a byte every 50 ms: each read succeeds, the whole never arrives in time.
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        read_request(&conn);
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n");
        for _ in 0..1000 {
            if conn.write_all(b"x").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let e = http_client::request(&addr, "GET", "/", &[], None, Limits::timeout(timeout))
        .expect_err("too slow");
    assert!(matches!(e, HttpClientError::TimedOut { .. }), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    server.join().expect("server");
}

#[test]
fn bad_request_is_refused_before_sending() {
    let e = http_client::request(
        "127.0.0.1:1",
        "GET",
        "/",
        &[("bad header\n", "x")],
        None,
        Limits::timeout(TIMEOUT),
    )
    .expect_err("an invalid header name");
    assert!(matches!(e, HttpClientError::Request { .. }), "{e:?}");
}

/// One chunk of a chunked body.
fn chunk(data: &str) -> Vec<u8> {
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

const STREAM_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";

#[test]
fn streamed_lines_arrive_one_by_one() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let (seen_tx, seen_rx) = mpsc::channel::<String>();
    // Sends the second line only once the client has handed over the first: a client that
    // waited for the whole body would wait for ever (the test's timeout).
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        read_request(&conn);
        conn.write_all(STREAM_HEAD).expect("head");
        conn.write_all(&chunk("data: one\r\n\n")).expect("first");
        let got = seen_rx
            .recv_timeout(TIMEOUT)
            .expect("the first line handed over before the body ended");
        assert_eq!(got, "data: one");
        // A line split over two chunks is still one line.
        conn.write_all(&chunk("data: t")).expect("half");
        conn.write_all(&chunk("wo\n")).expect("rest");
        conn.write_all(b"0\r\n\r\n").expect("end");
    });
    let mut lines = Vec::new();
    let r = http_client::request_lines(
        &addr,
        "POST",
        "/v1/completions",
        &[],
        Some("{}"),
        Limits::timeout(TIMEOUT).idle(TIMEOUT),
        |line| {
            lines.push(line.to_owned());
            let _ = seen_tx.send(line.to_owned());
            ControlFlow::Continue(())
        },
    )
    .expect("a streamed answer");
    assert_eq!((r.status, r.body.as_str()), (200, ""));
    assert_eq!(lines, ["data: one", "", "data: two"]);
    server.join().expect("server");
}

#[test]
fn a_stream_that_goes_quiet_is_given_up_after_the_idle_bound() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        read_request(&conn);
        conn.write_all(STREAM_HEAD).expect("head");
        conn.write_all(&chunk("data: one\n")).expect("first");
        // Then silence, until the client has gone.
        let _ = conn.read_to_end(&mut Vec::new());
    });
    let idle = Duration::from_millis(300);
    let started = Instant::now();
    let mut lines = 0;
    let e = http_client::request_lines(
        &addr,
        "GET",
        "/",
        &[],
        None,
        Limits::timeout(TIMEOUT).idle(idle),
        |_| {
            lines += 1;
            ControlFlow::Continue(())
        },
    )
    .expect_err("the stream went quiet");
    assert!(
        matches!(&e, HttpClientError::Silent { after, .. } if *after == idle),
        "{e:?}"
    );
    assert_eq!(lines, 1);
    let took = started.elapsed();
    assert!(took >= idle && took < TIMEOUT / 2, "took {took:?}");
    server.join().expect("server");
}

#[test]
fn a_streamed_request_answered_with_an_error_reads_it_whole() {
    let (addr, server) = serve_once(|_| answer("400 Bad Request", "", br#"{"error":"too long"}"#));
    let mut lines = 0;
    let r = http_client::request_lines(
        &addr,
        "POST",
        "/",
        &[],
        Some("{}"),
        Limits::timeout(TIMEOUT),
        |_| {
            lines += 1;
            ControlFlow::Continue(())
        },
    )
    .expect("an answer");
    assert_eq!(
        (r.status, r.body.as_str(), lines),
        (400, r#"{"error":"too long"}"#, 0)
    );
    server.join().expect("server");
}

#[test]
fn a_stream_is_bounded_as_a_whole_and_a_break_stops_reading() {
    let many = "data: 0123456789\n".repeat(100);
    let body = chunk(&many);
    let (addr, server) = serve_once(move |_| [STREAM_HEAD, &body, b"0\r\n\r\n"].concat());
    let e = http_client::request_lines(
        &addr,
        "GET",
        "/",
        &[],
        None,
        Limits::timeout(TIMEOUT).body_limit(500),
        |_| ControlFlow::Continue(()),
    )
    .expect_err("over the limit");
    assert!(
        matches!(e, HttpClientError::TooLarge { limit: 500, .. }),
        "{e:?}"
    );
    server.join().expect("server");

    // One line longer than a line may be, under the body limit: refused once it passes.
    let long = format!("data: {}\n", "x".repeat(http_client::MAX_LINE));
    let body = chunk(&long);
    let (addr, server) = serve_once(move |_| [STREAM_HEAD, &body, b"0\r\n\r\n"].concat());
    let e = http_client::request_lines(
        &addr,
        "GET",
        "/",
        &[],
        None,
        Limits::timeout(TIMEOUT).body_limit(1 << 30),
        |_| ControlFlow::Continue(()),
    )
    .expect_err("a line over the bound");
    assert!(
        matches!(e, HttpClientError::TooLarge { limit, .. } if limit == http_client::MAX_LINE as u64),
        "{e:?}"
    );
    server.join().expect("server");

    let body = chunk(&many);
    let (addr, server) = serve_once(move |_| [STREAM_HEAD, &body, b"0\r\n\r\n"].concat());
    let mut lines = 0;
    http_client::request_lines(
        &addr,
        "GET",
        "/",
        &[],
        None,
        Limits::timeout(TIMEOUT),
        |_| {
            lines += 1;
            if lines == 3 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        },
    )
    .expect("a streamed answer");
    assert_eq!(lines, 3);
    server.join().expect("server");
}
