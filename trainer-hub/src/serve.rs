//! `starling-hub serve`: the hub's distribution service.
//!
//! The hub listens for QUIC connections from relays, actors and the trainer (all with
//! cluster credentials; see `starling_transport`). A publish (`Publish { path }` from the
//! trainer over QUIC, or `POST /v1/versions` over HTTP) diffs that checkpoint against the
//! last published one and **offers every segment to subscribers the moment the encoder
//! emits it** (cut-through), while the same bytes go to the delta file in the store. The
//! version completes — subscribers get `Commit`, it becomes the listed latest — only once the
//! file is durable (fsync, rename). A failed diff aborts the version; receivers drop it.
//! Sending (striping, `Fetch`, `Ping`) is shared with the relays
//! (`starling_transport::fanout`).
//!
//! The hub diffs its own copy of each published checkpoint (`snapshot`), never the trainer's
//! file, so the trainer may delete or rewrite that file as soon as the publish returns.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use ed25519_dalek::SigningKey;
use quinn::{Connection, SendStream};
use starling_checkpoint::deltafile::{DiffOptions, diff_checkpoints};
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::writer::AtomicFile;
use starling_proto::container::{FrameKind, split_frames};
use starling_proto::digest::StateDigest;
use starling_proto::manifest::delta_id;
use starling_proto::msg::{Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use tracing::Instrument;

use crate::anchors::Anchors;
use crate::board::{Board, PeerRole};
use crate::clock::{now, now_ms};
use crate::durable;
// Defined where the store is seeded from it; public here, where it always was.
pub use crate::durable::model_dir;
use crate::ingest::{Allow, PublishError, PublishRequest};
use crate::rollouts::ModelLimits;
use starling_ledger::{Digest, Ledger, LedgerConfig};
use starling_proto::manifest::TrustPolicy;
use starling_transport::admit::admit;
use starling_transport::book::{LiveVersion, VersionBook, WireFrame};
use starling_transport::ceiling::RateCeiling;
use starling_transport::endpoint::{
    accept_capped, client_endpoint, connect, server_config, server_endpoint,
};
use starling_transport::fanout::{FanoutConfig, serve_subscription};
use starling_transport::framed::{MessageReader, send};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub cluster: PathBuf,
    pub store: PathBuf,
    pub listen: SocketAddr,
    /// The checkpoint of version `init_version`, the base of the first publish. Needed on the
    /// first start only; on a restart, if given, it must be a checkpoint of the run.
    pub init: Option<PathBuf>,
    pub init_version: u64,
    pub model_id: String,
    pub link: LinkProfile,
    /// Streams per version per subscriber.
    pub stripes: u16,
    /// Send segments while they are encoded (else once the delta is durable).
    pub cut_through: bool,
    /// Where to serve `/metrics` and the HTTP API (none: not served).
    pub http: Option<SocketAddr>,
    /// Deltas kept in memory for subscribers that fall behind.
    pub retain: usize,
    /// Write an anchor (full checkpoint) every this many versions (0: only the initial one).
    pub anchor_every: u64,
    /// Anchors kept on disk.
    pub keep_anchors: usize,
    /// Target size of a segment.
    pub segment_bytes: usize,
    /// Code every changed tensor range densely (the full new bits), never sparsely.
    pub full_broadcast: bool,
    /// The stated link to each peer by name (`*`: every other peer), for the sender's
    /// window ceiling (`starling_transport::ceiling`).
    pub peer_links: BTreeMap<String, LinkProfile>,
    /// Cap the window to each peer at its stated link (off: plain BBR, for comparison).
    pub link_ceiling: bool,
    /// Which codecs versions are encoded with (`crate::codecs`).
    pub codecs: crate::codecs::CodecPolicy,
    /// The ledger's URL (`sqlite:PATH` or `postgres://…`).
    pub ledger: String,
    /// Lease sizing, attempts, actor timeout.
    pub ledger_config: LedgerConfig,
    /// How often posted batches are scheduled and expired leases swept.
    pub schedule_tick: std::time::Duration,
    /// Per-actor limits on the job protocol.
    pub worker_limits: crate::limits::WorkerLimits,
    /// The reward services groups may name as their verifier (`--reward-service`).
    pub reward_services: crate::reward_service::RewardServices,
    /// Which delivered batches are archived out of the ledger.
    pub retention: starling_ledger::Retention,
    /// Where archived batches' results are written.
    pub results_archive: PathBuf,
    /// The directories checkpoints may be published from (`--publish-dir`).
    pub publish_dirs: crate::ingest::PublishDirs,
    /// Bounds of the HTTP server (connections, timeouts); publishes are exempt from its
    /// request timeout (they answer once the version is recorded).
    pub http_limits: starling_telemetry::http::HttpLimits,
}

