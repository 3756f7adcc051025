//! The actor's rollout worker: claims jobs from the hub under leases, generates them with the
//! engine, reports progress, and submits the results.
//!
//! Work flows on a connection of its own, straight to the hub (`docs/api.md`): the data
//! subscription goes through the region's relay, but jobs keep flowing while that relay is
//! down. The worker says `Work`, then runs one event loop over the connection:
//!
//! - **Pipelined claims.** It claims its next jobs while the current ones generate: a `Claim`
//!   goes out whenever it holds at most one claim's worth, so it holds at most two, and the
//!   next generation starts the moment the current one ends instead of a claim round trip
//!   later (150 ms per job batch on the demo's far link). A claim's worth is `--claim` jobs,
//!   or as many as the engine gets through in one round trip if that is more
//!   (`claim_depth`). Replies come back in request order (the hub answers each
//!   message before reading the next), so the loop matches them to a queue of what it asked.
//!   An empty `Jobs` waits 100 ms before the next claim, or less: a version staged or
//!   activated meanwhile (the share it may be waiting for) claims at once.
//! - **Generation** runs on a blocking thread, after waiting (bounded) until the engine holds
//!   at least each job's version (an actor scheduled while D(v) was still arriving activates
//!   v first): one call at a time, or as many as the engine's `calls` (two for vLLM, whose
//!   calls share its sequence budget, so the next call's jobs fill what the current call's
//!   longest jobs leave idle). Its results are submitted at once; the verdicts are
//!   read when they come, without holding up the next generation.
//! - **Progress**, every second while it holds jobs: the tokens generated so far for each job
//!   it holds (0 for the queued ones), which keeps their leases alive for as long as the
//!   engine moves, however long the generation (`docs/api.md`, leases).
//! - **Heartbeats** come from a task of their own: the engine's version and the staged one
//!   every second and at once when either changes; its handle is owned by the connection loop
//!   and aborted with it.
//!
//! A lost connection is retried after a pause; the hub releases the leases the lost
//! connection held as soon as it sees it close, and re-offers their groups.
//!
//! **Stopping** (the actor's SIGTERM): the worker claims nothing more, lets the generation in
//! flight finish, submits its results and waits for their verdicts, then closes its
//! connection (the hub releases the jobs it had not started). The actor bounds this by its
//! grace period.
//!
//! An engine whose fingerprint does not match the version the pipeline committed is fenced:
//! the worker claims nothing until they agree again.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use quinn::{ClientConfig, Endpoint, SendStream};
use starling_proto::protocol::msg::{
    MAX_MESSAGE_BODY, Message, PROTOCOL_VERSION, Role as MsgRole, StagingReport,
};
use starling_proto::protocol::rollout::{JobResult, JobSpec, Verdict, split_for_messages};
use starling_telemetry::Metrics;
use starling_transport::endpoint::connect_with;
use starling_transport::framed::{MessageReader, send};
use starling_transport::identity::{Credentials, Role};
use tokio::sync::{Mutex, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use starling_transport::endpoint::client_config;
use starling_transport::link::LinkProfile;

use crate::ActorConfig;
use crate::claim_depth::ClaimDepth;
use crate::engine::{Engine, JobProgress};

/// Where the weight pipeline stands, as the worker reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineStatus {
    /// The version committed and handed to the engine, with its digest.
    pub active: Option<(u64, [u8; 16])>,
    /// The newest version received completely and staged on its base, not yet active (its
    /// seal is checked at commit).
    pub staged: Option<u64>,
    /// When `active` became active (Unix ms): what a benchmark reads instead of polling for
    /// the moment.
    pub active_at_ms: Option<u64>,
    /// The newest version staged so far and when (Unix ms); kept after it becomes active.
    pub newest_staged: Option<(u64, u64)>,
    /// How long staging the newest version activated here took (sent to the hub once per
    /// version as `StagingTime`: its codec choice predicts staging from the slowest actor's).
    pub staging: Option<StagingReport>,
}

impl PipelineStatus {
    /// `version` is staged now.
    pub fn stage(&mut self, version: u64) {
        self.staged = Some(version);
        self.newest_staged = Some((version, starling_telemetry::unix_ms()));
    }

    /// `version` is no longer staged (it failed its seal or commit, or was discarded).
    pub fn unstage(&mut self, version: u64) {
        self.staged = self.staged.filter(|&v| v != version);
    }

    /// `version` with `digest` is active now; a staged version at or below it is no longer
    /// waiting.
    pub fn activate(&mut self, version: u64, digest: [u8; 16]) {
        self.active = Some((version, digest));
        self.active_at_ms = Some(starling_telemetry::unix_ms());
        self.staged = self.staged.filter(|&v| v > version);
    }
}

