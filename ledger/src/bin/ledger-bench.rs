//! `ledger-bench`: job transitions per second with batched operations.
//!
//! Posts `--jobs` prompts (in batches of 4096, scheduled over `--actors` actors), then times
//! four phases with `--actors` concurrent tasks, each calling the ledger with up to `--batch`
//! jobs per call:
//! 1. claim: every job `pending → leased`;
//! 2. submit: half of them `leased → done`;
//! 3. expire: the other half `leased → pending` after their leases ran out;
//! 4. mixed: the returned jobs claimed and submitted again, with an expiry sweeper running.
//!
//! SQLite runs on a fresh temporary file; PostgreSQL on a fresh database created through
//! `--url` (an admin URL) and dropped at the end.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use starling_ledger::clock::{Clock, ManualClock};
use starling_ledger::{
    ActorId, ClaimedJob, Digest, Ledger, LedgerConfig, ResultSubmission, Timestamp, Version,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Sqlite,
    Postgres,
}

#[derive(Debug, Parser)]
#[command(
    about = "Measure ledger job transitions per second (claim, submit, expire) with batched operations"
)]
struct Args {
    /// Database to measure.
    #[arg(long, value_enum, default_value = "sqlite")]
    backend: BackendArg,
    /// PostgreSQL admin URL (a fresh database is created and dropped); defaults to
    /// STARLING_TEST_POSTGRES_URL.
    #[arg(long, env = "STARLING_TEST_POSTGRES_URL")]
    url: Option<String>,
    /// Jobs to post.
    #[arg(long, default_value_t = 100_000)]
    jobs: usize,
    /// Concurrent actors (one task each).
    #[arg(long, default_value_t = 64)]
    actors: usize,
    /// Jobs per claim / submit call.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Result payload bytes.
    #[arg(long, default_value_t = 256)]
    payload: usize,
}

fn digest() -> Digest {
    Digest([0x5a; 16])
}

struct Phase {
    name: &'static str,
    transitions: u64,
    seconds: f64,
}

impl Phase {
    fn print(&self) {
        println!(
            "{:<8} {:>9} transitions in {:>7.3} s = {:>9.0} /s",
            self.name,
            self.transitions,
            self.seconds,
            self.transitions as f64 / self.seconds
        );
    }
}

fn results(jobs: &[ClaimedJob], payload: usize) -> Vec<ResultSubmission> {
    jobs.iter()
        .map(|j| ResultSubmission {
            job: j.id,
            version: j.version,
            digest: digest(),
            tokens: 512,
            elapsed: Duration::from_millis(900),
            payload: vec![7; payload],
        })
        .collect()
}