#[derive(Debug)]
struct State {
    version: u64,
    snapshot: PathBuf,
    /// The snapshot's state digest: from the ledger at start, then each manifest's post
    /// digest. Spares every diff a hash of every base element.
    digest: StateDigest,
    /// The trainer's step the newest version was published with, if it said.
    step: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct Hub {
    cfg: ServeConfig,
    /// What the hub has seen since it started, for the status page and the event stream.
    pub(crate) board: Arc<Board>,
    /// The size of the full BF16 checkpoint (what a full broadcast would send per version).
    pub(crate) checkpoint_bytes: u64,
    /// The run's tensors and shapes: what every published checkpoint must hold exactly.
    layout: starling_checkpoint::safetensors::Layout,
    signing: SigningKey,
    state: Mutex<State>,
    book: Arc<VersionBook>,
    metrics: Metrics,
    anchors: Arc<Anchors>,
    pub(crate) ledger: Arc<Ledger>,
    /// Live worker connections per actor certificate.
    workers: Arc<crate::limits::WorkerConnections>,
    /// The key trainer tokens are checked with.
    pub(crate) trainer_seed: [u8; 32],
    /// What prompts must fit (vocabulary, context).
    pub(crate) limits: ModelLimits,
    /// The configured reward services.
    pub(crate) rewards: Arc<crate::reward_service::RewardServices>,
    /// Woken when results were stored waiting for their reward service.
    pub(crate) scorer_wake: Arc<tokio::sync::Notify>,
    /// Cancelled when the hub stops: long-lived work (the scheduler, event streams, the HTTP
    /// server) ends on it.
    pub(crate) stop: CancellationToken,
    /// Every task the hub spawns (connections, anchor writes, the scheduler, HTTP): waited
    /// for, within the grace period, when it stops.
    tasks: TaskTracker,
    /// Snapshot copies an anchor is being written from: not released until it is written.
    pinned: std::sync::Mutex<std::collections::BTreeSet<PathBuf>>,
    /// The codec set of each version and why (`crate::codecs`); used from the diff's
    /// blocking task.
    pub(crate) codecs: Arc<std::sync::Mutex<crate::codecs::Chooser>>,
}

impl Hub {
    fn pins(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<PathBuf>> {
        self.pinned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `work` as a task of the hub, until it ends or the hub stops.
    fn spawn_until_stopped(&self, work: impl Future<Output = ()> + Send + 'static) {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = work => {}
                () = stop.cancelled() => {}
            }
        });
    }
}

/// The model's vocabulary, context and text side (tokenizer, chat template, EOS ids), from
/// the model directory `dir` (the store's copy of the run's model files): `config.json` and
/// the tokenizer files there; without `config.json`, the vocabulary from the embedding's
/// shape in `weights` (no context limit); without `tokenizer.json`, the byte tokenizer.
fn model_limits(dir: &Path, weights: &Path) -> Result<ModelLimits> {
    let dir = dir.to_owned();
    let text = std::sync::Arc::new(
        starling_text::ModelText::load(&dir)
            .with_context(|| format!("load the tokenizer of {}", dir.display()))?,
    );
    let config = dir.join("config.json");
    if config.exists() {
        let c = starling_engine::ModelConfig::from_file(&config)
            .with_context(|| format!("read {}", config.display()))?;
        return Ok(ModelLimits {
            vocab: u32::try_from(c.vocab_size).unwrap_or(u32::MAX),
            context: u32::try_from(c.max_position_embeddings).unwrap_or(u32::MAX),
            text,
        });
    }
    let c = Checkpoint::open(weights).with_context(|| format!("open {}", weights.display()))?;
    let vocab = c
        .tensor("model.embed_tokens.weight")
        .and_then(|t| t.shape.first().copied())
        .unwrap_or(u64::from(u32::MAX));
    Ok(ModelLimits {
        vocab: u32::try_from(vocab).unwrap_or(u32::MAX),
        context: u32::MAX,
        text,
    })
}

/// Writes the anchor of `version` from `checkpoint` (off the async runtime).
async fn write_anchor(hub: &Arc<Hub>, checkpoint: PathBuf, version: u64) -> Result<()> {
    let anchors = hub.anchors.clone();
    let seal = tokio::task::spawn_blocking(move || anchors.write(&checkpoint, version))
        .await
        .context("anchor task")??;
    tracing::info!(version, bytes = seal.size, "anchor written");
    println!("anchor {version}");
    Ok(())
}

impl Hub {
    pub(crate) fn book(&self) -> &VersionBook {
        &self.book
    }

