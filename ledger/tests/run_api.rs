//! The hub's side of the ledger, against SQLite and (when configured) PostgreSQL: published
//! versions with metadata, the staleness bound across versions, refusal counts per batch, the
//! trainer's result stream with its cursor, and cancellation.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
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

async fn published_versions_are_recorded_once(l: &Ledger) {
    l.publish_version(v(0), None, digest_of(0), "{}", T0)
        .await
        .unwrap();
    l.publish_version(v(1), Some(v(0)), digest_of(1), r#"{"bytes":7}"#, at(1))
        .await
        .unwrap();
    l.publish_version(v(1), Some(v(0)), digest_of(1), r#"{"bytes":7}"#, at(2))
        .await
        .expect("the same record again is a no-op");
    assert!(matches!(
        l.publish_version(v(1), Some(v(0)), digest_of(9), "{}", at(3)).await,
        Err(VersionError::Conflict(x)) if x == v(1)
    ));
    assert!(matches!(
        l.publish_version(v(5), Some(v(4)), digest_of(5), "{}", at(3)).await,
        Err(VersionError::UnknownBase(x)) if x == v(4)
    ));
    let latest = l.latest_versions(10).await.unwrap();
    assert_eq!(
        latest.iter().map(|r| r.version).collect::<Vec<_>>(),
        [v(1), v(0)]
    );
    assert_eq!(latest[0].meta, r#"{"bytes":7}"#);
    assert_eq!(latest[0].base, Some(v(0)));
    assert_eq!(latest[0].digest, digest_of(1));
    assert_eq!(
        l.version_state(v(1)).await.unwrap(),
        VersionState::Committed
    );
    assert_eq!(l.run_meta("model").await.unwrap(), None);
    l.set_run_meta("model", "m1").await.unwrap();
    l.set_run_meta("model", "m2").await.unwrap();
    assert_eq!(l.run_meta("model").await.unwrap().as_deref(), Some("m2"));
}
both_backends!(
    published_versions_are_recorded_once,
    LedgerConfig::default()
);

async fn staleness_is_judged_against_the_newest_version(l: &Ledger) {
    versions(l, 1).await;
    actors_on(l, &["a"], 1, T0).await;
    let batch = l
        .post_batch_bounded(v(1), &prompts(4), "{}", 1, T0)
        .await
        .unwrap();
    assert_eq!(l.unscheduled_batches(10).await.unwrap(), [batch]);
    l.schedule(batch, T0).await.unwrap();
    assert!(l.unscheduled_batches(10).await.unwrap().is_empty());
    let jobs = l.claim(&actor("a"), 4, T0).await.unwrap();
    assert_eq!(jobs.len(), 4);
    let a = actor("a");
    // Version 1 is the newest: accepted.
    let out = l.submit(&a, &[result(&jobs[0], 1)], at(1)).await.unwrap();
    assert_eq!(out[0].verdict, Ok(()));
    // Version 2 arrives; results from 1 (one step behind) and from 2 are accepted.
    l.publish_version(v(2), Some(v(1)), digest_of(2), "{}", at(2))
        .await
        .unwrap();
    let out = l
        .submit(&a, &[result(&jobs[1], 1), result(&jobs[2], 2)], at(3))
        .await
        .unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()), "{out:?}");
    // Version 3: a result from 1 is now two steps behind.
    l.publish_version(v(3), Some(v(2)), digest_of(3), "{}", at(4))
        .await
        .unwrap();
    let out = l.submit(&a, &[result(&jobs[3], 1)], at(5)).await.unwrap();
    assert_eq!(
        out[0].verdict,
        Err(Rejection::TooStale {
            result: v(1),
            latest: v(3)
        })
    );
    // And a result from a version nobody published.
    let out = l.submit(&a, &[result(&jobs[3], 9)], at(6)).await.unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::UnknownVersion(v(9))));
    let out = l.submit(&a, &[result(&jobs[3], 3)], at(7)).await.unwrap();
    assert_eq!(out[0].verdict, Ok(()));
    let status = l.batch_status(batch).await.unwrap();
    assert_eq!(status.jobs.done, 4);
    assert_eq!(status.max_staleness, 1);
    assert_eq!(
        status.refusals,
        [("stale".to_owned(), 1), ("unknown_version".to_owned(), 1)]
    );
    l.check_invariants().await.unwrap();
}
both_backends!(
    staleness_is_judged_against_the_newest_version,
    LedgerConfig::default()
);

