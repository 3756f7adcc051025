//! One run's cluster on this machine: a hub, and per region an emulated WAN link, a relay and
//! the region's actors, each a child process; brought up in one mode of weight delivery,
//! watched until every actor holds version 0 and can take work, and stopped with the links'
//! statistics. Both trainers of `starling demo` run against it: the built-in one (`demo.rs`)
//! and an external one such as the SDK's PyTorch GRPO trainer (`real.rs`).

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use starling_netem::{ProxyHandle, ProxyStats};
use starling_trainer::HubClient;

use crate::links::{ActorSpec, Region};
use crate::procs::{Proc, run_once};
use crate::watch::Watcher;

/// How weights reach the actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Mode {
    /// Deltas through the relays (Starling).
    Delta,
    /// Every version from a shared directory: no bytes on any link.
    NoTransfer,
    /// Full BF16 checkpoints through the relays.
    FullBroadcast,
}

impl Mode {
    pub(crate) const ALL: [Mode; 3] = [Mode::Delta, Mode::NoTransfer, Mode::FullBroadcast];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Delta => "delta",
            Mode::NoTransfer => "no-transfer",
            Mode::FullBroadcast => "full-broadcast",
        }
    }
}

/// What to start.
#[derive(Debug)]
pub(crate) struct Spec<'a> {
    pub(crate) mode: Mode,
    pub(crate) regions: &'a [Region],
    /// The run's version 0: a safetensors file with `config.json` beside it, or a model
    /// directory.
    pub(crate) init: &'a Path,
    /// Extra arguments of `starling hub serve`.
    pub(crate) hub_args: Vec<String>,
    /// The hub's HTTP port (0: any free port).
    pub(crate) http_port: u16,
    /// Seeds the links' loss.
    pub(crate) seed: u64,
    /// Every built-in engine runs this many times slower again, on top of `3 / speed`.
    pub(crate) engine_slowdown: f64,
    /// The running vLLM server a vLLM actor attaches to (`vllm_server.rs`).
    pub(crate) vllm: Option<SocketAddr>,
}

