//! The ledger's rules, one scenario each, against SQLite and (when configured) PostgreSQL:
//! version registration, version-gated scheduling, quotas, the shared pool, every rejection
//! reason, progress, expiry with max attempts, release of silent actors' shares, lease sizing
//! from the held budget and the throughput measured on the ledger's clock, release of a
//! closed connection's leases, the claim timeout, shares held for an actor whose version is
//! still arriving, and pipelined claims.
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
            margin: 2.0,
            floor: Duration::from_secs(1),
            ceiling: Duration::from_secs(60),
            initial: Duration::from_secs(30),
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
    // One version behind with D(v3) still arriving: its share is held for it (and it is not
    // decayed); two behind or silent: excluded.
    assert_eq!(
        shares,
        vec![
            ("not-staged", 34, true),
            ("on-v3", 34, false),
            ("staged-v3", 33, true)
        ]
    );
    let mut excluded: Vec<&str> = a.excluded.iter().map(ActorId::as_str).collect();
    excluded.sort();
    assert_eq!(excluded, vec!["silent", "two-behind"]);
    let initial = l.config().initial_tau;
    assert_eq!(l.actor(&actor("not-staged")).await.unwrap().tau, initial);
    for name in ["silent", "two-behind"] {
        let tau = l.actor(&actor(name)).await.unwrap().tau;
        assert!(
            (tau - initial * l.config().alpha).abs() < 1e-9,
            "{name}: tau {tau}"
        );
    }
    assert_eq!(l.actor(&actor("on-v3")).await.unwrap().tau, initial);
    let recorded = l.assignment(b).await.unwrap();
    assert_eq!(recorded.len(), 3);
    assert!(
        recorded
            .iter()
            .any(|r| r.actor.as_str() == "staged-v3" && r.commit && r.count == 33)
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

async fn progress_extends_only_moving_held_leases(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a", "b"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(4), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let mine = l.claim(&actor("a"), 10, T0).await.unwrap();
    let theirs = l.claim(&actor("b"), 10, T0).await.unwrap();
    assert_eq!(
        mine[0].lease_expires,
        at(30_000),
        "unmeasured: the initial lease"
    );
    // a's first job generated 10 tokens; its second waits behind it; b's are not a's.
    let report = [(mine[0].id, 10), (mine[1].id, 0), (theirs[0].id, 5)];
    let r = l.progress(&actor("a"), &report, at(20_000)).await.unwrap();
    assert_eq!(r.extended, vec![mine[0].id, mine[1].id]);
    assert_eq!(r.lost, vec![theirs[0].id]);
    // Nothing moved since: nothing is extended (a stuck engine's leases run out).
    let r = l.progress(&actor("a"), &report, at(21_000)).await.unwrap();
    assert_eq!(r.unmoved, vec![mine[0].id, mine[1].id]);
    // Extended to 20 s + 2 × the 20 s since the claim = 60 s: at 40 s only b's have expired.
    let e = l.expire(at(40_000)).await.unwrap();
    assert_eq!(e.returned, 2);
    assert_eq!(l.expire(at(60_000)).await.unwrap().returned, 0);
    let out = l
        .submit(
            &actor("a"),
            &mine.iter().map(ok).collect::<Vec<_>>(),
            at(60_000),
        )
        .await
        .unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()), "{out:?}");
    // An expired lease is not extended by progress, however much it moved.
    let gone: Vec<(JobId, u64)> = theirs.iter().map(|j| (j.id, 1_000)).collect();
    let r = l.progress(&actor("b"), &gone, at(45_000)).await.unwrap();
    assert!(r.extended.is_empty());
    assert_eq!(r.lost.len(), 2);
    assert!(matches!(
        l.progress(&actor("a"), &vec![(mine[0].id, 1); 5_000], at(45_000))
            .await,
        Err(ProgressError::TooMany(..))
    ));
    l.check_invariants().await.unwrap();
}
both_backends!(progress_extends_only_moving_held_leases, config());

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
            released: 0,
            unclaimed: 0,
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
            released: 0,
            unclaimed: 0,
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
    let mine = l.claim(&actor("alive"), 100, at(1)).await.unwrap();
    assert_eq!(mine.len(), 10);
    assert_eq!(
        l.expire(at(10_000)).await.unwrap().released,
        0,
        "gone is not yet silent for long"
    );
    l.heartbeat(&actor("alive"), Some(v(0)), None, at(25_000))
        .await
        .unwrap();
    let e = l.expire(at(25_000)).await.unwrap();
    assert_eq!(e.released, 10, "{e:?}");
    // Once done with its own share, alive takes gone's from the pool.
    l.submit(
        &actor("alive"),
        &mine.iter().map(ok).collect::<Vec<_>>(),
        at(25_000),
    )
    .await
    .unwrap();
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

