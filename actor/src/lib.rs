//! The actor's weight pipeline: subscribe to the region's relay (else another relay, else the
//! hub) after the version it holds; stage the next version **frame by frame as it arrives**,
//! against the active weights, while generating with them; activate it on `Commit` only once
//! the whole delta verified (signature by the trusted hub key, every segment hash, base
//! version and digest, post digest). The weights never change in between:
//! [`starling_proto::apply`] makes the commit a bare overwrite after every check, with an
//! undo log.
//!
//! Each activated version is made durable in the [`store`] (a snapshot plus a journal of the
//! verified deltas: O(delta) bytes per step) before it is reported `Active`, so a restarted
//! actor resumes from the version it last activated.
//!
//! Recovery: missing segments are fetched once every stripe of a transmission ended
//! (`Reception`); a source that dies is replaced by the next one with `Resume`, so the
//! segments already staged are not sent again; an actor behind every source's retained deltas
//! restores the hub's newest anchor (sealed, hashed, checked) and follows the chain from it.
//!
//! With an engine (`--engine builtin`), each activated version is loaded into it at the job
//! boundary (the engine swaps versions between generation calls, see [`engine`]) and the
//! rollout [`worker`] claims jobs from the hub, generates them and submits the results.

pub mod cli;
pub mod engine;
pub mod shared_dir;
mod status;
pub mod store;
pub mod vllm;
pub mod worker;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ed25519_dalek::VerifyingKey;
use quinn::SendStream;
use starling_checkpoint::deltafile::Model;
use starling_checkpoint::safetensors::Checkpoint;
use starling_proto::anchor::AnchorSeal;
use starling_proto::apply::Stager;
use starling_proto::apply::{UndoLog, VersionedWeights, full_digest};
use starling_proto::manifest::TrustPolicy;
use starling_proto::msg::{MAX_SEQS, RefuseReason};
use starling_proto::msg::{Message, PROTOCOL_VERSION, Role as MsgRole};
use starling_telemetry::{Component, Metrics};

use crate::status::ActorStatus;
use starling_transport::endpoint::EndpointError;
use starling_transport::framed::{DataStreamReader, StreamFrame, send};
use starling_transport::identity::{Credentials, Role, manifest_key};
use starling_transport::link::LinkProfile;
use starling_transport::reception::{Added, Reception};
use starling_transport::upstream::{UpstreamError, UpstreamEvent, subscribe};
use std::sync::Arc;

use engine::{BuiltinEngine, Engine};
use starling_engine::ModelConfig;
use store::{Layout, Store};
use tokio::sync::watch;
use worker::PipelineStatus;

/// Where to subscribe: relays of the actor's region first, then the hub.
#[derive(Debug, Clone)]
pub struct Source {
    pub role: Role,
    pub name: String,
    pub addr: SocketAddr,
}

/// What the actor needs.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// Credentials written by `starling-hub issue --role actor`.
    pub credentials: PathBuf,
    /// Tried in order; on failure or disconnect the next one (then around again).
    pub sources: Vec<Source>,
    /// The checkpoint to start from when the store holds none yet.
    pub init: PathBuf,
    /// Where the active weights are kept.
    pub store: PathBuf,
    pub region: String,
    pub model_id: String,
    pub link: LinkProfile,
    /// Where to serve `/metrics` (none: not served).
    pub http: Option<SocketAddr>,
    /// Generate rollouts with this engine (none: hold weights only).
    pub engine: Option<EngineSettings>,
    /// Read each version's full checkpoint from this directory instead of receiving deltas
    /// (the no-transfer baseline, [`shared_dir`]); relays are not used.
    pub weights_dir: Option<PathBuf>,
}

/// The rollout engine and worker settings.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// The model's HF `config.json`.
    pub model_config: PathBuf,
    /// Sequences decoded together.
    pub max_batch: u32,
    /// Groups claimed per generation call.
    pub claim: u32,
    /// Stretch each generation call to this many times its compute time (≥ 1; benchmarks).
    pub slowdown: f64,
    /// A label for the hardware (reported to the hub).
    pub hardware: String,
    /// Generate with a vLLM server (`vllm`) instead of the built-in engine.
    pub vllm: Option<vllm::VllmSettings>,
}

