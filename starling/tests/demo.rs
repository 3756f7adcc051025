//! `starling demo` as a user runs it: real child processes (hub, relays, actors), emulated WAN
//! links, the built-in trainer; then its summary and plot, and its refusals.

use std::process::Command;

fn starling() -> Command {
    Command::new(env!("CARGO_BIN_EXE_starling"))
}

#[test]
fn a_short_run_trains_through_the_hub_and_leaves_a_summary_and_a_plot() {
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