    pub(crate) fn model_id(&self) -> &str {
        &self.cfg.model_id
    }

    pub(crate) fn http_limits(&self) -> &starling_telemetry::http::HttpLimits {
        &self.cfg.http_limits
    }
}

/// How often retention looks for batches to archive.
const RETENTION_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a stopping hub waits for a publish in progress and for its connections to close.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// The application close code of a hub that is shutting down (`"ST"`): peers reconnect with
/// backoff, as after any lost connection, and resume where they were.
pub const CLOSE_SHUTDOWN: u32 = 0x5354;

/// Runs the hub until `shutdown` completes (SIGTERM or SIGINT from `starling-hub serve`), then
/// drains: no new connections, the publish in progress ends (durable and recorded, or
/// aborted), connections are closed with [`CLOSE_SHUTDOWN`], the ledger is closed; all within
/// [`SHUTDOWN_GRACE`]. Prints `listening on ADDR` once ready.
pub async fn serve(cfg: ServeConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    let creds = Credentials::load_hub(&cfg.cluster).context("load hub credentials")?;
    let signing = crate::keys::load_signing(&cfg.cluster.join("signing.key"))?;
    std::fs::create_dir_all(cfg.store.join("deltas")).context("create store")?;
    let trainer_seed =
        starling_transport::identity::hub_signing_seed(&cfg.cluster).context("load signing key")?;
    let ledger = Ledger::open(&cfg.ledger, cfg.ledger_config.clone())
        .await
        .with_context(|| format!("open the ledger at {}", cfg.ledger))?;
    let trust = TrustPolicy::Keys(vec![signing.verifying_key()]);
    let resumed = durable::resume(
        &ledger,
        &cfg.store,
        &cfg.model_id,
        cfg.init.as_deref(),
        cfg.init_version,
        &trust,
    )
    .await?;
    let model_files = durable::model_files(&cfg.store);
    let limits = if model_files.join("config.json").exists() || cfg.init.is_none() {
        model_limits(&model_files, &resumed.snapshot)?
    } else {
        // A store seeded before the hub kept the model's files and `--init` without a
        // config.json beside it: read them where `--init` is.
        let init = cfg.init.as_deref().unwrap_or(&resumed.snapshot);
        model_limits(&model_dir(init), &resumed.snapshot)?
    };
    // The newest `retain` deltas are served from the book; older ones through anchors.
    let first = resumed
        .first_delta
        .max(resumed.version.saturating_sub(cfg.retain as u64));
    let book = VersionBook::new(first, cfg.retain);
    for v in first + 1..=resumed.version {
        let path = durable::delta_path(&cfg.store, v);
        let map = starling_transport::book::map_store_file(&path)
            .with_context(|| format!("read {}", path.display()))?;
        book.load_delta_mapped(map, &trust)
            .with_context(|| format!("load {}", path.display()))?;
    }
    crate::snapshot::tidy(&cfg.store, &resumed.snapshot);
    let (layout, checkpoint_bytes) = {
        let c = Checkpoint::open(&resumed.snapshot)
            .with_context(|| format!("open {}", resumed.snapshot.display()))?;
        (c.layout(), c.numel().saturating_mul(2))
    };
    println!("base-digest {}", resumed.version);
    if resumed.version != cfg.init_version {
        tracing::info!(
            version = resumed.version,
            snapshot = %resumed.snapshot.display(),
            "resumed from the ledger"
        );
    }
    let endpoint = server_endpoint(&creds, cfg.listen, &cfg.link).context("listen")?;
    let addr = endpoint.local_addr().context("local address")?;
    let codec_policy = cfg.codecs;
    let hub = Arc::new(Hub {
        state: Mutex::new(State {
            version: resumed.version,
            snapshot: resumed.snapshot,
            digest: resumed.digest,
            step: resumed.step,
        }),
        book: Arc::new(book),
        board: Arc::new(Board::new(now_ms())),
        checkpoint_bytes,
        layout,
        metrics: Metrics::new(Component::Hub),
        anchors: Arc::new(Anchors::open(
            &cfg.store,
            &cfg.model_id,
            signing.clone(),
            cfg.keep_anchors,
        )?),
        ledger: Arc::new(ledger),
        workers: crate::limits::WorkerConnections::new(cfg.worker_limits.connections),
        trainer_seed,
        limits,
        rewards: Arc::new(cfg.reward_services.clone()),
        scorer_wake: Arc::new(tokio::sync::Notify::new()),
        cfg,
        signing,
        stop: CancellationToken::new(),
        tasks: TaskTracker::new(),
        pinned: Default::default(),
        codecs: Arc::new(std::sync::Mutex::new(crate::codecs::Chooser::new(
            codec_policy,
            rayon_threads(),
        ))),
    });
    hub.spawn_until_stopped(crate::jobs::run_scheduler(
        hub.ledger.clone(),
        hub.metrics.clone(),
        hub.board.clone(),
        hub.cfg.schedule_tick,
    ));
    hub.spawn_until_stopped(crate::scoring::run(crate::scoring::Scorer {
        ledger: hub.ledger.clone(),
        services: hub.rewards.clone(),
        board: hub.board.clone(),
        wake: hub.scorer_wake.clone(),
        text: hub.limits.text.clone(),
    }));
    if hub.cfg.retention.enabled() {
        hub.spawn_until_stopped(crate::archive::run(
            hub.ledger.clone(),
            hub.cfg.results_archive.clone(),
            hub.cfg.retention,
            RETENTION_EVERY,
        ));
    }
    let (current, snapshot) = {
        let s = hub.state.lock().await;
        (s.version, s.snapshot.clone())
    };
    if current == resumed.seeded && !hub.anchors.has(current) {
        // A full-checkpoint copy of the seed: in the background, so the hub serves at once
        // (until it is written, a subscriber asking for an anchor is refused and asks again
        // later). Once written, the seed file is no longer needed.
        let (owner, init, v) = (hub.clone(), snapshot, current);
        // Not cancelled by a stop: the copy is on a blocking thread, waited for in the drain.
        hub.tasks.spawn(async move {
            let hub = owner;
            if let Err(e) = write_anchor(&hub, init, v).await {
                tracing::error!(version = v, "anchor not written: {e:#}");
                hub.board.fault(
                    "anchor_failed",
                    None,
                    Some(v),
                    &format!("{e:#}"),
                    now_ms(),
                );
            }
        });
    }
    hub.metrics.set_active(resumed_version(&hub).await);
    if let Some(http) = hub.cfg.http {
        let (listener, at) = starling_telemetry::http::bind(http)
            .await
            .with_context(|| format!("bind HTTP on {http}"))?;
        let routes = crate::api::router(hub.clone()).merge(crate::status::router(hub.clone()));
        let metrics = hub.metrics.clone();
        let stop = hub.stop.clone().cancelled_owned();
        let mut limits = hub.cfg.http_limits.clone();
        limits
            .untimed
            .push((axum::http::Method::POST, "/v1/versions".to_owned()));
        hub.tasks.spawn(async move {
            if let Err(e) =
                starling_telemetry::http::serve_with(listener, metrics, routes, limits, stop).await
            {
                tracing::error!("HTTP server stopped: {e}");
            }
        });
        println!("http on {at}");
    }
    println!("listening on {addr}");
    let base = server_config(&creds, &hub.cfg.link).context("server configuration")?;
    tokio::pin!(shutdown);
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => match i {
                Some(i) => i,
                None => break,
            },
            () = &mut shutdown => break,
        };
        let Ok((connecting, ceiling)) = accept_capped(incoming, &base, &hub.cfg.link) else {
            continue;
        };
        let owner = hub.clone();
        hub.tasks.spawn(async move {
            let hub = owner;
            match connecting.await {
                Ok(conn) => {
                    if let Err(e) = serve_connection(hub, conn.clone(), ceiling).await {
                        tracing::warn!(remote = %conn.remote_address(), "connection ended: {e:#}");
                        conn.close(1u32.into(), b"error");
                    }
                }
                Err(e) => tracing::warn!("refused a connection during the handshake: {e}"),
            }
        });
    }
    drain(&hub, &endpoint).await;
    Ok(())
}

