//! What the trainer reads and what the ledger keeps, against SQLite and (when configured)
//! PostgreSQL: the hub's own refusals counted and applied in the submit transaction (a
//! non-finite result re-offered at once, an undeliverable one failed by name), failures by
//! reason, results that wait for their reward service (accepted, not readable, then readable
//! with a cursor after everything read before; or failed), pages bounded in bytes, and
//! retention (a delivered batch archived: its rows gone, its status and counts kept, cursors
//! never reused).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use starling_ledger::*;

fn result(job: &ClaimedJob, bytes: usize) -> ResultSubmission {
    ResultSubmission {
        job: job.id,
        version: job.version,
        digest: digest_of(job.version.number()),
        tokens: 10,
        elapsed: Duration::from_millis(20),
        payload: vec![b'x'; bytes],
    }
}

fn config() -> LedgerConfig {
    LedgerConfig {
        max_attempts: 2,
        ..LedgerConfig::default()
    }
}

/// A scheduled batch of `n` jobs on version 0, all leased to actor `a`.
async fn leased(l: &Ledger, n: usize) -> (BatchId, Vec<ClaimedJob>) {
    let batch = l.post_batch(v(0), &prompts(n), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let jobs = l.claim(&actor("a"), n, T0).await.unwrap();
    assert_eq!(jobs.len(), n);
    (batch, jobs)
}

fn counts(pairs: &[(String, u64)]) -> Vec<(&str, u64)> {
    pairs.iter().map(|(k, n)| (k.as_str(), *n)).collect()
}

async fn hub_refusals_are_counted_and_applied(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let (batch, jobs) = leased(l, 4).await;
    actors_on(l, &["b"], 0, T0).await;
    let a = actor("a");
    let refused = [
        HubRefusal {
            job: jobs[0].id,
            code: "nonfinite_logprob",
            effect: RefusalEffect::Reoffer,
        },
        HubRefusal {
            job: jobs[1].id,
            code: "result_too_large",
            effect: RefusalEffect::Fail,
        },
        HubRefusal {
            job: jobs[2].id,
            code: "invalid_result",
            effect: RefusalEffect::KeepLease,
        },
    ];
    let good = [result(&jobs[3], 10)];
    let call = SubmitCall {
        results: &good,
        refused: &refused,
        ..SubmitCall::default()
    };
    let out = l.submit_call(&a, call, at(1)).await.unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].verdict, Ok(()), "the others are judged as usual");
    // Re-offered at once: back in the shared pool, for anyone.
    assert_eq!(l.job(jobs[0].id).await.unwrap().state, JobState::Pending);
    let again = l.claim(&actor("b"), 4, at(2)).await.unwrap();
    assert_eq!(
        again.iter().map(|j| j.id).collect::<Vec<_>>(),
        [jobs[0].id],
        "only the re-offered group is open"
    );
    assert_eq!(again[0].attempt, 2);
    // Failed by name; the lease kept for the malformed one.
    assert_eq!(l.job(jobs[1].id).await.unwrap().state, JobState::Failed);
    assert_eq!(l.job(jobs[2].id).await.unwrap().state, JobState::Leased);
    let s = l.batch_status(batch).await.unwrap();
    assert_eq!(
        counts(&s.refusals),
        [
            ("invalid_result", 1),
            ("nonfinite_logprob", 1),
            ("result_too_large", 1)
        ]
    );
    assert_eq!(counts(&s.failures), [("result_too_large", 1)]);
    // A refusal for a job the submitter does not hold is counted, and changes nothing.
    let foreign = [HubRefusal {
        job: jobs[0].id,
        code: "result_too_large",
        effect: RefusalEffect::Fail,
    }];
    let call = SubmitCall {
        refused: &foreign,
        ..SubmitCall::default()
    };
    l.submit_call(&a, call, at(3)).await.unwrap();
    assert_eq!(l.job(jobs[0].id).await.unwrap().state, JobState::Leased);
    // Out of attempts (2): a second non-finite result fails the group as `attempts`.
    let nan = [HubRefusal {
        job: jobs[0].id,
        code: "nonfinite_logprob",
        effect: RefusalEffect::Reoffer,
    }];
    let call = SubmitCall {
        refused: &nan,
        ..SubmitCall::default()
    };
    l.submit_call(&actor("b"), call, at(4)).await.unwrap();
    let s = l.batch_status(batch).await.unwrap();
    assert_eq!(
        counts(&s.failures),
        [("attempts", 1), ("result_too_large", 1)]
    );
    assert_eq!(
        counts(&s.refusals),
        [
            ("invalid_result", 1),
            ("nonfinite_logprob", 2),
            ("result_too_large", 2)
        ]
    );
    // Cancelling fails the rest as `cancelled`.
    l.cancel_batch(batch, at(5)).await.unwrap();
    let s = l.batch_status(batch).await.unwrap();
    assert_eq!(
        counts(&s.failures),
        [("attempts", 1), ("cancelled", 1), ("result_too_large", 1)]
    );
    assert_eq!((s.jobs.done, s.jobs.failed), (1, 3));
    l.check_invariants().await.unwrap();
}
both_backends!(hub_refusals_are_counted_and_applied, config());

