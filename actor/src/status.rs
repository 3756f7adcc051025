//! The actor's own status (`GET /v1/status`, `docs/observability.md`): the version it
//! generates with and the one staged, where its deltas come from, and whether its rollout
//! worker is registered with the hub. Read from the pipeline's status channel and the
//! metrics, plus the source the pipeline last subscribed to; nothing here blocks the pipeline.

use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use serde_json::{Value, json};
use starling_telemetry::Metrics;
use tokio::sync::watch;

use crate::engine::Engine;
use crate::worker::PipelineStatus;

/// What the actor reports about itself.
#[derive(Debug)]
pub(crate) struct ActorStatus {
    pub(crate) name: String,
    pub(crate) region: String,
    pub(crate) engine: String,
    pub(crate) pipeline: watch::Receiver<PipelineStatus>,
    pub(crate) metrics: Metrics,
    /// The engine, asked what it holds (its fingerprint) at each read.
    engine_impl: Option<Arc<dyn Engine>>,
    source: Mutex<Option<Source>>,
}

#[derive(Debug, Clone)]
struct Source {
    name: String,
    kind: &'static str,
    connected: bool,
}

impl ActorStatus {
    pub(crate) fn new(
        name: &str,
        region: &str,
        engine: &str,
        pipeline: watch::Receiver<PipelineStatus>,
        metrics: Metrics,
        engine_impl: Option<Arc<dyn Engine>>,
    ) -> Self {
        ActorStatus {
            name: name.to_owned(),
            region: region.to_owned(),
            engine: engine.to_owned(),
            pipeline,
            metrics,
            engine_impl,
            source: Mutex::new(None),
        }
    }

    /// The pipeline subscribed to `name` (a `relay`, the `hub`, or a shared `directory`), or
    /// lost it.
    pub(crate) fn source(&self, name: &str, kind: &'static str, connected: bool) {
        *self.source.lock().unwrap_or_else(PoisonError::into_inner) = Some(Source {
            name: name.to_owned(),
            kind,
            connected,
        });
    }

    fn json(&self) -> Value {
        let p = *self.pipeline.borrow();
        let fingerprint = self.engine_impl.as_ref().and_then(|e| e.fingerprint());
        let source = self
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let now_ms = starling_telemetry::unix_ms();
        json!({
            "role": "actor",
            "name": self.name,
            "region": self.region,
            "now_ms": now_ms,
            "active_version": p.active.map(|(v, _)| v),
            "active_digest": p.active.map(|(_, d)| starling_proto::delta::manifest::hex(&d)),
            "active_at_ms": p.active_at_ms,
            // Staged and waiting for its commit; null once active.
            "staged_version": p.staged,
            // The newest version staged at all, and when: kept once it is active.
            "newest_staged_version": p.newest_staged.map(|(v, _)| v),
            "newest_staged_at_ms": p.newest_staged.map(|(_, at)| at),
            // How long staging the newest active version took here (reported to the hub).
            "staging": p.staging.map(|r| json!({
                "version": r.version,
                "changes": r.changes,
                "busy_ms": r.busy_ns as f64 / 1e6,
                "ns_per_change": r.seconds_per_change().map(|s| s * 1e9),
            })),
            "source": source.map(|s| json!({"name": s.name, "kind": s.kind, "connected": s.connected})),
            "engine": self.engine,
            // What the engine proves it holds; null while it is fenced (it then takes no work).
            "engine_version": fingerprint.map(|f| f.version),
            "engine_digest": fingerprint.map(|f| starling_proto::delta::manifest::hex(&f.digest)),
            "worker_connected": self.metrics.worker_connected(),
        })
    }
}

/// `GET /v1/status`.
pub(crate) fn router(status: Arc<ActorStatus>) -> Router {
    Router::new()
        .route(
            "/v1/status",
            get(|State(s): State<Arc<ActorStatus>>| async move { axum::Json(s.json()) }),
        )
        .with_state(status)
}