/// What the worker needs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub hub: std::net::SocketAddr,
    pub region: String,
    pub model_id: String,
    pub hardware: String,
    /// Jobs (groups) claimed per generation call, at least; more where the engine gets
    /// through more in one round trip to the hub (`claim_depth`). At most two
    /// claims' worth are held at once (the next call's jobs are claimed while the current
    /// call generates).
    pub claim: u32,
}

/// How the worker reaches the hub: the process's endpoint, the link's configuration.
#[derive(Debug, Clone)]
struct Link {
    endpoint: Endpoint,
    config: ClientConfig,
}

/// Runs the worker until `stop`; then it submits what it generated and returns.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    creds: Credentials,
    cfg: WorkerConfig,
    endpoint: Endpoint,
    config: ClientConfig,
    engine: Arc<dyn Engine>,
    status: watch::Receiver<PipelineStatus>,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let link = Link { endpoint, config };
    loop {
        let s = session(&creds, &cfg, &link, &engine, &status, &metrics, &stop);
        if let Err(e) = s.await {
            tracing::warn!("worker connection lost: {e:#}; reconnecting");
        }
        if stop.is_cancelled() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.cancelled() => return,
        }
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

/// What the loop is waiting for from the hub, in the order it asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaiting {
    Jobs,
    Verdicts(usize),
}

/// The generation in flight: its jobs, their progress, and the task that generates them.
struct Running {
    jobs: Vec<u64>,
    progress: Arc<JobProgress>,
    task: tokio::task::JoinHandle<Result<(Vec<JobResult>, Duration)>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        // The task waits on a blocking thread that an abort does not reach: the engine is
        // asked to end the call too (the `vllm` engine drops its streams; a session that
        // ended with another call's failure would otherwise leave this one generating work
        // nobody takes, holding the engine's version and sequences).
        self.progress.stop();
        self.task.abort();
    }
}

