//! What the hub keeps of an RL run beyond scheduling: versions with the hub's metadata
//! (written committed in one transaction, so a version exists in the ledger exactly when it
//! was published), the run's identity (model id, initial checkpoint), batch status with
//! refusal and failure counts, the trainer's stream of accepted results by cursor, results
//! waiting for their reward service, cancellation, and retention (see `retention`).
//!
//! **Cursors in commit order.** A result's cursor is not its row id: it is taken from the
//! `result_cursor` counter inside the transaction that makes the result readable (the submit,
//! or the scoring for a result that waits for its reward service), as that transaction's last
//! step but for writes to rows it already holds. On PostgreSQL the counter row stays locked to
//! the commit, so a transaction holding cursors `c+1..c+k` commits before any transaction can
//! take `c+k+1`: whatever a reader sees is a prefix of the cursor sequence, and a trainer that
//! polls after the last cursor it read never skips a result that commits later (with row ids,
//! a transaction that took a lower id and committed later was skipped). On SQLite one writer
//! gives the same order. The counter never goes back (retention deletes rows, not the
//! counter), so a cursor is never reused.
//!
//! The statements read the same in both dialects; [`with_pool`] runs one body against
//! whichever pool the ledger has, [`with_reader`] against its read pool, [`durably`] in a
//! transaction that is durable before it returns, and the row decoders in `sql` are generic
//! over both.

use crate::error::{CancelError, ReadError, ScoreError, VersionError};
use crate::ids::{ActorId, BatchId, Digest, JobId, Timestamp, Version};
use crate::model::{ActorInfo, JobCounts, Unscored};
use crate::sql::{self, Get};
use crate::{Backend, Ledger, Store};

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

/// Where a batch's results went when retention archived it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Archive {
    /// The file holding its results (one JSON document per line, in cursor order).
    pub path: String,
    /// When it was archived.
    pub at: Timestamp,
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
    /// Refused submissions per reason ([`crate::Rejection::code`], or the hub's code).
    pub refusals: Vec<(String, u64)>,
    /// Failed jobs per reason ([`crate::FAIL_ATTEMPTS`], [`crate::FAIL_CANCELLED`], or the
    /// code of the refusal or scoring failure that failed them).
    pub failures: Vec<(String, u64)>,
    /// Done jobs whose result waits for its reward service (not readable yet).
    pub scoring: u64,
    /// When the trainer read its results to the end (see [`Ledger::mark_delivered`]).
    pub delivered_at: Option<Timestamp>,
    /// Where its results are, once archived (its job and result rows are gone then).
    pub archive: Option<Archive>,
}

impl BatchStatus {
    /// Every job is done or failed, and every done job's result is readable.
    pub fn finished(&self) -> bool {
        let j = &self.jobs;
        j.done + j.failed == j.total() && self.scoring == 0
    }
}

/// One page of a batch's result stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResultsPage {
    /// Readable results after the cursor asked for, in cursor order.
    pub results: Vec<AcceptedResult>,
    /// Whether more readable results follow the last one (the page was full).
    pub more: bool,
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

/// Runs `$body` with `$p` bound to the ledger's read pool (SQLite: the read-only
/// connections, off the writer; PostgreSQL: the pool).
macro_rules! with_reader {
    ($self:ident, $p:ident => $body:expr) => {
        match &$self.store {
            Store::Sqlite(s) => {
                let $p = s.reader();
                $body
            }
            Store::Postgres(s) => {
                let $p = s.pool();
                $body
            }
        }
    };
}

