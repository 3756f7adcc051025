//! The regional relay: one upstream subscription to the hub, so each version crosses the WAN
//! once per region, forwarded to the region's actors **segment by segment as it arrives**
//! (cut-through).
//!
//! The relay is a shell around the receiving core ([`starling_transport::follow`]), which
//! decides what to subscribe to, what to fetch again and when a version may complete; the
//! shell does the I/O:
//! - **Staging** is forwarding: every frame, its BLAKE3 checked on arrival, goes into an
//!   assembler and straight into the relay's [`VersionBook`], from which every actor's sender
//!   streams (striped, bounded by QUIC flow control per actor: a slow actor never holds up the
//!   others or the relay).
//! - **Activation** is vouching: the version as a whole (every segment the manifest names, the
//!   manifest's signature by the trusted hub key) is verified, on a blocking thread, and
//!   written to the disk cache (`.sdc` files) before the relay completes it, so `Commit`
//!   reaches actors only for a version the relay vouches for; one that fails is aborted
//!   downstream and fetched again. The hub is told (`Staged`). The disk cache is for
//!   restarts and laggards, not for trust: a write that fails (a full disk) is logged and the
//!   version is still served from memory, rather than holding up the region.
//! - A lost hub connection (WAN outage, hub restart) is re-established with backoff; a
//!   half-received version continues from the segments already here (`Resume`), so the
//!   region's actors keep their subscription and simply see the rest arrive.
//! - A relay further behind than the hub retains deltas restores the hub's newest anchor into
//!   its cache (`anchors.rs`), restarts its chain there, and offers that anchor to its actors
//!   that are behind too: one full checkpoint over the WAN per region, not per actor.
//! - One QUIC endpoint: actors connect to the relay's listening endpoint, which also carries
//!   the subscription to the hub where routing towards the hub would pick the listening
//!   address as its source (it listens on every address, or on the one facing the hub);
//!   otherwise (loopback, or the region's LAN address) a second, client-only endpoint does.
//! - **Stopping** (SIGTERM): the relay leaves the hub, lets a verification in flight finish
//!   and forwards what it has verified to the actors subscribed, within [`SHUTDOWN_GRACE`].

mod anchors;
mod cache;
pub mod cli;
mod status;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::delta::container::{DeltaAssembler, FrameKind};
use starling_proto::delta::manifest::TrustPolicy;
use starling_proto::protocol::msg::{Message, PROTOCOL_VERSION, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use starling_transport::book::{LiveVersion, VersionBook, WireFrame};
use starling_transport::connections::ConnectionCap;
use starling_transport::downstream::{Downstream, accept_subscribers};
use starling_transport::drive::Shell;
use starling_transport::endpoint::{
    EndpointError, any_addr_for, can_reach, client_config, client_endpoint, server_endpoint,
};
use starling_transport::fanout::FanoutConfig;
use starling_transport::follow::{FollowConfig, Follower, Notice, PolicyConfig, SourcePolicy};
use starling_transport::framed::{DataStreamReader, StreamFrame};
use starling_transport::identity::{Credentials, Role, manifest_trust};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{Feed, SourceAddr, UpstreamError};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::status::RelayStatus;

/// How long a stopping relay takes to finish a verification in flight and forward what it
/// verified.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

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
    pub ping: Duration,
    /// Print each control round trip (`rtt-us MICROS`), for benchmarks.
    pub print_rtt: bool,
    /// Live subscription connections one actor certificate may hold
    /// (`starling_transport::connections`).
    pub subscriber_connections: usize,
}

