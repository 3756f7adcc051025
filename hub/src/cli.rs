//! The command line: argument definitions and one handler per subcommand.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use starling_checkpoint::deltafile::{
    DiffOptions, apply_in_memory, apply_to_file, diff_to_file, read_manifest,
};
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir, step_file};
use starling_checkpoint::writer::AtomicFile;
use starling_proto::delta::manifest::{TrustPolicy, hex};
use starling_proto::delta::segment::Segment;
use starling_transport::identity::Credentials;
use starling_transport::link::LinkProfile;

use crate::clock::now_ms;
use crate::keys;

#[derive(Parser, Debug)]
#[command(
    name = "starling-hub",
    version,
    about = "Starling trainer hub: ships only what changed in a policy's BF16 weights, bit-exactly.",
    long_about = "Starling trainer hub.\n\nToday this binary carries the delta checkpoint tools: `delta diff` turns two \
safetensors checkpoints into a small, signed, verifiable delta (.sdc); `delta apply` reproduces the new \
checkpoint bit-exactly from the old one; `delta inspect` shows sizes, densities and codec choices; `delta \
verify` proves a delta turns a given base into exactly the trainer's weights. `bench gen` writes realistic \
consecutive RL checkpoints, and `demo` runs the whole loop at small scale."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub log: starling_process::logging::LogArgs,
}

