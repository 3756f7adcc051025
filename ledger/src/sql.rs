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
            fn bytes(&self, c: &str) -> Result<Vec<u8>, sqlx::Error> {
                self.try_get(c)
            }
        }
    };
}
impl_get!(sqlx::sqlite::SqliteRow);
impl_get!(sqlx::postgres::PgRow);

pub(crate) const RECENT_COMPLETIONS: &str =
    "SELECT completion_ms FROM results ORDER BY id DESC LIMIT $1";
pub(crate) const VERSION_BY_ID: &str =
    "SELECT version, base, digest, state FROM versions WHERE version = $1";
pub(crate) const VERSION_STATE: &str = "SELECT state FROM versions WHERE version = $1";
pub(crate) const INSERT_VERSION: &str = "INSERT INTO versions (version, base, digest, state, created_at) VALUES ($1, $2, $3, 'staged', $4)";
pub(crate) const COMMIT_VERSION: &str = "UPDATE versions SET state = 'committed', committed_at = $2 WHERE version = $1 AND state = 'staged'";
pub(crate) const UPSERT_ACTOR: &str = "INSERT INTO actors (id, region, hardware, tau, last_heartbeat, registered_at) \
     VALUES ($1, $2, $3, $4, $5, $5) \
     ON CONFLICT (id) DO UPDATE SET region = excluded.region, hardware = excluded.hardware, \
     last_heartbeat = excluded.last_heartbeat";
pub(crate) const HEARTBEAT: &str =
    "UPDATE actors SET active_version = $2, staged_version = $3, last_heartbeat = $4 WHERE id = $1";
pub(crate) const INSERT_BATCH: &str = "INSERT INTO batches (version, size, sampling, created_at, max_staleness) VALUES ($1, $2, $3, $4, $5) RETURNING id";
pub(crate) const INSERT_JOB: &str =
    "INSERT INTO jobs (batch_id, version, prompt, state) VALUES ($1, $2, $3, 'posted')";
pub(crate) const BATCH_BY_ID: &str =
    "SELECT id, version, size, sampling, scheduled_at FROM batches WHERE id = $1";
pub(crate) const ACTORS_FOR_SCHEDULE: &str =
    "SELECT id, active_version, staged_version, tau, last_heartbeat FROM actors ORDER BY id";
pub(crate) const SET_TAU: &str = "UPDATE actors SET tau = $2 WHERE id = $1";
pub(crate) const ASSIGN_JOBS: &str = "UPDATE jobs SET state = 'pending', assignee = $1 \
     WHERE id IN (SELECT id FROM jobs WHERE batch_id = $2 AND state = 'posted' ORDER BY id LIMIT $3)";
pub(crate) const INSERT_ASSIGNMENT: &str =
    "INSERT INTO assignments (batch_id, actor_id, count, commit_version) VALUES ($1, $2, $3, $4)";
pub(crate) const MARK_SCHEDULED: &str = "UPDATE batches SET scheduled_at = $2 WHERE id = $1";
pub(crate) const ACTOR_ACTIVE: &str = "SELECT active_version FROM actors WHERE id = $1";
pub(crate) const ACTOR_TAU: &str = "SELECT tau FROM actors WHERE id = $1";
pub(crate) const RELEASE_SILENT: &str = "UPDATE jobs SET assignee = NULL WHERE state = 'pending' \
     AND assignee IN (SELECT id FROM actors WHERE last_heartbeat < $1)";
pub(crate) const ACTOR_BY_ID: &str = "SELECT id, region, hardware, active_version, staged_version, tau, \
     last_heartbeat FROM actors WHERE id = $1";
pub(crate) const JOB_VIEW: &str = "SELECT j.id, j.state, j.attempts, j.lease_holder, r.actor_id \
     FROM jobs j LEFT JOIN results r ON r.job_id = j.id WHERE j.id = $1";