async fn a_lease_covers_the_held_budget_at_the_measured_throughput(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a"], 0, T0).await;
    let batch = l
        .post_batch_budgeted(v(0), &prompts(4), &[1_000; 4], "{}", 1, T0)
        .await
        .unwrap();
    l.schedule(batch, T0).await.unwrap();
    let first = l.claim(&actor("a"), 2, T0).await.unwrap();
    assert_eq!(
        first[0].lease_expires,
        at(30_000),
        "not measured yet: the initial lease"
    );
    // 200 tokens accepted 4 s after the claim, whatever time the actor reports: 50 tokens/s
    // on the ledger's clock (the first measurement replaces the initial guess).
    let claims_1ms: Vec<ResultSubmission> = first
        .iter()
        .map(|j| ResultSubmission {
            elapsed: Duration::from_millis(1),
            ..ok(j)
        })
        .collect();
    let out = l.submit(&actor("a"), &claims_1ms, at(4_000)).await.unwrap();
    assert!(out.iter().all(|o| o.verdict.is_ok()));
    let info = l.actor(&actor("a")).await.unwrap();
    assert_eq!((info.tau, info.measured), (50.0, 1));
    // Its next claim (0.5 s later: its round trip, counted in its next interval) holds
    // 1,000 tokens: 2 × 1,000 / 50 = 40 s; pipelined, the next one's lease covers both.
    let next = l.claim(&actor("a"), 1, at(4_500)).await.unwrap();
    assert_eq!(next[0].lease_expires, at(44_500));
    let pipelined = l.claim(&actor("a"), 1, at(4_600)).await.unwrap();
    assert_eq!(pipelined[0].lease_expires, at(84_600));
    // 100 tokens over the 6 s since its last accepted submit (the 0.5 s round trip before
    // its next claim included: it did not pipeline then): τ moves by the EMA.
    l.submit(&actor("a"), &[ok(&next[0])], at(10_000))
        .await
        .unwrap();
    let tau = l.actor(&actor("a")).await.unwrap().tau;
    let expected = 0.9 * 50.0 + 0.1 * (100.0 / 6.0);
    assert!(
        (tau - expected).abs() < 1e-9,
        "tau {tau}, expected {expected}"
    );
    // The next busy delivery moves it again: 100 tokens in 1 s.
    l.submit(&actor("a"), &[ok(&pipelined[0])], at(11_000))
        .await
        .unwrap();
    let tau = l.actor(&actor("a")).await.unwrap().tau;
    let expected = 0.9 * expected + 0.1 * 100.0;
    assert!(
        (tau - expected).abs() < 1e-9,
        "tau {tau}, expected {expected}"
    );
    // Idle (a claim that found nothing), then a job 32× as long: its interval starts at the
    // claim, not at the last submit, and its lease is 32× a short one's.
    assert!(
        l.claim(&actor("a"), 1, at(11_100))
            .await
            .unwrap()
            .is_empty()
    );
    let tau_before = l.actor(&actor("a")).await.unwrap().tau;
    l.heartbeat(&actor("a"), Some(v(0)), None, at(70_000))
        .await
        .unwrap();
    let long_batch = l
        .post_batch_budgeted(v(0), &prompts(1), &[32_000], "{}", 1, at(70_000))
        .await
        .unwrap();
    l.schedule(long_batch, at(70_000)).await.unwrap();
    let long = l.claim(&actor("a"), 1, at(71_000)).await.unwrap();
    let lease_ms = (long[0].lease_expires.millis() - at(71_000).millis()) as f64;
    let expected_ms = 2.0 * 32_000.0 / tau_before * 1_000.0;
    assert!(
        (lease_ms - expected_ms).abs() <= 1.0,
        "{lease_ms} vs {expected_ms}"
    );
    // Its first delivery after idleness, 1 s after the claim, with the hub's round-trip
    // estimate of 0.4 s: that is latency (λ), not slowness, so 100 tokens count over 0.6 s.
    let delivered = [ok(&long[0])];
    let call = SubmitCall {
        results: &delivered,
        round_trip: Some(Duration::from_millis(400)),
        ..SubmitCall::default()
    };
    l.submit_call(&actor("a"), call, at(72_000)).await.unwrap();
    let info = l.actor(&actor("a")).await.unwrap();
    let expected = 0.9 * tau_before + 0.1 * (100.0 / 0.6);
    assert!(
        (info.tau - expected).abs() < 1e-9,
        "tau {}, expected {expected}",
        info.tau
    );
    assert_eq!(info.latency_s, Some(0.4));
    // The floor holds.
    let tiny = l
        .post_batch_budgeted(v(0), &prompts(1), &[1], "{}", 1, at(80_000))
        .await
        .unwrap();
    l.schedule(tiny, at(80_000)).await.unwrap();
    let t = l.claim(&actor("a"), 1, at(80_000)).await.unwrap();
    assert_eq!(t[0].lease_expires, at(81_000), "the 1 s floor");
    l.check_invariants().await.unwrap();
}
both_backends!(
    a_lease_covers_the_held_budget_at_the_measured_throughput,
    LedgerConfig {
        lease: LeaseConfig {
            ceiling: Duration::from_secs(3_600),
            ..config().lease
        },
        ..config()
    }
);

