//! The SQLite backend: one file in WAL mode, foreign keys on, a busy timeout for other
//! processes.
//!
//! Durability per transaction: a transaction whose outcome someone is told about — a version
//! recorded before it is announced, a batch before its id is answered, a submit before its
//! verdicts, a result made readable, a cancellation — commits with `synchronous = FULL`
//! ([`SqliteStore::durably`]): the WAL is fsynced before the commit returns (and before other
//! connections can see it), so it survives a power loss, and so does every transaction
//! before it in the WAL. Heartbeats, claims, renewals and expiry sweeps commit with
//! `synchronous = NORMAL` (survive a process crash; a power loss may lose the last of them):
//! losing one wastes work but accepts nothing wrongly, since acceptance needs the lease in
//! the ledger, and they are the most frequent writes (one heartbeat per actor per second).
//!
//! All writes go through a pool of exactly one connection and every state change runs in a
//! `BEGIN IMMEDIATE` transaction: SQLite has one writer anyway, and a single connection
//! avoids lock upgrades between readers and writers inside the process, so the read-check-write
//! sequences of claim and submit are serialized and see a stable database. Reads that serve
//! people (status, result pages, version lists) go through a separate pool of read-only
//! connections ([`SqliteStore::reader`]): WAL readers see the last commit and neither wait
//! for the writer nor hold it up. Id lists are bound as one JSON array and expanded with
//! `json_each`, so batched operations are a handful of statements whatever the batch size.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Row, SqlitePool};

use std::collections::{BTreeSet, HashMap};

use crate::config::LeaseConfig;
use crate::error::*;
use crate::ids::{ActorId, BatchId, Digest, JobId, Session, Timestamp, Version};
use crate::invariants::{InvariantError, InvariantViolation, RULES};
use crate::lease::{self, ProgressRow};
use crate::model::*;
use crate::schedule;
use crate::sql::{self, Get};

#[derive(Debug, Clone)]
pub(crate) struct SqliteStore {
    pool: SqlitePool,
    reader: SqlitePool,
}

