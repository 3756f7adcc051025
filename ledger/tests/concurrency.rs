//! Many tasks hammering one ledger at once — claims, progress, expiry sweeps, duplicate
//! submits (same call, later call, from another actor), stale-version, wrong-digest and
//! after-expiry submits — on SQLite and PostgreSQL. Afterwards: every job ends done, no job
//! was accepted twice, nothing was accepted that should not have been, and the invariants
//! hold over all rows.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use starling_ledger::clock::{Clock, ManualClock};
use starling_ledger::*;

const ACTORS: usize = 32;
const JOBS: usize = 2_000;
const VERSION: u64 = 3;

fn config() -> LedgerConfig {
    let lease = Duration::from_secs(5);
    LedgerConfig {
        lease: LeaseConfig {
            margin: 1.0,
            floor: lease,
            ceiling: lease,
            initial: lease,
        },
        max_attempts: 1_000,
        actor_timeout: Duration::from_secs(3_600),
        ..LedgerConfig::default()
    }
}

/// What kind of submission a task made, so we know whether acceptance was allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Good,
    StaleVersion,
    WrongDigest,
    AfterExpiry,
    NotMine,
}

#[derive(Debug, Default)]
struct Tally {
    /// Job → actors whose submission was accepted.
    accepted: HashMap<i64, Vec<String>>,
    /// Accepted submissions that should have been refused.
    wrongly_accepted: Vec<(Kind, i64)>,
    rejections: HashMap<String, u64>,
}

fn submission(job: &ClaimedJob, kind: Kind) -> ResultSubmission {
    let (version, digest) = match kind {
        Kind::StaleVersion => (v(VERSION - 1), digest_of(VERSION - 1)),
        Kind::WrongDigest => (v(VERSION), digest_of(99)),
        _ => (v(VERSION), digest_of(VERSION)),
    };
    ResultSubmission {
        job: job.id,
        version,
        digest,
        tokens: 50,
        elapsed: Duration::from_millis(20),
        payload: vec![1; 32],
    }
}

async fn submit_and_tally(
    ledger: &Ledger,
    who: &ActorId,
    subs: &[(ResultSubmission, Kind)],
    now: Timestamp,
    tally: &Mutex<Tally>,
) {
    let results: Vec<ResultSubmission> = subs.iter().map(|(s, _)| s.clone()).collect();
    let out = ledger.submit(who, &results, now).await.expect("submit");
    let mut t = tally.lock().unwrap();
    for (o, (s, kind)) in out.iter().zip(subs) {
        assert_eq!(o.job, s.job);
        match &o.verdict {
            Ok(()) => {
                t.accepted
                    .entry(s.job.raw())
                    .or_default()
                    .push(who.to_string());
                if *kind != Kind::Good {
                    t.wrongly_accepted.push((*kind, s.job.raw()));
                }
            }
            Err(r) => {
                let name = format!("{r:?}");
                let name = name.split([' ', '{', '(']).next().unwrap_or("").to_owned();
                *t.rejections.entry(name).or_default() += 1;
            }
        }
    }
}

