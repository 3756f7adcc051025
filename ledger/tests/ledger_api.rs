//! The ledger's rules, one scenario each, against SQLite and (when configured) PostgreSQL:
//! version registration, version-gated scheduling, quotas, the shared pool, every rejection
//! reason, renewal, expiry with max attempts, release of silent actors' shares, lease sizing.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use starling_ledger::*;

fn result(job: &ClaimedJob, version: u64, digest: Digest) -> ResultSubmission {
    ResultSubmission {
        job: job.id,
        version: v(version),
        digest,
        tokens: 100,
        elapsed: Duration::from_millis(50),
        payload: b"rollout".to_vec(),
    }
}

fn ok(job: &ClaimedJob) -> ResultSubmission {
    result(job, job.version.number(), digest_of(job.version.number()))
}

fn config() -> LedgerConfig {
    LedgerConfig {
        lease: LeaseConfig {
            multiple: 2.0,
            floor: Duration::from_secs(1),
            ceiling: Duration::from_secs(60),
            initial: Duration::from_secs(30),
            window: 16,
        },
        max_attempts: 2,
        actor_timeout: Duration::from_secs(20),
        ..LedgerConfig::default()
    }
}

async fn versions_are_registered_once(l: &Ledger) {
    l.register_version(v(0), None, digest_of(0), T0)
        .await
        .unwrap();
    l.register_version(v(0), None, digest_of(0), T0)
        .await
        .expect("same registration is idempotent");
    assert!(matches!(
        l.register_version(v(0), None, digest_of(9), T0).await,
        Err(VersionError::Conflict(x)) if x == v(0)
    ));
    assert!(matches!(
        l.register_version(v(5), Some(v(4)), digest_of(5), T0).await,
        Err(VersionError::UnknownBase(x)) if x == v(4)
    ));
    assert!(matches!(
        l.commit_version(v(3), T0).await,
        Err(VersionError::UnknownVersion(_))
    ));
    l.register_version(v(1), Some(v(0)), digest_of(1), T0)
        .await
        .unwrap();
    assert_eq!(l.version_state(v(1)).await.unwrap(), VersionState::Staged);
    assert!(matches!(
        l.post_batch(v(1), &prompts(3), "{}", T0).await,
        Err(PostError::NotCommitted(_))
    ));
    l.commit_version(v(1), T0).await.unwrap();
    l.commit_version(v(1), T0)
        .await
        .expect("commit is idempotent");
    assert_eq!(
        l.version_state(v(1)).await.unwrap(),
        VersionState::Committed
    );
    assert!(matches!(
        l.post_batch(v(1), &[], "{}", T0).await,
        Err(PostError::Empty)
    ));
    assert!(matches!(
        l.post_batch(v(7), &prompts(1), "{}", T0).await,
        Err(PostError::UnknownVersion(_))
    ));
    let b = l
        .post_batch(v(1), &prompts(3), r#"{"temperature":1.0}"#, T0)
        .await
        .unwrap();
    let info = l.batch(b).await.unwrap();
    assert_eq!(
        (info.size, info.sampling.as_str(), info.scheduled),
        (3, r#"{"temperature":1.0}"#, false)
    );
    assert_eq!(l.job_counts().await.unwrap().posted, 3);
    l.check_invariants().await.unwrap();
}
both_backends!(versions_are_registered_once, config());

async fn scheduling_is_gated_by_version(l: &Ledger) {
    versions(l, 3).await;
    let now = at(60_000);
    actors_on(l, &["on-v3"], 3, now).await;
    actors_on(l, &["staged-v3"], 2, now).await;
    l.heartbeat(&actor("staged-v3"), Some(v(2)), Some(v(3)), now)
        .await
        .unwrap();
    actors_on(l, &["two-behind", "not-staged"], 1, now).await;
    l.heartbeat(&actor("not-staged"), Some(v(2)), None, now)
        .await
        .unwrap();
    actors_on(l, &["silent"], 3, T0).await; // last heartbeat 60 s ago > actor_timeout
    let b = l.post_batch(v(3), &prompts(101), "{}", now).await.unwrap();
    let a = l.schedule(b, now).await.unwrap();
    let shares: Vec<(&str, u32, bool)> = a
        .shares
        .iter()
        .map(|s| (s.actor.as_str(), s.count, s.commit))
        .collect();
    assert_eq!(shares, vec![("on-v3", 51, false), ("staged-v3", 50, true)]);
    let mut excluded: Vec<&str> = a.excluded.iter().map(ActorId::as_str).collect();
    excluded.sort();
    assert_eq!(excluded, vec!["not-staged", "silent", "two-behind"]);
    let initial = l.config().initial_tau;
    for name in ["not-staged", "silent", "two-behind"] {
        let tau = l.actor(&actor(name)).await.unwrap().tau;
        assert!(
            (tau - initial * l.config().alpha).abs() < 1e-9,
            "{name}: tau {tau}"
        );
    }
    assert_eq!(l.actor(&actor("on-v3")).await.unwrap().tau, initial);
    let recorded = l.assignment(b).await.unwrap();
    assert_eq!(recorded.len(), 2);
    assert!(
        recorded
            .iter()
            .any(|r| r.actor.as_str() == "staged-v3" && r.commit && r.count == 50)
    );
    assert!(matches!(
        l.schedule(b, now).await,
        Err(ScheduleError::AlreadyScheduled(_))
    ));
    let counts = l.job_counts().await.unwrap();
    assert_eq!((counts.posted, counts.pending), (0, 101));
    // Actors ahead of a batch's version generate it from a newer version (accepted within
    // the staleness bound): a batch of v0 goes to every live actor.
    let b0 = l.post_batch(v(0), &prompts(4), "{}", now).await.unwrap();
    let a0 = l.schedule(b0, now).await.unwrap();
    assert_eq!(a0.shares.len(), 4, "{a0:?}");
    assert!(a0.shares.iter().all(|s| !s.commit));
    // Once every actor has gone silent, nobody is eligible.
    let later = at(10 * 60_000);
    let b1 = l.post_batch(v(3), &prompts(2), "{}", later).await.unwrap();
    assert!(matches!(
        l.schedule(b1, later).await,
        Err(ScheduleError::NoEligibleActors(_))
    ));
    l.check_invariants().await.unwrap();
}
both_backends!(scheduling_is_gated_by_version, config());

async fn claims_respect_quota_then_use_the_pool(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a", "b"], 0, T0).await;
    let b = l.post_batch(v(0), &prompts(10), "{}", T0).await.unwrap();
    l.schedule(b, T0).await.unwrap();
    let a_jobs = l.claim(&actor("a"), 100, T0).await.unwrap();
    assert_eq!(
        a_jobs.len(),
        5,
        "a gets its share and no more while nothing is in the pool"
    );
    assert!(
        a_jobs
            .iter()
            .all(|j| j.attempt == 1 && j.lease_expires == T0.plus(Duration::from_secs(30)))
    );
    assert!(l.claim(&actor("a"), 100, at(1)).await.unwrap().is_empty());
    assert!(matches!(
        l.claim(&actor("a"), 1_000_000, T0).await,
        Err(ClaimError::TooMany(..))
    ));
    assert!(matches!(
        l.claim(&actor("nobody"), 1, T0).await,
        Err(ClaimError::UnknownActor(_))
    ));
    // a's leases expire; the jobs go to the shared pool and b may take them beyond its share.
    let report = l.expire(at(31_000)).await.unwrap();
    assert_eq!((report.returned, report.failed), (5, 0));
    l.heartbeat(&actor("b"), Some(v(0)), None, at(31_000))
        .await
        .unwrap();
    let b_jobs = l.claim(&actor("b"), 100, at(31_000)).await.unwrap();
    assert_eq!(b_jobs.len(), 10);
    assert_eq!(b_jobs.iter().filter(|j| j.attempt == 2).count(), 5);
    let out = l
        .submit(
            &actor("b"),
            &b_jobs.iter().map(ok).collect::<Vec<_>>(),
            at(32_000),
        )
        .await
        .unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()));
    assert_eq!(l.job_counts().await.unwrap().done, 10);
    l.check_invariants().await.unwrap();
}
both_backends!(claims_respect_quota_then_use_the_pool, config());