async fn a_closed_connection_releases_its_own_leases_at_once(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["b"], 0, T0).await;
    let first = l.register_actor(&actor("a"), "r", "cpu", T0).await.unwrap();
    l.heartbeat(&actor("a"), Some(v(0)), None, T0)
        .await
        .unwrap();
    let batch = l.post_batch(v(0), &prompts(8), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let old = l.claim(&actor("a"), 2, T0).await.unwrap();
    // A second connection of the same actor (a reconnect while the first still looks alive).
    let second = l
        .register_actor(&actor("a"), "r", "cpu", at(1_000))
        .await
        .unwrap();
    assert!(second > first);
    // It may not pipeline from the pool, but its own share is its own.
    l.submit(&actor("a"), &[ok(&old[0])], at(1_500))
        .await
        .unwrap();
    let new = l.claim(&actor("a"), 1, at(2_000)).await.unwrap();
    assert_eq!(new.len(), 1);
    // The first connection closes: only its lease goes back, the share stays.
    let r = l.release(&actor("a"), first, at(3_000)).await.unwrap();
    assert_eq!(
        r,
        ReleaseReport {
            returned: 1,
            failed: 0,
            unassigned: 0
        }
    );
    assert_eq!(l.job(old[1].id).await.unwrap().state, JobState::Pending);
    assert_eq!(l.job(new[0].id).await.unwrap().state, JobState::Leased);
    // The newest closes: its lease and the unclaimed rest of its share go to the pool, and
    // b (holding nothing) takes them at once, attempts counted.
    let r = l.release(&actor("a"), second, at(4_000)).await.unwrap();
    assert_eq!((r.returned, r.unassigned), (1, 1));
    let b_jobs = l.claim(&actor("b"), 100, at(4_000)).await.unwrap();
    assert_eq!(b_jobs.len(), 4 + 3, "b's share and a's three");
    assert_eq!(b_jobs.iter().filter(|j| j.attempt == 2).count(), 2);
    // Results of released leases are refused.
    let out = l
        .submit(&actor("a"), &[ok(&old[1])], at(4_100))
        .await
        .unwrap();
    assert_eq!(out[0].verdict, Err(Rejection::NotLeaseHolder));
    // A job released on its last attempt fails (config: 2 attempts).
    let third = l
        .register_actor(&actor("c"), "r", "cpu", at(5_000))
        .await
        .unwrap();
    l.heartbeat(&actor("c"), Some(v(0)), None, at(5_000))
        .await
        .unwrap();
    let again = b_jobs.iter().find(|j| j.attempt == 2).unwrap();
    let rest: Vec<_> = b_jobs.iter().filter(|j| j.id != again.id).collect();
    l.submit(
        &actor("b"),
        &rest.iter().map(|j| ok(j)).collect::<Vec<_>>(),
        at(5_000),
    )
    .await
    .unwrap();
    let r = l
        .release(&actor("b"), Session::from_raw(1), at(5_000))
        .await
        .unwrap();
    assert_eq!((r.returned, r.failed), (0, 1));
    assert_eq!(l.job(again.id).await.unwrap().state, JobState::Failed);
    assert_eq!(third, Session::from_raw(1));
    l.check_invariants().await.unwrap();
}
both_backends!(
    a_closed_connection_releases_its_own_leases_at_once,
    config()
);

