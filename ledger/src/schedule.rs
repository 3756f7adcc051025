//! The scheduling decision of SparrowRL Algorithm 1 (§5.3), as pure functions: who is eligible
//! for a batch of version v, how many prompts each eligible actor gets, who must be sent
//! COMMIT(v), and how τ moves (decay on exclusion, EMA on settle).
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

use crate::ids::{ActorId, Version};

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
    /// Whether its last heartbeat is recent enough to count it in.
    pub alive: bool,
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
    /// Anything else (behind by more, D(v) not staged, silent): no work, τ decays.
    Ineligible,
}

/// The eligibility rule of Algorithm 1 (lines 3 and 8), with the staging condition of §5.3.
pub fn eligibility(target: Version, actor: &ActorState) -> Eligibility {
    if !actor.alive {
        return Eligibility::Ineligible;
    }
    if actor.active.is_some_and(|a| a >= target) {
        return Eligibility::OnVersion;
    }
    if actor.active.is_some() && actor.active == target.previous() && actor.staged == Some(target) {
        return Eligibility::NeedsCommit;
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
/// If every eligible τ is zero (or not finite), the split is even.
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
            Eligibility::NeedsCommit => eligible.push((a, true)),
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
    let mut parts: Vec<(usize, u32, f64)> = eligible
        .iter()
        .enumerate()
        .map(|(i, (a, _))| {
            let exact = if even {
                b / eligible.len() as f64
            } else {
                b * weight(a) / total
            };
            // exact <= b, so the floor fits u32.
            let floor = exact.floor().min(b) as u32;
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

/// The settle rule (Algorithm 1, line 16): τ ← β·τ + (1−β)·tokens/elapsed.
/// An elapsed time under one millisecond counts as one millisecond.
pub fn settle(tau: f64, beta: f64, tokens: u32, elapsed_ms: u64) -> f64 {
    let sample = f64::from(tokens) / (elapsed_ms.max(1) as f64 / 1000.0);
    let tau = if tau.is_finite() && tau >= 0.0 {
        tau
    } else {
        sample
    };
    beta * tau + (1.0 - beta) * sample
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
            alive: true,
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
            Eligibility::Ineligible
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
        let tau = settle(100.0, 0.75, 600, 2_000);
        assert!((tau - (0.75 * 100.0 + 0.25 * 300.0)).abs() < 1e-9);
        assert!((settle(f64::NAN, 0.5, 10, 1_000) - 10.0).abs() < 1e-9);
        assert!(settle(1.0, 0.5, 10, 0).is_finite());
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
