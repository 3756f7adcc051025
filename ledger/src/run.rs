//! What the hub keeps of an RL run beyond scheduling: versions with the hub's metadata
//! (written committed in one transaction, so a version exists in the ledger exactly when it
//! was published), the run's identity (model id, initial checkpoint), batch status with
//! refusal counts, the trainer's stream of accepted results (ordered by result id, which is
//! the cursor), and cancellation.
//!
//! The statements read the same in both dialects; [`with_pool`] runs one body against
//! whichever pool the ledger has, and the row decoders in `sql` are generic over both.

use crate::error::{CancelError, ReadError, VersionError};
use crate::ids::{ActorId, BatchId, Digest, JobId, Timestamp, Version};
use crate::model::{ActorInfo, JobCounts};
use crate::sql::{self, Get};
use crate::{Ledger, Store};

/// A published version as the ledger holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionRecord {
    /// The version.
    pub version: Version,
    /// Its base (none for the initial version).
    pub base: Option<Version>,
    /// The state digest of its weights.
    pub digest: Digest,
    /// The hub's metadata (JSON text: delta file, sizes, the trainer's step).
    pub meta: String,
    /// When it was published.
    pub created_at: Timestamp,
}

/// A batch's progress, for the trainer's status call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchStatus {
    /// The batch.
    pub id: BatchId,
    /// Its version.
    pub version: Version,
    /// Number of jobs (groups).
    pub size: u32,
    /// The staleness bound its results are judged with.
    pub max_staleness: u64,
    /// When it was posted.
    pub created_at: Timestamp,
    /// Whether it has been scheduled over actors.
    pub scheduled: bool,
    /// When it was cancelled, if it was.
    pub cancelled_at: Option<Timestamp>,
    /// Its jobs per state (cancelled jobs count as failed).
    pub jobs: JobCounts,
    /// Refused submissions per reason ([`crate::Rejection::code`]).
    pub refusals: Vec<(String, u64)>,
}

/// One accepted result, as the trainer reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedResult {
    /// Its position in the stream of accepted results (increasing; resume after it).
    pub cursor: i64,
    /// The job it answers.
    pub job: JobId,
    /// The actor whose result was accepted.
    pub actor: ActorId,
    /// The version it was generated with.
    pub version: Version,
    /// How many times the job had been leased.
    pub attempt: u32,
    /// The result payload the hub stored.
    pub payload: Vec<u8>,
    /// When it was accepted.
    pub accepted_at: Timestamp,
}

/// A job's prompt payload and batch, for the hub to judge a result against its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobPayload {
    /// The job.
    pub job: JobId,
    /// Its batch.
    pub batch: BatchId,
    /// Its version.
    pub version: Version,
    /// The prompt payload as posted.
    pub prompt: Vec<u8>,
}

/// Runs `$body` with `$p` bound to the ledger's pool, whichever backend it is.
macro_rules! with_pool {
    ($self:ident, $p:ident => $body:expr) => {
        match &$self.store {
            Store::Sqlite(s) => {
                let $p = s.pool();
                $body
            }
            Store::Postgres(s) => {
                let $p = s.pool();
                $body
            }
        }
    };
}

const INSERT_COMMITTED: &str = "INSERT INTO versions (version, base, digest, state, created_at, committed_at, meta) \
     VALUES ($1, $2, $3, 'committed', $4, $4, $5)";
const LATEST_VERSIONS: &str = "SELECT version, base, digest, meta, created_at FROM versions \
     WHERE state = 'committed' ORDER BY version DESC LIMIT $1";
const META_GET: &str = "SELECT value FROM run_meta WHERE key = $1";
const META_SET: &str = "INSERT INTO run_meta (key, value) VALUES ($1, $2) \
     ON CONFLICT (key) DO UPDATE SET value = excluded.value";
const UNSCHEDULED: &str = "SELECT id FROM batches WHERE scheduled_at IS NULL AND cancelled_at IS NULL \
     ORDER BY id LIMIT $1";
const BATCH_STATUS: &str = "SELECT id, version, size, max_staleness, created_at, scheduled_at, cancelled_at \
     FROM batches WHERE id = $1";
const BATCH_JOB_COUNTS: &str =
    "SELECT state, COUNT(*) AS n FROM jobs WHERE batch_id = $1 GROUP BY state";
const BATCH_REFUSALS: &str =
    "SELECT reason, count FROM refusals WHERE batch_id = $1 ORDER BY reason";
const RESULTS_AFTER: &str = "SELECT r.id, r.job_id, r.actor_id, r.version, r.payload, r.accepted_at, j.attempts \
     FROM results r JOIN jobs j ON j.id = r.job_id WHERE r.batch_id = $1 AND r.id > $2 ORDER BY r.id LIMIT $3";