/// Runs the async closure body `$body` with `$tx` bound to a connection inside a transaction
/// that is durable when it commits (`SqliteStore::durably`, `PgStore::durably`).
macro_rules! durably {
    ($self:ident, $tx:ident => $body:expr) => {
        match &$self.store {
            Store::Sqlite(s) => s.durably(async |$tx| $body).await,
            Store::Postgres(s) => s.durably(async |$tx| $body).await,
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
const BATCH_STATUS: &str = "SELECT id, version, size, max_staleness, created_at, scheduled_at, cancelled_at, \
     delivered_at, archived_at, archive FROM batches WHERE id = $1";
const BATCH_FAILURES: &str = "SELECT COALESCE(fail_reason, 'attempts') AS reason, COUNT(*) AS n FROM jobs \
     WHERE batch_id = $1 AND state = 'failed' GROUP BY COALESCE(fail_reason, 'attempts') ORDER BY reason";
const ARCHIVED_FAILURES: &str =
    "SELECT reason, count AS n FROM archived_failures WHERE batch_id = $1 ORDER BY reason";
const BATCH_SCORING: &str = "SELECT COUNT(*) FROM results WHERE batch_id = $1 AND cursor IS NULL";
const BATCH_JOB_COUNTS: &str =
    "SELECT state, COUNT(*) AS n FROM jobs WHERE batch_id = $1 GROUP BY state";
const BATCH_REFUSALS: &str =
    "SELECT reason, count FROM refusals WHERE batch_id = $1 ORDER BY reason";
/// Sizes first (no payloads read), to choose how many rows fit a page.
const RESULT_SIZES_AFTER: &str = "SELECT cursor, CAST(length(payload) AS BIGINT) AS bytes FROM results \
     WHERE batch_id = $1 AND cursor > $2 ORDER BY cursor LIMIT $3";
const RESULTS_BETWEEN: &str = "SELECT r.cursor, r.job_id, r.actor_id, r.version, r.payload, r.accepted_at, j.attempts \
     FROM results r JOIN jobs j ON j.id = r.job_id \
     WHERE r.batch_id = $1 AND r.cursor > $2 AND r.cursor <= $3 ORDER BY r.cursor";
const CANCEL_BATCH: &str =
    "UPDATE batches SET cancelled_at = $2 WHERE id = $1 AND cancelled_at IS NULL";
const CANCEL_JOBS: &str = "UPDATE jobs SET state = 'failed', fail_reason = 'cancelled', assignee = NULL, \
     lease_holder = NULL, leased_at = NULL, lease_expires = NULL \
     WHERE batch_id = $1 AND state IN ('posted', 'pending', 'leased')";
const UNSCORED: &str = "SELECT r.job_id, r.batch_id, r.version, r.payload, j.prompt FROM results r \
     JOIN jobs j ON j.id = r.job_id WHERE r.cursor IS NULL ORDER BY r.id LIMIT $1";
const UNSCORED_JOBS: &str = "SELECT job_id FROM results WHERE cursor IS NULL ORDER BY id LIMIT $1";
const UNSCORED_JOB: &str = "SELECT r.job_id, r.batch_id, r.version, r.payload, j.prompt FROM results r \
     JOIN jobs j ON j.id = r.job_id WHERE r.job_id = $1 AND r.cursor IS NULL";
const SCORE_RESULT: &str =
    "UPDATE results SET payload = $2, cursor = $3 WHERE job_id = $1 AND cursor IS NULL";
const UNSCORED_OF_JOB: &str = "SELECT COUNT(*) FROM results WHERE job_id = $1 AND cursor IS NULL";
const DROP_UNSCORED: &str = "DELETE FROM results WHERE job_id = $1 AND cursor IS NULL";
const FAIL_DONE_JOB: &str = "UPDATE jobs SET state = 'failed', fail_reason = $2, done_at = NULL \
     WHERE id = $1 AND state = 'done'";
const MARK_DELIVERED: &str =
    "UPDATE batches SET delivered_at = $2 WHERE id = $1 AND delivered_at IS NULL";
const OPEN_JOB_COUNTS: &str = "SELECT state, COUNT(*) AS n FROM jobs \
     WHERE state IN ('posted', 'pending', 'leased') GROUP BY state";
const FAILED_JOBS: &str = "SELECT COUNT(*) FROM jobs WHERE state = 'failed'";
const RECENT_BATCHES: &str = "SELECT id FROM batches ORDER BY id DESC LIMIT $1";
const LEASES_BY_ACTOR: &str = "SELECT lease_holder, COUNT(*) AS n FROM jobs \
     WHERE state = 'leased' GROUP BY lease_holder ORDER BY lease_holder";
const JOB_PAYLOAD: &str = "SELECT id, batch_id, version, prompt FROM jobs WHERE id = $1";
const ALL_ACTORS: &str = "SELECT id, region, hardware, active_version, staged_version, tau, \
     measured, latency_s, last_heartbeat, stalled_at FROM actors ORDER BY id";

fn version_record<R: Get>(r: &R) -> Result<VersionRecord, sqlx::Error> {
    Ok(VersionRecord {
        version: Version::from_db(r.i64("version")?)?,
        base: r.opt_i64("base")?.map(Version::from_db).transpose()?,
        digest: Digest::from_db(&r.bytes("digest")?)?,
        meta: r.string("meta")?,
        created_at: Timestamp::from_millis(r.i64("created_at")?),
    })
}

/// `(reason, n)` rows.
fn reason_counts<R: Get>(rows: &[R]) -> Result<Vec<(String, u64)>, sqlx::Error> {
    rows.iter()
        .map(|r| Ok((r.string("reason")?, u64::try_from(r.i64("n")?).unwrap_or(0))))
        .collect()
}

fn unscored_row<R: Get>(r: &R) -> Result<Unscored, sqlx::Error> {
    Ok(Unscored {
        job: JobId(r.i64("job_id")?),
        batch: BatchId(r.i64("batch_id")?),
        version: Version::from_db(r.i64("version")?)?,
        payload: r.bytes("payload")?,
        prompt: r.bytes("prompt")?,
    })
}

fn accepted<R: Get>(r: &R) -> Result<AcceptedResult, sqlx::Error> {
    Ok(AcceptedResult {
        cursor: r.i64("cursor")?,
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
        durably!(self, tx => {
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
            Ok(())
        })
    }

    /// The newest `limit` committed versions, newest first.
    pub async fn latest_versions(&self, limit: u32) -> Result<Vec<VersionRecord>, ReadError> {
        with_reader!(self, p => {
            let rows = sqlx::query(LATEST_VERSIONS)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?;
            Ok(rows.iter().map(version_record).collect::<Result<_, _>>()?)
        })
    }

    /// A value of the run's metadata.
    pub async fn run_meta(&self, key: &str) -> Result<Option<String>, ReadError> {
        with_reader!(self, p => {
            Ok(sqlx::query_scalar(META_GET).bind(key).fetch_optional(p).await?)
        })
    }

    /// Sets a value of the run's metadata.
    pub async fn set_run_meta(&self, key: &str, value: &str) -> Result<(), ReadError> {
        durably!(self, tx => {
            sqlx::query(META_SET).bind(key).bind(value).execute(&mut *tx).await?;
            Ok(())
        })
    }

    /// Batches posted but not yet scheduled (nor cancelled), oldest first.
    pub async fn unscheduled_batches(&self, limit: u32) -> Result<Vec<BatchId>, ReadError> {
        with_reader!(self, p => {
            let ids: Vec<i64> = sqlx::query_scalar(UNSCHEDULED)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?;
            Ok(ids.into_iter().map(BatchId).collect())
        })
    }

    /// A batch's progress (read off the writer, in one snapshot).
    pub async fn batch_status(&self, id: BatchId) -> Result<BatchStatus, ReadError> {
        with_reader!(self, p => {
            let mut tx = p.begin().await?;
            let row = sqlx::query(BATCH_STATUS)
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(ReadError::NotFound)?;
            let size = u64::try_from(row.i64("size")?).unwrap_or(0);
            let archive = match (row.opt_i64("archived_at")?, row.opt_string("archive")?) {
                (Some(at), Some(path)) => Some(Archive {
                    path,
                    at: Timestamp::from_millis(at),
                }),
                _ => None,
            };
            let (jobs, failures, scoring) = if archive.is_some() {
                let rows = sqlx::query(ARCHIVED_FAILURES)
                    .bind(id.0)
                    .fetch_all(&mut *tx)
                    .await?;
                let failures = reason_counts(&rows)?;
                let failed: u64 = failures.iter().map(|(_, n)| n).sum();
                let jobs = JobCounts {
                    done: size.saturating_sub(failed),
                    failed,
                    ..JobCounts::default()
                };
                (jobs, failures, 0)
            } else {
                let counts = sqlx::query(BATCH_JOB_COUNTS)
                    .bind(id.0)
                    .fetch_all(&mut *tx)
                    .await?;
                let rows = sqlx::query(BATCH_FAILURES)
                    .bind(id.0)
                    .fetch_all(&mut *tx)
                    .await?;
                let scoring: i64 = sqlx::query_scalar(BATCH_SCORING)
                    .bind(id.0)
                    .fetch_one(&mut *tx)
                    .await?;
                (
                    sql::job_counts(&counts)?,
                    reason_counts(&rows)?,
                    u64::try_from(scoring).unwrap_or(0),
                )
            };
            let refusals = sqlx::query(BATCH_REFUSALS)
                .bind(id.0)
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(BatchStatus {
                id,
                version: Version::from_db(row.i64("version")?)?,
                size: u32::try_from(size).unwrap_or(u32::MAX),
                max_staleness: u64::try_from(row.i64("max_staleness")?).unwrap_or(0),
                created_at: Timestamp::from_millis(row.i64("created_at")?),
                scheduled: row.opt_i64("scheduled_at")?.is_some(),
                cancelled_at: row.opt_i64("cancelled_at")?.map(Timestamp::from_millis),
                jobs,
                refusals: refusals
                    .iter()
                    .map(|r| Ok((r.string("reason")?, u64::try_from(r.i64("count")?).unwrap_or(0))))
                    .collect::<Result<_, sqlx::Error>>()?,
                failures,
                scoring,
                delivered_at: row.opt_i64("delivered_at")?.map(Timestamp::from_millis),
                archive,
            })
        })
    }

    /// Readable results of `batch` after `cursor`, in cursor order, at most `limit` (no
    /// bound in bytes; see [`Ledger::results_page`]).
    pub async fn results_after(
        &self,
        batch: BatchId,
        cursor: i64,
        limit: u32,
    ) -> Result<Vec<AcceptedResult>, ReadError> {
        Ok(self
            .results_page(batch, cursor, limit, u64::MAX)
            .await?
            .results)
    }

    /// Readable results of `batch` after `cursor`, in cursor order: at most `limit`, and no
    /// more than fit `max_bytes` of payload (always at least one). Sizes are read first and
    /// only the payloads that fit are loaded, so a page never holds more than `max_bytes`
    /// (plus one result) in memory. Nothing after the last result returned is skipped: a
    /// result that becomes readable later gets a greater cursor.
    pub async fn results_page(
        &self,
        batch: BatchId,
        cursor: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Result<ResultsPage, ReadError> {
        with_reader!(self, p => {
            let sizes = sqlx::query(RESULT_SIZES_AFTER)
                .bind(batch.0)
                .bind(cursor)
                .bind(i64::from(limit) + 1)
                .fetch_all(p)
                .await?;
            let sizes: Vec<(i64, u64)> = sizes
                .iter()
                .map(|r| Ok((r.i64("cursor")?, u64::try_from(r.i64("bytes")?).unwrap_or(0))))
                .collect::<Result<_, sqlx::Error>>()?;
            let take = page_len(&sizes, limit as usize, max_bytes);
            let Some(&(upto, _)) = sizes.get(take.wrapping_sub(1)) else {
                return Ok(ResultsPage::default());
            };
            let rows = sqlx::query(RESULTS_BETWEEN)
                .bind(batch.0)
                .bind(cursor)
                .bind(upto)
                .fetch_all(p)
                .await?;
            Ok(ResultsPage {
                results: rows.iter().map(accepted).collect::<Result<_, _>>()?,
                more: sizes.len() > take,
            })
        })
    }

    /// Cancels a batch: its unfinished jobs become failed (their leases end; results for them
    /// are refused as `Cancelled`). Returns how many jobs were cancelled, or `None` when the
    /// batch had already finished (every job done or failed and no result waiting for its
    /// reward service, or archived): then nothing changes and it is not marked cancelled.
    /// Whether it finished is decided inside the cancelling transaction, so a batch whose last
    /// group is accepted while it is cancelled is either cancelled with its open jobs or found
    /// finished. A batch with no open job but results waiting for their reward service is
    /// marked cancelled with 0 jobs. Two cancels racing are answered once with the count and
    /// once `AlreadyCancelled`: on PostgreSQL the batch row is locked first (on SQLite the
    /// transactions are serial), so the second waits for the first and finds it cancelled
    /// (before, it could find the jobs failed and answer "finished").
    pub async fn cancel_batch(
        &self,
        id: BatchId,
        now: Timestamp,
    ) -> Result<Option<u64>, CancelError> {
        let for_cancel = match self.backend() {
            Backend::Postgres => BATCH_FOR_CANCEL_LOCKED,
            Backend::Sqlite => BATCH_FOR_CANCEL,
        };
        durably!(self, tx => {
            let row = sqlx::query(for_cancel)
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(CancelError::UnknownBatch(id))?;
            if row.opt_i64("cancelled_at")?.is_some() {
                return Err(CancelError::AlreadyCancelled(id));
            }
            if row.opt_i64("archived_at")?.is_some() {
                return Ok(None);
            }
            // The open jobs first: each row is taken as it is when this statement runs (on
            // PostgreSQL after a concurrent submit that holds it commits), so `n` counts
            // exactly the jobs this cancels.
            let n = sqlx::query(CANCEL_JOBS)
                .bind(id.0)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if n == 0 {
                let scoring: i64 = sqlx::query_scalar(BATCH_SCORING)
                    .bind(id.0)
                    .fetch_one(&mut *tx)
                    .await?;
                if scoring == 0 {
                    // Nothing was open and nothing waits: finished. Nothing was written.
                    return Ok(None);
                }
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
            Ok(Some(n))
        })
    }

    /// The prompt payloads of jobs (unknown ids are left out).
    pub async fn job_payloads(&self, jobs: &[JobId]) -> Result<Vec<JobPayload>, ReadError> {
        with_reader!(self, p => {
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
        with_reader!(self, p => {
            let rows = sqlx::query(RECENT_BATCHES).bind(i64::from(limit)).fetch_all(p).await?;
            rows.iter().map(|r| Ok(BatchId(r.i64("id")?))).collect()
        })
    }

    /// How many jobs each actor holds a lease on now (actors holding none are left out).
    pub async fn leases_by_actor(&self) -> Result<Vec<(ActorId, u64)>, ReadError> {
        with_reader!(self, p => {
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
        with_reader!(self, p => {
            let rows = sqlx::query(ALL_ACTORS).fetch_all(p).await?;
            rows.iter().map(sql::actor_info).collect()
        })
    }

    /// Number of jobs per state, over the jobs the ledger holds (archived batches' are
    /// gone). Indexed: open and failed jobs are counted through partial indexes and `done`
    /// is the rest of the `jobs` counter, so the cost follows the open work, not the run's
    /// length; and it reads off the writer, in one snapshot.
    pub async fn job_counts(&self) -> Result<JobCounts, ReadError> {
        with_reader!(self, p => {
            let mut tx = p.begin().await?;
            let total: i64 = sqlx::query_scalar(sql::COUNTER)
                .bind(sql::COUNTER_JOBS)
                .fetch_one(&mut *tx)
                .await?;
            let open = sqlx::query(OPEN_JOB_COUNTS).fetch_all(&mut *tx).await?;
            let failed: i64 = sqlx::query_scalar(FAILED_JOBS).fetch_one(&mut *tx).await?;
            tx.commit().await?;
            let mut c = sql::job_counts(&open)?;
            c.failed = u64::try_from(failed).unwrap_or(0);
            let total = u64::try_from(total).unwrap_or(0);
            c.done = total.saturating_sub(c.posted + c.pending + c.leased + c.failed);
            Ok(c)
        })
    }

    /// Accepted results waiting for their reward service, oldest first, at most `limit`.
    pub async fn unscored(&self, limit: u32) -> Result<Vec<Unscored>, ReadError> {
        with_reader!(self, p => {
            let rows = sqlx::query(UNSCORED).bind(i64::from(limit)).fetch_all(p).await?;
            Ok(rows.iter().map(unscored_row).collect::<Result<_, _>>()?)
        })
    }

    /// The jobs whose accepted result waits for its reward service, oldest first, at most
    /// `limit` (ids only: cheap to list past the ones a scorer is waiting to try again).
    pub async fn unscored_jobs(&self, limit: u32) -> Result<Vec<JobId>, ReadError> {
        with_reader!(self, p => {
            let ids: Vec<i64> = sqlx::query_scalar(UNSCORED_JOBS)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?;
            Ok(ids.into_iter().map(JobId).collect())
        })
    }

    /// The results of `jobs` that wait for their reward service, in the order asked (jobs
    /// with none waiting are left out).
    pub async fn unscored_of(&self, jobs: &[JobId]) -> Result<Vec<Unscored>, ReadError> {
        with_reader!(self, p => {
            let mut out = Vec::with_capacity(jobs.len());
            for j in jobs {
                if let Some(r) = sqlx::query(UNSCORED_JOB).bind(j.0).fetch_optional(p).await? {
                    out.push(unscored_row(&r)?);
                }
            }
            Ok(out)
        })
    }

    /// Stores the scored `payload` of a result that waited for its reward service and makes
    /// it readable, with the next cursor (durable before it returns). Returns the cursor, or
    /// `None` when the job has no result waiting (scored before, or failed).
    pub async fn score(&self, job: JobId, payload: &[u8]) -> Result<Option<i64>, ScoreError> {
        if payload.len() > self.config.max_result_bytes {
            return Err(ScoreError::PayloadTooLarge(payload.len()));
        }
        durably!(self, tx => {
            let waiting: i64 = sqlx::query_scalar(UNSCORED_OF_JOB)
                .bind(job.0)
                .fetch_one(&mut *tx)
                .await?;
            if waiting == 0 {
                return Ok(None);
            }
            let cursor: i64 = sqlx::query_scalar(sql::ADD_COUNTER)
                .bind(sql::COUNTER_CURSOR)
                .bind(1i64)
                .fetch_one(&mut *tx)
                .await?;
            sqlx::query(SCORE_RESULT)
                .bind(job.0)
                .bind(payload)
                .bind(cursor)
                .execute(&mut *tx)
                .await?;
            Ok(Some(cursor))
        })
    }

    /// Fails a done job whose result waits for scoring (its reward service failed): the
    /// result is dropped (it was never readable) and the job counts as failed with
    /// `reason`. Returns whether there was such a result.
    pub async fn fail_scoring(&self, job: JobId, reason: &str) -> Result<bool, ScoreError> {
        durably!(self, tx => {
            let dropped = sqlx::query(DROP_UNSCORED)
                .bind(job.0)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if dropped == 0 {
                return Ok(false);
            }
            sqlx::query(FAIL_DONE_JOB)
                .bind(job.0)
                .bind(reason)
                .execute(&mut *tx)
                .await?;
            Ok(true)
        })
    }

    /// Records that the trainer read `batch`'s results to the end (its last page said
    /// `done`): from then on retention may archive it. Idempotent.
    pub async fn mark_delivered(&self, batch: BatchId, now: Timestamp) -> Result<(), ReadError> {
        with_pool!(self, p => {
            sqlx::query(MARK_DELIVERED).bind(batch.0).bind(now.millis()).execute(p).await?;
            Ok(())
        })
    }
}

/// How many of the first rows (cursor, payload bytes) a page takes: at most `limit`, within
/// `max_bytes` of payload, and at least one.
pub(crate) fn page_len(sizes: &[(i64, u64)], limit: usize, max_bytes: u64) -> usize {
    let mut bytes = 0u64;
    let mut n = 0;
    for &(_, b) in sizes.iter().take(limit) {
        bytes = bytes.saturating_add(b);
        if n > 0 && bytes > max_bytes {
            break;
        }
        n += 1;
    }
    n
}

const BATCH_FOR_CANCEL: &str = "SELECT cancelled_at, archived_at FROM batches WHERE id = $1";
/// PostgreSQL's: the batch row locked for the transaction, before its jobs (the order
/// scheduling takes too), so two cancels of one batch run one after the other. `NO KEY
/// UPDATE`, the lock an `UPDATE batches` takes anyway: a submit that holds its job rows and
/// inserts a result or a refusal takes `KEY SHARE` on the batch row for the foreign key,
/// which `FOR UPDATE` would block, deadlocking with this cancel waiting on those jobs.
const BATCH_FOR_CANCEL_LOCKED: &str =
    "SELECT cancelled_at, archived_at FROM batches WHERE id = $1 FOR NO KEY UPDATE";

#[cfg(test)]
mod tests {
    use super::page_len;

    #[test]
    fn a_page_holds_what_fits_and_at_least_one() {
        let rows = [(1, 400), (2, 400), (3, 400), (4, 10)];
        assert_eq!(page_len(&rows, 10, 1_000), 2);
        assert_eq!(page_len(&rows, 1, 1_000), 1);
        assert_eq!(
            page_len(&rows, 10, 100),
            1,
            "one even when it alone is too big"
        );
        assert_eq!(page_len(&rows, 10, u64::MAX), 4);
        assert_eq!(page_len(&[], 10, 1_000), 0);
        assert_eq!(page_len(&rows, 0, 1_000), 0);
    }
}