async fn results_waiting_for_scoring_are_readable_only_once_scored(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let (batch, jobs) = leased(l, 4).await;
    let a = actor("a");
    let subs: Vec<_> = jobs.iter().map(|j| result(j, 10)).collect();
    let unscored = [jobs[0].id, jobs[1].id];
    let call = SubmitCall {
        results: &subs,
        unscored: &unscored,
        ..SubmitCall::default()
    };
    let out = l.submit_call(&a, call, at(1)).await.unwrap();
    assert!(
        out.iter().all(|o| o.verdict.is_ok()),
        "acknowledged at once"
    );
    let page = l.results_after(batch, 0, 100).await.unwrap();
    assert_eq!(
        page.iter().map(|r| r.job).collect::<Vec<_>>(),
        [jobs[2].id, jobs[3].id],
        "only the scored ones are readable"
    );
    let read_to = page.last().unwrap().cursor;
    let s = l.batch_status(batch).await.unwrap();
    assert_eq!((s.jobs.done, s.scoring), (4, 2));
    assert!(!s.finished(), "not finished while results wait for scoring");
    let waiting = l.unscored(10).await.unwrap();
    assert_eq!(
        waiting.iter().map(|u| u.job).collect::<Vec<_>>(),
        [jobs[0].id, jobs[1].id]
    );
    assert_eq!(waiting[0].prompt, b"prompt 0");
    assert_eq!(waiting[0].version, v(0));
    // Listed by id alone, and read for the jobs asked (in that order; none for others).
    assert_eq!(l.unscored_jobs(10).await.unwrap(), [jobs[0].id, jobs[1].id]);
    assert_eq!(l.unscored_jobs(1).await.unwrap(), [jobs[0].id]);
    let some = l
        .unscored_of(&[jobs[1].id, jobs[2].id, jobs[0].id])
        .await
        .unwrap();
    assert_eq!(some, [waiting[1].clone(), waiting[0].clone()]);
    // Scored: readable after everything read before, with its new payload.
    let cursor = l.score(jobs[0].id, b"scored").await.unwrap();
    assert!(cursor.is_some_and(|c| c > read_to));
    assert_eq!(l.score(jobs[0].id, b"again").await.unwrap(), None, "once");
    let page = l.results_after(batch, read_to, 100).await.unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(
        (page[0].job, page[0].payload.as_slice()),
        (jobs[0].id, &b"scored"[..])
    );
    // Its service failed: the group fails by name, its result is gone.
    assert!(l.fail_scoring(jobs[1].id, "reward_service").await.unwrap());
    assert!(!l.fail_scoring(jobs[1].id, "reward_service").await.unwrap());
    let s = l.batch_status(batch).await.unwrap();
    assert_eq!((s.jobs.done, s.jobs.failed, s.scoring), (3, 1, 0));
    assert_eq!(counts(&s.failures), [("reward_service", 1)]);
    assert!(s.finished());
    assert!(l.unscored(10).await.unwrap().is_empty());
    assert_eq!(l.job_counts().await.unwrap().failed, 1);
    l.check_invariants().await.unwrap();
}
both_backends!(
    results_waiting_for_scoring_are_readable_only_once_scored,
    config()
);