const CANCEL_BATCH: &str =
    "UPDATE batches SET cancelled_at = $2 WHERE id = $1 AND cancelled_at IS NULL";
const CANCEL_JOBS: &str = "UPDATE jobs SET state = 'failed', assignee = NULL, lease_holder = NULL, \
     leased_at = NULL, lease_expires = NULL WHERE batch_id = $1 AND state IN ('posted', 'pending', 'leased')";
const RECENT_BATCHES: &str = "SELECT id FROM batches ORDER BY id DESC LIMIT $1";
const LEASES_BY_ACTOR: &str = "SELECT lease_holder, COUNT(*) AS n FROM jobs \
     WHERE state = 'leased' GROUP BY lease_holder ORDER BY lease_holder";
const JOB_PAYLOAD: &str = "SELECT id, batch_id, version, prompt FROM jobs WHERE id = $1";
const ALL_ACTORS: &str = "SELECT id, region, hardware, active_version, staged_version, tau, \
     measured, last_heartbeat, stalled_at FROM actors ORDER BY id";

fn version_record<R: Get>(r: &R) -> Result<VersionRecord, sqlx::Error> {
    Ok(VersionRecord {
        version: Version::from_db(r.i64("version")?)?,
        base: r.opt_i64("base")?.map(Version::from_db).transpose()?,
        digest: Digest::from_db(&r.bytes("digest")?)?,
        meta: r.string("meta")?,
        created_at: Timestamp::from_millis(r.i64("created_at")?),
    })
}

fn accepted<R: Get>(r: &R) -> Result<AcceptedResult, sqlx::Error> {
    Ok(AcceptedResult {
        cursor: r.i64("id")?,
        job: JobId(r.i64("job_id")?),
        actor: ActorId::from_db(r.string("actor_id")?),
        version: Version::from_db(r.i64("version")?)?,
        attempt: u32::try_from(r.i64("attempts")?).unwrap_or(0),
        payload: r.bytes("payload")?,
        accepted_at: Timestamp::from_millis(r.i64("accepted_at")?),
    })
}