async fn hammer(ledger: Arc<Ledger>) -> Arc<Ledger> {
    let ledger_arc = ledger;
    let ledger = &*ledger_arc;
    versions(ledger, VERSION).await;
    let clock = ManualClock::new(T0);
    let names: Vec<String> = (0..ACTORS).map(|i| format!("actor-{i:02}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    actors_on(ledger, &refs, VERSION, T0).await;
    for _ in 0..4 {
        let b = ledger
            .post_batch(v(VERSION), &prompts(JOBS / 4), "{}", T0)
            .await
            .unwrap();
        ledger.schedule(b, T0).await.unwrap();
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let recent: Arc<Mutex<Vec<ClaimedJob>>> = Arc::default();
    let started = Instant::now();

    let mut tasks = tokio::task::JoinSet::new();
    for (i, name) in names.iter().enumerate() {
        let (clock, tally, recent) = (clock.clone(), Arc::clone(&tally), Arc::clone(&recent));
        let who = actor(name);
        let ledger_ref = Arc::clone(&ledger_arc);
        tasks.spawn(async move {
            let ledger_ref = &*ledger_ref;
            let mut rng = StdRng::seed_from_u64(i as u64);
            // Every job this actor ever leased: a "foreign" result must not be one of these.
            let mut mine = std::collections::HashSet::new();
            loop {
                let counts = ledger_ref.job_counts().await.unwrap();
                if counts.done as usize == JOBS {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(240),
                    "no progress: {counts:?}"
                );
                let now = clock.now();
                if rng.random_bool(0.2) {
                    ledger_ref
                        .heartbeat(&who, Some(v(VERSION)), None, now)
                        .await
                        .unwrap();
                }
                let jobs = ledger_ref
                    .claim(&who, rng.random_range(1..=16), now)
                    .await
                    .unwrap();
                if jobs.is_empty() {
                    tokio::task::yield_now().await;
                    continue;
                }
                recent.lock().unwrap().extend(jobs.iter().cloned());
                mine.extend(jobs.iter().map(|j| j.id));
                if rng.random_bool(0.3) {
                    // Progress: every job moved, so each lease is extended to at most
                    // now + the 5 s floor (margin 1 × the little time since the claim).
                    let moved: Vec<(JobId, u64)> = jobs.iter().map(|j| (j.id, 1)).collect();
                    ledger_ref
                        .progress(&who, &moved, clock.now())
                        .await
                        .unwrap();
                }
                let mut batch = Vec::new();
                for job in &jobs {
                    match rng.random_range(0..100) {
                        0..55 => batch.push((submission(job, Kind::Good), Kind::Good)),
                        55..65 => {
                            // The same result twice in one call.
                            batch.push((submission(job, Kind::Good), Kind::Good));
                            batch.push((submission(job, Kind::Good), Kind::Good));
                        }
                        65..72 => {
                            batch.push((submission(job, Kind::StaleVersion), Kind::StaleVersion))
                        }
                        72..79 => {
                            batch.push((submission(job, Kind::WrongDigest), Kind::WrongDigest))
                        }
                        79..87 => {
                            // Past the lease as we know it (renewal may have extended it further,
                            // so only submit past the furthest possible expiry).
                            let late = clock
                                .now()
                                .plus(Duration::from_secs(5))
                                .plus(Duration::from_millis(1));
                            let s = (submission(job, Kind::AfterExpiry), Kind::AfterExpiry);
                            submit_and_tally(ledger_ref, &who, &[s], late, &tally).await;
                        }
                        _ => {} // abandoned: the lease will expire
                    }
                }
                // A result for a job another actor holds.
                let foreign = {
                    let r = recent.lock().unwrap();
                    if r.is_empty() {
                        None
                    } else {
                        Some(r[rng.random_range(0..r.len())].clone())
                    }
                };
                if let Some(f) = foreign.filter(|f| !mine.contains(&f.id)) {
                    batch.push((submission(&f, Kind::NotMine), Kind::NotMine));
                }
                clock.advance(Duration::from_millis(rng.random_range(0..40)));
                submit_and_tally(ledger_ref, &who, &batch, clock.now(), &tally).await;
                if rng.random_bool(0.2) {
                    // A retry of the whole call, as after a lost acknowledgement.
                    submit_and_tally(ledger_ref, &who, &batch, clock.now(), &tally).await;
                }
                let mut r = recent.lock().unwrap();
                let excess = r.len().saturating_sub(256);
                r.drain(..excess);
            }
        });
    }
    let sweeper = {
        let clock = clock.clone();
        let ledger_ref = Arc::clone(&ledger_arc);
        tokio::spawn(async move {
            let ledger_ref = &*ledger_ref;
            let mut rng = StdRng::seed_from_u64(4242);
            let mut swept = ExpireReport::default();
            loop {
                if ledger_ref.job_counts().await.unwrap().done as usize == JOBS {
                    break swept;
                }
                let now = clock.advance(Duration::from_millis(rng.random_range(0..300)));
                let r = ledger_ref.expire(now).await.unwrap();
                swept.returned += r.returned;
                swept.failed += r.failed;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    while let Some(r) = tasks.join_next().await {
        r.expect("actor task");
    }
    let swept = sweeper.await.expect("sweeper task");

    let t = std::mem::take(&mut *tally.lock().unwrap());
    println!(
        "{:?}: swept {swept:?}; rejections {:?}",
        ledger.backend(),
        t.rejections
    );
    assert!(
        t.wrongly_accepted.is_empty(),
        "accepted what must be refused: {:?}",
        t.wrongly_accepted
    );
    assert_eq!(t.accepted.len(), JOBS, "every job accepted once");
    for (job, who) in &t.accepted {
        assert_eq!(
            who.len(),
            1,
            "job {job} accepted {} times: {who:?}",
            who.len()
        );
        let view = ledger.job(JobId::from_raw(*job)).await.unwrap();
        assert_eq!(view.state, JobState::Done);
        assert_eq!(
            view.accepted_from.map(|a| a.to_string()).as_ref(),
            Some(&who[0])
        );
    }
    for reason in [
        "AlreadyAccepted",
        "StaleVersion",
        "DigestMismatch",
        "LeaseExpired",
        "NotLeaseHolder",
    ] {
        assert!(
            t.rejections.get(reason).copied().unwrap_or(0) > 0,
            "scenario {reason} never happened"
        );
    }
    assert!(swept.returned > 0, "some leases expired and were returned");
    let counts = ledger.job_counts().await.unwrap();
    assert_eq!((counts.done, counts.total()), (JOBS as u64, JOBS as u64));
    ledger.check_invariants().await.unwrap();
    ledger_arc
}

async fn finish(ledger: Arc<Ledger>, db: TestDb) {
    let ledger = Arc::try_unwrap(ledger).expect("all tasks ended");
    db.cleanup(ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hammer_sqlite() {
    let (ledger, db) = sqlite(config()).await;
    finish(hammer(Arc::new(ledger)).await, db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hammer_postgres() {
    let Some((ledger, db)) = postgres(config(), "hammer").await else {
        return;
    };
    finish(hammer(Arc::new(ledger)).await, db).await;
}
