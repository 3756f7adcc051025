//! The scheduling decision of SparrowRL Algorithm 1 (§5.3), as pure functions: who is eligible
//! for a batch of version v, how many prompts each eligible actor gets, who must be sent
//! COMMIT(v), and how τ moves (decay on exclusion, EMA on settle).
//!
//! One change to the paper's eligibility: an actor on v−1 whose D(v) has not finished arriving
//! is eligible too ([`Eligibility::Arriving`]). A batch is scheduled within a tick of being
//! posted, which is right after v is published: the near region has staged v by then, a far
//! one is still receiving it. Excluding it (and decaying its τ) left the demo's far actor with
//! no work for runs of 7 consecutive steps although v reached it well before the batch ended.
//! Its share is reserved; the ledger hands it out only once the actor can run v (it reports v
//! staged or active), and the claim timeout returns a share its actor never comes for to the
//! shared pool.
//!
//! Invariants of [`plan`]: the counts sum to exactly the batch size (largest-remainder
//! rounding, so no prompt is dropped); ineligible actors get nothing and appear in
//! `decayed` with τ·α; every eligible actor appears in `shares` (even with a count of zero, so
//! that it still receives its COMMIT); and when the batch has at least one prompt per eligible
//! actor, every eligible actor gets at least one. No I/O, no clock: the SQL layer feeds it rows.
//!
//! The one-prompt floor is ours, not the paper's: τ is only ever updated when an actor settles
//! work, so an actor whose τ decayed (it was excluded once, say it registered a moment after a
//! batch was split) or started low would round to zero prompts in every later batch and never
//! be measured again — starved for the rest of the run. One prompt per batch costs a fast
//! cluster almost nothing and lets τ climb back by the EMA. The floor is taken from the
//! actors with the largest counts, so proportions are otherwise kept.

use std::cmp::Ordering;

use std::time::Duration;

use crate::ids::{ActorId, Timestamp, Version};

/// What the scheduler needs to know about one registered actor.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorState {
    /// The actor.
    pub id: ActorId,
    /// The version it generates with.
    pub active: Option<Version>,
    /// The version it has fully staged (received and verified, not yet applied).
    pub staged: Option<Version>,
    /// Its throughput estimate τ, in tokens per second.
    pub tau: f64,
    /// The time a delivery after idleness costs it beyond τ (its round trip to the hub and
    /// its start-up), in seconds; 0 until measured ([`learn`]).
    pub latency_s: f64,
    /// Its accepted tokens per job (prompt), when measured: converts a batch's prompts into
    /// the time they take (`plan` with latencies).
    pub tokens_per_job: Option<f64>,
    /// Whether its last heartbeat is recent enough to count it in.
    pub alive: bool,
    /// Whether a share of it timed out unclaimed and it has not claimed since (a fenced
    /// engine heartbeats but takes no work): not scheduled until it claims again.
    pub stalled: bool,
}

/// Where an actor stands with respect to a target version v.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eligibility {
    /// Active on v, or on a newer version (its results come from a version at least as new
    /// as the batch's and never beyond the newest, so they are within any staleness bound):
    /// gets work.
    OnVersion,
    /// Active on v−1 with D(v) staged: gets work and COMMIT(v).
    NeedsCommit,
    /// Active on v−1, D(v) still arriving: gets work (held for it until it can run v, or
    /// until the claim timeout) and COMMIT(v).
    Arriving,
    /// Anything else (behind by more, silent, stalled): no work, τ decays.
    Ineligible,
}

/// The eligibility rule of Algorithm 1 (lines 3 and 8), with the staging condition of §5.3.
pub fn eligibility(target: Version, actor: &ActorState) -> Eligibility {
    if !actor.alive || actor.stalled {
        return Eligibility::Ineligible;
    }
    if actor.active.is_some_and(|a| a >= target) {
        return Eligibility::OnVersion;
    }
    if actor.active.is_some() && actor.active == target.previous() {
        return if actor.staged == Some(target) {
            Eligibility::NeedsCommit
        } else {
            Eligibility::Arriving
        };
    }
    Eligibility::Ineligible
}