/// The end of [`serve`]: see there. New connections are no longer accepted when this runs.
async fn drain(hub: &Hub, endpoint: &quinn::Endpoint) {
    tracing::info!(grace_s = SHUTDOWN_GRACE.as_secs(), "stopping");
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        // The state lock is held across a publish: taking it waits for the one in progress,
        // whose segments keep flowing to the subscribers meanwhile.
        let _no_publish = hub.state.lock().await;
        hub.stop.cancel();
        endpoint.close(CLOSE_SHUTDOWN.into(), b"hub shutting down");
        hub.tasks.close();
        // Connection tasks end with their connections; anchor writes finish (flushed).
        tokio::join!(hub.tasks.wait(), endpoint.wait_idle());
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            tasks = hub.tasks.len(),
            "grace period over; stopping with work in flight"
        );
        hub.stop.cancel();
        endpoint.close(CLOSE_SHUTDOWN.into(), b"hub shutting down");
    }
    hub.ledger.close().await;
    tracing::info!("stopped");
}

async fn serve_connection(hub: Arc<Hub>, conn: Connection, ceiling: RateCeiling) -> Result<()> {
    // The book, not the publish lock: admission never waits for an encode to finish.
    let latest = hub.book.latest();
    let serves = [MsgRole::Relay, MsgRole::Actor, MsgRole::Trainer];
    let Some(a) = admit(&conn, "hub", &hub.cfg.model_id, &serves, latest).await? else {
        return Ok(());
    };
    if a.role == MsgRole::Trainer {
        return serve_trainer(hub, a.control, a.reader)
            .instrument(tracing::info_span!("peer", peer = %a.name, role = "trainer"))
            .await;
    }
    let mut reader = a.reader;
    // An actor's first message says whether this connection subscribes to versions or
    // carries rollout work (`docs/api.md`).
    let after = match reader.next().await? {
        Some(Message::Subscribe { after_version }) => after_version,
        Some(Message::Work {
            engine,
            hardware,
            max_batch,
        }) if a.role == MsgRole::Actor => {
            let label = format!("{engine}/{hardware}/batch {max_batch}");
            let span = tracing::info_span!("worker", actor = %a.name, region = %a.region);
            return crate::jobs::serve_worker(
                crate::jobs::WorkerContext {
                    text: hub.limits.text.clone(),
                    ledger: hub.ledger.clone(),
                    metrics: hub.metrics.clone(),
                    board: hub.board.clone(),
                    connections: hub.workers.clone(),
                    limits: hub.cfg.worker_limits,
                    scorer: hub.scorer_wake.clone(),
                    conn: conn.clone(),
                },
                a.control,
                reader,
                a.name,
                a.region,
                label,
            )
            .instrument(span)
            .await;
        }
        other => bail!("expected Subscribe (or Work from an actor), got {other:?}"),
    };
    // The operator's statement for this peer wins over the peer's own; `*` fills in for
    // peers that state none. A stated link can only lower the sending rate, never raise it.
    let named = hub.cfg.peer_links.get(&a.name).copied();
    let fallback = hub.cfg.peer_links.get("*").copied();
    let link = named.or(a.link).or(fallback);
    if let Some(link) = link.filter(|_| hub.cfg.link_ceiling) {
        ceiling.set(link.rate_bps, link.rtt);
    }
    let role = if a.role == MsgRole::Relay {
        PeerRole::Relay
    } else {
        PeerRole::Actor
    };
    let span =
        tracing::info_span!("peer", peer = %a.name, role = role.as_str(), region = %a.region);
    span.in_scope(|| tracing::info!(after_version = after, "subscribed"));
    hub.board
        .peer_connected(&a.name, role, &a.region, link, now_ms());
    hub.metrics.peer_connected(role.as_str(), 1);
    let fanout = FanoutConfig {
        stripes: hub.cfg.stripes,
        anchors: Some(hub.anchors.clone()),
        observer: Some(hub.board.clone()),
    };
    let name = a.name.clone();
    let served = serve_subscription(
        hub.book.clone(),
        conn.clone(),
        a.control,
        reader,
        a.name,
        fanout,
        hub.metrics.clone(),
        after,
    )
    .instrument(span.clone())
    .await;
    hub.metrics.peer_connected(role.as_str(), -1);
    // A connection that ended on its own is still a fault when the peer did not close it.
    let why = match (&served, conn.close_reason()) {
        (Err(e), _) => Some(format!("{e:#}")),
        (Ok(()), Some(quinn::ConnectionError::ApplicationClosed(_))) | (Ok(()), None) => None,
        (Ok(()), Some(reason)) => Some(reason.to_string()),
    };
    span.in_scope(|| match &why {
        Some(w) => tracing::warn!("subscriber lost: {w}"),
        None => tracing::info!("subscriber left"),
    });
    hub.board
        .peer_disconnected(&name, why.as_deref(), now_ms());
    served?;
    Ok(())
}

