//! Retention: what keeps the ledger from growing with the run. A batch the trainer has read to
//! its end ([`Ledger::mark_delivered`]) is finished for good — every job done or failed, every
//! result readable — so its rows can leave the ledger: the hub writes its results to a file
//! the trainer can read (the same JSON documents the results endpoint serves, in cursor
//! order), makes the file durable, and then [`Ledger::archive_batch`] deletes the batch's
//! results, jobs and assignments in one transaction, keeping the batch row (with the file's
//! path and its failures by reason) and its refusal counts. What stays per archived batch is a
//! few hundred bytes, whatever its size.
//!
//! Which batches go is the hub's policy ([`Retention`]): delivered longer ago than an age,
//! and/or beyond a number of newest delivered batches. Undelivered batches are never
//! archived: their results are the trainer's work in progress.

use std::time::Duration;

use crate::error::{ArchiveError, ReadError};
use crate::ids::{BatchId, Timestamp};
use crate::sql::{self, Get};
use crate::{Ledger, Store};

/// Which delivered batches retention archives (none when both are unset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retention {
    /// Archive batches delivered longer ago than this.
    pub age: Option<Duration>,
    /// Keep at most this many delivered batches in the ledger (the newest).
    pub keep: Option<u64>,
}

impl Retention {
    /// Whether the policy archives anything.
    pub fn enabled(&self) -> bool {
        self.age.is_some() || self.keep.is_some()
    }
}

const DELIVERED_BEFORE: &str = "SELECT id FROM batches WHERE delivered_at IS NOT NULL \
     AND archived_at IS NULL AND delivered_at < $1 ORDER BY id LIMIT $2";
const DELIVERED_BEYOND: &str = "SELECT id FROM batches WHERE delivered_at IS NOT NULL \
     AND archived_at IS NULL ORDER BY id DESC LIMIT $2 OFFSET $1";
const BATCH_FOR_ARCHIVE: &str = "SELECT delivered_at, archived_at FROM batches WHERE id = $1";
const READABLE_OF_BATCH: &str =
    "SELECT COUNT(*) FROM results WHERE batch_id = $1 AND cursor IS NOT NULL";
const UNREADABLE_OF_BATCH: &str =
    "SELECT COUNT(*) FROM results WHERE batch_id = $1 AND cursor IS NULL";
const KEEP_FAILURES: &str = "INSERT INTO archived_failures (batch_id, reason, count) \
     SELECT batch_id, COALESCE(fail_reason, 'attempts'), COUNT(*) FROM jobs \
     WHERE batch_id = $1 AND state = 'failed' GROUP BY batch_id, COALESCE(fail_reason, 'attempts')";
const DELETE_RESULTS: &str = "DELETE FROM results WHERE batch_id = $1";
const DELETE_JOBS: &str = "DELETE FROM jobs WHERE batch_id = $1";
const DELETE_ASSIGNMENTS: &str = "DELETE FROM assignments WHERE batch_id = $1";
const MARK_ARCHIVED: &str = "UPDATE batches SET archived_at = $2, archive = $3 WHERE id = $1";

impl Ledger {
    /// Delivered, unarchived batches that `policy` archives now, oldest first, at most
    /// `limit`.
    pub async fn archivable(
        &self,
        policy: Retention,
        now: Timestamp,
        limit: u32,
    ) -> Result<Vec<BatchId>, ReadError> {
        let limit = i64::from(limit);
        let mut ids: Vec<i64> = Vec::new();
        with_reader!(self, p => {
            if let Some(age) = policy.age {
                let before = now.minus(age).millis();
                let rows = sqlx::query(DELIVERED_BEFORE)
                    .bind(before)
                    .bind(limit)
                    .fetch_all(p)
                    .await?;
                for r in &rows {
                    ids.push(r.i64("id")?);
                }
            }
            if let Some(keep) = policy.keep {
                let rows = sqlx::query(DELIVERED_BEYOND)
                    .bind(i64::try_from(keep).unwrap_or(i64::MAX))
                    .bind(limit)
                    .fetch_all(p)
                    .await?;
                for r in &rows {
                    ids.push(r.i64("id")?);
                }
            }
            Ok::<(), ReadError>(())
        })?;
        ids.sort_unstable();
        ids.dedup();
        ids.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(ids.into_iter().map(BatchId).collect())
    }

    /// Deletes a delivered batch's results, jobs and assignments, keeping the batch row with
    /// `archive` (the file its results were written to) and its failures by reason, in one
    /// durable transaction. `results` is how many results the file holds: if the ledger holds
    /// another number of readable results, or any still waiting for scoring, nothing is
    /// deleted ([`ArchiveError::Changed`]). The file must be durable before this is called.
    pub async fn archive_batch(
        &self,
        batch: BatchId,
        archive: &str,
        results: u64,
        now: Timestamp,
    ) -> Result<(), ArchiveError> {
        durably!(self, tx => {
            let row = sqlx::query(BATCH_FOR_ARCHIVE)
                .bind(batch.0)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(ArchiveError::UnknownBatch(batch))?;
            if row.opt_i64("delivered_at")?.is_none() || row.opt_i64("archived_at")?.is_some() {
                return Err(ArchiveError::Changed(batch));
            }
            let readable: i64 = sqlx::query_scalar(READABLE_OF_BATCH)
                .bind(batch.0)
                .fetch_one(&mut *tx)
                .await?;
            let waiting: i64 = sqlx::query_scalar(UNREADABLE_OF_BATCH)
                .bind(batch.0)
                .fetch_one(&mut *tx)
                .await?;
            if u64::try_from(readable).ok() != Some(results) || waiting != 0 {
                return Err(ArchiveError::Changed(batch));
            }
            sqlx::query(KEEP_FAILURES).bind(batch.0).execute(&mut *tx).await?;
            sqlx::query(DELETE_RESULTS).bind(batch.0).execute(&mut *tx).await?;
            let jobs = sqlx::query(DELETE_JOBS)
                .bind(batch.0)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            sqlx::query(DELETE_ASSIGNMENTS).bind(batch.0).execute(&mut *tx).await?;
            sqlx::query(sql::ADD_COUNTER)
                .bind(sql::COUNTER_JOBS)
                .bind(-i64::try_from(jobs).unwrap_or(i64::MAX))
                .execute(&mut *tx)
                .await?;
            sqlx::query(MARK_ARCHIVED)
                .bind(batch.0)
                .bind(now.millis())
                .bind(archive)
                .execute(&mut *tx)
                .await?;
            Ok(())
        })
    }
}
