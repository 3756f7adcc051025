//! The regional relay: one upstream subscription to the hub, so each version crosses the WAN
//! once per region, forwarded to the region's actors **segment by segment as it arrives**
//! (cut-through).
//!
//! - Every frame is checked against its BLAKE3 on arrival ([`starling_transport::upstream`]);
//!   a segment of another delta than announced is dropped. Checked frames go straight into
//!   the relay's [`VersionBook`], from which every actor's sender streams (striped, bounded by
//!   QUIC flow control per actor: a slow actor never holds up the others or the relay).
//! - The version as a whole (every segment the manifest names, the manifest's signature by
//!   the trusted hub key) is verified before the relay completes it, so `Commit` reaches
//!   actors only for a version the relay vouches for; one that fails is aborted downstream
//!   and fetched again.
//! - A stripe that broke (hash mismatch, reset) costs only its missing segments: once every
//!   stripe ended, the relay fetches exactly those (`Reception::refetch_due`).
//! - A lost hub connection (WAN outage, hub restart) is re-established with backoff; a
//!   half-received version continues from the segments already here (`Resume`), so the
//!   region's actors keep their subscription and simply see the rest arrive.
//! - Complete versions are also written to a disk cache (`.sdc` files), so a restarted relay
//!   serves its region's laggards without refetching over the WAN.
//! - A relay further behind than the hub retains deltas restores the hub's newest anchor into
//!   its cache (`anchors.rs`), restarts its chain there, and offers that anchor to its actors
//!   that are behind too: one full checkpoint over the WAN per region, not per actor.

mod anchors;
pub mod cli;
mod status;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ed25519_dalek::VerifyingKey;
use quinn::{Connection, SendStream};
use starling_checkpoint::deltafile::write_frames;
use starling_proto::container::{DeltaAssembler, FrameKind};
use starling_proto::manifest::TrustPolicy;
use starling_proto::msg::{MAX_SEQS, Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::status::RelayStatus;
use starling_transport::admit::admit;
use starling_transport::book::{LiveVersion, VersionBook, WireFrame};
use starling_transport::endpoint::{EndpointError, server_endpoint};
use starling_transport::fanout::{FanoutConfig, serve_subscriber};
use starling_transport::framed::{StreamFrame, send};
use starling_transport::identity::{Credentials, Role, manifest_key};
use starling_transport::link::LinkProfile;
use starling_transport::reception::{Added, Reception};
use starling_transport::upstream::{Upstream, UpstreamError, UpstreamEvent, subscribe};

/// What the relay needs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Credentials written by `starling-hub issue --role relay`.
    pub credentials: PathBuf,
    pub hub: SocketAddr,
    pub listen: SocketAddr,
    pub region: String,
    pub model_id: String,
    /// Versions after this one are fetched and cached.
    pub from_version: u64,
    /// The WAN link to the hub (sizes the receive windows).
    pub wan: LinkProfile,
    /// The LAN to the actors.
    pub lan: LinkProfile,
    /// Streams per version per actor.
    pub stripes: u16,
    /// Where complete versions are kept on disk (none: memory only).
    pub cache: Option<PathBuf>,
    /// Where to serve `/metrics`.
    pub http: Option<SocketAddr>,
    /// Versions kept in memory for laggards and late joiners.
    pub retain: usize,
    /// How often to measure the control round trip to the hub.
    pub ping: std::time::Duration,
    /// Print each control round trip (`rtt-us MICROS`), for benchmarks.
    pub print_rtt: bool,
}

