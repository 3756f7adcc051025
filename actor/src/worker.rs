//! The actor's rollout worker: claims jobs from the hub under leases, generates them with the
//! engine, and submits the results.
//!
//! Work flows on a connection of its own, straight to the hub (`docs/api.md`): the data
//! subscription goes through the region's relay, but jobs keep flowing while that relay is
//! down. The worker says `Work`, then loops: `Claim` → `Jobs`; wait until the engine holds at
//! least each job's version (an actor scheduled with COMMIT(v) pending activates v first);
//! generate on a blocking thread; `Submit` → `Verdicts`. A heartbeat task reports the
//! engine's version and the staged one every second and at once when either changes; its handle is owned by the connection
//! loop and aborted with it. A lost connection is retried after a pause; the ledger's leases
//! take care of jobs that were in flight (they expire and are re-offered).
//!
//! An engine whose fingerprint does not match the version the pipeline committed is fenced:
//! the worker claims nothing until they agree again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use quinn::SendStream;
use starling_proto::msg::{Message, PROTOCOL_VERSION, Role as MsgRole};
use starling_proto::rollout::{JobSpec, Verdict};
use starling_telemetry::Metrics;
use starling_transport::endpoint::{client_endpoint, connect};
use starling_transport::framed::{MessageReader, send};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use tokio::sync::{Mutex, watch};

use crate::engine::Engine;

/// Where the weight pipeline stands, as the worker reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineStatus {
    /// The version committed and handed to the engine, with its digest.
    pub active: Option<(u64, [u8; 16])>,
    /// The newest version received completely and verified, not yet active.
    pub staged: Option<u64>,
}

/// What the worker needs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub hub: std::net::SocketAddr,
    pub region: String,
    pub model_id: String,
    pub hardware: String,
    /// Jobs (groups) claimed per generation call.
    pub claim: u32,
}

/// Runs the worker until the process stops.
pub async fn run(
    creds: Credentials,
    cfg: WorkerConfig,
    engine: Arc<dyn Engine>,
    status: watch::Receiver<PipelineStatus>,
    metrics: Metrics,
) {
    loop {
        if let Err(e) = session(&creds, &cfg, &engine, &status, &metrics).await {
            tracing::warn!("worker connection lost: {e:#}; reconnecting");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `starling_actor_worker_connected`: 1 from the first answered claim until the session ends.
struct ConnectedGauge<'a> {
    metrics: &'a Metrics,
    set: bool,
}

impl ConnectedGauge<'_> {
    fn set(&mut self) {
        if !self.set {
            self.metrics.set_worker_connected(true);
            self.set = true;
        }
    }
}

impl Drop for ConnectedGauge<'_> {
    fn drop(&mut self) {
        self.metrics.set_worker_connected(false);
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn session(
    creds: &Credentials,
    cfg: &WorkerConfig,
    engine: &Arc<dyn Engine>,
    status: &watch::Receiver<PipelineStatus>,
    metrics: &Metrics,
) -> Result<()> {
    let bind: std::net::SocketAddr = if cfg.hub.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()?;
    let ep = client_endpoint(creds, bind, &LinkProfile::LAN).context("client endpoint")?;
    let conn = connect(&ep, cfg.hub, Role::Hub, "hub")
        .await
        .context("connect to the hub")?;
    let (tx, rx) = conn.open_bi().await.context("open the work stream")?;
    let tx = Arc::new(Mutex::new(tx));
    let mut reader = MessageReader::new(rx);
    let caps = engine.capabilities();
    let active = status.borrow().active;
    {
        let mut t = tx.lock().await;
        send(
            &mut t,
            &Message::Hello {
                protocol: PROTOCOL_VERSION,
                role: MsgRole::Actor,
                name: creds.name.clone(),
                region: cfg.region.clone(),
                model_id: cfg.model_id.clone(),
                active,
                link: None,
            },
        )
        .await?;
    }
    match reader.next().await? {
        Some(Message::Welcome { .. }) => {}
        Some(Message::Refuse { detail, .. }) => bail!("the hub refused: {detail}"),
        other => bail!("unexpected answer to Hello: {other:?}"),
    }
    send(
        &mut *tx.lock().await,
        &Message::Work {
            engine: caps.engine.clone(),
            hardware: cfg.hardware.clone(),
            max_batch: caps.max_batch,
        },
    )
    .await?;
    println!("worker connected");
    let mut connected = ConnectedGauge {
        metrics,
        set: false,
    };
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
        tx.clone(),
        engine.clone(),
        status.clone(),
    )));
    loop {
        // Fenced until the engine holds exactly what the pipeline committed.
        let committed = status.borrow().active;
        let fp = engine.fingerprint();
        let in_step = match (committed, fp) {
            (Some((v, d)), Some(f)) => f.version == v && f.digest == d,
            _ => false,
        };
        if !in_step {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        send(&mut *tx.lock().await, &Message::Claim { max: cfg.claim }).await?;
        let jobs = match reader.next().await? {
            Some(Message::Jobs { jobs }) => jobs,
            other => bail!("unexpected answer to Claim: {other:?}"),
        };
        // The hub answered a claim sent after `Work` and the first heartbeat on the same
        // stream, so it has registered this worker and knows its version.
        connected.set();
        if jobs.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        wait_for_version(engine, &jobs).await;
        let eng = engine.clone();
        let n = jobs.len();
        let results = tokio::task::spawn_blocking(move || eng.generate(&jobs))
            .await
            .context("generation task")?
            .context("generate")?;
        send(&mut *tx.lock().await, &Message::Submit { results }).await?;
        let verdicts = match reader.next().await? {
            Some(Message::Verdicts { verdicts }) => verdicts,
            other => bail!("unexpected answer to Submit: {other:?}"),
        };
        let mut accepted = 0;
        for (job, v) in &verdicts {
            match v {
                Verdict::Accepted => accepted += 1,
                Verdict::Refused { code, detail } => {
                    metrics.refused(code);
                    tracing::warn!(job, code = %code, "result refused: {detail}");
                }
            }
        }
        println!("submitted {n} accepted {accepted}");
    }
}

/// Waits (bounded) until the engine holds at least every job's version: jobs scheduled on an
/// actor that still had COMMIT(v) to apply.
async fn wait_for_version(engine: &Arc<dyn Engine>, jobs: &[JobSpec]) {
    let need = jobs.iter().map(|j| j.version).max().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.fingerprint().is_none_or(|f| f.version < need) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn heartbeat(
    tx: Arc<Mutex<SendStream>>,
    engine: Arc<dyn Engine>,
    mut status: watch::Receiver<PipelineStatus>,
) {
    let mut timer = tokio::time::interval(Duration::from_secs(1));
    let mut watching = true;
    loop {
        // Every second, and at once when the pipeline stages or activates a version: the
        // hub decides who is eligible for a batch from the last heartbeat, and a view up to a
        // second old would leave an actor that already holds the batch's version out of it.
        tokio::select! {
            _ = timer.tick() => {}
            changed = status.changed(), if watching => {
                if changed.is_err() {
                    watching = false;
                }
            }
        }
        let active = engine.fingerprint().map(|f| (f.version, f.digest));
        let staged = status.borrow().staged;
        let m = Message::Heartbeat { active, staged };
        if send(&mut *tx.lock().await, &m).await.is_err() {
            return;
        }
    }
}
