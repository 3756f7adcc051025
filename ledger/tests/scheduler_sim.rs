//! Scheduler simulation through a real ledger (an SQLite file): actors with relative speeds
//! 1:2:3 generate the prompts they are assigned, results go through real submits at times
//! given by a controllable clock, and τ is learned from those submits alone — on the ledger's
//! clock (the elapsed times the simulated actors report are deliberately wrong), with each
//! actor polling once (an empty claim) when it runs out of work, as real workers do.
//!
//! Shows: the proportional split finishes within 10% of the ideal makespan while a uniform
//! split of the same prompts is far worse; when one actor slows down 3× its share shrinks
//! within a few batches; an actor two versions behind gets no work, and when it catches up it
//! rejoins with a small share that grows as its measured throughput restores τ.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use starling_ledger::clock::{Clock, ManualClock};
use starling_ledger::*;

const B: usize = 512;

fn config() -> LedgerConfig {
    LedgerConfig {
        alpha: 0.5,
        beta: 0.8,
        initial_tau: 100.0,
        lease: LeaseConfig {
            margin: 3.0,
            floor: Duration::from_secs(3_600),
            ceiling: Duration::from_secs(7_200),
            initial: Duration::from_secs(3_600),
        },
        actor_timeout: Duration::from_secs(3_600),
        ..LedgerConfig::default()
    }
}

struct Sim {
    ledger: Ledger,
    db: TestDb,
    clock: ManualClock,
    rng: StdRng,
    /// Actor name → (speed in tokens/s, version it generates with).
    actors: BTreeMap<&'static str, (f64, u64)>,
}

#[derive(Debug)]
struct BatchStats {
    counts: BTreeMap<String, u32>,
    commits: Vec<String>,
    makespan: f64,
    ideal: f64,
    uniform: f64,
}

impl BatchStats {
    fn share(&self, actor: &str) -> f64 {
        f64::from(self.counts.get(actor).copied().unwrap_or(0)) / B as f64
    }
}

