//! Invariants over all rows of the ledger, each a query that counts offending rows (so zero
//! means it holds). The SQL is dialect-neutral and runs on both backends. Tests run these after
//! every stress, race and crash scenario; operators can run them on a live ledger.

use thiserror::Error;

/// One invariant that does not hold, and how many rows break it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvariantViolation {
    /// The rule, in words.
    pub rule: &'static str,
    /// Rows that break it.
    pub rows: i64,
}

/// Checking invariants failed or found violations.
#[derive(Debug, Error)]
pub enum InvariantError {
    /// Some invariants do not hold.
    #[error("ledger invariants violated: {0:?}")]
    Violated(Vec<InvariantViolation>),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// The rules. Queries take `$1` = max attempts.
pub(crate) const RULES: &[(&str, &str)] = &[
    (
        "every job is in exactly one known state",
        "SELECT COUNT(*) FROM jobs WHERE state NOT IN ('posted','pending','leased','done','failed') OR state IS NULL OR $1 < 0",
    ),
    (
        "a job is leased iff it has a lease (holder, grant time, expiry)",
        "SELECT COUNT(*) FROM jobs WHERE (state = 'leased' AND (lease_holder IS NULL OR lease_expires IS NULL OR leased_at IS NULL)) OR (state <> 'leased' AND (lease_holder IS NOT NULL OR lease_expires IS NOT NULL OR leased_at IS NOT NULL))",
    ),
    (
        "only pending jobs are assigned",
        "SELECT COUNT(*) FROM jobs WHERE assignee IS NOT NULL AND state <> 'pending'",
    ),
    (
        "a done job has exactly one accepted result",
        "SELECT COUNT(*) FROM jobs j WHERE j.state = 'done' AND (SELECT COUNT(*) FROM results r WHERE r.job_id = j.id) <> 1",
    ),
    (
        "only done jobs have results",
        "SELECT COUNT(*) FROM results r JOIN jobs j ON j.id = r.job_id WHERE j.state <> 'done'",
    ),
    (
        "no job has two accepted results",
        "SELECT COUNT(*) FROM (SELECT job_id FROM results GROUP BY job_id HAVING COUNT(*) > 1) dup",
    ),
    (
        "accepted results come from their job's version or a newer one",
        "SELECT COUNT(*) FROM results r JOIN jobs j ON j.id = r.job_id WHERE r.version < j.version",
    ),
    (
        "accepted results carry their version's digest",
        "SELECT COUNT(*) FROM results r JOIN versions v ON v.version = r.version WHERE r.digest <> v.digest",
    ),
    (
        "leased, done and failed jobs were leased at least once",
        "SELECT COUNT(*) FROM jobs j JOIN batches b ON b.id = j.batch_id WHERE j.state IN ('leased','done','failed') AND j.attempts < 1 AND b.cancelled_at IS NULL",
    ),
    (
        "no job was leased more than max_attempts times",
        "SELECT COUNT(*) FROM jobs WHERE attempts > $1",
    ),
    (
        "failed jobs used all their attempts (or failed for a named reason, or their batch was cancelled)",
        "SELECT COUNT(*) FROM jobs j JOIN batches b ON b.id = j.batch_id WHERE j.state = 'failed' AND j.attempts < $1 AND b.cancelled_at IS NULL AND j.fail_reason IS NULL",
    ),
    (
        "posted jobs belong to unscheduled batches and scheduled batches have no posted jobs",
        "SELECT COUNT(*) FROM jobs j JOIN batches b ON b.id = j.batch_id WHERE (j.state = 'posted') <> (b.scheduled_at IS NULL) AND b.cancelled_at IS NULL",
    ),
    (
        "jobs carry their batch's version",
        "SELECT COUNT(*) FROM jobs j JOIN batches b ON b.id = j.batch_id WHERE j.version <> b.version",
    ),
    (
        "each batch has as many jobs as its size (until it is archived)",
        "SELECT COUNT(*) FROM batches b WHERE b.archived_at IS NULL AND b.size <> (SELECT COUNT(*) FROM jobs j WHERE j.batch_id = b.id)",
    ),
    (
        "a scheduled batch's assignments sum to its size",
        "SELECT COUNT(*) FROM batches b WHERE b.scheduled_at IS NOT NULL AND b.archived_at IS NULL AND b.size <> (SELECT COALESCE(SUM(a.count), 0) FROM assignments a WHERE a.batch_id = b.id)",
    ),
    (
        "throughput estimates are finite and non-negative",
        "SELECT COUNT(*) FROM actors WHERE NOT (tau >= 0 AND tau < 1e300)",
    ),
    (
        "batches are posted only for committed versions",
        "SELECT COUNT(*) FROM batches b JOIN versions v ON v.version = b.version WHERE v.state <> 'committed'",
    ),
    (
        "cancelled batches have no open jobs",
        "SELECT COUNT(*) FROM jobs j JOIN batches b ON b.id = j.batch_id WHERE b.cancelled_at IS NOT NULL AND j.state NOT IN ('done','failed')",
    ),
    (
        "accepted results are filed under their job's batch",
        "SELECT COUNT(*) FROM results r JOIN jobs j ON j.id = r.job_id WHERE r.batch_id IS NOT NULL AND r.batch_id <> j.batch_id",
    ),
    (
        "no cursor is beyond the cursor counter (a cursor is never handed out twice)",
        "SELECT COUNT(*) FROM results WHERE cursor > (SELECT value FROM ledger_counters WHERE name = 'result_cursor') OR $1 < 0",
    ),
    (
        "the jobs counter equals the job rows",
        "SELECT COUNT(*) FROM ledger_counters WHERE name = 'jobs' AND value <> (SELECT COUNT(*) FROM jobs) OR $1 < 0",
    ),
    (
        "an archived batch holds no jobs, results or assignments",
        "SELECT (SELECT COUNT(*) FROM jobs j JOIN batches b ON b.id = j.batch_id WHERE b.archived_at IS NOT NULL) + (SELECT COUNT(*) FROM results r JOIN batches b ON b.id = r.batch_id WHERE b.archived_at IS NOT NULL) + (SELECT COUNT(*) FROM assignments a JOIN batches b ON b.id = a.batch_id WHERE b.archived_at IS NOT NULL) + $1 * 0",
    ),
    (
        "only delivered batches are archived, with their file",
        "SELECT COUNT(*) FROM batches WHERE archived_at IS NOT NULL AND (delivered_at IS NULL OR archive IS NULL) OR $1 < 0",
    ),
];