impl Ledger {
    /// Records a published version, committed, with the hub's metadata, in one transaction.
    /// Repeating it with the same base and digest is a no-op; another base or digest for a
    /// recorded version is a `Conflict`, and a base that is not recorded is `UnknownBase`.
    pub async fn publish_version(
        &self,
        version: Version,
        base: Option<Version>,
        digest: Digest,
        meta: &str,
        now: Timestamp,
    ) -> Result<(), VersionError> {
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let existing = sqlx::query(sql::VERSION_BY_ID)
                .bind(version.to_db())
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(row) = existing {
                let same = row.opt_i64("base")? == base.map(Version::to_db)
                    && row.bytes("digest")? == digest.0;
                if !same {
                    return Err(VersionError::Conflict(version));
                }
                sqlx::query(sql::COMMIT_VERSION)
                    .bind(version.to_db())
                    .bind(now.millis())
                    .execute(&mut *tx)
                    .await?;
            } else {
                if let Some(b) = base {
                    let known: Option<String> = sqlx::query_scalar(sql::VERSION_STATE)
                        .bind(b.to_db())
                        .fetch_optional(&mut *tx)
                        .await?;
                    if known.is_none() {
                        return Err(VersionError::UnknownBase(b));
                    }
                }
                sqlx::query(INSERT_COMMITTED)
                    .bind(version.to_db())
                    .bind(base.map(Version::to_db))
                    .bind(&digest.0[..])
                    .bind(now.millis())
                    .bind(meta)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok(())
        })
    }

    /// The newest `limit` committed versions, newest first.
    pub async fn latest_versions(&self, limit: u32) -> Result<Vec<VersionRecord>, ReadError> {
        with_pool!(self, p => {
            let rows = sqlx::query(LATEST_VERSIONS)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?;
            Ok(rows.iter().map(version_record).collect::<Result<_, _>>()?)
        })
    }

    /// A value of the run's metadata.
    pub async fn run_meta(&self, key: &str) -> Result<Option<String>, ReadError> {
        with_pool!(self, p => {
            Ok(sqlx::query_scalar(META_GET).bind(key).fetch_optional(p).await?)
        })
    }

    /// Sets a value of the run's metadata.
    pub async fn set_run_meta(&self, key: &str, value: &str) -> Result<(), ReadError> {
        with_pool!(self, p => {
            sqlx::query(META_SET).bind(key).bind(value).execute(p).await?;
            Ok(())
        })
    }

    /// Batches posted but not yet scheduled (nor cancelled), oldest first.
    pub async fn unscheduled_batches(&self, limit: u32) -> Result<Vec<BatchId>, ReadError> {
        with_pool!(self, p => {
            let ids: Vec<i64> = sqlx::query_scalar(UNSCHEDULED)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?;
            Ok(ids.into_iter().map(BatchId).collect())
        })
    }

    /// A batch's progress.
    pub async fn batch_status(&self, id: BatchId) -> Result<BatchStatus, ReadError> {
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let row = sqlx::query(BATCH_STATUS)
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(ReadError::NotFound)?;
            let counts = sqlx::query(BATCH_JOB_COUNTS)
                .bind(id.0)
                .fetch_all(&mut *tx)
                .await?;
            let refusals = sqlx::query(BATCH_REFUSALS)
                .bind(id.0)
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(BatchStatus {
                id,
                version: Version::from_db(row.i64("version")?)?,
                size: u32::try_from(row.i64("size")?).unwrap_or(0),
                max_staleness: u64::try_from(row.i64("max_staleness")?).unwrap_or(0),
                created_at: Timestamp::from_millis(row.i64("created_at")?),
                scheduled: row.opt_i64("scheduled_at")?.is_some(),
                cancelled_at: row.opt_i64("cancelled_at")?.map(Timestamp::from_millis),
                jobs: sql::job_counts(&counts)?,
                refusals: refusals
                    .iter()
                    .map(|r| Ok((r.string("reason")?, u64::try_from(r.i64("count")?).unwrap_or(0))))
                    .collect::<Result<_, sqlx::Error>>()?,
            })
        })
    }

    /// Accepted results of `batch` after `cursor`, in cursor order, at most `limit`.
    pub async fn results_after(
        &self,
        batch: BatchId,
        cursor: i64,
        limit: u32,
    ) -> Result<Vec<AcceptedResult>, ReadError> {
        with_pool!(self, p => {
            let rows = sqlx::query(RESULTS_AFTER)
                .bind(batch.0)
                .bind(cursor)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?;
            Ok(rows.iter().map(accepted).collect::<Result<_, _>>()?)
        })
    }

    /// Cancels a batch: its unfinished jobs become failed (their leases end; results for them
    /// are refused as `Cancelled`). Returns how many jobs were cancelled.
    pub async fn cancel_batch(&self, id: BatchId, now: Timestamp) -> Result<u64, CancelError> {
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let exists: Option<i64> = sqlx::query_scalar(BATCH_STATUS_ID)
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?;
            if exists.is_none() {
                return Err(CancelError::UnknownBatch(id));
            }
            let marked = sqlx::query(CANCEL_BATCH)
                .bind(id.0)
                .bind(now.millis())
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if marked == 0 {
                return Err(CancelError::AlreadyCancelled(id));
            }
            let n = sqlx::query(CANCEL_JOBS)
                .bind(id.0)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            Ok(n)
        })
    }

    /// The prompt payloads of jobs (unknown ids are left out).
    pub async fn job_payloads(&self, jobs: &[JobId]) -> Result<Vec<JobPayload>, ReadError> {
        with_pool!(self, p => {
            let mut out = Vec::with_capacity(jobs.len());
            for j in jobs {
                if let Some(r) = sqlx::query(JOB_PAYLOAD).bind(j.0).fetch_optional(p).await? {
                    out.push(JobPayload {
                        job: *j,
                        batch: BatchId(r.i64("batch_id")?),
                        version: Version::from_db(r.i64("version")?)?,
                        prompt: r.bytes("prompt")?,
                    });
                }
            }
            Ok(out)
        })
    }

    /// The newest `limit` batches, newest first (for status pages).
    pub async fn recent_batches(&self, limit: u32) -> Result<Vec<BatchId>, ReadError> {
        with_pool!(self, p => {
            let rows = sqlx::query(RECENT_BATCHES).bind(i64::from(limit)).fetch_all(p).await?;
            rows.iter().map(|r| Ok(BatchId(r.i64("id")?))).collect()
        })
    }

    /// How many jobs each actor holds a lease on now (actors holding none are left out).
    pub async fn leases_by_actor(&self) -> Result<Vec<(ActorId, u64)>, ReadError> {
        with_pool!(self, p => {
            let rows = sqlx::query(LEASES_BY_ACTOR).fetch_all(p).await?;
            rows.iter()
                .map(|r| {
                    let holder = sql::actor_id(r.string("lease_holder")?);
                    Ok((holder, u64::try_from(r.i64("n")?).unwrap_or(0)))
                })
                .collect()
        })
    }

    /// Every registered actor, by id.
    pub async fn actors(&self) -> Result<Vec<ActorInfo>, ReadError> {
        with_pool!(self, p => {
            let rows = sqlx::query(ALL_ACTORS).fetch_all(p).await?;
            rows.iter().map(sql::actor_info).collect()
        })
    }
}

const BATCH_STATUS_ID: &str = "SELECT id FROM batches WHERE id = $1";
