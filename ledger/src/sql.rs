//! What the two backends share: the statements that read the same in both dialects (`$n`
//! placeholders work in SQLite too), and the decoding of rows into the crate's types. The
//! statements that differ (id lists, row locking, `max`/`GREATEST`) live in the backend.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sqlx::Row;

use crate::ids::{ActorId, BatchId, Digest, JobId, Timestamp, Version};
use crate::model::*;
use crate::schedule::{self, ActorState, Plan};
use crate::verdict::{Committed, JobRow, judge};

/// Typed column access common to `SqliteRow` and `PgRow`.
pub(crate) trait Get {
    fn i64(&self, c: &str) -> Result<i64, sqlx::Error>;
    fn opt_i64(&self, c: &str) -> Result<Option<i64>, sqlx::Error>;
    fn string(&self, c: &str) -> Result<String, sqlx::Error>;
    fn opt_string(&self, c: &str) -> Result<Option<String>, sqlx::Error>;
    fn f64(&self, c: &str) -> Result<f64, sqlx::Error>;
    fn opt_f64(&self, c: &str) -> Result<Option<f64>, sqlx::Error>;
    fn bytes(&self, c: &str) -> Result<Vec<u8>, sqlx::Error>;
}

macro_rules! impl_get {
    ($row:ty) => {
        impl Get for $row {
            fn i64(&self, c: &str) -> Result<i64, sqlx::Error> {
                self.try_get(c)
            }
            fn opt_i64(&self, c: &str) -> Result<Option<i64>, sqlx::Error> {
                self.try_get(c)
            }
            fn string(&self, c: &str) -> Result<String, sqlx::Error> {
                self.try_get(c)
            }
            fn opt_string(&self, c: &str) -> Result<Option<String>, sqlx::Error> {
                self.try_get(c)
            }
            fn f64(&self, c: &str) -> Result<f64, sqlx::Error> {
                self.try_get(c)
            }
            fn opt_f64(&self, c: &str) -> Result<Option<f64>, sqlx::Error> {
                self.try_get(c)
            }
            fn bytes(&self, c: &str) -> Result<Vec<u8>, sqlx::Error> {
                self.try_get(c)
            }
        }
    };
}
impl_get!(sqlx::sqlite::SqliteRow);
impl_get!(sqlx::postgres::PgRow);

pub(crate) const VERSION_BY_ID: &str =
    "SELECT version, base, digest, state FROM versions WHERE version = $1";
pub(crate) const VERSION_STATE: &str = "SELECT state FROM versions WHERE version = $1";
pub(crate) const INSERT_VERSION: &str = "INSERT INTO versions (version, base, digest, state, created_at) VALUES ($1, $2, $3, 'staged', $4)";
pub(crate) const COMMIT_VERSION: &str = "UPDATE versions SET state = 'committed', committed_at = $2 WHERE version = $1 AND state = 'staged'";
pub(crate) const UPSERT_ACTOR: &str = "INSERT INTO actors (id, region, hardware, tau, last_heartbeat, registered_at, session) \
     VALUES ($1, $2, $3, $4, $5, $5, 1) \
     ON CONFLICT (id) DO UPDATE SET region = excluded.region, hardware = excluded.hardware, \
     last_heartbeat = excluded.last_heartbeat, session = actors.session + 1 \
     RETURNING session";
pub(crate) const HEARTBEAT: &str =
    "UPDATE actors SET active_version = $2, staged_version = $3, last_heartbeat = $4 WHERE id = $1";
pub(crate) const INSERT_BATCH: &str = "INSERT INTO batches (version, size, sampling, created_at, max_staleness) VALUES ($1, $2, $3, $4, $5) RETURNING id";
pub(crate) const INSERT_JOB: &str = "INSERT INTO jobs (batch_id, version, prompt, state, budget) \
     VALUES ($1, $2, $3, 'posted', $4)";
pub(crate) const BATCH_BY_ID: &str =
    "SELECT id, version, size, sampling, scheduled_at FROM batches WHERE id = $1";
