//! Scoring by reward services, after acceptance.
//!
//! A result for a group whose verifier is a reward service is judged and acknowledged to its
//! actor like any other (the actor never waits for a service), and stored in the ledger
//! without a cursor: accepted, not readable. This task finds such results in the ledger
//! (so a restarted hub picks up where it stopped), calls the group's service with the prompt,
//! the completions and the answer (`reward_service`), writes the rewards into the stored
//! result and makes it readable with the next cursor (`Ledger::score`).
//!
//! A service that is unavailable (it cannot be reached, or answers 408, 429, 502, 503 or 504:
//! [`CallError::transient`]) leaves the result waiting: it is called again later, with a
//! backoff that doubles from [`FIRST_BACKOFF`] to [`MAX_BACKOFF`] or is what the service asked
//! for (`Retry-After`, up to [`MAX_BACKOFF`]), until `RewardServices::retry_for` has passed
//! since its first failed try; then that group alone fails with reason `reward_service`
//! (`Ledger::fail_scoring`). Any other failure of the service fails the group at once, and a
//! scored result that no longer fits the ledger's bound on a stored result fails it as
//! `result_too_large`. Only a failing ledger write leaves a result to be tried again without
//! a bound. Results waiting for their next try take no call slot, and the ones due are taken
//! oldest first past them, so failing groups never hold up the others.
//!
//! At most [`CONCURRENT`] calls are in flight; each is a task of a `JoinSet` this task owns,
//! so stopping the hub stops them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use starling_ledger::{JobId, Ledger, ScoreError, Unscored};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::board::{Board, FaultKind};
use crate::clock::now_ms;
use crate::reward_service::{CallError, Completion, PromptView, RewardServices, ScoreRequest};
use crate::rollouts::{GroupSpec, RESULT_TOO_LARGE, StoredResult};

/// Reward-service calls in flight at once.
pub(crate) const CONCURRENT: usize = 32;
/// How often the ledger is looked at when nobody says there is work.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// The failure reason of a group whose service failed.
pub(crate) const REWARD_SERVICE: &str = "reward_service";
/// The pause before a result's second scoring; it doubles with each failure after.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_secs(2);
/// The longest pause between two scorings of one result.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What the scorer needs.
#[derive(Debug, Clone)]
pub(crate) struct Scorer {
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) services: Arc<RewardServices>,
    pub(crate) board: Arc<Board>,
    /// Woken when a submit stored results that wait for scoring.
    pub(crate) wake: Arc<Notify>,
    /// The model's tokenizer, to give a service the text of a prompt given as ids.
    pub(crate) text: Arc<starling_text::ModelText>,
}

/// How one scoring ended.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// Scored, or its group failed: nothing more to do.
    Settled,
    /// Left waiting because the service was unavailable: try again later, after at least
    /// `retry_after` if the service asked. These count towards the bound.
    Unavailable { retry_after: Option<Duration> },
    /// Left waiting for a fault of the hub's own (a ledger write, a panicked task): tried
    /// again with the same backoff, without counting against the service.
    Retry,
}

/// A result waiting for its next try.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    /// Its first try that found the service unavailable (the bound counts from it).
    first: Option<Instant>,
    /// Failed tries so far.
    failures: u32,
    /// Not tried before this.
    next: Instant,
}

impl Backoff {
    /// After another failed try at `now` (`unavailable`: the service's; else the hub's own):
    /// the next try doubles the pause (or waits what the service asked, both at most
    /// [`MAX_BACKOFF`]), and falls no later than `first + retry_for` while that is ahead, so
    /// the last try is made at the bound. Past it the pause still holds: a try that finds
    /// the service unavailable there fails the group, so only the hub's own faults are
    /// retried past it, never in a tight loop.
    fn failed(
        prev: Option<Backoff>,
        now: Instant,
        retry_after: Option<Duration>,
        retry_for: Duration,
        unavailable: bool,
    ) -> Backoff {
        let failures = prev.map_or(1, |b| b.failures.saturating_add(1));
        let first = prev.and_then(|b| b.first).or(unavailable.then_some(now));
        let doubled = FIRST_BACKOFF.saturating_mul(1 << failures.saturating_sub(1).min(16));
        let pause = doubled
            .max(retry_after.unwrap_or_default())
            .min(MAX_BACKOFF);
        let mut next = now + pause;
        if let Some(bound) = first.map(|f| f + retry_for).filter(|&b| b > now) {
            next = next.min(bound);
        }
        Backoff {
            first,
            failures,
            next,
        }
    }
}