/// A claim stops at its byte budget (each job's stored prompt plus `per_job`), continues in
/// the shared pool with what is left, always takes its first job whatever its size, and tags
/// its leases with the session it names, not the actor's newest.
async fn a_claim_keeps_to_its_byte_budget_and_its_session(l: &Ledger) {
    versions(l, 0).await;
    let first = l.register_actor(&actor("a"), "r", "cpu", T0).await.unwrap();
    l.heartbeat(&actor("a"), Some(v(0)), None, T0)
        .await
        .unwrap();
    // Prompts of 100, 200, ..., 600 bytes.
    let sized: Vec<Vec<u8>> = (1..=6).map(|i| vec![b'p'; 100 * i]).collect();
    let batch = l.post_batch(v(0), &sized, "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let limit = |max_bytes| ClaimLimit {
        session: Some(first),
        max: 100,
        max_bytes,
        per_job: 10,
    };
    // 110 + 210 fit 400; 310 more would not.
    let got = l.claim_within(&actor("a"), limit(400), T0).await.unwrap();
    assert_eq!(
        got.iter().map(|j| j.prompt.len()).collect::<Vec<_>>(),
        vec![100, 200]
    );
    l.submit(&actor("a"), &got.iter().map(ok).collect::<Vec<_>>(), at(10))
        .await
        .unwrap();
    // A job larger than the whole budget is still claimed when it comes first, alone.
    let got = l
        .claim_within(&actor("a"), limit(50), at(20))
        .await
        .unwrap();
    assert_eq!(
        got.iter().map(|j| j.prompt.len()).collect::<Vec<_>>(),
        vec![300]
    );
    // A reconnect: the old connection's claim is tagged with the old session, so closing the
    // old connection returns exactly that claim, and the new one's stays.
    let second = l
        .register_actor(&actor("a"), "r", "cpu", at(30))
        .await
        .unwrap();
    assert!(second > first);
    l.submit(&actor("a"), &got.iter().map(ok).collect::<Vec<_>>(), at(30))
        .await
        .unwrap();
    let old = l
        .claim_within(&actor("a"), limit(410), at(40))
        .await
        .unwrap();
    assert_eq!(
        old.iter().map(|j| j.prompt.len()).collect::<Vec<_>>(),
        vec![400]
    );
    let new = l
        .claim_within(
            &actor("a"),
            ClaimLimit {
                session: Some(second),
                ..limit(u64::MAX)
            },
            at(50),
        )
        .await
        .unwrap();
    assert_eq!(new.len(), 2);
    let r = l.release(&actor("a"), first, at(60)).await.unwrap();
    assert_eq!((r.returned, r.failed), (1, 0));
    assert_eq!(l.job(old[0].id).await.unwrap().state, JobState::Pending);
    assert!(
        l.job(new[0].id).await.unwrap().state == JobState::Leased
            && l.job(new[1].id).await.unwrap().state == JobState::Leased
    );
    l.check_invariants().await.unwrap();
}
both_backends!(a_claim_keeps_to_its_byte_budget_and_its_session, config());

