//! Support for tests and benchmarks that drive Starling's real binaries as separate
//! processes on loopback: a [`Testbed`] with a hub, relays (optionally behind an emulated WAN
//! link from `starling-netem`) and actors, whose output lines are read with deadlines.
//! Every process is killed and reaped when the test bed is dropped.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use starling_checkpoint::deltafile::delta_file_name;
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};
use starling_proto::delta::apply::full_digest;
use starling_telemetry::http_client::{self, Limits};

/// The environment variable `starling-fault-hub` (never `starling-hub`) reads: the version
/// whose first transmission it corrupts (`starling_transport::fanout::inject_corruption`).
/// A [`Testbed`] whose hub environment names it runs `starling-fault-hub` as its hub.
pub const CORRUPT_VERSION_VAR: &str = "STARLING_TEST_CORRUPT_VERSION";

/// A workspace binary next to this test's executable (built by `cargo test --workspace`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    // Test executables live in target/PROFILE/deps, binaries in target/PROFILE.
    let dir = exe.parent().expect("executable dir");
    let p = if dir.ends_with("deps") {
        dir.parent().unwrap_or(dir).join(name)
    } else {
        dir.join(name)
    };
    assert!(
        p.exists(),
        "{} not built: run the workspace tests (scripts/test.sh) or `cargo build --release --workspace`",
        p.display()
    );
    p
}

/// Kills and reaps its children on drop, so a failing test leaves no process behind.
#[derive(Debug)]
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn lines_of(r: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Spawns a process whose stdout lines arrive on the returned channel.
pub fn spawn(procs: &mut Procs, cmd: &mut Command) -> mpsc::Receiver<String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("STARLING_TEST_STDERR").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .spawn()
        .expect("spawn");
    let rx = lines_of(child.stdout.take().expect("stdout"));
    procs.0.push(child);
    rx
}

/// Like [`spawn`], and the process's stderr lines too.
pub fn spawn_with_log(
    procs: &mut Procs,
    cmd: &mut Command,
) -> (mpsc::Receiver<String>, mpsc::Receiver<String>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let out = lines_of(child.stdout.take().expect("stdout"));
    let err = lines_of(child.stderr.take().expect("stderr"));
    procs.0.push(child);
    (out, err)
}

pub fn wait_for(rx: &mpsc::Receiver<String>, what: &str, deadline: Instant) -> String {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(what) => return line,
            Ok(_) => {}
            Err(e) => panic!("waiting for {what:?}: {e}"),
        }
    }
}

/// The next line that is not a progress notice (`upstream …`, `staged …`, `resume …`).
pub fn next_event(rx: &mpsc::Receiver<String>, deadline: Instant) -> String {
    loop {
        let line = wait_for(rx, "", deadline);
        if !["upstream ", "staged ", "resume "]
            .iter()
            .any(|p| line.starts_with(p))
        {
            return line;
        }
    }
}

