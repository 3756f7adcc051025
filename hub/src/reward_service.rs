//! Reward services: HTTP endpoints the operator configures (`starling-hub serve
//! --reward-service NAME=URL`, never a URL taken from a request) that score a group's
//! completions when a group names one as its verifier (`docs/api.md`, "Reward services").
//!
//! One `POST` per group with the prompt, the completions and the group's answer; the answer
//! is `{"rewards": [..]}`, one finite number per completion. A call waits at most the
//! configured timeout per try and is tried `TRIES` times in all, `BACKOFF` apart (or as long
//! as a `Retry-After` asks, when that is at most `MAX_WAIT_IN_CALL`), on a connection error, a
//! timeout, a 5xx, a 408 or 429, or an answer that is not that JSON; any other 4xx is final.
//! The answer is read into at most `MAX_ANSWER` bytes. So one call takes at most `TRIES` ×
//! the timeout plus the pauses. Every failure is a `CallError` naming what went wrong; a
//! transient one (`CallError::transient`: the service is down, overloaded or restarting) has
//! the scorer keep the result and call again later (`scoring`), any other fails that group
//! alone.
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
/// The longest pause between two tries of one call; a service that asks for a longer one
/// (`Retry-After`) is called again by the scorer, which holds no call slot meanwhile.
pub(crate) const MAX_WAIT_IN_CALL: Duration = Duration::from_secs(2);
/// How long a group's scoring is tried again after transient failures, in multiples of the
/// timeout of one call (10 s: 5 minutes), before the group fails.
pub(crate) const RETRY_FOR_TIMEOUTS: u32 = 30;
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
    /// How long one try of a call may take.
    pub timeout: Duration,
    /// How long after its first failed call a group whose calls keep failing transiently is
    /// still tried (`RETRY_FOR_TIMEOUTS` × `timeout`).
    pub retry_for: Duration,
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
        Ok(RewardServices {
            services,
            timeout,
            retry_for: timeout.saturating_mul(RETRY_FOR_TIMEOUTS),
        })
    }

    /// The service called `name`.
    pub fn get(&self, name: &str) -> Option<&RewardService> {
        self.services.get(name)
    }

    /// Every service's name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.services.keys().map(String::as_str)
    }

    /// Scores one group: calls `service` with `request` under the retry policy. Bounded in
    /// time: at most [`TRIES`] tries of `timeout` each and pauses of at most
    /// [`MAX_WAIT_IN_CALL`].
    pub(crate) async fn score(
        &self,
        service: &RewardService,
        request: &ScoreRequest,
    ) -> Result<Vec<f32>, CallError> {
        let body = Bytes::from(
            serde_json::to_vec(request)
                .map_err(|e| CallError::Encode(format!("encode the request: {e}")))?,
        );
        let n = request.completions.len();
        let mut last: Option<CallError> = None;
        for attempt in 0..TRIES {
            if let Some(e) = &last {
                let pause = pause_before(attempt, e);
                if pause > MAX_WAIT_IN_CALL && e.transient() {
                    // The service asked for a longer pause than a call holds a slot for: the
                    // scorer calls again after it.
                    break;
                }
                tokio::time::sleep(pause.min(MAX_WAIT_IN_CALL)).await;
            }
            let answer = tokio::time::timeout(self.timeout, post(service, body.clone()))
                .await
                .unwrap_or(Err(CallError::Timeout(self.timeout)))
                .and_then(|(status, retry_after, body)| rewards(status, retry_after, &body, n));
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

/// The pause before try `attempt` (1 or 2) after `last` failed: the backoff, or what the
/// service asked for (`Retry-After`) when that is longer.
fn pause_before(attempt: usize, last: &CallError) -> Duration {
    let backoff = BACKOFF[(attempt - 1).min(BACKOFF.len() - 1)];
    last.retry_after().map_or(backoff, |r| r.max(backoff))
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
    Status {
        status: u16,
        body: String,
        /// What its `Retry-After` asked for (seconds), if it sent one.
        retry_after: Option<Duration>,
    },
    #[error(
        "answered something other than {{\"rewards\": [one finite number per completion]}}: {0}"
    )]
    Garbage(String),
    #[error("{0}")]
    Encode(String),
}