async fn serve_trainer(hub: Arc<Hub>, mut tx: SendStream, mut reader: MessageReader) -> Result<()> {
    // The trainer closes the connection when it is done: any end of the stream is normal.
    while let Ok(Some(m)) = reader.next().await {
        let Message::Publish { path } = m else {
            send(
                &mut tx,
                &Message::Refuse {
                    reason: RefuseReason::Protocol,
                    detail: "the trainer may only publish".into(),
                },
            )
            .await?;
            continue;
        };
        let req = PublishRequest {
            path: PathBuf::from(&path),
            step: None,
            allow: Vec::new(),
        };
        let reply = match publish(&hub, req).await {
            Ok(p) => Message::Published {
                version: p.version,
                changes: p.changes,
                bytes: p.bytes,
            },
            Err(e) => Message::Refuse {
                reason: RefuseReason::Protocol,
                detail: format!("publish {path}: {}: {e}", e.code()),
            },
        };
        send(&mut tx, &reply).await?;
    }
    Ok(())
}

/// The threads the encoder runs on (rayon's global pool).
fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

async fn resumed_version(hub: &Hub) -> u64 {
    hub.state.lock().await.version
}

/// A version the hub published, as recorded.
#[derive(Debug, Clone)]
pub(crate) struct Published {
    pub(crate) version: u64,
    pub(crate) base: u64,
    pub(crate) changes: u64,
    pub(crate) bytes: u64,
    /// Its state digest (the manifest's post digest): this version's, whatever was
    /// published after it.
    pub(crate) digest: [u8; 16],
    pub(crate) step: Option<u64>,
}

