//! Rollouts on the ledger, end to end with real processes: a hub, two regions each with a
//! relay and two actors running the built-in engine, and a trainer speaking the HTTP API with
//! its token. Several batches run across version changes; every accepted group is checked
//! from outside: exactly once per job, every group of a batch present, every token from a
//! version within the batch's staleness bound, every log-probability equal bit for bit to a
//! separate forward pass over the trainer's checkpoint of that version, every reward equal to
//! the verifier's. Then the faults: an actor SIGKILLed mid-batch, the hub SIGKILLed mid-batch
//! and restarted with the same command, a relay SIGKILLed while jobs run. Each test runs on
//! SQLite and, when `STARLING_TEST_POSTGRES_URL` is set, on PostgreSQL.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use starling_checkpoint::safetensors::Checkpoint;
use starling_engine::{Model, ModelConfig};
use starling_hub::verify::Verifier;
use starling_tests::{Testbed, http_request, postgres_database, wait_for};

/// The trainer side: HTTP with the trainer token.
struct Trainer {
    http: String,
    token: String,
}

impl Trainer {
    fn new(tb: &Testbed) -> Self {
        let token = starling_transport::identity::load_trainer_token(&tb.root.join("t1"))
            .expect("trainer token");
        Trainer {
            http: tb.hub_http.clone(),
            token,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string());
        let (status, text) =
            http_request(&self.http, method, path, Some(&self.token), body.as_deref());
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, v)
    }

    fn submit(&self, body: &Value) -> u64 {
        let (status, v) = self.call("POST", "/v1/batches", Some(body));
        assert_eq!(status, 201, "{v}");
        v["batch"].as_u64().expect("batch id")
    }

    fn status(&self, batch: u64) -> Value {
        let (status, v) = self.call("GET", &format!("/v1/batches/{batch}"), None);
        assert_eq!(status, 200, "{v}");
        v
    }

    /// Every accepted group of `batch`, read with the cursor until the batch is finished.
    fn drain(&self, batch: u64, deadline: Instant) -> Vec<Value> {
        let mut out = Vec::new();
        let mut cursor = 0u64;
        loop {
            assert!(
                Instant::now() < deadline,
                "batch {batch} did not finish: {}",
                self.status(batch)
            );
            let (status, v) = self.call(
                "GET",
                &format!("/v1/batches/{batch}/results?after={cursor}&limit=5&wait_ms=2000"),
                None,
            );
            assert_eq!(status, 200, "{v}");
            for r in v["results"].as_array().expect("results") {
                let c = r["cursor"].as_u64().expect("cursor");
                assert!(c > cursor, "cursors increase");
                cursor = c;
                out.push(r.clone());
            }
            if v["done"].as_bool() == Some(true) {
                return out;
            }
        }
    }
}

/// A batch of `groups` addition prompts ("12+30="), `n` samples each, numeric verifier.
fn additions(version: Option<u64>, groups: u32, n: u32, seed: u64) -> (Value, Vec<String>) {
    let mut answers = Vec::new();
    let gs: Vec<Value> = (0..groups)
        .map(|i| {
            let (a, b) = (10 + i * 7 % 50, 3 + i * 13 % 40);
            answers.push((a + b).to_string());
            json!({"prompt": format!("{a}+{b}="), "n": n, "verifier": "numeric", "answer": (a + b).to_string()})
        })
        .collect();
    let mut body = json!({
        "sampling": {"temperature": 1.0, "max_new_tokens": 12, "seed": seed},
        "groups": gs,
    });
    if let Some(v) = version {
        body["version"] = json!(v);
    }
    (body, answers)
}

/// The cluster: two regions, each a relay and two actors with the built-in engine.
struct Cluster {
    tb: Testbed,
    actors: BTreeMap<String, mpsc::Receiver<String>>,
    /// Each relay's stdout, kept open (a relay whose stdout closes dies writing to it).
    relays: BTreeMap<String, mpsc::Receiver<String>>,
}

fn cluster(versions: u32, ledger: Option<String>, slowdown: &str, hub_extra: &[&str]) -> Cluster {
    let peers = [
        ("relay", "r1"),
        ("relay", "r2"),
        ("actor", "a1"),
        ("actor", "a2"),
        ("actor", "a3"),
        ("actor", "a4"),
        ("trainer", "t1"),
    ];
    let mut hub_args: Vec<&str> = hub_extra.to_vec();
    if let Some(url) = &ledger {
        hub_args.extend(["--ledger", url.as_str()]);
    }
    let mut tb = Testbed::with_model("tiny", 1e-4, versions, 21, &peers, &[], &hub_args);
    let mut relays = BTreeMap::new();
    let mut actors = BTreeMap::new();
    for (region, names) in [("r1", ["a1", "a2"]), ("r2", ["a3", "a4"])] {
        let (addr, out) = tb.relay(region);
        relays.insert(region.to_owned(), out);
        for a in names {
            let rx = tb.actor_with(
                a,
                &[format!("{region}@{addr}")],
                &[
                    "--engine",
                    "builtin",
                    "--region",
                    region,
                    "--engine-slowdown",
                    slowdown,
                    "--claim",
                    "2",
                ],
            );
            actors.insert(a.to_owned(), rx);
        }
    }
    for rx in actors.values() {
        wait_for(rx, "worker connected", tb.deadline);
    }
    Cluster { tb, actors, relays }
}

