//! Reward services: HTTP endpoints the operator configures (`starling-hub serve
//! --reward-service NAME=URL`, never a URL taken from a request) that score a group's
//! completions when a group names one as its verifier (`docs/api.md`, "Reward services").
//!
//! One `POST` per group with the prompt, the completions and the group's answer; the answer
//! is `{"rewards": [..]}`, one finite number per completion. A call waits at most the
//! configured timeout and is tried `TRIES` times in all, `BACKOFF` apart, on a connection
//! error, a timeout, a 5xx or an answer that is not that JSON; a 4xx is final. The answer is
//! read into at most `MAX_ANSWER` bytes. Every failure is a `CallError` naming what went
//! wrong; the caller fails that group alone with it.
//!
//! One connection per call (HTTP/1.1 over `hyper`): a group's call carries its completions
//! (kilobytes to megabytes) and takes the service's scoring time, against which a TCP
//! handshake on the cluster's network is noise; pooling would add state for nothing measurable.
//! Plain `http://` only: a reward service runs beside the hub or on the cluster's private
//! network, like the hub's own HTTP API.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Uri;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio_util::task::AbortOnDropHandle;

/// Tries per call, the first included.
pub(crate) const TRIES: usize = 3;
/// The pause before the second and the third try.
pub(crate) const BACKOFF: [Duration; 2] = [Duration::from_millis(500), Duration::from_secs(1)];
/// The largest answer read from a service.
pub(crate) const MAX_ANSWER: usize = 1 << 20;
/// The default wait for one call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// One configured service: its name (what groups give as `verifier`) and where it listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewardService {
    pub name: String,
    /// `host:port`.
    authority: String,
    /// Path and query.
    path: String,
    url: String,
}

impl RewardService {
    /// Parses `NAME=URL` (`http://host[:port][/path]`). The name may not be one of the
    /// built-in verifiers'.
    pub fn parse(spec: &str) -> Result<RewardService, String> {
        let (name, url) = spec
            .split_once('=')
            .ok_or_else(|| format!("--reward-service {spec:?}: give NAME=URL"))?;
        let name = name.trim();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        {
            return Err(format!(
                "--reward-service {spec:?}: the name must be letters, digits, '_', '-' or '.'"
            ));
        }
        if crate::verify::Verifier::parse(name).is_some() {
            return Err(format!(
                "--reward-service {spec:?}: {name} is a built-in verifier's name"
            ));
        }
        let uri: Uri = url
            .trim()
            .parse()
            .map_err(|e| format!("--reward-service {spec:?}: {url:?} is not a URL ({e})"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "--reward-service {spec:?}: only http:// URLs are supported (run the service beside the hub or on the cluster's private network)"
            ));
        }
        let host = uri
            .host()
            .ok_or_else(|| format!("--reward-service {spec:?}: the URL has no host"))?;
        let authority = format!("{host}:{}", uri.port_u16().unwrap_or(80));
        let path = uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned());
        Ok(RewardService {
            name: name.to_owned(),
            authority,
            path,
            url: url.trim().to_owned(),
        })
    }

    /// The URL as configured.
    pub fn url(&self) -> &str {
        &self.url
    }
}

/// The configured services and the call policy.
#[derive(Debug, Clone, Default)]
pub struct RewardServices {
    services: BTreeMap<String, RewardService>,
    /// How long one call may take.
    pub timeout: Duration,
}

impl RewardServices {
    /// The services, by name (each name once).
    pub fn new(list: Vec<RewardService>, timeout: Duration) -> Result<RewardServices, String> {
        let mut services = BTreeMap::new();
        for s in list {
            let name = s.name.clone();
            if services.insert(name.clone(), s).is_some() {
                return Err(format!("--reward-service {name} is given twice"));
            }
        }
        Ok(RewardServices { services, timeout })
    }

    /// The service called `name`.
    pub fn get(&self, name: &str) -> Option<&RewardService> {
        self.services.get(name)
    }

    /// Every service's name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.services.keys().map(String::as_str)
    }

    /// Scores one group: calls `service` with `request` under the retry policy.
    pub(crate) async fn score(
        &self,
        service: &RewardService,
        request: &ScoreRequest,
    ) -> Result<Vec<f32>, CallError> {
        let body = Bytes::from(serde_json::to_vec(request).map_err(|e| CallError::Http {
            detail: format!("encode the request: {e}"),
        })?);
        let n = request.completions.len();
        let mut last = None;
        for attempt in 0..TRIES {
            if attempt > 0 {
                tokio::time::sleep(BACKOFF[attempt - 1]).await;
            }
            let answer = tokio::time::timeout(self.timeout, post(service, body.clone()))
                .await
                .unwrap_or(Err(CallError::Timeout(self.timeout)))
                .and_then(|(status, body)| rewards(status, &body, n));
            match answer {
                Ok(r) => return Ok(r),
                Err(e) if e.retryable() => {
                    tracing::debug!(service = %service.name, attempt, "reward service try failed: {e}");
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(CallError::Timeout(self.timeout)))
    }
}

/// What a service is sent for one group.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ScoreRequest {
    pub(crate) batch: i64,
    pub(crate) group: u32,
    pub(crate) job: i64,
    pub(crate) version: u64,
    pub(crate) prompt: PromptView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) answer: Option<String>,
    pub(crate) completions: Vec<Completion>,
}