// Parsed once at start and matched once: the size of `Serve` costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Delta checkpoint tools.
    #[command(subcommand)]
    Delta(DeltaCmd),
    /// Create a cluster: its certificate authority, the hub's credentials and the
    /// manifest-signing key, in DIR (secrets written with mode 0600).
    Init {
        /// Cluster directory (created; must not hold a cluster yet).
        #[arg(long, default_value = "cluster", env = "STARLING_HUB_CLUSTER_DIR")]
        dir: PathBuf,
        /// Cluster name (a DNS label: a–z, 0–9, '-').
        #[arg(long, default_value = "starling")]
        name: String,
    },
    /// Issue credentials for a relay, an actor or a trainer into OUT (copy OUT to that
    /// machine). A trainer's also hold its HTTP token (`OUT/token`).
    Issue {
        #[arg(long, default_value = "cluster", env = "STARLING_HUB_CLUSTER_DIR")]
        dir: PathBuf,
        /// relay, actor or trainer.
        #[arg(long)]
        role: String,
        /// The peer's name (a DNS label), e.g. eu-west-relay or a100-07.
        #[arg(long)]
        name: String,
        #[arg(short, long)]
        out: PathBuf,
    },
    /// Run the hub's distribution service (QUIC, mutual TLS with the cluster's credentials).
    Serve {
        #[arg(long, default_value = "cluster", env = "STARLING_HUB_CLUSTER_DIR")]
        cluster: PathBuf,
        /// Checkpoint store (deltas are written here before they are announced).
        #[arg(long, default_value = "hub-store", env = "STARLING_HUB_STORE")]
        store: PathBuf,
        #[arg(long, default_value = "0.0.0.0:7443", env = "STARLING_HUB_LISTEN")]
        listen: std::net::SocketAddr,
        /// The run's first checkpoint (a safetensors file, a sharded directory, or a model
        /// directory): needed on the first start only. Once the ledger and the store hold the
        /// run, a restart needs none; given, it must be a checkpoint of the run (the seed, or
        /// any recorded version with its --init-version).
        #[arg(long, env = "STARLING_HUB_INIT")]
        init: Option<PathBuf>,
        /// Its version (default: recorded in its metadata, else 0).
        #[arg(long, env = "STARLING_HUB_INIT_VERSION")]
        init_version: Option<u64>,
        #[arg(long, default_value = "model", env = "STARLING_HUB_MODEL_ID")]
        model_id: String,
        /// Streams each version is striped over, per subscriber.
        #[arg(long, default_value_t = 4)]
        stripes: u16,
        /// Offer a version only once its delta file is durable (for comparison; the default
        /// sends each segment as soon as it is encoded).
        #[arg(long)]
        store_and_forward: bool,
        /// Serve `/metrics` and the HTTP API (`POST /v1/versions`) here.
        #[arg(long, env = "STARLING_HUB_HTTP")]
        http: Option<std::net::SocketAddr>,
        /// A directory the trainer writes checkpoints into (repeatable; in the environment,
        /// comma-separated). A publish names a path that must lie inside one of them (links
        /// resolved); without any, the hub publishes no path: it reads published files with
        /// its own privileges, which include the cluster's signing key.
        #[arg(
            long = "publish-dir",
            value_name = "DIR",
            env = "STARLING_HUB_PUBLISH_DIRS",
            value_delimiter = ','
        )]
        publish_dirs: Vec<PathBuf>,
        /// Deltas kept in memory for subscribers that fall behind (further back: anchors).
        #[arg(long, default_value_t = 32)]
        retain: usize,
        /// Write an anchor (full checkpoint) every N versions (0: only the initial one).
        #[arg(long, default_value_t = 32)]
        anchor_every: u64,
        /// Anchors kept on disk (deltas older than the oldest are deleted).
        #[arg(long, default_value_t = 2)]
        keep_anchors: usize,
        /// The ledger (versions, actors, batches, jobs, leases, results): `sqlite:PATH` or
        /// `postgres://…`. Default: `sqlite:STORE/ledger.db`. Restarting with the same ledger
        /// resumes the run where it stopped.
        #[arg(long, env = "STARLING_HUB_LEDGER")]
        ledger: Option<String>,
        /// The lease of a job claimed by an actor whose throughput the hub has not measured
        /// yet (seconds). Afterwards a lease covers the token budget of every job the actor
        /// holds at its measured throughput × --lease-margin, within [--lease-floor, 1 h].
        #[arg(long, default_value_t = 120.0)]
        lease_initial: f64,
        /// The shortest lease (seconds), and how long after its last progress report a
        /// generation that stopped moving keeps its lease.
        #[arg(long, default_value_t = 10.0)]
        lease_floor: f64,
        /// Safety factor of a lease over the expected generation time (≥ 1).
        #[arg(long, default_value_t = 2.0)]
        lease_margin: f64,
        /// A share of a batch its actor has claimed nothing from for this long (seconds)
        /// goes back to the shared pool, and the actor is not scheduled again until it claims
        /// (an actor that heartbeats but never claims holds up nobody).
        #[arg(long, default_value_t = 10.0)]
        claim_timeout: f64,
        /// Most Heartbeat (and, separately, StagingTime and Progress) messages per second one actor's worker
        /// connection may send; beyond it the connection is refused (RateLimited) and closed.
        #[arg(long, default_value_t = 20.0)]
        actor_heartbeat_rate: f64,
        /// Most Submit (and, separately, Claim) messages per second one actor's worker
        /// connection may send; beyond it the connection is refused (RateLimited) and closed.
        #[arg(long, default_value_t = 50.0)]
        actor_submit_rate: f64,
        /// Most live worker connections one actor certificate may hold (a reconnect may
        /// overlap its dead predecessor until the idle timeout); more are refused
        /// (TooManyConnections).
        #[arg(long, default_value_t = starling_transport::connections::DEFAULT_MAX)]
        actor_connections: usize,
        /// Most live subscription connections one relay or actor certificate may hold (a
        /// reconnect may overlap its dead predecessor until the idle timeout); more are refused
        /// (TooManyConnections) and closed; the
        /// refused receiver asks again for up to 10 s before it takes another source.
        #[arg(long, default_value_t = starling_transport::connections::DEFAULT_MAX)]
        subscriber_connections: usize,
        /// An actor silent this long (seconds) gets no new work and its reserved share goes
        /// back to the shared pool.
        #[arg(long, default_value_t = 60.0)]
        actor_timeout: f64,
        /// Split batches evenly over the eligible actors instead of in proportion to their
        /// measured throughput (the baseline benchmarks compare against).
        #[arg(long)]
        uniform_split: bool,
        /// Ship every version as a full checkpoint (each tensor's new BF16 bits, as byte
        /// planes + zstd-1) instead of a sparse delta: the baseline `starling demo
        /// --full-broadcast` compares against. Same path, segments and verification.
        #[arg(long)]
        full_broadcast: bool,
        /// Record each new tensor's BLAKE3 in every version's manifest, for offline audits
        /// with `starling-hub verify`. Costs a hash pass over the whole checkpoint per version,
        /// beside the encode; actors never need it (they check each segment's hash and the
        /// post-state digest).
        #[arg(long)]
        tensor_hashes: bool,
        /// Close a segment once it holds this many KiB (the unit of forwarding, verifying
        /// and refetching).
        #[arg(long, default_value_t = 2048)]
        segment_kib: usize,
        /// The link to a peer, as NAME=RATE_MBIT:RTT_MS (repeatable): what the hub keeps in
        /// flight to that peer is capped at the rate × the measured minimum RTT plus a little
        /// headroom, so a transfer leaves no standing queue for control messages to wait
        /// behind. A named entry wins over the link the peer states in `Hello`; NAME `*` fills
        /// in for peers that state none. A peer with no link either way gets plain BBR.
        #[arg(long = "peer-link", value_name = "NAME=RATE_MBIT:RTT_MS", value_parser = parse_peer_link)]
        peer_links: Vec<(String, LinkProfile)>,
        /// Ignore every stated link and send with plain BBR (for comparison).
        #[arg(long)]
        no_link_ceiling: bool,
        /// Which codecs versions are encoded with: `small` (the smallest deltas), `fast` (the
        /// first release's codecs: ~1.5× the bytes, several times less CPU to encode and
        /// stage) or `auto` (per version, the set predicted to reach the slowest region's
        /// actors first, from the stated links and the encoder's measured speed, the small
        /// set only where it is predicted to win by 15%; what was chosen and why is in
        /// `/v1/status` and on the dashboard).
        #[arg(long, value_enum, default_value_t = crate::codecs::CodecPolicy::Auto, env = "STARLING_HUB_CODECS")]
        codecs: crate::codecs::CodecPolicy,
        /// Rewards by services, and retention of delivered results.
        #[command(flatten)]
        results: Box<ResultsArgs>,
        /// Bounds of the HTTP server.
        #[command(flatten)]
        http_limits: Box<HttpArgs>,
    },
    /// Ask a running hub to publish a new checkpoint (a path on the hub's machine).
    Publish {
        path: PathBuf,
        #[arg(long, default_value = "127.0.0.1:7443", env = "STARLING_HUB_ADDR")]
        hub: std::net::SocketAddr,
        /// Trainer credentials (`issue --role trainer`); without them, the hub's own from
        /// `--cluster` (on the hub's machine).
        #[arg(long, env = "STARLING_TRAINER_CREDENTIALS")]
        credentials: Option<PathBuf>,
        #[arg(long, default_value = "cluster", env = "STARLING_HUB_CLUSTER_DIR")]
        cluster: PathBuf,
        #[arg(long, default_value = "model", env = "STARLING_HUB_MODEL_ID")]
        model_id: String,
        /// Give the file to the hub: it renames it into its store instead of copying it where
        /// it can (a single file on the store's file system with no other hard link), and
        /// gives it back if the publish is refused. Do not write to the file afterwards.
        #[arg(long)]
        handover: bool,
    },
    /// Create an ed25519 signing key (FILE, mode 0600) and its public key (FILE.pub).
    Keygen {
        /// Where to write the secret key; must not exist.
        #[arg(short, long)]
        out: PathBuf,
    },
    /// Benchmarks' helpers.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Small-scale demo: generate checkpoints, then diff, inspect, apply and verify deltas.
    Demo {
        /// Working directory (created; reused if present).
        #[arg(long, default_value = "demo-out")]
        dir: PathBuf,
        /// Model preset (tiny, small, 100m, 0.5b, 1.5b).
        #[arg(long, default_value = "small")]
        model: String,
        #[arg(long, default_value_t = 4)]
        steps: u32,
    },
}