impl Sim {
    async fn new(actors: &[(&'static str, f64)]) -> Sim {
        let (ledger, db) = sqlite(config()).await;
        versions(&ledger, 2).await;
        let clock = ManualClock::new(T0);
        for (name, _) in actors {
            ledger
                .register_actor(&actor(name), "sim", "sim-gpu", clock.now())
                .await
                .unwrap();
        }
        let sim = Sim {
            ledger,
            db,
            clock,
            rng: StdRng::seed_from_u64(0x5eed_5ca1e),
            actors: actors.iter().map(|&(n, s)| (n, (s, 2))).collect(),
        };
        sim.heartbeats(None).await;
        sim
    }

    async fn heartbeats(&self, staged: Option<(&str, u64)>) {
        for (name, &(_, ver)) in &self.actors {
            let st = staged.filter(|(n, _)| n == name).map(|(_, s)| v(s));
            self.ledger
                .heartbeat(&actor(name), Some(v(ver)), st, self.clock.now())
                .await
                .unwrap();
        }
    }

    /// Posts, schedules and runs one batch of version `version` to completion.
    async fn batch(&mut self, version: u64) -> BatchStats {
        let tokens: Vec<u32> = (0..B).map(|_| self.rng.random_range(64..=1024)).collect();
        let prompts: Vec<Vec<u8>> = tokens.iter().map(|t| t.to_string().into_bytes()).collect();
        let start = self.clock.now();
        let batch = self
            .ledger
            .post_batch(v(version), &prompts, "{}", start)
            .await
            .unwrap();
        let assignment = self.ledger.schedule(batch, start).await.unwrap();
        let commits = assignment
            .shares
            .iter()
            .filter(|s| s.commit)
            .map(|s| s.actor.to_string())
            .collect();
        for s in assignment.shares.iter().filter(|s| s.commit) {
            // COMMIT(v) received: the actor activates the staged version before generating.
            self.actors.get_mut(s.actor.as_str()).unwrap().1 = version;
        }
        let mut counts = BTreeMap::new();
        let mut events = Vec::new();
        let mut makespan: f64 = 0.0;
        for share in &assignment.shares {
            let name = share.actor.as_str();
            let (speed, ver) = self.actors[name];
            let jobs = self
                .ledger
                .claim(&share.actor, share.count as usize, start)
                .await
                .unwrap();
            assert_eq!(
                jobs.len(),
                share.count as usize,
                "{name} claims exactly its share"
            );
            counts.insert(name.to_owned(), share.count);
            let mut t = 0.0;
            for job in jobs {
                let n: u32 = std::str::from_utf8(&job.prompt).unwrap().parse().unwrap();
                t += f64::from(n) / speed;
                events.push((t, share.actor.clone(), Some((job.id, n, ver))));
            }
            // Out of work: the worker polls once and finds nothing.
            events.push((t + 0.001, share.actor.clone(), None));
            makespan = makespan.max(t);
        }
        events.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (t, who, job) in events {
            let now = start.plus(Duration::from_secs_f64(t));
            self.clock.set(now);
            let Some((job, n, ver)) = job else {
                let none = self.ledger.claim(&who, 1, now).await.unwrap();
                assert!(none.is_empty(), "{who} polls after its share");
                continue;
            };
            let result = ResultSubmission {
                job,
                version: v(ver),
                digest: digest_of(ver),
                tokens: n,
                // What the actor says it took, ignored by the ledger (it would make every
                // actor look equally fast).
                elapsed: Duration::from_secs(1),
                payload: vec![],
            };
            let out = self.ledger.submit(&who, &[result], now).await.unwrap();
            assert_eq!(out[0].verdict, Ok(()), "{who} result for {job}");
        }
        let total: f64 = tokens.iter().map(|&t| f64::from(t)).sum();
        let eligible: Vec<f64> = assignment
            .shares
            .iter()
            .map(|s| self.actors[s.actor.as_str()].0)
            .collect();
        let ideal = total / eligible.iter().sum::<f64>();
        // The same prompts split evenly, in order, over the same actors.
        let per = B.div_ceil(eligible.len());
        let uniform = tokens
            .chunks(per)
            .zip(&eligible)
            .map(|(chunk, speed)| chunk.iter().map(|&t| f64::from(t)).sum::<f64>() / speed)
            .fold(0.0, f64::max);
        self.clock.advance(Duration::from_secs(1));
        self.heartbeats(None).await;
        BatchStats {
            counts,
            commits,
            makespan,
            ideal,
            uniform,
        }
    }

    async fn tau(&self, name: &str) -> f64 {
        self.ledger.actor(&actor(name)).await.unwrap().tau
    }

    async fn finish(self) {
        self.ledger.check_invariants().await.unwrap();
        self.db.cleanup(self.ledger).await;
    }
}

#[tokio::test]
async fn proportional_split_beats_uniform_and_tracks_ideal() {
    let mut sim = Sim::new(&[("speed1", 100.0), ("speed2", 200.0), ("speed3", 300.0)]).await;
    for round in 0..6 {
        let s = sim.batch(2).await;
        println!(
            "batch {round}: shares {:?}  makespan {:.1}s  ideal {:.1}s ({:+.1}%)  uniform split {:.1}s ({:+.1}%)",
            s.counts,
            s.makespan,
            s.ideal,
            100.0 * (s.makespan / s.ideal - 1.0),
            s.uniform,
            100.0 * (s.uniform / s.ideal - 1.0),
        );
        if round >= 2 {
            // τ has been learned from the first batches' submits.
            assert!(s.makespan <= 1.10 * s.ideal, "batch {round}: {s:?}");
            assert!(
                s.uniform >= 1.5 * s.ideal,
                "uniform should be much worse: {s:?}"
            );
            assert!(s.makespan < s.uniform);
            assert!((s.share("speed3") - 0.5).abs() < 0.05, "{s:?}");
        }
    }
    for (name, speed) in [("speed1", 100.0), ("speed2", 200.0), ("speed3", 300.0)] {
        let tau = sim.tau(name).await;
        assert!(
            (tau - speed).abs() / speed < 0.02,
            "{name}: tau {tau} vs speed {speed}"
        );
    }
    sim.finish().await;
}

#[tokio::test]
async fn a_slowed_actor_loses_share_within_a_few_batches() {
    let mut sim = Sim::new(&[("speed1", 100.0), ("speed2", 200.0), ("speed3", 300.0)]).await;
    for _ in 0..3 {
        sim.batch(2).await;
    }
    let before = sim.batch(2).await.share("speed3");
    println!("speed3 share before slowdown: {before:.3}");
    assert!(before > 0.45);
    sim.actors.get_mut("speed3").unwrap().0 = 100.0; // throttled 3×
    let mut shares = Vec::new();
    let mut last = None;
    for round in 0..4 {
        let s = sim.batch(2).await;
        println!(
            "after slowdown, batch {round}: speed3 share {:.3}, makespan {:.1}s vs ideal {:.1}s",
            s.share("speed3"),
            s.makespan,
            s.ideal
        );
        shares.push(s.share("speed3"));
        last = Some(s);
    }
    // The first batch after the slowdown was sized with the old τ; from the second on the
    // share follows the new speed: 100 / (100 + 200 + 100) = 25%.
    assert!(
        shares[1] < 0.30,
        "share should shrink within two batches: {shares:?}"
    );
    assert!((shares[3] - 0.25).abs() < 0.03, "{shares:?}");
    let last = last.unwrap();
    assert!(last.makespan <= 1.10 * last.ideal, "{last:?}");
    sim.finish().await;
}

#[tokio::test]
async fn actors_two_versions_behind_get_nothing_and_rejoin_conservatively() {
    let mut sim = Sim::new(&[("speed1", 100.0), ("speed2", 200.0), ("laggard", 300.0)]).await;
    for _ in 0..3 {
        sim.batch(2).await;
    }
    let fair = sim.batch(2).await.share("laggard");
    let tau_before = sim.tau("laggard").await;
    // The laggard falls back to v0 (say it restarted from an old anchor): two versions behind.
    sim.actors.get_mut("laggard").unwrap().1 = 0;
    sim.heartbeats(None).await;
    for round in 0..2 {
        let s = sim.batch(2).await;
        println!("laggard on v0, batch {round} of v2: shares {:?}", s.counts);
        assert_eq!(s.share("laggard"), 0.0, "two versions behind: no work");
        assert!(
            s.makespan <= 1.10 * s.ideal,
            "the others absorb the batch: {s:?}"
        );
    }
    let decayed = sim.tau("laggard").await;
    assert!(
        (decayed - tau_before * 0.25).abs() < 1e-6,
        "τ decays by α per excluded round: {decayed}"
    );
    // It catches up to v1 with D(v2) staged: eligible, told to COMMIT(v2), but with a small share.
    sim.actors.get_mut("laggard").unwrap().1 = 1;
    sim.heartbeats(Some(("laggard", 2))).await;
    let rejoin = sim.batch(2).await;
    println!(
        "laggard rejoins: share {:.3} (was {fair:.3}), commits {:?}",
        rejoin.share("laggard"),
        rejoin.commits
    );
    assert_eq!(rejoin.commits, vec!["laggard".to_owned()]);
    assert!(rejoin.share("laggard") > 0.0);
    assert!(
        rejoin.share("laggard") < fair / 2.0,
        "rejoin conservatively: {rejoin:?}"
    );
    // Its measured throughput restores τ, and with it its share.
    let next = sim.batch(2).await;
    println!("laggard next batch: share {:.3}", next.share("laggard"));
    assert!(next.share("laggard") > rejoin.share("laggard"));
    assert!((next.share("laggard") - fair).abs() < 0.05, "{next:?}");
    sim.finish().await;
}

/// One simulated worker of the far-region runs: a generation speed, a round trip to the hub,
/// and how long after a version is published it has that version staged.
#[derive(Debug, Clone)]
struct Worker {
    name: &'static str,
    /// Tokens per second while generating.
    speed: f64,
    /// Round trip to the hub, seconds.
    rtt: f64,
    /// Seconds from a batch's posting until its version is staged here.
    arrival: f64,
    /// Jobs per claim (the actor's claim depth: enough to outlast its round trip).
    claim: usize,
}

/// The batches of a far-region run.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// Tokens per job, uniform in this range.
    tokens: (u32, u32),
    /// Whether the hub passes its round-trip estimate with each submit (`SubmitCall::round_trip`).
    hub_rtt: bool,
}

#[derive(Debug, Clone)]
enum Ev {
    /// The worker's claim reaches the hub.
    Claim(usize),
    /// The hub's answer reaches the worker.
    Jobs(usize, Vec<ClaimedJob>),
    /// The worker's engine finished its current call.
    Generated(usize),
    /// The worker's results reach the hub.
    Submit(usize, Vec<ClaimedJob>),
    /// The worker's heartbeat saying the batch's version is staged reaches the hub.
    Staged(usize),
}

/// Per worker, during one batch.
#[derive(Debug, Default, Clone)]
struct WorkerState {
    queued: Vec<Vec<ClaimedJob>>,
    running: Option<Vec<ClaimedJob>>,
    claim_out: bool,
    accepted: u32,
}

#[derive(Debug)]
struct FarBatch {
    counts: Vec<u32>,
    makespan: f64,
    /// All tokens over all speeds: no round trips, no arrival delays.
    ideal: f64,
    /// What Algorithm 1's version gating gives: the far actor (its version not yet staged
    /// when the batch is split) excluded, the near ones generating everything.
    excluded: f64,
}

/// Runs `batches` batches of `B_FAR` prompts through a real ledger with `workers` claiming
/// their `claim` jobs at a time, pipelined (claim the next while generating, holding at most
/// twice that) or not (claim again only after the verdicts of the last submit came back).
async fn far_region_run(
    workers: &[Worker],
    batches: usize,
    pipelined: bool,
    shape: Shape,
) -> (Vec<FarBatch>, Vec<f64>) {
    const B_FAR: usize = 64;
    let (ledger, db) = sqlite(LedgerConfig {
        initial_tau: 1_000.0,
        ..LedgerConfig::default()
    })
    .await;
    versions(&ledger, 0).await;
    let mut rng = StdRng::seed_from_u64(24);
    let mut now = 0.0_f64;
    let t = |s: f64| T0.plus(Duration::from_secs_f64(s));
    for w in workers {
        ledger
            .register_actor(&actor(w.name), "sim", "sim", t(0.0))
            .await
            .unwrap();
    }
    let mut out = Vec::new();
    for b in 0..batches {
        let version = b as u64 + 1;
        // The trainer publishes the batch's version just before posting it.
        ledger
            .register_version(v(version), Some(v(version - 1)), digest_of(version), t(now))
            .await
            .unwrap();
        ledger.commit_version(v(version), t(now)).await.unwrap();
        for w in workers {
            ledger
                .heartbeat(&actor(w.name), Some(v(version - 1)), None, t(now))
                .await
                .unwrap();
        }
        let tokens: Vec<u32> = (0..B_FAR)
            .map(|_| rng.random_range(shape.tokens.0..=shape.tokens.1))
            .collect();
        let prompts: Vec<Vec<u8>> = tokens.iter().map(|n| n.to_string().into_bytes()).collect();
        let start = now;
        let batch = ledger
            .post_batch_budgeted(v(version), &prompts, &[1024; B_FAR], "{}", 1, t(start))
            .await
            .unwrap();
        // The hub schedules within a tick (100 ms); the near region has its version by then.
        let mut events: Vec<(f64, Ev)> = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            events.push((start + w.arrival + w.rtt / 2.0, Ev::Staged(i)));
            events.push((start + 0.1 + w.rtt / 2.0, Ev::Claim(i)));
        }
        let scheduled_at = start + 0.1;
        let mut scheduled = false;
        let mut st = vec![WorkerState::default(); workers.len()];
        let mut done = 0;
        while done < B_FAR {
            let k = (0..events.len())
                .min_by(|&x, &y| events[x].0.total_cmp(&events[y].0))
                .expect("events pending while jobs remain");
            let (at, ev) = events.swap_remove(k);
            if !scheduled && at >= scheduled_at {
                ledger.schedule(batch, t(scheduled_at)).await.unwrap();
                scheduled = true;
            }
            now = at;
            match ev {
                Ev::Staged(i) => {
                    ledger
                        .heartbeat(
                            &actor(workers[i].name),
                            Some(v(version - 1)),
                            Some(v(version)),
                            t(at),
                        )
                        .await
                        .unwrap();
                }
                Ev::Claim(i) => {
                    let w = &workers[i];
                    let jobs = ledger.claim(&actor(w.name), w.claim, t(at)).await.unwrap();
                    events.push((at + w.rtt / 2.0, Ev::Jobs(i, jobs)));
                }
                Ev::Jobs(i, jobs) => {
                    let w = &workers[i];
                    let s = &mut st[i];
                    s.claim_out = false;
                    if jobs.is_empty() {
                        // Poll again in 100 ms.
                        s.claim_out = true;
                        events.push((at + 0.1 + w.rtt / 2.0, Ev::Claim(i)));
                        continue;
                    }
                    s.queued.push(jobs);
                    if s.running.is_none() {
                        let next = s.queued.remove(0);
                        let work: f64 = next.iter().map(|j| job_tokens(j) / w.speed).sum();
                        s.running = Some(next);
                        events.push((at + work, Ev::Generated(i)));
                    }
                    let held: usize = s.queued.iter().chain(&s.running).map(Vec::len).sum();
                    if pipelined && held <= w.claim {
                        s.claim_out = true;
                        events.push((at + w.rtt / 2.0, Ev::Claim(i)));
                    }
                }
                Ev::Generated(i) => {
                    let w = &workers[i];
                    let s = &mut st[i];
                    let results = s.running.take().unwrap_or_default();
                    events.push((at + w.rtt / 2.0, Ev::Submit(i, results)));
                    if !s.queued.is_empty() {
                        let next = s.queued.remove(0);
                        let work: f64 = next.iter().map(|j| job_tokens(j) / w.speed).sum();
                        s.running = Some(next);
                        events.push((at + work, Ev::Generated(i)));
                    }
                    let held: usize = s.queued.iter().chain(&s.running).map(Vec::len).sum();
                    if !s.claim_out && held <= w.claim {
                        s.claim_out = true;
                        // Unpipelined, the next claim follows the verdicts: a round trip on.
                        let delay = if pipelined { 0.5 } else { 1.5 } * w.rtt;
                        events.push((at + delay, Ev::Claim(i)));
                    }
                }
                Ev::Submit(i, jobs) => {
                    let subs: Vec<ResultSubmission> = jobs
                        .iter()
                        .map(|j| ResultSubmission {
                            job: j.id,
                            version: v(version),
                            digest: digest_of(version),
                            tokens: job_tokens(j) as u32,
                            elapsed: Duration::from_millis(1),
                            payload: vec![],
                        })
                        .collect();
                    let call = SubmitCall {
                        results: &subs,
                        round_trip: shape
                            .hub_rtt
                            .then(|| Duration::from_secs_f64(workers[i].rtt)),
                        ..SubmitCall::default()
                    };
                    let verdicts = ledger
                        .submit_call(&actor(workers[i].name), call, t(at))
                        .await
                        .unwrap();
                    let ok = verdicts.iter().filter(|o| o.verdict.is_ok()).count();
                    assert_eq!(ok, subs.len(), "{verdicts:?}");
                    st[i].accepted += ok as u32;
                    done += ok;
                }
            }
        }
        // Every worker polls once more and finds nothing; the trainer takes a second.
        for w in workers {
            let none = ledger
                .claim(&actor(w.name), w.claim, t(now + w.rtt / 2.0))
                .await
                .unwrap();
            assert!(none.is_empty());
        }
        let total: f64 = tokens.iter().map(|&n| f64::from(n)).sum();
        out.push(FarBatch {
            counts: st.iter().map(|s| s.accepted).collect(),
            makespan: now - start,
            ideal: total / workers.iter().map(|w| w.speed).sum::<f64>(),
            excluded: total
                / workers
                    .iter()
                    .filter(|w| w.arrival < 0.1)
                    .map(|w| w.speed)
                    .sum::<f64>(),
        });
        now += 1.0;
    }
    let mut taus = Vec::new();
    for w in workers {
        taus.push(ledger.actor(&actor(w.name)).await.unwrap().tau);
    }
    ledger.check_invariants().await.unwrap();
    db.cleanup(ledger).await;
    (out, taus)
}

