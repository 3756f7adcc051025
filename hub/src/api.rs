//! The hub's HTTP API for the trainer (`docs/api.md`): publish a version, list versions,
//! submit a batch of prompt groups, read its status, stream its accepted results by cursor
//! (long-poll), cancel it. Served next to `/metrics` by `starling_telemetry::http`.
//!
//! Every error is a JSON body `{"code", "message"}` with a stable code and a sentence that
//! says what to fix. Routes that change state or return rollouts need the trainer token
//! (`Authorization: Bearer …`, from `starling-hub issue --role trainer`); the listener has no
//! TLS of its own: bind it to loopback or the training cluster's private network.
//!
//! Nothing of a request is read or parsed before its token is checked: the check is a layer
//! in front of the protected routes (`require_token`) that sees only the headers, and a
//! refused request is answered `401` with its body unread (the connection is then closed).
//! Past the check, a body is read into a reader bounded in bytes and in time (`read_json`)
//! and parsed only once whole.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use starling_ledger::{BatchId, CancelError, PostError, ReadError, Version};
use starling_proto::delta::manifest::hex;

use crate::clock::{now, now_ms};
use crate::durable::VersionMeta;
use crate::hub::Hub;
use crate::publish::publish;
use crate::results::{self, MAX_PAGE_BYTES};
use crate::rollouts::{BatchRequest, check_deliverable, check_rewards, expand};

/// The largest batch request (prompt groups as JSON).
const MAX_BATCH_BODY: usize = 64 << 20;
/// The largest publish request (a path and a few fields).
const MAX_PUBLISH_BODY: usize = 64 << 10;
/// Most results one poll returns.
const MAX_LIMIT: u32 = 1024;
/// Longest a poll waits.
const MAX_WAIT_MS: u64 = 30_000;

/// An API error: status, stable code, sentence.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// `what: ` and the whole chain of `e` (a ledger error says only "ledger database"; its
    /// cause is in its source).
    fn internal(what: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        let e = starling_process::error_chain(&*e.into());
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("{what}: {e}"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({"code": self.code, "message": self.message})),
        )
            .into_response()
    }
}

type Reply<T> = Result<T, ApiError>;

/// Reads a JSON request body of at most `limit` bytes that must arrive within `deadline`, then
/// parses it. Called only behind [`require_token`].
async fn read_json<T: DeserializeOwned>(body: Body, limit: usize, deadline: Duration) -> Reply<T> {
    let limited = http_body_util::Limited::new(body, limit);
    let bytes = match tokio::time::timeout(deadline, limited.collect()).await {
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!(
                    "the request body did not arrive within {} s",
                    deadline.as_secs_f64()
                ),
            ));
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("the request body is over this route's limit of {limit} bytes"),
            ));
        }
        Ok(Err(e)) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("reading the request body failed: {e}"),
            ));
        }
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("the request body is not the JSON this route takes: {e}"),
        )
    })
}

/// `POST /v1/versions` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// A safetensors file or sharded directory under one of the hub's `--publish-dir`s.
    pub path: PathBuf,
    /// The trainer's own step number, recorded with the version.
    #[serde(default)]
    pub step: Option<u64>,
    /// Checks this publish skips (`nonfinite`, `unchanged`, `step_backwards`).
    #[serde(default)]
    pub allow: Vec<crate::ingest::Allow>,
    /// The trainer gives the file to the hub, which renames it into its store instead of
    /// copying it where it can (a single file on the store's file system with no other link;
    /// else it copies). Given back if the publish is refused. The answer's `handed_over` says
    /// which happened.
    #[serde(default)]
    pub handover: bool,
}

pub(crate) fn router(hub: Arc<Hub>) -> Router {
    let token = || axum::middleware::from_fn_with_state(hub.clone(), require_token);
    Router::new()
        .route(
            "/v1/versions",
            get(list).merge(post(create).route_layer(token())),
        )
        .route("/v1/batches", post(submit_batch).route_layer(token()))
        .route("/v1/batches/{id}", get(batch_status).route_layer(token()))
        .route(
            "/v1/batches/{id}/results",
            get(results).route_layer(token()),
        )
        .route("/v1/batches/{id}/cancel", post(cancel).route_layer(token()))
        .with_state(hub)
}

/// Lets a request through to its route only with a valid trainer token. Runs before any
/// extractor of the route: a refused request's body is never read, and its connection is
/// closed (what the client already sent is dropped with it).
async fn require_token(
    State(hub): State<Arc<Hub>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authorize(&hub, request.headers()) {
        Ok(_trainer) => next.run(request).await,
        Err(e) => {
            let mut r = e.into_response();
            r.headers_mut().insert(
                header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            r
        }
    }
}

/// Checks the trainer token; returns the trainer's name.
fn authorize(hub: &Hub, headers: &HeaderMap) -> Reply<String> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "send the trainer token as `Authorization: Bearer <token>` (starling-hub issue --role trainer)",
            )
        })?;
    starling_transport::identity::verify_trainer_token(&hub.trainer_seed, token.trim()).ok_or_else(
        || {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the trainer token is not valid for this cluster",
            )
        },
    )
}