/// A running cluster; dropping it stops every process (use [`Cluster::stop`] for the links'
/// statistics).
#[derive(Debug)]
pub(crate) struct Cluster {
    pub(crate) out: PathBuf,
    pub(crate) http: SocketAddr,
    /// The trainer's credentials directory and its token.
    pub(crate) trainer_credentials: PathBuf,
    pub(crate) token: String,
    /// In no-transfer mode: where each version's full checkpoint must appear
    /// (`actor::shared_dir`).
    pub(crate) shared: PathBuf,
    /// Actor names per region.
    pub(crate) region_actors: BTreeMap<&'static str, Vec<String>>,
    pub(crate) watcher: Watcher,
    hub: Proc,
    procs: Vec<Proc>,
    links: Vec<(&'static str, ProxyHandle)>,
}

impl Cluster {
    /// Creates the cluster's identity in `out/cluster` and starts the hub, the links, the
    /// relays and the actors; logs go to `out/logs`.
    pub(crate) fn start(spec: &Spec<'_>, out: &Path) -> Result<Self> {
        std::fs::create_dir_all(out.join("logs"))
            .with_context(|| format!("create {}", out.join("logs").display()))?;
        let cluster = make_cluster(out, spec.regions)?;
        let quic = free_udp_port()?;
        let http = if spec.http_port == 0 {
            free_tcp_port()?
        } else {
            let addr: SocketAddr = ([127, 0, 0, 1], spec.http_port).into();
            TcpListener::bind(addr).with_context(|| {
                format!(
                    "port {} is in use: pass --http-port with a free port, or 0",
                    spec.http_port
                )
            })?;
            addr
        };
        // The trainer (in process or the SDK's) writes its checkpoints there, and the hub
        // publishes only paths under a --publish-dir.
        let checkpoints = out.join("checkpoints");
        std::fs::create_dir_all(&checkpoints)
            .with_context(|| format!("create {}", checkpoints.display()))?;
        let mut hub_args: Vec<String> = vec!["serve".into()];
        if spec.mode == Mode::FullBroadcast {
            hub_args.push("--full-broadcast".into());
        }
        hub_args.extend(spec.hub_args.iter().cloned());
        hub_args.extend([
            "--cluster".into(),
            path(&cluster),
            "--init".into(),
            path(spec.init),
            "--store".into(),
            path(&out.join("hub-store")),
            "--publish-dir".into(),
            path(&checkpoints),
            "--listen".into(),
            quic.to_string(),
            "--http".into(),
            http.to_string(),
        ]);
        let mut hub = Proc::start("hub", "hub", &hub_args, &out.join("logs/hub.log"))?;
        let trainer_credentials = cluster.join("trainer");
        let token = std::fs::read_to_string(trainer_credentials.join("token"))
            .context("read the trainer's token")?
            .trim()
            .to_owned();
        wait_for_hub(&HubClient::new(http.to_string(), token.clone()), &mut hub)?;
        println!(
            "   hub: QUIC {quic}, HTTP http://{http} (logs in {})",
            out.join("logs").display()
        );
        println!("   dashboard: http://{http}/ (status: http://{http}/v1/status)");

        let shared = out.join("shared-weights");
        if spec.mode == Mode::NoTransfer {
            std::fs::create_dir_all(&shared)
                .with_context(|| format!("create {}", shared.display()))?;
        }
        let vllm_actors = spec
            .regions
            .iter()
            .flat_map(|r| &r.actors)
            .filter(|a| a.vllm)
            .count();
        if vllm_actors > 1 {
            bail!(
                "{vllm_actors} vLLM actors, but one vLLM server: two actors would patch each other's weights"
            );
        }
        let mut links = Vec::new();
        let mut procs = Vec::new();
        let mut actor_http = Vec::new();
        let mut region_actors: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
        for (i, r) in spec.regions.iter().enumerate() {
            let link = r.start_link(quic, spec.seed * 100 + i as u64 * 2)?;
            let wan = link.local_addr();
            links.push((r.name, link));
            let relay_addr = free_udp_port()?;
            if spec.mode != Mode::NoTransfer {
                procs.push(Proc::start(
                    &format!("relay {}", r.name),
                    "relay",
                    &[
                        "--credentials".into(),
                        path(&cluster.join(format!("relay-{}", r.name))),
                        "--hub".into(),
                        wan.to_string(),
                        "--listen".into(),
                        relay_addr.to_string(),
                        "--region".into(),
                        r.name.into(),
                        "--wan-mbit".into(),
                        r.rate_mbit.to_string(),
                        "--wan-rtt-ms".into(),
                        r.rtt_ms.to_string(),
                        "--cache".into(),
                        path(&out.join(format!("regions/{}/relay-cache", r.name))),
                    ],
                    &out.join(format!("logs/relay-{}.log", r.name)),
                )?);
            }
            for a in &r.actors {
                let metrics = free_tcp_port()?;
                actor_http.push((a.name.to_string(), metrics));
                region_actors
                    .entry(r.name)
                    .or_default()
                    .push(a.name.to_string());
                let mut args: Vec<String> = if spec.mode == Mode::NoTransfer {
                    vec!["--weights-dir".into(), path(&shared)]
                } else {
                    vec!["--relay".into(), format!("{}@{relay_addr}", r.name)]
                };
                let store = out.join(format!("regions/{}/{}", r.name, a.name));
                args.extend([
                    "--credentials".into(),
                    path(&cluster.join(a.name)),
                    "--hub".into(),
                    wan.to_string(),
                    "--init".into(),
                    path(spec.init),
                    "--store".into(),
                    path(&store),
                    "--region".into(),
                    r.name.into(),
                    "--http".into(),
                    metrics.to_string(),
                ]);
                args.extend(engine_args(spec, a)?);
                procs.push(Proc::start(
                    a.name,
                    "actor",
                    &args,
                    &out.join(format!("logs/{}.log", a.name)),
                )?);
            }
            println!(
                "   region {}: link {} Mbit/s, RTT {} ms, loss {}%; actors {}{}",
                r.name,
                r.rate_mbit,
                r.rtt_ms,
                r.loss * 100.0,
                r.actors
                    .iter()
                    .map(|a| if a.vllm {
                        format!("{} (vLLM)", a.name)
                    } else {
                        format!("{} (speed {})", a.name, a.speed)
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                if spec.mode == Mode::NoTransfer {
                    "; weights from the shared directory, no relay"
                } else {
                    ""
                }
            );
        }
        Ok(Self {
            out: out.to_owned(),
            http,
            trainer_credentials,
            token,
            shared,
            region_actors,
            watcher: Watcher::start(actor_http, Duration::from_millis(20)),
            hub,
            procs,
            links,
        })
    }

    /// Every actor's name.
    pub(crate) fn actors(&self) -> Vec<String> {
        self.region_actors.values().flatten().cloned().collect()
    }

    /// Waits until every actor holds version 0 and its rollout worker is registered with the
    /// hub, so that no actor misses the first batch.
    pub(crate) fn wait_ready(&mut self, within: Duration) -> Result<()> {
        let all = self.actors();
        let deadline = Instant::now() + within;
        while self.watcher.all_reached(&all).is_none() || !self.watcher.workers_connected(&all) {
            self.check_alive()?;
            if Instant::now() > deadline {
                bail!(
                    "the actors did not all load version 0 and register with the hub within {} s; see the logs in {}",
                    within.as_secs(),
                    self.out.join("logs").display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Fails, with the end of its log, if any process of the cluster has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        self.hub.check_alive()?;
        for p in &mut self.procs {
            p.check_alive()?;
        }
        Ok(())
    }

    /// Seconds from `published` (when the version's publish call started) to the last actor
    /// of each region holding `version` (`None` where not every actor has it yet).
    pub(crate) fn region_arrival(
        &self,
        published: Instant,
        version: u64,
    ) -> BTreeMap<String, Option<f64>> {
        self.region_actors
            .iter()
            .map(|(name, actors)| {
                let last = actors
                    .iter()
                    .map(|a| self.watcher.reached(a, version))
                    .collect::<Option<Vec<Instant>>>()
                    .and_then(|v| v.into_iter().max());
                (
                    name.to_string(),
                    last.map(|t| t.saturating_duration_since(published).as_secs_f64()),
                )
            })
            .collect()
    }

    /// Waits (at most `within`) until every actor holds `version`.
    pub(crate) fn wait_all_reach(&self, version: u64, within: Duration) {
        let all = self.actors();
        let until = Instant::now() + within;
        while self.watcher.all_reached(&all).is_none_or(|v| v < version) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops every process, then the links; returns each link's statistics.
    pub(crate) fn stop(self) -> BTreeMap<&'static str, ProxyStats> {
        let Self {
            watcher,
            hub,
            procs,
            links,
            ..
        } = self;
        drop(watcher);
        crate::procs::stop_all(procs);
        drop(hub);
        let mut stats = BTreeMap::new();
        for (name, l) in links {
            match l.shutdown() {
                Ok(s) => {
                    stats.insert(name, s);
                }
                Err(e) => println!(
                    "   link {name}: no statistics ({:#})",
                    anyhow::Error::new(e)
                ),
            }
        }
        for (name, s) in &stats {
            println!(
                "   link {name}: {:.1} kB to the region, {:.1} kB to the hub, {} + {} datagrams lost",
                s.down.delivered_bytes as f64 / 1e3,
                s.up.delivered_bytes as f64 / 1e3,
                s.down.dropped_loss + s.down.dropped_queue,
                s.up.dropped_loss + s.up.dropped_queue
            );
        }
        stats
    }
}

/// The actor's engine arguments.
fn engine_args(spec: &Spec<'_>, a: &ActorSpec) -> Result<Vec<String>> {
    if !a.vllm {
        return Ok(vec![
            "--engine".into(),
            "builtin".into(),
            "--engine-slowdown".into(),
            format!("{}", spec.engine_slowdown * 3.0 / f64::from(a.speed)),
        ]);
    }
    let Some(addr) = spec.vllm else {
        bail!("actor {} runs vLLM, but no vLLM server was started", a.name);
    };
    // --vllm-url alone: the actor attaches to the demo's server (digest checked, version 0
    // loaded in full if the server holds another) and never starts or stops it.
    Ok(vec![
        "--engine".into(),
        "vllm".into(),
        "--vllm-url".into(),
        addr.to_string(),
    ])
}

fn make_cluster(out: &Path, regions: &[Region]) -> Result<PathBuf> {
    let dir = out.join("cluster");
    run_once("hub", &["init".into(), "--dir".into(), path(&dir)])?;
    let issue = |role: &str, name: &str, to: &str| {
        run_once(
            "hub",
            &[
                "issue".into(),
                "--dir".into(),
                path(&dir),
                "--role".into(),
                role.into(),
                "--name".into(),
                name.into(),
                "-o".into(),
                path(&dir.join(to)),
            ],
        )
    };
    issue("trainer", "trainer", "trainer")?;
    for r in regions {
        issue("relay", r.name, &format!("relay-{}", r.name))?;
        for a in &r.actors {
            issue("actor", a.name, a.name)?;
        }
    }
    Ok(dir)
}

fn wait_for_hub(client: &HubClient, hub: &mut Proc) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if client.versions().is_ok() {
            return Ok(());
        }
        hub.check_alive()?;
        if Instant::now() > deadline {
            bail!(
                "the hub did not answer on HTTP within 60 s; see {}",
                hub.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn free_udp_port() -> Result<SocketAddr> {
    let s = UdpSocket::bind("127.0.0.1:0").context("find a free UDP port")?;
    s.local_addr().context("find a free UDP port")
}

pub(crate) fn free_tcp_port() -> Result<SocketAddr> {
    let s = TcpListener::bind("127.0.0.1:0").context("find a free TCP port")?;
    s.local_addr().context("find a free TCP port")
}

pub(crate) fn path(p: &Path) -> String {
    p.display().to_string()
}

/// The mean of `xs`; NaN (written as null) when there are none.
pub(crate) fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

/// Per region, the mean seconds from publish to every actor active over the versions that
/// arrived (`arrivals`: version → region → seconds, `None` where one had not); NaN where none
/// did.
pub(crate) fn mean_arrival_by_region(
    regions: &[Region],
    arrivals: &BTreeMap<u64, BTreeMap<String, Option<f64>>>,
) -> BTreeMap<&'static str, f64> {
    regions
        .iter()
        .map(|r| {
            let seconds = arrivals
                .values()
                .filter_map(|m| m.get(r.name).copied().flatten());
            (r.name, mean(seconds))
        })
        .collect()
}
