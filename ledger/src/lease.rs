//! Lease sizing, as pure functions (no clock, no I/O): how long a claimed job's lease is, and
//! how far a progress report extends it.
//!
//! A lease must fit its job. Generations range from a handful of tokens to tens of thousands,
//! so one length for every job (the former `multiple × median completion`) made every long
//! generation expire on every attempt and fail. Here:
//!
//! - **At claim**, the lease covers the token budget (`n × max_new_tokens` + prompt) of every
//!   job the actor then holds — they share its engine, so the last of them finishes only when
//!   all are generated — at the actor's throughput τ as the hub measured it, times a margin:
//!   `clamp(margin × held budget / τ, floor, ceiling)`. An actor not yet measured, or a job of
//!   unknown budget, gets `initial`.
//! - **On progress** (the actor reports tokens generated so far for the jobs it holds, about
//!   every second), if any job's count moved, each reported lease is extended to
//!   `now + max(floor, margin × time since that job's previous progress)` (never shortened).
//!   Jobs queued behind a moving one are extended too: their actor is alive and working
//!   towards them. A report where nothing moved extends nothing, so a stuck generation expires
//!   a floor after it stopped moving, and a dead actor's leases expire on their own (or are
//!   released at once when its connection closes).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::config::LeaseConfig;
use crate::ids::{JobId, Timestamp};
use crate::model::ProgressReport;

/// The lease granted at claim for an actor holding jobs of `held_budget` tokens in all (the
/// ones just claimed included), whose measured throughput is `tau` tokens/s (`measured`:
/// whether the hub has measured it at all).
pub(crate) fn at_claim(held_budget: u64, tau: f64, measured: bool, c: &LeaseConfig) -> Duration {
    if !measured || held_budget == 0 || !(tau.is_finite() && tau > 0.0) {
        return c.initial;
    }
    let secs = c.margin * held_budget as f64 / tau;
    if !secs.is_finite() || secs >= c.ceiling.as_secs_f64() {
        return c.ceiling;
    }
    Duration::from_secs_f64(secs.max(0.0)).clamp(c.floor, c.ceiling)
}

/// The expiry of a lease that progressed at `now`, its previous progress (or grant) having
/// been at `previous`, its current expiry `expires`.
pub(crate) fn extended(
    now: Timestamp,
    previous: Timestamp,
    expires: Timestamp,
    c: &LeaseConfig,
) -> Timestamp {
    let since = now.since(previous);
    let by = since.mul_f64(c.margin).max(c.floor);
    let to = now.plus(by);
    if to > expires { to } else { expires }
}

/// What a progress transaction reads about one reported job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProgressRow {
    /// Leased to the reporting actor, and the lease has not run out.
    pub(crate) held: bool,
    /// Tokens at its previous progress.
    pub(crate) tokens: u64,
    /// Its previous progress (or its grant).
    pub(crate) previous: Timestamp,
    /// Its lease's expiry.
    pub(crate) expires: Timestamp,
}

/// One lease to extend: the job, its new expiry, its token count.
pub(crate) type Extension = (JobId, Timestamp, u64);