async fn run(ledger: Arc<Ledger>, args: &Args) -> anyhow::Result<Vec<Phase>> {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let v0 = Version::new(0)?;
    ledger
        .register_version(v0, None, digest(), clock.now())
        .await?;
    ledger.commit_version(v0, clock.now()).await?;
    let actors: Vec<ActorId> = (0..args.actors)
        .map(|i| ActorId::new(format!("bench-{i:03}")))
        .collect::<Result<_, _>>()?;
    for a in &actors {
        ledger
            .register_actor(a, "bench", "cpu", clock.now())
            .await?;
        ledger.heartbeat(a, Some(v0), None, clock.now()).await?;
    }
    let t = Instant::now();
    let mut posted = 0;
    while posted < args.jobs {
        let n = (args.jobs - posted).min(4096);
        let prompts: Vec<Vec<u8>> = (posted..posted + n)
            .map(|i| format!("prompt {i:08}").into_bytes())
            .collect();
        let batch = ledger
            .post_batch(v0, &prompts, "{}", clock.now())
            .await
            .context("post batch")?;
        ledger
            .schedule(batch, clock.now())
            .await
            .context("schedule")?;
        posted += n;
    }
    let mut phases = vec![Phase {
        name: "post",
        transitions: posted as u64,
        seconds: t.elapsed().as_secs_f64(),
    }];

    // 1. claim everything.
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for a in actors.clone() {
        let (ledger, clock, batch) = (Arc::clone(&ledger), clock.clone(), args.batch);
        tasks.spawn(async move {
            let mut held = Vec::new();
            loop {
                let jobs = ledger.claim(&a, batch, clock.now()).await?;
                if jobs.is_empty() {
                    return anyhow::Ok((a, held));
                }
                held.extend(jobs);
            }
        });
    }
    let mut held = Vec::new();
    while let Some(r) = tasks.join_next().await {
        held.push(r??);
    }
    let claimed: usize = held.iter().map(|(_, h)| h.len()).sum();
    phases.push(Phase {
        name: "claim",
        transitions: claimed as u64,
        seconds: t.elapsed().as_secs_f64(),
    });
    if claimed != args.jobs {
        bail!("claimed {claimed} of {} jobs", args.jobs);
    }

    // 2. submit half.
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (a, jobs) in &held {
        let (ledger, clock, batch, payload) =
            (Arc::clone(&ledger), clock.clone(), args.batch, args.payload);
        let (a, half) = (a.clone(), jobs[..jobs.len() / 2].to_vec());
        tasks.spawn(async move {
            let mut accepted = 0u64;
            for chunk in half.chunks(batch) {
                let out = ledger
                    .submit(&a, &results(chunk, payload), clock.now())
                    .await?;
                accepted += out.iter().filter(|o| o.verdict.is_ok()).count() as u64;
            }
            anyhow::Ok(accepted)
        });
    }
    let mut accepted = 0;
    while let Some(r) = tasks.join_next().await {
        accepted += r??;
    }
    phases.push(Phase {
        name: "submit",
        transitions: accepted,
        seconds: t.elapsed().as_secs_f64(),
    });

    // 3. the other half's leases run out.
    let last_expiry = held
        .iter()
        .flat_map(|(_, h)| h.iter().map(|j| j.lease_expires))
        .max();
    let last_expiry = last_expiry.context("no leases")?;
    clock.set(last_expiry.plus(Duration::from_millis(1)));
    let later = clock.now();
    let t = Instant::now();
    let mut returned = 0;
    loop {
        let r = ledger.expire(later).await?;
        if r.transitions() == 0 {
            break;
        }
        returned += r.transitions();
    }
    phases.push(Phase {
        name: "expire",
        transitions: returned,
        seconds: t.elapsed().as_secs_f64(),
    });

    // 4. mixed: the returned jobs are claimed from the pool and submitted, sweeper running.
    for a in &actors {
        ledger.heartbeat(a, Some(v0), None, later).await?;
    }
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for a in actors.clone() {
        let (ledger, clock, batch, payload) =
            (Arc::clone(&ledger), clock.clone(), args.batch, args.payload);
        tasks.spawn(async move {
            let mut n = 0u64;
            loop {
                let jobs = ledger.claim(&a, batch, clock.now()).await?;
                if jobs.is_empty() {
                    return anyhow::Ok(n);
                }
                let out = ledger
                    .submit(&a, &results(&jobs, payload), clock.now())
                    .await?;
                n += jobs.len() as u64 + out.iter().filter(|o| o.verdict.is_ok()).count() as u64;
            }
        });
    }
    let stop = Arc::new(tokio::sync::Notify::new());
    let sweeper = {
        let (ledger, clock, stop) = (Arc::clone(&ledger), clock.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut n = 0;
            loop {
                n += ledger.expire(clock.now()).await?.transitions();
                tokio::select! {
                    () = stop.notified() => return anyhow::Ok(n),
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        })
    };
    let mut mixed = 0;
    while let Some(r) = tasks.join_next().await {
        mixed += r??;
    }
    stop.notify_one();
    mixed += sweeper.await??;
    phases.push(Phase {
        name: "mixed",
        transitions: mixed,
        seconds: t.elapsed().as_secs_f64(),
    });

    let counts = ledger.job_counts().await?;
    if counts.done as usize != args.jobs {
        bail!("not every job is done: {counts:?}");
    }
    ledger
        .check_invariants()
        .await
        .context("check invariants")?;
    Ok(phases)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = LedgerConfig {
        max_per_call: args.batch.max(1),
        ..LedgerConfig::default()
    };
    let (url, scratch) = match args.backend {
        BackendArg::Sqlite => {
            let path = std::env::temp_dir()
                .join(format!("starling-ledger-bench-{}.db", std::process::id()));
            (format!("sqlite:{}", path.display()), Scratch::Sqlite(path))
        }
        BackendArg::Postgres => {
            let admin = args
                .url
                .clone()
                .context("--url or STARLING_TEST_POSTGRES_URL is required for postgres")?;
            let name = format!("starling_bench_{}", std::process::id());
            let options = PgConnectOptions::from_str(&admin).context("parse --url")?;
            let mut conn = PgConnection::connect_with(&options)
                .await
                .context("connect to PostgreSQL")?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .execute(&mut conn)
                .await
                .context("create bench database")?;
            (
                database_url(&admin, &name),
                Scratch::Postgres { conn, name },
            )
        }
    };
    println!(
        "ledger-bench: backend {:?}, {} jobs, {} actors, {} jobs per call",
        args.backend, args.jobs, args.actors, args.batch
    );
    let ledger = Arc::new(Ledger::open(&url, config).await.context("open ledger")?);
    let outcome = run(Arc::clone(&ledger), &args).await;
    ledger.close().await;
    drop(ledger);
    scratch.remove().await?;
    let phases = outcome?;
    for p in &phases {
        p.print();
    }
    let measured = &phases[1..];
    let total = Phase {
        name: "total",
        transitions: measured.iter().map(|p| p.transitions).sum(),
        seconds: measured.iter().map(|p| p.seconds).sum(),
    };
    total.print();
    Ok(())
}

/// The throwaway database the benchmark runs on.
#[derive(Debug)]
enum Scratch {
    Sqlite(std::path::PathBuf),
    Postgres { conn: PgConnection, name: String },
}

impl Scratch {
    async fn remove(self) -> anyhow::Result<()> {
        match self {
            Scratch::Sqlite(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let file = format!("{}{suffix}", path.display());
                    match std::fs::remove_file(&file) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            return Err(e).context(format!("remove {file}"));
                        }
                        _ => {}
                    }
                }
            }
            Scratch::Postgres { mut conn, name } => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
                .execute(&mut conn)
                .await
                .context("drop bench database")?;
            }
        }
        Ok(())
    }
}

/// `admin` with its database name replaced by `name`.
fn database_url(admin: &str, name: &str) -> String {
    let (base, query) = admin
        .split_once('?')
        .map_or((admin, None), |(b, q)| (b, Some(q)));
    let start = base.find("://").map_or(0, |i| i + 3);
    let end = base[start..].find('/').map_or(base.len(), |i| start + i);
    match query {
        Some(q) => format!("{}/{name}?{q}", &base[..end]),
        None => format!("{}/{name}", &base[..end]),
    }
}