#[derive(Subcommand, Debug)]
pub enum DeltaCmd {
    /// Diff OLD → NEW (safetensors file or sharded directory) into a delta checkpoint.
    Diff {
        old: PathBuf,
        new: PathBuf,
        /// Output .sdc (written atomically).
        #[arg(short, long)]
        out: PathBuf,
        /// Model id recorded in the manifest (keys the state digest).
        #[arg(long, default_value = "model", env = "STARLING_HUB_MODEL_ID")]
        model_id: String,
        /// Version of OLD (default: recorded in OLD's metadata, else 0).
        #[arg(long)]
        base_version: Option<u64>,
        /// Version of NEW (default: recorded in NEW's metadata, else base + 1).
        #[arg(long)]
        version: Option<u64>,
        /// Sign the manifest with this key (see `keygen`); unsigned without one.
        #[arg(long, env = "STARLING_HUB_SIGNING_KEY")]
        signing_key: Option<PathBuf>,
        /// Skip the per-tensor BLAKE3 of NEW in the manifest (saves a hash pass).
        #[arg(long)]
        no_tensor_hashes: bool,
        #[command(flatten)]
        output: Output,
    },
    /// Apply a delta to BASE and write the new checkpoint (safetensors, atomically).
    Apply {
        base: PathBuf,
        delta: PathBuf,
        #[arg(short, long)]
        out: PathBuf,
        #[command(flatten)]
        trust: Trust,
        #[command(flatten)]
        output: Output,
    },
    /// Show a delta's sizes, densities and codec choices.
    Inspect {
        delta: PathBuf,
        /// Per-tensor rows (default: totals and the largest tensors).
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        output: Output,
    },
    /// Check that a delta turns BASE into exactly the weights it was made from.
    Verify {
        base: PathBuf,
        delta: PathBuf,
        #[command(flatten)]
        trust: Trust,
        #[command(flatten)]
        output: Output,
    },
}

#[derive(Args, Debug)]
pub struct Trust {
    /// Accept only manifests signed by this public key (file or hex; repeatable).
    #[arg(long = "trust", env = "STARLING_HUB_TRUST", value_delimiter = ',')]
    keys: Vec<String>,
    /// The version BASE is at (default: recorded in its metadata, else what the delta says;
    /// the state digest is checked either way).
    #[arg(long)]
    base_version: Option<u64>,
}

#[derive(Args, Debug)]
pub struct Output {
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Write consecutive BF16 checkpoints that behave like RL post-training.
    Gen {
        /// Model preset: tiny, small, 100m, 0.5b (1 GB), 1.5b (3.1 GB).
        #[arg(long, default_value = "small")]
        model: String,
        /// Optimizer steps (writes steps + 1 checkpoints).
        #[arg(long, default_value_t = 3)]
        steps: u32,
        #[arg(long, default_value_t = 3e-6)]
        lr: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(short, long)]
        out: PathBuf,
    },
}

impl Trust {
    fn policy(&self) -> Result<TrustPolicy> {
        if self.keys.is_empty() {
            return Ok(TrustPolicy::AnySigner);
        }
        Ok(TrustPolicy::Keys(
            self.keys
                .iter()
                .map(|k| keys::load_trusted(k))
                .collect::<Result<_>>()?,
        ))
    }
}