impl Cluster {
    fn wait_active(&self, k: usize) {
        for rx in self.actors.values() {
            assert_eq!(
                wait_for(rx, &format!("active {k} "), self.tb.deadline),
                self.tb.active_line(k)
            );
        }
    }
}

/// The trainer's weights of each version, as engine models (the separate forward pass).
struct Reference {
    config: ModelConfig,
    models: BTreeMap<u64, Model>,
}

impl Reference {
    fn new(tb: &Testbed) -> Self {
        let dir = tb.steps[0].parent().expect("checkpoint dir");
        let config = ModelConfig::from_file(&dir.join("config.json")).expect("config.json");
        Reference {
            config,
            models: BTreeMap::new(),
        }
    }

    fn model(&mut self, tb: &Testbed, version: u64) -> &Model {
        let config = self.config.clone();
        self.models.entry(version).or_insert_with(|| {
            let w = Checkpoint::open(&tb.steps[version as usize])
                .expect("open")
                .read_all()
                .expect("read");
            let shapes: BTreeMap<String, Vec<usize>> = config.tensor_shapes().into_iter().collect();
            Model::from_bf16(config, |n| {
                Some((shapes.get(n)?.as_slice(), w.get(n)?.as_slice()))
            })
            .expect("load reference model")
        })
    }
}

/// The newest version published at or before `at_ms`.
fn latest_at(versions: &[(u64, i64)], at_ms: i64) -> u64 {
    versions
        .iter()
        .filter(|(_, t)| *t <= at_ms)
        .map(|(v, _)| *v)
        .max()
        .unwrap_or(0)
}

fn published(trainer: &Trainer) -> Vec<(u64, i64)> {
    let (_, v) = trainer.call("GET", "/v1/versions", None);
    v["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .map(|r| {
            (
                r["version"].as_u64().expect("v"),
                r["created_at_ms"].as_i64().expect("t"),
            )
        })
        .collect()
}

/// Checks one finished batch from outside; returns how many samples it checked.
#[allow(clippy::too_many_arguments)]
fn check_batch(
    tb: &Testbed,
    trainer: &Trainer,
    reference: &mut Reference,
    batch: u64,
    version: u64,
    groups: u32,
    n: u32,
    answers: &[String],
    max_staleness: u64,
) -> usize {
    let results = trainer.drain(batch, tb.deadline);
    let status = trainer.status(batch);
    assert_eq!(status["state"], "done", "{status}");
    assert_eq!(
        status["groups"]["done"].as_u64(),
        Some(u64::from(groups)),
        "{status}"
    );
    let versions = published(trainer);
    let mut jobs = BTreeSet::new();
    let mut seen_groups = BTreeSet::new();
    let mut checked = 0;
    for r in &results {
        assert!(
            jobs.insert(r["job"].as_u64().expect("job")),
            "a job accepted twice: {r}"
        );
        let g = r["group"].as_u64().expect("group");
        assert!(seen_groups.insert(g), "group {g} delivered twice");
        let v = r["version"].as_u64().expect("version");
        let latest = latest_at(
            &versions,
            r["accepted_at_ms"].as_i64().expect("accepted_at"),
        );
        assert!(
            v >= version,
            "group {g} from {v}, older than the batch's {version}"
        );
        assert!(
            v + max_staleness >= latest,
            "group {g} from {v} accepted when {latest} was the newest (bound {max_staleness})"
        );
        let prompt: Vec<u32> = serde_json::from_value(r["prompt_ids"].clone()).expect("prompt");
        let samples = r["samples"].as_array().expect("samples");
        assert_eq!(samples.len(), n as usize);
        for s in samples {
            let tokens: Vec<u32> = serde_json::from_value(s["tokens"].clone()).expect("tokens");
            let logprobs: Vec<f32> = serde_json::from_value(s["logprobs"].clone()).expect("lp");
            let spans = s["versions"].as_array().expect("spans");
            for sp in spans {
                assert_eq!(
                    sp["version"].as_u64(),
                    Some(v),
                    "one version per sample: {s}"
                );
            }
            let recomputed = reference
                .model(tb, v)
                .score(&prompt, &tokens, 1.0)
                .expect("score");
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&logprobs),
                bits(&recomputed),
                "group {g}: log-probabilities differ from a forward pass over version {v}"
            );
            let reward = Verifier::Numeric.reward(&tokens, &[2], &answers[g as usize]);
            assert_eq!(s["reward"].as_f64(), Some(f64::from(reward)));
            checked += 1;
        }
    }
    assert_eq!(
        seen_groups,
        (0..u64::from(groups)).collect(),
        "every group of batch {batch} exactly once"
    );
    checked
}