/// The demo's actors: speeds 3,000 and 1,000 tokens/s 40 ms from the hub (their versions
/// staged 50 ms after a batch is posted, 4 jobs a claim), and a speed-2,000 one 150 ms away
/// whose version is staged `far_arrival` s after the batch, claiming `far_claim` jobs.
fn demo_workers(far_arrival: f64, far_claim: usize) -> [Worker; 3] {
    let near = |name, speed| Worker {
        name,
        speed,
        rtt: 0.04,
        arrival: 0.05,
        claim: 4,
    };
    [
        near("eu-a1", 3_000.0),
        near("eu-a2", 1_000.0),
        Worker {
            name: "ap-a1",
            speed: 2_000.0,
            rtt: 0.15,
            arrival: far_arrival,
            claim: far_claim,
        },
    ]
}

fn job_tokens(j: &ClaimedJob) -> f64 {
    std::str::from_utf8(&j.prompt).unwrap().parse().unwrap()
}

/// The demo's shape (issue 24): speeds 1:2:3, the speed-2 actor in a far region 150 ms away
/// whose versions arrive 1.5 s after each batch is posted (the near region's at once). With
/// pipelined claims and the far actor's share held for it until its version arrives, it
/// takes part in every batch with about its speed's share, the batch ends sooner than with
/// the far actor excluded (Algorithm 1's gating), and its throughput estimate — on the
/// ledger's clock — ranks it above the near speed-1 actor. Without pipelining every claim
/// costs it a round trip idle, and its estimate (what it really delivers) shows it. Cost:
/// ~2 s.
#[tokio::test]
async fn the_far_actor_works_every_batch_with_its_speeds_share() {
    let workers = demo_workers(1.5, 4);
    let long = Shape {
        tokens: (64, 1024),
        hub_rtt: true,
    };
    let (batches, taus) = far_region_run(&workers, 8, true, long).await;
    for (k, b) in batches.iter().enumerate() {
        let total: u32 = b.counts.iter().sum();
        let far = f64::from(b.counts[2]) / f64::from(total);
        println!(
            "pipelined batch {k}: shares {:?} (far {:.0}% vs its speed's 33%), makespan {:.2} s vs ideal {:.2} s ({:+.0}%), far excluded {:.2} s",
            b.counts,
            100.0 * far,
            b.makespan,
            b.ideal,
            100.0 * (b.makespan / b.ideal - 1.0),
            b.excluded,
        );
        assert!(
            b.counts.iter().all(|&c| c > 0),
            "every actor takes part: {b:?}"
        );
        if k >= 2 {
            assert!(
                (far - 1.0 / 3.0).abs() <= 0.25 / 3.0,
                "far share {far:.3}: {b:?}"
            );
            // The far actor starts 1.5 s late (its version's arrival) with a full share, so
            // the batch ends up to that much after the ideal (and the split counts prompts,
            // not their lengths); still sooner than without it.
            assert!(b.makespan <= 1.5 * b.ideal, "{b:?}");
            assert!(b.makespan < b.excluded, "{b:?}");
        }
    }
    println!("pipelined: tau {taus:.0?} for speeds 3000, 1000, 2000 tokens/s");
    assert!(
        taus[2] > 1.5 * taus[1],
        "the far speed-2 actor ranks above the speed-1 one: {taus:?}"
    );
    assert!(
        (taus[2] / 2_000.0 - 1.0).abs() < 0.15,
        "far tau {}",
        taus[2]
    );

    let (_, unpipelined) = far_region_run(&workers, 8, false, long).await;
    println!("one claim at a time: tau {unpipelined:.0?}");
    assert!(
        unpipelined[2] < 0.9 * taus[2],
        "a round trip per claim shows in what it delivers: {unpipelined:?} vs {taus:?}"
    );
}

