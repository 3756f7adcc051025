//! The distribution path with real processes on loopback: a hub (`starling-hub serve`), two
//! actors (`starling-actor`), the trainer publishing five versions (`starling-hub publish`).
//! Every actor must reach every version bit-identically; a corrupted transmission is refused
//! and fetched again, never applied; an actor killed with SIGKILL and restarted resumes from
//! its store.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};
use starling_proto::apply::full_digest;

/// A workspace binary next to this test's executable (built by `cargo test --workspace`).
fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not built: run the workspace tests (scripts/test.sh) or `cargo build --release --workspace`",
        p.display()
    );
    p
}

/// Kills and reaps its children on drop, so a failing test leaves no process behind.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn lines_of(r: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
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
fn spawn(procs: &mut Procs, cmd: &mut Command) -> mpsc::Receiver<String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let rx = lines_of(child.stdout.take().expect("stdout"));
    procs.0.push(child);
    rx
}

/// Like [`spawn`], and the process's stderr lines too.
fn spawn_with_log(
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

fn wait_for(rx: &mpsc::Receiver<String>, what: &str, deadline: Instant) -> String {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(what) => return line,
            Ok(_) => {}
            Err(e) => panic!("waiting for {what:?}: {e}"),
        }
    }
}

/// The next line that is not an `upstream …` notice.
fn next_event(rx: &mpsc::Receiver<String>, deadline: Instant) -> String {
    loop {
        let line = wait_for(rx, "", deadline);
        if !line.starts_with("upstream ") {
            return line;
        }
    }
}

fn run_ok(cmd: &mut Command) {
    let o = cmd.output().expect("run");
    assert!(
        o.status.success(),
        "{:?} failed: {}",
        cmd,
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A cluster on loopback: generated checkpoints, credentials, a running hub.
struct Testbed {
    _dir: tempfile::TempDir,
    root: PathBuf,
    steps: Vec<PathBuf>,
    cluster: PathBuf,
    hub_addr: String,
    hub_log: mpsc::Receiver<String>,
    procs: Procs,
    deadline: Instant,
}

impl Testbed {
    /// `versions` checkpoints after the initial one; credentials for `peers` (role, name);
    /// extra environment for the hub (fault hooks).
    fn new(versions: u32, seed: u64, peers: &[(&str, &str)], hub_env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_owned();
        let spec = ModelSpec::preset("tiny").expect("preset");
        let cfg = TrainConfig {
            seed,
            lr: 1e-5,
            ..TrainConfig::default()
        };
        let steps =
            generate_to_dir(&spec, versions, &cfg, &root.join("ckpt"), &|_| {}).expect("generate");
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
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut procs = Procs(Vec::new());
        let mut hub = Command::new(bin("starling-hub"));
        hub.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--model-id",
            "tiny",
            "--cluster",
        ])
        .arg(&cluster)
        .arg("--store")
        .arg(root.join("hub-store"))
        .arg("--init")
        .arg(&steps[0]);
        for (k, v) in hub_env {
            hub.env(k, v);
        }
        let (hub_out, hub_log) = spawn_with_log(&mut procs, &mut hub);
        let hub_addr = wait_for(&hub_out, "listening on ", deadline)
            .trim_start_matches("listening on ")
            .to_owned();
        Self {
            _dir: dir,
            root,
            steps,
            cluster,
            hub_addr,
            hub_log,
            procs,
            deadline,
        }
    }

    fn relay(&mut self, name: &str) -> (String, mpsc::Receiver<String>) {
        let out = spawn(
            &mut self.procs,
            Command::new(bin("starling-relay"))
                .args([
                    "--model-id",
                    "tiny",
                    "--listen",
                    "127.0.0.1:0",
                    "--hub",
                    &self.hub_addr,
                    "--region",
                    name,
                    "--credentials",
                ])
                .arg(self.root.join(name)),
        );
        let addr = wait_for(&out, "listening on ", self.deadline)
            .trim_start_matches("listening on ")
            .to_owned();
        (addr, out)
    }

    /// Starts an actor that tries `relays` (NAME@ADDR) before the hub.
    fn actor(&mut self, name: &str, relays: &[String]) -> mpsc::Receiver<String> {
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
        spawn(&mut self.procs, &mut cmd)
    }

    fn store(&self, actor: &str) -> PathBuf {
        self.root.join(format!("{actor}-store"))
    }

    fn publish(&self, k: usize) {
        run_ok(
            Command::new(bin("starling-hub"))
                .args([
                    "publish",
                    "--model-id",
                    "tiny",
                    "--hub",
                    &self.hub_addr,
                    "--cluster",
                ])
                .arg(&self.cluster)
                .arg(&self.steps[k]),
        );
    }

    /// The trainer's weights of version `k`.
    fn weights(&self, k: usize) -> std::collections::BTreeMap<String, Vec<u16>> {
        Checkpoint::open(&self.steps[k])
            .expect("open")
            .read_all()
            .expect("read")
    }

    /// The line an actor prints once it runs version `k`, computed from the trainer's bits.
    fn active_line(&self, k: usize) -> String {
        let w = self.weights(k);
        let names: Vec<String> = w.keys().cloned().collect();
        format!("active {k} {}", full_digest("tiny", &w, &names))
    }

    /// Asserts that `actor`'s stored weights are bit-identical to version `k`.
    fn assert_store_is(&self, actor: &str, k: usize) {
        let got =
            Checkpoint::open(&self.store(actor).join("current.safetensors")).expect("open store");
        assert_eq!(got.version(), Some(k as u64), "{actor}");
        let got = got.read_all().expect("read store");
        for (name, w) in &self.weights(k) {
            assert_eq!(
                blake3::hash(&le_bytes(&got[name])),
                blake3::hash(&le_bytes(w)),
                "{actor}: tensor {name}"
            );
        }
    }

    /// SIGKILLs the process started `index`-th (0 is the hub) and reaps it.
    fn kill(&mut self, index: usize) {
        let mut p = self.procs.0.remove(index);
        p.kill().expect("SIGKILL");
        p.wait().expect("reap");
    }
}