pub(crate) const ACTORS_FOR_SCHEDULE: &str = "SELECT id, active_version, staged_version, tau, \
     latency_s, tokens_per_job, last_heartbeat, stalled_at FROM actors ORDER BY id";
pub(crate) const SET_TAU: &str = "UPDATE actors SET tau = $2 WHERE id = $1";
pub(crate) const ASSIGN_JOBS: &str = "UPDATE jobs SET state = 'pending', assignee = $1 \
     WHERE id IN (SELECT id FROM jobs WHERE batch_id = $2 AND state = 'posted' ORDER BY id LIMIT $3)";
pub(crate) const INSERT_ASSIGNMENT: &str =
    "INSERT INTO assignments (batch_id, actor_id, count, commit_version) VALUES ($1, $2, $3, $4)";
pub(crate) const MARK_SCHEDULED: &str = "UPDATE batches SET scheduled_at = $2 WHERE id = $1";
pub(crate) const ACTOR_FOR_CLAIM: &str = "SELECT active_version, staged_version, tau, measured, \
     busy_since, interval_fresh, session FROM actors WHERE id = $1";
pub(crate) const ACTOR_TAU: &str = "SELECT tau, measured, busy_since, interval_fresh, latency_s, \
     tokens_per_job FROM actors WHERE id = $1";
pub(crate) const HELD_BUDGET: &str = "SELECT COUNT(*) AS n, CAST(COALESCE(SUM(budget), 0) AS BIGINT) AS budget \
     FROM jobs WHERE state = 'leased' AND lease_holder = $1";
pub(crate) const ACTOR_CLAIMED: &str =
    "UPDATE actors SET busy_since = $2, interval_fresh = $3, stalled_at = NULL WHERE id = $1";
pub(crate) const TOUCH_ASSIGNMENT: &str =
    "UPDATE assignments SET claimed_at = $3 WHERE batch_id = $1 AND actor_id = $2";
pub(crate) const SETTLE_ACTOR: &str = "UPDATE actors SET tau = $2, measured = measured + 1, \
     busy_since = $3, interval_fresh = 0, latency_s = $4, tokens_per_job = $5 \
     WHERE id = $1";
pub(crate) const EXTEND_LEASE: &str = "UPDATE jobs SET lease_expires = $2, progress_tokens = $3, \
     progress_at = $4 WHERE id = $1 AND state = 'leased' AND lease_holder = $5";
pub(crate) const RELEASE_SESSION: &str = "UPDATE jobs SET state = CASE WHEN attempts >= $3 THEN 'failed' ELSE 'pending' END, \
     assignee = NULL, lease_holder = NULL, leased_at = NULL, lease_expires = NULL \
     WHERE state = 'leased' AND lease_holder = $1 AND lease_session = $2 RETURNING state";
pub(crate) const RELEASE_OTHER_SESSIONS: &str = "UPDATE jobs SET state = CASE WHEN attempts >= $3 THEN 'failed' ELSE 'pending' END, \
     assignee = NULL, lease_holder = NULL, leased_at = NULL, lease_expires = NULL \
     WHERE state = 'leased' AND lease_holder = $1 AND (lease_session IS NULL OR lease_session <> $2) \
     RETURNING state";
pub(crate) const ACTOR_SESSION: &str = "SELECT session FROM actors WHERE id = $1";
pub(crate) const UNASSIGN_ACTOR: &str =
    "UPDATE jobs SET assignee = NULL WHERE state = 'pending' AND assignee = $1";
pub(crate) const ACTOR_IDLE: &str =
    "UPDATE actors SET busy_since = NULL, interval_fresh = 0 WHERE id = $1";
/// Actors holding a share (batch, actor) nobody claimed from since `$1`: counted from the
/// last claim from the share, or from the batch's scheduling. They are marked stalled at `$2`.
pub(crate) const MARK_STALLED: &str = "UPDATE actors SET stalled_at = $2 WHERE stalled_at IS NULL AND id IN \
     (SELECT j.assignee FROM jobs j \
     JOIN assignments a ON a.batch_id = j.batch_id AND a.actor_id = j.assignee \
     JOIN batches b ON b.id = j.batch_id \
     WHERE j.state = 'pending' AND j.assignee IS NOT NULL AND COALESCE(a.claimed_at, b.scheduled_at) < $1)";