/// Publishes the checkpoint `req` names (`crate::ingest` for every check it passes first).
/// The work runs as a task of the hub: a caller that goes away (an HTTP client that
/// disconnects) does not cancel a publish halfway.
pub(crate) async fn publish(
    hub: &Arc<Hub>,
    req: PublishRequest,
) -> std::result::Result<Published, PublishError> {
    let owner = hub.clone();
    let path = req.path.clone();
    let task = hub
        .tasks
        .spawn(async move { publish_checked(&owner, req).await });
    let result = match task.await {
        Ok(r) => r,
        Err(e) => Err(PublishError::Internal(anyhow::anyhow!("publish task: {e}"))),
    };
    if let Err(e) = &result {
        tracing::warn!(path = %path.display(), code = e.code(), "publish refused: {e}");
        hub.board.fault(
            "publish_failed",
            None,
            None,
            &format!("{}: {e}", path.display()),
            now_ms(),
        );
    }
    result
}

async fn publish_checked(
    hub: &Arc<Hub>,
    req: PublishRequest,
) -> std::result::Result<Published, PublishError> {
    let internal = PublishError::Internal;
    // Off the runtime and before the publish lock: a FIFO, a stalled mount or a slow disk
    // holds this request only, never the hub or another publish.
    let copy = {
        let (store, dirs, layout, source) = (
            hub.cfg.store.clone(),
            hub.cfg.publish_dirs.clone(),
            hub.layout.clone(),
            req.path.clone(),
        );
        let allow_nonfinite = req.allows(Allow::Nonfinite);
        tokio::task::spawn_blocking(move || {
            let opened = crate::ingest::open_source(&dirs, &layout, &source)?;
            let copy = crate::snapshot::copy_in(&store, &opened).map_err(internal)?;
            drop(opened);
            crate::ingest::check_copy(copy.path(), &source, &layout, allow_nonfinite)?;
            Ok::<_, PublishError>(copy)
        })
        .await
        .map_err(|e| internal(anyhow::anyhow!("copy task: {e}")))??
    };
    // One publish at a time: the state lock is held across the diff.
    let state = hub.state.lock().await;
    if !req.allows(Allow::StepBackwards) {
        crate::ingest::check_step(req.step, state.step, state.version)?;
    }
    if !req.allows(Allow::Unchanged) {
        let (base, new, source, version) = (
            state.snapshot.clone(),
            copy.path().to_owned(),
            req.path.clone(),
            state.version,
        );
        tokio::task::spawn_blocking(move || {
            crate::ingest::check_changed(&base, &new, &source, version)
        })
        .await
        .map_err(|e| internal(anyhow::anyhow!("compare task: {e}")))??;
    }
    // Accepted: from here on the version streams to subscribers as it is encoded.
    publish_locked(hub, state, copy, req.step)
        .await
        .map_err(internal)
}

