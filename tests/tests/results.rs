//! Results through the real hub, with a test actor speaking the job protocol itself (so it
//! can send what a broken engine would) and the trainer's HTTP API:
//!
//! - a NaN log-probability is refused (`nonfinite_logprob`), counted, and its group offered
//!   again at once; the trainer never sees a batch `done` without its results;
//! - a group that could never be delivered is refused at submit (`too_large`), and a result
//!   too large for any message is refused by name, failing that group alone, while the
//!   connection and the actor's other results go on;
//! - a verifier asked for without the answer it needs is refused at submit; `math` scores
//!   the boxed answer;
//! - reward services on a real HTTP server this test runs: good answers, a 5xx then a good
//!   one (retried), timeouts, garbage, a 4xx (not retried) and a service that is down (called
//!   again with backoff until 30 × `--reward-timeout`, 15 s here, has passed) — the
//!   actor is answered before any service is called, failing services fail their group
//!   alone with `reward_service`, the rest are readable with the services' rewards;
//! - retention: a batch the trainer read to its end is archived to a file and served from
//!   it, identically, with its rows gone from the ledger.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use starling_engine::ByteTokenizer;
use starling_proto::delta::apply::full_digest;
use starling_proto::protocol::msg::Message;
use starling_proto::protocol::rollout::{
    FinishReason, JobResult, JobSpec, Sample, Verdict, VersionSpan,
};
use starling_tests::{Testbed, WorkClient, http_request, metric};

/// A hub with one test actor (`w`) and a trainer (`t1`).
struct Hub {
    tb: Testbed,
    token: String,
    digest: [u8; 16],
}

impl Hub {
    fn start(args: &[&str]) -> Hub {
        let peers = [("actor", "w"), ("trainer", "t1")];
        let tb = Testbed::with_model("tiny", 1e-4, 0, 5, &peers, &[], args);
        let w = tb.weights(0);
        let names: Vec<String> = w.keys().cloned().collect();
        let digest = full_digest("tiny", &w, &names).to_bytes();
        let token = starling_transport::identity::load_trainer_token(&tb.root.join("t1"))
            .expect("trainer token");
        Hub { tb, token, digest }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let body = body.map(Value::to_string);
        let (status, text) = http_request(
            &self.tb.hub_http,
            method,
            path,
            Some(&self.token),
            body.as_deref(),
        );
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn post(&self, body: &Value) -> u64 {
        let (s, v) = self.call("POST", "/v1/batches", Some(body));
        assert_eq!(s, 201, "{v}");
        v["batch"].as_u64().expect("batch")
    }

    fn status(&self, batch: u64) -> Value {
        let (s, v) = self.call("GET", &format!("/v1/batches/{batch}"), None);
        assert_eq!(s, 200, "{v}");
        v
    }

    /// Every readable result of `batch`, read after the last cursor until `done`.
    fn drain(&self, batch: u64) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut out, mut cursor) = (Vec::new(), 0);
        loop {
            assert!(
                Instant::now() < deadline,
                "not done: {}",
                self.status(batch)
            );
            let (s, v) = self.call(
                "GET",
                &format!("/v1/batches/{batch}/results?after={cursor}&wait_ms=1000"),
                None,
            );
            assert_eq!(s, 200, "{v}");
            for r in v["results"].as_array().expect("results") {
                let c = r["cursor"].as_u64().expect("cursor");
                assert!(c > cursor);
                cursor = c;
                out.push(r.clone());
            }
            if v["done"] == true {
                return out;
            }
        }
    }
}