/// Returns those shares' unclaimed jobs to the shared pool.
pub(crate) const RELEASE_UNCLAIMED: &str = "UPDATE jobs SET assignee = NULL WHERE id IN \
     (SELECT j.id FROM jobs j \
     JOIN assignments a ON a.batch_id = j.batch_id AND a.actor_id = j.assignee \
     JOIN batches b ON b.id = j.batch_id \
     WHERE j.state = 'pending' AND j.assignee IS NOT NULL AND COALESCE(a.claimed_at, b.scheduled_at) < $1)";
pub(crate) const RELEASE_SILENT: &str = "UPDATE jobs SET assignee = NULL WHERE state = 'pending' \
     AND assignee IN (SELECT id FROM actors WHERE last_heartbeat < $1)";
pub(crate) const ACTOR_BY_ID: &str = "SELECT id, region, hardware, active_version, staged_version, tau, \
     measured, latency_s, last_heartbeat, stalled_at FROM actors WHERE id = $1";
pub(crate) const JOB_VIEW: &str = "SELECT j.id, j.state, j.attempts, j.lease_holder, r.actor_id \
     FROM jobs j LEFT JOIN results r ON r.job_id = j.id WHERE j.id = $1";
pub(crate) const COMMITTED_FROM: &str =
    "SELECT version, digest FROM versions WHERE state = 'committed' AND version >= $1";
pub(crate) const LATEST_COMMITTED: &str =
    "SELECT MAX(version) FROM versions WHERE state = 'committed'";
pub(crate) const COUNT_REFUSALS: &str = "INSERT INTO refusals (batch_id, reason, count) VALUES ($1, $2, $3) \
     ON CONFLICT (batch_id, reason) DO UPDATE SET count = refusals.count + excluded.count";
/// Adds `$2` to counter `$1` and returns its new value. The row stays locked until the
/// transaction ends (PostgreSQL): transactions that take cursors commit in the order they
/// took them.
pub(crate) const ADD_COUNTER: &str =
    "UPDATE ledger_counters SET value = value + $2 WHERE name = $1 RETURNING value";
pub(crate) const COUNTER: &str = "SELECT value FROM ledger_counters WHERE name = $1";
/// The last cursor handed out.
pub(crate) const COUNTER_CURSOR: &str = "result_cursor";
/// The job rows the ledger holds.
pub(crate) const COUNTER_JOBS: &str = "jobs";
pub(crate) const ASSIGNMENTS_OF_BATCH: &str =
    "SELECT actor_id, count, commit_version FROM assignments WHERE batch_id = $1 ORDER BY actor_id";

fn version(v: i64) -> Result<Version, sqlx::Error> {
    Version::from_db(v)
}

fn opt_version(v: Option<i64>) -> Result<Option<Version>, sqlx::Error> {
    v.map(Version::from_db).transpose()
}

fn u32_of(v: i64, what: &str) -> Result<u32, sqlx::Error> {
    u32::try_from(v).map_err(|_| sqlx::Error::Decode(format!("{what} {v} out of range").into()))
}

pub(crate) fn actor_id(s: String) -> ActorId {
    ActorId::from_db(s)
}

pub(crate) fn actor_states<R: Get>(
    rows: &[R],
    now: Timestamp,
    timeout: Duration,
) -> Result<Vec<ActorState>, sqlx::Error> {
    let cutoff = now.minus(timeout).millis();
    rows.iter()
        .map(|r| {
            Ok(ActorState {
                id: actor_id(r.string("id")?),
                active: opt_version(r.opt_i64("active_version")?)?,
                staged: opt_version(r.opt_i64("staged_version")?)?,
                tau: r.f64("tau")?,
                latency_s: r.opt_f64("latency_s")?.unwrap_or(0.0),
                tokens_per_job: r.opt_f64("tokens_per_job")?,
                alive: r.i64("last_heartbeat")? >= cutoff,
                stalled: r.opt_i64("stalled_at")?.is_some(),
            })
        })
        .collect()
}