async fn every_rejection_has_its_reason(l: &Ledger) {
    versions(l, 2).await;
    actors_on(l, &["a", "b"], 2, T0).await;
    let batch = l.post_batch(v(2), &prompts(4), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let a_jobs = l.claim(&actor("a"), 10, T0).await.unwrap();
    let b_jobs = l.claim(&actor("b"), 10, T0).await.unwrap();
    assert_eq!((a_jobs.len(), b_jobs.len()), (2, 2));
    let (j1, j2) = (&a_jobs[0], &a_jobs[1]);
    let a = actor("a");

    let out = l.submit(&a, &[ok(j1), ok(j1)], at(10)).await.unwrap();
    assert_eq!(out[0].verdict, Ok(()));
    assert_eq!(
        out[1].verdict,
        Err(Rejection::AlreadyAccepted),
        "duplicate within one call"
    );
    let out = l.submit(&a, &[ok(j1)], at(11)).await.unwrap();
    assert_eq!(
        out[0].verdict,
        Err(Rejection::AlreadyAccepted),
        "duplicate in a later call"
    );

    let out = l
        .submit(&a, &[result(j2, 1, digest_of(1))], at(12))
        .await
        .unwrap();
    assert_eq!(
        out[0].verdict,
        Err(Rejection::StaleVersion {
            job: v(2),
            result: v(1)
        })
    );
    let out = l
        .submit(&a, &[result(j2, 2, digest_of(77))], at(13))
        .await
        .unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::DigestMismatch));
    let out = l.submit(&a, &[ok(&b_jobs[0])], at(14)).await.unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::NotLeaseHolder));
    let mut ghost = ok(j2);
    ghost.job = JobId::from_raw(987_654_321);
    let out = l.submit(&a, &[ghost], at(15)).await.unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::UnknownJob));

    // The lease is valid up to and including its expiry instant, not after.
    let expiry = j2.lease_expires;
    let late = expiry.plus(Duration::from_millis(1));
    let out = l
        .submit(&actor("b"), &[ok(&b_jobs[0])], expiry)
        .await
        .unwrap();
    assert_eq!(out[0].verdict, Ok(()), "t_r <= t_expire is valid");
    let out = l.submit(&a, &[ok(j2)], late).await.unwrap();
    assert_eq!(
        out[0].verdict,
        Err(Rejection::LeaseExpired {
            expired_at: Some(expiry)
        })
    );

    // After the sweep the job is back in the pool; once re-leased to b, a's result is refused.
    assert_eq!(l.expire(late).await.unwrap().returned, 2);
    let out = l.submit(&a, &[ok(j2)], late).await.unwrap();
    assert_eq!(
        out[0].verdict,
        Err(Rejection::LeaseExpired { expired_at: None })
    );
    l.heartbeat(&actor("b"), Some(v(2)), None, late)
        .await
        .unwrap();
    let again = l.claim(&actor("b"), 10, late).await.unwrap();
    assert_eq!(again.len(), 2);
    let out = l.submit(&a, &[ok(j2)], late).await.unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::NotLeaseHolder));
    let out = l
        .submit(&actor("b"), &again.iter().map(ok).collect::<Vec<_>>(), late)
        .await
        .unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()));
    let view = l.job(j2.id).await.unwrap();
    assert_eq!(
        (view.state, view.accepted_from.as_ref().map(ActorId::as_str)),
        (JobState::Done, Some("b"))
    );
    assert!(matches!(
        l.submit(&actor("nobody"), &[ok(j2)], late).await,
        Err(SubmitError::UnknownActor(_))
    ));
    l.check_invariants().await.unwrap();
}
both_backends!(every_rejection_has_its_reason, config());