pub fn run_ok(cmd: &mut Command) {
    let o = cmd.output().expect("run");
    assert!(
        o.status.success(),
        "{:?} failed: {}",
        cmd,
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A cluster on loopback: generated checkpoints, credentials, a running hub.
#[derive(Debug)]
pub struct Testbed {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
    pub steps: Vec<PathBuf>,
    pub cluster: PathBuf,
    pub hub_addr: String,
    /// The hub's HTTP address (`/metrics`, `/v1/versions`).
    pub hub_http: String,
    /// The hub's stdout (`first-segment N`, `anchor N`) and stderr (its log) lines.
    pub hub_out: mpsc::Receiver<String>,
    pub hub_log: mpsc::Receiver<String>,
    /// The stdout of each emulated link (`starling-netem`: its counters), in creation order.
    pub links_out: Vec<mpsc::Receiver<String>>,
    /// The HTTP address of each relay started with `--http` (by region name).
    pub relay_http: std::collections::BTreeMap<String, String>,
    pub procs: Procs,
    pub deadline: Instant,
    hub_args: Vec<String>,
    hub_env: Vec<(String, String)>,
    hub_pid: u32,
    /// `starling-hub`, or `starling-fault-hub` when the hub's environment arms a fault.
    hub_bin: &'static str,
    /// The hub's `--publish-dir`s: every directory holding a step (not the root, which holds
    /// the cluster's keys).
    pub publish_dirs: Vec<PathBuf>,
}

/// The hub's `serve` command of a test bed rooted at `root`.
#[allow(clippy::too_many_arguments)]
fn hub_command(
    hub_bin: &str,
    root: &std::path::Path,
    init: Option<&std::path::Path>,
    listen: &str,
    http: &str,
    args: &[String],
    env: &[(String, String)],
    publish: &[PathBuf],
) -> Command {
    let mut hub = Command::new(bin(hub_bin));
    hub.args([
        "serve",
        "--listen",
        listen,
        "--model-id",
        "tiny",
        "--cluster",
    ])
    .arg(root.join("cluster"))
    .arg("--store")
    .arg(root.join("hub-store"))
    .args(["--http", http])
    .args(args);
    for d in publish {
        hub.arg("--publish-dir").arg(d);
    }
    if let Some(init) = init {
        hub.arg("--init").arg(init);
    }
    for (k, v) in env {
        hub.env(k, v);
    }
    hub
}

impl Testbed {
    /// `versions` checkpoints after the initial one; credentials for `peers` (role, name);
    /// extra environment for the hub (fault hooks).
    pub fn new(versions: u32, seed: u64, peers: &[(&str, &str)], hub_env: &[(&str, &str)]) -> Self {
        Self::with_model("tiny", 1e-5, versions, seed, peers, hub_env, &[])
    }

    /// As [`Testbed::new`] with a model preset and learning rate of the workload generator.
    pub fn with_model(
        preset: &str,
        lr: f32,
        versions: u32,
        seed: u64,
        peers: &[(&str, &str)],
        hub_env: &[(&str, &str)],
        hub_args: &[&str],
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = ModelSpec::preset(preset).expect("preset");
        let cfg = TrainConfig {
            seed,
            lr,
            ..TrainConfig::default()
        };
        let ckpt = dir.path().join("ckpt");
        let steps = generate_to_dir(&spec, versions, &cfg, &ckpt, &|_| {}).expect("generate");
        if let Some(config) = spec.qwen3_config_json() {
            std::fs::write(ckpt.join("config.json"), config.to_string()).expect("config.json");
        }
        Self::with_checkpoints(dir, steps, peers, hub_env, hub_args)
    }

    /// A test bed over existing checkpoints (`steps[0]` is the hub's initial version).
    pub fn with_checkpoints(
        dir: tempfile::TempDir,
        steps: Vec<PathBuf>,
        peers: &[(&str, &str)],
        hub_env: &[(&str, &str)],
        hub_args: &[&str],
    ) -> Self {
        let root = dir.path().to_owned();
        let cluster = root.join("cluster");
        run_ok(
            Command::new(bin("starling-hub"))
                .args(["init", "--name", "test", "--dir"])
                .arg(&cluster),
        );
        for (role, name) in peers {
            run_ok(
                Command::new(bin("starling-hub"))
                    .args(["issue", "--role", role, "--name", name, "--dir"])
                    .arg(&cluster)
                    .arg("-o")
                    .arg(root.join(name)),
            );
        }
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut procs = Procs(Vec::new());
        let hub_args: Vec<String> = hub_args.iter().map(|a| (*a).to_owned()).collect();
        let hub_env: Vec<(String, String)> = hub_env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let mut publish_dirs: Vec<PathBuf> = Vec::new();
        for s in &steps {
            if let Some(d) = s
                .parent()
                .filter(|d| !publish_dirs.iter().any(|p| d.starts_with(p)))
            {
                publish_dirs.push(d.to_owned());
            }
        }
        let hub_bin = if hub_env.iter().any(|(k, _)| k == CORRUPT_VERSION_VAR) {
            "starling-fault-hub"
        } else {
            "starling-hub"
        };
        let mut hub = hub_command(
            hub_bin,
            &root,
            Some(&steps[0]),
            "127.0.0.1:0",
            "127.0.0.1:0",
            &hub_args,
            &hub_env,
            &publish_dirs,
        );
        let (hub_out, hub_log) = spawn_with_log(&mut procs, &mut hub);
        let hub_http = wait_for(&hub_out, "http on ", deadline)
            .trim_start_matches("http on ")
            .to_owned();
        let hub_addr = wait_for(&hub_out, "listening on ", deadline)
            .trim_start_matches("listening on ")
            .to_owned();
        Self {
            _dir: dir,
            root,
            steps,
            cluster,
            hub_addr,
            hub_http,
            hub_out,
            hub_log,
            links_out: Vec::new(),
            relay_http: std::collections::BTreeMap::new(),
            deadline,
            hub_pid: procs.0.first().map(|c| c.id()).unwrap_or(0),
            procs,
            hub_args,
            hub_env,
            hub_bin,
            publish_dirs,
        }
    }

    /// Starts the hub again with the very command it ran with (same store, ledger, `--init`,
    /// addresses), as its systemd unit's `Restart=on-failure` would; waits until it listens.
    /// Its output replaces `hub_out` and `hub_log`.
    pub fn restart_hub(&mut self) {
        let mut hub = hub_command(
            self.hub_bin,
            &self.root,
            Some(&self.steps[0]),
            &self.hub_addr,
            &self.hub_http,
            &self.hub_args,
            &self.hub_env,
            &self.publish_dirs,
        );
        let (out, log) = spawn_with_log(&mut self.procs, &mut hub);
        self.hub_pid = self.procs.0.last().map(|c| c.id()).unwrap_or(0);
        wait_for(&out, "listening on ", self.deadline);
        self.hub_out = out;
        self.hub_log = log;
    }

    /// As [`Testbed::restart_hub`], with `extra` added to the hub's environment (its binary
    /// stays the one it was: `starling-hub` unless the test bed was made with a fault armed).
    pub fn restart_hub_with_env(&mut self, extra: &[(&str, &str)]) {
        self.hub_env.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        self.restart_hub();
    }

    /// The hub's command with `init` as `--init` (for a start that must be refused).
    pub fn hub_command_with_init(&self, init: &std::path::Path, extra: &[&str]) -> Command {
        let mut args = self.hub_args.clone();
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        hub_command(
            self.hub_bin,
            &self.root,
            Some(init),
            &self.hub_addr,
            &self.hub_http,
            &args,
            &self.hub_env,
            &self.publish_dirs,
        )
    }

    /// The hub's command without `--init` (a restart once the ledger holds the run).
    pub fn hub_command_without_init(&self, extra: &[&str]) -> Command {
        let mut args = self.hub_args.clone();
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        hub_command(
            self.hub_bin,
            &self.root,
            None,
            &self.hub_addr,
            &self.hub_http,
            &args,
            &self.hub_env,
            &self.publish_dirs,
        )
    }

    /// Starts `cmd` as the hub (a command from [`Testbed::hub_command_with_init`] or
    /// [`Testbed::hub_command_without_init`]) and waits until it listens; its output replaces
    /// `hub_out` and `hub_log`.
    pub fn start_hub(&mut self, mut cmd: Command) {
        let (out, log) = spawn_with_log(&mut self.procs, &mut cmd);
        self.hub_pid = self.procs.0.last().map(|c| c.id()).unwrap_or(0);
        wait_for(&out, "listening on ", self.deadline);
        self.hub_out = out;
        self.hub_log = log;
    }

    /// A relay connected straight to the hub; returns its address and stdout lines.
    pub fn relay(&mut self, name: &str) -> (String, mpsc::Receiver<String>) {
        let hub = self.hub_addr.clone();
        self.relay_at(name, &hub, &[])
    }

    /// A relay connected straight to the hub, with extra arguments.
    pub fn relay_with(&mut self, name: &str, extra: &[&str]) -> (String, mpsc::Receiver<String>) {
        let hub = self.hub_addr.clone();
        self.relay_at(name, &hub, extra)
    }

    /// The hub's `/metrics` text.
    pub fn hub_metrics(&self) -> String {
        http_get(&self.hub_http, "/metrics")
    }

    /// The hub's `/v1/status` document.
    pub fn hub_status(&self) -> serde_json::Value {
        serde_json::from_str(&http_get(&self.hub_http, "/v1/status")).expect("status is JSON")
    }

    /// The bytes of the delta frames of `versions` as the hub stores them (segments and
    /// manifests, without the file header and trailer): what a subscriber is sent for them.
    pub fn delta_frame_bytes(&self, versions: std::ops::RangeInclusive<u64>) -> u64 {
        use starling_proto::delta::container::{FILE_HEADER_LEN, TRAILER_FRAME_LEN};
        versions
            .map(|k| {
                let f = self.root.join("hub-store/deltas").join(delta_file_name(k));
                std::fs::metadata(&f).expect("delta file").len()
                    - (FILE_HEADER_LEN + TRAILER_FRAME_LEN) as u64
            })
            .sum()
    }

    /// A relay whose link to the hub goes through `starling-netem` with `netem_args`
    /// (e.g. `--rate 100mbit --delay 25ms --loss 0.1%`); `relay_args` tell the relay the
    /// link it is on (`--wan-mbit`, `--wan-rtt-ms`).
    pub fn relay_behind_link(
        &mut self,
        name: &str,
        netem_args: &[&str],
        relay_args: &[&str],
    ) -> (String, mpsc::Receiver<String>) {
        let link = self.link_to_hub("127.0.0.1:0", netem_args);
        self.relay_at(name, &link, relay_args)
    }

    /// Starts a `starling-netem` link listening on `listen` (port 0: any) towards the hub;
    /// returns its address. Its stdout (counters) goes to `links_out`.
    pub fn link_to_hub(&mut self, listen: &str, netem_args: &[&str]) -> String {
        let out = spawn(
            &mut self.procs,
            Command::new(bin("starling-netem"))
                .args(["--listen", listen, "--upstream", &self.hub_addr])
                .args(netem_args),
        );
        let link = wait_for(&out, "listening on ", self.deadline)
            .trim_start_matches("listening on ")
            .to_owned();
        self.links_out.push(out);
        link
    }

    /// A relay that reaches the hub at `hub` (the hub itself or a link to it).
    pub fn relay_at(
        &mut self,
        name: &str,
        hub: &str,
        extra: &[&str],
    ) -> (String, mpsc::Receiver<String>) {
        self.relay_on(name, "127.0.0.1:0", hub, extra)
    }

    /// [`Testbed::relay_at`] listening on `listen` (a relay restarted on its old address).
    pub fn relay_on(
        &mut self,
        name: &str,
        listen: &str,
        hub: &str,
        extra: &[&str],
    ) -> (String, mpsc::Receiver<String>) {
        let out = spawn(
            &mut self.procs,
            Command::new(bin("starling-relay"))
                .args([
                    "--model-id",
                    "tiny",
                    "--listen",
                    listen,
                    "--hub",
                    hub,
                    "--region",
                    name,
                    "--credentials",
                ])
                .arg(self.root.join(name))
                .args(extra),
        );
        // A relay with `--http` says where it serves `/metrics` before it listens.
        let addr = loop {
            let line = wait_for(&out, "", self.deadline);
            if let Some(http) = line.strip_prefix("http on ") {
                self.relay_http.insert(name.to_owned(), http.to_owned());
            } else if let Some(addr) = line.strip_prefix("listening on ") {
                break addr.to_owned();
            }
        };
        (addr, out)
    }

    /// Starts an actor that tries `relays` (NAME@ADDR) before the hub.
    pub fn actor(&mut self, name: &str, relays: &[String]) -> mpsc::Receiver<String> {
        self.actor_with(name, relays, &[])
    }

    /// An actor with extra arguments (an engine, a region).
    pub fn actor_with(
        &mut self,
        name: &str,
        relays: &[String],
        extra: &[&str],
    ) -> mpsc::Receiver<String> {
        let mut cmd = Command::new(bin("starling-actor"));
        cmd.args([
            "--model-id",
            "tiny",
            "--hub",
            &self.hub_addr,
            "--credentials",
        ])
        .arg(self.root.join(name))
        .arg("--init")
        .arg(&self.steps[0])
        .arg("--store")
        .arg(self.store(name));
        for r in relays {
            cmd.args(["--relay", r]);
        }
        cmd.args(extra);
        spawn(&mut self.procs, &mut cmd)
    }

    pub fn store(&self, actor: &str) -> PathBuf {
        self.root.join(format!("{actor}-store"))
    }

    pub fn publish(&self, k: usize) {
        publish_to(&self.hub_addr, &self.cluster, &self.steps[k]);
    }

    /// The trainer's weights of version `k`.
    pub fn weights(&self, k: usize) -> std::collections::BTreeMap<String, Vec<u16>> {
        Checkpoint::open(&self.steps[k])
            .expect("open")
            .read_all()
            .expect("read")
    }

    /// The line an actor prints once it runs version `k`, computed from the trainer's bits.
    pub fn active_line(&self, k: usize) -> String {
        let w = self.weights(k);
        let names: Vec<String> = w.keys().cloned().collect();
        format!("active {k} {}", full_digest("tiny", &w, &names))
    }

    /// Asserts that `actor`'s store (snapshot + journal, replayed with every check under the
    /// cluster's signing key) holds exactly version `k`, bit-identical to the trainer's.
    pub fn assert_store_is(&self, actor: &str, k: usize) {
        let trust =
            starling_transport::identity::manifest_trust(&self.cluster).expect("signing.pub");
        let (got, version) =
            starling_actor::store::load(&self.store(actor), &self.steps[0], "tiny", &trust)
                .expect("load store");
        assert_eq!(version, k as u64, "{actor}");
        for (name, w) in &self.weights(k) {
            assert_eq!(
                blake3::hash(&le_bytes(&got[name])),
                blake3::hash(&le_bytes(w)),
                "{actor}: tensor {name}"
            );
        }
    }

    /// SIGKILLs the hub (the first one or the one [`Testbed::restart_hub`] started) and
    /// reaps it.
    /// Sends the hub SIGTERM and waits up to `limit` for it to exit; returns its exit status
    /// and how long it took (panics if it is still running after `limit`).
    pub fn terminate_hub(&mut self, limit: Duration) -> (std::process::ExitStatus, Duration) {
        let pid = self.hub_pid;
        let i = self
            .procs
            .0
            .iter()
            .position(|c| c.id() == pid)
            .expect("the hub is one of the test bed's processes");
        self.terminate(i, limit)
    }

    /// Sends the process started `index`-th (0 is the hub) SIGTERM and waits up to `limit`
    /// for it to exit; returns its exit status and how long it took (panics if it is still
    /// running after `limit`).
    pub fn terminate(
        &mut self,
        index: usize,
        limit: Duration,
    ) -> (std::process::ExitStatus, Duration) {
        let mut p = self.procs.0.remove(index);
        let sent = Instant::now();
        run_ok(Command::new("kill").args(["-TERM", &p.id().to_string()]));
        loop {
            if let Some(status) = p.try_wait().expect("wait for the process") {
                return (status, sent.elapsed());
            }
            if sent.elapsed() > limit {
                let _ = p.kill();
                let _ = p.wait();
                panic!("process {index} was still running {limit:?} after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The hub's process id (the first hub, or the one [`Testbed::restart_hub`] started).
    pub fn hub_pid(&self) -> u32 {
        self.hub_pid
    }

    pub fn kill_hub(&mut self) {
        let pid = self.hub_pid;
        if let Some(i) = self.procs.0.iter().position(|c| c.id() == pid) {
            self.kill(i);
        }
    }

    /// SIGKILLs the one process of this test bed whose command line contains `needle` (an
    /// actor's store path, `--region NAME --credentials`), and reaps it.
    pub fn kill_matching(&mut self, needle: &str) {
        let matches: Vec<usize> = self
            .procs
            .0
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                std::fs::read(format!("/proc/{}/cmdline", p.id()))
                    .map(|c| {
                        String::from_utf8_lossy(&c)
                            .replace('\0', " ")
                            .contains(needle)
                    })
                    .unwrap_or(false)
            })
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            matches.len(),
            1,
            "processes matching {needle:?}: {matches:?}"
        );
        self.kill(matches[0]);
    }

    /// SIGKILLs the process started `index`-th (0 is the hub) and reaps it.
    pub fn kill(&mut self, index: usize) {
        let mut p = self.procs.0.remove(index);
        p.kill().expect("SIGKILL");
        p.wait().expect("reap");
    }
}

/// Little-endian bytes of BF16 bits (for hashing tensors).
pub fn le_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `starling-hub publish` of `checkpoint` to the hub at `hub` (blocks until published).
pub fn publish_to(hub: &str, cluster: &std::path::Path, checkpoint: &std::path::Path) {
    run_ok(
        Command::new(bin("starling-hub"))
            .args(["publish", "--model-id", "tiny", "--hub", hub, "--cluster"])
            .arg(cluster)
            .arg(checkpoint),
    );
}

/// How long a test helper's request may take: longer than the hub's longest long poll (30 s)
/// and its request timeout (60 s), so a slow hub fails the test with its own answer.
const HTTP_TIMEOUT: Duration = Duration::from_secs(120);
/// The largest answer a test helper reads: the trainer client's bound (`starling_trainer`'s
/// `hub::ANSWER_LIMIT`), enough for any results page.
const HTTP_ANSWER_LIMIT: u64 = 256 << 20;

/// A GET through the project's HTTP client; returns the body (panics on a non-200 answer).
pub fn http_get(addr: &str, path: &str) -> String {
    let (status, body) = http_request(addr, "GET", path, None, None);
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// A request through the project's HTTP client with an optional bearer token and JSON body;
/// returns the status code and the body (panics when there is no answer).
pub fn http_request(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let r = http_client::request(
        addr,
        method,
        path,
        &headers,
        body,
        Limits::timeout(HTTP_TIMEOUT).body_limit(HTTP_ANSWER_LIMIT),
    )
    .unwrap_or_else(|e| panic!("{method} {path}: {}", starling_process::error_chain(&e)));
    (r.status, r.body)
}

/// A fresh PostgreSQL database on the server named by `STARLING_TEST_POSTGRES_URL`, as a
/// URL for `--ledger` (none when the variable is unset: the caller skips, saying so).
pub fn postgres_database(test: &str) -> Option<String> {
    let admin = std::env::var("STARLING_TEST_POSTGRES_URL").ok()?;
    let name = format!(
        "starling_e2e_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    );
    run_ok(Command::new("psql").args([&admin, "-q", "-c", &format!("CREATE DATABASE {name}")]));
    println!("{test}: PostgreSQL database {name}");
    let (base, _) = admin.rsplit_once('/').expect("a URL with a database");
    Some(format!("{base}/{name}"))
}

/// The value of one Prometheus sample line (`NAME{LABELS} VALUE`), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// A client of the hub's job protocol with an actor's credentials (tests and benchmarks
/// play actors with it: honest, hostile, or a load generator).
#[derive(Debug)]
pub struct WorkClient {
    _ep: quinn::Endpoint,
    pub conn: quinn::Connection,
    pub tx: quinn::SendStream,
    rx: starling_transport::framed::MessageReader,
}

impl WorkClient {
    /// Connects as actor `name` (credentials in the test bed), says `Work` and a heartbeat.
    pub async fn connect(tb: &Testbed, name: &str, active: (u64, [u8; 16])) -> WorkClient {
        let creds = starling_transport::identity::Credentials::load_peer(&tb.root.join(name))
            .expect("credentials");
        let bind: std::net::SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let ep = starling_transport::endpoint::client_endpoint(
            &creds,
            bind,
            &starling_transport::link::LinkProfile::LAN,
        )
        .expect("endpoint");
        let hub: std::net::SocketAddr = tb.hub_addr.parse().expect("hub addr");
        let conn = starling_transport::endpoint::connect(
            &ep,
            hub,
            starling_transport::identity::Role::Hub,
            "hub",
        )
        .await
        .expect("connect");
        let (mut tx, rx) = conn.open_bi().await.expect("stream");
        let mut rx = starling_transport::framed::MessageReader::new(rx);
        let hello = starling_proto::protocol::msg::Message::Hello {
            protocol: starling_proto::protocol::msg::PROTOCOL_VERSION,
            role: starling_proto::protocol::msg::Role::Actor,
            name: name.into(),
            region: "nowhere".into(),
            model_id: "tiny".into(),
            active: Some(active),
            link: None,
        };
        starling_transport::framed::send(&mut tx, &hello)
            .await
            .expect("hello");
        assert!(matches!(
            rx.next().await,
            Ok(Some(starling_proto::protocol::msg::Message::Welcome { .. }))
        ));
        let work = starling_proto::protocol::msg::Message::Work {
            engine: "rogue".into(),
            hardware: "none".into(),
            max_batch: 1,
        };
        starling_transport::framed::send(&mut tx, &work)
            .await
            .expect("work");
        let beat = starling_proto::protocol::msg::Message::Heartbeat {
            active: Some(active),
            staged: None,
        };
        starling_transport::framed::send(&mut tx, &beat)
            .await
            .expect("heartbeat");
        WorkClient {
            _ep: ep,
            conn,
            tx,
            rx,
        }
    }

    /// Sends `m` and reads the answer.
    pub async fn ask(
        &mut self,
        m: starling_proto::protocol::msg::Message,
    ) -> starling_proto::protocol::msg::Message {
        starling_transport::framed::send(&mut self.tx, &m)
            .await
            .expect("send");
        self.rx.next().await.expect("answer").expect("an answer")
    }

    /// Claims up to `max` jobs.
    pub async fn claim(&mut self, max: u32) -> Vec<starling_proto::protocol::rollout::JobSpec> {
        match self
            .ask(starling_proto::protocol::msg::Message::Claim { max })
            .await
        {
            starling_proto::protocol::msg::Message::Jobs { jobs } => jobs,
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Submits one result; returns its verdict.
    pub async fn submit(
        &mut self,
        r: starling_proto::protocol::rollout::JobResult,
    ) -> starling_proto::protocol::rollout::Verdict {
        match self
            .ask(starling_proto::protocol::msg::Message::Submit { results: vec![r] })
            .await
        {
            starling_proto::protocol::msg::Message::Verdicts { mut verdicts } => {
                verdicts.remove(0).1
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
