//! A hostile or broken actor against the real hub: this test speaks the job protocol itself
//! with a cluster's actor credentials and submits what an honest actor never would — a job
//! it does not hold, the wrong weight digest, a version nobody published, the wrong number of
//! samples, a duplicate, a result after its lease expired, garbage bytes. Each is refused
//! with its reason, counted in `/metrics` and in the batch's status, and the ledger's
//! invariants hold; the honest result is accepted exactly once. A certificate that opens more
//! subscriptions than the hub's bound is refused by name until one of them ends.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use starling_proto::delta::apply::full_digest;
use starling_proto::protocol::msg::{Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole};
use starling_proto::protocol::rollout::{
    FinishReason, JobResult, JobSpec, Sample, Verdict, VersionSpan,
};
use starling_tests::{Testbed, WorkClient, http_request, metric};
use starling_transport::endpoint::{client_config, client_endpoint};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{Upstream, UpstreamEvent};

/// A well-formed result for `job` claiming `version` with `digest`, `n` samples.
fn result(job: &JobSpec, version: u64, digest: [u8; 16], n: u32) -> JobResult {
    let sample = Sample {
        tokens: vec![50, 51, 2],
        logprobs: vec![-0.5, -0.25, -0.125],
        finish: FinishReason::Stop,
        spans: vec![VersionSpan {
            version,
            start: 0,
            end: 3,
        }],
        ttft_us: 100,
        decode_us: 1_000,
    };
    JobResult {
        job: job.job,
        attempt: job.attempt,
        version,
        digest,
        elapsed_us: 2_000,
        samples: vec![sample; n as usize],
    }
}

fn code(v: &Verdict) -> &str {
    match v {
        Verdict::Accepted => "accepted",
        Verdict::Refused { code, .. } => code,
    }
}

#[test]
fn a_rogue_actor_is_refused_with_reasons_and_the_ledger_stays_consistent() {
    let peers = [("actor", "rogue"), ("trainer", "t1")];
    let tb = Testbed::with_model(
        "tiny",
        1e-4,
        1,
        3,
        &peers,
        &[],
        &["--lease-initial", "2", "--lease-floor", "1"],
    );
    let w = tb.weights(0);
    let names: Vec<String> = w.keys().cloned().collect();
    let d0 = full_digest("tiny", &w, &names).to_bytes();
    let token = starling_transport::identity::load_trainer_token(&tb.root.join("t1"))
        .expect("trainer token");
    let groups: Vec<Value> = (0..6)
        .map(|i| json!({"prompt": format!("{i}+1="), "n": 2, "verifier": "numeric", "answer": (i + 1).to_string()}))
        .collect();
    let body = json!({"groups": groups, "sampling": {"max_new_tokens": 8}}).to_string();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut rogue = WorkClient::connect(&tb, "rogue", (0, d0)).await;
        // Let the heartbeat land before the batch is scheduled.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, answer) = http_request(
            &tb.hub_http,
            "POST",
            "/v1/batches",
            Some(&token),
            Some(&body),
        );
        assert_eq!(status, 201, "{answer}");
        let batch: Value = serde_json::from_str(&answer).expect("json");
        let batch = batch["batch"].as_u64().expect("batch");
        let mut jobs = Vec::new();
        for _ in 0..50 {
            jobs = rogue.claim(6).await;
            if !jobs.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(jobs.len(), 6, "the only actor gets the whole batch");
        let mut got = BTreeMap::new();
        let mut ghost = result(&jobs[0], 0, d0, 2);
        ghost.job = 9_999_999;
        got.insert("unknown job", code(&rogue.submit(ghost).await).to_owned());
        got.insert(
            "wrong digest",
            code(&rogue.submit(result(&jobs[0], 0, [7; 16], 2)).await).to_owned(),
        );
        got.insert(
            "unpublished version",
            code(&rogue.submit(result(&jobs[0], 5, d0, 2)).await).to_owned(),
        );
        got.insert(
            "wrong n",
            code(&rogue.submit(result(&jobs[0], 0, d0, 1)).await).to_owned(),
        );
        got.insert(
            "honest",
            code(&rogue.submit(result(&jobs[1], 0, d0, 2)).await).to_owned(),
        );
        got.insert(
            "twice",
            code(&rogue.submit(result(&jobs[1], 0, d0, 2)).await).to_owned(),
        );
        // Past its lease (2 s initially): the sweep returns the job to the pool.
        tokio::time::sleep(Duration::from_millis(3_000)).await;
        got.insert(
            "expired",
            code(&rogue.submit(result(&jobs[2], 0, d0, 2)).await).to_owned(),
        );
        let want: BTreeMap<&str, String> = [
            ("unknown job", "unknown_job"),
            ("wrong digest", "digest"),
            ("unpublished version", "unknown_version"),
            ("wrong n", "invalid_result"),
            ("honest", "accepted"),
            ("twice", "duplicate"),
            ("expired", "lease_expired"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_owned()))
        .collect();
        assert_eq!(got, want);

        // Refusals are counted per reason, in /metrics and in the batch's status.
        let m = tb.hub_metrics();
        for reason in [
            "unknown_job",
            "digest",
            "unknown_version",
            "invalid_result",
            "duplicate",
            "lease_expired",
        ] {
            let series = format!("starling_hub_results_refused_total{{reason=\"{reason}\"}}");
            assert_eq!(metric(&m, &series), Some(1.0), "{series}");
        }
        assert_eq!(metric(&m, "starling_hub_results_accepted_total"), Some(1.0));
        let (_, status) = http_request(
            &tb.hub_http,
            "GET",
            &format!("/v1/batches/{batch}"),
            Some(&token),
            None,
        );
        let status: Value = serde_json::from_str(&status).expect("json");
        assert_eq!(status["groups"]["done"], 1, "{status}");
        assert_eq!(status["refused"]["digest"], 1, "{status}");
        assert_eq!(status["refused"]["lease_expired"], 1, "{status}");

        // Garbage on the stream: the hub drops this connection and carries on.
        rogue
            .tx
            .write_all(&[0xFF; 64])
            .await
            .expect("write garbage");
        let closed = tokio::time::timeout(Duration::from_secs(5), rogue.conn.closed()).await;
        assert!(
            closed.is_ok(),
            "the hub closes a connection that sends garbage"
        );
        let (s, _) = http_request(&tb.hub_http, "GET", "/v1/versions", None, None);
        assert_eq!(s, 200, "the hub still serves");
    });
    let url = format!("sqlite:{}", tb.root.join("hub-store/ledger.db").display());
    rt.block_on(async {
        let l = starling_ledger::Ledger::open(&url, starling_ledger::LedgerConfig::default())
            .await
            .expect("open ledger");
        l.check_invariants().await.expect("invariants");
    });
}

