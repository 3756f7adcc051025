//! A small blocking client of the hub's trainer HTTP API (`docs/api.md`): publish a version,
//! submit a batch, long-poll its accepted results, read its status, cancel it.
//!
//! It speaks plain HTTP/1.1 through `starling_telemetry::http_client` (one connection per
//! request: the trainer makes a handful per optimizer step; each request bounded in time and
//! in the size of its answer, [`ANSWER_LIMIT`]). The hub's error bodies (`{"code", "message"}`,
//! `docs/api.md`) become [`HubError::Refused`]: the code parsed once into an [`ErrorCode`], so
//! a caller decides by its variant, never by the text.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use starling_telemetry::http_client::{self, HttpClientError, Limits};

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("cannot reach the hub at {addr}")]
    Unreachable {
        addr: String,
        source: std::io::Error,
    },
    #[error("the hub at {addr} did not answer within {after:?}")]
    TimedOut { addr: String, after: Duration },
    #[error("the hub refused ({status} {code}): {message}")]
    Refused {
        status: u16,
        code: ErrorCode,
        message: String,
    },
    #[error("malformed answer from the hub: {0}")]
    Malformed(String),
}

/// The stable `code` of a hub error body (`docs/api.md`, "Errors").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    InvalidBatch,
    UnknownVerifier,
    PromptTooLong,
    Unauthorized,
    PathNotAllowed,
    NotFound,
    MethodNotAllowed,
    Timeout,
    LayoutMismatch,
    /// A checkpoint equal to the latest version (the trainer's publish allows it).
    Unchanged,
    StepBackwards,
    UnknownVersion,
    BatchFinished,
    TooLarge,
    UnreadableCheckpoint,
    NonfiniteWeights,
    Internal,
    TooManyConnections,
    /// A code this client does not know (a newer hub), or an answer without one (a proxy's
    /// page): kept as it came, `unknown` when there was none.
    #[serde(untagged)]
    Other(String),
}

impl ErrorCode {
    /// The code as the API spells it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::BadRequest => "bad_request",
            Self::InvalidBatch => "invalid_batch",
            Self::UnknownVerifier => "unknown_verifier",
            Self::PromptTooLong => "prompt_too_long",
            Self::Unauthorized => "unauthorized",
            Self::PathNotAllowed => "path_not_allowed",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::Timeout => "timeout",
            Self::LayoutMismatch => "layout_mismatch",
            Self::Unchanged => "unchanged",
            Self::StepBackwards => "step_backwards",
            Self::UnknownVersion => "unknown_version",
            Self::BatchFinished => "batch_finished",
            Self::TooLarge => "too_large",
            Self::UnreadableCheckpoint => "unreadable_checkpoint",
            Self::NonfiniteWeights => "nonfinite_weights",
            Self::Internal => "internal",
            Self::TooManyConnections => "too_many_connections",
            Self::Other(code) => code,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A hub error body.
#[derive(Debug, Deserialize)]
struct ErrorBody {
    code: ErrorCode,
    #[serde(default)]
    message: String,
}

impl HubError {
    /// A non-2xx answer with `status` and `body`: the hub's code and sentence when the body is
    /// the hub's, else `unknown` and the body's text.
    fn refused(status: u16, body: &str) -> Self {
        match serde_json::from_str::<ErrorBody>(body) {
            Ok(e) => HubError::Refused {
                status,
                code: e.code,
                message: e.message,
            },
            Err(_) => HubError::Refused {
                status,
                code: ErrorCode::Other("unknown".to_owned()),
                message: body.trim().to_owned(),
            },
        }
    }

    /// The hub's code, when the hub answered with one.
    pub fn code(&self) -> Option<&ErrorCode> {
        match self {
            HubError::Refused { code, .. } => Some(code),
            HubError::Unreachable { .. } | HubError::TimedOut { .. } | HubError::Malformed(_) => {
                None
            }
        }
    }
}

/// The hub's answer to a publish.
#[derive(Debug, Clone, Deserialize)]
pub struct Published {
    pub version: u64,
    pub base: u64,
    pub changes: u64,
    pub bytes: u64,
    pub digest: String,
    /// Whether the hub took the file (handover) rather than copying it.
    #[serde(default)]
    pub handed_over: bool,
}

/// The hub's answer to a batch submission.
#[derive(Debug, Clone, Deserialize)]
pub struct Submitted {
    pub batch: u64,
    pub version: u64,
}

/// One accepted sample.
#[derive(Debug, Clone, Deserialize)]
pub struct SampleOut {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub reward: f32,
    #[serde(default)]
    pub tokens_per_s: f64,
    /// Half-open token spans per version that produced them.
    #[serde(default)]
    pub versions: Vec<VersionSpan>,
}

/// Tokens `[start, end)` of a sample came from `version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct VersionSpan {
    pub version: u64,
    pub start: usize,
    pub end: usize,
}

/// One accepted group.
#[derive(Debug, Clone, Deserialize)]
pub struct GroupOut {
    pub cursor: u64,
    pub group: u32,
    pub actor: String,
    pub version: u64,
    pub prompt_ids: Vec<u32>,
    pub samples: Vec<SampleOut>,
}

/// One page of a batch's results.
#[derive(Debug, Clone, Deserialize)]
pub struct ResultsPage {
    pub results: Vec<GroupOut>,
    pub cursor: u64,
    pub done: bool,
}

/// The largest answer read from the hub. Its largest answers are results pages: at most 8 MiB
/// of JSON, but always at least one result, and one group's result may fill a 16 MiB
/// job-protocol message, a few times that as JSON (token ids, log-probabilities, text)
/// (`docs/api.md`, "Bounds"); 256 MiB leaves room for it.
pub const ANSWER_LIMIT: u64 = 256 << 20;