/// Scores waiting results until the task is dropped.
pub(crate) async fn run(scorer: Scorer) {
    let mut tasks: JoinSet<Outcome> = JoinSet::new();
    let mut running: HashMap<tokio::task::Id, JobId> = HashMap::new();
    let mut busy: HashSet<JobId> = HashSet::new();
    let mut waiting: HashMap<JobId, Backoff> = HashMap::new();
    loop {
        if tasks.len() < CONCURRENT {
            take_due(&scorer, &mut tasks, &mut running, &mut busy, &mut waiting).await;
        }
        tokio::select! {
            Some(done) = tasks.join_next_with_id() => {
                let (id, outcome) = match done {
                    Ok((id, o)) => (id, o),
                    Err(e) => (e.id(), Outcome::Retry),
                };
                if let Some(job) = running.remove(&id) {
                    busy.remove(&job);
                    let (retry_after, unavailable) = match outcome {
                        Outcome::Settled => {
                            waiting.remove(&job);
                            continue;
                        }
                        Outcome::Unavailable { retry_after } => (retry_after, true),
                        Outcome::Retry => (None, false),
                    };
                    let b = Backoff::failed(
                        waiting.get(&job).copied(),
                        Instant::now(),
                        retry_after,
                        scorer.services.retry_for,
                        unavailable,
                    );
                    waiting.insert(job, b);
                }
            }
            () = scorer.wake.notified() => {}
            () = tokio::time::sleep(IDLE_POLL) => {}
        }
    }
}

/// Starts scoring the oldest waiting results that are not being scored and whose next try is
/// due, as many as there are free call slots. Lists job ids only, past every result being
/// scored or waiting for its next try, so those never hide the others.
async fn take_due(
    scorer: &Scorer,
    tasks: &mut JoinSet<Outcome>,
    running: &mut HashMap<tokio::task::Id, JobId>,
    busy: &mut HashSet<JobId>,
    waiting: &mut HashMap<JobId, Backoff>,
) {
    let want = busy.len() + waiting.len() + CONCURRENT;
    let ids = match scorer
        .ledger
        .unscored_jobs(u32::try_from(want).unwrap_or(u32::MAX))
        .await
    {
        Ok(ids) => ids,
        Err(e) => {
            tracing::error!(
                "read results waiting for scoring: {}",
                starling_process::error_chain(&e)
            );
            return;
        }
    };
    if ids.len() < want {
        // Every waiting result is listed: forget those that were settled elsewhere.
        let listed: HashSet<JobId> = ids.iter().copied().collect();
        waiting.retain(|j, _| listed.contains(j));
    }
    let now = Instant::now();
    let due: Vec<JobId> = ids
        .into_iter()
        .filter(|j| !busy.contains(j) && waiting.get(j).is_none_or(|b| b.next <= now))
        .take(CONCURRENT - tasks.len())
        .collect();
    if due.is_empty() {
        return;
    }
    match scorer.ledger.unscored_of(&due).await {
        Ok(found) => {
            for u in found {
                let job = u.job;
                let since = waiting.get(&job).and_then(|b| b.first);
                busy.insert(job);
                let handle = tasks.spawn(score_one(scorer.clone(), u, since));
                running.insert(handle.id(), job);
            }
        }
        Err(e) => tracing::error!(
            "read results waiting for scoring: {}",
            starling_process::error_chain(&e)
        ),
    }
}