async fn publish_locked(
    hub: &Arc<Hub>,
    mut state: tokio::sync::MutexGuard<'_, State>,
    copy: crate::snapshot::Copy,
    step: Option<u64>,
) -> Result<Published> {
    let started = std::time::Instant::now();
    let base = state.version;
    let version = base + 1;
    let old = state.snapshot.clone();
    let previous = old.clone();
    let dest = durable::delta_path(&hub.cfg.store, version);
    let new = copy.path().to_owned();
    let created = now_ms();
    let span = tracing::info_span!("publish", version);
    let mut opts = DiffOptions::new(&hub.cfg.model_id, base, version, created);
    opts.signing_key = Some(hub.signing.clone());
    opts.encoder.segment_target_bytes = hub.cfg.segment_bytes;
    if hub.cfg.full_broadcast {
        opts.encoder.choice = starling_proto::segment::CodecChoice::only_dense(
            starling_proto::codec::DenseCodec::PlanesZstd,
        );
    }
    opts.pre_digest = Some(state.digest);
    let id = delta_id(&hub.cfg.model_id, base, version, created);
    // Cut-through: subscribers get each frame the moment the encoder emits it. Store-and-
    // forward (for comparison): the version is offered once its file is durable.
    let live = if hub.cfg.cut_through {
        Some(hub.book.begin(version, base, id)?)
    } else {
        None
    };
    let sink_live = live.clone();
    let dest2 = dest.clone();
    let (codecs, links, board) = (hub.codecs.clone(), hub.board.links(), hub.board.clone());
    let full_broadcast = hub.cfg.full_broadcast;
    let diffed = tokio::task::spawn_blocking(move || -> Result<_> {
        let o =
            Checkpoint::open(&old).with_context(|| format!("open snapshot {}", old.display()))?;
        let n = Checkpoint::open(&new).with_context(|| format!("open {}", new.display()))?;
        // The codec set for this version, from a sample of its own pair and the links.
        let sample = (!full_broadcast)
            .then(|| crate::codecs::sample(&o, &n))
            .flatten();
        let elements = o.numel();
        let decision = codecs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .decide(version, elements, sample.as_ref(), &links);
        tracing::info!(codecs = decision.set.name(), "{}", decision.why);
        if !full_broadcast {
            opts.encoder.choice = decision.set.choice();
        }
        let encode_started = std::time::Instant::now();
        let mut file =
            AtomicFile::create(&dest2).with_context(|| format!("create {}", dest2.display()))?;
        let mut first = true;
        let (signed, bytes) = diff_checkpoints(
            &o,
            &n,
            &opts,
            &mut |b| {
                file.write_all(b)?;
                if first && b.first() == Some(&(FrameKind::Segment as u8)) {
                    first = false;
                    board.first_segment(version, now_ms());
                    println!("first-segment {version}");
                }
                if let Some(live) = &sink_live {
                    offer(live, b);
                }
                Ok(())
            },
            &|_| {},
        )?;
        codecs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .observe(
                decision.set,
                elements,
                sample.as_ref(),
                signed.manifest.total_changes(),
                encode_started.elapsed().as_secs_f64(),
            );
        // Durable before it is listed: fsync, rename, fsync the directory.
        file.commit()
            .with_context(|| format!("write {}", dest2.display()))?;
        Ok((signed.manifest, bytes))
    })
    .instrument(span.clone())
    .await
    .context("diff task")
    .and_then(|r| r);
    let (manifest, bytes) = match diffed {
        Ok(d) => d,
        Err(e) => {
            hub.book.abort(version);
            return Err(e);
        }
    };
    let store = hub.cfg.store.clone();
    let sealed = tokio::task::spawn_blocking(move || copy.seal(&store, version))
        .await
        .context("seal task")
        .and_then(|r| r);
    let (snapshot, source) = match sealed.and_then(|p| Ok((durable::FileStamp::of(&p)?, p))) {
        Ok((stamp, p)) => (p, stamp),
        Err(e) => {
            hub.book.abort(version);
            return Err(e).context("keep the hub's copy of the checkpoint");
        }
    };
    if live.is_none() {
        let live = hub.book.begin(version, base, id)?;
        let file = tokio::fs::read(&dest)
            .await
            .with_context(|| format!("read {}", dest.display()))?;
        for f in split_frames(&file)? {
            offer(&live, f);
        }
    }
    // In the ledger before anyone hears of it: a version announced is a version recorded.
    let meta = durable::VersionMeta {
        source: Some(source),
        delta: Some(dest.clone()),
        changes: manifest.total_changes(),
        bytes,
        step,
    };
    let recorded = hub
        .ledger
        .publish_version(
            durable::to_ledger_version(version)?,
            Some(durable::to_ledger_version(base)?),
            Digest(manifest.post_digest.to_bytes()),
            &meta.to_text(),
            now(),
        )
        .await;
    if let Err(e) = recorded {
        hub.book.abort(version);
        return Err(e).context("record the version in the ledger");
    }
    // On the board before `Commit` can go out, so a subscriber's delivery always finds it.
    let elapsed = started.elapsed();
    hub.board.published(
        version,
        base,
        bytes,
        manifest.total_changes(),
        step,
        u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        hub.checkpoint_bytes,
        now_ms(),
    );
    hub.book.complete(version)?;
    // From now on its subscribers read it from the durable file, not from memory.
    spill(&hub.book, version, &dest).await;
    hub.metrics.set_active(version);
    hub.metrics.observe_publish(bytes, elapsed);
    state.version = version;
    state.snapshot = snapshot.clone();
    state.digest = manifest.post_digest;
    state.step = step;
    drop(state);
    if !hub.pins().contains(&previous) {
        crate::snapshot::release(&hub.cfg.store, &previous);
    }
    if hub.cfg.anchor_every > 0 && version.is_multiple_of(hub.cfg.anchor_every) {
        // In the background: the next publish need not wait for a full-checkpoint write.
        // From the hub's copy, pinned until the anchor is written (a publish meanwhile does
        // not release it; this task does, once it is no longer the newest).
        let (owner, path) = (hub.clone(), snapshot);
        hub.pins().insert(path.clone());
        hub.tasks.spawn(async move {
            let hub = owner;
            let written = write_anchor(&hub, path.clone(), version).await;
            hub.pins().remove(&path);
            if let Ok(state) = hub.state.try_lock()
                && state.snapshot != path
            {
                crate::snapshot::release(&hub.cfg.store, &path);
            }
            if let Err(e) = written {
                tracing::error!(version, "anchor not written: {e:#}");
                hub.board.fault(
                    "anchor_failed",
                    None,
                    Some(version),
                    &format!("{e:#}"),
                    now_ms(),
                );
            }
        });
    }
    span.in_scope(|| {
        tracing::info!(
            changes = manifest.total_changes(),
            bytes,
            encode_ms = elapsed.as_millis() as u64,
            "published"
        )
    });
    Ok(Published {
        version,
        base,
        changes: manifest.total_changes(),
        bytes,
        digest: manifest.post_digest.to_bytes(),
        step,
    })
}