/// How many times in a row the actor may fail to reach any source before it gives up.
const MAX_FAILOVERS: u32 = 50;

/// How many times one version may be fetched again before the actor gives up.
const MAX_REFETCHES: u32 = 5;

/// One version on its way in: buffering until its base is active, then staging. Sealing and
/// committing follow at once in [`Pipeline::activate_ready`], so they are no lasting state:
/// a version is pending (one of these), active, or gone.
#[derive(Debug)]
struct Pending {
    reception: Reception,
    stage: Stage,
    /// Every frame's wire bytes (for the store's journal).
    raw: Vec<Vec<u8>>,
    /// Wire bytes held for this version (staged or buffered), against [`Pipeline::version_cap`].
    held: u64,
}

/// Where a pending version stands.
#[derive(Debug)]
enum Stage {
    /// Its base is not active yet: frames are kept as they came (decoding needs the base).
    Buffering(Vec<StreamFrame>),
    /// Its base is active (it is active + 1): each frame is staged on arrival, against the
    /// untouched active weights.
    Staging(Box<Stager>),
}

/// Versions beyond the active one that the actor holds frames of: a server streams one
/// version at a time per subscriber, so more than this ahead is a broken or hostile source.
const MAX_VERSIONS_AHEAD: u64 = 8;

/// What handling an event led to.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Nothing,
    Activated,
    /// Subscribe again (after restoring an anchor, or to another source).
    Resubscribe,
}

/// The actor's weight pipeline: the active weights and what is on its way.
struct Pipeline<'a> {
    cfg: &'a ActorConfig,
    trust: &'a TrustPolicy,
    layout: Layout,
    store: Store,
    metrics: &'a Metrics,
    state: VersionedWeights<Model>,
    pending: BTreeMap<u64, Pending>,
    commits: BTreeSet<u64>,
    retries: BTreeMap<u64, u32>,
    /// The upstream we are subscribed to now (metrics label).
    peer: String,
    /// An anchor was asked of the current upstream.
    anchor_asked: bool,
    /// The engine each activated version is loaded into.
    engine: Option<Arc<dyn Engine>>,
    /// What the worker reports to the hub.
    status: watch::Sender<PipelineStatus>,
    /// The most wire bytes one version may take: a delta is never larger than the whole
    /// model coded densely (its BF16 bytes) plus framing; a source that sends more, or more
    /// than twice this over every version in flight (an honest source streams the next
    /// version while the one before awaits its commit, never more), is dropped.
    version_cap: u64,
    /// Why the current source is being dropped (it broke a bound), if it is.
    misbehaved: Option<String>,
}