/// Subscribes to the hub as `name` on an endpoint of its own and pings: the first answer
/// (anything streamed before it skipped) says whether the subscription is served (`Pong`) or
/// refused.
async fn subscribe_to_hub(tb: &Testbed, name: &str, nonce: u64) -> (Upstream, UpstreamEvent) {
    let creds = Credentials::load_peer(&tb.root.join(name)).expect("credentials");
    let bind = "127.0.0.1:0".parse().expect("addr");
    let ep = client_endpoint(&creds, bind, &LinkProfile::LAN).expect("endpoint");
    let config = client_config(&creds, &LinkProfile::LAN).expect("client config");
    let hello = Message::Hello {
        protocol: PROTOCOL_VERSION,
        role: MsgRole::Actor,
        name: name.into(),
        region: "nowhere".into(),
        model_id: "tiny".into(),
        active: None,
        link: None,
    };
    let hub = tb.hub_addr.parse().expect("hub addr");
    let mut up = Upstream::connect(&ep, config, hub, Role::Hub, "hub", &hello)
        .await
        .expect("admitted");
    up.subscribe(0).await.expect("subscribe");
    up.send(&Message::Ping { nonce }).await.expect("ping");
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), up.next_event())
            .await
            .expect("an answer in time")
            .expect("an event");
        if matches!(
            ev,
            UpstreamEvent::Pong(_) | UpstreamEvent::Refused { .. } | UpstreamEvent::Closed(_)
        ) {
            return (up, ev);
        }
    }
}

#[test]
fn the_hub_serves_one_certificate_at_most_its_bound_of_subscriptions() {
    let tb = Testbed::new(1, 3, &[("actor", "rogue")], &[]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut held = Vec::new();
        for nonce in 0..2 {
            let (up, ev) = subscribe_to_hub(&tb, "rogue", nonce).await;
            assert!(
                matches!(ev, UpstreamEvent::Pong(n) if n == nonce),
                "subscription {nonce} within the default bound of 2: {ev:?}"
            );
            held.push(up);
        }
        let (_over, ev) = subscribe_to_hub(&tb, "rogue", 10).await;
        match ev {
            UpstreamEvent::Refused { reason, detail } => {
                assert_eq!(reason, RefuseReason::TooManyConnections);
                assert!(
                    detail.contains("rogue already holds 2 subscription connections"),
                    "{detail}"
                );
            }
            other => panic!("a third subscription: expected a refusal, got {other:?}"),
        }
        // One leaves: a new one gets in once the hub has seen it end.
        held.remove(0).close();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (up, ev) = subscribe_to_hub(&tb, "rogue", 20).await;
            if matches!(ev, UpstreamEvent::Pong(20)) {
                held.push(up);
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no place freed after a subscription ended: {ev:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for up in held {
            up.close();
        }
    });
    // The hub logs the refusal (stderr; the line starts with its time and level).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let logged = std::iter::from_fn(|| {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        tb.hub_log.recv_timeout(left).ok()
    })
    .any(|line| line.contains("subscription connection refused: rogue already holds 2"));
    assert!(logged, "the hub did not log the refusal");
}
