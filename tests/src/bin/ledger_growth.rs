//! The ledger's growth per step and `/v1/status` latency over a long synthetic run, through
//! the real hub: a hub on loopback (SQLite ledger), one job-protocol client playing the actors
//! (no engine: it submits a fixed result of the requested size at once) and the trainer's
//! HTTP API. Each step posts a batch, claims and submits every group, and reads the results
//! to the end (as a trainer does, which makes the batch "delivered"). Every `--every` steps it
//! records the ledger's size on disk (database + WAL) and the latency of `GET /v1/status`
//! (median of 5 uncached requests: the hub reuses one status for 500 ms, so they are spaced
//! 600 ms apart). With `--retain-batches N` the hub archives all but the newest N delivered
//! batches.
//!
//! `cargo build --release --workspace && target/release/ledger-growth --steps 10000`
//! `target/release/ledger-growth --steps 10000 --retain-batches 16`

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Value, json};
use starling_proto::delta::apply::full_digest;
use starling_proto::protocol::msg::Message;
use starling_proto::protocol::rollout::{FinishReason, JobResult, Sample, VersionSpan};
use starling_tests::{Testbed, WorkClient, http_get, http_request};

#[derive(Parser, Debug)]
#[command(about = "Ledger size per step and /v1/status latency over a synthetic run")]
struct Args {
    /// Steps (one batch each).
    #[arg(long, default_value_t = 10_000)]
    steps: u32,
    /// Groups per step, samples per group, tokens per sample.
    #[arg(long, default_value_t = 8)]
    groups: u32,
    #[arg(long, default_value_t = 4)]
    n: u32,
    #[arg(long, default_value_t = 64)]
    tokens: u32,
    /// Measure every this many steps.
    #[arg(long, default_value_t = 1_000)]
    every: u32,
    /// Keep at most this many delivered batches in the ledger (the hub's --retain-batches).
    #[arg(long)]
    retain_batches: Option<u64>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let keep = a.retain_batches.map(|n| n.to_string());
    // One client plays every actor: the per-actor rate limits would throttle it.
    let mut hub_args = vec!["--lease-initial", "600", "--actor-submit-rate", "100000"];
    if let Some(k) = &keep {
        hub_args.extend(["--retain-batches", k.as_str()]);
    }
    let peers = [("actor", "w"), ("trainer", "t1")];
    let tb = Testbed::with_model("tiny", 1e-4, 0, 5, &peers, &[], &hub_args);
    let w = tb.weights(0);
    let names: Vec<String> = w.keys().cloned().collect();
    let digest = full_digest("tiny", &w, &names).to_bytes();
    let token = starling_transport::identity::load_trainer_token(&tb.root.join("t1"))
        .context("trainer token")?;
    let ledger_files = [
        tb.root.join("hub-store/ledger.db"),
        tb.root.join("hub-store/ledger.db-wal"),
    ];
    let size = || -> u64 {
        ledger_files
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum()
    };
    println!(
        "# {} steps of {} groups × {} samples × {} tokens, retention: {}",
        a.steps,
        a.groups,
        a.n,
        a.tokens,
        keep.as_deref()
            .map_or("off".to_owned(), |k| format!("--retain-batches {k}"))
    );
    println!("| step | ledger MB | bytes/step since last | /v1/status ms (median of 5) | s/step |");
    println!("|---:|---:|---:|---:|---:|");
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let mut client = WorkClient::connect(&tb, "w", (0, digest)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let groups: Vec<Value> = (0..a.groups)
            .map(|i| json!({"prompt": format!("{i}+1="), "n": a.n, "verifier": "none"}))
            .collect();
        let body = json!({"groups": groups, "sampling": {"max_new_tokens": a.tokens}}).to_string();
        let (mut last_size, mut last_step, mut t0) = (size(), 0u32, Instant::now());
        let mut beat = Instant::now();
        for step in 1..=a.steps {
            // A silent actor is not scheduled after --actor-timeout: say it is alive.
            if beat.elapsed() > Duration::from_secs(1) {
                let m = Message::Heartbeat {
                    active: Some((0, digest)),
                    staged: None,
                };
                starling_transport::framed::send(&mut client.tx, &m)
                    .await
                    .context("heartbeat")?;
                beat = Instant::now();
            }
            let (s, v) = http_request(
                &tb.hub_http,
                "POST",
                "/v1/batches",
                Some(&token),
                Some(&body),
            );
            if s != 201 {
                bail!("post: {s} {v}");
            }
            let batch: Value = serde_json::from_str(&v)?;
            let batch = batch["batch"].as_u64().context("batch id")?;
            let mut held = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(30);
            while held.len() < a.groups as usize {
                if Instant::now() > deadline {
                    bail!("step {step}: claimed {} of {}", held.len(), a.groups);
                }
                let got = client.claim(a.groups).await;
                if got.is_empty() {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                held.extend(got);
            }
            let results: Vec<JobResult> = held
                .iter()
                .map(|j| JobResult {
                    job: j.job,
                    attempt: j.attempt,
                    version: j.version,
                    digest,
                    elapsed_us: 1_000,
                    samples: (0..a.n)
                        .map(|i| Sample {
                            tokens: (0..a.tokens).map(|t| 3 + (t * 7 + i) % 250).collect(),
                            logprobs: (0..a.tokens)
                                .map(|t| -0.001 * (t as f32 + 1.0) - 0.37)
                                .collect(),
                            finish: FinishReason::Length,
                            spans: vec![VersionSpan {
                                version: j.version,
                                start: 0,
                                end: a.tokens,
                            }],
                            ttft_us: 100,
                            decode_us: 1_000,
                        })
                        .collect(),
                })
                .collect();
            match client.ask(Message::Submit { results }).await {
                Message::Verdicts { .. } => {}
                other => bail!("submit: {other:?}"),
            }
            let mut cursor = 0u64;
            loop {
                let (s, v) = http_request(
                    &tb.hub_http,
                    "GET",
                    &format!("/v1/batches/{batch}/results?after={cursor}&limit=1024&wait_ms=5000"),
                    Some(&token),
                    None,
                );
                if s != 200 {
                    bail!("results: {s} {v}");
                }
                let v: Value = serde_json::from_str(&v)?;
                cursor = v["cursor"].as_u64().unwrap_or(cursor);
                if v["done"] == true {
                    break;
                }
            }
            if step % a.every == 0 || step == a.steps {
                let per_step = (t0.elapsed().as_secs_f64()) / f64::from(step - last_step);
                let mut ms = Vec::new();
                for _ in 0..5 {
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    let t = Instant::now();
                    let status = http_get(&tb.hub_http, "/v1/status");
                    ms.push(t.elapsed().as_secs_f64() * 1e3);
                    if !status.contains("\"jobs\"") {
                        bail!("status: {status}");
                    }
                }
                ms.sort_by(f64::total_cmp);
                let now = size();
                let growth = now.saturating_sub(last_size) as f64 / f64::from(step - last_step);
                println!(
                    "| {step} | {:.1} | {:.0} | {:.2} | {:.3} |",
                    now as f64 / 1e6,
                    growth,
                    ms[2],
                    per_step
                );
                (last_size, last_step, t0) = (now, step, Instant::now());
            }
        }
        anyhow::Ok(())
    })?;
    Ok(())
}
