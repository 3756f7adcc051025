//! How many jobs the worker claims at a time: enough that the jobs it holds outlast a claim's
//! round trip to the hub. Pure arithmetic over what the worker measures (its connection's
//! round-trip time and how long its generation calls take per job), so it is tested alone.
//!
//! Why: the worker claims its next jobs while the current ones generate, holding at most two
//! claims' worth. When a claim's worth generates faster than the round trip (the demo's far
//! actor: 4 short groups in ~80 ms, 150 ms from the hub), the engine still waits for every
//! reply, and the hub measures the actor at the rate of its round trips, not of its engine.
//! Claiming `rate × round trip` jobs at a time keeps the engine busy across the trip — the
//! bandwidth-delay product of the claim loop. The hub bounds what it hands out by the actor's
//! share, so a larger claim never takes more than the share.

use std::time::Duration;

/// The weight of the previous value in the per-job time's moving average.
const KEEP: f64 = 0.7;

/// At most this many times the configured claim per call, however long the round trip.
const MAX_FACTOR: u32 = 16;

/// The claim size, learned from generation calls.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ClaimDepth {
    /// The configured jobs per call (`--claim`): the floor.
    base: u32,
    /// Seconds per job of the recent generation calls (a moving average); none before the
    /// first call.
    per_job_s: Option<f64>,
}

impl ClaimDepth {
    pub(crate) fn new(base: u32) -> Self {
        Self {
            base: base.max(1),
            per_job_s: None,
        }
    }

    /// A generation call of `jobs` jobs took `took` on the engine.
    pub(crate) fn observe(&mut self, jobs: usize, took: Duration) {
        if jobs == 0 {
            return;
        }
        let sample = took.as_secs_f64() / jobs as f64;
        if !sample.is_finite() {
            return;
        }
        self.per_job_s = Some(match self.per_job_s {
            Some(old) => KEEP * old + (1.0 - KEEP) * sample,
            None => sample,
        });
    }

    /// Jobs to claim per call for a round trip of `rtt`: the configured claim, or the jobs the
    /// engine gets through in one round trip (rounded up) if that is more, at most
    /// [`MAX_FACTOR`] × the configured claim.
    pub(crate) fn size(&self, rtt: Duration) -> u32 {
        let Some(per_job) = self.per_job_s.filter(|p| *p > 0.0) else {
            return self.base;
        };
        let cap = self.base.saturating_mul(MAX_FACTOR);
        let cover = (rtt.as_secs_f64() / per_job).ceil();
        if cover >= f64::from(cap) {
            cap
        } else {
            (cover as u32).clamp(self.base, cap)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_claim_until_a_call_is_measured() {
        let d = ClaimDepth::new(4);
        assert_eq!(d.size(Duration::from_millis(150)), 4);
        assert_eq!(ClaimDepth::new(0).size(Duration::ZERO), 1);
    }

    #[test]
    fn a_far_actor_claims_what_it_generates_in_a_round_trip() {
        // 4 jobs in 80 ms: 20 ms a job; a 150 ms round trip covers 7.5 jobs: 8.
        let mut d = ClaimDepth::new(4);
        d.observe(4, Duration::from_millis(80));
        assert_eq!(d.size(Duration::from_millis(150)), 8);
        // Near the hub, the configured claim already covers the trip.
        assert_eq!(d.size(Duration::from_millis(20)), 4);
        // Long generations (seconds a job, the real run) never raise it.
        let mut slow = ClaimDepth::new(1);
        slow.observe(2, Duration::from_secs(20));
        assert_eq!(slow.size(Duration::from_millis(150)), 1);
    }

    #[test]
    fn the_size_is_capped_and_follows_the_engine() {
        let mut d = ClaimDepth::new(2);
        d.observe(10, Duration::from_micros(10));
        assert_eq!(
            d.size(Duration::from_secs(5)),
            32,
            "16 x the configured claim"
        );
        // A slower engine lowers it again, by the moving average.
        let mut e = ClaimDepth::new(2);
        e.observe(1, Duration::from_millis(10));
        e.observe(1, Duration::from_millis(110));
        // 0.7 × 10 + 0.3 × 110 = 40 ms a job: 100 ms covers 2.5 -> 3.
        assert_eq!(e.size(Duration::from_millis(100)), 3);
        e.observe(0, Duration::from_secs(100));
        assert_eq!(
            e.size(Duration::from_millis(100)),
            3,
            "an empty call says nothing"
        );
    }
}
