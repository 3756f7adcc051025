//! `starling demo` as a user runs it: real child processes (hub, relays, actors), emulated WAN
//! links, the built-in trainer; then its summary and plot, and its refusals.

use std::process::Command;
use std::sync::{Mutex, MutexGuard};

fn starling() -> Command {
    Command::new(env!("CARGO_BIN_EXE_starling"))
}

/// Held by each test that runs a whole demo. A demo picks free ports by binding port 0 and
/// hands them to its children, so two demos starting at once can pick the same port and one
/// of them stops; tests of one binary run in parallel, so they take turns here.
fn one_demo_at_a_time() -> MutexGuard<'static, ()> {
    static DEMOS: Mutex<()> = Mutex::new(());
    DEMOS.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_short_run_trains_through_the_hub_and_leaves_a_summary_and_a_plot() {
    let _turn = one_demo_at_a_time();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let o = starling()
        .args([
            "demo",
            "--steps",
            "4",
            "--groups",
            "8",
            "--warm-steps",
            "20",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("run the demo");
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "demo failed:\n{text}");

    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary.json"))
            .expect("summary parses");
    assert_eq!(s["mode"], "delta");
    let steps = s["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 4);
    for (i, st) in steps.iter().enumerate() {
        let r = &st["report"];
        assert_eq!(
            r["published"]["version"].as_u64(),
            Some(i as u64 + 1),
            "versions in order"
        );
        // The trainer hands each step's file to the hub, which takes it rather than copying.
        assert_eq!(r["published"]["handed_over"], true, "{}", r["published"]);
        let reward = r["mean_reward"].as_f64().expect("reward");
        assert!((0.0..=1.0).contains(&reward), "reward {reward}");
        assert_eq!(
            r["groups_accepted"].as_u64(),
            Some(8),
            "every group accepted once"
        );
        assert_eq!(r["samples"].as_u64(), Some(64));
        // One-step lag at most: the batch's tokens come from its version or the one before.
        let (lo, hi) = (
            r["sample_versions"][0].as_u64(),
            r["sample_versions"][1].as_u64(),
        );
        let bv = r["batch_version"].as_u64().expect("batch version");
        assert!(
            lo >= Some(bv) && hi <= Some(bv + 1),
            "{lo:?}..{hi:?} for batch at v{bv}"
        );
        assert!(r["published"]["delta_bytes"].as_u64() > Some(0));
    }
    let deltas = s["bytes"]["deltas"].as_f64().expect("delta bytes");
    let full = s["bytes"]["full_checkpoints"].as_f64().expect("full bytes");
    assert!(
        deltas > 0.0 && deltas < full,
        "deltas {deltas} vs full {full}"
    );
    let share: f64 = s["per_actor_share"]
        .as_object()
        .expect("shares")
        .values()
        .filter_map(serde_json::Value::as_f64)
        .sum();
    assert!((share - 1.0).abs() < 1e-6, "shares sum to {share}");
    for region in ["eu", "ap"] {
        let t = s["mean_transfer_s"][region]
            .as_f64()
            .expect("a transfer time per region");
        assert!(t > 0.0 && t < 60.0, "{region}: {t}");
    }
    // Every consumed rollout was recomputed on its version's weights, and matched bit for bit.
    assert_eq!(
        s["behaviour_check"]["verified_samples"].as_u64(),
        Some(4 * 64)
    );
    assert_eq!(s["behaviour_check"]["mismatches"].as_u64(), Some(0));
    // Each region's link carried at least the deltas once (the relay's copy).
    for region in ["eu", "ap"] {
        let to_region = s["link_bytes"][region]["to_region"]
            .as_f64()
            .expect("link bytes");
        assert!(to_region >= deltas, "{region}: {to_region} < {deltas}");
    }
    let density = s["delta_density"].as_f64().expect("density");
    assert!(density > 0.0 && density <= 1.0, "density {density}");
    let png = std::fs::read(out.join("summary.png")).expect("summary.png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(out.join("logs/hub.log").is_file());

    // The same output directory again: refused before anything starts.
    let again = starling()
        .args(["demo", "--out"])
        .arg(&out)
        .output()
        .expect("run");
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("exists") && err.contains("--out"), "{err}");
}

/// The process ids whose parent is `parent`, from `/proc`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("list /proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// Running: present in `/proc` and not a zombie.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next().map(|st| st != "Z"))
        })
        .unwrap_or(false)
}