/// `serve`'s flags for rewards and results (`docs/api.md`).
#[derive(clap::Args, Debug)]
pub struct ResultsArgs {
    /// A reward service groups may name as their verifier, as NAME=URL (repeatable):
    /// the hub POSTs each such group's prompt, completions and answer to URL
    /// (`http://host:port/path`) and stores the rewards it answers (docs/api.md).
    #[arg(long = "reward-service", value_name = "NAME=URL")]
    reward_services: Vec<String>,
    /// How long one reward-service call may take (seconds); each call is tried 3 times.
    #[arg(long, default_value_t = 10.0)]
    reward_timeout: f64,
    /// Archive batches the trainer has read to their end once they were delivered this
    /// long ago (seconds): their results move to a file in --results-archive and their
    /// rows leave the ledger.
    #[arg(long)]
    retain_age: Option<f64>,
    /// Keep at most this many delivered batches in the ledger; older ones are archived.
    #[arg(long)]
    retain_batches: Option<u64>,
    /// Where archived batches' results are written (default: STORE/results).
    #[arg(long)]
    results_archive: Option<PathBuf>,
}

/// `serve`'s bounds on its HTTP server (`docs/api.md`, "Bounds").
#[derive(clap::Args, Debug)]
pub struct HttpArgs {
    /// Most HTTP connections served at once; one more is answered 503
    /// (too_many_connections) and closed.
    #[arg(long, default_value_t = 256, env = "STARLING_HUB_HTTP_MAX_CONNECTIONS")]
    http_max_connections: usize,
    /// Most HTTP connections served at once from one IP address (so one host reopening idle
    /// connections cannot take every slot); one more from it is answered 503.
    #[arg(long, default_value_t = 64, env = "STARLING_HUB_HTTP_MAX_PER_ADDRESS")]
    http_max_per_address: usize,
    /// Seconds a request's line and headers may take to arrive, from the connection's start or
    /// the previous response's end (so also how long an idle keep-alive connection stays open).
    #[arg(long, default_value_t = 10.0, env = "STARLING_HUB_HTTP_HEADER_TIMEOUT")]
    http_header_timeout: f64,
    /// Seconds a request may take to be answered, its body included (408 timeout). Publishes
    /// are exempt (they answer once the version is recorded), but their body must arrive
    /// within it; long-polls wait at most half of it.
    #[arg(
        long,
        default_value_t = 60.0,
        env = "STARLING_HUB_HTTP_REQUEST_TIMEOUT"
    )]
    http_request_timeout: f64,
    /// Seconds a response may wait for its client to read it before the connection is closed.
    #[arg(long, default_value_t = 30.0, env = "STARLING_HUB_HTTP_WRITE_TIMEOUT")]
    http_write_timeout: f64,
}