/// Decides a progress report (see the module docs): the leases to extend, and what the actor
/// is told. A job reported twice counts with its largest number.
pub(crate) fn on_progress(
    now: Timestamp,
    reports: &[(JobId, u64)],
    rows: &HashMap<i64, ProgressRow>,
    c: &LeaseConfig,
) -> (Vec<Extension>, ProgressReport) {
    let mut reported: BTreeMap<JobId, u64> = BTreeMap::new();
    for &(job, tokens) in reports {
        let t = reported.entry(job).or_default();
        *t = (*t).max(tokens);
    }
    let mut report = ProgressReport::default();
    let mut held = Vec::new();
    let mut moved = false;
    for (&job, &tokens) in &reported {
        match rows.get(&job.0) {
            Some(row) if row.held => {
                moved |= tokens > row.tokens;
                held.push((job, tokens, *row));
            }
            _ => report.lost.push(job),
        }
    }
    if !moved {
        report.unmoved = held.into_iter().map(|(job, _, _)| job).collect();
        return (Vec::new(), report);
    }
    let mut extensions = Vec::with_capacity(held.len());
    for (job, tokens, row) in held {
        let expires = extended(now, row.previous, row.expires, c);
        extensions.push((job, expires, tokens.max(row.tokens)));
        report.extended.push(job);
    }
    (extensions, report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> LeaseConfig {
        LeaseConfig {
            margin: 2.0,
            floor: Duration::from_secs(10),
            ceiling: Duration::from_secs(3_600),
            initial: Duration::from_secs(120),
        }
    }

    #[test]
    fn a_claim_covers_the_held_budget_at_the_measured_speed() {
        let c = config();
        // 4 jobs of 8 × 512 tokens at 1,000 tokens/s: 16.4 s of work, × 2.
        let held = 4 * 8 * 512;
        assert_eq!(
            at_claim(held, 1_000.0, true, &c),
            Duration::from_secs_f64(2.0 * 16.384)
        );
        // 32× the budget: 32× the lease, so a long generation is not cut at a short one's.
        assert_eq!(
            at_claim(32 * held, 1_000.0, true, &c),
            Duration::from_secs_f64(2.0 * 32.0 * 16.384)
        );
        assert_eq!(at_claim(10, 1_000.0, true, &c), c.floor, "floor");
        assert_eq!(at_claim(u64::MAX, 1e-9, true, &c), c.ceiling, "ceiling");
        assert_eq!(at_claim(held, 1_000.0, false, &c), c.initial, "unmeasured");
        assert_eq!(at_claim(0, 1_000.0, true, &c), c.initial, "unknown budget");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(at_claim(held, bad, true, &c), c.initial, "tau {bad}");
        }
    }

    #[test]
    fn progress_extends_by_the_margin_over_its_interval_never_below_the_floor() {
        let c = config();
        let t = |s: i64| Timestamp::from_millis(s * 1_000);
        // Reports a second apart: the floor.
        assert_eq!(extended(t(100), t(99), t(105), &c), t(110));
        // A report 30 s after the previous one: 60 s more.
        assert_eq!(extended(t(100), t(70), t(105), &c), t(160));
        // Never shortened.
        assert_eq!(extended(t(100), t(99), t(500), &c), t(500));
    }

    #[test]
    fn a_report_extends_only_when_something_moved() {
        let c = config();
        let t = |s: i64| Timestamp::from_millis(s * 1_000);
        let row = |tokens, previous, expires| ProgressRow {
            held: true,
            tokens,
            previous: t(previous),
            expires: t(expires),
        };
        let rows: HashMap<i64, ProgressRow> = [
            (1, row(100, 99, 105)), // generating
            (2, row(0, 80, 105)),   // queued behind job 1 since its claim at 80 s
            (
                3,
                ProgressRow {
                    held: false,
                    ..row(0, 80, 90)
                },
            ),
        ]
        .into_iter()
        .collect();
        let j = JobId;
        // Job 1 moved: it and the queued job 2 are extended; job 3 is not held.
        let (ext, report) = on_progress(
            t(100),
            &[(j(1), 150), (j(2), 0), (j(3), 5), (j(4), 1)],
            &rows,
            &c,
        );
        assert_eq!(ext, vec![(j(1), t(110), 150), (j(2), t(140), 0)]);
        assert_eq!(report.extended, vec![j(1), j(2)]);
        assert_eq!(report.lost, vec![j(3), j(4)]);
        // Nothing moved (a stuck engine): nothing is extended.
        let (ext, report) = on_progress(t(100), &[(j(1), 100), (j(2), 0)], &rows, &c);
        assert!(ext.is_empty());
        assert_eq!(report.unmoved, vec![j(1), j(2)]);
        // A count going backwards is not progress; a duplicate counts with its largest.
        let (ext, _) = on_progress(t(100), &[(j(1), 50)], &rows, &c);
        assert!(ext.is_empty());
        let (ext, _) = on_progress(t(100), &[(j(1), 50), (j(1), 101)], &rows, &c);
        assert_eq!(ext, vec![(j(1), t(110), 101)]);
    }
}