#[test]
fn hub_delivers_every_version_to_every_actor_bit_identically() {
    let peers = [("actor", "a1"), ("actor", "a2")];
    let mut tb = Testbed::new(5, 5, &peers, &[("STARLING_TEST_CORRUPT_VERSION", "2")]);
    let dl = tb.deadline;
    let a1 = tb.actor("a1", &[]);
    let mut a2 = tb.actor("a2", &[]);
    wait_for(&a1, "active 0 ", dl);
    wait_for(&a2, "active 0 ", dl);
    for k in 1..=3 {
        tb.publish(k);
        let want = tb.active_line(k);
        // The hub corrupts one byte of version 2's first transmission (to whichever actor
        // it serves first): that actor must refuse it, fetch it again, and only then
        // activate the right bits.
        let mut refetched = false;
        for rx in [&a1, &a2] {
            let mut line = next_event(rx, dl);
            if line.starts_with("refetch ") {
                assert_eq!(line, format!("refetch {k}"));
                refetched = true;
                line = next_event(rx, dl);
            }
            assert_eq!(line, want);
        }
        assert_eq!(refetched, k == 2, "exactly version 2 was refetched, once");
    }
    // SIGKILL actor 2 at version 3, publish version 4 without it, restart it from its store.
    tb.kill(2);
    tb.publish(4);
    assert_eq!(wait_for(&a1, "active 4 ", dl), tb.active_line(4));
    a2 = tb.actor("a2", &[]);
    assert_eq!(
        wait_for(&a2, "active 3 ", dl),
        tb.active_line(3),
        "resumed from its store"
    );
    assert_eq!(
        wait_for(&a2, "active 4 ", dl),
        tb.active_line(4),
        "caught up"
    );
    tb.publish(5);
    for rx in [&a1, &a2] {
        assert_eq!(wait_for(rx, "active 5 ", dl), tb.active_line(5));
    }
    tb.assert_store_is("a1", 5);
    tb.assert_store_is("a2", 5);
}

#[test]
fn relays_carry_one_copy_per_region_and_actors_fail_over_to_the_hub() {
    let peers = [
        ("relay", "r-eu"),
        ("relay", "r-us"),
        ("actor", "eu-1"),
        ("actor", "eu-2"),
        ("actor", "us-1"),
    ];
    let mut tb = Testbed::new(4, 8, &peers, &[]);
    let dl = tb.deadline;
    let (eu_addr, eu_out) = tb.relay("r-eu");
    let (us_addr, us_out) = tb.relay("r-us");
    let mut actors = Vec::new();
    for (name, relay) in [
        ("eu-1", format!("r-eu@{eu_addr}")),
        ("eu-2", format!("r-eu@{eu_addr}")),
        ("us-1", format!("r-us@{us_addr}")),
    ] {
        let out = tb.actor(name, std::slice::from_ref(&relay));
        let relay_name = relay.split('@').next().unwrap_or_default().to_owned();
        assert_eq!(
            wait_for(&out, "upstream ", dl),
            format!("upstream relay {relay_name}")
        );
        actors.push(out);
    }
    for k in 1..=3 {
        tb.publish(k);
        for out in [&eu_out, &us_out] {
            assert_eq!(wait_for(out, "cached ", dl), format!("cached {k}"));
        }
        for out in &actors {
            assert_eq!(
                wait_for(out, &format!("active {k} "), dl),
                tb.active_line(k)
            );
        }
    }
    // The hub sent each version exactly once per region (to the two relays), never to actors.
    let mut sent: Vec<String> = (0..6)
        .map(|_| wait_for(&tb.hub_log, "sent version ", dl))
        .collect();
    sent.sort();
    let expected: Vec<String> = (1..=3)
        .flat_map(|k| {
            [
                format!("sent version {k} to r-eu"),
                format!("sent version {k} to r-us"),
            ]
        })
        .collect();
    assert_eq!(sent, expected);
    // Kill the EU relay (started right after the hub): its actors fail over to the hub.
    tb.kill(1);
    for out in &actors[..2] {
        assert_eq!(wait_for(out, "upstream ", dl), "upstream hub hub");
    }
    tb.publish(4);
    for out in &actors {
        assert_eq!(wait_for(out, "active 4 ", dl), tb.active_line(4));
    }
    for name in ["eu-1", "eu-2", "us-1"] {
        tb.assert_store_is(name, 4);
    }
}

fn le_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
