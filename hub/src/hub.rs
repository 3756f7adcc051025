//! The running hub's shared parts: what `serve` is configured with ([`ServeConfig`]), the
//! newest version ([`State`], behind the publish lock) and everything the hub's tasks share
//! ([`Hub`]: the book of versions, the ledger, the run board, the anchors, the keys, the
//! task tracker).
//!
//! A module of its own below `crate::serve` (which builds a hub and wires its tasks
//! together), so that what works on a hub (`crate::publish`, `crate::api`, `crate::status`)
//! imports this and not the wiring above it.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use ed25519_dalek::SigningKey;
use starling_ledger::{Ledger, LedgerConfig};
use starling_proto::delta::digest::StateDigest;
use starling_telemetry::Metrics;
use starling_transport::book::VersionBook;
use starling_transport::connections::ConnectionCap;
use starling_transport::link::LinkProfile;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::anchors::Anchors;
use crate::board::Board;
use crate::rollouts::ModelLimits;

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
    /// Record each new tensor's BLAKE3 in every version's manifest, for offline audits
    /// (`starling-hub verify` checks them). Off by default: it is a hash pass over the whole
    /// checkpoint per version (3.5 GB at 1.5B, 140 GB at 70B), and no online receiver needs
    /// it: actors and relays check every segment's hash and the post-state digest.
    pub tensor_hashes: bool,
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
    /// Live subscription connections one relay or actor certificate may hold
    /// (`starling_transport::connections`).
    pub subscriber_connections: usize,
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

/// The newest version: its number, the hub's copy of its checkpoint (the next publish's
/// base), its digest and step. Behind [`Hub::state`], whose lock a publish holds from its
/// checks to its record: one publish at a time.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) version: u64,
    /// The hub's copy of its checkpoint (`crate::snapshot`).
    pub(crate) snapshot: PathBuf,
    /// The snapshot's state digest: from the ledger at start, then each manifest's post
    /// digest. Spares every diff a hash of every base element.
    pub(crate) digest: StateDigest,
    /// The trainer's step the newest version was published with, if it said.
    pub(crate) step: Option<u64>,
}

/// The running hub: its configuration and what its tasks share. `crate::serve` builds it
/// once and hands `Arc<Hub>` to the connections, the HTTP API, the status routes and
/// publishing.
#[derive(Debug)]
pub(crate) struct Hub {
    pub(crate) cfg: ServeConfig,
    /// What the hub has seen since it started, for the status page and the event stream.
    pub(crate) board: Arc<Board>,
    /// The size of the full BF16 checkpoint (what a full broadcast would send per version).
    pub(crate) checkpoint_bytes: u64,
    /// The run's tensors and shapes: what every published checkpoint must hold exactly.
    pub(crate) layout: starling_checkpoint::safetensors::Layout,
    pub(crate) signing: SigningKey,
    pub(crate) state: Mutex<State>,
    /// The newest version is known to hold no NaN or ±Inf: it passed the scan of every element
    /// (at a publish, or in the background after a start), or the change check on top of such
    /// a version. Then the next publish checks only its changed elements, in the diff's own
    /// pass (`crate::ingest`, step 4). False after a start until the scan ends, and after a
    /// publish that allowed `nonfinite`. Written only with `state` locked, so a publish decides
    /// on its own base; read without it by `/v1/status`.
    pub(crate) newest_finite: std::sync::atomic::AtomicBool,
    pub(crate) book: Arc<VersionBook>,
    pub(crate) metrics: Metrics,
    pub(crate) anchors: Arc<Anchors>,
    pub(crate) ledger: Arc<Ledger>,
    /// Live worker connections per actor certificate.
    pub(crate) workers: Arc<ConnectionCap>,
    /// Live subscriptions per relay or actor certificate.
    pub(crate) subscribers: Arc<ConnectionCap>,
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
    pub(crate) tasks: TaskTracker,
    /// Snapshot copies an anchor is being written from: not released until it is written.
    pub(crate) pinned: std::sync::Mutex<std::collections::BTreeSet<PathBuf>>,
    /// The codec set of each version and why (`crate::codecs`); used from the diff's
    /// blocking task.
    pub(crate) codecs: Arc<std::sync::Mutex<crate::codecs::Chooser>>,
}

impl Hub {
    pub(crate) fn pins(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<PathBuf>> {
        self.pinned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `work` as a task of the hub, until it ends or the hub stops.
    pub(crate) fn spawn_until_stopped(&self, work: impl Future<Output = ()> + Send + 'static) {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = work => {}
                () = stop.cancelled() => {}
            }
        });
    }

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