async fn list(State(hub): State<Arc<Hub>>) -> Reply<Json<Value>> {
    let records = hub
        .ledger
        .latest_versions(64)
        .await
        .map_err(|e| ApiError::internal("read versions", e))?;
    let versions: Vec<Value> = records
        .iter()
        .map(|r| {
            let m = VersionMeta::parse(&r.meta);
            json!({
                "version": r.version.number(),
                "base": r.base.map(Version::number),
                "digest": hex(&r.digest.0),
                "changes": m.changes,
                "bytes": m.bytes,
                "step": m.step,
                "created_at_ms": r.created_at.millis(),
            })
        })
        .collect();
    Ok(Json(json!({
        "latest": hub.book().latest(),
        "oldest_retained": hub.book().oldest(),
        "versions": versions,
    })))
}

async fn create(State(hub): State<Arc<Hub>>, body: Body) -> Reply<(StatusCode, Json<Value>)> {
    let req: PublishRequest =
        read_json(body, MAX_PUBLISH_BODY, hub.http_limits().request_timeout).await?;
    let req = crate::ingest::PublishRequest {
        path: req.path,
        step: req.step,
        allow: req.allow,
        handover: req.handover,
    };
    match publish(&hub, req).await {
        Ok(p) => Ok((
            StatusCode::CREATED,
            Json(json!({
                "version": p.version,
                "base": p.base,
                "changes": p.changes,
                "bytes": p.bytes,
                "digest": hex(&p.digest),
                "step": p.step,
                "handed_over": p.handed_over,
                "nonfinite_check": p.nonfinite_check.name(),
            })),
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            e.code(),
            e.to_string(),
        )),
    }
}

async fn submit_batch(State(hub): State<Arc<Hub>>, body: Body) -> Reply<(StatusCode, Json<Value>)> {
    let req: BatchRequest =
        read_json(body, MAX_BATCH_BODY, hub.http_limits().request_timeout).await?;
    check_rewards(&req, &hub.rewards)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.code, e.message))?;
    let groups = expand(&req, &hub.limits)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.code, e.message))?;
    check_deliverable(&groups)
        .map_err(|e| ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, e.code, e.message))?;
    if groups.len() > hub.ledger.config().max_batch_size {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!(
                "{} groups; a batch holds at most {}",
                groups.len(),
                hub.ledger.config().max_batch_size
            ),
        ));
    }
    let latest = hub.book().latest();
    let version = req.version.unwrap_or(latest);
    let v = Version::new(version)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string()))?;
    let max_staleness = req
        .max_staleness
        .unwrap_or(starling_ledger::DEFAULT_MAX_STALENESS);
    let prompts: Vec<Vec<u8>> = groups.iter().map(|g| g.to_bytes()).collect();
    let budgets: Vec<u64> = groups.iter().map(crate::jobs::token_budget).collect();
    let sampling = serde_json::to_string(&groups[0].sampling).unwrap_or_default();
    let batch = hub
        .ledger
        .post_batch_budgeted(v, &prompts, &budgets, &sampling, max_staleness, now())
        .await
        .map_err(|e| match e {
            PostError::UnknownVersion(_) | PostError::NotCommitted(_) => ApiError::new(
                StatusCode::CONFLICT,
                "unknown_version",
                format!("version {version} is not published (latest is {latest})"),
            ),
            PostError::TooLarge(..) | PostError::PromptTooLarge { .. } => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", e.to_string())
            }
            other => ApiError::internal("post batch", other),
        })?;
    let samples: u64 = groups.iter().map(|g| u64::from(g.n)).sum();
    let size = u32::try_from(groups.len()).unwrap_or(u32::MAX);
    hub.board.batch_posted(batch.raw(), version, size, now_ms());
    tracing::info!(batch = batch.raw(), version, groups = size, "batch posted");
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "batch": batch.raw(),
            "version": version,
            "groups": groups.len(),
            "samples": samples,
            "max_staleness": max_staleness,
        })),
    ))
}

fn batch_id(raw: &str) -> Reply<BatchId> {
    raw.parse::<i64>()
        .ok()
        .filter(|&n| n > 0)
        .map(BatchId::from_raw)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("{raw:?} is not a batch id"),
            )
        })
}

fn not_found_batch(id: BatchId) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no batch {}", id.raw()),
    )
}