/// Runs until every source failed too often or the process is stopped. Prints `active
/// VERSION DIGEST` after each activation, `refetch VERSION` when (part of) a delta is
/// requested again, and `upstream ROLE NAME` when it (re)subscribes.
pub async fn run(cfg: ActorConfig) -> Result<()> {
    let creds = Credentials::load_peer(&cfg.credentials).context("load credentials")?;
    if creds.role != Role::Actor {
        bail!(
            "{} holds {} credentials, not an actor's",
            cfg.credentials.display(),
            creds.role.as_str()
        );
    }
    if cfg.sources.is_empty() {
        bail!("no hub or relay to subscribe to");
    }
    let key = VerifyingKey::from_bytes(&manifest_key(&cfg.credentials)?)
        .context("signing.pub is not an ed25519 key")?;
    let trust = TrustPolicy::Keys(vec![key]);
    let metrics = Metrics::new(Component::Actor);
    let (status, status_rx) = watch::channel(PipelineStatus::default());
    let engine_name = match &cfg.engine {
        None => "none",
        Some(e) if e.vllm.is_some() => "vllm",
        Some(_) => "builtin",
    };
    let engine: Option<Arc<dyn Engine>> = match &cfg.engine {
        None => None,
        Some(e) if e.vllm.is_some() => {
            let settings = e.vllm.clone().context("vllm settings")?;
            Some(Arc::new(vllm::VllmEngine::new(
                settings,
                &e.model_config,
                &cfg.model_id,
                &cfg.store,
                e.max_batch,
            )?))
        }
        Some(e) => {
            let config = ModelConfig::from_file(&e.model_config)
                .with_context(|| format!("read {}", e.model_config.display()))?;
            Some(Arc::new(BuiltinEngine::new(
                config,
                &cfg.model_id,
                e.max_batch,
                e.slowdown,
            )?))
        }
    };
    let shown = Arc::new(ActorStatus::new(
        &creds.name,
        &cfg.region,
        engine_name,
        status_rx.clone(),
        metrics.clone(),
        engine.clone(),
    ));
    let mut http_server = None;
    if let Some(http) = cfg.http {
        let (listener, at) = starling_telemetry::http::bind(http)
            .await
            .with_context(|| format!("bind HTTP on {http}"))?;
        let m = metrics.clone();
        let routes = status::router(shown.clone());
        // Owned by `run`: aborted when it returns or is dropped (SIGTERM, SIGINT).
        http_server = Some(AbortOnDrop(tokio::spawn(async move {
            if let Err(e) = starling_telemetry::http::serve(listener, m, routes).await {
                tracing::error!("HTTP server stopped: {e}");
            }
        })));
        println!("http on {at}");
    }
    let _http_server = http_server;
    if let Some(dir) = &cfg.weights_dir {
        shown.source(&dir.display().to_string(), "directory", true);
        let _worker = start_worker(&cfg, &creds, &engine, status_rx, &metrics)?;
        return shared_dir::SharedDir {
            dir: dir.clone(),
            init: &cfg.init,
            model_id: &cfg.model_id,
            engine,
            status,
            metrics: &metrics,
        }
        .follow()
        .await;
    }
    let loaded = Store::open(&cfg.store, &cfg.init, &cfg.model_id, &trust)?;
    if loaded.replayed > 0 {
        tracing::info!(entries = loaded.replayed, "replayed the store's journal");
    }
    let mut p = Pipeline {
        cfg: &cfg,
        trust: &trust,
        layout: loaded.layout,
        store: loaded.store,
        metrics: &metrics,
        state: loaded.state,
        pending: BTreeMap::new(),
        commits: BTreeSet::new(),
        retries: BTreeMap::new(),
        peer: String::new(),
        anchor_asked: false,
        engine: engine.clone(),
        status,
        version_cap: 0,
        misbehaved: None,
    };
    p.version_cap = version_cap(p.state.weights());
    metrics.set_active(p.state.version());
    p.load_engine(None)?;
    println!("active {} {}", p.state.version(), p.state.digest());
    // The rollout worker lives as long as `run`.
    let _worker = start_worker(&cfg, &creds, &engine, status_rx, &metrics)?;

    let mut failures = 0u32;
    // The source to try next: after a loss, the one after the source lost (relays in order,
    // then the hub); after the preferred source (the first) answers again, the preferred one.
    let mut next = 0usize;
    // Sources that broke a bound, and until when they are not used.
    let mut quarantined: BTreeMap<usize, tokio::time::Instant> = BTreeMap::new();
    loop {
        let now = tokio::time::Instant::now();
        quarantined.retain(|_, until| *until > now);
        let Some(index) = (0..cfg.sources.len())
            .map(|k| (next + k) % cfg.sources.len())
            .find(|i| !quarantined.contains_key(i))
        else {
            // Every source misbehaved: wait for the first quarantine to end.
            let until = quarantined.values().min().copied().unwrap_or(now);
            tokio::time::sleep_until(until).await;
            continue;
        };
        let source = &cfg.sources[index];
        next = index + 1;
        let active = p.state.version();
        let hello = Message::Hello {
            protocol: PROTOCOL_VERSION,
            role: MsgRole::Actor,
            name: creds.name.clone(),
            region: cfg.region.clone(),
            model_id: cfg.model_id.clone(),
            active: Some((active, p.state.digest().to_bytes())),
            link: Some(cfg.link.stated()),
        };
        // Versions already active will not be needed again.
        p.pending.retain(|&v, _| v > active);
        p.commits.retain(|&v| v > active);
        // Continue a half-received next version from the segments already staged: the new
        // source sends only the rest (`Resume`), and the subscription continues after it.
        let resume = p.pending.get_mut(&(active + 1)).and_then(|n| {
            n.reception.reset_requests();
            let have = n.reception.have();
            (!have.is_empty() && have.len() <= MAX_SEQS).then_some(have)
        });
        let after = if resume.is_some() { active + 1 } else { active };
        let mut up = match subscribe(
            &creds,
            source.addr,
            source.role,
            &source.name,
            &hello,
            after,
            &cfg.link,
        )
        .await
        {
            Ok(up) => up,
            Err(e @ UpstreamError::Endpoint(EndpointError::ForeignCluster { .. })) => {
                return Err(e).context("subscribe");
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(
                    source = %source.name,
                    role = source.role.as_str(),
                    addr = %source.addr,
                    "source not reached: {}",
                    starling_telemetry::error_chain(&e)
                );
                if failures > MAX_FAILOVERS {
                    return Err(e)
                        .context(format!("no source reachable after {failures} attempts"));
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                continue;
            }
        };
        println!("upstream {} {}", source.role.as_str(), source.name);
        tracing::info!(source = %source.name, role = source.role.as_str(), after_version = after, "subscribed");
        shown.source(&source.name, source.role.as_str(), true);
        p.peer = source.name.clone();
        p.anchor_asked = false;
        if let Some(have) = resume {
            println!("resume {} have {}", active + 1, have.len());
            let version = active + 1;
            // A failed send shows up as the connection closing.
            let _ = send(&mut up.control, &Message::Resume { version, have }).await;
        }
        // On a fallback source, look for the preferred one every `PREFERRED_PROBE`: while the
        // actor stays on the hub, its region's relay no longer saves the WAN a copy per actor.
        let mut probe = tokio::time::interval_at(
            tokio::time::Instant::now() + PREFERRED_PROBE,
            PREFERRED_PROBE,
        );
        let mut returning = false;
        // The last probe found the preferred source back: return at the next version boundary
        // (the next activation with nothing half-received), not only at a probe.
        let mut preferred_back = false;
        let mut health = tokio::time::interval(ENGINE_HEALTH);
        loop {
            let ev = tokio::select! {
                ev = up.events.recv() => ev,
                _ = health.tick(), if p.engine.is_some() => {
                    p.reload_engine_if_lost();
                    continue;
                }
                _ = probe.tick(), if index > 0 && !quarantined.contains_key(&0) => {
                    preferred_back = preferred_is_back(&cfg.sources[0], &creds, &hello, &cfg.link, p.state.version()).await;
                    if preferred_back && p.pending.is_empty() {
                        returning = true;
                        break;
                    }
                    continue;
                }
            };
            let Some(ev) = ev else { break };
            if let UpstreamEvent::Closed(why) = &ev {
                tracing::warn!(source = %source.name, role = source.role.as_str(), "source lost: {why}");
                break;
            }
            match p.handle(ev, &mut up.control).await? {
                Outcome::Nothing => {}
                Outcome::Activated => {
                    failures = 0;
                    if preferred_back && p.pending.is_empty() {
                        returning = true;
                        break;
                    }
                }
                Outcome::Resubscribe => break,
            }
        }
        up.close().await;
        shown.source(&source.name, source.role.as_str(), false);
        if p.misbehaved.take().is_some() {
            quarantined.insert(index, tokio::time::Instant::now() + QUARANTINE);
        }
        if returning {
            // At a version boundary (nothing half-received): back to the preferred source.
            tracing::info!(
                source = %cfg.sources[0].name,
                from = %source.name,
                "the preferred source answers again; returning to it"
            );
            next = 0;
            continue;
        }
        failures += 1;
        if failures > MAX_FAILOVERS {
            bail!("lost every upstream {failures} times in a row");
        }
    }
}

/// [`Pipeline::version_cap`] for a model: its BF16 bytes, an eighth more for framing, hashes
/// and segment headers, and 1 MiB for the manifest of a small model.
fn version_cap(weights: &Model) -> u64 {
    let bf16: u64 = weights.values().map(|t| t.len() as u64 * 2).sum();
    bf16 + bf16 / 8 + (1 << 20)
}

/// How often the actor asks its engine whether it lost its weights (a dead vLLM server).
const ENGINE_HEALTH: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a source that broke a bound (sent more than a version can hold, announced a
/// version far ahead) is not used: the actor takes the next source meanwhile.
const QUARANTINE: std::time::Duration = std::time::Duration::from_secs(60);

/// How often an actor on a fallback source checks whether its preferred one is back.
const PREFERRED_PROBE: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether `preferred` accepts a subscription again and holds at least version `active` (a
/// relay that restarted empty must catch up from the hub first). The probe's subscription is
/// closed at once; the caller subscribes for real.
async fn preferred_is_back(
    preferred: &Source,
    creds: &Credentials,
    hello: &Message,
    link: &starling_transport::link::LinkProfile,
    active: u64,
) -> bool {
    let probe = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        subscribe(
            creds,
            preferred.addr,
            preferred.role,
            &preferred.name,
            hello,
            active,
            link,
        ),
    )
    .await;
    match probe {
        Ok(Ok(up)) => {
            let ready = up.latest >= active;
            up.close().await;
            ready
        }
        _ => false,
    }
}

/// Starts the rollout worker when the actor has an engine; it runs until the handle drops.
fn start_worker(
    cfg: &ActorConfig,
    creds: &Credentials,
    engine: &Option<Arc<dyn Engine>>,
    status_rx: watch::Receiver<PipelineStatus>,
    metrics: &Metrics,
) -> Result<Option<AbortOnDrop>> {
    let (Some(engine), Some(e)) = (engine, &cfg.engine) else {
        return Ok(None);
    };
    let hub = cfg
        .sources
        .iter()
        .find(|s| s.role == Role::Hub)
        .context("an actor with an engine needs the hub's address")?;
    let wcfg = worker::WorkerConfig {
        hub: hub.addr,
        region: cfg.region.clone(),
        model_id: cfg.model_id.clone(),
        hardware: e.hardware.clone(),
        claim: e.claim,
    };
    Ok(Some(AbortOnDrop(tokio::spawn(worker::run(
        creds.clone(),
        wcfg,
        engine.clone(),
        status_rx,
        metrics.clone(),
    )))))
}

/// Aborts a task when dropped: the owner of the actor's background tasks.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Pipeline<'_> {
    /// Loads the active version into the engine (at the job boundary: a generation call in
    /// flight keeps the version it started with) and tells the worker.
    fn load_engine(&mut self, change: Option<&UndoLog>) -> Result<()> {
        let (version, digest) = (self.state.version(), self.state.digest().to_bytes());
        if let Some(engine) = &self.engine {
            let weights = self.state.weights();
            tokio::task::block_in_place(|| engine.load(weights, version, digest, change))?;
        }
        self.status.send_modify(|s| {
            s.active = Some((version, digest));
            s.staged = s.staged.filter(|&v| v > version);
        });
        Ok(())
    }

    /// Loads the active version into an engine that lost it (its server died and was
    /// restarted); until that succeeds the engine's fingerprint does not match and the worker
    /// takes no work. A failure is retried at the next check.
    fn reload_engine_if_lost(&mut self) {
        // Blocking: a vLLM engine may ask its server to digest the model (`--vllm-verify-every`).
        let lost = self
            .engine
            .as_ref()
            .is_some_and(|e| tokio::task::block_in_place(|| e.needs_reload()));
        if !lost {
            return;
        }
        tracing::warn!(
            version = self.state.version(),
            "the engine lost its weights; loading the active version into it again"
        );
        if let Err(e) = self.load_engine(None) {
            tracing::error!("reloading the engine failed (retrying): {e:#}");
        }
    }

    /// Handles one event.
    async fn handle(&mut self, ev: UpstreamEvent, control: &mut SendStream) -> Result<Outcome> {
        match ev {
            UpstreamEvent::StreamStarted {
                version,
                base,
                delta_id,
                transmission,
                stripes,
            } => {
                if let Some(p) = self.entry(version, base, delta_id) {
                    p.reception.stream_started(transmission, stripes);
                }
            }
            UpstreamEvent::Frame {
                version,
                delta_id,
                frame,
            } => self.frame(version, delta_id, frame, control).await,
            UpstreamEvent::StreamEnded {
                version,
                delta_id,
                transmission,
                stripes,
                error,
            } => {
                if let Some(p) = self.pending.get_mut(&version)
                    && p.reception.delta_id == delta_id
                    && let Some(seqs) = p.reception.stream_ended(transmission, stripes, error)
                {
                    self.refetch(control, version, seqs).await?;
                }
            }
            UpstreamEvent::Commit(v) => {
                if v > self.state.version() {
                    self.commits.insert(v);
                }
            }
            UpstreamEvent::Pong(_) | UpstreamEvent::Closed(_) => {}
            UpstreamEvent::Refused { reason, detail } => {
                tracing::warn!("upstream refused: {reason:?}: {detail}");
                if reason == RefuseReason::VersionUnavailable {
                    if self.anchor_asked {
                        // Neither the deltas nor an anchor here: try the next source.
                        return Ok(Outcome::Resubscribe);
                    }
                    self.anchor_asked = true;
                    let after_version = self.state.version();
                    let _ = send(control, &Message::FetchAnchor { after_version }).await;
                }
            }
            UpstreamEvent::Anchor { seal, stream } => {
                return match self.restore(seal, stream).await {
                    Ok(()) => Ok(Outcome::Resubscribe),
                    Err(e) => {
                        tracing::warn!(version = seal.version, "anchor refused: {e:#}");
                        Ok(Outcome::Resubscribe)
                    }
                };
            }
        }
        if self.drop_if_misbehaved() {
            return Ok(Outcome::Resubscribe);
        }
        let activated = self.activate_ready(control).await?;
        Ok(if self.drop_if_misbehaved() {
            Outcome::Resubscribe
        } else if activated {
            Outcome::Activated
        } else {
            Outcome::Nothing
        })
    }

    /// Whether the current source broke a bound; if it did, nothing it sent is kept (what
    /// was held for its versions is dropped with them) and the caller leaves it.
    fn drop_if_misbehaved(&mut self) -> bool {
        let Some(why) = &self.misbehaved else {
            return false;
        };
        tracing::error!(source = %self.peer, "dropping this source for {QUARANTINE:?}: {why}");
        self.metrics.source_dropped(&self.peer);
        self.pending.clear();
        true
    }

    /// Restores from an anchor: receives the file next to the store while hashing it (on a
    /// blocking thread), checks size, hash and the hub's seal, checks it is this model at the
    /// sealed version, and only then replaces the active weights (file renamed into place,
    /// atomically).
    async fn restore(&mut self, seal: AnchorSeal, mut stream: DataStreamReader) -> Result<()> {
        seal.verify(&self.cfg.model_id, self.trust)
            .context("anchor seal")?;
        if seal.version <= self.state.version() {
            bail!(
                "anchor {} is not newer than active {}",
                seal.version,
                self.state.version()
            );
        }
        std::fs::create_dir_all(&self.cfg.store).context("create store")?;
        let partial = self.cfg.store.join("anchor.partial");
        // Hashed and written on a blocking thread as it arrives; size and hash checked.
        starling_transport::anchor_file::receive(&seal, &mut stream, &partial).await?;
        let (model_id, layout) = (&self.cfg.model_id, &self.layout);
        let (weights, digest) = tokio::task::block_in_place(|| -> Result<_> {
            let c = Checkpoint::open(&partial).context("open anchor")?;
            if c.version() != Some(seal.version) {
                bail!("anchor file says version {:?}", c.version());
            }
            let found: Layout = c
                .tensors()
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect();
            if &found != layout {
                bail!("anchor is not this model (tensor layout differs)");
            }
            let weights = c.read_all()?;
            let names: Vec<String> = weights.keys().cloned().collect();
            let digest = full_digest(model_id, &weights, &names);
            Ok((weights, digest))
        })?;
        tokio::task::block_in_place(|| self.store.install_snapshot(&partial, seal.version))?;
        self.state = VersionedWeights::new(&self.cfg.model_id, weights, seal.version, digest);
        self.pending.clear();
        self.commits.clear();
        self.metrics.set_active(seal.version);
        self.load_engine(None)?;
        println!("restored anchor {}", seal.version);
        println!("active {} {}", self.state.version(), self.state.digest());
        Ok(())
    }

    fn entry(&mut self, version: u64, base: u64, delta_id: [u8; 32]) -> Option<&mut Pending> {
        if version <= self.state.version() {
            return None;
        }
        if version > self.state.version() + MAX_VERSIONS_AHEAD {
            self.misbehaved = Some(format!(
                "it announced version {version}, more than {MAX_VERSIONS_AHEAD} ahead of the \
                 active {}",
                self.state.version()
            ));
            return None;
        }
        let fresh = self
            .pending
            .get(&version)
            .is_none_or(|p| p.reception.delta_id != delta_id);
        if fresh {
            let stage = if version == self.state.version() + 1 {
                Stage::Staging(Box::new(self.state.stager()))
            } else {
                Stage::Buffering(Vec::new())
            };
            self.pending.insert(
                version,
                Pending {
                    reception: Reception::new(version, base, delta_id),
                    stage,
                    raw: Vec::new(),
                    held: 0,
                },
            );
        }
        self.pending.get_mut(&version)
    }

    /// Stages a frame of the next version at once (against the untouched active weights),
    /// or buffers a frame of a later one.
    async fn frame(
        &mut self,
        version: u64,
        delta_id: [u8; 32],
        frame: StreamFrame,
        control: &mut SendStream,
    ) {
        let weights = self.state.weights();
        // What the other versions in flight hold: with this one, at most two versions' worth.
        let others: u64 = self
            .pending
            .iter()
            .filter(|&(&v, _)| v != version)
            .map(|(_, p)| p.held)
            .sum();
        let Some(p) = self.pending.get_mut(&version) else {
            return;
        };
        if p.reception.delta_id != delta_id {
            return;
        }
        self.metrics
            .received(&self.peer, frame.bytes.len() as u64, 1);
        match p.reception.frame(frame.kind, frame.body()) {
            Ok(Added::New) => {}
            Ok(Added::Duplicate) => return,
            Err(e) => return tracing::warn!(version, "dropped a frame: {e}"),
        }
        p.held += frame.bytes.len() as u64;
        let over = if p.held > self.version_cap {
            Some(format!(
                "it sent more than {} bytes of version {version}, more than the whole model \
                 coded densely",
                self.version_cap
            ))
        } else if others + p.held > 2 * self.version_cap {
            Some(format!(
                "the versions it is sending hold more than {} bytes, two whole models' worth",
                2 * self.version_cap
            ))
        } else {
            None
        };
        if let Some(why) = over {
            self.misbehaved = Some(why);
            self.pending.remove(&version);
            return;
        }
        if p.reception.complete() {
            println!("staged {version}");
            self.status.send_modify(|s| s.staged = Some(version));
        }
        p.raw.push(frame.bytes.clone());
        let staged = match &mut p.stage {
            // Decoding and verifying a segment is CPU work: off the runtime's workers.
            Stage::Staging(stager) => {
                tokio::task::block_in_place(|| stager.stage_frame(frame.as_frame(), weights))
            }
            Stage::Buffering(frames) => {
                frames.push(frame);
                Ok(())
            }
        };
        if let Err(e) = staged {
            tracing::warn!(
                version,
                "staging failed ({}); fetching it again",
                starling_telemetry::error_chain(&e)
            );
            self.pending.remove(&version);
            let _ = self.refetch(control, version, Vec::new()).await;
        }
    }

    async fn refetch(
        &mut self,
        control: &mut SendStream,
        version: u64,
        seqs: Vec<u32>,
    ) -> Result<()> {
        let n = self.retries.entry(version).or_default();
        *n += 1;
        println!("refetch {version}");
        self.metrics.refetch(&self.peer);
        if *n > MAX_REFETCHES {
            // This source keeps sending what does not verify: drop it (for a while) and take
            // the version from the next one, which starts with a fresh count.
            self.retries.remove(&version);
            self.misbehaved = Some(format!(
                "version {version} failed verification {MAX_REFETCHES} times from it"
            ));
            return Ok(());
        }
        tracing::warn!(
            version,
            attempt = *n,
            "fetching {} again",
            if seqs.is_empty() {
                "everything".to_owned()
            } else {
                format!("{} segments", seqs.len())
            }
        );
        let _ = send(control, &Message::Fetch { version, seqs }).await;
        Ok(())
    }

    /// Activates every next version that is complete and committed; `true` if any was.
    async fn activate_ready(&mut self, control: &mut SendStream) -> Result<bool> {
        let mut any = false;
        loop {
            let next = self.state.version() + 1;
            let ready = self.commits.contains(&next)
                && self
                    .pending
                    .get(&next)
                    .is_some_and(|p| p.reception.complete());
            if !ready {
                return Ok(any);
            }
            let Some(mut p) = self.pending.remove(&next) else {
                return Ok(any);
            };
            let transfer = p.reception.started.elapsed();
            let raw = std::mem::take(&mut p.raw);
            match tokio::task::block_in_place(|| self.seal_and_commit(p)) {
                Ok((apply, written)) => {
                    any = true;
                    self.commits.remove(&next);
                    self.metrics.staged();
                    self.metrics.observe_transfer(transfer);
                    self.metrics.observe_apply(apply);
                    self.metrics.set_active(next);
                    let frames: Vec<&[u8]> = raw.iter().map(Vec::as_slice).collect();
                    tokio::task::block_in_place(|| self.store.record(next, &frames, &self.state))?;
                    self.load_engine(Some(&written))?;
                    println!("active {} {}", self.state.version(), self.state.digest());
                    let _ = send(
                        control,
                        &Message::Active {
                            version: self.state.version(),
                            digest: self.state.digest().to_bytes(),
                        },
                    )
                    .await;
                    let after = next + 1;
                    if let Err(e) = tokio::task::block_in_place(|| self.start_staging(after)) {
                        tracing::warn!(
                            version = after,
                            "staging failed ({}); fetching it again",
                            starling_telemetry::error_chain(&e)
                        );
                        self.pending.remove(&after);
                        self.refetch(control, after, Vec::new()).await?;
                    }
                }
                Err(e) => {
                    tracing::error!(version = next, "version refused: {e:#}");
                    self.refetch(control, next, Vec::new()).await?;
                    return Ok(any);
                }
            }
        }
    }

    /// Seals a fully received version and commits it; returns the commit time and what the
    /// commit wrote. The weights are untouched unless every check passed.
    fn seal_and_commit(&mut self, p: Pending) -> Result<(std::time::Duration, UndoLog)> {
        let stager = match p.stage {
            Stage::Staging(s) => *s,
            // Its base became active while it was still arriving: staged now, as a whole.
            Stage::Buffering(frames) => self.staged(&frames)?,
        };
        let sealed = stager.seal(self.trust)?;
        let t = std::time::Instant::now();
        let written = self.state.commit(sealed)?;
        Ok((t.elapsed(), written))
    }

    /// The version after the one just activated becomes the one staged on arrival: what was
    /// buffered of it is staged now. An error leaves it buffering; the caller drops it and
    /// fetches it again.
    fn start_staging(&mut self, version: u64) -> Result<(), starling_proto::apply::StageError> {
        let Some(Stage::Buffering(frames)) = self.pending.get(&version).map(|p| &p.stage) else {
            return Ok(());
        };
        let stager = self.staged(frames)?;
        if let Some(p) = self.pending.get_mut(&version) {
            p.stage = Stage::Staging(Box::new(stager));
        }
        Ok(())
    }

    /// A stager against the active weights with `frames` staged.
    fn staged(&self, frames: &[StreamFrame]) -> Result<Stager, starling_proto::apply::StageError> {
        let mut stager = self.state.stager();
        for f in frames {
            stager.stage_frame(f.as_frame(), self.state.weights())?;
        }
        Ok(stager)
    }
}
