//! `starling-hub serve`: the hub's distribution service, wired together.
//!
//! [`serve`] resumes the run from the ledger and the store (`crate::durable`), builds the
//! `Hub` (`hub.rs`), starts its background tasks (the scheduler in `crate::jobs`,
//! scoring in `crate::scoring`, archiving in `crate::archive`) and its HTTP server (the
//! trainer's API in `crate::api`, status and dashboard in `crate::status`), and accepts QUIC
//! connections from relays, actors and the trainer (all with cluster credentials; see
//! `starling_transport`). A subscriber is sent versions (striping, `Fetch`, `Ping`: shared
//! with the relays, `starling_transport::fanout`), at most `--subscriber-connections` live
//! subscriptions per certificate (`starling_transport::connections`); an actor's work
//! connection goes to `crate::jobs`; the trainer's `Publish` to `crate::publish`. On
//! shutdown it drains.
//!
//! This module sits on top of the hub's modules: it imports them, none of them imports it.
//! [`publish_remote`] is the trainer's end of `Publish`, for `starling-hub publish`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use quinn::{Connection, SendStream};
use starling_checkpoint::safetensors::Checkpoint;
use starling_ledger::Ledger;
use starling_proto::delta::manifest::TrustPolicy;
use starling_proto::protocol::msg::{Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use starling_transport::admit::admit;
use starling_transport::book::VersionBook;
use starling_transport::ceiling::RateCeiling;
use starling_transport::connections::ConnectionCap;
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
use tracing::Instrument;

use crate::anchors::Anchors;
use crate::board::{Board, FaultKind, PeerRole};
use crate::clock::now_ms;
use crate::durable;
use crate::hub::{Hub, State};
use crate::ingest::PublishRequest;
use crate::publish::{publish, write_anchor};
use crate::rollouts::ModelLimits;

// Defined below the wiring (the store is seeded from `model_dir`; every part of the hub
// shares `ServeConfig`); public here, where they always were.
pub use crate::durable::model_dir;
pub use crate::hub::ServeConfig;

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
    let cut_through = cfg.cut_through;
    let hub = Arc::new(Hub {
        state: Mutex::new(State {
            version: resumed.version,
            snapshot: resumed.snapshot,
            digest: resumed.digest,
            step: resumed.step,
        }),
        newest_finite: std::sync::atomic::AtomicBool::new(false),
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
        workers: ConnectionCap::new("worker", cfg.worker_limits.connections),
        subscribers: ConnectionCap::new("subscription", cfg.subscriber_connections),
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
            cut_through,
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
    let snapshot_for_scan = snapshot.clone();
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
                    FaultKind::AnchorFailed,
                    None,
                    Some(v),
                    &format!("{e:#}"),
                    now_ms(),
                );
            }
        });
    }
    // Whether the newest version is finite, learnt in the background, so that the first
    // publish can check only what it changes for NaN and ±Inf.
    hub.spawn_until_stopped(crate::publish::learn_finite(
        hub.clone(),
        snapshot_for_scan,
        current,
    ));
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
    let Some(mut a) = admit(&conn, "hub", &hub.cfg.model_id, &serves, latest).await? else {
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
                    codecs: hub.codecs.clone(),
                    conn: conn.clone(),
                    book: hub.book.clone(),
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
    let Some(slot) = hub
        .subscribers
        .take(a.role, &a.name, &mut a.control)
        .await?
    else {
        hub.metrics.subscription_refused();
        return Ok(());
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
    drop(slot);
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
    hub.board.peer_disconnected(&name, why.as_deref(), now_ms());
    served?;
    Ok(())
}

async fn serve_trainer(hub: Arc<Hub>, mut tx: SendStream, mut reader: MessageReader) -> Result<()> {
    // The trainer closes the connection when it is done: any end of the stream is normal.
    while let Ok(Some(m)) = reader.next().await {
        let Message::Publish { path, handover } = m else {
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
            handover,
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

/// `starling-hub publish`: asks a running hub to publish a checkpoint.
pub async fn publish_remote(
    creds: &Credentials,
    hub_addr: SocketAddr,
    model_id: &str,
    path: &Path,
    handover: bool,
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
            handover,
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
