//! The blocking HTTP/1.1 client for the local JSON APIs Starling's processes call: the trainer
//! calling its hub's API, an actor driving the vLLM server beside it, the demo polling its
//! actors' `/metrics` and its vLLM server's `/health`, the end-to-end tests calling the hub.
//!
//! A thin layer over [`ureq`], and the one place the project configures it, so every caller
//! gets the same bounds:
//! - a request takes at most [`Limits::timeout`] in all (connecting, sending, the whole
//!   answer), not per read: a server that trickles bytes cannot hold a caller forever;
//! - an answer's body is read up to [`Limits::body_limit`] bytes ([`DEFAULT_BODY_LIMIT`]
//!   unless a caller whose answers can be larger says more); a longer one is
//!   [`HttpClientError::TooLarge`], never buffered;
//! - a streamed answer ([`request_lines`]) may also be bounded per read ([`Limits::idle`]):
//!   a server that stops sending mid-answer is given up after that long, however long the
//!   whole answer may take;
//! - every status is an answer: a 4xx or 5xx is a [`Response`] for the caller to read (the
//!   hub's and vLLM's error bodies say why), and a redirect is not followed;
//! - no proxy from the environment (`http_proxy` must not reroute loopback calls), no
//!   compression, plain `http` only (no TLS in the build);
//! - one connection per request, none kept idle: these callers make a handful of requests per
//!   step, so reuse would save nothing measurable, and a pooled connection that the server
//!   (restarted, or timing out idle keep-alives) has closed would fail a `POST` that ureq
//!   does not retry.

use std::io::{self, BufRead, BufReader, Read};
use std::ops::ControlFlow;
use std::time::Duration;

use ureq::Agent;
use ureq::http;

/// The largest answer body read when the caller does not say otherwise: far above what a
/// status document, a digest or an error says, far below what would strain a process.
pub const DEFAULT_BODY_LIMIT: u64 = 16 << 20;

/// The longest line [`request_lines`] holds (with its line ending): far above one event of a
/// streamed answer.
pub const MAX_LINE: usize = 1 << 20;

/// Why a request got no (acceptable) HTTP answer.
#[derive(Debug, thiserror::Error)]
pub enum HttpClientError {
    /// No connection to `addr`, or it broke before the answer was whole.
    #[error("cannot reach {addr}")]
    Unreachable {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// The exchange took longer than the request's timeout.
    #[error("no whole answer from {addr} within {after:?}")]
    TimedOut { addr: String, after: Duration },
    /// The server sent nothing for the request's idle bound ([`Limits::idle`]).
    #[error("{addr} sent nothing for {after:?}")]
    Silent { addr: String, after: Duration },
    /// The answer's body is longer than the request's body limit; the rest was not read.
    #[error("the answer from {addr} is larger than the limit of {limit} bytes")]
    TooLarge { addr: String, limit: u64 },
    /// The request could not be sent as given (a method, path or header HTTP does not allow).
    #[error("cannot send {method} {path} to {addr}")]
    Request {
        addr: String,
        method: String,
        path: String,
        #[source]
        source: ureq::Error,
    },
    /// The answer is not valid HTTP/1.1.
    #[error("malformed HTTP answer from {addr}")]
    Malformed {
        addr: String,
        #[source]
        source: ureq::Error,
    },
}

/// What one request may cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    timeout: Duration,
    body_limit: u64,
    idle: Option<Duration>,
}

impl Limits {
    /// At most `timeout` for the whole exchange, and [`DEFAULT_BODY_LIMIT`] bytes of body.
    pub fn timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            body_limit: DEFAULT_BODY_LIMIT,
            idle: None,
        }
    }

    /// The same, giving up once one read has waited `idle` for a byte: for answers that are
    /// streamed over minutes, where the whole `timeout` says little about a server that hung.
    pub fn idle(self, idle: Duration) -> Self {
        Self {
            idle: Some(idle),
            ..self
        }
    }

    /// The same, reading an answer body of up to `bytes` bytes.
    pub fn body_limit(self, bytes: u64) -> Self {
        Self {
            body_limit: bytes,
            ..self
        }
    }
}

/// A response: its status and body (as text, invalid UTF-8 replaced; the APIs called here
/// answer JSON or the Prometheus text format).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

impl Response {
    /// Whether the status is a success (2xx).
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Sends `method path` to `http://addr` (`host:port`) with `headers` and, if given, a JSON
/// `body` (with `content-type: application/json`), within `limits`.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
    limits: Limits,
) -> Result<Response, HttpClientError> {
    let mut answer = send(addr, method, path, headers, body, limits)?;
    let status = answer.status().as_u16();
    let body = read_whole(addr, answer.body_mut(), limits)?;
    Ok(Response { status, body })
}