async fn session(
    creds: &Credentials,
    cfg: &WorkerConfig,
    link: &Link,
    engine: &Arc<dyn Engine>,
    status: &watch::Receiver<PipelineStatus>,
    metrics: &Metrics,
    stop: &CancellationToken,
) -> Result<()> {
    let connecting = connect_with(
        &link.endpoint,
        link.config.clone(),
        cfg.hub,
        Role::Hub,
        "hub",
    );
    let conn = tokio::select! {
        c = connecting => c.context("connect to the hub")?,
        _ = stop.cancelled() => return Ok(()),
    };
    let _close = CloseOnDrop(conn.clone());
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
    let _heartbeat = AbortOnDropHandle::new(tokio::spawn(heartbeat(
        tx.clone(),
        engine.clone(),
        status.clone(),
    )));
    let mut depth = ClaimDepth::new(cfg.claim);
    let mut pipeline_moved = status.clone();
    let mut watching = true;
    let mut awaiting: VecDeque<Awaiting> = VecDeque::new();
    let mut queued: VecDeque<Vec<JobSpec>> = VecDeque::new();
    // The generations in flight, at most `caps.calls` (one for the built-in engine).
    let mut running: Vec<Running> = Vec::new();
    let calls = caps.calls.max(1) as usize;
    let mut last_end: Option<Instant> = None;
    let mut next_claim = Instant::now();
    let mut progress_timer = tokio::time::interval(Duration::from_secs(1));
    progress_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut draining = false;
    loop {
        if stop.is_cancelled() && !draining {
            // Claim nothing more; the jobs not started are released when the connection
            // closes. The generation in flight finishes and its results are submitted.
            draining = true;
            let dropped: usize = queued.iter().map(Vec::len).sum();
            queued.clear();
            tracing::info!(
                generating = running.iter().map(|r| r.jobs.len()).sum::<usize>(),
                released = dropped,
                "stopping: submitting the generation in flight"
            );
        }
        if draining {
            queued.clear();
            let verdicts_due = awaiting.iter().any(|a| matches!(a, Awaiting::Verdicts(_)));
            if running.is_empty() && !verdicts_due {
                return Ok(());
            }
        }
        // Start the next generation as soon as the engine can take it.
        while running.len() < calls
            && let Some(jobs) = queued.pop_front()
        {
            running.push(start_generation(engine, jobs));
        }
        let held = running.iter().map(|r| r.jobs.len()).sum::<usize>()
            + queued.iter().map(Vec::len).sum::<usize>();
        let claim = depth.size(conn.rtt()) as usize;
        let claiming = awaiting.contains(&Awaiting::Jobs);
        let may_claim = !draining && !claiming && held <= claim && in_step(engine, status);
        let claim_at = tokio::time::Instant::from_std(next_claim);
        tokio::select! {
            m = reader.next() => {
                let m = m?.context("the hub closed the work stream")?;
                let asked = awaiting.pop_front();
                match (asked, m) {
                    (_, Message::Refuse { reason, detail }) => {
                        bail!("the hub refused ({reason:?}): {detail}")
                    }
                    (Some(Awaiting::Jobs), Message::Jobs { jobs }) => {
                        // The hub answered a claim sent after `Work` and the first heartbeat
                        // on the same stream, so it has registered this worker and knows its
                        // version.
                        connected.set();
                        if jobs.is_empty() {
                            next_claim = Instant::now() + Duration::from_millis(100);
                        } else {
                            queued.push_back(jobs);
                        }
                    }
                    (Some(Awaiting::Verdicts(n)), Message::Verdicts { verdicts }) => {
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
                    (asked, other) => bail!("unexpected answer to {asked:?}: {other:?}"),
                }
            }
            (i, done) = finished(&mut running) => {
                running.remove(i);
                let (results, took) = done.context("generation task")?.context("generate")?;
                // With calls overlapping, a call's own time counts only where no earlier
                // call's end already covered it: the engine's rate, not each call's.
                depth.observe(results.len(), own_time(took, Instant::now(), &mut last_end));
                // Each `Submit` carries what fits one message; a result too large for any
                // goes alone (the hub refuses it by name), so it sinks none of the others.
                for part in split_for_messages(results, MAX_MESSAGE_BODY) {
                    let n = part.len();
                    send(&mut *tx.lock().await, &Message::Submit { results: part }).await?;
                    awaiting.push_back(Awaiting::Verdicts(n));
                }
            }
            _ = progress_timer.tick(), if held > 0 => {
                let mut jobs: Vec<(u64, u64)> = Vec::with_capacity(held);
                for r in &running {
                    jobs.extend(r.jobs.iter().copied().zip(r.progress.snapshot()));
                }
                for q in &queued {
                    jobs.extend(q.iter().map(|j| (j.job, 0)));
                }
                send(&mut *tx.lock().await, &Message::Progress { jobs }).await?;
            }
            _ = tokio::time::sleep_until(claim_at), if may_claim => {
                let max = u32::try_from(claim).unwrap_or(u32::MAX);
                send(&mut *tx.lock().await, &Message::Claim { max }).await?;
                awaiting.push_back(Awaiting::Jobs);
            }
            // A version staged or activated: a share may be waiting for it; claim now.
            moved = pipeline_moved.changed(), if watching => {
                watching = moved.is_ok();
                next_claim = Instant::now();
            }
            // Fenced (or a claim already out with nothing else to do): look again soon.
            _ = tokio::time::sleep(Duration::from_millis(100)), if !may_claim => {}
            _ = stop.cancelled(), if !draining => {}
        }
    }
}

/// Closes the worker's connection when its session ends (the endpoint is the process's and
/// outlives it), so the hub releases what the session held at once.
struct CloseOnDrop(quinn::Connection);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close(0u32.into(), b"worker done");
    }
}

/// The first generation in flight to end, and its place (never, if none is in flight).
async fn finished(
    running: &mut [Running],
) -> (
    usize,
    Result<Result<(Vec<JobResult>, Duration)>, tokio::task::JoinError>,
) {
    if running.is_empty() {
        return std::future::pending().await;
    }
    std::future::poll_fn(|cx| {
        for (i, r) in running.iter_mut().enumerate() {
            if let Poll::Ready(done) = Pin::new(&mut r.task).poll(cx) {
                return Poll::Ready((i, done));
            }
        }
        Poll::Pending
    })
    .await
}

/// The part of a call that took `took` and ended at `now` that no earlier call's end covered
/// (`last_end`, moved to `now`): with calls overlapping, these parts tile the time the engine
/// was busy, so jobs over them is the engine's rate, where each call's own time would count
/// the overlap twice.
fn own_time(took: Duration, now: Instant, last_end: &mut Option<Instant>) -> Duration {
    let started = now.checked_sub(took).unwrap_or(now);
    let from = last_end.map_or(started, |e| e.max(started));
    *last_end = Some(last_end.map_or(now, |e| e.max(now)));
    now.saturating_duration_since(from)
}

/// Whether the engine holds exactly what the pipeline committed (otherwise it is fenced).
fn in_step(engine: &Arc<dyn Engine>, status: &watch::Receiver<PipelineStatus>) -> bool {
    let committed = status.borrow().active;
    match (committed, engine.fingerprint()) {
        (Some((v, d)), Some(f)) => f.version == v && f.digest == d,
        _ => false,
    }
}