/// Runs the relay until the hub refuses it or the process is stopped (a lost hub connection
/// is re-established). Prints `listening on ADDR` once actors can connect, `upstream hub` on
/// each connection to the hub, `resume VERSION have N` when a new connection continues a
/// half-received version, `received VERSION` and `cached VERSION` for each version (all bytes
/// in; verified and cached) and `refetch VERSION` when part of one is requested again.
pub async fn run(cfg: RelayConfig) -> Result<()> {
    let creds = Credentials::load_peer(&cfg.credentials).context("load credentials")?;
    if creds.role != Role::Relay {
        bail!(
            "{} holds {} credentials, not a relay's",
            cfg.credentials.display(),
            creds.role.as_str()
        );
    }
    let key = VerifyingKey::from_bytes(&manifest_key(&cfg.credentials)?)
        .context("signing.pub is not an ed25519 key")?;
    let trust = TrustPolicy::Keys(vec![key]);
    // Anchors live in the disk cache: a relay without one cannot restore from an anchor.
    let anchors = match &cfg.cache {
        Some(dir) => Some(Arc::new(anchors::RelayAnchors::open(
            dir,
            &cfg.model_id,
            &trust,
        )?)),
        None => None,
    };
    // A disk cache that starts later than `from_version` (older files were pruned) makes
    // its first version the start of the chain; an anchor held restarts it there.
    let cached = match cfg.cache.as_deref().and_then(oldest_cached) {
        Some(first) if first > cfg.from_version + 1 => first - 1,
        _ => cfg.from_version,
    };
    let start = cached.max(
        anchors
            .as_ref()
            .and_then(|a| a.newest_version())
            .unwrap_or(0),
    );
    let book = Arc::new(VersionBook::new(start, cfg.retain));
    if let Some(dir) = &cfg.cache {
        let n = load_cache(dir, &book, &trust)?;
        if n > 0 {
            tracing::info!(versions = n, cache = %dir.display(), "restored from the disk cache");
        }
    }
    let metrics = Metrics::new(Component::Relay);
    metrics.set_active(book.latest());
    let status = Arc::new(RelayStatus::new(
        &creds.name,
        &cfg.region,
        cfg.hub,
        book.clone(),
    ));
    // Every task the relay spawns, owned here: when `run` returns or is dropped (SIGTERM,
    // SIGINT), they are aborted with it.
    let mut owned: JoinSet<()> = JoinSet::new();
    if let Some(http) = cfg.http {
        let (listener, at) = starling_telemetry::http::bind(http)
            .await
            .with_context(|| format!("bind HTTP on {http}"))?;
        let m = metrics.clone();
        let routes = status::router(status.clone());
        owned.spawn(async move {
            if let Err(e) = starling_telemetry::http::serve(listener, m, routes).await {
                tracing::error!("HTTP server stopped: {e}");
            }
        });
        println!("http on {at}");
    }
    let endpoint = server_endpoint(&creds, cfg.listen, &cfg.lan).context("listen")?;
    println!(
        "listening on {}",
        endpoint.local_addr().context("local address")?
    );
    {
        let book = book.clone();
        let model_id = cfg.model_id.clone();
        let fanout = FanoutConfig {
            stripes: cfg.stripes,
            anchors: anchors
                .clone()
                .map(|a| a as Arc<dyn starling_transport::fanout::AnchorSource>),
            observer: Some(status.clone()),
        };
        let metrics = metrics.clone();
        let status = status.clone();
        owned.spawn(async move {
            // Each actor's connection is owned by this accept loop, so by `run`.
            let mut connections = JoinSet::new();
            while let Some(incoming) = endpoint.accept().await {
                while connections.try_join_next().is_some() {}
                let (book, model_id, fanout, metrics, status) = (
                    book.clone(),
                    model_id.clone(),
                    fanout.clone(),
                    metrics.clone(),
                    status.clone(),
                );
                connections.spawn(async move {
                    match incoming.await {
                        Ok(conn) => {
                            let r = serve_actor(
                                book,
                                conn.clone(),
                                &model_id,
                                fanout,
                                metrics,
                                &status,
                            );
                            if let Err(e) = r.await {
                                tracing::warn!(remote = %conn.remote_address(), "actor connection ended: {e:#}");
                            }
                        }
                        Err(e) => tracing::warn!("refused a connection during the handshake: {e}"),
                    }
                });
            }
        });
    }
    let result = follow_hub(
        &cfg,
        &creds,
        &trust,
        &book,
        anchors.as_deref(),
        &metrics,
        &status,
    )
    .await;
    // Dropping `owned` ends the HTTP server, the accept loop and every actor's connection.
    drop(owned);
    result
}

async fn serve_actor(
    book: Arc<VersionBook>,
    conn: Connection,
    model_id: &str,
    fanout: FanoutConfig,
    metrics: Metrics,
    status: &RelayStatus,
) -> Result<()> {
    let Some(a) = admit(&conn, "relay", model_id, &[MsgRole::Actor], book.latest()).await? else {
        return Ok(());
    };
    let name = a.name.clone();
    let span = tracing::info_span!("peer", peer = %name, role = "actor");
    span.in_scope(|| tracing::info!("actor subscribed"));
    status.subscriber(&name, true);
    let served = serve_subscriber(book, conn, a.control, a.reader, a.name, fanout, metrics)
        .instrument(span.clone())
        .await;
    status.subscriber(&name, false);
    span.in_scope(|| tracing::info!("actor left"));
    served?;
    Ok(())
}

