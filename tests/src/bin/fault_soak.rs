//! Fault soak (issue 12): Starling's real hub, relays and actors in network namespaces, many
//! versions published while relays and actors are SIGKILLed and restarted at random, WAN
//! links drop for seconds at a time and the hub restarts twice (SIGTERM once, SIGKILL once,
//! each time with the very same command, resuming from its ledger).
//!
//! Why: the fault tests in `tests/tests/distribution.rs` try one fault at a time; this soak
//! shows the distribution stays correct and economical when faults overlap and repeat, and
//! that no process grows without bound over hundreds of versions.
//!
//! Topology: the hub in the root namespace (listening on every address); one namespace per
//! region (`fsoak-rN`) holding that region's relay and actors. A veth pair joins the root
//! namespace (`fsk-wN`, 10.213.N.1) to the region (`wan0`, 10.213.N.2), shaped with `tc tbf`
//! both ways (default 200 and 50 Mbit/s). Actors reach their relay on the region's loopback
//! and fall back to the hub over the WAN veth. A link drop is `ip link set wan0 down` in the
//! region's namespace for 1–5 s.
//!
//! What it asserts at the end:
//! - every actor reports the hub's final version with the digest computed from the trainer's
//!   bits, and its store (snapshot + journal replayed under the cluster's signing key) is
//!   bit-identical to the final checkpoint; every `active` line any actor printed during the
//!   soak carried the right digest for its version;
//! - WAN bytes per version per region (tx + rx of the hub-side veth, from
//!   `/sys/class/net/fsk-wN/statistics`) ≤ `--wan-ratio` × the version's delta frame bytes for
//!   every version during which that region's relay was up the whole time (ratios for every
//!   version are reported, split by what overlapped the version);
//! - for every process instance that lived at least a quarter of the soak, the VmRSS of the
//!   second, third and last quarter of its life (the median of its samples in each) does not
//!   grow by more than half `--rss-growth-mib` in both steps (a leak keeps growing; a one-time
//!   step does not), nor by more than four times it in all
//!   (the first quarter is warm-up: retained versions and allocator arenas fill).
//!
//! It tears down every process and namespace it started, on success and on failure (stale
//! ones from an aborted run are removed at start). Logs of every process instance stay under
//! `--out` (`NAME.INSTANCE.out` with seconds since start, `NAME.INSTANCE.err`).
//!
//! `cargo build --release --bins && sudo target/release/fault-soak --versions 200 --seed 1`

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use starling_checkpoint::deltafile::delta_file_name;
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};
use starling_proto::delta::apply::full_digest;
use starling_proto::delta::container::{FILE_HEADER_LEN, TRAILER_FRAME_LEN};
use starling_tests::{bin, http_get, le_bytes};

const NS_PREFIX: &str = "fsoak-";
const VETH_PREFIX: &str = "fsk-w";
const RELAY_PORT: u16 = 7444;

#[derive(Parser, Debug)]
#[command(about = "Fault soak: real processes in network namespaces under random faults")]
struct Args {
    /// Versions published after the initial one.
    #[arg(long, default_value_t = 200)]
    versions: u32,
    /// Seed of the fault schedule and of the generated model.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// WAN rate of each region in Mbit/s (one region per entry).
    #[arg(long, value_delimiter = ',', default_value = "200,50")]
    wan_mbit: Vec<u32>,
    /// Actors per region.
    #[arg(long, default_value_t = 2)]
    actors_per_region: usize,
    /// Probability, per version and relay, that the relay is SIGKILLed (restarted 1–6 s later).
    #[arg(long, default_value_t = 0.04)]
    relay_kill: f64,
    /// Probability, per version and actor, that the actor is SIGKILLed (restarted 0.5–4 s later).
    #[arg(long, default_value_t = 0.03)]
    actor_kill: f64,
    /// Probability, per version and region, that the WAN link goes down for 1–5 s.
    #[arg(long, default_value_t = 0.03)]
    link_drop: f64,
    /// Generator preset and learning rate (set the model and delta sizes).
    #[arg(long, default_value = "small")]
    model: String,
    #[arg(long, default_value_t = 1e-4)]
    lr: f32,
    /// Publish a version at most this often (a training step's pace; the actors' 2 s probe
    /// for their preferred source must fit between versions for "one version" to mean time).
    #[arg(long, default_value_t = 2500)]
    interval_ms: u64,
    /// Longest wait for the live actors to activate one version before moving on.
    #[arg(long, default_value_t = 60)]
    version_timeout_s: u64,
    /// Give up (failing) when publishing has not finished after this many seconds.
    #[arg(long, default_value_t = 1500)]
    max_duration_s: u64,
    /// Bound on WAN bytes ÷ delta bytes for versions with the region's relay up throughout.
    #[arg(long, default_value_t = 1.1)]
    wan_ratio: f64,
    /// Bound on RSS growth (last-quarter median − second-quarter median) per long-lived process.
    #[arg(long, default_value_t = 16)]
    rss_growth_mib: u64,
    /// Versions the hub and relays keep for laggards (`--retain`): small, so these bounded
    /// caches fill within the first quarter of a process's life and the RSS comparison after
    /// it sees growth that is not theirs (8 versions ≈ 27 s, longer than any relay outage).
    #[arg(long, default_value_t = 8)]
    retain: usize,
    /// Run directory (checkpoints, stores, logs); default /var/tmp/starling-fault-soak/seed-N.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The fault schedule's generator: SplitMix64 (its one home is `starling-rng`, re-exported by
/// `starling-netem`).
struct Rng(starling_netem::rng::SplitMix64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0.next_f64()
    }
    fn secs(&mut self, lo: f64, hi: f64) -> Duration {
        Duration::from_secs_f64(lo + (hi - lo) * self.unit())
    }
}

/// A line of a process's stdout: which service, which incarnation of it.
struct Ev {
    who: String,
    inst: u32,
    line: String,
}

/// One service (hub, relay, actor): its command and its current incarnation.
struct Svc {
    name: String,
    ns: Option<String>,
    exe: PathBuf,
    argv: Vec<OsString>,
    child: Option<Child>,
    inst: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    RelayKill,
    ActorKill,
    LinkDrop,
    HubTerm,
    HubKill,
    Unexpected,
}