/// One eligible actor's part of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The actor.
    pub actor: ActorId,
    /// How many prompts it gets.
    pub count: u32,
    /// Whether it must be sent COMMIT(v) before generating.
    pub commit: bool,
}

/// The outcome of one scheduling round.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// One entry per eligible actor, counts summing to the batch size.
    pub shares: Vec<Share>,
    /// Ineligible actors and their decayed τ (τ·α).
    pub decayed: Vec<(ActorId, f64)>,
}

/// How a batch is split over the eligible actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Split {
    /// In proportion to each actor's throughput estimate τ (Algorithm 1).
    #[default]
    Proportional,
    /// Evenly, whatever τ says: the baseline the benchmarks compare Algorithm 1 against.
    Uniform,
}

/// No actor may run the target version, so the batch cannot be placed without dropping prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no actor is on {0} or on its predecessor with it staged")]
pub struct NoEligibleActors(pub Version);

/// Splits a batch of `batch_size` prompts of version `target` over `actors` (Algorithm 1).
///
/// Each eligible actor gets ⌊B·τ_a/T⌋ and the remaining prompts go one each to the actors with
/// the largest fractional parts (ties: larger τ, then smaller id), so the counts sum to B.
/// If every eligible τ is zero (or not finite), the split is even. Where actors have measured
/// latencies (and tokens per job), the exact shares are those that let every actor finish
/// together ([`finish_together`]) instead of B·τ_a/T.
pub fn plan(
    target: Version,
    batch_size: u32,
    actors: &[ActorState],
    alpha: f64,
    split: Split,
) -> Result<Plan, NoEligibleActors> {
    let mut eligible: Vec<(&ActorState, bool)> = Vec::new();
    let mut decayed = Vec::new();
    for a in actors {
        match eligibility(target, a) {
            Eligibility::OnVersion => eligible.push((a, false)),
            Eligibility::NeedsCommit | Eligibility::Arriving => eligible.push((a, true)),
            Eligibility::Ineligible => decayed.push((a.id.clone(), a.tau * alpha)),
        }
    }
    if eligible.is_empty() {
        return Err(NoEligibleActors(target));
    }
    let weight = |a: &ActorState| {
        if a.tau.is_finite() && a.tau > 0.0 {
            a.tau
        } else {
            0.0
        }
    };
    let total: f64 = eligible.iter().map(|(a, _)| weight(a)).sum();
    let even = split == Split::Uniform || !(total.is_finite() && total > 0.0);
    let b = f64::from(batch_size);
    let exact: Vec<f64> = if even {
        vec![b / eligible.len() as f64; eligible.len()]
    } else {
        let weights: Vec<f64> = eligible.iter().map(|(a, _)| weight(a)).collect();
        let latencies: Vec<f64> = eligible
            .iter()
            .map(|(a, _)| {
                if a.latency_s.is_finite() && a.latency_s > 0.0 {
                    a.latency_s
                } else {
                    0.0
                }
            })
            .collect();
        match tokens_per_job(&eligible) {
            Some(m) if latencies.iter().any(|&l| l > 0.0) => {
                finish_together(b, m, &weights, &latencies)
            }
            _ => weights.iter().map(|w| b * w / total).collect(),
        }
    };
    let mut parts: Vec<(usize, u32, f64)> = exact
        .iter()
        .enumerate()
        .map(|(i, &exact)| {
            // 0 <= exact <= b, so the floor fits u32.
            let floor = exact.floor().clamp(0.0, b) as u32;
            (i, floor, exact - f64::from(floor))
        })
        .collect();
    let assigned: u32 = parts.iter().map(|p| p.1).sum();
    let mut remainder = batch_size.saturating_sub(assigned) as usize;
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by(|&x, &y| {
        let (px, py) = (&parts[x], &parts[y]);
        py.2.partial_cmp(&px.2)
            .unwrap_or(Ordering::Equal)
            .then_with(|| {
                weight(eligible[py.0].0)
                    .partial_cmp(&weight(eligible[px.0].0))
                    .unwrap_or(Ordering::Equal)
            })
            .then_with(|| eligible[px.0].0.id.cmp(&eligible[py.0].0.id))
    });
    // Rounding can leave at most one prompt per actor; cycle in case of float edge cases.
    let mut k = 0;
    while remainder > 0 {
        parts[order[k % order.len()]].1 += 1;
        remainder -= 1;
        k += 1;
    }
    // The one-prompt floor (module docs): each actor at zero takes one from the largest share.
    if batch_size as usize >= parts.len() {
        while let Some(zero) = parts.iter().position(|p| p.1 == 0) {
            let Some(richest) = (0..parts.len()).max_by_key(|&i| parts[i].1) else {
                break;
            };
            if parts[richest].1 < 2 {
                break;
            }
            parts[richest].1 -= 1;
            parts[zero].1 += 1;
        }
    }
    let shares = parts
        .iter()
        .map(|&(i, count, _)| Share {
            actor: eligible[i].0.id.clone(),
            count,
            commit: eligible[i].1,
        })
        .collect();
    Ok(Plan { shares, decayed })
}

