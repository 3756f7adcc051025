//! Rollout scheduling and the job path through the real hub, measured with real processes on
//! loopback.
//!
//! **makespan**: a hub and three actors running the built-in engine at relative speeds 1:2:3
//! (`--engine-slowdown` 6, 3, 2: each generation call stretched to that many times its
//! compute). After warm-up batches (the hub learns each actor's throughput τ from its
//! results), each measured batch's generation phase — from the batch's posting to its last
//! accepted group — is compared with the ideal makespan ΣT_i / Σr_i, where T_i is the tokens
//! actor i generated and r_i = T_i / (its last result − the batch's posting) its measured
//! rate. The same runs again with the hub's `--uniform-split` (an even split whatever τ says).
//!
//! **jobs**: claims + submits per second through the hub: `--clients` job-protocol clients
//! (no engine: they submit a fixed result at once) drain a batch of `--jobs` groups of one
//! sample, claiming `--per-claim` at a time; on SQLite and, with `--postgres URL`, on
//! PostgreSQL.
//!
//! `cargo build --release --workspace && target/release/rollout-bench --help`

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Value, json};
use starling_proto::delta::apply::full_digest;
use starling_proto::protocol::rollout::{FinishReason, JobResult, Sample, Verdict, VersionSpan};
use starling_tests::{Testbed, WorkClient, http_request, wait_for};

#[derive(Parser, Debug)]
#[command(about = "Rollout makespan (speeds 1:2:3, Algorithm 1 vs uniform) and job throughput")]
struct Args {
    /// Which measurements: makespan, jobs.
    #[arg(long, value_delimiter = ',', default_value = "makespan,jobs")]
    run: Vec<String>,
    /// Engine slowdowns of the three actors (speeds are their inverses).
    #[arg(long, value_delimiter = ',', default_value = "6,3,2")]
    slowdowns: Vec<f64>,
    /// Warm-up batches (τ is learned) and measured batches per split.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    #[arg(long, default_value_t = 4)]
    batches: u32,
    /// Groups per batch, samples per group, new tokens per sample.
    #[arg(long, default_value_t = 48)]
    groups: u32,
    #[arg(long, default_value_t = 4)]
    n: u32,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: u32,
    /// Job throughput: groups, clients, groups per claim.
    #[arg(long, default_value_t = 4096)]
    jobs: u32,
    #[arg(long, default_value_t = 8)]
    clients: u32,
    #[arg(long, default_value_t = 64)]
    per_claim: u32,
    /// A PostgreSQL server URL (a database is created on it) for the job throughput.
    #[arg(long, env = "STARLING_TEST_POSTGRES_URL")]
    postgres: Option<String>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.slowdowns.len() != 3 {
        bail!("--slowdowns takes three factors");
    }
    if a.run.iter().any(|r| r == "makespan") {
        println!(
            "## makespan: 3 actors at slowdowns {:?}, {} groups × {} samples × ≤{} tokens\n",
            a.slowdowns, a.groups, a.n, a.max_new_tokens
        );
        println!(
            "| split | batch | makespan s | ideal s | makespan / ideal | shares (slow→fast) |"
        );
        println!("|---|---|---|---|---|---|");
        let mut summary = Vec::new();
        for uniform in [false, true] {
            let ratios = makespan(&a, uniform)?;
            summary.push((uniform, ratios));
        }
        println!();
        for (uniform, mut r) in summary {
            r.sort_by(f64::total_cmp);
            println!(
                "{}: median makespan / ideal {:.3} (min {:.3}, max {:.3})",
                if uniform {
                    "uniform split"
                } else {
                    "Algorithm 1"
                },
                r[r.len() / 2],
                r[0],
                r[r.len() - 1]
            );
        }
    }
    if a.run.iter().any(|r| r == "jobs") {
        println!("\n## jobs claimed + submitted through the hub\n");
        println!("| ledger | jobs | clients | per claim | seconds | jobs/s |");
        println!("|---|---|---|---|---|---|");
        jobs(&a, None)?;
        if let Some(url) = &a.postgres {
            let db = starling_tests::postgres_database("rollout-bench").context("database")?;
            let _ = url;
            jobs(&a, Some(db))?;
        }
    }
    Ok(())
}