/// One version on its way in: what arrived, the assembler that verifies the whole, and the
/// live version actors are already being sent.
#[derive(Debug)]
struct Incoming {
    reception: Reception,
    assembler: DeltaAssembler,
    live: Arc<LiveVersion>,
    /// `received VERSION` was printed.
    said_received: bool,
}

struct Follower<'a> {
    cfg: &'a RelayConfig,
    trust: &'a TrustPolicy,
    book: &'a VersionBook,
    /// Where an anchor is restored into (none: no disk cache).
    anchors: Option<&'a anchors::RelayAnchors>,
    /// An anchor was asked of the hub on this connection.
    anchor_asked: bool,
    metrics: &'a Metrics,
    status: &'a RelayStatus,
    incoming: BTreeMap<u64, Incoming>,
    /// Versions the hub committed. Kept apart from `incoming`: the control stream has send
    /// priority, so a `Commit` may overtake the last data of its version.
    commits: BTreeSet<u64>,
    /// The version being verified whole and written to the disk cache, off the event loop
    /// (a multi-second fsync or hash must not hold up pings, commits or other versions).
    verifying: Option<Verification>,
}

/// Whole-version verification and caching of one version, on a blocking thread.
#[derive(Debug)]
struct Verification {
    version: u64,
    task: tokio::task::JoinHandle<Verified>,
}

/// What a [`Verification`] found.
#[derive(Debug)]
struct Verified {
    live: Arc<LiveVersion>,
    started: Instant,
    outcome: Result<(), String>,
}

/// The least and the most a relay waits between attempts to reach the hub again.
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// Follows the hub for as long as the process runs. A lost connection (a WAN outage, a hub
/// restart) is not the end: the relay keeps its cache and its actors, reconnects with
/// backoff, and continues a half-received version from the segments it already has
/// (`Resume`), so its actors see the rest of the same version arrive. Only a refusal (wrong
/// credentials, model or protocol) ends it.
async fn follow_hub(
    cfg: &RelayConfig,
    creds: &Credentials,
    trust: &TrustPolicy,
    book: &VersionBook,
    anchors: Option<&anchors::RelayAnchors>,
    metrics: &Metrics,
    status: &RelayStatus,
) -> Result<()> {
    let hello = Message::Hello {
        protocol: PROTOCOL_VERSION,
        role: MsgRole::Relay,
        name: creds.name.clone(),
        region: cfg.region.clone(),
        model_id: cfg.model_id.clone(),
        active: None,
        link: Some(cfg.wan.stated()),
    };
    let mut f = Follower {
        cfg,
        trust,
        book,
        anchors,
        anchor_asked: false,
        metrics,
        status,
        incoming: BTreeMap::new(),
        commits: BTreeSet::new(),
        verifying: None,
    };
    // Control-stream round trips, measured all the time (they show whether control traffic
    // still gets through while a transfer fills the link).
    let epoch = Instant::now();
    let mut ping = tokio::time::interval(cfg.ping);
    let mut backoff = RECONNECT_MIN;
    loop {
        let resume = f.resumable();
        let after = match &resume {
            Some((version, _)) => *version,
            None => f.done_through(),
        };
        let mut up =
            match subscribe(creds, cfg.hub, Role::Hub, "hub", &hello, after, &cfg.wan).await {
                Ok(up) => up,
                Err(UpstreamError::Refused(why)) => bail!("the hub refused this relay: {why}"),
                Err(e @ UpstreamError::Endpoint(EndpointError::ForeignCluster { .. })) => {
                    return Err(e).context("subscribe to the hub");
                }
                Err(e) => {
                    tracing::warn!(
                        hub = %cfg.hub,
                        "hub not reached: {}; trying again in {backoff:?}",
                        starling_telemetry::error_chain(&e)
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RECONNECT_MAX);
                    continue;
                }
            };
        backoff = RECONNECT_MIN;
        f.anchor_asked = false;
        println!("upstream hub");
        tracing::info!(hub = %cfg.hub, after_version = after, "subscribed to the hub");
        metrics.set_upstream_connected(true);
        status.hub_connected(true);
        if let Some((version, have)) = resume {
            println!("resume {version} have {}", have.len());
            // A failed send shows up as the connection closing.
            let _ = send(&mut up.control, &Message::Resume { version, have }).await;
        }
        let followed = f.follow(&mut up, epoch, &mut ping).await;
        metrics.set_upstream_connected(false);
        status.hub_connected(false);
        let why = followed?;
        tracing::warn!("hub connection ended: {why}; reconnecting");
        up.close().await;
    }
}