/// The batch's expected tokens per prompt: the mean of the eligible actors' measurements.
fn tokens_per_job(eligible: &[(&ActorState, bool)]) -> Option<f64> {
    let measured: Vec<f64> = eligible
        .iter()
        .filter_map(|(a, _)| a.tokens_per_job)
        .filter(|m| m.is_finite() && *m > 0.0)
        .collect();
    (!measured.is_empty()).then(|| measured.iter().sum::<f64>() / measured.len() as f64)
}

/// The exact (unrounded) shares of `b` prompts of `m` tokens each that let every actor finish
/// at the same time T, actor a starting `latency[a]` seconds late and then delivering
/// `rate[a]` tokens per second: share_a = rate_a·(T − latency_a)/m, summing to b. An actor
/// whose latency alone exceeds T gets nothing (it would finish after the others even with
/// no work), and T is solved again without it. With every latency 0 this is b·rate_a/Σ rate,
/// Algorithm 1's split.
///
/// Why: τ measured over whole deliveries folds an actor's round trip into its rate, and the
/// smaller its share the more the round trip weighs, so a far actor with a short batch was
/// measured slower than it is, got less, and was measured slower again (the demo's far
/// actor, at half-second steps and a 150 ms round trip, fell to 6% of the samples at 33% of
/// the speed). Measuring the rate and the latency apart ([`learn`]) and splitting for the
/// makespan breaks that loop. Rates ≤ 0 get nothing; at least one rate must be positive.
pub fn finish_together(b: f64, m: f64, rate: &[f64], latency: &[f64]) -> Vec<f64> {
    let mut active: Vec<usize> = (0..rate.len()).filter(|&i| rate[i] > 0.0).collect();
    let mut t = 0.0;
    loop {
        let rates: f64 = active.iter().map(|&i| rate[i]).sum();
        if active.is_empty() || rates <= 0.0 {
            break;
        }
        let head: f64 = active.iter().map(|&i| rate[i] * latency[i]).sum();
        t = (b * m + head) / rates;
        let before = active.len();
        active.retain(|&i| latency[i] < t);
        if active.len() == before {
            break;
        }
    }
    (0..rate.len())
        .map(|i| {
            if active.contains(&i) {
                (rate[i] * (t - latency[i]) / m).max(0.0)
            } else {
                0.0
            }
        })
        .collect()
}

/// What the hub has measured of one actor's deliveries, on its own clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// τ, tokens per second while it works.
    pub tau: f64,
    /// Whether τ has been measured at all (else it is the configured initial guess).
    pub measured: bool,
    /// The time a delivery after idleness costs beyond its work: the round trip of the claim
    /// and of the result, in seconds (none: unmeasured).
    pub latency_s: Option<f64>,
    /// Accepted tokens per job (none: unmeasured).
    pub tokens_per_job: Option<f64>,
}