/// The shared pool continues a claim with what its share left of the byte budget, and a
/// claim whose share used the budget up takes nothing from the pool.
async fn the_pool_gets_what_the_share_left_of_the_budget(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a", "b"], 0, T0).await;
    let sized: Vec<Vec<u8>> = (0..4).map(|_| vec![b'p'; 100]).collect();
    let batch = l.post_batch(v(0), &sized, "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    // b's share (2 jobs) goes to the pool when b's connection closes.
    let r = l
        .release(&actor("b"), Session::from_raw(1), at(10))
        .await
        .unwrap();
    assert_eq!(r.unassigned, 2);
    let limit = |max_bytes| ClaimLimit {
        session: None,
        max: 100,
        max_bytes,
        per_job: 0,
    };
    // Its share's two jobs (200 bytes) and one of the pool's within 300.
    let got = l
        .claim_within(&actor("a"), limit(300), at(20))
        .await
        .unwrap();
    assert_eq!(got.len(), 3);
    l.submit(&actor("a"), &got.iter().map(ok).collect::<Vec<_>>(), at(30))
        .await
        .unwrap();
    // Nothing held now: the last pool job alone is over a 50-byte budget, but a claim's first
    // job is taken whatever its size.
    let got = l
        .claim_within(&actor("a"), limit(50), at(40))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    l.check_invariants().await.unwrap();
}
both_backends!(the_pool_gets_what_the_share_left_of_the_budget, config());

async fn an_unclaimed_share_returns_to_the_pool_and_stalls_its_actor(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["worker", "fenced", "slow"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(9), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let w = l.claim(&actor("worker"), 3, at(100)).await.unwrap();
    // The slow actor claims one of its three now and then: its share stays its own.
    let s1 = l.claim(&actor("slow"), 1, at(6_000)).await.unwrap();
    assert_eq!(l.expire(at(9_000)).await.unwrap().unclaimed, 0);
    l.submit(&actor("slow"), &[ok(&s1[0])], at(9_500))
        .await
        .unwrap();
    let _s2 = l.claim(&actor("slow"), 1, at(9_600)).await.unwrap();
    for name in ["worker", "fenced", "slow"] {
        l.heartbeat(&actor(name), Some(v(0)), None, at(10_500))
            .await
            .unwrap();
    }
    // 10 s after scheduling the fenced actor (heartbeating, never claiming) loses its share.
    let e = l.expire(at(10_500)).await.unwrap();
    assert_eq!(e.unclaimed, 3);
    assert!(
        l.actor(&actor("fenced"))
            .await
            .unwrap()
            .stalled_since
            .is_some()
    );
    assert!(
        l.actor(&actor("slow"))
            .await
            .unwrap()
            .stalled_since
            .is_none()
    );
    // The worker, done with its share, takes them from the pool.
    l.submit(
        &actor("worker"),
        &w.iter().map(ok).collect::<Vec<_>>(),
        at(10_600),
    )
    .await
    .unwrap();
    assert_eq!(
        l.claim(&actor("worker"), 10, at(10_700))
            .await
            .unwrap()
            .len(),
        3
    );
    // The next batch leaves the stalled actor out (it would hold its share up again) ...
    let next = l
        .post_batch(v(0), &prompts(4), "{}", at(11_000))
        .await
        .unwrap();
    let a = l.schedule(next, at(11_000)).await.unwrap();
    let names: Vec<&str> = a.shares.iter().map(|s| s.actor.as_str()).collect();
    assert_eq!(names, ["slow", "worker"]);
    // ... until it claims again (even for nothing).
    l.claim(&actor("fenced"), 1, at(12_000)).await.unwrap();
    assert!(
        l.actor(&actor("fenced"))
            .await
            .unwrap()
            .stalled_since
            .is_none()
    );
    let third = l
        .post_batch(v(0), &prompts(3), "{}", at(12_000))
        .await
        .unwrap();
    assert_eq!(l.schedule(third, at(12_000)).await.unwrap().shares.len(), 3);
    l.check_invariants().await.unwrap();
}
both_backends!(
    an_unclaimed_share_returns_to_the_pool_and_stalls_its_actor,
    config()
);

async fn an_arriving_actor_gets_its_share_once_it_can_run_the_version(l: &Ledger) {
    versions(l, 1).await;
    actors_on(l, &["far", "near"], 0, T0).await;
    l.heartbeat(&actor("near"), Some(v(0)), Some(v(1)), T0)
        .await
        .unwrap();
    let batch = l.post_batch(v(1), &prompts(6), "{}", T0).await.unwrap();
    let a = l.schedule(batch, T0).await.unwrap();
    assert_eq!(a.shares.len(), 2, "{a:?}");
    assert!(a.excluded.is_empty());
    // D(v1) has not reached the far actor: nothing of v1 is handed to it yet.
    assert!(
        l.claim(&actor("far"), 10, at(200))
            .await
            .unwrap()
            .is_empty()
    );
    // The near one has staged v1 (its COMMIT is on the way): it gets its share.
    assert_eq!(l.claim(&actor("near"), 10, at(200)).await.unwrap().len(), 3);
    // v1 arrives at the far actor within the claim timeout: its share waited for it.
    l.heartbeat(&actor("far"), Some(v(0)), Some(v(1)), at(900))
        .await
        .unwrap();
    let got = l.claim(&actor("far"), 10, at(1_000)).await.unwrap();
    assert_eq!(got.len(), 3);
    assert!(got.iter().all(|j| j.version == v(1)));
    let initial = l.config().initial_tau;
    assert_eq!(l.actor(&actor("far")).await.unwrap().tau, initial);
    l.check_invariants().await.unwrap();
}
both_backends!(
    an_arriving_actor_gets_its_share_once_it_can_run_the_version,
    config()
);

async fn a_pipelining_actor_takes_only_its_own_share(l: &Ledger) {
    versions(l, 0).await;
    actors_on(l, &["a", "b"], 0, T0).await;
    let batch = l.post_batch(v(0), &prompts(4), "{}", T0).await.unwrap();
    l.schedule(batch, T0).await.unwrap();
    let b = l.claim(&actor("b"), 2, T0).await.unwrap();
    l.release(&actor("b"), Session::from_raw(1), at(100))
        .await
        .unwrap();
    // Two jobs in the pool. a claims its share one at a time, pipelining: while it holds a
    // lease it gets only its own jobs, never pooled ones an idle actor could start now.
    let first = l.claim(&actor("a"), 1, at(200)).await.unwrap();
    let second = l.claim(&actor("a"), 1, at(210)).await.unwrap();
    assert_eq!((first.len(), second.len()), (1, 1));
    assert!(l.claim(&actor("a"), 1, at(220)).await.unwrap().is_empty());
    l.submit(
        &actor("a"),
        &first.iter().chain(&second).map(ok).collect::<Vec<_>>(),
        at(300),
    )
    .await
    .unwrap();
    // Holding nothing, it takes pooled jobs.
    let pooled = l.claim(&actor("a"), 10, at(400)).await.unwrap();
    assert_eq!(
        pooled.iter().map(|j| j.id).collect::<Vec<_>>(),
        b.iter().map(|j| j.id).collect::<Vec<_>>()
    );
    l.check_invariants().await.unwrap();
}
both_backends!(a_pipelining_actor_takes_only_its_own_share, config());

#[tokio::test]
async fn sqlite_state_and_measurements_survive_reopen() {
    let (l, db) = sqlite(config()).await;
    versions(&l, 0).await;
    actors_on(&l, &["a"], 0, T0).await;
    let batch = l
        .post_batch_budgeted(v(0), &prompts(6), &[100; 6], "{}", 1, T0)
        .await
        .unwrap();
    l.schedule(batch, T0).await.unwrap();
    let jobs = l.claim(&actor("a"), 3, T0).await.unwrap();
    l.submit(
        &actor("a"),
        &jobs.iter().map(ok).collect::<Vec<_>>(),
        at(2_000),
    )
    .await
    .unwrap();
    let before = l.actor(&actor("a")).await.unwrap();
    assert_eq!((before.tau, before.measured), (150.0, 1));
    let held = l.claim(&actor("a"), 1, at(2_100)).await.unwrap();
    let counts = l.job_counts().await.unwrap();
    l.close().await;
    drop(l);
    // The hub restarts: what it measured and granted is all in the file.
    let reopened = Ledger::open(&sqlite_url(&db), config()).await.unwrap();
    assert_eq!(reopened.job_counts().await.unwrap(), counts);
    assert_eq!((counts.done, counts.leased), (3, 1));
    assert_eq!(reopened.actor(&actor("a")).await.unwrap(), before);
    // 2 × (100 + 100) / 150 s = 2.67 s: the same lease as before the restart would give.
    let next = reopened.claim(&actor("a"), 1, at(2_200)).await.unwrap();
    assert_eq!(next[0].lease_expires, at(2_200 + 2_666));
    // The interval opened before the restart goes on: 200 tokens over 1.2 s, moving τ by the
    // EMA (β = 0.9).
    let out = reopened
        .submit(
            &actor("a"),
            &held.iter().chain(&next).map(ok).collect::<Vec<_>>(),
            at(3_200),
        )
        .await
        .unwrap();
    assert!(
        out.iter().all(|o| o.verdict.is_ok()),
        "leases survive a restart"
    );
    let tau = reopened.actor(&actor("a")).await.unwrap().tau;
    assert!(
        (tau - (0.9 * 150.0 + 0.1 * 200.0 / 1.2)).abs() < 1e-9,
        "{tau}"
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