async fn renewal_extends_only_valid_leases(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a", "b"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(4), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let mine = l.claim(&actor("a"), 10, T0).await.unwrap();
    let theirs = l.claim(&actor("b"), 10, T0).await.unwrap();
    let ids: Vec<JobId> = mine.iter().chain(&theirs).map(|j| j.id).collect();
    let r = l.renew(&actor("a"), &ids, at(20_000)).await.unwrap();
    assert_eq!(r.renewed, mine.iter().map(|j| j.id).collect::<Vec<_>>());
    assert_eq!(r.lost, theirs.iter().map(|j| j.id).collect::<Vec<_>>());
    assert_eq!(r.expires, at(50_000));
    // At 40 s b's leases have expired and a's have not.
    let e = l.expire(at(40_000)).await.unwrap();
    assert_eq!(e.returned, 2);
    let out = l
        .submit(
            &actor("a"),
            &mine.iter().map(ok).collect::<Vec<_>>(),
            at(45_000),
        )
        .await
        .unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()), "{out:?}");
    // An expired lease cannot be renewed.
    let r = l
        .renew(
            &actor("b"),
            &theirs.iter().map(|j| j.id).collect::<Vec<_>>(),
            at(45_000),
        )
        .await
        .unwrap();
    assert!(r.renewed.is_empty());
    l.check_invariants().await.unwrap();
}
both_backends!(renewal_extends_only_valid_leases, config());

