//! A small blocking client of the hub's trainer HTTP API (`docs/api.md`): publish a version,
//! submit a batch, long-poll its accepted results, read its status, cancel it.
//!
//! It speaks plain HTTP/1.1 through `starling_telemetry::http_client` (one connection per
//! request: the trainer makes a handful per optimizer step). The hub's
//! error bodies (`{"error": {"code", "message"}}`) become [`HubError::Refused`] with the code and
//! sentence intact.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("cannot reach the hub at {addr}")]
    Unreachable {
        addr: String,
        source: std::io::Error,
    },
    #[error("the hub refused ({status} {code}): {message}")]
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    #[error("malformed answer from the hub: {0}")]
    Malformed(String),
}

/// The hub's answer to a publish.
#[derive(Debug, Clone, Deserialize)]
pub struct Published {
    pub version: u64,
    pub base: u64,
    pub changes: u64,
    pub bytes: u64,
    pub digest: String,
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
    /// checkpoint equal to the latest version by default, `docs/api.md`).
    pub fn publish(&self, path: &std::path::Path, step: u64) -> Result<Published, HubError> {
        let body = serde_json::json!({"path": path, "step": step, "allow": ["unchanged"]});
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
            let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let e = &v["error"];
            return Err(HubError::Refused {
                status,
                code: e["code"].as_str().unwrap_or("unknown").to_owned(),
                message: e["message"].as_str().unwrap_or(text.trim()).to_owned(),
            });
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
        let r = starling_telemetry::http_client::request(
            &self.addr,
            method,
            path,
            &[("authorization", &auth)],
            payload.as_deref(),
            self.timeout,
        )
        .map_err(|e| match e {
            starling_telemetry::http_client::HttpClientError::Unreachable { addr, source } => {
                HubError::Unreachable { addr, source }
            }
            other => HubError::Malformed(starling_process::error_chain(&other)),
        })?;
        Ok((r.status, r.body))
    }
}
