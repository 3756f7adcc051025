//! Scheduler simulation through a real ledger (an SQLite file): actors with relative speeds
//! 1:2:3 generate the prompts they are assigned, results go through real submits at times
//! given by a controllable clock, and τ is learned from those submits alone.
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
            multiple: 3.0,
            floor: Duration::from_secs(3_600),
            ceiling: Duration::from_secs(7_200),
            initial: Duration::from_secs(3_600),
            window: 64,
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
                let elapsed = f64::from(n) / speed;
                t += elapsed;
                events.push((t, share.actor.clone(), job.id, n, elapsed, ver));
            }
            makespan = makespan.max(t);
        }
        events.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (t, who, job, n, elapsed, ver) in events {
            let now = start.plus(Duration::from_secs_f64(t));
            self.clock.set(now);
            let result = ResultSubmission {
                job,
                version: v(ver),
                digest: digest_of(ver),
                tokens: n,
                elapsed: Duration::from_secs_f64(elapsed),
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
