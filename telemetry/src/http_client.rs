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
//! - every status is an answer: a 4xx or 5xx is a [`Response`] for the caller to read (the
//!   hub's and vLLM's error bodies say why), and a redirect is not followed;
//! - no proxy from the environment (`http_proxy` must not reroute loopback calls), no
//!   compression, plain `http` only (no TLS in the build);
//! - one connection per request, none kept idle: these callers make a handful of requests per
//!   step, so reuse would save nothing measurable, and a pooled connection that the server
//!   (restarted, or timing out idle keep-alives) has closed would fail a `POST` that ureq
//!   does not retry.

use std::io;
use std::time::Duration;

use ureq::Agent;
use ureq::http;

/// The largest answer body read when the caller does not say otherwise: far above what a
/// status document, a digest or an error says, far below what would strain a process.
pub const DEFAULT_BODY_LIMIT: u64 = 16 << 20;

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
}

impl Limits {
    /// At most `timeout` for the whole exchange, and [`DEFAULT_BODY_LIMIT`] bytes of body.
    pub fn timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            body_limit: DEFAULT_BODY_LIMIT,
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
    let agent = agent(limits.timeout);
    let answer = match body {
        Some(body) => builder
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
            .map(|r| agent.run(r)),
        None => builder.body(()).map(|r| agent.run(r)),
    };
    let mut answer = answer
        .map_err(|e| bad_request(e.into()))?
        .map_err(|e| classify(addr, limits, e).unwrap_or_else(bad_request))?;
    let status = answer.status().as_u16();
    let bytes = answer
        .body_mut()
        .with_config()
        .limit(limits.body_limit)
        .read_to_vec()
        .map_err(|e| classify(addr, limits, e).unwrap_or_else(bad_request))?;
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// The agent for one request, with every setting the module documentation lists.
fn agent(timeout: Duration) -> Agent {
    Agent::config_builder()
        .timeout_global(Some(timeout))
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