impl Follower<'_> {
    /// Handles the hub's events until the connection ends; returns why it ended.
    async fn follow(
        &mut self,
        up: &mut Upstream,
        epoch: Instant,
        ping: &mut tokio::time::Interval,
    ) -> Result<String> {
        loop {
            let ev = tokio::select! {
                ev = up.events.recv() => ev,
                done = async { (&mut self.verifying.as_mut().expect("guarded by the if").task).await },
                    if self.verifying.is_some() =>
                {
                    self.verifying = None;
                    let done = done.context("verification task")?;
                    self.verified(done, &mut up.control).await?;
                    continue;
                }
                _ = ping.tick() => {
                    let nonce = epoch.elapsed().as_micros() as u64;
                    let _ = send(&mut up.control, &Message::Ping { nonce }).await;
                    continue;
                }
            };
            match ev {
                None => return Ok("the subscription ended".into()),
                Some(UpstreamEvent::Closed(why)) => return Ok(why),
                Some(UpstreamEvent::Pong(nonce)) => {
                    let rtt = (epoch.elapsed().as_micros() as u64).saturating_sub(nonce);
                    self.metrics
                        .observe_control_rtt(std::time::Duration::from_micros(rtt));
                    self.status.rtt(std::time::Duration::from_micros(rtt));
                    if self.cfg.print_rtt {
                        println!("rtt-us {rtt}");
                    }
                }
                Some(UpstreamEvent::Anchor { seal, mut stream }) => {
                    return self.restore(seal, &mut stream).await;
                }
                Some(UpstreamEvent::Refused { reason, detail }) => {
                    tracing::warn!("hub refused: {reason:?}: {detail}");
                    if reason == RefuseReason::VersionUnavailable
                        && let Some(why) = self.version_unavailable(&mut up.control).await?
                    {
                        return Ok(why);
                    }
                }
                Some(ev) => self.handle(ev, &mut up.control).await?,
            }
        }
    }

    /// The hub no longer retains the version the relay needs next: ask it for its newest
    /// anchor, once per connection. `Some(why)` ends the connection: the hub has no anchor
    /// either (the relay tries again later).
    async fn version_unavailable(&mut self, control: &mut SendStream) -> Result<Option<String>> {
        if self.anchors.is_none() {
            bail!(
                "the hub no longer retains version {} and this relay has no disk cache to \
                 restore an anchor into: start it with --cache DIR",
                self.done_through() + 1
            );
        }
        if self.anchor_asked {
            tokio::time::sleep(RECONNECT_MAX).await;
            return Ok(Some(
                "the hub has neither the next delta nor a newer anchor".into(),
            ));
        }
        self.anchor_asked = true;
        let after_version = self.done_through();
        tracing::info!(after_version, "asking the hub for its newest anchor");
        let _ = send(control, &Message::FetchAnchor { after_version }).await;
        Ok(None)
    }

    /// Restores the hub's anchor: received into the disk cache and checked against its seal,
    /// then the chain restarts at its version (older versions dropped; actors still waiting
    /// for one are told it is gone, and fetch this anchor from the relay). Ends the
    /// connection either way: the next one subscribes after the anchor.
    async fn restore(
        &mut self,
        seal: starling_proto::anchor::AnchorSeal,
        stream: &mut starling_transport::framed::DataStreamReader,
    ) -> Result<String> {
        let Some(anchors) = self.anchors else {
            return Ok("an anchor came unasked and there is no cache to keep it".into());
        };
        if seal.version <= self.done_through() {
            return Ok(format!(
                "anchor {} is not newer than version {}",
                seal.version,
                self.done_through()
            ));
        }
        if let Err(e) = anchors.receive(seal, stream).await {
            tracing::warn!(version = seal.version, "anchor refused: {e:#}");
            return Ok(format!("anchor {} refused", seal.version));
        }
        self.book.restart_at(seal.version)?;
        self.incoming.clear();
        self.commits.clear();
        // A verification still running is of an older version; its result is not wanted.
        self.verifying = None;
        if let Some(dir) = &self.cfg.cache {
            starling_checkpoint::deltafile::remove_deltas_through(dir, seal.version);
        }
        self.metrics.set_active(seal.version);
        println!("restored anchor {}", seal.version);
        tracing::info!(version = seal.version, "restored the hub's anchor");
        Ok(format!("restored anchor {}", seal.version))
    }

    /// The newest version that needs nothing more from the hub: cached, or whole and being
    /// verified.
    fn done_through(&self) -> u64 {
        let verifying = self.verifying.as_ref().map_or(0, |v| v.version);
        self.book.latest().max(verifying)
    }

    /// The next version, if part of it is here: its number and the segments already in
    /// (the rest is what a new connection asks for).
    fn resumable(&mut self) -> Option<(u64, Vec<u32>)> {
        let next = self.done_through() + 1;
        let inc = self.incoming.get_mut(&next)?;
        inc.reception.reset_requests();
        let have = inc.reception.have();
        (!have.is_empty() && have.len() <= MAX_SEQS).then_some((next, have))
    }

    async fn handle(&mut self, ev: UpstreamEvent, control: &mut SendStream) -> Result<()> {
        match ev {
            UpstreamEvent::StreamStarted {
                version,
                base,
                delta_id,
                transmission,
                stripes,
            } => {
                if let Some(inc) = self.entry(version, base, delta_id)? {
                    inc.reception.stream_started(transmission, stripes);
                }
            }
            UpstreamEvent::Frame {
                version,
                delta_id,
                frame,
            } => self.frame(version, delta_id, frame),
            UpstreamEvent::StreamEnded {
                version,
                delta_id,
                transmission,
                stripes,
                error,
            } => {
                let Some(inc) = self.incoming.get_mut(&version) else {
                    return Ok(());
                };
                if inc.live.delta_id != delta_id {
                    return Ok(());
                }
                if let Some(seqs) = inc.reception.stream_ended(transmission, stripes, error) {
                    self.refetch(control, version, seqs).await?;
                }
            }
            UpstreamEvent::Commit(v) => {
                if v > self.book.latest() {
                    self.commits.insert(v);
                }
            }
            UpstreamEvent::Pong(_) => {}
            // Handled in `follow`: they end the connection.
            UpstreamEvent::Refused { .. } | UpstreamEvent::Anchor { .. } => {}
            UpstreamEvent::Closed(_) => {}
        }
        self.complete_ready()
    }

    /// The incoming state of `version`, started (and offered downstream) on first sight;
    /// a different delta under the same number replaces an unfinished one.
    fn entry(
        &mut self,
        version: u64,
        base: u64,
        delta_id: [u8; 32],
    ) -> Result<Option<&mut Incoming>> {
        if version <= self.book.latest()
            || self
                .verifying
                .as_ref()
                .is_some_and(|v| v.version == version)
        {
            return Ok(None);
        }
        let fresh = self
            .incoming
            .get(&version)
            .is_none_or(|i| i.live.delta_id != delta_id);
        if fresh {
            let live = self.book.begin(version, base, delta_id)?;
            self.incoming.insert(
                version,
                Incoming {
                    reception: Reception::new(version, base, delta_id),
                    assembler: DeltaAssembler::new(),
                    live,
                    said_received: false,
                },
            );
        }
        Ok(self.incoming.get_mut(&version))
    }

    fn frame(&mut self, version: u64, delta_id: [u8; 32], frame: StreamFrame) {
        let Some(inc) = self.incoming.get_mut(&version) else {
            return;
        };
        if inc.live.delta_id != delta_id {
            return;
        }
        self.metrics.received("hub", frame.bytes.len() as u64, 1);
        match inc.reception.frame(frame.kind, frame.body()) {
            Ok(Added::New) => {}
            Ok(Added::Duplicate) => return,
            Err(e) => return tracing::warn!(version, "dropped a frame: {e}"),
        }
        if let Err(e) = inc.assembler.add(frame.as_frame()) {
            return tracing::warn!(
                version,
                "dropped a frame: {}",
                starling_telemetry::error_chain(&e)
            );
        }
        if frame.kind != FrameKind::Trailer {
            match WireFrame::parse(frame.bytes) {
                Ok(w) => inc.live.push(w),
                Err(e) => tracing::warn!(version, "unparsable frame: {e}"),
            }
        }
        if !inc.said_received && inc.reception.complete() {
            // Every byte is in (whole-version verification and caching follow): the moment
            // benchmarks take as the end of the WAN transfer.
            inc.said_received = true;
            println!("received {version}");
        }
    }

    async fn refetch(
        &mut self,
        control: &mut SendStream,
        version: u64,
        seqs: Vec<u32>,
    ) -> Result<()> {
        tracing::warn!(
            version,
            "fetching {} again",
            if seqs.is_empty() {
                "everything".to_owned()
            } else {
                format!("segments {seqs:?}")
            }
        );
        println!("refetch {version}");
        self.metrics.refetch("hub");
        // A failed send means the connection is going: its end arrives as an event, and the
        // next connection resumes from what is here.
        if let Err(e) = send(control, &Message::Fetch { version, seqs }).await {
            tracing::warn!(
                version,
                "fetch not sent: {}",
                starling_telemetry::error_chain(&e)
            );
        }
        Ok(())
    }

    /// Starts verifying the next version once it is whole and committed upstream (one at a
    /// time, in order); [`verified`](Self::verified) completes it.
    fn complete_ready(&mut self) -> Result<()> {
        if self.verifying.is_some() {
            return Ok(());
        }
        let next = self.book.latest() + 1;
        let ready = self
            .incoming
            .get(&next)
            .is_some_and(|i| self.commits.contains(&next) && i.reception.complete());
        if !ready {
            return Ok(());
        }
        let Some(inc) = self.incoming.remove(&next) else {
            return Ok(());
        };
        self.commits.remove(&next);
        let trust = self.trust.clone();
        let cache = self.cfg.cache.clone();
        let stale = next.checked_sub(self.cfg.retain as u64);
        let task = tokio::task::spawn_blocking(move || {
            let outcome = inc
                .assembler
                .finish(&trust)
                .map_err(|e| starling_telemetry::error_chain(&e))
                .map(|_| {
                    if let Some(dir) = &cache {
                        if let Err(e) = write_cache(dir, &inc.live) {
                            tracing::error!(version = next, "not cached on disk: {e:#}");
                        }
                        // The disk keeps what memory keeps: the newest `retain` versions.
                        if let Some(old) = stale {
                            let _ = std::fs::remove_file(cache_path(dir, old));
                        }
                    }
                });
            Verified {
                live: inc.live,
                started: inc.reception.started,
                outcome,
            }
        });
        self.verifying = Some(Verification {
            version: next,
            task,
        });
        Ok(())
    }

    /// Completes (or aborts and refetches) the version just verified, then starts the next.
    async fn verified(&mut self, done: Verified, control: &mut SendStream) -> Result<()> {
        let version = done.live.version;
        match done.outcome {
            Ok(()) => {
                self.book.complete(version)?;
                self.metrics.observe_transfer(done.started.elapsed());
                self.metrics.set_active(version);
                println!("cached {version}");
                tracing::info!(version, "version verified and cached");
                // Tells the hub this region holds the version (its status shows when).
                let staged = Message::Staged {
                    version,
                    missing: Vec::new(),
                };
                if let Err(e) = send(control, &staged).await {
                    tracing::debug!(
                        version,
                        "staged report not sent: {}",
                        starling_telemetry::error_chain(&e)
                    );
                }
            }
            Err(e) => {
                tracing::warn!(version, "failed verification ({e}); fetching it again");
                self.book.abort(version);
                self.refetch(control, version, Vec::new()).await?;
            }
        }
        self.complete_ready()
    }
}