/// The demo's own batches: the same actors, but jobs of 20–60 tokens, so a batch of 64 is
/// ~0.4 s of generation, the far actor's version arrives 0.12 s after the batch is posted and
/// its round trip is 0.15 s. The far actor claims what it generates in a round trip (8 jobs),
/// the near ones 4. Measured on whole deliveries (Algorithm 1: no round trip from the hub),
/// the round trip is folded into the far actor's rate (−13% here; in the demo, where shares
/// shrink with it, it fell below the speed-1 actor); with the hub's round trip taken off its
/// first delivery after idleness, its τ is within 10% of its speed, and each batch is split
/// so that everyone finishes together: batches end no later. (Both stay ~2× the ideal: at
/// 0.4 s of work, the far actor's 0.27 s of arrival and round trip is most of a batch.)
/// Cost: ~2 s.
#[tokio::test]
async fn short_batches_measure_the_far_actor_at_its_speed_and_split_for_the_makespan() {
    let workers = demo_workers(0.12, 8);
    let short = |hub_rtt| Shape {
        tokens: (20, 60),
        hub_rtt,
    };
    let (with, taus) = far_region_run(&workers, 10, true, short(true)).await;
    let (without, folded) = far_region_run(&workers, 10, true, short(false)).await;
    let mean = |b: &[FarBatch], f: &dyn Fn(&FarBatch) -> f64| {
        b[3..].iter().map(f).sum::<f64>() / (b.len() - 3) as f64
    };
    for (name, run, tau) in [
        ("hub round trip", &with, &taus),
        ("folded", &without, &folded),
    ] {
        println!(
            "{name}: tau {tau:.0?} for speeds 3000, 1000, 2000; far share {:.0}%; makespan {:.0}% over ideal",
            100.0 * mean(run, &|b| f64::from(b.counts[2]) / 64.0),
            100.0 * (mean(run, &|b| b.makespan / b.ideal) - 1.0),
        );
    }
    assert!(
        (taus[2] / 2_000.0 - 1.0).abs() < 0.1 && taus[2] > 1.5 * taus[1],
        "measured at its speed, above the speed-1 actor: {taus:?}"
    );
    assert!(
        folded[2] < 0.9 * taus[2],
        "whole deliveries fold the round trip into the far actor's rate: {folded:?} vs {taus:?}"
    );
    for b in &with[3..] {
        assert!(
            b.counts.iter().all(|&c| c > 0),
            "every actor takes part: {b:?}"
        );
    }
    assert!(
        mean(&with, &|b| b.makespan) <= mean(&without, &|b| b.makespan),
        "splitting for the makespan ends batches sooner"
    );
}