/// Claims until `n` jobs are held.
async fn claim(w: &mut WorkClient, n: usize) -> Vec<JobSpec> {
    let mut jobs = Vec::new();
    for _ in 0..100 {
        jobs.extend(w.claim(n as u32).await);
        if jobs.len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(jobs.len(), n, "claimed");
    jobs.sort_by_key(|j| j.group);
    jobs
}

/// A result whose samples complete with `texts` (byte tokenizer, then the stop token).
fn result(job: &JobSpec, digest: [u8; 16], texts: &[&str], logprob: f32) -> JobResult {
    JobResult {
        job: job.job,
        attempt: job.attempt,
        version: job.version,
        digest,
        elapsed_us: 1_000,
        samples: texts
            .iter()
            .map(|t| {
                let mut tokens = ByteTokenizer.encode(t);
                tokens.push(ByteTokenizer::EOS);
                let n = tokens.len() as u32;
                Sample {
                    logprobs: vec![logprob; tokens.len()],
                    tokens,
                    finish: FinishReason::Stop,
                    spans: vec![VersionSpan {
                        version: job.version,
                        start: 0,
                        end: n,
                    }],
                    ttft_us: 10,
                    decode_us: 100,
                }
            })
            .collect(),
    }
}

fn verdicts(m: Message) -> Vec<(u64, String)> {
    let Message::Verdicts { verdicts } = m else {
        panic!("not verdicts: {m:?}");
    };
    verdicts
        .into_iter()
        .map(|(j, v)| match v {
            Verdict::Accepted => (j, "accepted".to_owned()),
            Verdict::Refused { code, .. } => (j, code),
        })
        .collect()
}

#[test]
fn broken_results_are_refused_by_name_and_nothing_else_is_lost() {
    let hub = Hub::start(&["--lease-initial", "60"]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut w = WorkClient::connect(&hub.tb, "w", (0, hub.digest)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;

        // Bad input at submit: a verifier without the answer it needs (before: accepted and
        // scored 0), an answer math cannot read, a group no message could carry.
        for (group, status, code) in [
            (json!({"prompt": "1+1=", "n": 1, "verifier": "numeric"}), 400, "invalid_batch"),
            (json!({"prompt": "1+1=", "n": 1, "verifier": "math"}), 400, "invalid_batch"),
            (json!({"prompt": "1+1=", "n": 1, "verifier": "exact_match"}), 400, "invalid_batch"),
            (json!({"prompt": "1+1=", "n": 1, "verifier": "math", "answer": "two"}), 400, "invalid_batch"),
            (json!({"prompt": "1+1=", "n": 1, "verifier": "judge"}), 400, "unknown_verifier"),
            (
                json!({"prompt": "1+1=", "n": 1024, "verifier": "none", "sampling": {"max_new_tokens": 2000}}),
                413,
                "too_large",
            ),
        ] {
            let (s, v) = hub.call("POST", "/v1/batches", Some(&json!({"groups": [group]})));
            assert_eq!((s, v["code"].as_str()), (status, Some(code)), "{group} → {v}");
            assert!(v["message"].as_str().is_some_and(|m| m.len() > 20), "{v}");
        }

        let groups: Vec<Value> = [("6*7=", "42"), ("3+4=", "7"), ("2+2=", "4")]
            .iter()
            .map(|(p, a)| json!({"prompt": p, "n": 2, "verifier": "math", "answer": a}))
            .collect();
        let batch = hub.post(&json!({"groups": groups, "sampling": {"max_new_tokens": 32}}));
        let jobs = claim(&mut w, 3).await;
        let d = hub.digest;

        // A NaN log-probability: refused by name, and the group is offered again at once.
        let nan = result(&jobs[0], d, &["\\boxed{42}", "42"], f32::NAN);
        assert_eq!(code_of(&w.submit(nan).await), "nonfinite_logprob");
        let s = hub.status(batch);
        assert_eq!(s["refused"]["nonfinite_logprob"], 1, "{s}");
        assert_eq!((s["groups"]["pending"].as_u64(), s["groups"]["leased"].as_u64()), (Some(1), Some(2)), "{s}");
        // It went back to the shared pool, which an actor claims from once it holds no
        // lease (docs/ledger.md): another actor, or this one after its current jobs.

        // A result too large for any message, alone in its Submit (as the actor sends it):
        // refused by name, that group fails; the connection goes on.
        let mut huge = result(&jobs[2], d, &["4"], -0.5);
        let mut s0 = huge.samples[0].clone();
        s0.tokens = vec![u32::MAX; 65_536];
        s0.logprobs = vec![-0.5; 65_536];
        s0.finish = FinishReason::Length;
        s0.spans[0].end = 65_536;
        huge.samples = vec![s0; 30];
        let answer = w.ask(Message::Submit { results: vec![huge] }).await;
        assert_eq!(verdicts(answer), [(jobs[2].job, "result_too_large".to_owned())]);

        // The actor's other results are judged as usual.
        let good = vec![result(&jobs[1], d, &["3 + 4 = 7", "\\boxed{8}"], -0.25)];
        let answer = w.ask(Message::Submit { results: good }).await;
        assert_eq!(verdicts(answer), [(jobs[1].job, "accepted".to_owned())]);

        // Holding no lease now, the actor gets the refused group again, as its second attempt.
        let again = claim(&mut w, 1).await;
        assert_eq!((again[0].job, again[0].attempt), (jobs[0].job, 2));
        let good = vec![result(&again[0], d, &["6 times 7 is \\boxed{42}.", "41"], -0.5)];
        let answer = w.ask(Message::Submit { results: good }).await;
        assert_eq!(verdicts(answer), [(jobs[0].job, "accepted".to_owned())]);

        let results = hub.drain(batch);
        let rewards: BTreeMap<u64, Vec<f64>> = results
            .iter()
            .map(|r| {
                let g = r["group"].as_u64().expect("group");
                let rw = r["samples"]
                    .as_array()
                    .expect("samples")
                    .iter()
                    .map(|s| s["reward"].as_f64().expect("reward"))
                    .collect();
                (g, rw)
            })
            .collect();
        assert_eq!(rewards, BTreeMap::from([(0, vec![1.0, 0.0]), (1, vec![1.0, 0.0])]));
        for r in &results {
            for s in r["samples"].as_array().expect("samples") {
                assert!(s["logprobs"].as_array().expect("lp").iter().all(Value::is_f64), "{s}");
            }
        }
        let s = hub.status(batch);
        assert_eq!(s["state"], "done", "{s}");
        assert_eq!((s["groups"]["done"].as_u64(), s["groups"]["failed"].as_u64()), (Some(2), Some(1)), "{s}");
        assert_eq!(s["failures"], json!({"result_too_large": 1}), "{s}");
        assert_eq!(s["refused"], json!({"nonfinite_logprob": 1, "result_too_large": 1}), "{s}");
        let m = hub.tb.hub_metrics();
        for reason in ["nonfinite_logprob", "result_too_large"] {
            let series = format!("starling_hub_results_refused_total{{reason=\"{reason}\"}}");
            assert_eq!(metric(&m, &series), Some(1.0), "{series}");
        }
    });
}

fn code_of(v: &Verdict) -> &str {
    match v {
        Verdict::Accepted => "accepted",
        Verdict::Refused { code, .. } => code,
    }
}

/// A reward service on a real socket: each path behaves as one kind of service, and every
/// request is kept.
struct RewardServer {
    addr: String,
    seen: Arc<Mutex<Vec<(String, Value)>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RewardServer {
    fn start() -> RewardServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let seen: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        RewardServer {
            addr,
            seen,
            stop,
            thread: Some(thread),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Requests seen on `path`.
    fn on(&self, path: &str) -> Vec<Value> {
        let seen = self.seen.lock().expect("lock");
        seen.iter()
            .filter(|(p, _)| p == path)
            .map(|(_, v)| v.clone())
            .collect()
    }
}

impl Drop for RewardServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(&self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request: read it, record it, answer as its path says.
fn serve(conn: TcpStream, seen: &Mutex<Vec<(String, Value)>>) {
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    let mut len = 0;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; len];
    if r.read_exact(&mut body).is_err() {
        return;
    }
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let tries = {
        let mut seen = seen.lock().expect("lock");
        seen.push((path.clone(), req.clone()));
        seen.iter()
            .filter(|(p, v)| *p == path && v["job"] == req["job"])
            .count()
    };
    // 1 when the completion holds the answer, else 0.25.
    let good = || {
        let answer = req["answer"].as_str().unwrap_or("\u{0}");
        let rewards: Vec<f64> = req["completions"]
            .as_array()
            .map(|cs| {
                cs.iter()
                    .map(|c| {
                        if c["text"].as_str().unwrap_or("").contains(answer) {
                            1.0
                        } else {
                            0.25
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        (200, json!({"rewards": rewards}).to_string())
    };
    let (status, answer) = match path.as_str() {
        "/good" => good(),
        "/flaky" if tries == 1 => (503, "busy".to_owned()),
        "/flaky" => good(),
        "/slow" => {
            std::thread::sleep(Duration::from_secs(3));
            good()
        }
        "/garbage" => (200, "this is not JSON".to_owned()),
        "/reject" => (422, "{\"error\": \"no\"}".to_owned()),
        _ => (404, String::new()),
    };
    let mut conn = r.into_inner();
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
        answer.len()
    );
}

#[test]
fn reward_services_score_groups_and_a_failing_one_fails_its_group_alone() {
    let server = RewardServer::start();
    // A port nothing listens on.
    let down = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let specs: Vec<String> = ["good", "flaky", "slow", "garbage", "reject"]
        .iter()
        .map(|n| format!("{n}={}", server.url(&format!("/{n}"))))
        .chain([format!("down=http://127.0.0.1:{down}/score")])
        .collect();
    let mut args = vec!["--reward-timeout", "0.5", "--lease-initial", "60"];
    for s in &specs {
        args.extend(["--reward-service", s.as_str()]);
    }
    let hub = Hub::start(&args);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut w = WorkClient::connect(&hub.tb, "w", (0, hub.digest)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (s, v) = hub.call(
            "POST",
            "/v1/batches",
            Some(&json!({"groups": [{"prompt": "x", "n": 1, "verifier": "other"}]})),
        );
        assert_eq!((s, v["code"].as_str()), (400, Some("unknown_verifier")));
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| m.contains("flaky") && m.contains("math")),
            "{v}"
        );

        let names = ["good", "flaky", "slow", "garbage", "reject", "down"];
        let groups: Vec<Value> = names
            .iter()
            .map(|n| {
                let mut g = json!({"prompt": "12+30=", "n": 2, "verifier": n});
                if *n != "down" {
                    g["answer"] = json!("42");
                }
                g
            })
            .collect();
        let batch = hub.post(&json!({"groups": groups, "sampling": {"max_new_tokens": 16}}));
        let jobs = claim(&mut w, 6).await;
        // The actor is answered before any service is called (the slow one takes 3 s a try).
        let started = Instant::now();
        let results = jobs
            .iter()
            .map(|j| result(j, hub.digest, &["it is 42", "41"], -0.5))
            .collect();
        let answer = w.ask(Message::Submit { results }).await;
        assert!(
            started.elapsed() < Duration::from_millis(1_500),
            "{:?}",
            started.elapsed()
        );
        assert!(verdicts(answer).iter().all(|(_, v)| v == "accepted"));

        let results = hub.drain(batch);
        let by_group: BTreeMap<u64, Vec<f64>> = results
            .iter()
            .map(|r| {
                let rw = r["samples"]
                    .as_array()
                    .expect("samples")
                    .iter()
                    .map(|s| s["reward"].as_f64().expect("reward"))
                    .collect();
                (r["group"].as_u64().expect("group"), rw)
            })
            .collect();
        assert_eq!(
            by_group,
            BTreeMap::from([(0, vec![1.0, 0.25]), (1, vec![1.0, 0.25])]),
            "the working services' rewards, and only their groups"
        );
        let s = hub.status(batch);
        assert_eq!(s["state"], "done", "{s}");
        assert_eq!(
            (s["groups"]["done"].as_u64(), s["groups"]["failed"].as_u64()),
            (Some(2), Some(4)),
            "{s}"
        );
        assert_eq!(s["failures"], json!({"reward_service": 4}), "{s}");

        // What the services were sent, and how often they were tried.
        let good = server.on("/good");
        assert_eq!(good.len(), 1);
        let r = &good[0];
        assert_eq!(r["batch"].as_u64(), Some(batch));
        assert_eq!(
            (r["group"].as_u64(), r["version"].as_u64()),
            (Some(0), Some(0))
        );
        assert_eq!(r["job"].as_u64(), Some(jobs[0].job));
        assert_eq!(r["prompt"]["text"], "12+30=");
        assert_eq!(r["answer"], "42");
        assert_eq!(
            r["completions"],
            json!([{"text": "it is 42", "finish": "stop", "tokens": 9},
                   {"text": "41", "finish": "stop", "tokens": 3}])
        );
        assert_eq!(server.on("/flaky").len(), 2, "a 5xx is tried again");
        assert_eq!(
            server.on("/garbage").len(),
            3,
            "garbage is tried 3 times in all"
        );
        assert_eq!(
            server.on("/slow").len(),
            3,
            "a timeout is tried 3 times in all"
        );
        assert_eq!(server.on("/reject").len(), 1, "a 4xx is final");
        let faults = hub.tb.hub_status()["faults"].to_string();
        for needle in [
            "no answer within",
            "answered something other than",
            "HTTP 422",
            "cannot connect",
        ] {
            assert!(faults.contains(needle), "{needle}: {faults}");
        }
    });
}

#[test]
fn a_delivered_batch_is_archived_to_a_file_and_served_from_it() {
    let hub = Hub::start(&["--retain-batches", "0", "--lease-initial", "60"]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut w = WorkClient::connect(&hub.tb, "w", (0, hub.digest)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let groups: Vec<Value> = (0..3)
            .map(|i| json!({"prompt": format!("{i}+1="), "n": 2, "verifier": "numeric", "answer": (i + 1).to_string()}))
            .collect();
        let batch = hub.post(&json!({"groups": groups, "sampling": {"max_new_tokens": 8}}));
        let jobs = claim(&mut w, 3).await;
        let results = jobs.iter().map(|j| result(j, hub.digest, &["1", "2"], -0.5)).collect();
        assert!(verdicts(w.ask(Message::Submit { results }).await).iter().all(|(_, v)| v == "accepted"));
        let before = hub.drain(batch);
        assert_eq!(before.len(), 3);
        // Read to its end: archived within a few retention rounds.
        let deadline = Instant::now() + Duration::from_secs(20);
        let path = loop {
            let s = hub.status(batch);
            if let Some(p) = s["archived"]["path"].as_str() {
                assert_eq!(s["state"], "done", "{s}");
                assert_eq!(s["groups"]["done"], 3, "{s}");
                break p.to_owned();
            }
            assert!(Instant::now() < deadline, "not archived: {s}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let lines = std::fs::read_to_string(&path).expect("archive file");
        let archived: Vec<Value> = lines.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        assert_eq!(archived, before, "the file holds what the trainer read");
        assert_eq!(hub.drain(batch), before, "served from the file, the same");
        let (_, page) = hub.call("GET", &format!("/v1/batches/{batch}/results?after=0&limit=2"), None);
        assert_eq!((page["results"].as_array().map(Vec::len), page["done"].as_bool()), (Some(2), Some(false)));
        // Its rows left the ledger.
        assert_eq!(hub.tb.hub_status()["jobs"]["done"], 0);
        // A later batch's cursors follow the archived ones.
        let last = before.last().expect("one")["cursor"].as_u64().expect("cursor");
        let b2 = hub.post(&json!({"groups": [{"prompt": "9+1=", "n": 1, "verifier": "none"}]}));
        let j = claim(&mut w, 1).await;
        w.ask(Message::Submit { results: vec![result(&j[0], hub.digest, &["10"], -0.5)] }).await;
        let more = hub.drain(b2);
        assert!(more[0]["cursor"].as_u64().expect("cursor") > last);
    });
}