fn token(tb: &Testbed) -> Result<String> {
    Ok(starling_transport::identity::load_trainer_token(
        &tb.root.join("t1"),
    )?)
}

fn call(tb: &Testbed, token: &str, method: &str, path: &str, body: Option<&Value>) -> Value {
    let body = body.map(Value::to_string);
    let (_, text) = http_request(&tb.hub_http, method, path, Some(token), body.as_deref());
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// Runs warm-up and measured batches; returns makespan / ideal per measured batch.
fn makespan(a: &Args, uniform: bool) -> Result<Vec<f64>> {
    let peers = [
        ("actor", "slow"),
        ("actor", "mid"),
        ("actor", "fast"),
        ("trainer", "t1"),
    ];
    let mut hub_args = vec!["--lease-initial", "60"];
    if uniform {
        hub_args.push("--uniform-split");
    }
    let mut tb = Testbed::with_model("tiny", 1e-4, 0, 5, &peers, &[], &hub_args);
    let names = ["slow", "mid", "fast"];
    let mut outs = Vec::new();
    for (name, s) in names.iter().zip(&a.slowdowns) {
        let s = s.to_string();
        let claim = "2";
        outs.push(tb.actor_with(
            name,
            &[],
            &[
                "--engine",
                "builtin",
                "--engine-slowdown",
                &s,
                "--claim",
                claim,
            ],
        ));
    }
    for o in &outs {
        wait_for(o, "worker connected", tb.deadline);
    }
    let token = token(&tb)?;
    let mut ratios = Vec::new();
    for b in 0..a.warmup + a.batches {
        let groups: Vec<Value> = (0..a.groups)
            .map(|i| json!({"prompt": format!("{}+{}=", i % 50, i % 17), "n": a.n, "verifier": "none"}))
            .collect();
        // Stop tokens off: every sample runs to max_new_tokens, so the work per group is equal
        // and the makespan measures the split, not the luck of generation lengths.
        let body = json!({"groups": groups, "sampling": {"max_new_tokens": a.max_new_tokens, "stop_token_ids": [], "seed": b}});
        let posted = call(&tb, &token, "POST", "/v1/batches", Some(&body));
        let id = posted["batch"].as_u64().context("batch id")?;
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut results = Vec::new();
        let mut cursor = 0;
        loop {
            if Instant::now() > deadline {
                bail!("batch {id} did not finish");
            }
            let r = call(
                &tb,
                &token,
                "GET",
                &format!("/v1/batches/{id}/results?after={cursor}&limit=1024&wait_ms=1000"),
                None,
            );
            for x in r["results"].as_array().into_iter().flatten() {
                cursor = x["cursor"].as_u64().unwrap_or(cursor);
                results.push(x.clone());
            }
            if r["done"].as_bool() == Some(true) {
                break;
            }
        }
        let status = call(&tb, &token, "GET", &format!("/v1/batches/{id}"), None);
        let t0 = status["created_at_ms"].as_i64().context("created_at")?;
        let mut per: BTreeMap<String, (f64, i64, u32)> = BTreeMap::new();
        for r in &results {
            let actor = r["actor"].as_str().unwrap_or("?").to_owned();
            let tokens: usize = r["samples"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| s["tokens"].as_array().map_or(0, Vec::len))
                .sum();
            let e = per.entry(actor).or_insert((0.0, t0, 0));
            e.0 += tokens as f64;
            e.1 = e.1.max(r["accepted_at_ms"].as_i64().unwrap_or(t0));
            e.2 += 1;
        }
        let makespan = per.values().map(|p| p.1 - t0).max().unwrap_or(0) as f64 / 1e3;
        let total: f64 = per.values().map(|p| p.0).sum();
        let rate: f64 = per
            .values()
            .map(|p| p.0 / ((p.1 - t0).max(1) as f64 / 1e3))
            .sum();
        let ideal = total / rate;
        let shares: Vec<String> = names
            .iter()
            .map(|n| per.get(*n).map_or(0, |p| p.2).to_string())
            .collect();
        let measured = b >= a.warmup;
        println!(
            "| {} | {}{} | {makespan:.2} | {ideal:.2} | {:.3} | {} |",
            if uniform { "uniform" } else { "Algorithm 1" },
            b,
            if measured { "" } else { " (warm-up)" },
            makespan / ideal,
            shares.join(" / ")
        );
        if measured {
            ratios.push(makespan / ideal);
        }
    }
    drop(outs);
    tb.kill_hub();
    Ok(ratios)
}

/// Claims + submits per second through the hub with `clients` engine-less clients.
fn jobs(a: &Args, postgres: Option<String>) -> Result<()> {
    let names: Vec<String> = (0..a.clients).map(|i| format!("w{i}")).collect();
    let mut peers: Vec<(&str, &str)> = names.iter().map(|n| ("actor", n.as_str())).collect();
    peers.push(("trainer", "t1"));
    let mut hub_args = vec![];
    if let Some(url) = &postgres {
        hub_args.extend(["--ledger", url.as_str()]);
    }
    let tb = Testbed::with_model("tiny", 1e-4, 0, 5, &peers, &[], &hub_args);
    let w = tb.weights(0);
    let keys: Vec<String> = w.keys().cloned().collect();
    let d0 = full_digest("tiny", &w, &keys).to_bytes();
    let token = token(&tb)?;
    let rt = tokio::runtime::Runtime::new()?;
    let (secs, done) = rt.block_on(async {
        let mut clients = Vec::new();
        for n in &names {
            clients.push(WorkClient::connect(&tb, n, (0, d0)).await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let groups: Vec<Value> = (0..a.jobs)
            .map(|i| json!({"prompt_ids": [3 + (i % 200)], "n": 1, "verifier": "none"}))
            .collect();
        let body = json!({"groups": groups, "sampling": {"max_new_tokens": 4}});
        let posted = call(&tb, &token, "POST", "/v1/batches", Some(&body));
        if posted["batch"].as_u64().is_none() {
            return Err(anyhow::anyhow!("batch refused: {posted}"));
        }
        let start = Instant::now();
        let per_claim = a.per_claim;
        let mut tasks = tokio::task::JoinSet::new();
        for mut c in clients {
            tasks.spawn(async move {
                let mut done = 0u32;
                let mut last = Instant::now();
                let mut empty = 0;
                while empty < 20 {
                    let jobs = c.claim(per_claim).await;
                    if jobs.is_empty() {
                        empty += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    empty = 0;
                    let results: Vec<JobResult> = jobs
                        .iter()
                        .map(|j| JobResult {
                            job: j.job,
                            attempt: j.attempt,
                            version: 0,
                            digest: d0,
                            elapsed_us: 1_000,
                            samples: vec![Sample {
                                tokens: vec![5, 2],
                                logprobs: vec![-1.0, -1.0],
                                finish: FinishReason::Stop,
                                spans: vec![VersionSpan {
                                    version: 0,
                                    start: 0,
                                    end: 2,
                                }],
                                ttft_us: 10,
                                decode_us: 100,
                            }],
                        })
                        .collect();
                    let answer = c
                        .ask(starling_proto::protocol::msg::Message::Submit { results })
                        .await;
                    if let starling_proto::protocol::msg::Message::Verdicts { verdicts } = answer {
                        done += verdicts
                            .iter()
                            .filter(|(_, v)| *v == Verdict::Accepted)
                            .count() as u32;
                        last = Instant::now();
                    }
                }
                (done, last)
            });
        }
        let mut done = 0;
        let mut end = start;
        while let Some(r) = tasks.join_next().await {
            let (n, last) = r.unwrap_or((0, start));
            done += n;
            end = end.max(last);
        }
        // From the batch's posting to the last accepted submit (the idle polls after are not
        // work).
        let secs = end.duration_since(start).as_secs_f64().max(1e-3);
        Ok((secs, done))
    })?;
    println!(
        "| {} | {done} | {} | {} | {secs:.2} | {:.0} |",
        if postgres.is_some() {
            "PostgreSQL"
        } else {
            "SQLite"
        },
        a.clients,
        a.per_claim,
        f64::from(done) / secs
    );
    if done != a.jobs {
        bail!("{done} of {} jobs accepted", a.jobs);
    }
    Ok(())
}