/// Generates `jobs` on a blocking thread once the engine holds their version.
fn start_generation(engine: &Arc<dyn Engine>, jobs: Vec<JobSpec>) -> Running {
    let progress = Arc::new(JobProgress::new(jobs.len()));
    let ids = jobs.iter().map(|j| j.job).collect();
    let (eng, counts) = (engine.clone(), progress.clone());
    let task = tokio::spawn(async move {
        wait_for_version(&eng, &jobs).await;
        let started = Instant::now();
        let results = tokio::task::spawn_blocking(move || eng.generate(&jobs, &counts))
            .await
            .context("generation thread")??;
        Ok((results, started.elapsed()))
    });
    Running {
        jobs: ids,
        progress,
        task,
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
    let mut reported = None;
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
        let (staged, staging) = {
            let s = status.borrow();
            (s.staged, s.staging)
        };
        // Each version's staging time once per connection (this task lives as long as it),
        // ahead of the heartbeat that says the version is active: a hub that sees it active
        // has its report.
        let mut messages = Vec::with_capacity(2);
        if let Some(report) = staging.filter(|r| Some(r.version) != reported) {
            reported = Some(report.version);
            messages.push(Message::StagingTime { report });
        }
        messages.push(Message::Heartbeat { active, staged });
        let mut tx = tx.lock().await;
        for m in &messages {
            if send(&mut tx, m).await.is_err() {
                return;
            }
        }
    }
}

/// Starts the rollout worker when the actor has an engine; it runs until `stop`, then
/// submits what it generated and ends.
pub(crate) fn start(
    cfg: &ActorConfig,
    creds: &Credentials,
    endpoint: &quinn::Endpoint,
    engine: &Option<Arc<dyn Engine>>,
    status_rx: watch::Receiver<PipelineStatus>,
    metrics: &Metrics,
    stop: &CancellationToken,
) -> Result<Option<AbortOnDropHandle<()>>> {
    let (Some(engine), Some(e)) = (engine, &cfg.engine) else {
        return Ok(None);
    };
    let hub = cfg
        .sources
        .iter()
        .find(|s| s.role == Role::Hub)
        .context("an actor with an engine needs the hub's address")?;
    let wcfg = WorkerConfig {
        hub: hub.addr,
        region: cfg.region.clone(),
        model_id: cfg.model_id.clone(),
        hardware: e.hardware.clone(),
        claim: e.claim,
    };
    let config = client_config(creds, &LinkProfile::LAN).context("client configuration")?;
    Ok(Some(AbortOnDropHandle::new(tokio::spawn(run(
        creds.clone(),
        wcfg,
        endpoint.clone(),
        config,
        engine.clone(),
        status_rx,
        metrics.clone(),
        stop.clone(),
    )))))
}

#[cfg(test)]
mod tests {
    use super::{PipelineStatus, own_time};
    use std::time::{Duration, Instant};

    #[test]
    fn overlapping_calls_count_the_busy_time_once() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut last = None;
        // Calls of 10 s ending at 10 and 15 (the second began at 5): 10 s, then 5 s.
        assert_eq!(own_time(s(10), t0 + s(10), &mut last), s(10));
        assert_eq!(own_time(s(10), t0 + s(15), &mut last), s(5));
        // A call that began after the last end counts whole: the engine was idle between.
        assert_eq!(own_time(s(3), t0 + s(20), &mut last), s(3));
        // A call ending within an earlier one counts nothing more.
        let mut last = Some(t0 + s(30));
        assert_eq!(own_time(s(2), t0 + s(29), &mut last), Duration::ZERO);
    }

    #[test]
    fn a_version_that_fails_is_no_longer_reported_staged() {
        let mut s = PipelineStatus::default();
        s.stage(3);
        s.unstage(2);
        assert_eq!(
            s.staged,
            Some(3),
            "another version's failure changes nothing"
        );
        s.unstage(3);
        assert_eq!(s.staged, None);
        assert_eq!(
            s.newest_staged.map(|(v, _)| v),
            Some(3),
            "the stamp of when it was staged stays"
        );
    }

    #[test]
    fn activating_a_version_keeps_a_newer_staged_one_and_the_staging_time() {
        let mut s = PipelineStatus::default();
        s.stage(3);
        let staged = s.newest_staged;
        assert_eq!(staged.map(|(v, _)| v), Some(3));
        s.activate(2, [2; 16]);
        assert_eq!((s.staged, s.newest_staged), (Some(3), staged));
        assert_eq!(s.active, Some((2, [2; 16])));
        assert!(
            s.active_at_ms
                .zip(staged)
                .is_some_and(|(active, (_, staged))| active >= staged)
        );
        s.activate(3, [3; 16]);
        assert_eq!((s.staged, s.newest_staged), (None, staged));
        assert_eq!(s.active.map(|a| a.0), Some(3));
    }
}