fn cache_path(dir: &Path, version: u64) -> PathBuf {
    dir.join(format!("v{version:08}.sdc"))
}

/// The oldest version in the disk cache.
fn oldest_cached(dir: &Path) -> Option<u64> {
    starling_checkpoint::deltafile::delta_files(dir)
        .into_iter()
        .map(|(v, _)| v)
        .min()
}

/// Writes a complete version as a `.sdc` file (segments in order, manifest, trailer).
fn write_cache(dir: &Path, live: &LiveVersion) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let frames = live.snapshot();
    let bytes: Vec<&[u8]> = frames.iter().map(|f| f.bytes.as_slice()).collect();
    write_frames(&cache_path(dir, live.version), &bytes)?;
    Ok(())
}

/// Loads the cached versions that continue the book's chain, each verified again.
fn load_cache(dir: &Path, book: &VersionBook, trust: &TrustPolicy) -> Result<usize> {
    let mut n = 0;
    loop {
        let path = cache_path(dir, book.latest() + 1);
        let Ok(bytes) = std::fs::read(&path) else {
            return Ok(n);
        };
        if let Err(e) = book.load_delta(&bytes, trust) {
            tracing::warn!(
                path = %path.display(),
                "cache file refused: {}; ignoring the cache from here",
                starling_telemetry::error_chain(&e)
            );
            return Ok(n);
        }
        n += 1;
    }
}