pub(crate) const JOB_COUNTS: &str = "SELECT state, COUNT(*) AS n FROM jobs GROUP BY state";
pub(crate) const COMMITTED_FROM: &str =
    "SELECT version, digest FROM versions WHERE state = 'committed' AND version >= $1";
pub(crate) const LATEST_COMMITTED: &str =
    "SELECT MAX(version) FROM versions WHERE state = 'committed'";
pub(crate) const COUNT_REFUSALS: &str = "INSERT INTO refusals (batch_id, reason, count) VALUES ($1, $2, $3) \
     ON CONFLICT (batch_id, reason) DO UPDATE SET count = refusals.count + excluded.count";
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
                alive: r.i64("last_heartbeat")? >= cutoff,
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

pub(crate) fn renew_report(asked: &[JobId], renewed: Vec<i64>, expires: Timestamp) -> RenewReport {
    let set: HashSet<i64> = renewed.iter().copied().collect();
    let mut renewed: Vec<JobId> = renewed.into_iter().map(JobId).collect();
    renewed.sort();
    let lost = asked
        .iter()
        .copied()
        .filter(|j| !set.contains(&j.0))
        .collect();
    RenewReport {
        renewed,
        expires,
        lost,
    }
}

pub(crate) fn expire_report(states: &[String], released: u64) -> ExpireReport {
    let failed = states.iter().filter(|s| s.as_str() == "failed").count() as u64;
    ExpireReport {
        returned: states.len() as u64 - failed,
        failed,
        released,
    }
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
    pub(crate) completions: Vec<Duration>,
    pub(crate) tau: f64,
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

/// Refusals per (batch, reason) of one submit call, for the `refusals` counters.
pub(crate) fn refusal_counts(
    rows: &HashMap<i64, JobRow>,
    outcomes: &[SubmitOutcome],
) -> Vec<(i64, &'static str, i64)> {
    let mut counts: HashMap<(i64, &'static str), i64> = HashMap::new();
    for o in outcomes {
        if let (Err(why), Some(row)) = (&o.verdict, rows.get(&o.job.0)) {
            *counts.entry((row.batch, why.code())).or_default() += 1;
        }
    }
    let mut v: Vec<_> = counts.into_iter().map(|((b, r), n)| (b, r, n)).collect();
    v.sort();
    v
}

pub(crate) fn decide<'a>(
    rows: &'a HashMap<i64, JobRow>,
    committed: &Committed,
    results: &'a [ResultSubmission],
    actor: &ActorId,
    now: Timestamp,
    mut tau: f64,
    beta: f64,
) -> Decided<'a> {
    let mut seen = HashSet::new();
    let mut outcomes = Vec::with_capacity(results.len());
    let mut accepted = Vec::new();
    let mut completions = Vec::new();
    for sub in results {
        let row = rows.get(&sub.job.0);
        let verdict = judge(row, sub, committed, actor, now, seen.contains(&sub.job.0));
        if let (Ok(()), Some(row)) = (&verdict, row) {
            seen.insert(sub.job.0);
            accepted.push((sub, row));
            let leased_at = Timestamp::from_millis(row.leased_at.unwrap_or(now.millis()));
            completions.push(now.since(leased_at));
            let elapsed = u64::try_from(sub.elapsed.as_millis()).unwrap_or(u64::MAX);
            tau = schedule::settle(tau, beta, sub.tokens, elapsed);
        }
        outcomes.push(SubmitOutcome {
            job: sub.job,
            verdict,
        });
    }
    Decided {
        outcomes,
        accepted,
        completions,
        tau,
    }
}

pub(crate) fn actor_info<R: Get>(r: &R) -> Result<ActorInfo, crate::error::ReadError> {
    Ok(ActorInfo {
        id: actor_id(r.string("id")?),
        region: r.string("region")?,
        hardware: r.string("hardware")?,
        active: opt_version(r.opt_i64("active_version")?)?,
        staged: opt_version(r.opt_i64("staged_version")?)?,
        tau: r.f64("tau")?,
        last_heartbeat: Timestamp::from_millis(r.i64("last_heartbeat")?),
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