/// Something the soak does later: bring a service back, or a link up.
enum Due {
    Restart(String),
    LinkUp(usize),
}

/// An interval during which a region's path was disturbed. A relay's lasts from its kill
/// until it is back in service: restarted, listening, and holding every version published
/// before its restart (its catch-up is the kill's cost, not the next version's).
#[derive(Clone, Copy, Debug)]
struct Outage {
    kind: Kind,
    region: Option<usize>,
    from: Instant,
    to: Option<Instant>,
    /// A killed relay: when it was started again, and the newest version published by then.
    restarted: Option<(Instant, u64)>,
}

struct Window {
    version: u64,
    from: Instant,
    to: Instant,
    delta: u64,
    wan: Vec<(u64, u64)>,
    converged: bool,
}

type RssLog = Arc<Mutex<BTreeMap<String, Vec<(f64, u64)>>>>;

struct Soak {
    args: Args,
    dir: PathBuf,
    logs: PathBuf,
    t0: Instant,
    steps: Vec<PathBuf>,
    svcs: Vec<Svc>,
    tx: mpsc::Sender<Ev>,
    rx: mpsc::Receiver<Ev>,
    rng: Rng,
    due: Vec<(Instant, Due)>,
    outages: Vec<Outage>,
    faults: Vec<(f64, u64, Kind, String)>,
    link_down: Vec<bool>,
    hub_addr: String,
    hub_http: String,
    hub_port: u16,
    ready: BTreeMap<String, bool>,
    active: BTreeMap<String, u64>,
    upstream: BTreeMap<String, String>,
    digests: BTreeMap<u64, String>,
    wrong_digests: Vec<String>,
    live: Arc<Mutex<Vec<(String, u32)>>>,
    rss: RssLog,
    stop_sampler: Arc<std::sync::atomic::AtomicBool>,
    windows: Vec<Window>,
    /// The newest version published so far.
    published: u64,
    /// Per region: the newest version its relay holds (`cached`, `restored anchor` lines of
    /// any instance: the cache survives a kill).
    relay_holds: BTreeMap<usize, u64>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        })
        .unwrap_or_default();
    if uid != "0" {
        bail!(
            "fault-soak must run as root: it creates network namespaces, veth pairs and tc \
             qdiscs, and takes links down (uid is {uid:?}); run it with sudo"
        );
    }
    for tool in ["ip", "tc"] {
        ensure!(
            Command::new(tool)
                .arg("-V")
                .output()
                .is_ok_and(|o| o.status.success()),
            "`{tool}` (iproute2) is needed"
        );
    }
    ensure!(
        !args.wan_mbit.is_empty() && args.wan_mbit.len() <= 8,
        "1 to 8 regions"
    );
    ensure!(args.versions >= 3, "at least 3 versions (two hub restarts)");
    let mut soak = Soak::new(args)?;
    let res = soak.run();
    let report = soak.report();
    match (res, report) {
        (Ok(()), Ok(())) => {
            println!("fault soak passed");
            Ok(())
        }
        (Err(e), _) | (Ok(()), Err(e)) => Err(e),
    }
}

fn sh(cmd: &mut Command) -> Result<()> {
    let o = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    ensure!(
        o.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&o.stderr).trim()
    );
    Ok(())
}

fn ns_name(r: usize) -> String {
    format!("{NS_PREFIX}r{r}")
}

fn veth_name(r: usize) -> String {
    format!("{VETH_PREFIX}{r}")
}

/// Removes namespaces and veths of this soak (an earlier aborted run's, or ours), killing by
/// PID the processes still inside a namespace first.
fn remove_stale() {
    let list = Command::new("ip").args(["netns", "list"]).output();
    if let Ok(o) = list {
        for ns in String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(NS_PREFIX))
        {
            if let Ok(p) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&p.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).output();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
    if let Ok(rd) = std::fs::read_dir("/sys/class/net") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(VETH_PREFIX) {
                let _ = Command::new("ip").args(["link", "del", &n]).output();
            }
        }
    }
}