pub(crate) fn assignment(batch: BatchId, version: Version, plan: Plan) -> Assignment {
    Assignment {
        batch,
        version,
        shares: plan
            .shares
            .into_iter()
            .map(|s| ActorAssignment {
                actor: s.actor,
                count: s.count,
                commit: s.commit,
            })
            .collect(),
        excluded: plan.decayed.into_iter().map(|(a, _)| a).collect(),
    }
}

/// A claim's byte budget as its queries bind it: each job costs its stored prompt's length
/// plus `per_job` (`ClaimLimit`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClaimBytes {
    pub(crate) budget: i64,
    pub(crate) per_job: i64,
}

impl ClaimBytes {
    pub(crate) fn of(limit: ClaimLimit) -> Self {
        Self {
            budget: i64::try_from(limit.max_bytes).unwrap_or(i64::MAX),
            per_job: i64::try_from(limit.per_job).unwrap_or(i64::MAX),
        }
    }

    /// What is left of the budget after the claimed `rows` (`prompt_len` of each).
    pub(crate) fn left_after<R: Get>(&self, rows: &[R]) -> Result<i64, sqlx::Error> {
        let mut left = self.budget;
        for r in rows {
            left = left
                .saturating_sub(r.i64("prompt_len")?)
                .saturating_sub(self.per_job);
        }
        Ok(left.max(0))
    }
}