#[test]
fn a_sigterm_stops_the_demo_and_every_process_it_started() {
    use std::io::BufRead;
    let _turn = one_demo_at_a_time();
    let dir = tempfile::tempdir().expect("tempdir");
    let stderr_path = dir.path().join("demo.stderr");
    let mut demo = starling()
        .args(["demo", "--steps", "50", "--warm-steps", "20", "--out"])
        .arg(dir.path().join("run"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).expect("stderr file"))
        .spawn()
        .expect("start the demo");
    let stdout = demo.stdout.take().expect("stdout");
    // Once every actor is registered, the hub, relays and actors are all running.
    let mut lines = std::io::BufReader::new(stdout).lines();
    let ready = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains("registered for work"));
    assert!(
        ready,
        "the demo never got its actors registered; its stderr:\n{}",
        std::fs::read_to_string(&stderr_path).unwrap_or_default()
    );
    let kids = children_of(demo.id());
    assert!(kids.len() >= 4, "hub, relays and actors: {kids:?}");
    let status = Command::new("kill")
        .args(["-TERM", &demo.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let exit = loop {
        if let Some(s) = demo.try_wait().expect("wait") {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the demo did not stop within 30 s of SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(exit.code(), Some(128 + 15), "exit status 128 + SIGTERM");
    let left: Vec<u32> = kids.into_iter().filter(|&p| running(p)).collect();
    assert!(left.is_empty(), "children left running: {left:?}");
}

#[test]
fn a_port_in_use_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = busy.local_addr().expect("addr").port();
    let o = starling()
        .args([
            "demo",
            "--warm-steps",
            "1",
            "--http-port",
            &port.to_string(),
            "--out",
        ])
        .arg(dir.path().join("run"))
        .output()
        .expect("run");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("in use") && err.contains("--http-port"),
        "{err}"
    );
}

#[test]
fn compare_runs_every_mode_and_no_transfer_ships_no_weights() {
    let _turn = one_demo_at_a_time();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("cmp");
    let o = starling()
        .args([
            "demo",
            "--compare",
            "--steps",
            "3",
            "--groups",
            "6",
            "--warm-steps",
            "10",
            "--link-mbit",
            "eu=20,ap=10",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("run the comparison");
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "compare failed:\n{text}");
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("compare.json")).expect("compare.json"))
            .expect("compare.json parses");
    let runs = c["runs"].as_array().expect("runs");
    let modes: Vec<&str> = runs.iter().filter_map(|r| r["mode"].as_str()).collect();
    assert_eq!(modes, ["delta", "no-transfer", "full-broadcast"]);
    let summary = |mode: &str| {
        &runs
            .iter()
            .find(|r| r["mode"] == mode)
            .expect("the mode ran")["summary"]
    };
    let to_region = |mode: &str, region: &str| {
        summary(mode)["link_bytes"][region]["to_region"]
            .as_f64()
            .expect("link bytes")
    };
    for mode in ["delta", "no-transfer", "full-broadcast"] {
        let s = summary(mode);
        assert_eq!(s["steps"].as_array().map(Vec::len), Some(3), "{mode}");
        assert_eq!(
            s["behaviour_check"]["mismatches"].as_u64(),
            Some(0),
            "{mode}"
        );
        assert!(
            s["throughput"]["rollout_tokens_per_s"].as_f64() > Some(0.0),
            "{mode}"
        );
    }
    let deltas = summary("delta")["bytes"]["deltas"]
        .as_f64()
        .expect("deltas");
    for region in ["eu", "ap"] {
        // Without transfer only job traffic crosses the link: less than one step's delta per
        // step; with deltas at least every delta once; full checkpoints more than deltas.
        let (none, delta, full) = (
            to_region("no-transfer", region),
            to_region("delta", region),
            to_region("full-broadcast", region),
        );
        assert!(none < deltas, "{region}: no-transfer carried {none} B");
        assert!(
            delta >= deltas,
            "{region}: delta carried {delta} B < {deltas}"
        );
        assert!(full > delta, "{region}: full {full} B <= delta {delta} B");
    }
    for key in [
        "delta_over_no_transfer_steps_per_hour",
        "delta_over_full_broadcast_steps_per_hour",
    ] {
        let r = c["ratios"][key].as_f64().expect("ratio");
        assert!(r.is_finite() && r > 0.0, "{key} = {r}");
    }
    assert!(
        out.join("r1-no-transfer/shared-weights/v00000003.safetensors")
            .is_file()
    );
}