/// One accepted submit, as the hub saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Accepted tokens.
    pub tokens: u64,
    /// Accepted jobs.
    pub jobs: u64,
    /// Wall time on the hub's clock since the actor's delivery interval began
    /// ([`interval_after_claim`]); under one millisecond counts as one.
    pub elapsed_ms: u64,
    /// Whether the interval began at a claim that ended the actor's idleness (its first
    /// delivery since): the elapsed time then includes the claim's reply travelling out and
    /// the result travelling back, which a busy actor overlaps with its previous work.
    pub fresh: bool,
    /// The hub's own estimate of the round-trip time to the actor (its transport's, from
    /// acknowledgement timing; none where the caller has no connection to ask).
    pub round_trip: Option<Duration>,
}

/// Updates an actor's estimate from one accepted submit (every EMA with weight `beta` on the
/// old value; a first measurement replaces outright).
///
/// τ ← EMA(tokens / work), where the work is the elapsed time — except for the first
/// delivery after idleness, whose elapsed time holds one round trip to the hub besides the
/// work (the claim's reply out, the result back): that round trip, as the hub's transport
/// measures it, is taken off (at most three quarters of the elapsed time, so a stale estimate
/// cannot make a delivery look instantaneous) and becomes the actor's latency λ ← EMA(round
/// trip). A busy actor pays no such trip per delivery (it claims while it generates), so its
/// deliveries count whole, as do round trips between jobs of an actor that does not pipeline.
///
/// Without the round trip subtracted, a far actor with a short share was measured at
/// tokens/(round trip + work): the smaller its share the slower it looked, so it got less
/// and looked slower again (the demo's far actor fell to 6% of the samples at 33% of the
/// speed). With λ apart, [`plan`] splits for the makespan ([`finish_together`]). Times an
/// actor reports are never used: its share must not be its own to set, and the round trip
/// is the hub's measurement (an actor that delays its acknowledgements only lengthens it,
/// which shrinks its own share).
pub fn learn(e: &Estimate, d: &Delivery, beta: f64) -> Estimate {
    let ema = |old: Option<f64>, new: f64| match old {
        Some(o) if o.is_finite() => beta * o + (1.0 - beta) * new,
        _ => new,
    };
    let mut next = *e;
    if d.jobs > 0 {
        next.tokens_per_job = Some(ema(e.tokens_per_job, d.tokens as f64 / d.jobs as f64));
    }
    let mut work_ms = d.elapsed_ms;
    if d.fresh
        && let Some(rtt) = d.round_trip
    {
        next.latency_s = Some(ema(e.latency_s, rtt.as_secs_f64()));
        let rtt_ms = u64::try_from(rtt.as_millis()).unwrap_or(u64::MAX);
        work_ms = d.elapsed_ms.saturating_sub(rtt_ms).max(d.elapsed_ms / 4);
    }
    next.tau = settle(e.tau, e.measured, beta, d.tokens, work_ms);
    next.measured = true;
    next
}

/// The settle rule (Algorithm 1, line 16): τ ← β·τ + (1−β)·tokens/elapsed, where `tokens`
/// are the tokens of one accepted submit and `elapsed` the wall time on the hub's clock it
/// took the actor to deliver them (see `docs/ledger.md`). The first measurement of an actor
/// (`measured` false) replaces the configured initial guess outright. An elapsed time under
/// one millisecond counts as one millisecond.
pub fn settle(tau: f64, measured: bool, beta: f64, tokens: u64, elapsed_ms: u64) -> f64 {
    let sample = tokens as f64 / (elapsed_ms.max(1) as f64 / 1000.0);
    if !(measured && tau.is_finite() && tau >= 0.0) {
        return sample;
    }
    beta * tau + (1.0 - beta) * sample
}

/// An actor's open delivery interval: when it began, and whether it began at a claim that
/// ended the actor's idleness and has not been settled since (its first delivery is then a
/// latency sample, [`Delivery::fresh`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    /// The start, on the ledger's clock.
    pub since: Timestamp,
    /// Opened by a claim after idleness, nothing settled in it yet.
    pub fresh: bool,
}

