//! The SQLite backend: one file in WAL mode with `synchronous = NORMAL` (a committed
//! transaction survives a process crash; only an OS crash or power loss may lose the last
//! ones), foreign keys on, a busy timeout for other processes.
//!
//! All statements go through a pool of exactly one connection and every state change runs in
//! a `BEGIN IMMEDIATE` transaction: SQLite has one writer anyway, and a single connection
//! avoids lock upgrades between readers and writers inside the process, so the read-check-write
//! sequences of claim and submit are serialized and see a stable database. Id lists are
//! bound as one JSON array and expanded with `json_each`, so batched operations are a
//! handful of statements whatever the batch size.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

use crate::error::*;
use crate::ids::{ActorId, BatchId, Digest, JobId, Timestamp, Version};
use crate::invariants::{InvariantError, InvariantViolation, RULES};
use crate::model::*;
use crate::schedule;
use crate::sql;

#[derive(Debug, Clone)]
pub(crate) struct SqliteStore {
    pool: SqlitePool,
}

fn id_list(ids: impl IntoIterator<Item = i64>) -> String {
    let mut s = String::from("[");
    for (i, id) in ids.into_iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&id.to_string());
    }
    s.push(']');
    s
}

impl SqliteStore {
    pub(crate) async fn open(url: &str) -> Result<SqliteStore, OpenError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(OpenError::Connect)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(120))
            .connect_with(options)
            .await
            .map_err(OpenError::Connect)?;
        sqlx::migrate!("./migrations/sqlite").run(&pool).await?;
        Ok(SqliteStore { pool })
    }

    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }

    pub(crate) async fn recent_completions(&self, n: usize) -> Result<Vec<i64>, sqlx::Error> {
        let rows = sqlx::query(sql::RECENT_COMPLETIONS)
            .bind(i64::try_from(n).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(|r| r.try_get::<i64, _>(0)).collect()
    }

    pub(crate) async fn register_version(
        &self,
        version: Version,
        base: Option<Version>,
        digest: Digest,
        now: Timestamp,
    ) -> Result<(), VersionError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let existing = sqlx::query(sql::VERSION_BY_ID)
            .bind(version.to_db())
            .fetch_optional(&mut *tx)
            .await?;
        if let Some(row) = existing {
            let same_base = row.try_get::<Option<i64>, _>("base")? == base.map(Version::to_db);
            let same_digest = row.try_get::<Vec<u8>, _>("digest")? == digest.0;
            return if same_base && same_digest {
                Ok(())
            } else {
                Err(VersionError::Conflict(version))
            };
        }
        if let Some(b) = base {
            let found = sqlx::query(sql::VERSION_BY_ID)
                .bind(b.to_db())
                .fetch_optional(&mut *tx)
                .await?;
            if found.is_none() {
                return Err(VersionError::UnknownBase(b));
            }
        }
        sqlx::query(sql::INSERT_VERSION)
            .bind(version.to_db())
            .bind(base.map(Version::to_db))
            .bind(&digest.0[..])
            .bind(now.millis())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn commit_version(
        &self,
        version: Version,
        now: Timestamp,
    ) -> Result<(), VersionError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let done = sqlx::query(sql::COMMIT_VERSION)
            .bind(version.to_db())
            .bind(now.millis())
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            let found = sqlx::query(sql::VERSION_BY_ID)
                .bind(version.to_db())
                .fetch_optional(&mut *tx)
                .await?;
            if found.is_none() {
                return Err(VersionError::UnknownVersion(version));
            }
        }
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn register_actor(
        &self,
        id: &ActorId,
        region: &str,
        hardware: &str,
        tau: f64,
        now: Timestamp,
    ) -> Result<(), ActorError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query(sql::UPSERT_ACTOR)
            .bind(id.as_str())
            .bind(region)
            .bind(hardware)
            .bind(tau)
            .bind(now.millis())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn heartbeat(
        &self,
        id: &ActorId,
        active: Option<Version>,
        staged: Option<Version>,
        now: Timestamp,
    ) -> Result<(), ActorError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let done = sqlx::query(sql::HEARTBEAT)
            .bind(id.as_str())
            .bind(active.map(Version::to_db))
            .bind(staged.map(Version::to_db))
            .bind(now.millis())
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            return Err(ActorError::UnknownActor(id.clone()));
        }
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn post_batch(
        &self,
        version: Version,
        prompts: &[Vec<u8>],
        sampling: &str,
        max_staleness: i64,
        now: Timestamp,
    ) -> Result<BatchId, PostError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let state: Option<String> = sqlx::query_scalar(sql::VERSION_STATE)
            .bind(version.to_db())
            .fetch_optional(&mut *tx)
            .await?;
        match state.as_deref() {
            None => return Err(PostError::UnknownVersion(version)),
            Some("committed") => {}
            Some(_) => return Err(PostError::NotCommitted(version)),
        }
        let size = i64::try_from(prompts.len()).unwrap_or(i64::MAX);
        let batch: i64 = sqlx::query_scalar(sql::INSERT_BATCH)
            .bind(version.to_db())
            .bind(size)
            .bind(sampling)
            .bind(now.millis())
            .bind(max_staleness)
            .fetch_one(&mut *tx)
            .await?;
        for p in prompts {
            sqlx::query(sql::INSERT_JOB)
                .bind(batch)
                .bind(version.to_db())
                .bind(&p[..])
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(BatchId(batch))
    }

    pub(crate) async fn schedule(
        &self,
        batch: BatchId,
        now: Timestamp,
        alpha: f64,
        actor_timeout: Duration,
        split: schedule::Split,
    ) -> Result<Assignment, ScheduleError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let row = sqlx::query(sql::BATCH_BY_ID)
            .bind(batch.0)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Err(ScheduleError::UnknownBatch(batch));
        };
        if row.try_get::<Option<i64>, _>("scheduled_at")?.is_some() {
            return Err(ScheduleError::AlreadyScheduled(batch));
        }
        let version = Version::from_db(row.try_get("version")?)?;
        let size = u32::try_from(row.try_get::<i64, _>("size")?)
            .map_err(|_| sqlx::Error::Decode("batch size out of range".into()))?;
        let rows = sqlx::query(sql::ACTORS_FOR_SCHEDULE)
            .fetch_all(&mut *tx)
            .await?;
        let actors = sql::actor_states(&rows, now, actor_timeout)?;
        let plan = schedule::plan(version, size, &actors, alpha, split)?;
        for (id, tau) in &plan.decayed {
            sqlx::query(sql::SET_TAU)
                .bind(id.as_str())
                .bind(*tau)
                .execute(&mut *tx)
                .await?;
        }
        for share in &plan.shares {
            if share.count > 0 {
                sqlx::query(sql::ASSIGN_JOBS)
                    .bind(share.actor.as_str())
                    .bind(batch.0)
                    .bind(i64::from(share.count))
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query(sql::INSERT_ASSIGNMENT)
                .bind(batch.0)
                .bind(share.actor.as_str())
                .bind(i64::from(share.count))
                .bind(share.commit.then_some(version.to_db()))
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(sql::MARK_SCHEDULED)
            .bind(batch.0)
            .bind(now.millis())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(sql::assignment(batch, version, plan))
    }

    pub(crate) async fn claim(
        &self,
        actor: &ActorId,
        max: usize,
        now: Timestamp,
        lease: Duration,
    ) -> Result<Vec<ClaimedJob>, ClaimError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let active: Option<Option<i64>> = sqlx::query_scalar(sql::ACTOR_ACTIVE)
            .bind(actor.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(active) = active else {
            return Err(ClaimError::UnknownActor(actor.clone()));
        };
        let expires = now.plus(lease);
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let mut rows = sqlx::query(SQLITE_CLAIM_ASSIGNED)
            .bind(actor.as_str())
            .bind(now.millis())
            .bind(expires.millis())
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        if let (Some(active), true) = (active, rows.len() < max) {
            let more = sqlx::query(SQLITE_CLAIM_OPEN)
                .bind(actor.as_str())
                .bind(now.millis())
                .bind(expires.millis())
                .bind(limit - rows.len() as i64)
                .bind(active)
                .fetch_all(&mut *tx)
                .await?;
            rows.extend(more);
        }
        let jobs = sql::claimed_jobs(&rows, expires)?;
        tx.commit().await?;
        Ok(jobs)
    }

    pub(crate) async fn renew(
        &self,
        actor: &ActorId,
        jobs: &[JobId],
        now: Timestamp,
        lease: Duration,
    ) -> Result<RenewReport, RenewError> {
        let expires = now.plus(lease);
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let renewed: Vec<i64> = sqlx::query_scalar(SQLITE_RENEW)
            .bind(actor.as_str())
            .bind(now.millis())
            .bind(expires.millis())
            .bind(id_list(jobs.iter().map(|j| j.0)))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(sql::renew_report(jobs, renewed, expires))
    }

    pub(crate) async fn expire(
        &self,
        now: Timestamp,
        max_attempts: u32,
        limit: usize,
        actor_timeout: Duration,
    ) -> Result<ExpireReport, ExpireError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let states: Vec<String> = sqlx::query_scalar(SQLITE_EXPIRE)
            .bind(now.millis())
            .bind(i64::from(max_attempts))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
        let released = sqlx::query(sql::RELEASE_SILENT)
            .bind(now.minus(actor_timeout).millis())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(sql::expire_report(&states, released))
    }

    /// Returns the verdicts and, for accepted results, the observed completion times.
    pub(crate) async fn submit(
        &self,
        actor: &ActorId,
        results: &[ResultSubmission],
        now: Timestamp,
        beta: f64,
    ) -> Result<(Vec<SubmitOutcome>, Vec<Duration>), SubmitError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let tau: Option<f64> = sqlx::query_scalar(sql::ACTOR_TAU)
            .bind(actor.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(tau) = tau else {
            return Err(SubmitError::UnknownActor(actor.clone()));
        };
        let rows = sqlx::query(SQLITE_SUBMIT_ROWS)
            .bind(id_list(results.iter().map(|r| r.job.0)))
            .fetch_all(&mut *tx)
            .await?;
        let rows = sql::job_rows(&rows)?;
        let named = sqlx::query(sql::COMMITTED_FROM)
            .bind(sql::oldest_named(results))
            .fetch_all(&mut *tx)
            .await?;
        let latest: Option<i64> = sqlx::query_scalar(sql::LATEST_COMMITTED)
            .fetch_one(&mut *tx)
            .await?;
        let committed = sql::committed(&named, latest)?;
        let decided = sql::decide(&rows, &committed, results, actor, now, tau, beta);
        for (batch, reason, n) in sql::refusal_counts(&rows, &decided.outcomes) {
            sqlx::query(sql::COUNT_REFUSALS)
                .bind(batch)
                .bind(reason)
                .bind(n)
                .execute(&mut *tx)
                .await?;
        }
        // Multi-row INSERTs: one statement per 256 results (2,560 parameters, far below
        // SQLite's limit of 32,766).
        for chunk in decided.accepted.chunks(256) {
            let mut insert = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
                "INSERT INTO results (job_id, actor_id, version, digest, tokens, elapsed_ms, \
                 completion_ms, payload, accepted_at, batch_id) ",
            );
            insert.push_values(chunk, |mut b, (sub, row)| {
                b.push_bind(sub.job.0)
                    .push_bind(actor.as_str())
                    .push_bind(sub.version.to_db())
                    .push_bind(&sub.digest.0[..])
                    .push_bind(i64::from(sub.tokens))
                    .push_bind(crate::ids::duration_millis(sub.elapsed))
                    .push_bind(
                        now.millis()
                            .saturating_sub(row.leased_at.unwrap_or(now.millis()))
                            .max(0),
                    )
                    .push_bind(&sub.payload[..])
                    .push_bind(now.millis())
                    .push_bind(row.batch);
            });
            insert.build().execute(&mut *tx).await?;
        }
        if !decided.accepted.is_empty() {
            let done = sqlx::query(SQLITE_MARK_DONE)
                .bind(actor.as_str())
                .bind(now.millis())
                .bind(id_list(decided.accepted.iter().map(|(s, _)| s.job.0)))
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() != decided.accepted.len() as u64 {
                return Err(SubmitError::Conflict);
            }
            sqlx::query(sql::SET_TAU)
                .bind(actor.as_str())
                .bind(decided.tau)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok((decided.outcomes, decided.completions))
    }

    pub(crate) async fn check_invariants(&self, max_attempts: u32) -> Result<(), InvariantError> {
        let mut tx = self.pool.begin().await?;
        let mut bad = Vec::new();
        for (rule, query) in RULES {
            let rows: i64 = sqlx::query_scalar(*query)
                .bind(i64::from(max_attempts))
                .fetch_one(&mut *tx)
                .await?;
            if rows != 0 {
                bad.push(InvariantViolation { rule, rows });
            }
        }
        tx.commit().await?;
        if bad.is_empty() {
            Ok(())
        } else {
            Err(InvariantError::Violated(bad))
        }
    }

    pub(crate) async fn actor(&self, id: &ActorId) -> Result<ActorInfo, ReadError> {
        let row = sqlx::query(sql::ACTOR_BY_ID)
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await?;
        sql::actor_info(row.as_ref().ok_or(ReadError::NotFound)?)
    }

    pub(crate) async fn batch(&self, id: BatchId) -> Result<BatchInfo, ReadError> {
        let row = sqlx::query(sql::BATCH_BY_ID)
            .bind(id.0)
            .fetch_optional(&self.pool)
            .await?;
        sql::batch_info(id, row.as_ref().ok_or(ReadError::NotFound)?)
    }

    pub(crate) async fn job(&self, id: JobId) -> Result<JobView, ReadError> {
        let row = sqlx::query(sql::JOB_VIEW)
            .bind(id.0)
            .fetch_optional(&self.pool)
            .await?;
        sql::job_view(row.as_ref().ok_or(ReadError::NotFound)?)
    }

    pub(crate) async fn version_state(&self, v: Version) -> Result<VersionState, ReadError> {
        let s: Option<String> = sqlx::query_scalar(sql::VERSION_STATE)
            .bind(v.to_db())
            .fetch_optional(&self.pool)
            .await?;
        sql::version_state(s.as_deref().ok_or(ReadError::NotFound)?)
    }

    pub(crate) async fn job_counts(&self) -> Result<JobCounts, ReadError> {
        let rows = sqlx::query(sql::JOB_COUNTS).fetch_all(&self.pool).await?;
        sql::job_counts(&rows)
    }

    pub(crate) async fn assignment(
        &self,
        batch: BatchId,
    ) -> Result<Vec<ActorAssignment>, ReadError> {
        let rows = sqlx::query(sql::ASSIGNMENTS_OF_BATCH)
            .bind(batch.0)
            .fetch_all(&self.pool)
            .await?;
        sql::assignments(&rows)
    }
}