/// Read-only connections for status and result reads.
const READERS: u32 = 4;

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
        let base = SqliteConnectOptions::from_str(url).map_err(OpenError::Connect)?;
        let options = base
            .clone()
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
        // An in-memory database is private to its connection: read through the writer.
        let reader = if url.contains(":memory:") || url.contains("mode=memory") {
            pool.clone()
        } else {
            SqlitePoolOptions::new()
                .max_connections(READERS)
                .min_connections(0)
                .acquire_timeout(Duration::from_secs(120))
                .connect_with(
                    base.read_only(true)
                        .busy_timeout(Duration::from_secs(10))
                        .foreign_keys(true),
                )
                .await
                .map_err(OpenError::Connect)?
        };
        Ok(SqliteStore { pool, reader })
    }

    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The read-only pool: reads that need no writer and must not wait for one.
    pub(crate) fn reader(&self) -> &SqlitePool {
        &self.reader
    }

    pub(crate) async fn close(&self) {
        self.reader.close().await;
        self.pool.close().await;
    }

    /// Runs `body` in one `BEGIN IMMEDIATE` transaction on the writer and commits it with
    /// `synchronous = FULL` (see the module documentation); rolls back when `body` fails.
    /// The connection goes back to `NORMAL` afterwards (left at `FULL` only if the reset
    /// itself fails or the caller is cancelled, which costs speed, never safety).
    pub(crate) async fn durably<T, E: From<sqlx::Error>>(
        &self,
        body: impl AsyncFnOnce(&mut SqliteConnection) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut conn = self.pool.acquire().await?;
        sqlx::query("PRAGMA synchronous = FULL")
            .execute(&mut *conn)
            .await?;
        let out = {
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            match body(&mut tx).await {
                Ok(v) => {
                    tx.commit().await?;
                    Ok(v)
                }
                Err(e) => Err(e),
            }
        };
        sqlx::query("PRAGMA synchronous = NORMAL")
            .execute(&mut *conn)
            .await?;
        out
    }

    pub(crate) async fn register_version(
        &self,
        version: Version,
        base: Option<Version>,
        digest: Digest,
        now: Timestamp,
    ) -> Result<(), VersionError> {
        self.durably(async |tx| {
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
            Ok(())
        })
        .await
    }

    pub(crate) async fn commit_version(
        &self,
        version: Version,
        now: Timestamp,
    ) -> Result<(), VersionError> {
        self.durably(async |tx| {
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
            Ok(())
        })
        .await
    }

    pub(crate) async fn register_actor(
        &self,
        id: &ActorId,
        region: &str,
        hardware: &str,
        tau: f64,
        now: Timestamp,
    ) -> Result<Session, ActorError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let session: i64 = sqlx::query_scalar(sql::UPSERT_ACTOR)
            .bind(id.as_str())
            .bind(region)
            .bind(hardware)
            .bind(tau)
            .bind(now.millis())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Session(session))
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
        budgets: &[u64],
        sampling: &str,
        max_staleness: i64,
        now: Timestamp,
    ) -> Result<BatchId, PostError> {
        self.durably(async |tx| {
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
            for (p, budget) in prompts.iter().zip(budgets) {
                sqlx::query(sql::INSERT_JOB)
                    .bind(batch)
                    .bind(version.to_db())
                    .bind(&p[..])
                    .bind(i64::try_from(*budget).unwrap_or(i64::MAX))
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query(sql::ADD_COUNTER)
                .bind(sql::COUNTER_JOBS)
                .bind(size)
                .execute(&mut *tx)
                .await?;
            Ok(BatchId(batch))
        })
        .await
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
        limit: ClaimLimit,
        now: Timestamp,
        lease: &LeaseConfig,
        max_gap: Duration,
    ) -> Result<Vec<ClaimedJob>, ClaimError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let row = sqlx::query(sql::ACTOR_FOR_CLAIM)
            .bind(actor.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Err(ClaimError::UnknownActor(actor.clone()));
        };
        let who = sql::claiming_actor(&row)?;
        let held = sqlx::query(sql::HELD_BUDGET)
            .bind(actor.as_str())
            .fetch_one(&mut *tx)
            .await?;
        let held_before = u64::try_from(held.i64("n")?).unwrap_or(0);
        // A placeholder expiry, set for real below once the held budget is known.
        let expires = now.plus(lease.initial);
        let max = limit.max;
        let session = limit.session.map_or(who.session, Session::raw);
        let bytes = sql::ClaimBytes::of(limit);
        let mut rows = Vec::new();
        if let (Some(runnable), true) = (who.runnable, max > 0) {
            rows = sqlx::query(SQLITE_CLAIM_ASSIGNED)
                .bind(actor.as_str())
                .bind(now.millis())
                .bind(expires.millis())
                .bind(i64::try_from(max).unwrap_or(i64::MAX))
                .bind(runnable)
                .bind(session)
                .bind(bytes.budget)
                .bind(bytes.per_job)
                .bind(true)
                .fetch_all(&mut *tx)
                .await?;
            let left = bytes.left_after(&rows)?;
            if rows.len() < max && held_before == 0 && (left > 0 || rows.is_empty()) {
                let more = sqlx::query(SQLITE_CLAIM_OPEN)
                    .bind(actor.as_str())
                    .bind(now.millis())
                    .bind(expires.millis())
                    .bind(i64::try_from(max - rows.len()).unwrap_or(i64::MAX))
                    .bind(runnable)
                    .bind(session)
                    .bind(left)
                    .bind(bytes.per_job)
                    .bind(rows.is_empty())
                    .fetch_all(&mut *tx)
                    .await?;
                rows.extend(more);
            }
        }
        let mut jobs = sql::claimed_jobs(&rows, expires)?;
        if !jobs.is_empty() {
            let budget: i64 = sqlx::query(sql::HELD_BUDGET)
                .bind(actor.as_str())
                .fetch_one(&mut *tx)
                .await?
                .i64("budget")?;
            let length = lease::at_claim(
                u64::try_from(budget).unwrap_or(0),
                who.tau,
                who.measured,
                lease,
            );
            let expires = now.plus(length);
            sqlx::query(SQLITE_SET_EXPIRY)
                .bind(expires.millis())
                .bind(id_list(jobs.iter().map(|j| j.id.0)))
                .execute(&mut *tx)
                .await?;
            for j in &mut jobs {
                j.lease_expires = expires;
            }
            let batches: BTreeSet<i64> = jobs.iter().map(|j| j.batch.0).collect();
            for b in batches {
                sqlx::query(sql::TOUCH_ASSIGNMENT)
                    .bind(b)
                    .bind(actor.as_str())
                    .bind(now.millis())
                    .execute(&mut *tx)
                    .await?;
            }
        }
        let interval =
            schedule::interval_after_claim(who.busy, held_before, jobs.len(), now, max_gap);
        sqlx::query(sql::ACTOR_CLAIMED)
            .bind(actor.as_str())
            .bind(interval.map(|i| i.since.millis()))
            .bind(i64::from(interval.is_some_and(|i| i.fresh)))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(jobs)
    }

    pub(crate) async fn progress(
        &self,
        actor: &ActorId,
        jobs: &[(JobId, u64)],
        now: Timestamp,
        lease: &LeaseConfig,
    ) -> Result<ProgressReport, ProgressError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows = sqlx::query(SQLITE_PROGRESS_ROWS)
            .bind(id_list(jobs.iter().map(|(j, _)| j.0)))
            .fetch_all(&mut *tx)
            .await?;
        let rows: HashMap<i64, ProgressRow> = rows
            .iter()
            .map(|r| sql::progress_row(r, actor, now))
            .collect::<Result<_, _>>()?;
        let (extensions, report) = lease::on_progress(now, jobs, &rows, lease);
        for (job, expires, tokens) in extensions {
            sqlx::query(sql::EXTEND_LEASE)
                .bind(job.0)
                .bind(expires.millis())
                .bind(i64::try_from(tokens).unwrap_or(i64::MAX))
                .bind(now.millis())
                .bind(actor.as_str())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(report)
    }

    pub(crate) async fn release(
        &self,
        actor: &ActorId,
        session: Session,
        _now: Timestamp,
        max_attempts: u32,
    ) -> Result<ReleaseReport, ReleaseError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let states: Vec<String> = sqlx::query_scalar(sql::RELEASE_SESSION)
            .bind(actor.as_str())
            .bind(session.0)
            .bind(i64::from(max_attempts))
            .fetch_all(&mut *tx)
            .await?;
        let newest: Option<i64> = sqlx::query_scalar(sql::ACTOR_SESSION)
            .bind(actor.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let mut unassigned = 0;
        if newest == Some(session.0) {
            unassigned = sqlx::query(sql::UNASSIGN_ACTOR)
                .bind(actor.as_str())
                .execute(&mut *tx)
                .await?
                .rows_affected();
            sqlx::query(sql::ACTOR_IDLE)
                .bind(actor.as_str())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(sql::release_report(&states, unassigned))
    }

    pub(crate) async fn release_others(
        &self,
        actor: &ActorId,
        keep: Session,
        max_attempts: u32,
    ) -> Result<ReleaseReport, ReleaseError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let states: Vec<String> = sqlx::query_scalar(sql::RELEASE_OTHER_SESSIONS)
            .bind(actor.as_str())
            .bind(keep.0)
            .bind(i64::from(max_attempts))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(sql::release_report(&states, 0))
    }

    pub(crate) async fn expire(
        &self,
        now: Timestamp,
        max_attempts: u32,
        limit: usize,
        actor_timeout: Duration,
        claim_cutoff: Timestamp,
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
        sqlx::query(sql::MARK_STALLED)
            .bind(claim_cutoff.millis())
            .bind(now.millis())
            .execute(&mut *tx)
            .await?;
        let unclaimed = sqlx::query(sql::RELEASE_UNCLAIMED)
            .bind(claim_cutoff.millis())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(sql::expire_report(&states, released, unclaimed))
    }

    pub(crate) async fn submit(
        &self,
        actor: &ActorId,
        call: SubmitCall<'_>,
        now: Timestamp,
        beta: f64,
        max_attempts: u32,
    ) -> Result<Vec<SubmitOutcome>, SubmitError> {
        let results = call.results;
        self.durably(async |tx| {
            let who = sqlx::query(sql::ACTOR_TAU)
                .bind(actor.as_str())
                .fetch_optional(&mut *tx)
                .await?;
            let Some(who) = who else {
                return Err(SubmitError::UnknownActor(actor.clone()));
            };
            let who = sql::settling_actor(&who)?;
            let rows = sqlx::query(SQLITE_SUBMIT_ROWS)
                .bind(id_list(sql::submit_ids(&call)))
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
            let decided = sql::decide(&rows, &committed, results, actor, now);
            for (batch, reason, n) in sql::refusal_counts(&rows, &decided.outcomes, call.refused) {
                sqlx::query(sql::COUNT_REFUSALS)
                    .bind(batch)
                    .bind(reason)
                    .bind(n)
                    .execute(&mut *tx)
                    .await?;
            }
            let effects = sql::refusal_effects(&rows, call.refused, actor);
            if !effects.reoffer.is_empty() {
                sqlx::query(SQLITE_REOFFER)
                    .bind(actor.as_str())
                    .bind(id_list(effects.reoffer.iter().copied()))
                    .bind(i64::from(max_attempts))
                    .execute(&mut *tx)
                    .await?;
            }
            for (code, jobs) in &effects.fail {
                sqlx::query(SQLITE_FAIL_REFUSED)
                    .bind(actor.as_str())
                    .bind(*code)
                    .bind(id_list(jobs.iter().copied()))
                    .execute(&mut *tx)
                    .await?;
            }
            // Cursors last but one (then only inserts and updates of rows this transaction
            // holds), so the counter row is held as briefly as possible.
            let readable = sql::readable_count(&decided.accepted, call.unscored);
            let last: i64 = if readable > 0 {
                sqlx::query_scalar(sql::ADD_COUNTER)
                    .bind(sql::COUNTER_CURSOR)
                    .bind(readable)
                    .fetch_one(&mut *tx)
                    .await?
            } else {
                0
            };
            let cursors = sql::cursors(&decided.accepted, call.unscored, last);
            // Multi-row INSERTs: one statement per 256 results (2,816 parameters, far below
            // SQLite's limit of 32,766).
            let accepted: Vec<_> = decided.accepted.iter().zip(&cursors).collect();
            for chunk in accepted.chunks(256) {
                let mut insert = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
                    "INSERT INTO results (job_id, actor_id, version, digest, tokens, elapsed_ms, \
                     completion_ms, payload, accepted_at, batch_id, cursor) ",
                );
                insert.push_values(chunk, |mut b, ((sub, row), cursor)| {
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
                        .push_bind(row.batch)
                        .push_bind(**cursor);
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
            }
            if let Some(e) = sql::settle_submit(&who, &decided, now, beta, call.round_trip) {
                sqlx::query(sql::SETTLE_ACTOR)
                    .bind(actor.as_str())
                    .bind(e.tau)
                    .bind(now.millis())
                    .bind(e.latency_s)
                    .bind(e.tokens_per_job)
                    .execute(&mut *tx)
                    .await?;
            }
            Ok(decided.outcomes)
        })
        .await
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

    pub(crate) async fn assignment(
        &self,
        batch: BatchId,
    ) -> Result<Vec<ActorAssignment>, ReadError> {
        // For status pages: off the writer.
        let rows = sqlx::query(sql::ASSIGNMENTS_OF_BATCH)
            .bind(batch.0)
            .fetch_all(&self.reader)
            .await?;
        sql::assignments(&rows)
    }
}

const SQLITE_CLAIM_ASSIGNED: &str = "UPDATE jobs SET state = 'leased', assignee = NULL, lease_holder = $1, \
     leased_at = $2, lease_expires = $3, attempts = attempts + 1, lease_session = $6, \
     progress_tokens = 0, progress_at = $2 \
     WHERE id IN (SELECT id FROM (SELECT id, length(prompt) + $8 AS own, \
     SUM(length(prompt) + $8) OVER (ORDER BY id) AS upto FROM (SELECT id, prompt FROM jobs \
     WHERE state = 'pending' AND assignee = $1 AND version <= $5 ORDER BY id LIMIT $4)) \
     WHERE upto <= $7 OR (upto = own AND $9)) \
     RETURNING id, batch_id, version, prompt, attempts, length(prompt) AS prompt_len";

const SQLITE_CLAIM_OPEN: &str = "UPDATE jobs SET state = 'leased', lease_holder = $1, \
     leased_at = $2, lease_expires = $3, attempts = attempts + 1, lease_session = $6, \
     progress_tokens = 0, progress_at = $2 \
     WHERE id IN (SELECT id FROM (SELECT id, length(prompt) + $8 AS own, \
     SUM(length(prompt) + $8) OVER (ORDER BY id) AS upto FROM (SELECT id, prompt FROM jobs \
     WHERE state = 'pending' AND assignee IS NULL AND version <= $5 ORDER BY id LIMIT $4)) \
     WHERE upto <= $7 OR (upto = own AND $9)) \
     RETURNING id, batch_id, version, prompt, attempts, length(prompt) AS prompt_len";

const SQLITE_SET_EXPIRY: &str =
    "UPDATE jobs SET lease_expires = $1 WHERE id IN (SELECT value FROM json_each($2))";

const SQLITE_PROGRESS_ROWS: &str = "SELECT id, state, lease_holder, leased_at, lease_expires, \
     progress_tokens, progress_at FROM jobs WHERE id IN (SELECT value FROM json_each($1))";

const SQLITE_EXPIRE: &str = "UPDATE jobs SET state = CASE WHEN attempts >= $2 THEN 'failed' ELSE 'pending' END, \
     lease_holder = NULL, leased_at = NULL, lease_expires = NULL \
     WHERE id IN (SELECT id FROM jobs WHERE state = 'leased' AND lease_expires < $1 ORDER BY lease_expires LIMIT $3) \
     RETURNING state";

const SQLITE_SUBMIT_ROWS: &str = "SELECT j.id, j.state, j.attempts, j.version, j.lease_holder, j.leased_at, \
     j.lease_expires, j.batch_id, b.max_staleness, b.cancelled_at FROM jobs j JOIN batches b ON b.id = j.batch_id \
     WHERE j.id IN (SELECT value FROM json_each($1))";

const SQLITE_REOFFER: &str = "UPDATE jobs SET state = CASE WHEN attempts >= $3 THEN 'failed' ELSE 'pending' END, \
     lease_holder = NULL, leased_at = NULL, lease_expires = NULL \
     WHERE id IN (SELECT value FROM json_each($2)) AND state = 'leased' AND lease_holder = $1";

const SQLITE_FAIL_REFUSED: &str = "UPDATE jobs SET state = 'failed', fail_reason = $2, lease_holder = NULL, \
     leased_at = NULL, lease_expires = NULL \
     WHERE id IN (SELECT value FROM json_each($3)) AND state = 'leased' AND lease_holder = $1";

const SQLITE_MARK_DONE: &str = "UPDATE jobs SET state = 'done', lease_holder = NULL, leased_at = NULL, \
     lease_expires = NULL, done_at = $2 \
     WHERE id IN (SELECT value FROM json_each($3)) AND state = 'leased' AND lease_holder = $1";