/// Runs the relay until the hub refuses it or `stop` is cancelled (a lost hub connection is
/// re-established). Prints `listening on ADDR` once actors can connect, `upstream hub` on
/// each connection to the hub, `resume VERSION have N` when a new connection continues a
/// half-received version, `received VERSION` and `cached VERSION` for each version (all bytes
/// in; verified and cached) and `refetch VERSION` when part of one is requested again.
pub async fn run(cfg: RelayConfig, stop: CancellationToken) -> Result<()> {
    let creds = Credentials::load_as(&cfg.credentials, Role::Relay).context("load credentials")?;
    let trust = manifest_trust(&cfg.credentials)?;
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
    let cached = match cfg.cache.as_deref().and_then(cache::oldest) {
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
        let n = cache::load(dir, &book, &trust);
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
    // Every task the relay spawns, owned here: when `run` returns they are aborted with it.
    let mut owned: JoinSet<()> = JoinSet::new();
    let _http = match cfg.http {
        Some(http) => {
            let routes = status::router(status.clone());
            let (at, task) = starling_telemetry::http::spawn(http, metrics.clone(), routes)
                .await
                .with_context(|| format!("bind HTTP on {http}"))?;
            println!("http on {at}");
            Some(task)
        }
        None => None,
    };
    let endpoint = server_endpoint(&creds, cfg.listen, &cfg.lan).context("listen")?;
    println!(
        "listening on {}",
        endpoint.local_addr().context("local address")?
    );
    let fanout = FanoutConfig {
        stripes: cfg.stripes,
        anchors: anchors
            .clone()
            .map(|a| a as Arc<dyn starling_transport::fanout::AnchorSource>),
        observer: Some(status.clone()),
    };
    let downstream = Downstream {
        book: book.clone(),
        server: "relay".into(),
        model_id: cfg.model_id.clone(),
        serves: vec![MsgRole::Actor],
        subscriptions: ConnectionCap::new("subscription", cfg.subscriber_connections),
        fanout,
        metrics: metrics.clone(),
    };
    let accepting = CancellationToken::new();
    owned.spawn(accept_subscribers(
        endpoint.clone(),
        downstream,
        accepting.clone(),
    ));
    // The hub over the listening endpoint where its socket can reach it.
    let upstream = if can_reach(cfg.listen, cfg.hub) {
        endpoint.clone()
    } else {
        client_endpoint(&creds, any_addr_for(cfg.hub), &cfg.wan).context("client endpoint")?
    };
    let config = client_config(&creds, &cfg.wan).context("client configuration")?;
    let hub = SourceAddr {
        role: Role::Hub,
        name: "hub".into(),
        addr: cfg.hub,
    };
    let mut relay = Relay {
        cfg: &cfg,
        name: &creds.name,
        trust: &trust,
        book: &book,
        anchors: anchors.as_deref(),
        metrics: &metrics,
        status: &status,
        incoming: BTreeMap::new(),
        verifying: None,
    };
    let mut core = Follower::new(
        FollowConfig::relay(anchors.is_some()),
        SourcePolicy::new(PolicyConfig::relay(), 1),
        book.latest(),
        Instant::now(),
    );
    let mut feed = Feed::new(upstream, config, vec![hub], metrics.clone());
    let result = starling_transport::drive::run(&mut core, &mut feed, &mut relay, &stop).await;
    if stop.is_cancelled() {
        relay.drain(&mut feed, &accepting).await;
    }
    endpoint.close(0u32.into(), b"relay stopping");
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    // Dropping `owned` ends the HTTP server, the accept loop and every actor's connection.
    drop(owned);
    result
}

/// One version on its way in: the assembler that verifies the whole, and the live version
/// actors are already being sent.
#[derive(Debug)]
struct Incoming {
    assembler: DeltaAssembler,
    live: Arc<LiveVersion>,
}

/// Whole-version verification and caching of one version, on a blocking thread.
#[derive(Debug)]
struct Verification {
    version: u64,
    started: Instant,
    task: tokio_util::task::AbortOnDropHandle<Result<(), String>>,
}

/// The relay's shell around the receiving core: staging is forwarding, activation is
/// vouching (see the module docs).
struct Relay<'a> {
    cfg: &'a RelayConfig,
    name: &'a str,
    trust: &'a TrustPolicy,
    book: &'a VersionBook,
    /// Where an anchor is restored into (none: no disk cache).
    anchors: Option<&'a anchors::RelayAnchors>,
    metrics: &'a Metrics,
    status: &'a RelayStatus,
    incoming: BTreeMap<u64, Incoming>,
    /// The version being verified whole and written to the disk cache, off the event loop
    /// (a multi-second fsync or hash must not hold up pings, commits or other versions).
    verifying: Option<Verification>,
}

