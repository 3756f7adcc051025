//! The actor: keeps a local copy of the policy's weights in step with the hub and generates
//! rollouts with them.
//!
//! - `pipeline`: the weight pipeline, the shell of the receiving core
//!   ([`starling_transport::follow`]): subscribe to the region's relay (else another relay,
//!   else the hub) after the version it holds; stage the next version **frame by frame as it
//!   arrives**, against the active weights, while generating with them; activate it on
//!   `Commit` only once the whole delta verified (signature by the trusted hub key, every
//!   segment hash, base version and digest, post digest). The weights never change in
//!   between: [`starling_proto::delta::apply`] makes the commit a bare overwrite after every check,
//!   with an undo log. Which source to follow, what to fetch again and when, and which
//!   source to drop are the core's and its source policy's decisions.
//! - [`store`]: each activated version is made durable (a snapshot plus a journal of the
//!   verified deltas: O(delta) bytes per step) before it is reported `Active`, so a restarted
//!   actor resumes from the version it last activated.
//! - [`engine`], [`vllm`]: with an engine (`--engine builtin|vllm`), each activated version is
//!   loaded into it at the job boundary, and the rollout [`worker`] claims jobs from the hub,
//!   generates them and submits the results.
//!
//! One QUIC endpoint serves the process: the subscription, the probes of the preferred relay
//! and the worker's connection to the hub. On SIGTERM the actor leaves its source at once and
//! gives the worker [`SHUTDOWN_GRACE`] to finish the generation in flight and submit its
//! results (the hub accepts them before the actor exits; the jobs it had not started are
//! released when its connection closes).

mod anchor;
mod claim_depth;
pub mod cli;
mod completion_stream;
mod concurrent_jobs;
mod config;
pub mod engine;
mod pipeline;
pub mod shared_dir;
mod status;
pub mod store;
pub mod vllm;
pub mod worker;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use starling_checkpoint::deltafile::Model;
use starling_proto::delta::manifest::TrustPolicy;
use starling_telemetry::{Component, Metrics};
use starling_transport::endpoint::{any_addr_for, client_config, client_endpoint};
use starling_transport::follow::{Bounds, FollowConfig, Follower, PolicyConfig, SourcePolicy};
use starling_transport::identity::{Credentials, Role, manifest_trust};
use starling_transport::upstream::Feed;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::engine::Engine;
use crate::status::ActorStatus;
use crate::store::Store;
use crate::worker::PipelineStatus;

/// How long a stopping actor gives its worker to finish the generation in flight and submit
/// its results.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

pub use config::{ActorConfig, EngineSettings, Source};