impl HttpArgs {
    fn limits(&self) -> Result<starling_telemetry::http::HttpLimits> {
        let secs = |name: &str, v: f64| {
            if v.is_finite() && (0.1..1e6).contains(&v) {
                Ok(std::time::Duration::from_secs_f64(v))
            } else {
                Err(anyhow::anyhow!(
                    "--{name} must be a number of seconds from 0.1 on, not {v}"
                ))
            }
        };
        if self.http_max_connections == 0 {
            bail!("--http-max-connections must be at least 1");
        }
        if self.http_max_per_address == 0 {
            bail!("--http-max-per-address must be at least 1");
        }
        Ok(starling_telemetry::http::HttpLimits {
            max_connections: self.http_max_connections,
            max_per_address: self.http_max_per_address,
            header_timeout: secs("http-header-timeout", self.http_header_timeout)?,
            request_timeout: secs("http-request-timeout", self.http_request_timeout)?,
            write_timeout: secs("http-write-timeout", self.http_write_timeout)?,
            ..Default::default()
        })
    }
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Delta(cmd) => delta(cmd),
        Command::Serve {
            cluster,
            store,
            listen,
            init,
            init_version,
            model_id,
            stripes,
            store_and_forward,
            http,
            publish_dirs,
            retain,
            anchor_every,
            keep_anchors,
            segment_kib,
            peer_links,
            no_link_ceiling,
            codecs,
            ledger,
            lease_initial,
            lease_floor,
            lease_margin,
            claim_timeout,
            actor_heartbeat_rate,
            actor_submit_rate,
            actor_connections,
            subscriber_connections,
            actor_timeout,
            uniform_split,
            full_broadcast,
            tensor_hashes,
            results,
            http_limits,
        } => {
            let ResultsArgs {
                reward_services,
                reward_timeout,
                retain_age,
                retain_batches,
                results_archive,
            } = *results;
            let secs = |name: &str, v: f64| {
                if v.is_finite() && v > 0.0 && v < 1e7 {
                    Ok(std::time::Duration::from_secs_f64(v))
                } else {
                    Err(anyhow::anyhow!(
                        "--{name} must be a positive number of seconds"
                    ))
                }
            };
            let mut ledger_config = starling_ledger::LedgerConfig::default();
            ledger_config.lease.initial = secs("lease-initial", lease_initial)?;
            ledger_config.lease.floor = secs("lease-floor", lease_floor)?;
            ledger_config.lease.ceiling =
                ledger_config.lease.ceiling.max(ledger_config.lease.floor);
            if !(lease_margin.is_finite() && lease_margin >= 1.0) {
                anyhow::bail!("--lease-margin must be a number of at least 1, not {lease_margin}");
            }
            ledger_config.lease.margin = lease_margin;
            ledger_config.claim_timeout = secs("claim-timeout", claim_timeout)?;
            ledger_config.actor_timeout = secs("actor-timeout", actor_timeout)?;
            let rate = |name: &str, v: f64| {
                if v.is_finite() && v > 0.0 {
                    Ok(v)
                } else {
                    Err(anyhow::anyhow!(
                        "--{name} must be a positive number per second"
                    ))
                }
            };
            if actor_connections == 0 {
                anyhow::bail!("--actor-connections must be at least 1");
            }
            if subscriber_connections == 0 {
                anyhow::bail!("--subscriber-connections must be at least 1");
            }
            let worker_limits = crate::limits::WorkerLimits {
                heartbeats_per_s: rate("actor-heartbeat-rate", actor_heartbeat_rate)?,
                submits_per_s: rate("actor-submit-rate", actor_submit_rate)?,
                connections: actor_connections,
            };
            if uniform_split {
                ledger_config.split = starling_ledger::schedule::Split::Uniform;
            }
            // Results are stored as JSON (about 3× their wire size): room for a group at the
            // job protocol's 16 MiB limit; a larger one is refused as result_too_large.
            ledger_config.max_result_bytes = 128 << 20;
            let services = reward_services
                .iter()
                .map(|s| crate::reward_service::RewardService::parse(s))
                .collect::<Result<Vec<_>, String>>()
                .map_err(anyhow::Error::msg)?;
            let reward_services = crate::reward_service::RewardServices::new(
                services,
                secs("reward-timeout", reward_timeout)?,
            )
            .map_err(anyhow::Error::msg)?;
            let retention = starling_ledger::Retention {
                age: retain_age.map(|a| secs("retain-age", a)).transpose()?,
                keep: retain_batches,
            };
            let results_archive = results_archive.unwrap_or_else(|| store.join("results"));
            let ledger =
                ledger.unwrap_or_else(|| format!("sqlite:{}", store.join("ledger.db").display()));
            let version = match (init_version, &init) {
                (Some(v), _) => v,
                (None, Some(init)) => Checkpoint::open(init)
                    .with_context(|| format!("open {}", init.display()))?
                    .version()
                    .unwrap_or(0),
                (None, None) => 0,
            };
            let cfg = crate::serve::ServeConfig {
                cluster,
                store,
                listen,
                init,
                init_version: version,
                model_id,
                link: LinkProfile::LAN,
                stripes,
                cut_through: !store_and_forward,
                http,
                retain,
                anchor_every,
                keep_anchors,
                segment_bytes: segment_kib.max(1) << 10,
                full_broadcast,
                tensor_hashes,
                peer_links: peer_links.into_iter().collect(),
                link_ceiling: !no_link_ceiling,
                codecs,
                ledger,
                ledger_config,
                schedule_tick: std::time::Duration::from_millis(100),
                worker_limits,
                subscriber_connections,
                reward_services,
                retention,
                results_archive,
                http_limits: http_limits.limits()?,
                publish_dirs: crate::ingest::PublishDirs::new(&publish_dirs)?,
            };
            runtime()?.block_on(crate::serve::serve(
                cfg,
                starling_process::signal::shutdown_signal(),
            ))
        }
        Command::Publish {
            path,
            hub,
            credentials,
            cluster,
            model_id,
            handover,
        } => {
            let creds = match &credentials {
                Some(dir) => Credentials::load_peer(dir)
                    .with_context(|| format!("load trainer credentials from {}", dir.display()))?,
                None => Credentials::load_hub(&cluster).context("load hub credentials")?,
            };
            let (version, changes, bytes) = runtime()?.block_on(crate::serve::publish_remote(
                &creds, hub, &model_id, &path, handover,
            ))?;
            let how = match (handover, path.exists()) {
                (false, _) => "",
                (true, false) => " (handed over)",
                (true, true) => " (copied: the hub could not take the file)",
            };
            println!(
                "published {} as version {version}: {changes} changes, {bytes} bytes{how}",
                path.display()
            );
            Ok(())
        }
        Command::Init { dir, name } => {
            let mut seed = [0u8; 32];
            getrandom::fill(&mut seed).map_err(|e| anyhow::anyhow!("read OS randomness: {e}"))?;
            starling_transport::identity::init_cluster(&dir, &name, seed)
                .with_context(|| format!("create cluster in {}", dir.display()))?;
            println!(
                "created cluster {name} in {}: ca.pem, hub.pem/.key, signing.key/.pub",
                dir.display()
            );
            println!(
                "next: starling-hub issue --dir {} --role relay|actor|trainer --name NAME -o DIR",
                dir.display()
            );
            Ok(())
        }
        Command::Issue {
            dir,
            role,
            name,
            out,
        } => {
            let role = starling_transport::identity::Role::parse(&role)?;
            starling_transport::identity::issue(&dir, role, &name, &out)
                .with_context(|| format!("issue {} credentials for {name}", role.as_str()))?;
            println!(
                "issued {} credentials for {name} into {}",
                role.as_str(),
                out.display()
            );
            Ok(())
        }
        Command::Keygen { out } => {
            let public = keys::generate(&out)?;
            println!(
                "wrote {} and {}",
                out.display(),
                out.with_extension("pub").display()
            );
            println!("public key: {}", hex(public.as_bytes()));
            Ok(())
        }
        Command::Bench(BenchCmd::Gen {
            model,
            steps,
            lr,
            seed,
            out,
        }) => {
            let spec = ModelSpec::preset(&model).with_context(|| {
                format!(
                    "unknown model preset {model}; known: {:?}",
                    ModelSpec::PRESETS
                )
            })?;
            generate(&spec, steps, lr, seed, &out)?;
            Ok(())
        }
        Command::Demo { dir, model, steps } => crate::cli::demo(&dir, &model, steps),
    }
}