/// Scores one result, leaves it waiting for another try, or fails its group. `since` is its
/// first try that found the service unavailable, if it had one.
async fn score_one(scorer: Scorer, u: Unscored, since: Option<Instant>) -> Outcome {
    let batch = u.batch.raw();
    let job = u.job.raw();
    let (reason, why) = match scored_payload(&scorer.services, &scorer.text, &u).await {
        Ok(payload) => match scorer.ledger.score(u.job, &payload).await {
            Ok(_) => {
                crate::jobs::note_if_finished(&scorer.ledger, &scorer.board, batch).await;
                return Outcome::Settled;
            }
            // The rewards made it longer than the ledger stores: it never will be stored.
            Err(ScoreError::PayloadTooLarge(n)) => (
                RESULT_TOO_LARGE,
                format!(
                    "the scored result is {n} bytes, over the ledger's bound on a stored result ({} bytes)",
                    scorer.ledger.config().max_result_bytes
                ),
            ),
            // Left waiting: tried again on a later round.
            Err(e) => {
                tracing::error!(
                    job,
                    "store a scored result: {}",
                    starling_process::error_chain(&e)
                );
                return Outcome::Retry;
            }
        },
        Err(Failure::Transient(e, why))
            if since.is_none_or(|t| t.elapsed() < scorer.services.retry_for) =>
        {
            tracing::info!(
                job,
                batch,
                "reward service unavailable, tried again later: {why}"
            );
            return Outcome::Unavailable {
                retry_after: e.retry_after(),
            };
        }
        Err(Failure::Transient(_, why)) => (
            REWARD_SERVICE,
            format!(
                "{why} (unavailable for {:?}, the bound)",
                scorer.services.retry_for
            ),
        ),
        Err(Failure::Final(why)) => (REWARD_SERVICE, why),
    };
    tracing::warn!(job, batch, reason, "scoring failed, the group fails: {why}");
    scorer.board.fault(
        FaultKind::RewardService,
        None,
        None,
        &format!("batch {batch} job {job}: {why}"),
        now_ms(),
    );
    match scorer.ledger.fail_scoring(u.job, reason).await {
        Ok(_) => {
            crate::jobs::note_if_finished(&scorer.ledger, &scorer.board, batch).await;
            Outcome::Settled
        }
        Err(e) => {
            tracing::error!(
                job,
                "fail a group whose scoring failed: {}",
                starling_process::error_chain(&e)
            );
            Outcome::Retry
        }
    }
}

/// Why a result has no rewards.
#[derive(Debug)]
enum Failure {
    /// The service is unavailable (the call's error, and what to report).
    Transient(CallError, String),
    /// Anything else: the group fails.
    Final(String),
}

impl From<String> for Failure {
    fn from(why: String) -> Failure {
        Failure::Final(why)
    }
}

impl From<&str> for Failure {
    fn from(why: &str) -> Failure {
        Failure::Final(why.to_owned())
    }
}