/// Serves a complete version from its delta file in the store instead of from memory (see
/// `LiveVersion::spill`). Should that fail, the version stays served from memory.
/// On a blocking thread: checking the file against the frames reads the whole delta.
async fn spill(book: &VersionBook, version: u64, file: &Path) {
    let Some(live) = book.get(version) else {
        return;
    };
    let file = file.to_owned();
    let spilled = tokio::task::spawn_blocking(move || {
        starling_transport::book::map_store_file(&file)
            .map_err(|e| anyhow::anyhow!("map {}: {e}", file.display()))
            .and_then(|map| Ok(live.spill(map)?))
    })
    .await
    .context("spill task")
    .and_then(|r| r);
    if let Err(e) = spilled {
        tracing::warn!(version, "version stays in memory: {e:#}");
    }
}

/// Offers one encoded frame to subscribers: segments and the manifest (the file header and
/// the trailer only matter in a file).
fn offer(live: &LiveVersion, frame: &[u8]) {
    if frame
        .first()
        .is_some_and(|&k| k == FrameKind::Segment as u8 || k == FrameKind::Manifest as u8)
    {
        match WireFrame::parse(frame.to_vec()) {
            Ok(f) => live.push(f),
            Err(e) => tracing::error!("encoder emitted an unparsable frame: {e}"),
        }
    }
}

/// `starling-hub publish`: asks a running hub to publish a checkpoint.
pub async fn publish_remote(
    creds: &Credentials,
    hub_addr: SocketAddr,
    model_id: &str,
    path: &Path,
) -> Result<(u64, u64, u64)> {
    if !matches!(creds.role, Role::Hub | Role::Trainer) {
        bail!(
            "{} credentials cannot publish: issue trainer credentials",
            creds.role.as_str()
        );
    }
    let bind: SocketAddr = if hub_addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()?;
    let ep = client_endpoint(creds, bind, &LinkProfile::LAN)?;
    let conn = connect(&ep, hub_addr, Role::Hub, "hub").await?;
    let (mut tx, rx) = conn.open_bi().await?;
    let mut reader = MessageReader::new(rx);
    send(
        &mut tx,
        &Message::Hello {
            protocol: PROTOCOL_VERSION,
            role: MsgRole::Trainer,
            name: creds.name.clone(),
            region: String::new(),
            model_id: model_id.to_owned(),
            active: None,
            link: None,
        },
    )
    .await?;
    match reader.next().await? {
        Some(Message::Welcome { .. }) => {}
        Some(Message::Refuse { detail, .. }) => bail!("hub refused: {detail}"),
        other => bail!("unexpected answer {other:?}"),
    }
    let abs = std::fs::canonicalize(path).with_context(|| format!("resolve {}", path.display()))?;
    send(
        &mut tx,
        &Message::Publish {
            path: abs.to_string_lossy().into_owned(),
        },
    )
    .await?;
    let out = match reader.next().await? {
        Some(Message::Published {
            version,
            changes,
            bytes,
        }) => (version, changes, bytes),
        Some(Message::Refuse { detail, .. }) => bail!("{detail}"),
        other => bail!("unexpected answer {other:?}"),
    };
    let _ = tx.finish();
    conn.close(0u32.into(), b"done");
    ep.wait_idle().await;
    Ok(out)
}
