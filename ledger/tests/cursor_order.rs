//! The results cursor on a real PostgreSQL server under concurrent commits: two submitters,
//! one of them held inside its transaction (another session holds a row lock its insert
//! needs) while the other commits and a trainer reads. A trainer that polls with the last
//! cursor it read must see every accepted result exactly once. With row ids as cursors the
//! held submitter's result, which took the lower id and committed last, was skipped.
//! Needs `STARLING_TEST_POSTGRES_URL` (skipped, saying so, without it); SQLite has one writer
//! and cannot interleave commits this way.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use sqlx::Connection;
use starling_ledger::*;

fn result(job: &ClaimedJob, version: u64) -> ResultSubmission {
    ResultSubmission {
        job: job.id,
        version: v(version),
        digest: digest_of(version),
        tokens: 10,
        elapsed: Duration::from_millis(20),
        payload: format!("rollout of {}", job.id.raw()).into_bytes(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_committed_late_is_never_skipped_by_the_cursor() {
    let Some((ledger, db)) = postgres(LedgerConfig::default(), "cursor order").await else {
        return;
    };
    let TestDb::Postgres { admin_url, name } = &db else {
        unreachable!("a PostgreSQL test database");
    };
    let url = with_database(admin_url, name);
    let l = Arc::new(ledger);
    versions(&l, 1).await;
    // a generates with version 0, b with version 1: both within the batch's bound.
    actors_on(&l, &["a"], 0, T0).await;
    actors_on(&l, &["b"], 1, T0).await;
    let batch = l.post_batch(v(0), &prompts(2), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let ja = l.claim(&actor("a"), 1, T0).await.unwrap();
    let jb = l.claim(&actor("b"), 1, T0).await.unwrap();
    assert_eq!((ja.len(), jb.len()), (1, 1), "one group each");

    // Another session holds version 0's row: a's insert (which references it) waits inside
    // a's transaction, after a took whatever it takes before inserting.
    let mut hold = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut hold).await.unwrap();
    sqlx::query("SELECT version FROM versions WHERE version = 0 FOR UPDATE")
        .execute(&mut hold)
        .await
        .unwrap();
    let (la, a_job) = (l.clone(), ja[0].clone());
    let a = tokio::spawn(async move { la.submit(&actor("a"), &[result(&a_job, 0)], at(1)).await });
    wait_for_lock_waiters(&url, 1).await;
    let (lb, b_job) = (l.clone(), jb[0].clone());
    let b = tokio::spawn(async move { lb.submit(&actor("b"), &[result(&b_job, 1)], at(1)).await });
    // b commits now if nothing orders it after a (it did with row ids); either way, wait a
    // little, then read as a trainer would.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !b.is_finished() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut seen = Vec::new();
    let mut cursor = 0;
    for r in l.results_after(batch, cursor, 10).await.unwrap() {
        cursor = r.cursor;
        seen.push(r.job);
    }
    // a commits.
    sqlx::query("ROLLBACK").execute(&mut hold).await.unwrap();
    let out_a = a.await.unwrap().unwrap();
    let out_b = b.await.unwrap().unwrap();
    assert!(out_a[0].verdict.is_ok() && out_b[0].verdict.is_ok());
    for r in l.results_after(batch, cursor, 10).await.unwrap() {
        assert!(r.cursor > cursor);
        cursor = r.cursor;
        seen.push(r.job);
    }
    seen.sort();
    let mut want = vec![ja[0].id, jb[0].id];
    want.sort();
    assert_eq!(
        seen, want,
        "every accepted result once, polling after the last cursor read"
    );
    l.check_invariants().await.unwrap();
    hold.close().await.unwrap();
    let l = Arc::try_unwrap(l).unwrap();
    db.cleanup(l).await;
}

/// Waits until `n` sessions of the test database wait for a lock.
async fn wait_for_lock_waiters(url: &str, n: i64) {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock'",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        if waiting >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no session waits for the held row"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.close().await.unwrap();
}