/// Like [`request`], for an answer streamed as lines (server-sent events, JSON lines): a
/// success's body is handed to `line` one line at a time as it arrives (without its line
/// ending; the `Response`'s `body` is then empty), until the body ends or `line` breaks. Any
/// other status is read whole into the `Response`, as [`request`] does. The body limit
/// counts every byte streamed; a line is at most [`MAX_LINE`] bytes besides (what is held
/// at once).
pub fn request_lines(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
    limits: Limits,
    mut line: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<Response, HttpClientError> {
    let mut answer = send(addr, method, path, headers, body, limits)?;
    let status = answer.status().as_u16();
    if !(200..300).contains(&status) {
        let body = read_whole(addr, answer.body_mut(), limits)?;
        return Ok(Response { status, body });
    }
    let mut reader = BufReader::new(
        answer
            .body_mut()
            .with_config()
            .limit(limits.body_limit)
            .reader(),
    );
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| classify_io(addr, limits, e))?;
        if n == 0 {
            break;
        }
        if n > MAX_LINE {
            return Err(HttpClientError::TooLarge {
                addr: addr.to_owned(),
                limit: MAX_LINE as u64,
            });
        }
        let text = String::from_utf8_lossy(&buf);
        if line(text.trim_end_matches(['\r', '\n'])).is_break() {
            break;
        }
    }
    Ok(Response {
        status,
        body: String::new(),
    })
}

/// Sends the request and reads the answer's head.
fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
    limits: Limits,
) -> Result<http::Response<ureq::Body>, HttpClientError> {
    let bad_request = |source| HttpClientError::Request {
        addr: addr.to_owned(),
        method: method.to_owned(),
        path: path.to_owned(),
        source,
    };
    let mut builder = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let agent = agent(limits);
    let answer = match body {
        Some(body) => builder
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
            .map(|r| agent.run(r)),
        None => builder.body(()).map(|r| agent.run(r)),
    };
    answer
        .map_err(|e| bad_request(e.into()))?
        .map_err(|e| classify(addr, limits, e).unwrap_or_else(bad_request))
}

/// A body read whole, up to the limit, as text.
fn read_whole(
    addr: &str,
    body: &mut ureq::Body,
    limits: Limits,
) -> Result<String, HttpClientError> {
    let bytes = body
        .with_config()
        .limit(limits.body_limit)
        .read_to_vec()
        .map_err(|e| {
            classify(addr, limits, e).unwrap_or_else(|source| HttpClientError::Malformed {
                addr: addr.to_owned(),
                source,
            })
        })?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The error a failed read of a streamed body is (ureq's errors come wrapped in `io::Error`).
fn classify_io(addr: &str, limits: Limits, e: io::Error) -> HttpClientError {
    if e.get_ref().is_some_and(|inner| inner.is::<ureq::Error>()) {
        let inner = e
            .into_inner()
            .and_then(|inner| inner.downcast::<ureq::Error>().ok());
        if let Some(inner) = inner {
            return classify(addr, limits, *inner).unwrap_or_else(|source| {
                HttpClientError::Malformed {
                    addr: addr.to_owned(),
                    source,
                }
            });
        }
        return HttpClientError::Unreachable {
            addr: addr.to_owned(),
            source: io::Error::other("read failed"),
        };
    }
    HttpClientError::Unreachable {
        addr: addr.to_owned(),
        source: e,
    }
}

/// The agent for one request, with every setting the module documentation lists.
fn agent(limits: Limits) -> Agent {
    Agent::config_builder()
        .timeout_global(Some(limits.timeout))
        .timeout_per_read(limits.idle)
        .http_status_as_error(false)
        .max_redirects(0)
        .proxy(None)
        .max_idle_connections(0)
        .max_idle_connections_per_host(0)
        .build()
        .into()
}

/// The error a failed exchange is, or `Err` with ureq's error when the request itself was
/// refused before anything was sent (the caller's mistake, not the server's).
fn classify(addr: &str, limits: Limits, e: ureq::Error) -> Result<HttpClientError, ureq::Error> {
    let addr = addr.to_owned();
    Ok(match e {
        ureq::Error::Timeout(ureq::Timeout::PerRead) => HttpClientError::Silent {
            addr,
            after: limits.idle.unwrap_or(limits.timeout),
        },
        ureq::Error::Timeout(_) => HttpClientError::TimedOut {
            addr,
            after: limits.timeout,
        },
        ureq::Error::BodyExceedsLimit(_) => HttpClientError::TooLarge {
            addr,
            limit: limits.body_limit,
        },
        ureq::Error::Io(source) => HttpClientError::Unreachable { addr, source },
        ureq::Error::HostNotFound => HttpClientError::Unreachable {
            addr,
            source: io::Error::new(io::ErrorKind::NotFound, "host not found"),
        },
        ureq::Error::ConnectionFailed => HttpClientError::Unreachable {
            addr,
            source: io::Error::other("connection failed"),
        },
        ureq::Error::Http(_) | ureq::Error::BadUri(_) => return Err(e),
        source => HttpClientError::Malformed { addr, source },
    })
}