async fn results_stream_once_in_cursor_order(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let b1 = l.post_batch(v(0), &prompts(5), "{}", T0).await.unwrap();
    let b2 = l.post_batch(v(0), &prompts(2), "{}", T0).await.unwrap();
    l.schedule(b1, T0).await.unwrap();
    l.schedule(b2, T0).await.unwrap();
    let jobs = l.claim(&actor("a"), 7, T0).await.unwrap();
    let subs: Vec<_> = jobs.iter().rev().map(|j| result(j, 0)).collect();
    let out = l.submit(&actor("a"), &subs, at(1)).await.unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()));
    let mut seen = Vec::new();
    let mut cursor = 0;
    loop {
        let page = l.results_after(b1, cursor, 2).await.unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 2);
        for r in &page {
            assert!(r.cursor > cursor, "cursor increases");
            cursor = r.cursor;
            assert_eq!(
                r.payload,
                format!("rollout of {}", r.job.raw()).into_bytes()
            );
            assert_eq!((r.actor.as_str(), r.attempt), ("a", 1));
            seen.push(r.job);
        }
    }
    let mut b1_jobs: Vec<_> = jobs
        .iter()
        .filter(|j| j.batch == b1)
        .map(|j| j.id)
        .collect();
    b1_jobs.sort();
    seen.sort();
    assert_eq!(
        seen, b1_jobs,
        "every result of the batch once, no other batch's"
    );
    assert_eq!(l.results_after(b2, 0, 100).await.unwrap().len(), 2);
}
both_backends!(results_stream_once_in_cursor_order, LedgerConfig::default());

async fn cancelled_batches_accept_nothing_more(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(3), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let jobs = l.claim(&actor("a"), 2, T0).await.unwrap();
    let out = l.submit(&actor("a"), &[result(&jobs[0], 0)], at(1)).await;
    assert!(out.unwrap()[0].verdict.is_ok());
    assert_eq!(l.cancel_batch(batch, at(2)).await.unwrap(), Some(2));
    assert!(matches!(
        l.cancel_batch(batch, at(3)).await,
        Err(CancelError::AlreadyCancelled(_))
    ));
    let ghost = BatchId::from_raw(9_999);
    assert!(matches!(
        l.cancel_batch(ghost, at(3)).await,
        Err(CancelError::UnknownBatch(_))
    ));
    let out = l
        .submit(&actor("a"), &[result(&jobs[1], 0)], at(4))
        .await
        .unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::Cancelled));
    assert!(l.claim(&actor("a"), 5, at(5)).await.unwrap().is_empty());
    let status = l.batch_status(batch).await.unwrap();
    assert_eq!((status.jobs.done, status.jobs.failed), (1, 2));
    assert_eq!(status.cancelled_at, Some(at(2)));
    // Posted (unscheduled) batches can be cancelled too.
    let posted = l.post_batch(v(0), &prompts(2), "{}", at(6)).await.unwrap();
    assert_eq!(l.cancel_batch(posted, at(7)).await.unwrap(), Some(2));
    assert!(l.unscheduled_batches(10).await.unwrap().is_empty());
    l.check_invariants().await.unwrap();
}
both_backends!(
    cancelled_batches_accept_nothing_more,
    LedgerConfig::default()
);

/// Two cancels of one batch at once: one cancels its jobs, the other is told it was already
/// cancelled. (On PostgreSQL the second used to wait on the job rows only, find them failed
/// and answer that the batch had finished.)
async fn racing_cancels_are_answered_once_each(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    for round in 0..20 {
        let batch = l
            .post_batch(v(0), &prompts(3), "{}", at(round))
            .await
            .unwrap();
        l.schedule(batch, at(round)).await.unwrap();
        let (a, b) = tokio::join!(
            l.cancel_batch(batch, at(round + 1)),
            l.cancel_batch(batch, at(round + 1))
        );
        let (won, lost) = if matches!(a, Ok(Some(_))) {
            (a, b)
        } else {
            (b, a)
        };
        assert_eq!(won.unwrap(), Some(3), "round {round}");
        assert!(
            matches!(lost, Err(CancelError::AlreadyCancelled(_))),
            "round {round}: {lost:?}"
        );
    }
    l.check_invariants().await.unwrap();
}
both_backends!(
    racing_cancels_are_answered_once_each,
    LedgerConfig::default()
);