/// A client bound to one hub and trainer token.
#[derive(Debug, Clone)]
pub struct HubClient {
    addr: String,
    token: String,
    timeout: Duration,
}

impl HubClient {
    /// `addr` is the hub's `--http` address (`host:port`); `token` the trainer's token.
    pub fn new(addr: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            token: token.into(),
            timeout: Duration::from_secs(120),
        }
    }

    /// Publishes the checkpoint at `path` (which the hub reads) as the next version. The
    /// trainer publishes one version per step, so a step that left the weights as they were
    /// (no informative sample) is still a version: `allow: ["unchanged"]` (the hub refuses a
    /// checkpoint equal to the latest version by default, `docs/api.md`). With `handover` the
    /// hub takes the file by a rename where it can instead of copying it.
    pub fn publish(
        &self,
        path: &std::path::Path,
        step: u64,
        handover: bool,
    ) -> Result<Published, HubError> {
        let mut body = serde_json::json!({"path": path, "step": step, "allow": ["unchanged"]});
        if handover {
            body["handover"] = serde_json::Value::Bool(true);
        }
        self.json("POST", "/v1/versions", Some(&body))
    }

    /// Submits a batch (the JSON of `POST /v1/batches`).
    pub fn submit(&self, batch: &Value) -> Result<Submitted, HubError> {
        self.json("POST", "/v1/batches", Some(batch))
    }

    /// Accepted groups after `cursor`, waiting up to `wait_ms` for one.
    pub fn results(&self, batch: u64, after: u64, wait_ms: u64) -> Result<ResultsPage, HubError> {
        let path =
            format!("/v1/batches/{batch}/results?after={after}&limit=1024&wait_ms={wait_ms}");
        self.json("GET", &path, None)
    }

    /// The batch's status document.
    pub fn status(&self, batch: u64) -> Result<Value, HubError> {
        self.json("GET", &format!("/v1/batches/{batch}"), None)
    }

    /// `GET /v1/status`: the run as the hub sees it (actors with their τ, batches, …).
    pub fn run_status(&self) -> Result<Value, HubError> {
        self.json("GET", "/v1/status", None)
    }

    /// `GET /v1/versions`.
    pub fn versions(&self) -> Result<Value, HubError> {
        self.json("GET", "/v1/versions", None)
    }

    fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<T, HubError> {
        let (status, text) = self.request(method, path, body)?;
        if !(200..300).contains(&status) {
            return Err(HubError::refused(status, &text));
        }
        serde_json::from_str(&text).map_err(|e| HubError::Malformed(format!("{path}: {e}")))
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, String), HubError> {
        let payload = body.map(Value::to_string);
        let auth = format!("Bearer {}", self.token);
        let r = http_client::request(
            &self.addr,
            method,
            path,
            &[("authorization", &auth)],
            payload.as_deref(),
            Limits::timeout(self.timeout).body_limit(ANSWER_LIMIT),
        )
        .map_err(|e| match e {
            HttpClientError::Unreachable { addr, source } => HubError::Unreachable { addr, source },
            HttpClientError::TimedOut { addr, after } => HubError::TimedOut { addr, after },
            other => HubError::Malformed(starling_process::error_chain(&other)),
        })?;
        Ok((r.status, r.body))
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn an_error_body_is_parsed_into_its_code() {
        let e = HubError::refused(409, r#"{"code": "unchanged", "message": "same as v3"}"#);
        assert!(
            matches!(&e, HubError::Refused { status: 409, code: ErrorCode::Unchanged, message } if message == "same as v3"),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "the hub refused (409 unchanged): same as v3");
        let busy = HubError::refused(503, r#"{"code": "too_many_connections", "message": "x"}"#);
        assert_eq!(busy.code(), Some(&ErrorCode::TooManyConnections));
    }

    #[test]
    fn an_unknown_code_or_a_foreign_body_is_kept_as_it_came() {
        let newer = HubError::refused(400, r#"{"code": "shiny_new", "message": "m"}"#);
        assert_eq!(newer.code(), Some(&ErrorCode::Other("shiny_new".into())));
        let proxy = HubError::refused(502, "  <html>bad gateway</html>\n");
        assert!(
            matches!(&proxy, HubError::Refused { code: ErrorCode::Other(c), message, .. }
                if c == "unknown" && message == "<html>bad gateway</html>"),
            "{proxy:?}"
        );
    }

    #[test]
    fn nobody_listening_is_unreachable() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let e = HubClient::new(addr.to_string(), "t")
            .versions()
            .expect_err("nobody listens");
        assert!(matches!(e, HubError::Unreachable { .. }), "{e:?}");
    }

    #[test]
    fn an_error_body_is_refused_with_its_code() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut head = Vec::new();
            let mut byte = [0u8];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).expect("read") == 1 {
                head.push(byte[0]);
            }
            let body = r#"{"code":"step_backwards","message":"step 3 is behind 4"}"#;
            write!(
                conn,
                "HTTP/1.1 409 Conflict\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .expect("answer");
            String::from_utf8(head).expect("UTF-8 head")
        });
        let e = HubClient::new(addr.to_string(), "tok")
            .versions()
            .expect_err("refused");
        match e {
            HubError::Refused {
                status,
                code,
                message,
            } => assert_eq!(
                (status, code, message.as_str()),
                (409, ErrorCode::StepBackwards, "step 3 is behind 4")
            ),
            other => panic!("not Refused: {other:?}"),
        }
        let head = server.join().expect("server");
        assert!(head.starts_with("GET /v1/versions HTTP/1.1\r\n"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("authorization: bearer tok\r\n"),
            "{head}"
        );
    }
}