fn check_ledger(url: &str) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let l = starling_ledger::Ledger::open(url, starling_ledger::LedgerConfig::default())
            .await
            .expect("open ledger");
        l.check_invariants().await.expect("ledger invariants");
        l.close().await;
    });
}

fn ledger_url(tb: &Testbed, pg: &Option<String>) -> String {
    pg.clone()
        .unwrap_or_else(|| format!("sqlite:{}", tb.root.join("hub-store/ledger.db").display()))
}

fn batches_across_versions(pg: Option<String>) {
    let c = cluster(3, pg.clone(), "1", &[]);
    let tb = &c.tb;
    let trainer = Trainer::new(tb);
    let mut reference = Reference::new(tb);
    let mut checked = 0;

    // Version 0.
    let (body, answers) = additions(None, 12, 4, 7);
    let b = trainer.submit(&body);
    checked += check_batch(tb, &trainer, &mut reference, b, 0, 12, 4, &answers, 1);

    // Version 1, and version 2 published while its batch runs: both are within the bound.
    tb.publish(1);
    c.wait_active(1);
    let (body, answers) = additions(None, 16, 4, 8);
    let b = trainer.submit(&body);
    tb.publish(2);
    checked += check_batch(tb, &trainer, &mut reference, b, 1, 16, 4, &answers, 1);
    c.wait_active(2);

    // A batch pinned to version 1 after 3 is out, bound 2: actors on 3 generate it.
    tb.publish(3);
    c.wait_active(3);
    let (mut body, answers) = additions(Some(1), 8, 2, 9);
    body["max_staleness"] = json!(2);
    let b = trainer.submit(&body);
    checked += check_batch(tb, &trainer, &mut reference, b, 1, 8, 2, &answers, 2);
    assert!(checked >= 48 + 64 + 16);

    // Bad input is refused with a code and changes nothing.
    let bad = [
        (json!({"groups": []}), 400, "invalid_batch"),
        (
            json!({"groups": [{"prompt": "1+1=", "n": 0, "verifier": "numeric"}]}),
            400,
            "invalid_batch",
        ),
        (
            json!({"groups": [{"prompt": "1+1=", "n": 1, "verifier": "regex"}]}),
            400,
            "unknown_verifier",
        ),
        (
            json!({"version": 99, "groups": [{"prompt": "1", "n": 1, "verifier": "none"}]}),
            409,
            "unknown_version",
        ),
        (
            json!({"groups": [{"prompt": "x", "n": 1, "verifier": "none", "sampling": {"max_new_tokens": 5000}}]}),
            400,
            "prompt_too_long",
        ),
        (json!({"groups": "nope"}), 400, "bad_request"),
    ];
    for (body, status, code) in bad {
        let (s, v) = trainer.call("POST", "/v1/batches", Some(&body));
        assert_eq!(
            (s, v["code"].as_str()),
            (status, Some(code)),
            "{body} → {v}"
        );
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let (s, v) = http_request(&trainer.http, "POST", "/v1/batches", None, Some("{}"));
    assert_eq!(s, 401, "no token: {v}");
    let (s, _) = http_request(
        &trainer.http,
        "POST",
        "/v1/batches",
        Some("trainer.t1.00"),
        Some("{}"),
    );
    assert_eq!(s, 401, "a forged token");
    let (s, v) = trainer.call("GET", "/v1/batches/987654", None);
    assert_eq!((s, v["code"].as_str()), (404, Some("not_found")));
    check_ledger(&ledger_url(tb, &pg));
}

#[test]
fn batches_across_versions_sqlite() {
    batches_across_versions(None);
}

#[test]
fn batches_across_versions_postgres() {
    match postgres_database("batches_across_versions_postgres") {
        Some(url) => batches_across_versions(Some(url)),
        None => println!("skipped on PostgreSQL: STARLING_TEST_POSTGRES_URL is not set"),
    }
}

/// Waits until `batch` has at least `done` groups done.
fn wait_done(trainer: &Trainer, batch: u64, done: u64, deadline: Instant) {
    loop {
        let s = trainer.status(batch);
        if s["groups"]["done"].as_u64().unwrap_or(0) >= done {
            return;
        }
        assert!(Instant::now() < deadline, "batch {batch} stuck: {s}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn faults(pg: Option<String>) {
    // Slow engines, so that faults land mid-batch; leases longer than the transport takes to
    // see a SIGKILLed peer's connection die (its 5 s idle timeout), so that a killed actor's
    // groups can only come back early through the release on connection close, which is what
    // this checks (with 4 s leases they expired first, and the check could not tell).
    let hub = [
        "--lease-initial",
        "30",
        "--lease-floor",
        "15",
        "--actor-timeout",
        "3",
    ];
    let mut c = cluster(2, pg.clone(), "50", &hub);
    let trainer = Trainer::new(&c.tb);
    let mut reference = Reference::new(&c.tb);
    let dl = c.tb.deadline;

    // An actor SIGKILLed while it holds leases: its groups come back when the hub sees its
    // connection close (`leases.rs` times it).
    let (body, answers) = additions(None, 24, 4, 11);
    let b = trainer.submit(&body);
    // Right after a submit the worker claims its next groups and generates them (slowly):
    // killed now, it dies holding leases. Whichever actor submits first: on a loaded machine
    // the scheduler may have left a given actor out of this batch (a missed heartbeat under
    // `--actor-timeout 3` makes it ineligible), and waiting on that one never ends.
    let victim = first_to_print(&c.actors, "submitted ", dl);
    std::thread::sleep(Duration::from_millis(100));
    kill_named(&mut c, &victim);
    check_batch(&c.tb, &trainer, &mut reference, b, 0, 24, 4, &answers, 1);
    let released = starling_tests::metric(
        &c.tb.hub_metrics(),
        "starling_hub_leases_released_total{reason=\"connection_closed\"}",
    );
    assert!(
        released.unwrap_or(0.0) >= 1.0,
        "{victim}'s leases were released and re-offered"
    );

    // The hub SIGKILLed mid-batch and restarted with the same command: the batch, its leases
    // and accepted results are intact, actors reconnect, the batch completes.
    let (body, answers) = additions(None, 24, 4, 12);
    let b = trainer.submit(&body);
    wait_done(&trainer, b, 3, dl);
    let before = trainer.status(b)["groups"]["done"].as_u64().unwrap_or(0);
    c.tb.kill_hub();
    c.tb.restart_hub();
    let after = trainer.status(b)["groups"]["done"].as_u64().unwrap_or(0);
    assert!(
        after >= before,
        "accepted results survive the restart ({before} → {after})"
    );
    check_batch(&c.tb, &trainer, &mut reference, b, 0, 24, 4, &answers, 1);
    // Publishing continues with the next number.
    c.tb.publish(1);
    assert_eq!(published(&trainer).first().map(|v| v.0), Some(1));
    // Every actor but the one killed.
    for rx in c.actors.values() {
        assert_eq!(wait_for(rx, "active 1 ", dl), c.tb.active_line(1));
    }

    // A relay SIGKILLed while jobs run: jobs keep flowing (they go to the hub directly).
    let (body, answers) = additions(None, 24, 4, 13);
    let b = trainer.submit(&body);
    wait_done(&trainer, b, 2, dl);
    kill_relay(&mut c, "r1");
    check_batch(&c.tb, &trainer, &mut reference, b, 1, 24, 4, &answers, 1);
    check_ledger(&ledger_url(&c.tb, &pg));
}

/// The name of the first of `actors` to print a line starting with `what` (lines before it
/// are consumed).
fn first_to_print(
    actors: &BTreeMap<String, mpsc::Receiver<String>>,
    what: &str,
    deadline: Instant,
) -> String {
    loop {
        for (name, rx) in actors {
            while let Ok(line) = rx.try_recv() {
                if line.starts_with(what) {
                    return name.clone();
                }
            }
        }
        assert!(Instant::now() < deadline, "no actor printed {what:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs actor `name` (its store path is on its command line).
fn kill_named(c: &mut Cluster, name: &str) {
    let store = c.tb.store(name);
    c.tb.kill_matching(&store.display().to_string());
    c.actors.remove(name);
}

fn kill_relay(c: &mut Cluster, region: &str) {
    c.tb.kill_matching(&format!("--region {region} --credentials"));
    c.relays.remove(region);
}

#[test]
fn faults_sqlite() {
    faults(None);
}

#[test]
fn faults_postgres() {
    match postgres_database("faults_postgres") {
        Some(url) => faults(Some(url)),
        None => println!("skipped on PostgreSQL: STARLING_TEST_POSTGRES_URL is not set"),
    }
}