pub(crate) fn claimed_jobs<R: Get>(
    rows: &[R],
    expires: Timestamp,
) -> Result<Vec<ClaimedJob>, sqlx::Error> {
    let mut jobs = rows
        .iter()
        .map(|r| {
            Ok(ClaimedJob {
                id: JobId(r.i64("id")?),
                batch: BatchId(r.i64("batch_id")?),
                version: version(r.i64("version")?)?,
                prompt: r.bytes("prompt")?,
                attempt: u32_of(r.i64("attempts")?, "attempts")?,
                lease_expires: expires,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    jobs.sort_by_key(|j| j.id);
    Ok(jobs)
}

pub(crate) fn expire_report(states: &[String], released: u64, unclaimed: u64) -> ExpireReport {
    let failed = states.iter().filter(|s| s.as_str() == "failed").count() as u64;
    ExpireReport {
        returned: states.len() as u64 - failed,
        failed,
        released,
        unclaimed,
    }
}

pub(crate) fn release_report(states: &[String], unassigned: u64) -> ReleaseReport {
    let failed = states.iter().filter(|s| s.as_str() == "failed").count() as u64;
    ReleaseReport {
        returned: states.len() as u64 - failed,
        failed,
        unassigned,
    }
}

/// What a claim transaction reads of its actor.
pub(crate) struct ClaimingActor {
    /// The newest version it can run now: its active one, or the next one if it has staged
    /// it (its COMMIT is on the way); none before it holds weights.
    pub(crate) runnable: Option<i64>,
    pub(crate) tau: f64,
    pub(crate) measured: bool,
    pub(crate) busy: Option<schedule::Interval>,
    pub(crate) session: i64,
}

pub(crate) fn claiming_actor<R: Get>(r: &R) -> Result<ClaimingActor, sqlx::Error> {
    let active = r.opt_i64("active_version")?;
    let staged = r.opt_i64("staged_version")?;
    let runnable = match (active, staged) {
        (Some(a), Some(s)) if s == a.saturating_add(1) => Some(s),
        (a, _) => a,
    };
    Ok(ClaimingActor {
        runnable,
        tau: r.f64("tau")?,
        measured: r.i64("measured")? > 0,
        busy: interval(r)?,
        session: r.i64("session")?,
    })
}

/// A job row of a progress report (`id, state, lease_holder, leased_at, lease_expires,
/// progress_tokens, progress_at`) as `lease::on_progress` needs it.
pub(crate) fn progress_row<R: Get>(
    r: &R,
    actor: &ActorId,
    now: Timestamp,
) -> Result<(i64, crate::lease::ProgressRow), sqlx::Error> {
    let expires = r.opt_i64("lease_expires")?;
    let held = JobState::parse(&r.string("state")?)? == JobState::Leased
        && r.opt_string("lease_holder")?.as_deref() == Some(actor.as_str())
        && expires.is_some_and(|e| e >= now.millis());
    let previous = r
        .opt_i64("progress_at")?
        .or(r.opt_i64("leased_at")?)
        .unwrap_or(now.millis());
    Ok((
        r.i64("id")?,
        crate::lease::ProgressRow {
            held,
            tokens: u64::try_from(r.i64("progress_tokens")?).unwrap_or(0),
            previous: Timestamp::from_millis(previous),
            expires: Timestamp::from_millis(expires.unwrap_or(0)),
        },
    ))
}

/// The actor's open delivery interval (`busy_since`, `interval_fresh`).
fn interval<R: Get>(r: &R) -> Result<Option<schedule::Interval>, sqlx::Error> {
    let fresh = r.i64("interval_fresh")? != 0;
    Ok(r.opt_i64("busy_since")?.map(|ms| schedule::Interval {
        since: Timestamp::from_millis(ms),
        fresh,
    }))
}

/// What a submit transaction reads of its actor to measure it.
pub(crate) struct SettlingActor {
    pub(crate) estimate: schedule::Estimate,
    pub(crate) busy: Option<schedule::Interval>,
}

pub(crate) fn settling_actor<R: Get>(r: &R) -> Result<SettlingActor, sqlx::Error> {
    Ok(SettlingActor {
        estimate: schedule::Estimate {
            tau: r.f64("tau")?,
            measured: r.i64("measured")? > 0,
            latency_s: r.opt_f64("latency_s")?,
            tokens_per_job: r.opt_f64("tokens_per_job")?,
        },
        busy: interval(r)?,
    })
}

/// The actor's new estimate after an accepted submit (`None`: nothing was accepted, nothing
/// changes): the accepted tokens over the wall time since the actor's interval started (its
/// previous accepted submit, or the claim that ended its idleness), or since the earliest of
/// these leases if no interval is open ([`schedule::learn`]). The next interval starts now.
pub(crate) fn settle_submit(
    actor: &SettlingActor,
    decided: &Decided<'_>,
    now: Timestamp,
    beta: f64,
    round_trip: Option<Duration>,
) -> Option<schedule::Estimate> {
    if decided.accepted.is_empty() {
        return None;
    }
    let tokens: u64 = decided
        .accepted
        .iter()
        .map(|(s, _)| u64::from(s.tokens))
        .sum();
    let open = actor.busy.unwrap_or_else(|| {
        let earliest = decided
            .accepted
            .iter()
            .filter_map(|(_, r)| r.leased_at)
            .min()
            .unwrap_or(now.millis());
        schedule::Interval {
            since: Timestamp::from_millis(earliest),
            fresh: true,
        }
    });
    let elapsed_ms = u64::try_from(now.millis().saturating_sub(open.since.millis())).unwrap_or(0);
    let delivery = schedule::Delivery {
        tokens,
        jobs: decided.accepted.len() as u64,
        elapsed_ms,
        fresh: open.fresh,
        round_trip,
    };
    Some(schedule::learn(&actor.estimate, &delivery, beta))
}

pub(crate) fn job_rows<R: Get>(rows: &[R]) -> Result<HashMap<i64, JobRow>, sqlx::Error> {
    rows.iter()
        .map(|r| {
            let id = r.i64("id")?;
            Ok((
                id,
                JobRow {
                    state: JobState::parse(&r.string("state")?)?,
                    attempts: r.i64("attempts")?,
                    version: version(r.i64("version")?)?,
                    batch: r.i64("batch_id")?,
                    max_staleness: u64::try_from(r.i64("max_staleness")?).unwrap_or(0),
                    cancelled: r.opt_i64("cancelled_at")?.is_some(),
                    holder: r.opt_string("lease_holder")?,
                    leased_at: r.opt_i64("leased_at")?,
                    expires: r.opt_i64("lease_expires")?,
                },
            ))
        })
        .collect()
}

/// The verdicts of one submit call, in request order.
pub(crate) struct Decided<'a> {
    pub(crate) outcomes: Vec<SubmitOutcome>,
    pub(crate) accepted: Vec<(&'a ResultSubmission, &'a JobRow)>,
}

/// The committed versions' digests from `version, digest` rows, and the newest committed
/// version.
pub(crate) fn committed<R: Get>(rows: &[R], latest: Option<i64>) -> Result<Committed, sqlx::Error> {
    let digests = rows
        .iter()
        .map(|r| {
            Ok((
                version(r.i64("version")?)?,
                Digest::from_db(&r.bytes("digest")?)?,
            ))
        })
        .collect::<Result<HashMap<_, _>, sqlx::Error>>()?;
    Ok(Committed {
        digests,
        latest: opt_version(latest)?,
    })
}

/// The oldest version any submission names (the committed digests are read from there on).
pub(crate) fn oldest_named(results: &[ResultSubmission]) -> i64 {
    results.iter().map(|r| r.version.to_db()).min().unwrap_or(0)
}

/// The jobs a submit call reads: those of its results, then those the hub refused.
pub(crate) fn submit_ids(call: &SubmitCall<'_>) -> Vec<i64> {
    let mut ids: Vec<i64> = call
        .results
        .iter()
        .map(|r| r.job.0)
        .chain(call.refused.iter().map(|r| r.job.0))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Refusals per (batch, reason) of one submit call — the ledger's and the hub's — for the
/// `refusals` counters.
pub(crate) fn refusal_counts(
    rows: &HashMap<i64, JobRow>,
    outcomes: &[SubmitOutcome],
    refused: &[HubRefusal],
) -> Vec<(i64, &'static str, i64)> {
    let mut counts: HashMap<(i64, &'static str), i64> = HashMap::new();
    for o in outcomes {
        if let (Err(why), Some(row)) = (&o.verdict, rows.get(&o.job.0)) {
            *counts.entry((row.batch, why.code())).or_default() += 1;
        }
    }
    for r in refused {
        if let Some(row) = rows.get(&r.job.0) {
            *counts.entry((row.batch, r.code)).or_default() += 1;
        }
    }
    let mut v: Vec<_> = counts.into_iter().map(|((b, r), n)| (b, r, n)).collect();
    v.sort();
    v
}

/// The jobs the hub's refusals act on: only jobs leased to the submitter.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    /// Leases to end now (the group goes back to the pool, or fails out of attempts).
    pub(crate) reoffer: Vec<i64>,
    /// Groups to fail, by reason.
    pub(crate) fail: Vec<(&'static str, Vec<i64>)>,
}

pub(crate) fn refusal_effects(
    rows: &HashMap<i64, JobRow>,
    refused: &[HubRefusal],
    actor: &ActorId,
) -> Effects {
    let mut e = Effects::default();
    for r in refused {
        let held = rows.get(&r.job.0).is_some_and(|row| {
            row.state == JobState::Leased && row.holder.as_deref() == Some(actor.as_str())
        });
        if !held {
            continue;
        }
        match r.effect {
            RefusalEffect::KeepLease => {}
            RefusalEffect::Reoffer => e.reoffer.push(r.job.0),
            RefusalEffect::Fail => match e.fail.iter_mut().find(|(c, _)| *c == r.code) {
                Some((_, jobs)) => jobs.push(r.job.0),
                None => e.fail.push((r.code, vec![r.job.0])),
            },
        }
    }
    e
}

/// How many of the accepted results are readable at once (the others wait for scoring).
pub(crate) fn readable_count(accepted: &[(&ResultSubmission, &JobRow)], unscored: &[JobId]) -> i64 {
    let later: HashSet<JobId> = unscored.iter().copied().collect();
    accepted
        .iter()
        .filter(|(s, _)| !later.contains(&s.job))
        .count() as i64
}

/// The cursor of each accepted result, in order: the readable ones take the counter's values
/// up to `last` in turn; the ones waiting for scoring get none.
pub(crate) fn cursors(
    accepted: &[(&ResultSubmission, &JobRow)],
    unscored: &[JobId],
    last: i64,
) -> Vec<Option<i64>> {
    let later: HashSet<JobId> = unscored.iter().copied().collect();
    let mut next = last - readable_count(accepted, unscored) + 1;
    accepted
        .iter()
        .map(|(s, _)| {
            if later.contains(&s.job) {
                None
            } else {
                next += 1;
                Some(next - 1)
            }
        })
        .collect()
}

pub(crate) fn decide<'a>(
    rows: &'a HashMap<i64, JobRow>,
    committed: &Committed,
    results: &'a [ResultSubmission],
    actor: &ActorId,
    now: Timestamp,
) -> Decided<'a> {
    let mut seen = HashSet::new();
    let mut outcomes = Vec::with_capacity(results.len());
    let mut accepted = Vec::new();
    for sub in results {
        let row = rows.get(&sub.job.0);
        let verdict = judge(row, sub, committed, actor, now, seen.contains(&sub.job.0));
        if let (Ok(()), Some(row)) = (&verdict, row) {
            seen.insert(sub.job.0);
            accepted.push((sub, row));
        }
        outcomes.push(SubmitOutcome {
            job: sub.job,
            verdict,
        });
    }
    Decided { outcomes, accepted }
}

pub(crate) fn actor_info<R: Get>(r: &R) -> Result<ActorInfo, crate::error::ReadError> {
    Ok(ActorInfo {
        id: actor_id(r.string("id")?),
        region: r.string("region")?,
        hardware: r.string("hardware")?,
        active: opt_version(r.opt_i64("active_version")?)?,
        staged: opt_version(r.opt_i64("staged_version")?)?,
        tau: r.f64("tau")?,
        measured: u64::try_from(r.i64("measured")?).unwrap_or(0),
        latency_s: r.opt_f64("latency_s")?,
        last_heartbeat: Timestamp::from_millis(r.i64("last_heartbeat")?),
        stalled_since: r.opt_i64("stalled_at")?.map(Timestamp::from_millis),
    })
}

pub(crate) fn batch_info<R: Get>(id: BatchId, r: &R) -> Result<BatchInfo, crate::error::ReadError> {
    Ok(BatchInfo {
        id,
        version: version(r.i64("version")?)?,
        size: u32_of(r.i64("size")?, "batch size")?,
        sampling: r.string("sampling")?,
        scheduled: r.opt_i64("scheduled_at")?.is_some(),
    })
}

pub(crate) fn job_view<R: Get>(r: &R) -> Result<JobView, crate::error::ReadError> {
    Ok(JobView {
        id: JobId(r.i64("id")?),
        state: JobState::parse(&r.string("state")?)?,
        attempts: u32_of(r.i64("attempts")?, "attempts")?,
        holder: r.opt_string("lease_holder")?.map(actor_id),
        accepted_from: r.opt_string("actor_id")?.map(actor_id),
    })
}

pub(crate) fn job_counts<R: Get>(rows: &[R]) -> Result<JobCounts, crate::error::ReadError> {
    let mut c = JobCounts::default();
    for r in rows {
        let n = u64::try_from(r.i64("n")?).unwrap_or(0);
        match JobState::parse(&r.string("state")?)? {
            JobState::Posted => c.posted = n,
            JobState::Pending => c.pending = n,
            JobState::Leased => c.leased = n,
            JobState::Done => c.done = n,
            JobState::Failed => c.failed = n,
        }
    }
    Ok(c)
}

pub(crate) fn assignments<R: Get>(
    rows: &[R],
) -> Result<Vec<ActorAssignment>, crate::error::ReadError> {
    rows.iter()
        .map(|r| {
            Ok(ActorAssignment {
                actor: actor_id(r.string("actor_id")?),
                count: u32_of(r.i64("count")?, "count")?,
                commit: r.opt_i64("commit_version")?.is_some(),
            })
        })
        .collect()
}

pub(crate) fn version_state(s: &str) -> Result<VersionState, crate::error::ReadError> {
    match s {
        "staged" => Ok(VersionState::Staged),
        "committed" => Ok(VersionState::Committed),
        other => Err(sqlx::Error::Decode(format!("unknown version state {other:?}").into()).into()),
    }
}