fn counters(r: usize) -> (u64, u64) {
    let read = |what: &str| {
        std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{what}", veth_name(r)))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    (read("tx_bytes"), read("rx_bytes"))
}

fn vm_rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Soak {
    fn new(args: Args) -> Result<Self> {
        let dir = args.out.clone().unwrap_or_else(|| {
            PathBuf::from(format!("/var/tmp/starling-fault-soak/seed-{}", args.seed))
        });
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("clear {}", dir.display()))?;
        }
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("create {}", logs.display()))?;
        let (tx, rx) = mpsc::channel();
        let rng = Rng(starling_netem::rng::SplitMix64::new(
            args.seed ^ 0x5eed_fa17,
        ));
        let regions = args.wan_mbit.len();
        Ok(Self {
            args,
            dir,
            logs,
            t0: Instant::now(),
            steps: Vec::new(),
            svcs: Vec::new(),
            tx,
            rx,
            rng,
            due: Vec::new(),
            outages: Vec::new(),
            faults: Vec::new(),
            link_down: vec![false; regions],
            hub_addr: String::new(),
            hub_http: String::new(),
            hub_port: 0,
            ready: BTreeMap::new(),
            active: BTreeMap::new(),
            upstream: BTreeMap::new(),
            digests: BTreeMap::new(),
            wrong_digests: Vec::new(),
            live: Arc::new(Mutex::new(Vec::new())),
            rss: Arc::new(Mutex::new(BTreeMap::new())),
            stop_sampler: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            windows: Vec::new(),
            published: 0,
            relay_holds: BTreeMap::new(),
        })
    }

    fn now_s(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    fn regions(&self) -> usize {
        self.args.wan_mbit.len()
    }

    fn actor_names(&self, r: usize) -> Vec<String> {
        (0..self.args.actors_per_region)
            .map(|a| format!("r{r}a{a}"))
            .collect()
    }

    fn all_actors(&self) -> Vec<String> {
        (0..self.regions())
            .flat_map(|r| self.actor_names(r))
            .collect()
    }

    fn log(&self, what: &str) {
        println!("[{:8.2}s] {what}", self.now_s());
    }

    fn fault(&mut self, version: u64, kind: Kind, what: String) {
        self.log(&format!("fault v{version} {kind:?}: {what}"));
        self.faults.push((self.now_s(), version, kind, what));
    }

    fn setup_network(&self) -> Result<()> {
        remove_stale();
        for (r, &mbit) in self.args.wan_mbit.iter().enumerate() {
            let ns = ns_name(r);
            let veth = veth_name(r);
            sh(Command::new("ip").args(["netns", "add", &ns]))?;
            sh(Command::new("ip").args(["-n", &ns, "link", "set", "lo", "up"]))?;
            sh(Command::new("ip").args([
                "link", "add", &veth, "type", "veth", "peer", "name", "wan0", "netns", &ns,
            ]))?;
            sh(Command::new("ip").args([
                "addr",
                "add",
                &format!("10.213.{r}.1/30"),
                "dev",
                &veth,
            ]))?;
            sh(Command::new("ip").args([
                "-n",
                &ns,
                "addr",
                "add",
                &format!("10.213.{r}.2/30"),
                "dev",
                "wan0",
            ]))?;
            sh(Command::new("ip").args(["link", "set", &veth, "up"]))?;
            sh(Command::new("ip").args(["-n", &ns, "link", "set", "wan0", "up"]))?;
            // tbf needs a burst of at least rate/HZ (HZ=250) to reach its rate.
            let burst = (u64::from(mbit) * 1_000_000 / 8 / 250)
                .max(16_000)
                .to_string();
            let rate = format!("{mbit}mbit");
            let tbf = [
                "root", "tbf", "rate", &rate, "burst", &burst, "latency", "100ms",
            ];
            sh(Command::new("tc")
                .args(["qdisc", "add", "dev", &veth])
                .args(tbf))?;
            sh(Command::new("tc")
                .args(["-n", &ns, "qdisc", "add", "dev", "wan0"])
                .args(tbf))?;
        }
        Ok(())
    }

    fn set_link(&mut self, r: usize, up: bool) -> Result<()> {
        sh(Command::new("ip").args([
            "-n",
            &ns_name(r),
            "link",
            "set",
            "wan0",
            if up { "up" } else { "down" },
        ]))?;
        self.link_down[r] = !up;
        Ok(())
    }

    /// Registers a service; `start` runs it.
    fn add(&mut self, name: &str, ns: Option<String>, exe: PathBuf, argv: Vec<OsString>) {
        self.svcs.push(Svc {
            name: name.to_owned(),
            ns,
            exe,
            argv,
            child: None,
            inst: 0,
        });
    }

    fn svc(&mut self, name: &str) -> Result<&mut Svc> {
        self.svcs
            .iter_mut()
            .find(|s| s.name == name)
            .with_context(|| format!("no service {name}"))
    }

    fn is_up(&self, name: &str) -> bool {
        self.svcs
            .iter()
            .any(|s| s.name == name && s.child.is_some())
    }

    fn start(&mut self, name: &str) -> Result<()> {
        let logs = self.logs.clone();
        let tx = self.tx.clone();
        let t0 = self.t0;
        let live = self.live.clone();
        let s = self.svc(name)?;
        ensure!(s.child.is_none(), "{name} already runs");
        s.inst += 1;
        let mut cmd = match &s.ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&s.exe);
                c
            }
            None => Command::new(&s.exe),
        };
        cmd.args(&s.argv);
        let err = std::fs::File::create(logs.join(format!("{}.{}.err", s.name, s.inst)))?;
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn {name}"))?;
        let out = child.stdout.take().context("stdout")?;
        let mut file = std::fs::File::create(logs.join(format!("{}.{}.out", s.name, s.inst)))?;
        let (who, inst) = (s.name.clone(), s.inst);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = writeln!(file, "{:.3} {line}", t0.elapsed().as_secs_f64());
                if tx
                    .send(Ev {
                        who: who.clone(),
                        inst,
                        line,
                    })
                    .is_err()
                {
                    break;
                }
            }
        });
        let pid = child.id();
        let key = format!("{}#{}", s.name, s.inst);
        s.child = Some(child);
        if let Ok(mut l) = live.lock() {
            l.retain(|(k, _)| !k.starts_with(&format!("{name}#")));
            l.push((key, pid));
        }
        self.ready.insert(name.to_owned(), false);
        Ok(())
    }

    fn forget_live(&self, name: &str) {
        if let Ok(mut l) = self.live.lock() {
            l.retain(|(k, _)| !k.starts_with(&format!("{name}#")));
        }
    }

    /// SIGKILLs a service and reaps it.
    fn kill(&mut self, name: &str) -> Result<()> {
        self.forget_live(name);
        let s = self.svc(name)?;
        if let Some(mut c) = s.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        Ok(())
    }

    /// SIGTERMs a service and waits up to `grace` for it to exit (then SIGKILL); returns
    /// whether it exited within the grace period and how long it took.
    fn terminate(&mut self, name: &str, grace: Duration) -> Result<(bool, Duration)> {
        self.forget_live(name);
        let s = self.svc(name)?;
        let Some(mut c) = s.child.take() else {
            return Ok((true, Duration::ZERO));
        };
        let sent = Instant::now();
        sh(Command::new("kill").args(["-TERM", &c.id().to_string()]))?;
        loop {
            if c.try_wait()?.is_some() {
                return Ok((true, sent.elapsed()));
            }
            if sent.elapsed() > grace {
                let _ = c.kill();
                let _ = c.wait();
                return Ok((false, sent.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn expected_digest(&mut self, k: u64) -> Result<String> {
        if let Some(d) = self.digests.get(&k) {
            return Ok(d.clone());
        }
        let w = self.weights(k)?;
        let names: Vec<String> = w.keys().cloned().collect();
        let d = full_digest(&self.args.model, &w, &names).to_string();
        self.digests.insert(k, d.clone());
        Ok(d)
    }

    fn weights(&self, k: u64) -> Result<BTreeMap<String, Vec<u16>>> {
        let p = self
            .steps
            .get(usize::try_from(k)?)
            .with_context(|| format!("no checkpoint {k}"))?;
        Checkpoint::open(p)
            .with_context(|| format!("open {}", p.display()))?
            .read_all()
            .with_context(|| format!("read {}", p.display()))
    }

    fn handle(&mut self, ev: Ev) -> Result<()> {
        let current = self
            .svcs
            .iter()
            .any(|s| s.name == ev.who && s.inst == ev.inst && s.child.is_some());
        if !current {
            return Ok(());
        }
        if ev.who == "hub" {
            if let Some(a) = ev.line.strip_prefix("listening on ") {
                self.hub_port = a
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .with_context(|| format!("hub address {a:?}"))?;
                self.ready.insert(ev.who, true);
            } else if let Some(a) = ev.line.strip_prefix("http on ") {
                self.hub_http = a.to_owned();
            }
        } else if ev.line.starts_with("listening on ") {
            self.ready.insert(ev.who.clone(), true);
            self.relay_progress(&ev.who, None);
        } else if let Some(v) = ev
            .line
            .strip_prefix("cached ")
            .or_else(|| ev.line.strip_prefix("restored anchor "))
        {
            let v = v.trim().parse().ok();
            self.relay_progress(&ev.who, v);
        } else if let Some(rest) = ev.line.strip_prefix("active ") {
            let mut it = rest.split_whitespace();
            let v: u64 = it
                .next()
                .and_then(|v| v.parse().ok())
                .with_context(|| format!("{}: {:?}", ev.who, ev.line))?;
            let d = it.next().unwrap_or_default().to_owned();
            if d != self.expected_digest(v)? {
                let msg = format!("{} active {v} with digest {d}: wrong", ev.who);
                self.log(&msg);
                self.wrong_digests.push(msg);
            }
            self.active.insert(ev.who, v);
        } else if let Some(rest) = ev.line.strip_prefix("upstream ") {
            self.upstream.insert(ev.who, rest.to_owned());
        }
        Ok(())
    }

    /// A relay's progress line (`listening on`, `cached V`, `restored anchor V`): once a
    /// restarted relay listens and holds every version published before its restart, its
    /// outage ends.
    fn relay_progress(&mut self, who: &str, version: Option<u64>) {
        let Some(r) = who
            .strip_prefix("relay-r")
            .and_then(|r| r.parse::<usize>().ok())
        else {
            return;
        };
        if let Some(v) = version {
            let held = self.relay_holds.entry(r).or_default();
            *held = (*held).max(v);
        }
        let held = self.relay_holds.get(&r).copied().unwrap_or(0);
        let listening = self.ready.get(who) == Some(&true);
        let now = Instant::now();
        for o in &mut self.outages {
            if let (None, Some((_, target))) = (o.to, o.restarted)
                && o.kind == Kind::RelayKill
                && o.region == Some(r)
                && listening
                && held >= target
            {
                o.to = Some(now);
            }
        }
    }

    /// Fires what is due, reaps processes that died on their own (restarting them).
    fn fire_due(&mut self) -> Result<()> {
        let now = Instant::now();
        let mut i = 0;
        while i < self.due.len() {
            if self.due[i].0 <= now {
                let (_, d) = self.due.remove(i);
                match d {
                    Due::Restart(name) => {
                        self.log(&format!("restart {name}"));
                        self.start(&name)?;
                        let published = self.published;
                        for o in &mut self.outages {
                            if o.to.is_none()
                                && o.kind == Kind::RelayKill
                                && name == format!("relay-r{}", o.region.unwrap_or(usize::MAX))
                            {
                                o.restarted = Some((now, published));
                            }
                        }
                    }
                    Due::LinkUp(r) => {
                        self.log(&format!("link r{r} up"));
                        self.set_link(r, true)?;
                        for o in &mut self.outages {
                            if o.to.is_none() && o.kind == Kind::LinkDrop && o.region == Some(r) {
                                o.to = Some(now);
                            }
                        }
                    }
                }
            } else {
                i += 1;
            }
        }
        let mut died = Vec::new();
        for s in &mut self.svcs {
            if let Some(c) = &mut s.child
                && let Some(st) = c.try_wait()?
            {
                died.push((s.name.clone(), s.inst, st));
                s.child = None;
            }
        }
        for (name, inst, st) in died {
            self.forget_live(&name);
            let v = self.windows.len() as u64 + 1;
            self.fault(
                v,
                Kind::Unexpected,
                format!("{name} (instance {inst}) exited on its own: {st}; restarting it"),
            );
            self.due
                .push((Instant::now() + Duration::from_secs(1), Due::Restart(name)));
        }
        Ok(())
    }

    /// Processes events and due work until `cond` holds (true) or `deadline` passes (false).
    fn wait_until(&mut self, deadline: Instant, cond: impl Fn(&Self) -> bool) -> Result<bool> {
        loop {
            self.fire_due()?;
            if cond(self) {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let mut until = deadline.min(now + Duration::from_millis(200));
            if let Some(t) = self.due.iter().map(|(t, _)| *t).min() {
                until = until.min(t);
            }
            match self.rx.recv_timeout(until.saturating_duration_since(now)) {
                Ok(ev) => self.handle(ev)?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("event channel closed"),
            }
        }
    }

    fn start_and_wait(&mut self, name: &str) -> Result<()> {
        self.start(name)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let n = name.to_owned();
        ensure!(
            self.wait_until(deadline, |s| s.ready.get(&n) == Some(&true))?,
            "{name} did not say it listens within 60 s (see {})",
            self.logs.display()
        );
        Ok(())
    }

    fn hub_bin(&self) -> PathBuf {
        bin("starling-hub")
    }

    fn prepare(&mut self) -> Result<()> {
        self.log(&format!(
            "generating {} versions of the {} model in {}",
            self.args.versions,
            self.args.model,
            self.dir.display()
        ));
        let spec = ModelSpec::preset(&self.args.model)
            .with_context(|| format!("unknown preset {}", self.args.model))?;
        let cfg = TrainConfig {
            seed: self.args.seed,
            lr: self.args.lr,
            ..TrainConfig::default()
        };
        self.steps = generate_to_dir(
            &spec,
            self.args.versions,
            &cfg,
            &self.dir.join("ckpt"),
            &|_| {},
        )
        .context("generate checkpoints")?;
        let cluster = self.dir.join("cluster");
        let hub = self.hub_bin();
        sh(Command::new(&hub)
            .args(["init", "--name", "soak", "--dir"])
            .arg(&cluster))?;
        let mut peers = Vec::new();
        for r in 0..self.regions() {
            peers.push(("relay", format!("relay-r{r}")));
            for a in self.actor_names(r) {
                peers.push(("actor", a));
            }
        }
        for (role, name) in &peers {
            sh(Command::new(&hub)
                .args(["issue", "--role", role, "--name", name, "--dir"])
                .arg(&cluster)
                .arg("-o")
                .arg(self.dir.join(name)))?;
        }
        self.setup_network()?;
        Ok(())
    }

    fn hub_argv(&self, listen: &str, http: &str) -> Vec<OsString> {
        let mut v: Vec<OsString> = ["serve", "--listen", listen, "--model-id", &self.args.model]
            .iter()
            .map(OsString::from)
            .collect();
        v.push("--cluster".into());
        v.push(self.dir.join("cluster").into());
        v.push("--store".into());
        v.push(self.dir.join("hub-store").into());
        v.push("--init".into());
        v.push(self.steps[0].clone().into());
        v.push("--publish-dir".into());
        v.push(self.dir.join("ckpt").into());
        v.push("--http".into());
        v.push(http.into());
        v.push("--retain".into());
        v.push(self.args.retain.to_string().into());
        v
    }

    fn start_services(&mut self) -> Result<()> {
        // The hub first picks its ports; it is restarted with the command naming them.
        let argv = self.hub_argv("0.0.0.0:0", "127.0.0.1:0");
        self.add("hub", None, self.hub_bin(), argv);
        self.start_and_wait("hub")?;
        let (listen, http) = (format!("0.0.0.0:{}", self.hub_port), self.hub_http.clone());
        let argv = self.hub_argv(&listen, &http);
        self.svc("hub")?.argv = argv;
        self.hub_addr = format!("127.0.0.1:{}", self.hub_port);
        self.log(&format!("hub on {listen}, http {http}"));
        for r in 0..self.regions() {
            let ns = ns_name(r);
            let name = format!("relay-r{r}");
            let hub = format!("10.213.{r}.1:{}", self.hub_port);
            let argv: Vec<OsString> = vec![
                "--model-id".into(),
                self.args.model.clone().into(),
                "--listen".into(),
                format!("0.0.0.0:{RELAY_PORT}").into(),
                "--hub".into(),
                hub.clone().into(),
                "--region".into(),
                format!("r{r}").into(),
                "--credentials".into(),
                self.dir.join(&name).into(),
                "--cache".into(),
                self.dir.join(format!("{name}-cache")).into(),
                "--wan-mbit".into(),
                self.args.wan_mbit[r].to_string().into(),
                "--wan-rtt-ms".into(),
                "1".into(),
                "--retain".into(),
                self.args.retain.to_string().into(),
            ];
            self.add(&name, Some(ns.clone()), bin("starling-relay"), argv);
            self.start_and_wait(&name)?;
            for a in self.actor_names(r) {
                let argv: Vec<OsString> = vec![
                    "--model-id".into(),
                    self.args.model.clone().into(),
                    "--hub".into(),
                    hub.clone().into(),
                    "--relay".into(),
                    format!("relay-r{r}@127.0.0.1:{RELAY_PORT}").into(),
                    "--region".into(),
                    format!("r{r}").into(),
                    "--credentials".into(),
                    self.dir.join(&a).into(),
                    "--init".into(),
                    self.steps[0].clone().into(),
                    "--store".into(),
                    self.dir.join(format!("{a}-store")).into(),
                ];
                self.add(&a, Some(ns.clone()), bin("starling-actor"), argv);
                self.start(&a)?;
            }
        }
        let actors = self.all_actors();
        let deadline = Instant::now() + Duration::from_secs(60);
        ensure!(
            self.wait_until(deadline, |s| actors
                .iter()
                .all(|a| s.active.contains_key(a)))?,
            "actors did not start at version 0 within 60 s"
        );
        Ok(())
    }

    fn start_sampler(&self) {
        let (live, rss, stop, t0) = (
            self.live.clone(),
            self.rss.clone(),
            self.stop_sampler.clone(),
            self.t0,
        );
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let procs = live.lock().map(|l| l.clone()).unwrap_or_default();
                let t = t0.elapsed().as_secs_f64();
                for (key, pid) in procs {
                    if let Some(kb) = vm_rss_kb(pid)
                        && let Ok(mut m) = rss.lock()
                    {
                        m.entry(key).or_default().push((t, kb));
                    }
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        });
    }

    fn publish(&mut self, k: u64) -> Result<()> {
        let ckpt = self.steps[usize::try_from(k)?].clone();
        for attempt in 1..=5 {
            let o = Command::new(self.hub_bin())
                .args([
                    "publish",
                    "--model-id",
                    &self.args.model,
                    "--hub",
                    &self.hub_addr,
                ])
                .arg("--cluster")
                .arg(self.dir.join("cluster"))
                .arg(&ckpt)
                .output()
                .context("run publish")?;
            if o.status.success() {
                return Ok(());
            }
            self.log(&format!(
                "publish {k} attempt {attempt} failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
            let _ = self.wait_until(Instant::now() + Duration::from_secs(2), |_| false)?;
        }
        bail!("publishing version {k} failed 5 times")
    }

    fn delta_bytes(&self, k: u64) -> u64 {
        let f = self.dir.join("hub-store/deltas").join(delta_file_name(k));
        std::fs::metadata(&f)
            .map(|m| {
                m.len()
                    .saturating_sub((FILE_HEADER_LEN + TRAILER_FRAME_LEN) as u64)
            })
            .unwrap_or(0)
    }

    fn restart_hub(&mut self, k: u64, term: bool) -> Result<()> {
        let from = Instant::now();
        if term {
            let (in_time, took) = self.terminate("hub", Duration::from_secs(30))?;
            self.fault(
                k,
                Kind::HubTerm,
                format!(
                    "hub SIGTERM: exited in {:.2} s{}",
                    took.as_secs_f64(),
                    if in_time { "" } else { " (killed after 30 s)" }
                ),
            );
        } else {
            self.kill("hub")?;
            self.fault(k, Kind::HubKill, "hub SIGKILL".into());
        }
        self.start_and_wait("hub")?;
        self.log("hub restarted with the same command");
        self.outages.push(Outage {
            kind: if term { Kind::HubTerm } else { Kind::HubKill },
            region: None,
            from,
            to: Some(Instant::now()),
            restarted: None,
        });
        Ok(())
    }

    fn inject(&mut self, k: u64) -> Result<()> {
        let n = u64::from(self.args.versions);
        if k == n / 3 {
            self.restart_hub(k, true)?;
        }
        if k == 2 * n / 3 {
            self.restart_hub(k, false)?;
        }
        for r in 0..self.regions() {
            let relay = format!("relay-r{r}");
            if self.is_up(&relay) && self.rng.unit() < self.args.relay_kill {
                let after = self.rng.secs(1.0, 6.0);
                self.kill(&relay)?;
                self.fault(
                    k,
                    Kind::RelayKill,
                    format!("{relay} SIGKILL, restart in {:.1} s", after.as_secs_f64()),
                );
                self.outages.push(Outage {
                    kind: Kind::RelayKill,
                    region: Some(r),
                    from: Instant::now(),
                    to: None,
                    restarted: None,
                });
                self.due.push((Instant::now() + after, Due::Restart(relay)));
            }
            if !self.link_down[r] && self.rng.unit() < self.args.link_drop {
                let after = self.rng.secs(1.0, 5.0);
                self.set_link(r, false)?;
                self.fault(
                    k,
                    Kind::LinkDrop,
                    format!("r{r} WAN link down for {:.1} s", after.as_secs_f64()),
                );
                self.outages.push(Outage {
                    kind: Kind::LinkDrop,
                    region: Some(r),
                    from: Instant::now(),
                    to: None,
                    restarted: None,
                });
                self.due.push((Instant::now() + after, Due::LinkUp(r)));
            }
            for a in self.actor_names(r) {
                if self.is_up(&a) && self.rng.unit() < self.args.actor_kill {
                    let after = self.rng.secs(0.5, 4.0);
                    self.kill(&a)?;
                    self.fault(
                        k,
                        Kind::ActorKill,
                        format!("{a} SIGKILL, restart in {:.1} s", after.as_secs_f64()),
                    );
                    self.due.push((Instant::now() + after, Due::Restart(a)));
                }
            }
        }
        Ok(())
    }

    fn run(&mut self) -> Result<()> {
        self.prepare()?;
        self.start_services()?;
        self.start_sampler();
        let actors = self.all_actors();
        let started = Instant::now();
        let n = u64::from(self.args.versions);
        let mut prev = (Instant::now(), (0..self.regions()).map(counters).collect());
        let mut pending: Option<(u64, u64, bool)> = None;
        for k in 1..=n {
            ensure!(
                started.elapsed() < Duration::from_secs(self.args.max_duration_s),
                "publishing took longer than --max-duration-s at version {k}"
            );
            // The previous version's window ends here, before this version's faults.
            let now = (Instant::now(), (0..self.regions()).map(counters).collect());
            if let Some((v, delta, converged)) = pending.take() {
                self.close_window(v, delta, converged, &prev, &now);
            }
            prev = now;
            let paced = Instant::now() + Duration::from_millis(self.args.interval_ms);
            self.inject(k)?;
            self.publish(k)?;
            self.published = k;
            let delta = self.delta_bytes(k);
            let deadline = Instant::now() + Duration::from_secs(self.args.version_timeout_s);
            let names = actors.clone();
            let converged = self.wait_until(deadline, |s| {
                names
                    .iter()
                    .all(|a| !s.is_up(a) || s.active.get(a).is_some_and(|&v| v >= k))
            })?;
            if !converged {
                let behind: Vec<String> = actors
                    .iter()
                    .filter(|a| self.is_up(a) && self.active.get(*a).is_none_or(|&v| v < k))
                    .map(|a| format!("{a}@{:?}", self.active.get(a)))
                    .collect();
                self.log(&format!(
                    "version {k}: live actors behind after {} s: {behind:?}",
                    self.args.version_timeout_s
                ));
            }
            if k % 20 == 0 {
                self.log(&format!("published {k}/{n}"));
            }
            pending = Some((k, delta, converged));
            if k < n {
                self.wait_until(paced, |_| false)?;
            }
        }
        // Bring everything back, then every actor must reach the last version.
        let now = Instant::now();
        for d in &mut self.due {
            d.0 = now;
        }
        self.fire_due()?;
        let deadline = Instant::now() + Duration::from_secs(180);
        let names = actors.clone();
        let all = self.wait_until(deadline, |s| {
            names
                .iter()
                .all(|a| s.is_up(a) && s.active.get(a) == Some(&n))
        })?;
        let end = (Instant::now(), (0..self.regions()).map(counters).collect());
        if let Some((v, delta, converged)) = pending.take() {
            self.close_window(v, delta, converged, &prev, &end);
        }
        self.stop_sampler
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if !all {
            let states: Vec<String> = actors
                .iter()
                .map(|a| {
                    format!(
                        "{a}: up {} active {:?} upstream {:?}",
                        self.is_up(a),
                        self.active.get(a),
                        self.upstream.get(a)
                    )
                })
                .collect();
            self.log(&format!(
                "not every actor reached {n} within 180 s: {states:?}"
            ));
        }
        Ok(())
    }

    fn close_window(
        &mut self,
        version: u64,
        delta: u64,
        converged: bool,
        from: &(Instant, Vec<(u64, u64)>),
        to: &(Instant, Vec<(u64, u64)>),
    ) {
        let wan = from
            .1
            .iter()
            .zip(&to.1)
            .map(|(a, b)| (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1)))
            .collect();
        self.windows.push(Window {
            version,
            from: from.0,
            to: to.0,
            delta,
            wan,
            converged,
        });
    }

    /// What overlapped window `w` on region `r`'s path.
    fn overlaps(&self, w: &Window, r: usize) -> Vec<Kind> {
        let end = Instant::now();
        let mut k: Vec<Kind> = self
            .outages
            .iter()
            .filter(|o| o.region.is_none_or(|x| x == r))
            .filter(|o| o.from < w.to && o.to.unwrap_or(end) > w.from)
            .map(|o| o.kind)
            .collect();
        k.sort();
        k.dedup();
        k
    }

    /// Whether region `r`'s relay came back (after a kill) in the window before `w`.
    fn relay_returned_before(&self, w: &Window, r: usize) -> bool {
        let Some(prev) = self.windows.iter().find(|p| p.version + 1 == w.version) else {
            return false;
        };
        self.outages.iter().any(|o| {
            o.kind == Kind::RelayKill
                && o.region == Some(r)
                && o.to.is_some_and(|t| t >= prev.from && t < prev.to)
        })
    }

    fn report(&mut self) -> Result<()> {
        let mut failures = Vec::new();
        let n = u64::from(self.args.versions);
        println!("\n==== fault soak report (seed {}) ====", self.args.seed);
        println!("run directory: {}", self.dir.display());
        println!(
            "versions published: {} of {n}; soak time {:.0} s",
            self.windows.len(),
            self.now_s()
        );
        let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
        for (_, _, k, _) in &self.faults {
            *by_kind.entry(format!("{k:?}")).or_default() += 1;
        }
        println!("faults by kind: {by_kind:?}");
        println!("fault schedule (seconds since start, version, kind, what):");
        for (t, v, k, what) in &self.faults {
            println!("  {t:8.2}  v{v:<4} {k:?}: {what}");
        }
        if by_kind.contains_key("Unexpected") {
            failures.push("a process exited on its own (see the schedule)".to_owned());
        }
        let late = self.windows.iter().filter(|w| !w.converged).count();
        println!(
            "versions where a live actor took longer than {} s: {late}",
            self.args.version_timeout_s
        );
        if (self.windows.len() as u64) < n {
            failures.push(format!(
                "only {} of {n} versions published",
                self.windows.len()
            ));
        }

        // Final state: every actor's reported version and digest, then its store on disk.
        if !self.wrong_digests.is_empty() {
            failures.push(format!(
                "{} active lines with a wrong digest: {:?}",
                self.wrong_digests.len(),
                self.wrong_digests
            ));
        }
        let actors = self.all_actors();
        for a in &actors {
            let (ok, took) = self.terminate(a, Duration::from_secs(20))?;
            if !ok {
                println!("{a}: did not exit within 20 s of SIGTERM (killed)");
            } else {
                println!("{a}: exited {:.2} s after SIGTERM", took.as_secs_f64());
            }
        }
        let want = self.weights(n)?;
        let trust = starling_transport::identity::manifest_trust(&self.dir.join("cluster"))
            .context("signing.pub")?;
        let mut identical = 0;
        for a in &actors {
            let reported = self.active.get(a).copied();
            if reported != Some(n) {
                failures.push(format!(
                    "{a} last reported version {reported:?}, not {n} (upstream {:?})",
                    self.upstream.get(a)
                ));
            }
            match starling_actor::store::load(
                &self.dir.join(format!("{a}-store")),
                &self.steps[0],
                &self.args.model,
                &trust,
            ) {
                Ok((got, v)) => {
                    let same = v == n
                        && want.len() == got.len()
                        && want.iter().all(|(name, w)| {
                            got.get(name).is_some_and(|g| {
                                blake3::hash(&le_bytes(g)) == blake3::hash(&le_bytes(w))
                            })
                        });
                    println!(
                        "{a}: store holds version {v}; bit-identical to checkpoint {n}: {same}"
                    );
                    if same {
                        identical += 1;
                    } else {
                        failures.push(format!("{a}: store at {v} is not checkpoint {n}"));
                    }
                }
                Err(e) => failures.push(format!("{a}: store does not load: {e:#}")),
            }
        }
        println!(
            "final bit-identity: {identical} of {} actors identical to the hub's checkpoint {n}",
            actors.len()
        );
        if self.is_up("hub") {
            match std::panic::catch_unwind(|| http_get(&self.hub_http, "/v1/status")) {
                Ok(s) => println!(
                    "hub /v1/status: {}",
                    s.chars().take(400).collect::<String>()
                ),
                Err(_) => println!("hub /v1/status: no answer"),
            }
        }

        // WAN bytes per version per region.
        println!("\nWAN bytes ÷ delta bytes per version (hub-side veth, tx + rx):");
        for r in 0..self.regions() {
            let mut clean = Vec::new();
            let mut up_other = Vec::new();
            let mut after_return = Vec::new();
            let mut relay_down = Vec::new();
            let mut over = Vec::new();
            let mut all_up = Vec::new();
            let mut tx_only = Vec::new();
            for w in &self.windows {
                if w.delta == 0 {
                    continue;
                }
                let (tx, rx) = w.wan[r];
                let ratio = (tx + rx) as f64 / w.delta as f64;
                let ov = self.overlaps(w, r);
                if ov.contains(&Kind::RelayKill) {
                    relay_down.push(ratio);
                    continue;
                }
                tx_only.push(tx as f64 / w.delta as f64);
                let returned = self.relay_returned_before(w, r);
                // Asserted: every version with the region's relay up throughout (link drops
                // and hub restarts included), the one right after the relay's return too: its
                // actors take it from their relay (issue 26).
                if ratio > self.args.wan_ratio {
                    over.push(format!(
                        "v{} {ratio:.3} (tx {tx} rx {rx} delta {}; overlapped by {ov:?}{})",
                        w.version,
                        w.delta,
                        if returned {
                            ", first version after the relay's return"
                        } else {
                            ""
                        }
                    ));
                }
                all_up.push(ratio);
                if returned {
                    after_return.push(ratio);
                } else if ov.is_empty() {
                    clean.push(ratio);
                } else {
                    up_other.push(ratio);
                }
            }
            println!("region r{r} ({} Mbit/s):", self.args.wan_mbit[r]);
            for (label, v) in [
                ("relay up, no fault on the path", &clean),
                ("relay up, link drop or hub restart during it", &up_other),
                ("relay up, first version after its return", &after_return),
                ("relay up, all of the above", &all_up),
                ("relay up, all of the above, tx only", &tx_only),
                ("relay killed or restarting during it", &relay_down),
            ] {
                println!("  {label:48} {}", stats(v));
            }
            if !over.is_empty() {
                println!(
                    "  relay-up versions (right after its return included: all asserted) above {}×:",
                    self.args.wan_ratio
                );
                for o in &over {
                    println!("    {o}");
                }
                failures.push(format!(
                    "region r{r}: {} relay-up versions above {}× the delta",
                    over.len(),
                    self.args.wan_ratio
                ));
            }
        }
        let deltas: Vec<f64> = self.windows.iter().map(|w| w.delta as f64).collect();
        println!("delta frame bytes per version: {}", stats(&deltas));
        println!("relay outages (kill → restart → back in service: listening, caught up):");
        for o in self.outages.iter().filter(|o| o.kind == Kind::RelayKill) {
            let at = |t: Instant| t.saturating_duration_since(self.t0).as_secs_f64();
            println!(
                "  r{}: killed {:.2} s, restarted {}, back {}",
                o.region.unwrap_or(0),
                at(o.from),
                o.restarted.map_or("never".into(), |(t, v)| format!(
                    "{:.2} s (after v{v})",
                    at(t)
                )),
                o.to.map_or("never".into(), |t| format!("{:.2} s", at(t))),
            );
        }

        // Memory: second-quarter vs last-quarter peak RSS per process instance. The first
        // quarter is warm-up: the retained versions fill (hub and relays, `--retain`) and the
        // allocator's per-thread arenas appear; growth after that is what a leak looks like.
        println!(
            "\nVmRSS per process instance (sampled every 0.5 s): medians of the second, third and last quarter of its life"
        );
        let total = self.now_s();
        let rss = self.rss.lock().map(|m| m.clone()).unwrap_or_default();
        // The series itself, for a look at how an instance grew: instance, seconds, KiB.
        let mut tsv = String::from("instance\tseconds\tkib\n");
        for (key, samples) in &rss {
            for (t, kb) in samples {
                tsv.push_str(&format!("{key}\t{t:.1}\t{kb}\n"));
            }
        }
        let series = self.dir.join("rss.tsv");
        if let Err(e) = std::fs::write(&series, tsv) {
            println!("(rss series not written to {}: {e})", series.display());
        } else {
            println!("(rss series of every instance: {})", series.display());
        }
        for (key, samples) in &rss {
            let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
                continue;
            };
            let life = last.0 - first.0;
            let q = life / 4.0;
            // The median of a window: a leak raises the floor; a publish's or a verification's
            // transient buffers (tens of MB for a moment) only raise the peaks.
            let peak = |lo: f64, hi: f64| {
                let mut w: Vec<u64> = samples
                    .iter()
                    .filter(|(t, _)| *t >= lo && *t <= hi)
                    .map(|(_, kb)| *kb)
                    .collect();
                w.sort_unstable();
                w.get(w.len() / 2).copied().unwrap_or(0)
            };
            let (p2, p3, p4) = (
                peak(first.0 + q, first.0 + 2.0 * q),
                peak(first.0 + 2.0 * q, first.0 + 3.0 * q),
                peak(last.0 - q, last.0),
            );
            let long = life >= total / 4.0;
            let kib = |a: u64, b: u64| b as i64 - a as i64;
            let growth = kib(p2, p4);
            // A leak grows quarter after quarter; a one-time step (a buffer pool or allocator
            // arena made once, e.g. at a process's first anchor write) does not. Flagged: growth
            // in both later quarters of at least half the bound each (a steady leak of
            // `--rss-growth-mib` over the second half), or over four times the bound at all.
            let bound = (self.args.rss_growth_mib * 1024) as i64;
            let steady = kib(p2, p3).min(kib(p3, p4)) > bound / 2;
            println!(
                "  {key:14} lived {life:6.0} s{}  {:7.1} → {:7.1} → {:7.1} MiB  ({:+.1} MiB)",
                if long {
                    " (long-lived)"
                } else {
                    "              "
                },
                p2 as f64 / 1024.0,
                p3 as f64 / 1024.0,
                p4 as f64 / 1024.0,
                growth as f64 / 1024.0,
            );
            if long && (steady || growth > 4 * bound) {
                failures.push(format!(
                    "{key}: RSS grew {:.1} MiB from the second quarter to the last ({:+.1}, then {:+.1} MiB; bound {} MiB)",
                    growth as f64 / 1024.0,
                    kib(p2, p3) as f64 / 1024.0,
                    kib(p3, p4) as f64 / 1024.0,
                    self.args.rss_growth_mib
                ));
            }
        }

        if failures.is_empty() {
            Ok(())
        } else {
            println!("\nFAILURES:");
            for f in &failures {
                println!("  - {f}");
            }
            bail!(
                "fault soak failed: {} findings (logs: {})",
                failures.len(),
                self.logs.display()
            )
        }
    }

    fn teardown(&mut self) {
        self.stop_sampler
            .store(true, std::sync::atomic::Ordering::Relaxed);
        for s in &mut self.svcs {
            if let Some(mut c) = s.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        remove_stale();
        println!("torn down: processes, namespaces {NS_PREFIX}*, veths {VETH_PREFIX}*");
    }
}

impl Drop for Soak {
    fn drop(&mut self) {
        // On a panic the report never ran: still leave nothing behind.
        self.teardown();
    }
}

fn stats(v: &[f64]) -> String {
    if v.is_empty() {
        return "n=0".into();
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let q = |p: f64| s[((s.len() - 1) as f64 * p).round() as usize];
    format!(
        "n={:<4} min {:.3} p50 {:.3} p90 {:.3} max {:.3}",
        s.len(),
        s[0],
        q(0.5),
        q(0.9),
        s[s.len() - 1]
    )
}
