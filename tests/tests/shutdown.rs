//! Shutdown parity with the hub: an actor stopped with SIGTERM in the middle of a batch
//! finishes the generation it is running, submits the results, waits for the hub's verdicts
//! and only then exits (within its grace period, `starling_actor::SHUTDOWN_GRACE`).
//!
//! A hub and one actor on the built-in engine, slowed down so that one generation call of
//! four groups lasts seconds; the trainer asks for those four groups. Once the hub has leased
//! all four to the actor and accepted none, the actor gets SIGTERM. It must exit 0, and the
//! hub must hold all four results, each accepted on its first attempt and from this actor: its
//! in-flight work was submitted before it exited, not re-offered after its connection closed.
//! Against the branch point's actor (which dropped everything on SIGTERM) the results are
//! missing and the groups are released with the connection (`leases_released_total`). ~10 s.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use starling_tests::{Testbed, http_request, metric, wait_for};

fn call(tb: &Testbed, token: &str, method: &str, path: &str, body: Option<&Value>) -> Value {
    let body = body.map(|b| b.to_string());
    let (status, text) = http_request(&tb.hub_http, method, path, Some(token), body.as_deref());
    assert!(
        (200..300).contains(&status),
        "{method} {path}: {status} {text}"
    );
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

fn hub_metric(tb: &Testbed, series: &str) -> f64 {
    metric(&tb.hub_metrics(), series).unwrap_or(0.0)
}

#[test]
fn an_actor_stopped_mid_batch_submits_its_results_before_it_exits() {
    let peers = [("actor", "a1"), ("trainer", "t1")];
    let mut tb = Testbed::with_model("tiny", 1e-4, 0, 9, &peers, &[], &[]);
    let dl = tb.deadline;
    let out = tb.actor_with(
        "a1",
        &[],
        &[
            "--engine",
            "builtin",
            "--engine-slowdown",
            "30",
            "--claim",
            "4",
            "--max-batch",
            "16",
        ],
    );
    wait_for(&out, "worker connected", dl);
    let token =
        starling_transport::identity::load_trainer_token(&tb.root.join("t1")).expect("token");
    let groups: Vec<Value> = (0..4)
        .map(|i| {
            json!({
                "prompt": format!("{i}+{i}="),
                "n": 2,
                "verifier": "none",
                "sampling": {"max_new_tokens": 24, "stop_token_ids": []},
            })
        })
        .collect();
    let batch = call(
        &tb,
        &token,
        "POST",
        "/v1/batches",
        Some(&json!({"groups": groups})),
    );
    let batch = batch["batch"].as_u64().expect("batch id");

    // All four leased to the actor (one generation call), none accepted yet.
    loop {
        assert!(Instant::now() < dl, "the actor never held the four groups");
        if hub_metric(&tb, "starling_hub_jobs_leased_total") >= 4.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        hub_metric(&tb, "starling_hub_results_accepted_total"),
        0.0,
        "the generation must still be running when the actor is stopped"
    );
    // Processes: 0 hub, 1 actor.
    let grace = starling_actor::SHUTDOWN_GRACE + Duration::from_secs(5);
    let (status, took) = tb.terminate(1, grace);
    assert!(
        status.success(),
        "the actor on SIGTERM: {status} after {took:?}"
    );
    let mut said = Vec::new();
    while let Ok(line) = out.recv_timeout(Duration::from_millis(100)) {
        said.push(line);
    }
    assert!(
        said.iter().any(|l| l == "submitted 4 accepted 4"),
        "the actor submitted its four results before it exited ({took:?} after SIGTERM): {said:?}"
    );

    // The hub holds every result, each from a1 on its first attempt.
    let v = call(
        &tb,
        &token,
        "GET",
        &format!("/v1/batches/{batch}/results?after=0&limit=50"),
        None,
    );
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 4, "{v}");
    for r in results {
        assert_eq!(r["attempt"], 1, "re-offered after the actor left: {r}");
        assert_eq!(r["actor"], "a1", "{r}");
    }
    assert_eq!(v["done"], true, "{v}");
    assert_eq!(hub_metric(&tb, "starling_hub_results_accepted_total"), 4.0);
    let released = "starling_hub_leases_released_total{reason=\"connection_closed\"}";
    assert_eq!(
        hub_metric(&tb, released),
        0.0,
        "nothing was left to release"
    );
    println!("the actor exited {took:?} after SIGTERM, its four results accepted");
}