/// The group's prompt: its text, and its messages when it was given as a chat.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PromptView {
    pub(crate) text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) messages: Option<serde_json::Value>,
}

/// One completion of the group.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Completion {
    pub(crate) text: String,
    pub(crate) finish: String,
    pub(crate) tokens: usize,
}

#[derive(Debug, Deserialize)]
struct ScoreAnswer {
    rewards: Vec<f64>,
}

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum CallError {
    #[error("cannot connect to {authority}: {detail}")]
    Connect { authority: String, detail: String },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("HTTP failure: {detail}")]
    Http { detail: String },
    #[error("answered HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error(
        "answered something other than {{\"rewards\": [one finite number per completion]}}: {0}"
    )]
    Garbage(String),
}

impl CallError {
    /// A 4xx is the service saying the request is wrong: trying again changes nothing.
    fn retryable(&self) -> bool {
        !matches!(self, CallError::Status { status, .. } if (400..500).contains(status))
    }
}

/// One HTTP/1.1 `POST` of `body` to `service`: its status and (bounded) answer.
async fn post(service: &RewardService, body: Bytes) -> Result<(u16, Bytes), CallError> {
    let http = |e: &dyn std::fmt::Display| CallError::Http {
        detail: e.to_string(),
    };
    let stream = tokio::net::TcpStream::connect(&service.authority)
        .await
        .map_err(|e| CallError::Connect {
            authority: service.authority.clone(),
            detail: e.to_string(),
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| http(&e))?;
    // The connection's driver: owned here, stopped when the call ends or is dropped.
    let _driver = AbortOnDropHandle::new(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let request = hyper::Request::post(service.path.as_str())
        .header(HOST, service.authority.as_str())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| http(&e))?;
    let answer = sender.send_request(request).await.map_err(|e| http(&e))?;
    let status = answer.status().as_u16();
    let body = Limited::new(answer.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| {
            http(&format!(
                "read the answer (at most {MAX_ANSWER} bytes): {e}"
            ))
        })?
        .to_bytes();
    Ok((status, body))
}

/// The rewards in an answer, or why it is not one.
fn rewards(status: u16, body: &[u8], n: usize) -> Result<Vec<f32>, CallError> {
    if status != 200 {
        let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        return Err(CallError::Status { status, body: text });
    }
    let a: ScoreAnswer =
        serde_json::from_slice(body).map_err(|e| CallError::Garbage(e.to_string()))?;
    if a.rewards.len() != n {
        return Err(CallError::Garbage(format!(
            "{} rewards for {n} completions",
            a.rewards.len()
        )));
    }
    a.rewards
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            let f = r as f32;
            if f.is_finite() {
                Ok(f)
            } else {
                Err(CallError::Garbage(format!(
                    "reward {i} is {r}, not a finite f32"
                )))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_are_parsed_with_clear_errors() {
        let s = RewardService::parse("judge=http://127.0.0.1:9000/score?x=1").expect("valid");
        assert_eq!(
            (s.name.as_str(), s.authority.as_str(), s.path.as_str()),
            ("judge", "127.0.0.1:9000", "/score?x=1")
        );
        let s = RewardService::parse("rm=http://rewards.internal").expect("valid");
        assert_eq!(
            (s.authority.as_str(), s.path.as_str()),
            ("rewards.internal:80", "/")
        );
        for (bad, says) in [
            ("judge", "NAME=URL"),
            ("=http://a", "name"),
            ("math=http://a", "built-in"),
            ("j=https://a/score", "only http://"),
            ("j=not a url", "not a URL"),
        ] {
            let e = RewardService::parse(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
        let twice = vec![
            RewardService::parse("j=http://a").expect("valid"),
            RewardService::parse("j=http://b").expect("valid"),
        ];
        assert!(RewardServices::new(twice, DEFAULT_TIMEOUT).is_err());
    }

    #[test]
    fn answers_are_one_finite_reward_per_completion() {
        assert_eq!(
            rewards(200, br#"{"rewards": [1, 0.5]}"#, 2),
            Ok(vec![1.0, 0.5])
        );
        assert!(matches!(rewards(200, b"{}", 2), Err(CallError::Garbage(_))));
        assert!(matches!(
            rewards(200, b"nope", 2),
            Err(CallError::Garbage(_))
        ));
        assert!(matches!(
            rewards(200, br#"{"rewards": [1]}"#, 2),
            Err(CallError::Garbage(_))
        ));
        assert!(matches!(
            rewards(200, br#"{"rewards": [1, 1e300]}"#, 2),
            Err(CallError::Garbage(_))
        ));
        let e = rewards(503, b"busy", 2).expect_err("5xx");
        assert!(e.retryable(), "a 5xx is tried again");
        let e = rewards(422, b"bad", 2).expect_err("4xx");
        assert!(!e.retryable(), "a 4xx is final");
        assert!(CallError::Timeout(DEFAULT_TIMEOUT).retryable());
    }
}
