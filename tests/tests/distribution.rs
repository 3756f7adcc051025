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

#[test]
fn hub_delivers_every_version_to_every_actor_bit_identically() {
    let d = tempfile::tempdir().expect("tempdir");
    let root = d.path();
    let spec = ModelSpec::preset("tiny").expect("preset");
    let steps = generate_to_dir(
        &spec,
        5,
        &TrainConfig {
            seed: 5,
            lr: 1e-5,
            ..TrainConfig::default()
        },
        &root.join("ckpt"),
        &|_| {},
    )
    .expect("generate");
    let hub = bin("starling-hub");
    let actor = bin("starling-actor");
    let cluster = root.join("cluster");
    run_ok(
        Command::new(&hub)
            .args(["init", "--name", "test", "--dir"])
            .arg(&cluster),
    );
    for a in ["a1", "a2"] {
        run_ok(
            Command::new(&hub)
                .args(["issue", "--role", "actor", "--name", a, "--dir"])
                .arg(&cluster)
                .arg("-o")
                .arg(root.join(a)),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut procs = Procs(Vec::new());
    let hub_out = spawn(
        &mut procs,
        Command::new(&hub)
            .env("STARLING_TEST_CORRUPT_VERSION", "2")
            .args([
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
            .arg(&steps[0]),
    );
    let addr = wait_for(&hub_out, "listening on ", deadline)
        .trim_start_matches("listening on ")
        .to_owned();
    let start_actor = |procs: &mut Procs, name: &str| {
        spawn(
            procs,
            Command::new(&actor)
                .args(["--model-id", "tiny", "--hub", &addr, "--credentials"])
                .arg(root.join(name))
                .arg("--init")
                .arg(&steps[0])
                .arg("--store")
                .arg(root.join(format!("{name}-store"))),
        )
    };
    let a1 = start_actor(&mut procs, "a1");
    let mut a2 = start_actor(&mut procs, "a2");
    wait_for(&a1, "active 0 ", deadline);
    wait_for(&a2, "active 0 ", deadline);
    let publish = |k: usize| {
        run_ok(
            Command::new(&hub)
                .args(["publish", "--model-id", "tiny", "--hub", &addr, "--cluster"])
                .arg(&cluster)
                .arg(&steps[k]),
        );
    };
    let digest_of = |k: usize| {
        let w = Checkpoint::open(&steps[k])
            .expect("open")
            .read_all()
            .expect("read");
        let names: Vec<String> = w.keys().cloned().collect();
        full_digest("tiny", &w, &names).to_string()
    };
    for k in 1..=3 {
        publish(k);
        let want = format!("active {k} {}", digest_of(k));
        // The hub corrupts one byte of version 2's first transmission (to whichever actor
        // it serves first): that actor must refuse it, fetch it again, and only then
        // activate the right bits.
        let mut refetched = false;
        for rx in [&a1, &a2] {
            let line = next_event(rx, deadline);
            let line = if line.starts_with("refetch ") {
                assert_eq!(line, format!("refetch {k}"));
                refetched = true;
                next_event(rx, deadline)
            } else {
                line
            };
            assert_eq!(line, want);
        }
        assert_eq!(refetched, k == 2, "exactly version 2 was refetched, once");
    }
    // SIGKILL actor 2 at version 3, publish version 4 without it, restart it from its store.
    let mut killed = procs.0.remove(2);
    killed.kill().expect("SIGKILL a2");
    killed.wait().expect("reap a2");
    publish(4);
    assert_eq!(
        wait_for(&a1, "active 4 ", deadline),
        format!("active 4 {}", digest_of(4))
    );
    a2 = start_actor(&mut procs, "a2");
    assert_eq!(
        wait_for(&a2, "active 3 ", deadline),
        format!("active 3 {}", digest_of(3)),
        "resumed from its store"
    );
    assert_eq!(
        wait_for(&a2, "active 4 ", deadline),
        format!("active 4 {}", digest_of(4)),
        "caught up"
    );
    publish(5);
    for rx in [&a1, &a2] {
        assert_eq!(
            wait_for(rx, "active 5 ", deadline),
            format!("active 5 {}", digest_of(5))
        );
    }
    // Full check of the bits each actor keeps on disk against the trainer's checkpoint.
    let want = Checkpoint::open(&steps[5])
        .expect("open")
        .read_all()
        .expect("read");
    for a in ["a1", "a2"] {
        let got = Checkpoint::open(&root.join(format!("{a}-store/current.safetensors")))
            .expect("open store");
        assert_eq!(got.version(), Some(5));
        let got = got.read_all().expect("read store");
        for (name, w) in &want {
            let g = &got[name];
            assert_eq!(
                blake3::hash(&bytemuck_bytes(g)),
                blake3::hash(&bytemuck_bytes(w)),
                "{a}: tensor {name}"
            );
        }
    }
}

fn bytemuck_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn relays_carry_one_copy_per_region_and_actors_fail_over_to_the_hub() {
    let d = tempfile::tempdir().expect("tempdir");
    let root = d.path();
    let spec = ModelSpec::preset("tiny").expect("preset");
    let steps = generate_to_dir(
        &spec,
        4,
        &TrainConfig {
            seed: 8,
            lr: 1e-5,
            ..TrainConfig::default()
        },
        &root.join("ckpt"),
        &|_| {},
    )
    .expect("generate");
    let hub = bin("starling-hub");
    let actor = bin("starling-actor");
    let relay = bin("starling-relay");
    let cluster = root.join("cluster");
    run_ok(
        Command::new(&hub)
            .args(["init", "--name", "test", "--dir"])
            .arg(&cluster),
    );
    for (role, name) in [
        ("relay", "r-eu"),
        ("relay", "r-us"),
        ("actor", "eu-1"),
        ("actor", "eu-2"),
        ("actor", "us-1"),
    ] {
        run_ok(
            Command::new(&hub)
                .args(["issue", "--role", role, "--name", name, "--dir"])
                .arg(&cluster)
                .arg("-o")
                .arg(root.join(name)),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut procs = Procs(Vec::new());
    let (hub_out, hub_log) = spawn_with_log(
        &mut procs,
        Command::new(&hub)
            .args([
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
            .arg(&steps[0]),
    );
    let addr = wait_for(&hub_out, "listening on ", deadline)
        .trim_start_matches("listening on ")
        .to_owned();
    let mut relay_addrs = Vec::new();
    let mut relay_outs = Vec::new();
    for name in ["r-eu", "r-us"] {
        let out = spawn(
            &mut procs,
            Command::new(&relay)
                .args([
                    "--model-id",
                    "tiny",
                    "--listen",
                    "127.0.0.1:0",
                    "--hub",
                    &addr,
                    "--region",
                    name,
                    "--credentials",
                ])
                .arg(root.join(name)),
        );
        relay_addrs.push(
            wait_for(&out, "listening on ", deadline)
                .trim_start_matches("listening on ")
                .to_owned(),
        );
        relay_outs.push(out);
    }
    let mut actors = Vec::new();
    for (name, r) in [("eu-1", 0), ("eu-2", 0), ("us-1", 1)] {
        let relay_arg = format!("{}@{}", ["r-eu", "r-us"][r], relay_addrs[r]);
        let out = spawn(
            &mut procs,
            Command::new(&actor)
                .args([
                    "--model-id",
                    "tiny",
                    "--hub",
                    &addr,
                    "--relay",
                    &relay_arg,
                    "--credentials",
                ])
                .arg(root.join(name))
                .arg("--init")
                .arg(&steps[0])
                .arg("--store")
                .arg(root.join(format!("{name}-store"))),
        );
        let relay_name = ["r-eu", "r-us"][r];
        assert_eq!(
            wait_for(&out, "upstream ", deadline),
            format!("upstream relay {relay_name}")
        );
        actors.push(out);
    }
    let publish = |k: usize| {
        run_ok(
            Command::new(&hub)
                .args(["publish", "--model-id", "tiny", "--hub", &addr, "--cluster"])
                .arg(&cluster)
                .arg(&steps[k]),
        );
    };
    let digest_of = |k: usize| {
        let w = Checkpoint::open(&steps[k])
            .expect("open")
            .read_all()
            .expect("read");
        let names: Vec<String> = w.keys().cloned().collect();
        full_digest("tiny", &w, &names).to_string()
    };
    for k in 1..=3 {
        publish(k);
        for out in &relay_outs {
            assert_eq!(wait_for(out, "cached ", deadline), format!("cached {k}"));
        }
        for out in &actors {
            assert_eq!(
                wait_for(out, &format!("active {k} "), deadline),
                format!("active {k} {}", digest_of(k))
            );
        }
    }
    // The hub sent each version exactly once per region (to the two relays), never to actors.
    let mut sent: Vec<String> = Vec::new();
    while sent.len() < 6 {
        let line = wait_for(&hub_log, "sent version ", deadline);
        sent.push(line);
    }
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
    // Kill the EU relay: its actors fail over to the hub and keep up.
    let mut r_eu = procs.0.remove(1);
    r_eu.kill().expect("SIGKILL relay");
    r_eu.wait().expect("reap relay");
    for out in &actors[..2] {
        assert_eq!(wait_for(out, "upstream ", deadline), "upstream hub hub");
    }
    publish(4);
    for out in &actors {
        assert_eq!(
            wait_for(out, "active 4 ", deadline),
            format!("active 4 {}", digest_of(4))
        );
    }
    let want = Checkpoint::open(&steps[4])
        .expect("open")
        .read_all()
        .expect("read");
    for name in ["eu-1", "eu-2", "us-1"] {
        let got = Checkpoint::open(&root.join(format!("{name}-store/current.safetensors")))
            .expect("open store")
            .read_all()
            .expect("read");
        assert_eq!(got, want, "{name}");
    }
}