/// A batch's status document, whether it is finished, and where its results were archived.
async fn status_json(hub: &Hub, id: BatchId) -> Reply<(Value, bool, Option<String>)> {
    let s = match hub.ledger.batch_status(id).await {
        Ok(s) => s,
        Err(ReadError::NotFound) => return Err(not_found_batch(id)),
        Err(e) => return Err(ApiError::internal("read batch", e)),
    };
    let j = &s.jobs;
    let finished = s.finished();
    let state = if s.cancelled_at.is_some() {
        "cancelled"
    } else if !s.scheduled && s.archive.is_none() {
        "posted"
    } else if finished {
        "done"
    } else {
        "running"
    };
    let counts = |pairs: &[(String, u64)]| -> serde_json::Map<String, Value> {
        pairs.iter().map(|(k, n)| (k.clone(), json!(n))).collect()
    };
    let mut doc = json!({
        "batch": id.raw(),
        "version": s.version.number(),
        "state": state,
        "max_staleness": s.max_staleness,
        "groups": {"total": j.total(), "posted": j.posted, "pending": j.pending,
                   "leased": j.leased, "scoring": s.scoring, "done": j.done - s.scoring.min(j.done),
                   "failed": j.failed},
        "refused": counts(&s.refusals),
        "failures": counts(&s.failures),
        "created_at_ms": s.created_at.millis(),
    });
    if let Some(a) = &s.archive {
        doc["archived"] = json!({"path": a.path, "at_ms": a.at.millis()});
    }
    Ok((doc, finished, s.archive.map(|a| a.path)))
}