/// What a verification ended with: the version, when its first stripe began, the outcome.
type Verified = (u64, Instant, Result<(), String>);

impl Shell for Relay<'_> {
    type Error = anyhow::Error;
    type Done = Verified;

    fn hello(&self) -> Message {
        Message::Hello {
            protocol: PROTOCOL_VERSION,
            role: MsgRole::Relay,
            name: self.name.to_owned(),
            region: self.cfg.region.clone(),
            model_id: self.cfg.model_id.clone(),
            active: None,
            link: Some(self.cfg.wan.stated()),
        }
    }

    /// Offers `version` to the actors at once (cut-through) and starts assembling it.
    fn begin(&mut self, version: u64, base: u64, delta_id: [u8; 32]) -> bool {
        match self.book.begin(version, base, delta_id) {
            Ok(live) => {
                let assembler = DeltaAssembler::new();
                self.incoming.insert(version, Incoming { assembler, live });
                true
            }
            Err(e) => {
                tracing::warn!(version, "not begun: {e}");
                false
            }
        }
    }

    /// Forwards a checked frame to the actors at once and adds it to the assembler.
    fn stage(&mut self, version: u64, frame: StreamFrame) -> bool {
        let Some(inc) = self.incoming.get_mut(&version) else {
            return true;
        };
        if let Err(e) = inc.assembler.add(frame.as_frame()) {
            let e = starling_process::error_chain(&e);
            tracing::warn!(
                version,
                "a frame does not fit its version ({e}); fetching it again"
            );
            return false;
        }
        if frame.kind != FrameKind::Trailer {
            match WireFrame::parse(frame.bytes) {
                Ok(w) => inc.live.push(w),
                Err(e) => tracing::warn!(version, "unparsable frame: {e}"),
            }
        }
        true
    }

    fn discard(&mut self, version: u64) {
        if self.incoming.remove(&version).is_some() {
            self.book.abort(version);
        }
    }

    /// Verifies `version` whole and caches it on a blocking thread; [`Shell::finish`]
    /// completes it.
    async fn activate(
        &mut self,
        _feed: &mut Feed,
        version: u64,
        started: Instant,
    ) -> Result<Option<bool>> {
        let Some(inc) = self.incoming.remove(&version) else {
            return Ok(Some(false));
        };
        let (trust, cache_dir) = (self.trust.clone(), self.cfg.cache.clone());
        let stale = version.checked_sub(self.cfg.retain as u64);
        let task = tokio::task::spawn_blocking(move || {
            inc.assembler
                .finish(&trust)
                .map_err(|e| starling_process::error_chain(&e))?;
            if let Some(dir) = &cache_dir
                && let Err(e) = cache::store(dir, &inc.live, stale)
            {
                tracing::error!(version, "not cached on disk: {e:#}");
            }
            Ok(())
        });
        let task = tokio_util::task::AbortOnDropHandle::new(task);
        self.verifying = Some(Verification {
            version,
            started,
            task,
        });
        Ok(None)
    }

    async fn background(&mut self) -> Verified {
        match &mut self.verifying {
            Some(v) => {
                let outcome = (&mut v.task)
                    .await
                    .unwrap_or_else(|e| Err(format!("verification task: {e}")));
                (v.version, v.started, outcome)
            }
            None => std::future::pending().await,
        }
    }

    /// Completes (or aborts) the version just verified; the hub is told it is here.
    async fn finish(
        &mut self,
        feed: &mut Feed,
        (version, started, outcome): Verified,
    ) -> (u64, bool) {
        self.verifying = None;
        let completed =
            outcome.and_then(|()| self.book.complete(version).map_err(|e| e.to_string()));
        if let Err(e) = completed {
            tracing::warn!(version, "failed verification ({e}); fetching it again");
            self.book.abort(version);
            return (version, false);
        }
        self.metrics.observe_transfer(started.elapsed());
        self.metrics.set_active(version);
        self.metrics.staged();
        self.status.cached(version);
        println!("cached {version}");
        tracing::info!(version, "version verified and cached");
        // Tells the hub this region holds the version (its status shows when).
        let missing = Vec::new();
        feed.send_current(&Message::Staged { version, missing })
            .await;
        (version, true)
    }

    /// Restores the hub's anchor: received into the disk cache and checked against its seal,
    /// then the chain restarts at its version (older versions dropped; actors still waiting
    /// for one are told it is gone, and fetch this anchor from the relay).
    async fn restore(&mut self, seal: AnchorSeal, mut stream: DataStreamReader) -> bool {
        let Some(anchors) = self.anchors else {
            return false;
        };
        let restored = async {
            anchors.receive(seal, &mut stream).await?;
            self.book.restart_at(seal.version)?;
            anyhow::Ok(())
        };
        if let Err(e) = restored.await {
            tracing::warn!(version = seal.version, "anchor refused: {e:#}");
            return false;
        }
        self.incoming.clear();
        // A verification still running is of an older version; its result is not wanted.
        self.verifying = None;
        if let Some(dir) = &self.cfg.cache {
            starling_checkpoint::deltafile::remove_deltas_through(dir, seal.version);
        }
        self.metrics.set_active(seal.version);
        println!("restored anchor {}", seal.version);
        tracing::info!(version = seal.version, "restored the hub's anchor");
        true
    }

    fn tick_every(&self) -> Option<Duration> {
        Some(self.cfg.ping)
    }

    /// Measures the control round trip (it shows whether control traffic still gets through
    /// while a transfer fills the link).
    async fn tick(&mut self, feed: &mut Feed) {
        feed.ping().await;
    }

    fn pong(&mut self, rtt: Duration) {
        self.metrics.observe_control_rtt(rtt);
        self.status.rtt(rtt);
        if self.cfg.print_rtt {
            println!("rtt-us {}", rtt.as_micros());
        }
    }

    fn subscribed(&mut self, _source: &SourceAddr, _after: u64) {
        println!("upstream hub");
        self.metrics.set_upstream_connected(true);
        self.status.hub_connected(true);
    }

    fn left(&mut self, _source: &SourceAddr) {
        self.metrics.set_upstream_connected(false);
        self.status.hub_connected(false);
    }

    fn not_reached(&mut self, error: UpstreamError) -> Result<()> {
        match error {
            UpstreamError::Refused { reason, detail } => {
                bail!("the hub refused this relay: {reason:?}: {detail}")
            }
            e @ UpstreamError::Endpoint(EndpointError::ForeignCluster { .. }) => {
                Err(e).context("subscribe to the hub")
            }
            e => {
                let e = starling_process::error_chain(&e);
                tracing::warn!(hub = %self.cfg.hub, "hub not reached: {e}; trying again");
                Ok(())
            }
        }
    }

    fn notice(&mut self, n: Notice, _source: Option<&SourceAddr>) -> Result<()> {
        match n {
            // Every byte is in (whole-version verification and caching follow): the moment
            // benchmarks take as the end of the WAN transfer.
            Notice::Received { version } => {
                self.status.received(version);
                println!("received {version}");
            }
            Notice::NothingToOffer { after, .. } if self.anchors.is_none() => bail!(
                "the hub no longer retains version {} and this relay has no disk cache to \
                 restore an anchor into: start it with --cache DIR",
                after + 1
            ),
            Notice::NothingToOffer { .. } => {
                tracing::warn!("the hub has neither the next delta nor a newer anchor")
            }
            n => tracing::info!("{n}"),
        }
        Ok(())
    }
}

impl Relay<'_> {
    /// The end of a stopping relay: a verification in flight finishes (and its version goes
    /// out), versions still streaming in are abandoned, and the actors subscribed are sent
    /// what the relay verified; all within [`SHUTDOWN_GRACE`].
    async fn drain(&mut self, feed: &mut Feed, accepting: &CancellationToken) {
        accepting.cancel();
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            if self.verifying.is_some() {
                let done = self.background().await;
                self.finish(feed, done).await;
            }
            for version in std::mem::take(&mut self.incoming).into_keys() {
                self.book.abort(version);
            }
            let latest = self.book.latest();
            while !self.status.all_delivered(latest) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!("grace period over; stopping with versions not yet forwarded");
        }
    }
}
