//! `ledger-stress`: a claim/submit workload against a ledger URL that prints every
//! acknowledged operation (after its transaction committed) on stdout, one line each:
//!
//! ```text
//! READY <jobs>
//! CLAIMED <actor> <job> <job> …
//! ACCEPTED <actor> <job> <job> …
//! ```
//!
//! The crash-safety test SIGKILLs it mid-run and checks that everything it printed is in the
//! database; it is also a small soak tool (`--seconds`). Uses the system clock.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use starling_ledger::clock::{Clock, SystemClock};
use starling_ledger::{ActorId, Digest, Ledger, LedgerConfig, ResultSubmission, Version};

#[derive(Debug, Parser)]
#[command(about = "Run a claim/submit workload on a ledger and print each acknowledged operation")]
struct Args {
    /// Ledger URL (sqlite:PATH or postgres://…).
    #[arg(long)]
    url: String,
    /// Jobs to post (when the ledger is fresh).
    #[arg(long, default_value_t = 20_000)]
    jobs: usize,
    /// Concurrent actors.
    #[arg(long, default_value_t = 8)]
    actors: usize,
    /// Jobs per claim.
    #[arg(long, default_value_t = 8)]
    claim: usize,
    /// Stop after this many seconds.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
}

/// The digest the workload uses for version `v`.
fn digest(v: u64) -> Digest {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&v.to_le_bytes());
    Digest(d)
}

fn say(line: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").context("write stdout")?;
    out.flush().context("flush stdout")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let ledger = Arc::new(
        Ledger::open(&args.url, LedgerConfig::default())
            .await
            .context("open ledger")?,
    );
    let clock = SystemClock;
    let v0 = Version::new(0).context("version")?;
    ledger
        .register_version(v0, None, digest(0), clock.now())
        .await
        .context("register version")?;
    ledger
        .commit_version(v0, clock.now())
        .await
        .context("commit version")?;
    let actors: Vec<ActorId> = (0..args.actors)
        .map(|i| ActorId::new(format!("stress-{i}")))
        .collect::<Result<_, _>>()?;
    for a in &actors {
        ledger
            .register_actor(a, "local", "cpu", clock.now())
            .await
            .context("register actor")?;
        ledger
            .heartbeat(a, Some(v0), None, clock.now())
            .await
            .context("heartbeat")?;
    }
    if ledger.job_counts().await.context("count jobs")?.total() == 0 {
        for chunk in (0..args.jobs).collect::<Vec<_>>().chunks(4096) {
            let prompts: Vec<Vec<u8>> = chunk
                .iter()
                .map(|i| format!("prompt {i}").into_bytes())
                .collect();
            let batch = ledger
                .post_batch(v0, &prompts, "{}", clock.now())
                .await
                .context("post batch")?;
            ledger
                .schedule(batch, clock.now())
                .await
                .context("schedule batch")?;
        }
    }
    say(&format!(
        "READY {}",
        ledger.job_counts().await.context("count jobs")?.total()
    ))?;
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for a in actors {
        let ledger = Arc::clone(&ledger);
        let claim = args.claim;
        tasks.spawn(async move {
            while Instant::now() < deadline {
                let jobs = ledger
                    .claim(&a, claim, clock.now())
                    .await
                    .context("claim")?;
                if jobs.is_empty() {
                    break;
                }
                let ids: Vec<String> = jobs.iter().map(|j| j.id.raw().to_string()).collect();
                say(&format!("CLAIMED {a} {}", ids.join(" ")))?;
                let results: Vec<ResultSubmission> = jobs
                    .iter()
                    .map(|j| ResultSubmission {
                        job: j.id,
                        version: j.version,
                        digest: digest(j.version.number()),
                        tokens: 64,
                        elapsed: Duration::from_millis(5),
                        payload: j.prompt.clone(),
                    })
                    .collect();
                let out = ledger
                    .submit(&a, &results, clock.now())
                    .await
                    .context("submit")?;
                let ok: Vec<String> = out
                    .iter()
                    .filter(|o| o.verdict.is_ok())
                    .map(|o| o.job.raw().to_string())
                    .collect();
                if !ok.is_empty() {
                    say(&format!("ACCEPTED {a} {}", ok.join(" ")))?;
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("join actor task")??;
    }
    ledger.close().await;
    say("DONE")
}