/// Statuses that say "not now" rather than "not this request": a request timeout, too many
/// requests, and a gateway or service that is unavailable.
const TRANSIENT_STATUS: [u16; 5] = [408, 429, 502, 503, 504];

impl CallError {
    /// Whether trying again within the call may help: not after a 4xx (the service says the
    /// request is wrong) other than 408 and 429.
    fn retryable(&self) -> bool {
        match self {
            CallError::Status { status, .. } => {
                !(400..500).contains(status) || TRANSIENT_STATUS.contains(status)
            }
            CallError::Encode(_) => false,
            _ => true,
        }
    }

    /// Whether the service is unavailable rather than wrong: it cannot be reached, the
    /// connection broke, or it answered 408, 429, 502, 503 or 504. The scorer keeps such a
    /// result and calls again later; any other failure fails the group.
    pub(crate) fn transient(&self) -> bool {
        match self {
            CallError::Connect { .. } | CallError::Http { .. } => true,
            CallError::Status { status, .. } => TRANSIENT_STATUS.contains(status),
            _ => false,
        }
    }

    /// The pause the service asked for.
    pub(crate) fn retry_after(&self) -> Option<Duration> {
        match self {
            CallError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// A `Retry-After` in seconds (the HTTP-date form is not honoured: the usual backoff
/// applies). Values beyond an hour are taken as an hour; callers bound it further.
fn retry_after(headers: &hyper::HeaderMap) -> Option<Duration> {
    let secs: u64 = headers
        .get(hyper::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(secs.min(3600)))
}

/// One HTTP/1.1 `POST` of `body` to `service`: its status, its `Retry-After` and its
/// (bounded) answer.
async fn post(
    service: &RewardService,
    body: Bytes,
) -> Result<(u16, Option<Duration>, Bytes), CallError> {
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
        .map_err(|e| CallError::Encode(format!("build the request: {e}")))?;
    let answer = sender.send_request(request).await.map_err(|e| http(&e))?;
    let status = answer.status().as_u16();
    let wait = retry_after(answer.headers());
    let body = Limited::new(answer.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                CallError::Garbage(format!("an answer over {MAX_ANSWER} bytes"))
            } else {
                http(&format!("read the answer: {e}"))
            }
        })?
        .to_bytes();
    Ok((status, wait, body))
}

/// The rewards in an answer, or why it is not one.
fn rewards(
    status: u16,
    retry_after: Option<Duration>,
    body: &[u8],
    n: usize,
) -> Result<Vec<f32>, CallError> {
    if status != 200 {
        let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        return Err(CallError::Status {
            status,
            body: text,
            retry_after,
        });
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

/// Reads one HTTP request, its head and its `content-length` body, from a test's reward
/// service; `false` if the connection ended first.
#[cfg(test)]
pub(crate) async fn read_request(conn: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut req = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = conn.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            return false;
        }
        req.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&req).to_lowercase();
        if let Some(end) = text.find("\r\n\r\n") {
            let len: usize = text
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if req.len() >= end + 4 + len {
                return true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::AsyncWriteExt;

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
            rewards(200, None, br#"{"rewards": [1, 0.5]}"#, 2),
            Ok(vec![1.0, 0.5])
        );
        assert!(matches!(
            rewards(200, None, b"{}", 2),
            Err(CallError::Garbage(_))
        ));
        assert!(matches!(
            rewards(200, None, b"nope", 2),
            Err(CallError::Garbage(_))
        ));
        assert!(matches!(
            rewards(200, None, br#"{"rewards": [1]}"#, 2),
            Err(CallError::Garbage(_))
        ));
        assert!(matches!(
            rewards(200, None, br#"{"rewards": [1, 1e300]}"#, 2),
            Err(CallError::Garbage(_))
        ));
        let e = rewards(500, None, b"broken", 2).expect_err("5xx");
        assert!(e.retryable(), "a 5xx is tried again");
        assert!(!e.transient(), "but a 500 fails the group after its tries");
        let e = rewards(422, None, b"bad", 2).expect_err("4xx");
        assert!(!e.retryable(), "a 4xx is final");
        assert!(!e.transient());
        assert!(CallError::Timeout(DEFAULT_TIMEOUT).retryable());
    }

    #[test]
    fn unavailable_services_are_transient_and_their_pauses_honoured_within_bounds() {
        for status in [408, 429, 502, 503, 504] {
            let e = rewards(status, None, b"later", 1).expect_err("not 200");
            assert!(e.retryable() && e.transient(), "{status}");
        }
        let refused = CallError::Connect {
            authority: "x:1".into(),
            detail: "refused".into(),
        };
        assert!(refused.retryable() && refused.transient());
        let reset = CallError::Http {
            detail: "connection closed".into(),
        };
        assert!(reset.transient());
        for final_ in [
            CallError::Garbage("x".into()),
            CallError::Timeout(DEFAULT_TIMEOUT),
            CallError::Encode("x".into()),
        ] {
            assert!(!final_.transient(), "{final_}");
        }
        // Retry-After: seconds, honoured when longer than the backoff, capped at an hour.
        let mut h = hyper::HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(hyper::header::RETRY_AFTER, "7".parse().expect("value"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(
            hyper::header::RETRY_AFTER,
            "99999999".parse().expect("value"),
        );
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3600)));
        h.insert(
            hyper::header::RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().expect("value"),
        );
        assert_eq!(retry_after(&h), None, "a date: the usual backoff");
        let busy = |s| rewards(429, Some(Duration::from_secs(s)), b"", 1).expect_err("429");
        assert_eq!(pause_before(1, &busy(0)), BACKOFF[0]);
        assert_eq!(pause_before(2, &busy(0)), BACKOFF[1]);
        assert_eq!(pause_before(1, &busy(2)), Duration::from_secs(2));
        assert_eq!(busy(30).retry_after(), Some(Duration::from_secs(30)));
        let services = RewardServices::new(vec![], DEFAULT_TIMEOUT).expect("services");
        assert_eq!(services.retry_for, Duration::from_secs(300));
    }

    /// A service on a real socket that answers each connection with the next of `answers`
    /// (status, extra headers, body), counting the calls.
    async fn service(
        answers: Vec<(u16, &'static str, &'static str)>,
    ) -> (RewardService, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let task = tokio::spawn(async move {
            for (status, headers, body) in answers {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                seen.fetch_add(1, Ordering::SeqCst);
                read_request(&mut conn).await;
                let answer = format!(
                    "HTTP/1.1 {status} X\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            }
        });
        let s = RewardService::parse(&format!("rm=http://{addr}/score")).expect("service");
        (s, calls, task)
    }

    fn request() -> ScoreRequest {
        ScoreRequest {
            batch: 1,
            group: 0,
            job: 1,
            version: 0,
            prompt: PromptView {
                text: "p".into(),
                messages: None,
            },
            answer: None,
            completions: vec![Completion {
                text: "c".into(),
                finish: "stop".into(),
                tokens: 1,
            }],
        }
    }

    #[tokio::test]
    async fn a_busy_service_is_waited_for_as_it_asks_within_bounds() {
        let services = RewardServices::new(vec![], Duration::from_secs(2)).expect("services");
        // 429 asking for 1 s, then an answer: one call, two tries, the pause honoured.
        let (s, calls, _t) = service(vec![
            (429, "retry-after: 1\r\n", "slow down"),
            (200, "", r#"{"rewards": [0.5]}"#),
        ])
        .await;
        let started = std::time::Instant::now();
        assert_eq!(services.score(&s, &request()).await, Ok(vec![0.5]));
        assert!(
            started.elapsed() >= Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // 503 asking for a minute: the call ends at once, transient, carrying the pause for
        // the scorer (no slot held for a minute).
        let (s, calls, _t) = service(vec![(503, "retry-after: 60\r\n", "restarting")]).await;
        let started = std::time::Instant::now();
        let e = services.score(&s, &request()).await.expect_err("503");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert!(e.transient(), "{e}");
        assert_eq!(e.retry_after(), Some(Duration::from_secs(60)));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // A 4xx other than 408/429: final after one try.
        let (s, calls, _t) = service(vec![(422, "", "no"), (200, "", r#"{"rewards": [1]}"#)]).await;
        let e = services.score(&s, &request()).await.expect_err("422");
        assert!(!e.transient(), "{e}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Nothing listening: transient, every try made, bounded (backoff 0.5 s + 1 s).
        let down = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        let s = RewardService::parse(&format!("rm=http://{down}/")).expect("service");
        let started = std::time::Instant::now();
        let e = services.score(&s, &request()).await.expect_err("down");
        assert!(e.transient(), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }
}
