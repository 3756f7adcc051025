//! What the hub shows a person: `GET /v1/status` (JSON), `GET /v1/events` (server-sent
//! events) and the dashboard at `/` (`docs/observability.md`).
//!
//! The status joins the ledger (versions, actors with τ, batches, jobs, leases: what survives
//! a restart) with the run board (`crate::board`: propagation times, transfers, per-actor
//! counts, steps, faults). Building it costs a few ledger reads, so one response is shared by
//! every client asking within [`STATUS_TTL`]: a dashboard open in many browsers costs the
//! ledger at most a few reads a second.
//!
//! The event stream gives each client its own receiver of the board's bounded broadcast: a
//! slow or dead client misses events (and is told so with `lagged`), it never holds up the hub.
//! The dashboard's three files are compiled into the binary; nothing is fetched from elsewhere.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};
use starling_telemetry::http::json_error;
use tokio::sync::broadcast::error::RecvError;

use crate::board;
use crate::clock::now_ms;
use crate::hub::Hub;

/// How long one status response is reused.
const STATUS_TTL: Duration = Duration::from_millis(500);
/// Versions shown unless the query asks for more (each lists every actor).
const DEFAULT_VERSIONS: usize = 8;
/// Batches shown.
const RECENT_BATCHES: u32 = 10;
/// An idle event stream gets a comment this often, so proxies keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

const INDEX_HTML: &str = include_str!("../assets/dashboard/index.html");
const APP_JS: &str = include_str!("../assets/dashboard/app.js");
const STYLE_CSS: &str = include_str!("../assets/dashboard/style.css");

/// What the status routes share: the hub, and the last status built with when (one per
/// router, and the hub builds one router).
#[derive(Debug)]
struct StatusRoutes {
    hub: Arc<Hub>,
    last: tokio::sync::Mutex<Option<(Instant, Value)>>,
    /// One permit per open `/v1/events` stream.
    streams: Arc<tokio::sync::Semaphore>,
}

/// `/v1/events` streams open at once. The route is open (the dashboard reads it), and a
/// stream holds its HTTP connection: without a bound, 256 of them would take every
/// connection slot and lock the trainer's API out.
pub(crate) const MAX_EVENT_STREAMS: usize = 32;
/// A stream ends after this, so an idle client does not hold a slot for ever; a browser's
/// `EventSource` reconnects by itself (after the `retry` the stream states).
const EVENT_STREAM_LIFETIME: Duration = Duration::from_secs(600);

pub(crate) fn router(hub: Arc<Hub>) -> Router {
    let routes = Arc::new(StatusRoutes {
        hub,
        last: tokio::sync::Mutex::new(None),
        streams: Arc::new(tokio::sync::Semaphore::new(MAX_EVENT_STREAMS)),
    });
    Router::new()
        .route("/", get(|| asset("text/html; charset=utf-8", INDEX_HTML)))
        .route(
            "/dashboard/app.js",
            get(|| asset("text/javascript; charset=utf-8", APP_JS)),
        )
        .route(
            "/dashboard/style.css",
            get(|| asset("text/css; charset=utf-8", STYLE_CSS)),
        )
        .route("/v1/status", get(status))
        .route("/v1/events", get(events))
        .with_state(routes)
}

async fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `GET /v1/status` query: how many versions to show with their propagation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusQuery {
    versions: Option<usize>,
}

async fn status(
    State(routes): State<Arc<StatusRoutes>>,
    query: Result<Query<StatusQuery>, QueryRejection>,
) -> Response {
    let shown = match query {
        Ok(Query(q)) => match q.versions {
            None => DEFAULT_VERSIONS,
            Some(n) if (1..=board::MAX_VERSIONS).contains(&n) => n,
            Some(n) => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("versions={n}: give 1 to {}", board::MAX_VERSIONS),
                );
            }
        },
        Err(e) => return json_error(StatusCode::BAD_REQUEST, "bad_request", e.body_text()),
    };
    let mut cache = routes.last.lock().await;
    if let Some((at, v)) = cache.as_ref()
        && at.elapsed() < STATUS_TTL
    {
        return axum::Json(with_versions(v.clone(), shown)).into_response();
    }
    match build(&routes.hub).await {
        Ok(v) => {
            *cache = Some((Instant::now(), v.clone()));
            axum::Json(with_versions(v, shown)).into_response()
        }
        Err(e) => {
            tracing::warn!("status not built: {e:#}");
            json_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                format!("read the ledger: {e:#}"),
            )
        }
    }
}