/// Where an actor's delivery interval stands after a claim (its throughput is measured on the
/// hub's clock as accepted tokens per second of this interval, see [`learn`]).
///
/// `busy` is the open interval (none: idle), `held_before` the leases it held before the
/// claim, `claimed` what the claim leased. An actor that holds work stays in its interval. An
/// idle actor that got nothing is idle (its wait for work is not its slowness). An idle actor
/// that got work continues the interval its last accepted submit opened if that was at most
/// `max_gap` ago — the verdict's trip back, its turnaround and the claim's trip in are its own
/// round trip, which it pays between every two jobs unless it pipelines — and otherwise
/// starts a fresh one now.
pub fn interval_after_claim(
    busy: Option<Interval>,
    held_before: u64,
    claimed: usize,
    now: Timestamp,
    max_gap: Duration,
) -> Option<Interval> {
    let fresh = Interval {
        since: now,
        fresh: true,
    };
    if held_before > 0 {
        return Some(busy.unwrap_or(fresh));
    }
    if claimed == 0 {
        return None;
    }
    match busy {
        Some(open) if now.since(open.since) <= max_gap => Some(open),
        _ => Some(fresh),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(n: u64) -> Version {
        Version::new(n).expect("small version")
    }

    fn actor(name: &str, active: Option<u64>, staged: Option<u64>, tau: f64) -> ActorState {
        ActorState {
            id: ActorId::new(name).expect("valid id"),
            active: active.map(v),
            staged: staged.map(v),
            tau,
            latency_s: 0.0,
            tokens_per_job: None,
            alive: true,
            stalled: false,
        }
    }

    fn counts(p: &Plan) -> Vec<(String, u32, bool)> {
        p.shares
            .iter()
            .map(|s| (s.actor.to_string(), s.count, s.commit))
            .collect()
    }

    #[test]
    fn paper_example_h100_a100() {
        let actors = [
            actor("h100", Some(7), None, 5000.0),
            actor("a100", Some(7), None, 2500.0),
        ];
        let p = plan(v(7), 300, &actors, 0.5, Split::Proportional).expect("eligible");
        assert_eq!(
            counts(&p),
            vec![("h100".into(), 200, false), ("a100".into(), 100, false)]
        );
        assert!(p.decayed.is_empty());
    }

    #[test]
    fn eligibility_follows_algorithm_1() {
        let t = v(10);
        assert_eq!(
            eligibility(t, &actor("a", Some(10), None, 1.0)),
            Eligibility::OnVersion
        );
        assert_eq!(
            eligibility(t, &actor("a", Some(9), Some(10), 1.0)),
            Eligibility::NeedsCommit
        );
        assert_eq!(
            eligibility(t, &actor("a", Some(9), None, 1.0)),
            Eligibility::Arriving,
            "one version behind with D(v) on its way: work is held for it"
        );
        assert_eq!(
            eligibility(t, &actor("a", Some(8), Some(9), 1.0)),
            Eligibility::Ineligible
        );
        assert_eq!(
            eligibility(t, &actor("a", Some(11), None, 1.0)),
            Eligibility::OnVersion,
            "an actor ahead of the batch generates from a newer version, which is accepted"
        );
        assert_eq!(
            eligibility(t, &actor("a", None, Some(10), 1.0)),
            Eligibility::Ineligible
        );
        let mut dead = actor("a", Some(10), None, 1.0);
        dead.alive = false;
        assert_eq!(eligibility(t, &dead), Eligibility::Ineligible);
        let mut stalled = actor("a", Some(10), None, 1.0);
        stalled.stalled = true;
        assert_eq!(eligibility(t, &stalled), Eligibility::Ineligible);
        assert_eq!(
            eligibility(v(0), &actor("a", Some(0), None, 1.0)),
            Eligibility::OnVersion
        );
    }

    #[test]
    fn remainders_are_spread_so_nothing_is_dropped() {
        let actors = [
            actor("a", Some(3), None, 1.0),
            actor("b", Some(3), None, 1.0),
            actor("c", Some(2), Some(3), 1.0),
        ];
        let p = plan(v(3), 10, &actors, 0.5, Split::Proportional).expect("eligible");
        // 10/3 each = 3.33: floors give 9, one prompt left, ties broken by id.
        assert_eq!(
            counts(&p),
            vec![
                ("a".into(), 4, false),
                ("b".into(), 3, false),
                ("c".into(), 3, true)
            ]
        );
        for b in [0u32, 1, 2, 7, 511, 512, 100_000] {
            let weird = [
                actor("a", Some(3), None, 1e-300),
                actor("b", Some(3), None, 3.7),
                actor("c", Some(3), None, 1e300),
                actor("d", Some(3), None, f64::NAN),
            ];
            let p = plan(v(3), b, &weird, 0.5, Split::Proportional).expect("eligible");
            assert_eq!(p.shares.iter().map(|s| s.count).sum::<u32>(), b, "B = {b}");
        }
    }

    #[test]
    fn every_eligible_actor_gets_a_prompt_so_a_low_tau_can_recover() {
        let actors = [
            actor("fast", Some(3), None, 26_000.0),
            actor("mid", Some(3), None, 9_700.0),
            actor("decayed", Some(3), None, 500.0),
        ];
        // 32 × 500 / 36 200 = 0.44: plain largest-remainder rounding gives it nothing.
        let p = plan(v(3), 32, &actors, 0.5, Split::Proportional).expect("eligible");
        assert_eq!(
            p.shares.iter().map(|s| s.count).collect::<Vec<_>>(),
            [22, 9, 1]
        );
        // Fewer prompts than actors: no floor, and nothing is dropped.
        let p = plan(v(3), 2, &actors, 0.5, Split::Proportional).expect("eligible");
        assert_eq!(
            p.shares.iter().map(|s| s.count).collect::<Vec<_>>(),
            [1, 1, 0]
        );
    }

    #[test]
    fn ineligible_actors_get_nothing_and_decay() {
        let actors = [
            actor("fast", Some(5), None, 300.0),
            actor("behind", Some(3), None, 400.0),
        ];
        let p = plan(v(5), 64, &actors, 0.25, Split::Proportional).expect("eligible");
        assert_eq!(counts(&p), vec![("fast".into(), 64, false)]);
        assert_eq!(p.decayed.len(), 1);
        assert_eq!(p.decayed[0].0.as_str(), "behind");
        assert!((p.decayed[0].1 - 100.0).abs() < 1e-9);
        assert_eq!(
            plan(v(9), 64, &actors, 0.5, Split::Proportional),
            Err(NoEligibleActors(v(9)))
        );
    }

    #[test]
    fn zero_weights_split_evenly_and_commit_without_work_is_kept() {
        let actors = [
            actor("a", Some(1), None, 0.0),
            actor("b", Some(0), Some(1), 0.0),
        ];
        let p = plan(v(1), 5, &actors, 0.5, Split::Proportional).expect("eligible");
        assert_eq!(p.shares.iter().map(|s| s.count).sum::<u32>(), 5);
        let p = plan(v(1), 0, &actors, 0.5, Split::Proportional).expect("eligible");
        assert_eq!(
            counts(&p),
            vec![("a".into(), 0, false), ("b".into(), 0, true)]
        );
    }

    #[test]
    fn settle_is_an_ema_of_tokens_per_second() {
        let tau = settle(100.0, true, 0.75, 600, 2_000);
        assert!((tau - (0.75 * 100.0 + 0.25 * 300.0)).abs() < 1e-9);
        assert!((settle(100.0, false, 0.75, 600, 2_000) - 300.0).abs() < 1e-9);
        assert!((settle(f64::NAN, true, 0.5, 10, 1_000) - 10.0).abs() < 1e-9);
        assert!(settle(1.0, true, 0.5, 10, 0).is_finite());
    }

    #[test]
    fn an_actor_whose_version_is_still_arriving_keeps_its_proportional_share() {
        // The demo's shape: the near region has staged v when the batch is split, the far
        // actor is still receiving D(v). It keeps its τ and its share (and is told COMMIT).
        let actors = [
            actor("eu-a1", Some(6), Some(7), 300.0),
            actor("eu-a2", Some(6), Some(7), 100.0),
            actor("ap-a1", Some(6), None, 200.0),
        ];
        let p = plan(v(7), 60, &actors, 0.5, Split::Proportional).expect("eligible");
        assert_eq!(
            counts(&p),
            vec![
                ("eu-a1".into(), 30, true),
                ("eu-a2".into(), 10, true),
                ("ap-a1".into(), 20, true)
            ]
        );
        assert!(p.decayed.is_empty(), "nobody is excluded: {p:?}");
    }

    #[test]
    fn the_delivery_interval_counts_round_trips_but_not_idleness() {
        let t = |ms: i64| Timestamp::from_millis(ms);
        let open = |ms: i64, fresh: bool| Interval {
            since: t(ms),
            fresh,
        };
        let gap = Duration::from_secs(2);
        // Submitted at 1.0 s, claimed again at 1.3 s (a 300 ms round trip) and got work: the
        // round trip counts, and the interval is a busy one (its delivery measures the rate).
        assert_eq!(
            interval_after_claim(Some(open(1_000, false)), 0, 4, t(1_300), gap),
            Some(open(1_000, false))
        );
        // Came back after 10 s: it was idle; measure from the claim, as a fresh interval.
        assert_eq!(
            interval_after_claim(Some(open(1_000, false)), 0, 4, t(11_000), gap),
            Some(open(11_000, true))
        );
        // Nothing to do: idle.
        assert_eq!(
            interval_after_claim(Some(open(1_000, false)), 0, 0, t(1_300), gap),
            None
        );
        // Pipelining (it still holds work): the interval goes on whatever this claim got, and
        // stays fresh until its first delivery settles.
        assert_eq!(
            interval_after_claim(Some(open(1_000, true)), 4, 0, t(9_000), gap),
            Some(open(1_000, true))
        );
        assert_eq!(
            interval_after_claim(None, 0, 4, t(5_000), gap),
            Some(open(5_000, true))
        );
    }

    fn delivery(tokens: u64, elapsed_ms: u64, fresh: bool, rtt_ms: Option<u64>) -> Delivery {
        Delivery {
            tokens,
            jobs: 2,
            elapsed_ms,
            fresh,
            round_trip: rtt_ms.map(Duration::from_millis),
        }
    }

    #[test]
    fn the_round_trip_of_a_delivery_after_idleness_is_latency_not_slowness() {
        // A far actor: 1,000 tokens/s, 150 ms from the hub. 100 tokens after idleness take
        // 250 ms on the hub's clock: 100 ms of work at its rate, and a 150 ms latency.
        let e = Estimate {
            tau: 50.0,
            measured: false,
            latency_s: None,
            tokens_per_job: None,
        };
        let e = learn(&e, &delivery(100, 250, true, Some(150)), 0.5);
        assert!((e.tau - 1_000.0).abs() < 1e-9, "{e:?}");
        assert_eq!(e.latency_s, Some(0.15));
        assert_eq!(e.tokens_per_job, Some(50.0));
        // Busy (it claimed while generating): the whole interval is work.
        let e = learn(&e, &delivery(1_000, 500, false, Some(150)), 0.5);
        assert!((e.tau - 1_500.0).abs() < 1e-9);
        assert_eq!(e.latency_s, Some(0.15), "only fresh deliveries measure it");
        // The round trip moves by the EMA.
        let e = learn(&e, &delivery(150, 150, true, Some(50)), 0.5);
        assert!((e.latency_s.expect("measured") - 0.1).abs() < 1e-9);
        assert!(
            (e.tau - 1_500.0).abs() < 1e-9,
            "150 tokens in 100 ms of work"
        );
        // A round trip as long as the delivery leaves a quarter of it as work.
        let e = learn(&e, &delivery(100, 400, true, Some(900)), 0.0);
        assert!((e.tau - 1_000.0).abs() < 1e-9, "{e:?}");
    }

    #[test]
    fn without_a_round_trip_a_delivery_is_measured_as_algorithm_1_measures_it() {
        let e = Estimate {
            tau: 50.0,
            measured: true,
            latency_s: None,
            tokens_per_job: None,
        };
        let e = learn(&e, &delivery(100, 250, true, None), 0.5);
        assert!((e.tau - (0.5 * 50.0 + 0.5 * 400.0)).abs() < 1e-9);
        assert_eq!(e.latency_s, None);
    }

    #[test]
    fn latencies_split_the_batch_so_that_everyone_finishes_together() {
        // No latency: Algorithm 1's proportional split.
        let x = finish_together(60.0, 10.0, &[300.0, 100.0, 200.0], &[0.0; 3]);
        for (got, want) in x.iter().zip([30.0, 10.0, 20.0]) {
            assert!((got - want).abs() < 1e-9, "{x:?}");
        }
        // The far actor starts 0.5 s late: T = (600 + 100)/600 s; each finishes at T.
        let rate = [300.0, 100.0, 200.0];
        let lat = [0.0, 0.0, 0.5];
        let x = finish_together(60.0, 10.0, &rate, &lat);
        assert!((x.iter().sum::<f64>() - 60.0).abs() < 1e-9);
        let t = 700.0 / 600.0;
        for i in 0..3 {
            let finish = lat[i] + x[i] * 10.0 / rate[i];
            assert!((finish - t).abs() < 1e-9, "actor {i}: {x:?}");
        }
        // A latency longer than the batch takes the others: nothing for that actor.
        let x = finish_together(6.0, 10.0, &[300.0, 100.0, 200.0], &[0.0, 0.0, 5.0]);
        assert_eq!(x[2], 0.0);
        assert!(
            (x[0] - 4.5).abs() < 1e-9 && (x[1] - 1.5).abs() < 1e-9,
            "{x:?}"
        );
        // Rates of zero get nothing.
        let x = finish_together(6.0, 10.0, &[0.0, 100.0], &[0.0, 0.1]);
        assert_eq!(x[0], 0.0);
        assert!((x[1] - 6.0).abs() < 1e-9);
    }

    #[test]
    fn plan_gives_a_far_actor_its_makespan_share_not_its_round_trip_starved_one() {
        // The demo's far actor at half-second steps: measured apart, its rate ranks it above
        // the speed-1 actor, and its share is what lets it finish with the others.
        let mut actors = [
            actor("ap-a1", Some(6), Some(7), 2_000.0),
            actor("eu-a1", Some(6), Some(7), 3_000.0),
            actor("eu-a2", Some(6), Some(7), 1_000.0),
        ];
        for a in &mut actors {
            a.tokens_per_job = Some(40.0);
        }
        actors[0].latency_s = 0.15;
        actors[1].latency_s = 0.04;
        actors[2].latency_s = 0.04;
        let p = plan(v(7), 32, &actors, 0.5, Split::Proportional).expect("eligible");
        let c: Vec<u32> = p.shares.iter().map(|s| s.count).collect();
        assert_eq!(c.iter().sum::<u32>(), 32);
        // T = (32·40 + 2000·0.15 + 3000·0.04 + 1000·0.04)/6000 = 0.29 s.
        assert_eq!(c, vec![7, 19, 6], "{p:?}");
        assert!(c[0] > c[2], "the far actor outranks the speed-1 one");
        // Without tokens per job the latencies cannot be priced: Algorithm 1's split.
        for a in &mut actors {
            a.tokens_per_job = None;
        }
        let p = plan(v(7), 32, &actors, 0.5, Split::Proportional).expect("eligible");
        let c: Vec<u32> = p.shares.iter().map(|s| s.count).collect();
        assert_eq!(c, vec![11, 16, 5]);
    }

    #[test]
    fn a_uniform_split_ignores_tau() {
        let actors = [
            actor("a", Some(3), None, 100.0),
            actor("b", Some(3), None, 200.0),
            actor("c", Some(3), None, 300.0),
        ];
        let counts = |split| -> Vec<u32> {
            plan(v(3), 60, &actors, 0.5, split)
                .expect("eligible")
                .shares
                .iter()
                .map(|s| s.count)
                .collect()
        };
        assert_eq!(counts(Split::Proportional), [10, 20, 30]);
        assert_eq!(counts(Split::Uniform), [20, 20, 20]);
    }
}
