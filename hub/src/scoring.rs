//! Scoring by reward services, after acceptance.
//!
//! A result for a group whose verifier is a reward service is judged and acknowledged to its
//! actor like any other (the actor never waits for a service), and stored in the ledger
//! without a cursor: accepted, not readable. This task finds such results in the ledger
//! (so a restarted hub picks up where it stopped), calls the group's service with the prompt,
//! the completions and the answer (`reward_service`), writes the rewards into the stored
//! result and makes it readable with the next cursor (`Ledger::score`). When the service
//! fails every try, that group alone fails with reason `reward_service`
//! (`Ledger::fail_scoring`); nothing else waits for it.
//!
//! At most [`CONCURRENT`] calls are in flight; each is a task of a `JoinSet` this task owns,
//! so stopping the hub stops them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use starling_ledger::{JobId, Ledger, Unscored};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::board::{Board, FaultKind};
use crate::clock::now_ms;
use crate::reward_service::{Completion, PromptView, RewardServices, ScoreRequest};
use crate::rollouts::{GroupSpec, StoredResult};

/// Reward-service calls in flight at once.
pub(crate) const CONCURRENT: usize = 32;
/// How often the ledger is looked at when nobody says there is work.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// The failure reason of a group whose service failed.
pub(crate) const REWARD_SERVICE: &str = "reward_service";

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

/// Scores waiting results until the task is dropped.
pub(crate) async fn run(scorer: Scorer) {
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut running: HashMap<tokio::task::Id, JobId> = HashMap::new();
    let mut busy: HashSet<JobId> = HashSet::new();
    loop {
        if tasks.len() < CONCURRENT {
            let want = u32::try_from(busy.len() + CONCURRENT).unwrap_or(u32::MAX);
            match scorer.ledger.unscored(want).await {
                Ok(waiting) => {
                    for u in waiting {
                        if tasks.len() >= CONCURRENT {
                            break;
                        }
                        if busy.insert(u.job) {
                            let job = u.job;
                            let handle = tasks.spawn(score_one(scorer.clone(), u));
                            running.insert(handle.id(), job);
                        }
                    }
                }
                Err(e) => tracing::error!(
                    "read results waiting for scoring: {}",
                    starling_process::error_chain(&e)
                ),
            }
        }
        tokio::select! {
            Some(done) = tasks.join_next_with_id() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                if let Some(job) = running.remove(&id) {
                    busy.remove(&job);
                }
            }
            () = scorer.wake.notified() => {}
            () = tokio::time::sleep(IDLE_POLL) => {}
        }
    }
}

/// Scores one result, or fails its group.
async fn score_one(scorer: Scorer, u: Unscored) {
    let batch = u.batch.raw();
    let job = u.job.raw();
    match scored_payload(&scorer.services, &scorer.text, &u).await {
        Ok(payload) => match scorer.ledger.score(u.job, &payload).await {
            Ok(_) => crate::jobs::note_if_finished(&scorer.ledger, &scorer.board, batch).await,
            // Left waiting: found and tried again on a later round.
            Err(e) => tracing::error!(
                job,
                "store a scored result: {}",
                starling_process::error_chain(&e)
            ),
        },
        Err(why) => {
            tracing::warn!(job, batch, "reward service failed, the group fails: {why}");
            scorer.board.fault(
                FaultKind::RewardService,
                None,
                None,
                &format!("batch {batch} job {job}: {why}"),
                now_ms(),
            );
            match scorer.ledger.fail_scoring(u.job, REWARD_SERVICE).await {
                Ok(_) => crate::jobs::note_if_finished(&scorer.ledger, &scorer.board, batch).await,
                Err(e) => tracing::error!(
                    job,
                    "fail a group whose scoring failed: {}",
                    starling_process::error_chain(&e)
                ),
            }
        }
    }
}

/// The stored result with the service's rewards, or why there are none.
async fn scored_payload(
    services: &RewardServices,
    text: &starling_text::ModelText,
    u: &Unscored,
) -> Result<Vec<u8>, String> {
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
    let rewards = services
        .score(service, &request)
        .await
        .map_err(|e| format!("reward service {} ({}): {e}", service.name, service.url()))?;
    for (s, r) in stored.samples.iter_mut().zip(rewards) {
        s.reward = r;
    }
    serde_json::to_vec(&stored).map_err(|e| format!("encode the scored result: {e}"))
}