/// The status with only its newest `n` versions.
fn with_versions(mut status: Value, n: usize) -> Value {
    if let Some(vs) = status.get_mut("versions").and_then(Value::as_array_mut) {
        vs.truncate(n);
    }
    status
}

/// Builds the status document (`docs/observability.md`).
async fn build(hub: &Hub) -> anyhow::Result<Value> {
    let board = &hub.board;
    let version = hub.book().latest();
    let ledger = &hub.ledger;
    let actors = ledger.actors().await?;
    let leases: BTreeMap<String, u64> = ledger
        .leases_by_actor()
        .await?
        .into_iter()
        .map(|(a, n)| (a.as_str().to_owned(), n))
        .collect();
    let jobs = ledger.job_counts().await?;
    let steps = board.steps();
    let finished_at = |id: i64| {
        steps
            .iter()
            .rev()
            .find(|s| s.batch == id)
            .map(|s| s.done_at_ms)
    };
    let mut batches = Vec::new();
    let mut newest_shares: Option<BTreeMap<String, u32>> = None;
    for id in ledger.recent_batches(RECENT_BATCHES).await? {
        let s = ledger.batch_status(id).await?;
        let shares: BTreeMap<String, u32> = ledger
            .assignment(id)
            .await?
            .into_iter()
            .map(|a| (a.actor.as_str().to_owned(), a.count))
            .collect();
        if newest_shares.is_none() && s.scheduled {
            newest_shares = Some(shares.clone());
        }
        let open = s.jobs.posted + s.jobs.pending + s.jobs.leased;
        batches.push(json!({
            "id": id.raw(),
            "version": s.version.number(),
            "size": s.size,
            "created_at_ms": s.created_at.millis(),
            "scheduled": s.scheduled,
            "cancelled": s.cancelled_at.is_some(),
            "done": open == 0,
            "done_at_ms": if open == 0 { finished_at(id.raw()) } else { None },
            "jobs": counts_json(&s.jobs),
            "refusals": s.refusals.iter().cloned().collect::<BTreeMap<String, u64>>(),
            "shares": shares,
        }));
    }
    let newest_shares = newest_shares.unwrap_or_default();
    let share_total: u32 = newest_shares.values().sum();
    let seen = board.actors();
    let actor_regions: BTreeMap<String, String> = actors
        .iter()
        .map(|a| (a.id.as_str().to_owned(), a.region.clone()))
        .collect();
    let actors_json: Vec<Value> = actors
        .iter()
        .map(|a| {
            let name = a.id.as_str();
            let b = seen.get(name).cloned().unwrap_or_default();
            let active = a.active.map(|v| v.number());
            json!({
                "name": name,
                "region": a.region,
                "connected": b.worker_connected,
                "engine": if b.engine.is_empty() { a.hardware.clone() } else { b.engine.clone() },
                "active_version": active,
                "staged_version": a.staged.map(|v| v.number()),
                "behind": active.map(|v| version.saturating_sub(v)),
                "source": b.source,
                "tokens_per_s": a.tau,
                "latency_s": a.latency_s,
                "share": newest_shares.get(name).map(|&n| f64::from(n) / f64::from(share_total.max(1))),
                "leases": leases.get(name).copied().unwrap_or(0),
                "accepted": b.accepted,
                "refused": b.refused,
                "last_heartbeat_ms": a.last_heartbeat.millis(),
            })
        })
        .collect();
    let mut regions: BTreeMap<String, RegionView> = BTreeMap::new();
    for r in board.relays() {
        regions.entry(r.region.clone()).or_default().relays.push(r);
    }
    for a in &actors {
        let e = regions.entry(a.region.clone()).or_default();
        e.actors.push(a.id.as_str().to_owned());
        if let Some(v) = a.active {
            e.versions.push(v.number());
        }
    }
    let regions_json: Vec<Value> = regions
        .into_iter()
        .map(|(region, r)| {
            json!({
                "region": region,
                "relays": r.relays,
                "actors": r.actors,
                "min_version": r.versions.iter().min(),
                "max_version": r.versions.iter().max(),
            })
        })
        .collect();
    Ok(json!({
        "role": "hub",
        "model_id": hub.model_id(),
        "now_ms": now_ms(),
        "started_at_ms": board.started_at_ms(),
        "version": version,
        "checkpoint_bytes": hub.checkpoint_bytes,
        // Whether the next publish checks only its changed elements for NaN and ±Inf.
        "newest_version_finite": hub.newest_finite.load(std::sync::atomic::Ordering::Acquire),
        // The newest version with a full-checkpoint anchor (null until the first is written).
        "newest_anchor": starling_transport::fanout::AnchorSource::newest(&*hub.anchors)
            .map(|(_, seal)| seal.version),
        "codecs": hub.codecs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).status(),
        "versions": board.versions(&actor_regions, hub.checkpoint_bytes),
        "regions": regions_json,
        "actors": actors_json,
        "jobs": counts_json(&jobs),
        "batches": batches,
        "steps": steps,
        "faults": board.faults(),
    }))
}