async fn jobs_fail_after_max_attempts(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(1), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let first = l.claim(&actor("a"), 1, T0).await.unwrap();
    assert_eq!(
        l.expire(at(30_001)).await.unwrap(),
        ExpireReport {
            returned: 1,
            failed: 0,
            released: 0
        }
    );
    l.heartbeat(&actor("a"), Some(v(0)), None, at(30_001))
        .await
        .unwrap();
    let second = l.claim(&actor("a"), 1, at(30_001)).await.unwrap();
    assert_eq!(second[0].attempt, 2);
    assert_eq!(
        l.expire(at(70_000)).await.unwrap(),
        ExpireReport {
            returned: 0,
            failed: 1,
            released: 0
        }
    );
    let out = l
        .submit(&actor("a"), &[ok(&first[0])], at(70_000))
        .await
        .unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::JobFailed));
    assert_eq!(l.job_counts().await.unwrap().failed, 1);
    l.check_invariants().await.unwrap();
}
both_backends!(jobs_fail_after_max_attempts, config());

async fn silent_actors_lose_their_unclaimed_share(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["alive", "gone"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(20), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    assert_eq!(
        l.claim(&actor("alive"), 100, at(1)).await.unwrap().len(),
        10
    );
    assert_eq!(
        l.expire(at(10_000)).await.unwrap().released,
        0,
        "gone is not yet silent for long"
    );
    l.heartbeat(&actor("alive"), Some(v(0)), None, at(25_000))
        .await
        .unwrap();
    assert_eq!(l.expire(at(25_000)).await.unwrap().released, 10);
    assert_eq!(
        l.claim(&actor("alive"), 100, at(25_000))
            .await
            .unwrap()
            .len(),
        10
    );
    l.check_invariants().await.unwrap();
}
both_backends!(silent_actors_lose_their_unclaimed_share, config());

async fn lease_length_follows_median_completion(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    assert_eq!(
        l.lease_length(),
        Duration::from_secs(30),
        "initial lease before any completion"
    );
    let batch = l.post_batch(v(0), &prompts(5), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let jobs = l.claim(&actor("a"), 5, T0).await.unwrap();
    let out = l
        .submit(
            &actor("a"),
            &jobs.iter().map(ok).collect::<Vec<_>>(),
            at(4_000),
        )
        .await
        .unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()));
    assert_eq!(l.lease_length(), Duration::from_secs(8), "2 × median 4 s");
    let batch = l.post_batch(v(0), &prompts(1), "{}", T0).await.unwrap();
    l.schedule(batch, at(5_000)).await.unwrap();
    let next = l.claim(&actor("a"), 1, at(5_000)).await.unwrap();
    assert_eq!(next[0].lease_expires, at(13_000));
}
both_backends!(lease_length_follows_median_completion, config());

#[tokio::test]
async fn sqlite_state_and_lease_window_survive_reopen() {
    let (l, db) = sqlite(config()).await;
    versions(&l, 0).await;
    actors_on(&l, &["a"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(6), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let jobs = l.claim(&actor("a"), 6, T0).await.unwrap();
    l.submit(
        &actor("a"),
        &jobs[..3].iter().map(ok).collect::<Vec<_>>(),
        at(2_000),
    )
    .await
    .unwrap();
    let counts = l.job_counts().await.unwrap();
    let lease = l.lease_length();
    l.close().await;
    drop(l);
    let reopened = Ledger::open(&sqlite_url(&db), config()).await.unwrap();
    assert_eq!(reopened.job_counts().await.unwrap(), counts);
    assert_eq!((counts.done, counts.leased), (3, 3));
    assert_eq!(reopened.lease_length(), lease);
    assert_eq!(lease, Duration::from_secs(4));
    let out = reopened
        .submit(
            &actor("a"),
            &jobs[3..].iter().map(ok).collect::<Vec<_>>(),
            at(3_000),
        )
        .await
        .unwrap();
    assert!(
        out.iter().all(|o| o.verdict.is_ok()),
        "leases survive a restart"
    );
    reopened.check_invariants().await.unwrap();
    db.cleanup(reopened).await;
}

#[tokio::test]
async fn bad_urls_and_configs_are_refused() {
    assert!(matches!(
        Ledger::open("mysql://x", LedgerConfig::default()).await,
        Err(OpenError::UnsupportedUrl(_))
    ));
    let bad = LedgerConfig {
        alpha: 2.0,
        ..LedgerConfig::default()
    };
    assert!(matches!(
        Ledger::open("sqlite::memory:", bad).await,
        Err(OpenError::Config(_))
    ));
}