/// A cancel racing a submit of the same batch: neither fails. (A cancel that locked the batch
/// row `FOR UPDATE` deadlocked on PostgreSQL with a submit that held its job rows and took
/// `KEY SHARE` on the batch row for the result's foreign key.)
async fn a_cancel_racing_a_submit_fails_neither(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    for round in 0..30 {
        let batch = l
            .post_batch(v(0), &prompts(4), "{}", at(round))
            .await
            .unwrap();
        l.schedule(batch, at(round)).await.unwrap();
        let jobs = l.claim(&actor("a"), 4, at(round)).await.unwrap();
        let subs: Vec<_> = jobs.iter().map(|j| result(j, 0)).collect();
        let a = actor("a");
        let (submitted, cancelled) = tokio::join!(
            l.submit(&a, &subs, at(round + 1)),
            l.cancel_batch(batch, at(round + 1))
        );
        submitted.unwrap_or_else(|e| panic!("round {round}: submit: {e:?}"));
        cancelled.unwrap_or_else(|e| panic!("round {round}: cancel: {e:?}"));
    }
    l.check_invariants().await.unwrap();
}
both_backends!(
    a_cancel_racing_a_submit_fails_neither,
    LedgerConfig::default()
);

/// A batch that finished is not cancelled, and that is decided in the cancelling transaction
/// (before, the hub read `finished` and cancelled in two calls: a batch whose last group was
/// accepted in between was answered `{"cancelled": 0}` and flipped to cancelled).
async fn finished_batches_are_not_cancelled(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(2), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let jobs = l.claim(&actor("a"), 2, T0).await.unwrap();
    let subs: Vec<_> = jobs.iter().map(|j| result(j, 0)).collect();
    l.submit(&actor("a"), &subs, at(1)).await.unwrap();
    assert!(l.batch_status(batch).await.unwrap().finished());
    assert_eq!(
        l.cancel_batch(batch, at(2)).await.unwrap(),
        None,
        "finished: nothing cancelled"
    );
    let status = l.batch_status(batch).await.unwrap();
    assert_eq!(status.cancelled_at, None, "and not marked cancelled");
    assert_eq!((status.jobs.done, status.jobs.failed), (2, 0));
    // Every job done but a result waiting for its reward service: not finished, so it is
    // cancelled (nothing open to fail; the waiting result is scored or failed as usual).
    let scoring = l.post_batch(v(0), &prompts(1), "{}", at(3)).await.unwrap();
    l.schedule(scoring, at(3)).await.unwrap();
    let jobs = l.claim(&actor("a"), 1, at(3)).await.unwrap();
    let subs = [result(&jobs[0], 0)];
    let unscored = [jobs[0].id];
    let call = SubmitCall {
        results: &subs,
        unscored: &unscored,
        ..SubmitCall::default()
    };
    l.submit_call(&actor("a"), call, at(4)).await.unwrap();
    assert_eq!(l.cancel_batch(scoring, at(5)).await.unwrap(), Some(0));
    assert_eq!(
        l.batch_status(scoring).await.unwrap().cancelled_at,
        Some(at(5))
    );
    // An archived batch is finished too.
    l.mark_delivered(batch, at(6)).await.unwrap();
    l.archive_batch(batch, "/archive/b.jsonl", 2, at(7))
        .await
        .unwrap();
    assert_eq!(l.cancel_batch(batch, at(8)).await.unwrap(), None);
    assert_eq!(l.batch_status(batch).await.unwrap().cancelled_at, None);
    l.check_invariants().await.unwrap();
}
both_backends!(finished_batches_are_not_cancelled, LedgerConfig::default());