/// One region while the status is assembled: its relays, its actors and their versions.
#[derive(Debug, Default)]
struct RegionView {
    relays: Vec<board::RelayView>,
    actors: Vec<String>,
    versions: Vec<u64>,
}

fn counts_json(c: &starling_ledger::JobCounts) -> Value {
    json!({
        "posted": c.posted, "pending": c.pending, "leased": c.leased,
        "done": c.done, "failed": c.failed,
    })
}

/// An event's `data:` line, one JSON object.
fn event_data(e: &board::Event) -> String {
    // Plain fields, numbers and strings: writing them to a string cannot fail.
    serde_json::to_string(e).unwrap_or_else(|err| {
        tracing::error!(event = e.name(), "event not serialized: {err}");
        String::from("{}")
    })
}

async fn events(State(routes): State<Arc<StatusRoutes>>) -> Response {
    let Ok(permit) = routes.streams.clone().try_acquire_owned() else {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_streams",
            format!("{MAX_EVENT_STREAMS} event streams are open, the most this hub serves"),
        );
    };
    let hub = &routes.hub;
    let rx = hub.board.subscribe();
    let hello = json!({"version": hub.book().latest(), "at_ms": now_ms()});
    let first = Some(
        SseEvent::default()
            .event("hello")
            .retry(Duration::from_secs(1))
            .data(hello.to_string()),
    );
    let stop = hub.stop.clone();
    let ends = tokio::time::Instant::now() + EVENT_STREAM_LIFETIME;
    let state = (rx, first, stop, permit);
    let stream =
        futures_util::stream::unfold(state, move |(mut rx, first, stop, permit)| async move {
            if let Some(e) = first {
                return Some((Ok::<_, Infallible>(e), (rx, None, stop, permit)));
            }
            // A stopping hub ends every stream, so its HTTP server can drain; every stream ends
            // at its lifetime (its permit with it).
            let next = tokio::select! {
                n = rx.recv() => n,
                () = stop.cancelled() => return None,
                () = tokio::time::sleep_until(ends) => return None,
            };
            let event = match next {
                Ok(e) => SseEvent::default().event(e.name()).data(event_data(&e)),
                Err(RecvError::Lagged(missed)) => SseEvent::default()
                    .event("lagged")
                    .data(json!({"missed": missed, "at_ms": now_ms()}).to_string()),
                Err(RecvError::Closed) => return None,
            };
            Some((Ok(event), (rx, None, stop, permit)))
        });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response()
}