const SQLITE_CLAIM_ASSIGNED: &str = "UPDATE jobs SET state = 'leased', assignee = NULL, lease_holder = $1, \
     leased_at = $2, lease_expires = $3, attempts = attempts + 1 \
     WHERE id IN (SELECT id FROM jobs WHERE state = 'pending' AND assignee = $1 ORDER BY id LIMIT $4) \
     RETURNING id, batch_id, version, prompt, attempts";

const SQLITE_CLAIM_OPEN: &str = "UPDATE jobs SET state = 'leased', lease_holder = $1, \
     leased_at = $2, lease_expires = $3, attempts = attempts + 1 \
     WHERE id IN (SELECT id FROM jobs WHERE state = 'pending' AND assignee IS NULL AND version <= $5 ORDER BY id LIMIT $4) \
     RETURNING id, batch_id, version, prompt, attempts";

const SQLITE_RENEW: &str = "UPDATE jobs SET lease_expires = max(lease_expires, $3) \
     WHERE id IN (SELECT value FROM json_each($4)) AND state = 'leased' AND lease_holder = $1 AND lease_expires >= $2 \
     RETURNING id";

const SQLITE_EXPIRE: &str = "UPDATE jobs SET state = CASE WHEN attempts >= $2 THEN 'failed' ELSE 'pending' END, \
     lease_holder = NULL, leased_at = NULL, lease_expires = NULL \
     WHERE id IN (SELECT id FROM jobs WHERE state = 'leased' AND lease_expires < $1 ORDER BY lease_expires LIMIT $3) \
     RETURNING state";

const SQLITE_SUBMIT_ROWS: &str = "SELECT j.id, j.state, j.attempts, j.version, j.lease_holder, j.leased_at, \
     j.lease_expires, j.batch_id, b.max_staleness, b.cancelled_at FROM jobs j JOIN batches b ON b.id = j.batch_id \
     WHERE j.id IN (SELECT value FROM json_each($1))";

const SQLITE_MARK_DONE: &str = "UPDATE jobs SET state = 'done', lease_holder = NULL, leased_at = NULL, \
     lease_expires = NULL, done_at = $2 \
     WHERE id IN (SELECT value FROM json_each($3)) AND state = 'leased' AND lease_holder = $1";