/// The stored result with the service's rewards, or why there are none.
async fn scored_payload(
    services: &RewardServices,
    text: &starling_text::ModelText,
    u: &Unscored,
) -> Result<Vec<u8>, Failure> {
    let spec = GroupSpec::parse(&u.prompt).ok_or("the job holds no group spec")?;
    let mut stored: StoredResult = serde_json::from_slice(&u.payload)
        .map_err(|e| format!("the stored result does not parse: {e}"))?;
    let service = services.get(&spec.verifier).ok_or_else(|| {
        format!(
            "no reward service named {:?} is configured (--reward-service)",
            spec.verifier
        )
    })?;
    let request = ScoreRequest {
        batch: u.batch.raw(),
        group: spec.group,
        job: u.job.raw(),
        version: u.version.number(),
        prompt: PromptView {
            text: spec
                .prompt_text
                .clone()
                .unwrap_or_else(|| text.decode(&spec.prompt_ids, &[])),
            messages: spec
                .messages
                .as_ref()
                .and_then(|m| serde_json::to_value(m).ok()),
        },
        answer: spec.answer.clone(),
        completions: stored
            .samples
            .iter()
            .map(|s| Completion {
                text: s.text.clone(),
                finish: s.finish.clone(),
                tokens: s.tokens.len(),
            })
            .collect(),
    };
    let rewards = services.score(service, &request).await.map_err(|e| {
        let why = format!("reward service {} ({}): {e}", service.name, service.url());
        if e.transient() {
            Failure::Transient(e, why)
        } else {
            Failure::Final(why)
        }
    })?;
    for (s, r) in stored.samples.iter_mut().zip(rewards) {
        s.reward = r;
    }
    Ok(serde_json::to_vec(&stored).map_err(|e| format!("encode the scored result: {e}"))?)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use starling_ledger::{
        ActorId, Digest, JobState, LedgerConfig, ResultSubmission, SubmitCall, Timestamp, Version,
    };
    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::reward_service::RewardService;

    /// A reward service that answers every call with `answer` (status 200) after reading it.
    async fn service(answer: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if !crate::reward_service::read_request(&mut conn).await {
                        return;
                    }
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                        answer.len()
                    );
                    let _ = conn.write_all(reply.as_bytes()).await;
                });
            }
        });
        format!("http://{addr}/score")
    }

    /// A ledger whose results may be `slack` bytes longer than the stored result of one
    /// group scored by service `rm`, with that result accepted and waiting for scoring.
    async fn waiting(dir: &std::path::Path, url: &str, slack: usize) -> (Scorer, Unscored) {
        let spec = serde_json::json!({
            "group": 0, "prompt_ids": [1, 2], "prompt_text": "p", "n": 1,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 4,
                         "stop_token_ids": [], "seed": 0},
            "verifier": "rm"});
        let stored = serde_json::json!({
            "group": 0, "prompt_ids": [1, 2],
            "samples": [{"tokens": [3], "logprobs": [-0.5], "finish": "stop", "text": "c",
                         "versions": [{"version": 0, "start": 0, "end": 1}],
                         "reward": 0.0, "ttft_ms": 1.0, "tokens_per_s": 1.0}]});
        let payload = serde_json::to_vec(&stored).expect("payload");
        let config = LedgerConfig {
            max_result_bytes: payload.len() + slack,
            ..LedgerConfig::default()
        };
        let url_db = format!("sqlite:{}", dir.join("ledger.db").display());
        let ledger = Arc::new(Ledger::open(&url_db, config).await.expect("ledger"));
        let (v0, t0, digest) = (
            Version::new(0).expect("v"),
            Timestamp::from_millis(1_000),
            Digest([7; 16]),
        );
        ledger
            .register_version(v0, None, digest, t0)
            .await
            .expect("register");
        ledger.commit_version(v0, t0).await.expect("commit");
        let a = ActorId::new("a").expect("actor");
        ledger
            .register_actor(&a, "r", "cpu", t0)
            .await
            .expect("actor");
        ledger
            .heartbeat(&a, Some(v0), None, t0)
            .await
            .expect("heartbeat");
        let spec_bytes = serde_json::to_vec(&spec).expect("spec");
        let batch = ledger
            .post_batch(v0, &[spec_bytes], "{}", t0)
            .await
            .expect("batch");
        ledger.schedule(batch, t0).await.expect("schedule");
        let jobs = ledger.claim(&a, 1, t0).await.expect("claim");
        let results = [ResultSubmission {
            job: jobs[0].id,
            version: v0,
            digest,
            tokens: 1,
            elapsed: Duration::from_millis(5),
            payload,
        }];
        let unscored = [jobs[0].id];
        let call = SubmitCall {
            results: &results,
            unscored: &unscored,
            ..SubmitCall::default()
        };
        let out = ledger.submit_call(&a, call, t0).await.expect("submit");
        assert!(out[0].verdict.is_ok());
        let services = RewardServices::new(
            vec![RewardService::parse(&format!("rm={url}")).expect("service")],
            Duration::from_millis(500),
        )
        .expect("services");
        let scorer = Scorer {
            ledger: ledger.clone(),
            services: Arc::new(services),
            board: Arc::new(Board::new(0)),
            wake: Arc::new(Notify::new()),
            text: Arc::new(starling_text::ModelText::byte()),
        };
        let mut u = ledger.unscored(10).await.expect("unscored");
        assert_eq!(u.len(), 1);
        (scorer, u.remove(0))
    }

    #[tokio::test]
    async fn a_scored_result_over_the_bound_fails_its_group_instead_of_coming_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        // `0.0` becomes `0.12345679`: 8 bytes longer, over a bound 4 bytes above the result.
        let url = service(r#"{"rewards": [0.123456789]}"#).await;
        let (scorer, u) = waiting(dir.path(), &url, 4).await;
        let (job, batch) = (u.job, u.batch);
        assert_eq!(score_one(scorer.clone(), u, None).await, Outcome::Settled);
        assert!(
            scorer
                .ledger
                .unscored(10)
                .await
                .expect("unscored")
                .is_empty(),
            "not waiting any more (before: picked up again every second, for ever)"
        );
        assert_eq!(
            scorer.ledger.job(job).await.expect("job").state,
            JobState::Failed
        );
        let s = scorer.ledger.batch_status(batch).await.expect("status");
        assert_eq!(s.failures, [(RESULT_TOO_LARGE.to_owned(), 1)]);
        assert!(s.finished());
    }

    #[tokio::test]
    async fn an_unavailable_service_leaves_the_result_waiting_until_the_bound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let down = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            format!("http://{}/score", l.local_addr().expect("addr"))
        };
        let (scorer, u) = waiting(dir.path(), &down, 1 << 10).await;
        let job = u.job;
        // Within the bound: left waiting, nothing failed.
        let outcome = score_one(scorer.clone(), u.clone(), Some(Instant::now())).await;
        assert_eq!(outcome, Outcome::Unavailable { retry_after: None });
        assert_eq!(scorer.ledger.unscored(10).await.expect("unscored").len(), 1);
        // Past it: the group fails as `reward_service`.
        let long_ago = Instant::now()
            .checked_sub(scorer.services.retry_for + Duration::from_secs(1))
            .expect("instant");
        assert_eq!(
            score_one(scorer.clone(), u, Some(long_ago)).await,
            Outcome::Settled
        );
        assert_eq!(
            scorer.ledger.job(job).await.expect("job").state,
            JobState::Failed
        );
        assert!(
            scorer
                .ledger
                .unscored(10)
                .await
                .expect("unscored")
                .is_empty()
        );
    }

    #[test]
    fn backoff_doubles_honours_retry_after_and_ends_at_the_bound() {
        let t0 = Instant::now();
        let bound = Duration::from_secs(300);
        let b = Backoff::failed(None, t0, None, bound, true);
        assert_eq!((b.failures, b.next - t0), (1, FIRST_BACKOFF));
        let b = Backoff::failed(Some(b), t0, None, bound, true);
        assert_eq!((b.failures, b.next - t0), (2, FIRST_BACKOFF * 2));
        let asked = Backoff::failed(Some(b), t0, Some(Duration::from_secs(30)), bound, true);
        assert_eq!(
            asked.next - t0,
            Duration::from_secs(30),
            "what the service asked"
        );
        let asked = Backoff::failed(Some(b), t0, Some(Duration::from_secs(3600)), bound, true);
        assert_eq!(asked.next - t0, MAX_BACKOFF, "at most the longest pause");
        let mut b = b;
        for _ in 0..40 {
            b = Backoff::failed(Some(b), t0, None, bound, true);
        }
        assert_eq!(b.next - t0, MAX_BACKOFF, "never longer, never overflowing");
        // Near the bound: the next try is at the bound, not past it.
        let late = t0 + bound - Duration::from_secs(5);
        let b = Backoff::failed(Some(b), late, None, bound, true);
        assert_eq!(b.next, t0 + bound);
        assert_eq!(b.first, Some(t0));
        // Past the bound (only the hub's own faults are retried there): still a pause, not
        // a tight loop.
        let past = t0 + bound + Duration::from_secs(5);
        let b = Backoff::failed(Some(b), past, None, bound, false);
        assert_eq!(b.next - past, MAX_BACKOFF);
        // The hub's own faults do not start the service's clock.
        let own = Backoff::failed(None, t0, None, bound, false);
        assert_eq!(own.first, None);
        let then = Backoff::failed(Some(own), t0 + bound * 2, None, bound, true);
        assert_eq!(
            then.first,
            Some(t0 + bound * 2),
            "counted from the service's failure"
        );
    }
}