async fn batch_status(State(hub): State<Arc<Hub>>, Path(id): Path<String>) -> Reply<Json<Value>> {
    let id = batch_id(&id)?;
    Ok(Json(status_json(&hub, id).await?.0))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultsQuery {
    after: Option<i64>,
    limit: Option<u32>,
    wait_ms: Option<u64>,
}

async fn results(
    State(hub): State<Arc<Hub>>,
    Path(id): Path<String>,
    query: Result<Query<ResultsQuery>, axum::extract::rejection::QueryRejection>,
) -> Reply<Response> {
    let id = batch_id(&id)?;
    let Query(q) =
        query.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    let after = q.after.unwrap_or(0);
    let limit = q.limit.unwrap_or(64).clamp(1, MAX_LIMIT);
    // A poll ends well within the request timeout, which would otherwise cut it off.
    let longest = Duration::from_millis(MAX_WAIT_MS).min(hub.http_limits().request_timeout / 2);
    let wait = Duration::from_millis(q.wait_ms.unwrap_or(0)).min(longest);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let (page, finished) = look(&*hub, id, after, limit).await?;
        if !page.docs.is_empty() || finished || tokio::time::Instant::now() >= deadline {
            let done = finished && !page.cut;
            if done {
                // The trainer has read the batch to its end: retention may archive it.
                if let Err(e) = hub.ledger.mark_delivered(id, now()).await {
                    tracing::warn!(
                        batch = id.raw(),
                        "mark delivered: {}",
                        starling_process::error_chain(&e)
                    );
                }
            }
            return Ok((
                [(header::CONTENT_TYPE, "application/json")],
                page.body(done),
            )
                .into_response());
        }
        // Accepted results land in the ledger; poll it at a short interval until one does.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a results poll reads: whether the batch is finished (and where retention archived
/// it), and a page of the results the ledger holds. A trait so that the order of the reads can
/// be tested against a batch archived between them.
pub(crate) trait ResultReads {
    /// Whether the batch is finished, and the file its results were archived to.
    async fn state(&self, id: BatchId) -> Reply<(bool, Option<String>)>;
    /// Its readable results after `after` that the ledger holds.
    async fn ledger_page(&self, id: BatchId, after: i64, limit: u32) -> Reply<results::Page>;
}

impl ResultReads for Hub {
    async fn state(&self, id: BatchId) -> Reply<(bool, Option<String>)> {
        let (_, finished, archive) = status_json(self, id).await?;
        Ok((finished, archive))
    }

    async fn ledger_page(&self, id: BatchId, after: i64, limit: u32) -> Reply<results::Page> {
        let rows = self
            .ledger
            .results_page(id, after, limit, MAX_PAGE_BYTES as u64)
            .await
            .map_err(|e| ApiError::internal("read results", e))?;
        let mut page = results::fill(
            after,
            limit as usize,
            rows.results
                .iter()
                .map(|r| results::render(id.raw(), r).map(|d| (r.cursor, d))),
        )
        .map_err(|e| ApiError::internal("read results", e))?;
        page.cut |= rows.more;
        Ok(page)
    }
}

/// A page of an archived batch's results after `after`, from its file.
async fn archived_page(path: String, after: i64, limit: u32) -> Reply<results::Page> {
    let path = PathBuf::from(path);
    tokio::task::spawn_blocking(move || {
        let docs = results::archived(&path, after)
            .map_err(|e| ApiError::internal("open the batch's archive", e))?;
        results::fill(after, limit as usize, docs)
            .map_err(|e| ApiError::internal("read results", e))
    })
    .await
    .map_err(|e| ApiError::internal("read the batch's archive", e))?
}

/// One look at a batch's results after `after`: a page, and whether the batch was finished
/// before the page was read (then every result it will ever have was readable, so a page
/// that is not cut holds all that remain). Retention may archive the batch between the two
/// reads, deleting its rows: a finished batch whose ledger page comes back empty is looked at
/// again, and if it was archived meanwhile the page is read from its file. So `done` is
/// never answered while results after `after` exist.
async fn look(
    reads: &impl ResultReads,
    id: BatchId,
    after: i64,
    limit: u32,
) -> Reply<(results::Page, bool)> {
    let (finished, archive) = reads.state(id).await?;
    if let Some(path) = archive {
        return Ok((archived_page(path, after, limit).await?, finished));
    }
    let page = reads.ledger_page(id, after, limit).await?;
    if finished
        && page.docs.is_empty()
        && let (_, Some(path)) = reads.state(id).await?
    {
        return Ok((archived_page(path, after, limit).await?, finished));
    }
    Ok((page, finished))
}

async fn cancel(State(hub): State<Arc<Hub>>, Path(id): Path<String>) -> Reply<Json<Value>> {
    let id = batch_id(&id)?;
    // Whether the batch finished is decided in the cancelling transaction: a batch that
    // finishes while it is cancelled is answered `batch_finished` and stays `done`.
    let finished = || {
        ApiError::new(
            StatusCode::CONFLICT,
            "batch_finished",
            format!("batch {} already finished", id.raw()),
        )
    };
    match hub.ledger.cancel_batch(id, now()).await {
        Ok(Some(n)) => Ok(Json(json!({"batch": id.raw(), "cancelled": n}))),
        Ok(None) => Err(finished()),
        Err(CancelError::UnknownBatch(_)) => Err(not_found_batch(id)),
        Err(CancelError::AlreadyCancelled(_)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "batch_finished",
            format!("batch {} is already cancelled", id.raw()),
        )),
        Err(e) => Err(ApiError::internal("cancel batch", e)),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use super::*;

    /// A batch whose state answers come from a script, and whose ledger rows are gone (the
    /// ledger page is empty), as when retention archived it between the reads.
    struct Archived {
        states: Mutex<VecDeque<(bool, Option<String>)>>,
    }

    impl ResultReads for Archived {
        async fn state(&self, _: BatchId) -> Reply<(bool, Option<String>)> {
            let mut s = self.states.lock().expect("lock");
            Ok(s.pop_front().expect("a state read the script has"))
        }

        async fn ledger_page(&self, _: BatchId, after: i64, _: u32) -> Reply<results::Page> {
            Ok(results::Page {
                cursor: after,
                ..results::Page::default()
            })
        }
    }

    #[tokio::test]
    async fn a_batch_archived_between_the_reads_is_served_from_its_file_not_done_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("batch-1.jsonl");
        std::fs::write(
            &file,
            "{\"cursor\":4,\"job\":1}\n{\"cursor\":7,\"job\":2}\n",
        )
        .expect("archive");
        let path = file.display().to_string();
        // Finished and still in the ledger when its state is read; archived (rows deleted)
        // before its page is read.
        let reads = Archived {
            states: Mutex::new(VecDeque::from([(true, None), (true, Some(path.clone()))])),
        };
        let (page, finished) = look(&reads, BatchId::from_raw(1), 4, 10)
            .await
            .expect("look");
        assert!(finished);
        assert_eq!(
            (page.docs.len(), page.cursor, page.cut),
            (1, 7, false),
            "the result after the cursor, from the file (before: `results: []`, `done: true`)"
        );
        // Finished, not archived, nothing left in the ledger: truly done, one extra look.
        let reads = Archived {
            states: Mutex::new(VecDeque::from([(true, None), (true, None)])),
        };
        let (page, finished) = look(&reads, BatchId::from_raw(1), 7, 10)
            .await
            .expect("look");
        assert!(finished && page.docs.is_empty() && !page.cut);
        assert_eq!(page.cursor, 7);
        // Already archived: read from the file, no second look.
        let reads = Archived {
            states: Mutex::new(VecDeque::from([(true, Some(path))])),
        };
        let (page, _) = look(&reads, BatchId::from_raw(1), 0, 10)
            .await
            .expect("look");
        assert_eq!((page.docs.len(), page.cursor), (2, 7));
    }
}