/// Parses `args` (the first is the program name) and runs the command; errors are printed
/// with their causes. The `starling-hub` binary calls it, and so does `starling hub …`.
pub fn main_from<I, T>(args: I) -> std::process::ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = Cli::parse_from(args);
    if let Err(e) = starling_process::logging::init(&cli.log) {
        eprintln!("error: {}", starling_process::error_chain(&e));
        return std::process::ExitCode::from(2);
    }
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            starling_process::logging::fatal(&format_args!("{e:#}"));
            std::process::ExitCode::FAILURE
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:>10} [{bar:30}] {percent:>3}% {elapsed_precise} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb
}

fn generate(spec: &ModelSpec, steps: u32, lr: f32, seed: u64, out: &Path) -> Result<Vec<PathBuf>> {
    let cfg = TrainConfig {
        seed,
        lr,
        ..TrainConfig::default()
    };
    let pb = bar(spec.numel(), "generate");
    let paths = generate_to_dir(spec, steps, &cfg, out, &|d| pb.set_position(d))
        .with_context(|| format!("generate checkpoints into {}", out.display()))?;
    pb.finish_and_clear();
    // The model's HF-style config, so engines (built-in, vLLM) load the same files.
    if let Some(config) = spec.qwen3_config_json() {
        let path = out.join("config.json");
        let mut f =
            AtomicFile::create(&path).with_context(|| format!("create {}", path.display()))?;
        f.write_all(serde_json::to_string_pretty(&config)?.as_bytes())?;
        f.commit()
            .with_context(|| format!("write {}", path.display()))?;
    }
    tracing::info!(
        "wrote {} checkpoints of model {} ({:.1} M parameters, {:.1} MB each) to {}",
        paths.len(),
        spec.name,
        spec.numel() as f64 / 1e6,
        spec.numel() as f64 * 2.0 / 1e6,
        out.display()
    );
    Ok(paths)
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

fn delta(cmd: DeltaCmd) -> Result<()> {
    match cmd {
        DeltaCmd::Diff {
            old,
            new,
            out,
            model_id,
            base_version,
            version,
            signing_key,
            no_tensor_hashes,
            output,
        } => {
            let o = Checkpoint::open(&old).with_context(|| format!("open {}", old.display()))?;
            let n = Checkpoint::open(&new).with_context(|| format!("open {}", new.display()))?;
            let base = base_version.or(o.version()).unwrap_or(0);
            let ver = version.or(n.version()).unwrap_or(base + 1);
            let mut opts = DiffOptions::new(&model_id, base, ver, now_ms());
            opts.tensor_hashes = !no_tensor_hashes;
            if let Some(k) = &signing_key {
                opts.signing_key = Some(keys::load_signing(k)?);
            }
            let pb = bar(o.numel(), "diff");
            let t = Instant::now();
            let s = diff_to_file(&o, &n, &out, &opts, &|d| pb.set_position(d))
                .context("diff checkpoints")?;
            pb.finish_and_clear();
            let secs = t.elapsed().as_secs_f64();
            let m = &s.manifest;
            if output.json {
                println!(
                    "{}",
                    json!({"delta": out, "model_id": m.model_id, "base_version": m.base_version, "version": m.version,
                        "elements": m.total_elements(), "changes": m.total_changes(), "delta_bytes": s.delta_bytes,
                        "dense_bf16_bytes": s.dense_bf16_bytes, "segments": m.segments.len(), "signed": s.signed,
                        "pre_digest": m.pre_digest.to_string(), "post_digest": m.post_digest.to_string(), "seconds": secs})
                );
            } else {
                println!(
                    "{} → {}: {} of {} elements changed ({:.3}%), delta {:.3} MB vs {:.1} MB dense BF16 ({:.0}× smaller), {} segments, {}, {:.2} s",
                    m.base_version,
                    m.version,
                    m.total_changes(),
                    m.total_elements(),
                    100.0 * m.total_changes() as f64 / m.total_elements().max(1) as f64,
                    mb(s.delta_bytes),
                    mb(s.dense_bf16_bytes),
                    s.dense_bf16_bytes as f64 / s.delta_bytes.max(1) as f64,
                    m.segments.len(),
                    if s.signed { "signed" } else { "unsigned" },
                    secs
                );
            }
            Ok(())
        }
        DeltaCmd::Apply {
            base,
            delta,
            out,
            trust,
            output,
        } => {
            let b = Checkpoint::open(&base).with_context(|| format!("open {}", base.display()))?;
            let s = apply_to_file(&b, &delta, &out, &trust.policy()?, trust.base_version)
                .with_context(|| format!("apply {} to {}", delta.display(), base.display()))?;
            if output.json {
                println!(
                    "{}",
                    json!({"out": out, "version": s.manifest.version, "changes": s.changes, "digest": s.post_digest.to_string(), "tensor_hashes_checked": s.tensors_hash_checked})
                );
            } else {
                println!(
                    "applied {} changes: version {} → {}, state digest {} verified, {} tensor BLAKE3 checked; wrote {}",
                    s.changes,
                    s.manifest.base_version,
                    s.manifest.version,
                    s.post_digest,
                    s.tensors_hash_checked,
                    out.display()
                );
            }
            Ok(())
        }
        DeltaCmd::Verify {
            base,
            delta,
            trust,
            output,
        } => {
            let b = Checkpoint::open(&base).with_context(|| format!("open {}", base.display()))?;
            let (_, s) = apply_in_memory(&b, &delta, &trust.policy()?, trust.base_version)
                .with_context(|| {
                    format!("verify {} against {}", delta.display(), base.display())
                })?;
            if output.json {
                println!(
                    "{}",
                    json!({"ok": true, "version": s.manifest.version, "changes": s.changes, "digest": s.post_digest.to_string(), "tensor_hashes_checked": s.tensors_hash_checked})
                );
            } else {
                println!(
                    "OK: {} turns version {} into version {} ({} changes); state digest {} and {} tensor BLAKE3 match",
                    delta.display(),
                    s.manifest.base_version,
                    s.manifest.version,
                    s.changes,
                    s.post_digest,
                    s.tensors_hash_checked
                );
            }
            Ok(())
        }
        DeltaCmd::Inspect { delta, all, output } => inspect(&delta, all, output.json),
    }
}

#[derive(Default, Clone)]
struct TensorStats {
    bytes: u64,
    codecs: std::collections::BTreeMap<String, u64>,
}

fn inspect(path: &Path, all: bool, json_out: bool) -> Result<()> {
    let (signed, frames) =
        read_manifest(path).with_context(|| format!("read {}", path.display()))?;
    let m = &signed.manifest;
    let file_bytes = std::fs::metadata(path).map(|x| x.len()).unwrap_or(0);
    let mut stats: std::collections::BTreeMap<String, TensorStats> =
        std::collections::BTreeMap::new();
    for f in &frames {
        let seg =
            Segment::decode_body(&f.body).with_context(|| format!("read {}", path.display()))?;
        for p in &seg.parts {
            let e = stats.entry(p.tensor.clone()).or_default();
            e.bytes += p.payload_len() as u64;
            let (i, v) = p.codec_names();
            let name = if v.is_empty() {
                i.to_owned()
            } else {
                format!("{i} / {v}")
            };
            *e.codecs.entry(name).or_default() += 1;
        }
    }
    let dense = 2 * m.total_elements();
    if json_out {
        let tensors: Vec<_> = m
            .tensors
            .iter()
            .map(|t| {
                let s = stats.get(&t.name).cloned().unwrap_or_default();
                json!({"name": t.name, "shape": t.shape, "elements": t.numel(), "changes": t.changes,
                    "density": t.changes as f64 / t.numel().max(1) as f64, "payload_bytes": s.bytes,
                    "dense_bf16_bytes": 2 * t.numel(), "codecs": s.codecs, "segments": t.segments,
                    "blake3": t.post_blake3.map(|h| hex(&h))})
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model_id": m.model_id, "base_version": m.base_version, "version": m.version,
                "created_unix_ms": m.created_unix_ms, "signed": signed.is_signed(),
                "pre_digest": m.pre_digest.to_string(), "post_digest": m.post_digest.to_string(),
                "file_bytes": file_bytes, "dense_bf16_bytes": dense, "elements": m.total_elements(),
                "changes": m.total_changes(), "segments": m.segments.len(), "tensors": tensors,
            }))?
        );
        return Ok(());
    }
    println!(
        "delta {}: model {}, version {} → {}, {}",
        path.display(),
        m.model_id,
        m.base_version,
        m.version,
        if signed.is_signed() {
            "signed"
        } else {
            "UNSIGNED"
        }
    );
    println!(
        "  {} of {} elements changed ({:.3}%), {:.3} MB on disk vs {:.1} MB dense BF16: {:.0}× smaller, {:.2} bytes per change",
        m.total_changes(),
        m.total_elements(),
        100.0 * m.total_changes() as f64 / m.total_elements().max(1) as f64,
        mb(file_bytes),
        mb(dense),
        dense as f64 / file_bytes.max(1) as f64,
        file_bytes as f64 / m.total_changes().max(1) as f64
    );
    println!(
        "  {} segments, {} tensors ({} unchanged); digest {} → {}",
        m.segments.len(),
        m.tensors.len(),
        m.tensors.iter().filter(|t| t.changes == 0).count(),
        m.pre_digest,
        m.post_digest
    );
    let mut rows: Vec<_> = m.tensors.iter().collect();
    if !all {
        rows.sort_by_key(|t| std::cmp::Reverse(stats.get(&t.name).map_or(0, |s| s.bytes)));
        rows.truncate(12);
        println!("  largest tensors (--all for every tensor):");
    }
    println!(
        "  {:<48} {:>12} {:>10} {:>9} {:>10} {:>7}  codecs",
        "tensor", "elements", "changes", "density", "bytes", "B/chg"
    );
    for t in rows {
        let s = stats.get(&t.name).cloned().unwrap_or_default();
        let codecs: Vec<String> = s.codecs.iter().map(|(c, n)| format!("{c} ×{n}")).collect();
        println!(
            "  {:<48} {:>12} {:>10} {:>8.3}% {:>10} {:>7.2}  {}",
            t.name,
            t.numel(),
            t.changes,
            100.0 * t.changes as f64 / t.numel().max(1) as f64,
            s.bytes,
            s.bytes as f64 / t.changes.max(1) as f64,
            codecs.join(", ")
        );
    }
    Ok(())
}