async fn pages_are_bounded_in_bytes_but_hold_at_least_one(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let (batch, jobs) = leased(l, 5).await;
    let subs: Vec<_> = jobs
        .iter()
        .zip([300, 300, 300, 5_000, 10])
        .map(|(j, n)| result(j, n))
        .collect();
    l.submit(&actor("a"), &subs, at(1)).await.unwrap();
    let mut sizes = Vec::new();
    let mut cursor = 0;
    loop {
        let p = l.results_page(batch, cursor, 10, 1_000).await.unwrap();
        let Some(last) = p.results.last() else {
            assert!(!p.more);
            break;
        };
        cursor = last.cursor;
        sizes.push(
            p.results
                .iter()
                .map(|r| r.payload.len())
                .collect::<Vec<_>>(),
        );
        assert_eq!(p.more, sizes.len() < 3, "{sizes:?}");
    }
    assert_eq!(sizes, [vec![300, 300, 300], vec![5_000], vec![10]]);
}
both_backends!(pages_are_bounded_in_bytes_but_hold_at_least_one, config());

async fn delivered_batches_are_archived_and_cursors_never_reused(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let (b1, jobs) = leased(l, 3).await;
    let mut subs: Vec<_> = jobs[..2].iter().map(|j| result(j, 10)).collect();
    let refused = [HubRefusal {
        job: jobs[2].id,
        code: "result_too_large",
        effect: RefusalEffect::Fail,
    }];
    let call = SubmitCall {
        results: &subs,
        refused: &refused,
        ..SubmitCall::default()
    };
    l.submit_call(&actor("a"), call, at(1)).await.unwrap();
    let before = l.batch_status(b1).await.unwrap();
    let read = l.results_after(b1, 0, 10).await.unwrap();
    let last = read.last().unwrap().cursor;
    let policy = Retention {
        age: Some(Duration::from_secs(60)),
        keep: None,
    };
    assert!(
        l.archivable(policy, at(1_000_000), 10)
            .await
            .unwrap()
            .is_empty(),
        "never before the trainer read it"
    );
    assert!(matches!(
        l.archive_batch(b1, "/x", 2, at(2)).await,
        Err(ArchiveError::Changed(_))
    ));
    l.mark_delivered(b1, at(10)).await.unwrap();
    assert!(l.archivable(policy, at(10), 10).await.unwrap().is_empty());
    assert_eq!(l.archivable(policy, at(70_000), 10).await.unwrap(), [b1]);
    let keep_none = Retention {
        age: None,
        keep: Some(0),
    };
    assert_eq!(l.archivable(keep_none, at(11), 10).await.unwrap(), [b1]);
    assert!(
        l.archivable(
            Retention {
                age: None,
                keep: Some(1)
            },
            at(11),
            10
        )
        .await
        .unwrap()
        .is_empty()
    );
    // A count that is not the ledger's: nothing is deleted.
    assert!(matches!(
        l.archive_batch(b1, "/archive/b1.jsonl", 3, at(20)).await,
        Err(ArchiveError::Changed(_))
    ));
    assert_eq!(l.results_after(b1, 0, 10).await.unwrap().len(), 2);
    l.archive_batch(b1, "/archive/b1.jsonl", 2, at(20))
        .await
        .unwrap();
    let after = l.batch_status(b1).await.unwrap();
    assert_eq!(
        after.archive,
        Some(Archive {
            path: "/archive/b1.jsonl".into(),
            at: at(20)
        })
    );
    assert_eq!((after.jobs.done, after.jobs.failed), (2, 1));
    assert_eq!(after.failures, before.failures);
    assert_eq!(after.refusals, before.refusals);
    assert!(after.finished());
    assert!(
        l.results_after(b1, 0, 10).await.unwrap().is_empty(),
        "rows gone"
    );
    assert_eq!(l.job_counts().await.unwrap().total(), 0);
    assert!(
        l.archivable(keep_none, at(30), 10)
            .await
            .unwrap()
            .is_empty()
    );
    // New results never get an archived result's cursor.
    let (b2, jobs) = leased(l, 2).await;
    subs = jobs.iter().map(|j| result(j, 10)).collect();
    l.submit(&actor("a"), &subs, at(40)).await.unwrap();
    let fresh = l.results_after(b2, 0, 10).await.unwrap();
    assert!(
        fresh.iter().all(|r| r.cursor > last),
        "{fresh:?} after {last}"
    );
    assert_eq!(l.job_counts().await.unwrap().done, 2);
    l.check_invariants().await.unwrap();
}
both_backends!(
    delivered_batches_are_archived_and_cursors_never_reused,
    config()
);