/// Runs until every source failed too often or `stop` is cancelled (SIGTERM, SIGINT): then
/// it leaves its source, lets the worker submit what it generated (within
/// [`SHUTDOWN_GRACE`]) and returns. Prints `active VERSION DIGEST` after each activation and
/// the pipeline's progress lines (`pipeline`).
pub async fn run(cfg: ActorConfig, stop: CancellationToken) -> Result<()> {
    let creds = Credentials::load_as(&cfg.credentials, Role::Actor).context("load credentials")?;
    let Some(last) = cfg.sources.last() else {
        bail!("no hub or relay to subscribe to");
    };
    let trust = manifest_trust(&cfg.credentials)?;
    let metrics = Metrics::new(Component::Actor);
    let (status, status_rx) = watch::channel(PipelineStatus::default());
    let engine = cfg.build_engine()?;
    let engine_name = match &cfg.engine {
        None => "none",
        Some(e) if e.vllm.is_some() => "vllm",
        Some(_) => "builtin",
    };
    let shown = Arc::new(ActorStatus::new(
        &creds.name,
        &cfg.region,
        engine_name,
        status_rx.clone(),
        metrics.clone(),
        engine.clone(),
    ));
    // Owned by `run`: aborted when it returns.
    let _http = match cfg.http {
        Some(http) => {
            let routes = status::router(shown.clone());
            let (at, task) = starling_telemetry::http::spawn(http, metrics.clone(), routes)
                .await
                .with_context(|| format!("bind HTTP on {http}"))?;
            println!("http on {at}");
            Some(task)
        }
        None => None,
    };
    // The process's one QUIC endpoint: subscriptions, probes and the worker's connection.
    let endpoint =
        client_endpoint(&creds, any_addr_for(last.addr), &cfg.link).context("client endpoint")?;
    let worker_stop = CancellationToken::new();
    let worker = worker::start(
        &cfg,
        &creds,
        &endpoint,
        &engine,
        status_rx,
        &metrics,
        &worker_stop,
    )?;
    let followed = if let Some(dir) = &cfg.weights_dir {
        shown.source(&dir.display().to_string(), "directory", true);
        let follow = shared_dir::SharedDir {
            dir: dir.clone(),
            init: &cfg.init,
            model_id: &cfg.model_id,
            engine,
            status,
            metrics: &metrics,
        }
        .follow();
        tokio::select! {
            r = follow => r,
            _ = stop.cancelled() => Ok(()),
        }
    } else {
        follow_sources(
            &cfg, &creds, &trust, &metrics, engine, status, &shown, &endpoint, &stop,
        )
        .await
    };
    // The worker submits what it holds before the process exits.
    worker_stop.cancel();
    if let Some(w) = worker {
        let started = Instant::now();
        match tokio::time::timeout(SHUTDOWN_GRACE, w).await {
            Ok(_) => tracing::info!(
                took_ms = started.elapsed().as_millis() as u64,
                "worker done"
            ),
            Err(_) => tracing::warn!("grace period over; stopping with a generation in flight"),
        }
    }
    endpoint.close(0u32.into(), b"actor stopping");
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    followed
}

/// The weight pipeline from the store, following `cfg.sources` until `stop` or until every
/// source failed too often.
#[allow(clippy::too_many_arguments)]
async fn follow_sources(
    cfg: &ActorConfig,
    creds: &Credentials,
    trust: &TrustPolicy,
    metrics: &Metrics,
    engine: Option<Arc<dyn Engine>>,
    status: watch::Sender<PipelineStatus>,
    shown: &ActorStatus,
    endpoint: &quinn::Endpoint,
    stop: &CancellationToken,
) -> Result<()> {
    let loaded = Store::open(&cfg.store, &cfg.init, &cfg.model_id, trust)?;
    if loaded.replayed > 0 {
        tracing::info!(entries = loaded.replayed, "replayed the store's journal");
    }
    let bounds = Bounds::for_model(bf16_bytes(loaded.state.weights()));
    let policy = PolicyConfig::actor();
    let quarantine = policy.quarantine;
    let policy = SourcePolicy::new(policy, cfg.sources.len());
    let active = loaded.state.version();
    let mut core = Follower::new(FollowConfig::actor(bounds), policy, active, Instant::now());
    let config = client_config(creds, &cfg.link).context("client configuration")?;
    let mut feed = Feed::new(
        endpoint.clone(),
        config,
        cfg.sources.clone(),
        metrics.clone(),
    );
    let mut p = pipeline::Pipeline {
        cfg,
        name: &creds.name,
        trust,
        layout: loaded.layout,
        store: loaded.store,
        state: loaded.state,
        metrics,
        engine,
        status,
        shown,
        quarantine,
        staging: Default::default(),
        staging_buffers: Default::default(),
        engine_behind: None,
    };
    metrics.set_active(active);
    // At start-up the engine's server is waited for (a start that fails ends the actor);
    // after that, a restart runs beside the pipeline (`pipeline::EngineRetry`).
    tokio::select! {
        loaded = engine::load_waiting(|| p.load_engine(None)) => loaded?,
        () = stop.cancelled() => return Ok(()),
    }
    println!("active {} {}", p.state.version(), p.state.digest());
    starling_transport::drive::run(&mut core, &mut feed, &mut p, stop).await
}

/// A model's BF16 bytes.
fn bf16_bytes(weights: &Model) -> u64 {
    weights.values().map(|t| t.len() as u64 * 2).sum()
}