/// The small-scale demo: the main job, end to end, on one machine.
pub fn demo(dir: &Path, model: &str, steps: u32) -> Result<()> {
    if steps == 0 {
        bail!("--steps must be at least 1");
    }
    let spec = ModelSpec::preset(model).with_context(|| format!("unknown model preset {model}"))?;
    println!(
        "== Starling demo: {steps} RL steps of a {:.1} M-parameter Qwen-style model (lr 3e-6)\n",
        spec.numel() as f64 / 1e6
    );
    let ckpt = dir.join("checkpoints");
    generate(&spec, steps, 3e-6, 42, &ckpt)?;
    let key_path = dir.join("hub.key");
    if !key_path.exists() {
        keys::generate(&key_path)?;
    }
    let signing = keys::load_signing(&key_path)?;
    let trust = TrustPolicy::Keys(vec![signing.verifying_key()]);
    println!(
        "{:>6} {:>10} {:>9} {:>12} {:>12} {:>9} {:>10} {:>10}",
        "step", "changes", "density", "delta bytes", "dense bytes", "ratio", "diff ms", "apply ms"
    );
    let mut total_delta = 0u64;
    let mut total_dense = 0u64;
    let mut current = step_file(&ckpt, 0);
    for s in 1..=steps {
        let old = Checkpoint::open(&current)?;
        let new_path = step_file(&ckpt, s);
        let new = Checkpoint::open(&new_path)?;
        let delta_path = dir.join(format!("delta-{:04}-{:04}.sdc", s - 1, s));
        let mut opts = DiffOptions::new(&spec.name, u64::from(s - 1), u64::from(s), now_ms());
        opts.signing_key = Some(signing.clone());
        let t = Instant::now();
        let d = diff_to_file(&old, &new, &delta_path, &opts, &|_| {})?;
        let diff_ms = t.elapsed().as_secs_f64() * 1e3;
        // Apply the delta to the *reconstructed* previous checkpoint: a chain, as an actor runs it.
        let rebuilt = dir.join(format!("rebuilt-{s:04}.safetensors"));
        let t = Instant::now();
        apply_to_file(&old, &delta_path, &rebuilt, &trust, None)?;
        let apply_ms = t.elapsed().as_secs_f64() * 1e3;
        // Bit-exactness: the rebuilt checkpoint's tensors equal the trainer's, byte for byte.
        let a = Checkpoint::open(&rebuilt)?.read_all()?;
        let b = new.read_all()?;
        if a != b {
            bail!("step {s}: the rebuilt checkpoint differs from the trainer's");
        }
        let m = &d.manifest;
        total_delta += d.delta_bytes;
        total_dense += d.dense_bf16_bytes;
        println!(
            "{:>6} {:>10} {:>8.3}% {:>12} {:>12} {:>8.0}× {:>10.1} {:>10.1}",
            s,
            m.total_changes(),
            100.0 * m.total_changes() as f64 / m.total_elements() as f64,
            d.delta_bytes,
            d.dense_bf16_bytes,
            d.dense_bf16_bytes as f64 / d.delta_bytes as f64,
            diff_ms,
            apply_ms
        );
        current = rebuilt;
    }
    println!(
        "\nall {steps} rebuilt checkpoints are bit-identical to the trainer's; {:.2} MB of deltas instead of {:.1} MB of full checkpoints ({:.0}× less to ship)",
        mb(total_delta),
        mb(total_dense),
        total_dense as f64 / total_delta as f64
    );
    let last = dir.join(format!("delta-{:04}-{:04}.sdc", steps - 1, steps));
    println!("\n== starling-hub delta inspect {}\n", last.display());
    inspect(&last, false, false)?;
    println!(
        "\nTry: starling-hub delta verify {} {} --trust {}",
        step_file(&ckpt, steps - 1).display(),
        last.display(),
        key_path.with_extension("pub").display()
    );
    Ok(())
}

/// `NAME=RATE_MBIT:RTT_MS`, for `--peer-link`.
fn parse_peer_link(s: &str) -> Result<(String, LinkProfile), String> {
    let (name, profile) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAME=RATE_MBIT:RTT_MS"))?;
    if name.is_empty() {
        return Err(format!("{s:?}: empty peer name"));
    }
    Ok((
        name.to_owned(),
        profile.parse().map_err(|e| format!("{e}"))?,
    ))
}
