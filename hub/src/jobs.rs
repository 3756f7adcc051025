//! Rollout work on the hub: the actors' job connections and the scheduler loop.
//!
//! An actor opens a connection of its own to the hub for work (the data subscription goes
//! through its region's relay), says `Work`, and then sends `Heartbeat`, `StagingTime` (to
//! the codec chooser), `Claim`, `Progress` and `Submit`; the hub answers `Claim` with `Jobs` and `Submit` with `Verdicts`. Every
//! decision is the ledger's: registration (each connection is a ledger session), heartbeats
//! (which drive eligibility), leases sized to the job and extended by progress, and
//! exactly-once acceptance under the batch's staleness bound. When the connection ends — the
//! actor stopped, died, or its link dropped (the hub sees it at most the QUIC idle timeout
//! later) — the leases that session holds are released at once and their groups re-offered,
//! rather than waiting for the leases to run out. Per-actor limits ([`crate::limits`]) bound
//! the rate of each message kind and the connections per certificate. The hub adds what only it can: the group's
//! reference answer never leaves it, and rewards are computed here by the group's verifier
//! (`rollouts::judge_result`), so an actor can neither see the answer nor forge a reward.
//!
//! Before the ledger judges a result, the hub checks what only it can: the result's shape
//! against its group (`invalid_result`), that every log-probability is finite
//! (`nonfinite_logprob`: refused, counted, and the group re-offered at once — a trainer could
//! not read it), and that it can be stored and delivered (`result_too_large`: that group
//! fails, named; the actor's other results are judged as usual). These refusals are counted
//! in the ledger with its own, in the submit's transaction. A result too large for any
//! message arrives alone in its `Submit` (the actor splits them); the hub reads its job id,
//! drops the rest unread and refuses it the same way, and the connection goes on.
//!
//! The scheduler loop ([`run_scheduler`]) splits posted batches over the eligible actors
//! (Algorithm 1, in the ledger) and sweeps expired leases back into the pool, every
//! `tick`; it is owned by the serve task and stops with it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use quinn::SendStream;
use starling_ledger::{
    ActorId, ClaimLimit, Digest, HubRefusal, JobId, Ledger, RefusalEffect, Rejection,
    ResultSubmission, ScheduleError, Session, SubmitCall, Version,
};
use starling_proto::protocol::msg::{MAX_MESSAGE_BODY, Message, RefuseReason, Role as MsgRole};
use starling_proto::protocol::rollout::{JobResult, MAX_NEW_TOKENS, MAX_SAMPLES, Verdict};
use starling_telemetry::Metrics;
use starling_transport::connections::ConnectionCap;
use starling_transport::framed::{Incoming, MessageReader, send};
use tokio::sync::Notify;

use crate::board::{Board, FaultKind};
use crate::clock::{now, now_ms};
use crate::limits::{Kind, RateLimiter, WorkerLimits};
use crate::rollouts::{GroupSpec, NONFINITE_LOGPROB, RESULT_TOO_LARGE, judge_result};
use crate::verify::Verifier;
use tracing::Instrument;

/// Most jobs one `Claim` gets.
const MAX_CLAIM: u32 = 256;
/// What a `Jobs` message holds beyond its jobs' fields, at most: its type, length and count.
const JOBS_HEADER_BYTES: u64 = 32;
/// What a job on the wire holds beyond its stored group spec, at most: its id, version,
/// attempt and lease expiry as varints (10 + 10 + 5 + 10 bytes). The rest of a job (group,
/// prompt ids, n, sampling) is in the stored spec as JSON, whose decimal numbers, commas and
/// keys take at least the bytes of their varints and raw floats
/// (`rollouts::tests::a_jobs_wire_size_is_bounded_by_its_stored_spec`).
pub(crate) const JOB_FIELDS_BYTES: u64 = 64;
/// The byte budget of one claim's stored specs, so that its `Jobs` reply fits one message
/// (`MAX_MESSAGE_BODY`, which the actor enforces): 116 jobs of 48k-token prompts would not.
/// A claim's first job is leased whatever its size; one job alone always fits (its prompt
/// holds at most `MAX_PROMPT_TOKENS` ids).
const CLAIM_BYTES: u64 = MAX_MESSAGE_BODY as u64 - JOBS_HEADER_BYTES;

/// What a worker connection records into.
#[derive(Debug, Clone)]
pub(crate) struct WorkerContext {
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) metrics: Metrics,
    pub(crate) board: Arc<Board>,
    /// The model's tokenizer: completions are decoded with it before they are scored.
    pub(crate) text: Arc<starling_text::ModelText>,
    /// The live worker connections per certificate (shared by all connections).
    pub(crate) connections: Arc<ConnectionCap>,
    pub(crate) limits: WorkerLimits,
    /// Woken when results were stored waiting for their reward service.
    pub(crate) scorer: Arc<Notify>,
    /// The codec chooser, which predicts staging from the actors' heartbeats.
    pub(crate) codecs: Arc<std::sync::Mutex<crate::codecs::Chooser>>,
    /// The actor's connection: its round-trip time measures the actor's latency apart from
    /// its rate (`starling_ledger::schedule::learn`).
    pub(crate) conn: quinn::Connection,
    /// The versions published: a result's tokens come from these.
    pub(crate) book: Arc<starling_transport::book::VersionBook>,
}

/// The largest oversized `Submit` the hub reads past (to refuse its result by name) instead
/// of dropping the connection: the largest result any group could ever produce.
fn max_oversized() -> u64 {
    starling_proto::protocol::rollout::max_result_len(MAX_SAMPLES as u32, MAX_NEW_TOKENS as u32)
        + 16
}

/// Serves one actor's job connection until it closes.
pub(crate) async fn serve_worker(
    cx: WorkerContext,
    mut tx: SendStream,
    reader: MessageReader,
    name: String,
    region: String,
    label: String,
) -> Result<()> {
    let actor = ActorId::new(name.clone()).context("actor name")?;
    let too_long = [("region", &region), ("engine and hardware label", &label)]
        .into_iter()
        .find(|(_, v)| v.len() > starling_ledger::MAX_LABEL);
    if let Some((what, v)) = too_long {
        // Said to the actor, which would otherwise reconnect and fail to register for ever.
        let refuse = Message::Refuse {
            reason: RefuseReason::Protocol,
            detail: format!(
                "its {what} is {} bytes; the ledger keeps at most {}",
                v.len(),
                starling_ledger::MAX_LABEL
            ),
        };
        send(&mut tx, &refuse).await?;
        let _ = tx.finish();
        return Ok(());
    }
    let Some(slot) = cx.connections.take(MsgRole::Actor, &name, &mut tx).await? else {
        cx.metrics.worker_refused("connections");
        return Ok(());
    };
    let session = cx
        .ledger
        .register_actor(&actor, &region, &label, now())
        .await
        .with_context(|| format!("register actor {name}"))?;
    tracing::info!(engine = %label, session = session.raw(), "worker registered");
    if slot.first() {
        // No other connection of this actor is live here: what its earlier sessions hold
        // (a connection that died, or one a previous hub process served) is no one's work.
        match cx.ledger.release_others(&actor, session).await {
            Ok(r) => {
                cx.metrics
                    .released("connection_closed", r.returned + r.failed);
                cx.metrics.expired(r.failed);
            }
            Err(e) => tracing::error!(
                "release the leases of the actor's earlier connections: {}",
                starling_process::error_chain(&e)
            ),
        }
    }
    cx.board.worker_connected(&name, &region, &label, now_ms());
    cx.metrics.peer_connected("worker", 1);
    let served = work(&cx, &actor, session, tx, reader).await;
    cx.metrics.peer_connected("worker", -1);
    let why = served.as_ref().err().map(|e| format!("{e:#}"));
    match &why {
        Some(w) => tracing::warn!("worker lost: {w}"),
        None => tracing::info!("worker left"),
    }
    cx.board
        .worker_disconnected(&name, why.as_deref(), now_ms());
    // Its report describes it while any connection of it lives (a reconnect overlaps the
    // connection it replaces, and sends its report once, at its start).
    if slot.alone() {
        cx.codecs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .forget_actor(&name);
    }
    release(&cx, &actor, session).await;
    served
}

/// The connection of `session` ended: its leases go back to the pool at once (the ledger
/// decides, in one transaction), so its groups are re-offered now rather than when the leases
/// would have run out.
async fn release(cx: &WorkerContext, actor: &ActorId, session: Session) {
    match cx.ledger.release(actor, session, now()).await {
        Ok(r) => {
            cx.metrics
                .released("connection_closed", r.returned + r.failed + r.unassigned);
            cx.metrics.expired(r.failed);
            if r.returned + r.failed + r.unassigned > 0 {
                tracing::info!(
                    returned = r.returned,
                    failed = r.failed,
                    unassigned = r.unassigned,
                    "worker's leases released"
                );
            }
            if r.failed > 0 {
                for batch in cx.board.open_batches() {
                    note_if_finished(&cx.ledger, &cx.board, batch).await;
                }
            }
        }
        Err(e) => tracing::error!(
            "release the worker's leases (they expire instead): {}",
            starling_process::error_chain(&e)
        ),
    }
}

/// The rate bucket a message draws from.
fn kind_of(m: &Message) -> Option<Kind> {
    match m {
        Message::Heartbeat { .. } => Some(Kind::Heartbeat),
        // At most one per heartbeat (an actor sends its newest version's when it heartbeats).
        Message::StagingTime { .. } => Some(Kind::StagingTime),
        Message::Progress { .. } => Some(Kind::Progress),
        Message::Claim { .. } => Some(Kind::Claim),
        Message::Submit { .. } => Some(Kind::Submit),
        _ => None,
    }
}

async fn work(
    cx: &WorkerContext,
    actor: &ActorId,
    session: Session,
    mut tx: SendStream,
    mut reader: MessageReader,
) -> Result<()> {
    let ledger = &cx.ledger;
    let mut rates = RateLimiter::new(&cx.limits, std::time::Instant::now());
    // The actor closes the connection when it stops: any end of the stream is normal.
    while let Ok(Some(incoming)) = reader.next_or_oversized(max_oversized()).await {
        let m = match incoming {
            Incoming::Message(m) => m,
            Incoming::Oversized { kind, len, head } => {
                let reply = oversized(cx, actor, kind, len, &head).await?;
                send(&mut tx, &reply).await?;
                continue;
            }
        };
        if let Some(kind) = kind_of(&m)
            && let Err(limited) = rates.admit(kind, std::time::Instant::now())
        {
            cx.metrics.worker_refused(limited.kind.code());
            let refuse = Message::Refuse {
                reason: RefuseReason::RateLimited,
                detail: limited.detail.clone(),
            };
            send(&mut tx, &refuse).await?;
            let _ = tx.finish();
            bail!("refused: {}", limited.detail);
        }
        let reply = match m {
            Message::Progress { jobs } => {
                let jobs: Vec<(JobId, u64)> = jobs
                    .iter()
                    .map(|&(j, t)| (JobId::from_raw(i64::try_from(j).unwrap_or(i64::MAX)), t))
                    .collect();
                let r = ledger
                    .progress(actor, &jobs, now())
                    .await
                    .context("record progress")?;
                cx.metrics.extended(r.extended.len() as u64);
                if !r.lost.is_empty() {
                    tracing::debug!(lost = r.lost.len(), "progress on jobs no longer held");
                }
                None
            }
            Message::StagingTime { report } => {
                cx.codecs
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .report_staging(actor.as_str(), report);
                None
            }
            Message::Heartbeat { active, staged } => {
                cx.board
                    .heartbeat(actor.as_str(), active.map(|(v, _)| v), staged, now_ms());
                let active = active.map(|(v, _)| Version::new(v)).transpose();
                let staged = staged.map(Version::new).transpose();
                if let (Ok(active), Ok(staged)) = (active, staged) {
                    ledger
                        .heartbeat(actor, active, staged, now())
                        .await
                        .context("record heartbeat")?;
                }
                None
            }
            Message::Claim { max } => Some(claim(ledger, &cx.metrics, actor, session, max).await?),
            Message::Submit { results } => Some(
                submit(cx, actor, results)
                    .instrument(tracing::debug_span!("submit"))
                    .await?,
            ),
            other => Some(Message::Refuse {
                reason: RefuseReason::Protocol,
                detail: format!(
                    "a worker may send Heartbeat, StagingTime, Claim, Progress or Submit, not {other:?}"
                ),
            }),
        };
        if let Some(reply) = reply {
            send(&mut tx, &reply).await?;
        }
    }
    Ok(())
}

/// Leases up to `max` jobs for the connection of `session` (closing it releases them), no
/// more than one `Jobs` message holds ([`CLAIM_BYTES`]).
async fn claim(
    ledger: &Ledger,
    metrics: &Metrics,
    actor: &ActorId,
    session: Session,
    max: u32,
) -> Result<Message> {
    let limit = ClaimLimit {
        session: Some(session),
        max: max.min(MAX_CLAIM) as usize,
        max_bytes: CLAIM_BYTES,
        per_job: JOB_FIELDS_BYTES,
    };
    let claimed = ledger
        .claim_within(actor, limit, now())
        .await
        .context("claim jobs")?;
    metrics.leased(claimed.len() as u64);
    let mut jobs = Vec::with_capacity(claimed.len());
    for c in &claimed {
        match GroupSpec::parse(&c.prompt) {
            Some(spec) => jobs.push(spec.wire(c)),
            // Not a group the hub wrote: it expires and fails after its attempts.
            None => tracing::error!(job = c.id.raw(), "job holds no group spec; not handed out"),
        }
    }
    Ok(Message::Jobs { jobs })
}

/// The type byte of a `Submit` message.
fn submit_type() -> u8 {
    let mut b = Vec::new();
    Message::Submit {
        results: Vec::new(),
    }
    .encode(&mut b);
    b[0]
}

/// Answers a message too large to read: a `Submit` (the actor sends a result that cannot fit
/// a message alone) has its first job refused as `result_too_large` — counted, and that
/// group failed, since no attempt could deliver it; anything else ends the connection.
async fn oversized(
    cx: &WorkerContext,
    actor: &ActorId,
    kind: u8,
    len: u64,
    head: &[u8],
) -> Result<Message> {
    let mut r = starling_proto::wire::Reader::new(head);
    let job = (kind == submit_type())
        .then(|| r.varint("result count").and_then(|_| r.varint("job id")))
        .and_then(Result::ok);
    let Some(job) = job else {
        anyhow::bail!(
            "a message of {len} bytes (type {kind}), over the {MAX_MESSAGE_BODY}-byte limit"
        );
    };
    let id = JobId::from_raw(i64::try_from(job).unwrap_or(i64::MAX));
    let refused = [HubRefusal {
        job: id,
        code: RESULT_TOO_LARGE,
        effect: RefusalEffect::Fail,
    }];
    let call = SubmitCall {
        refused: &refused,
        ..SubmitCall::default()
    };
    cx.ledger
        .submit_call(actor, call, now())
        .await
        .context("record a refusal")?;
    let detail = format!(
        "job {job}: the result is {len} bytes, over the {} MiB one message carries; the group fails",
        MAX_MESSAGE_BODY >> 20
    );
    cx.metrics.refused(RESULT_TOO_LARGE);
    tracing::warn!(job, code = RESULT_TOO_LARGE, "result refused: {detail}");
    cx.board.result_refused(
        actor.as_str(),
        RESULT_TOO_LARGE,
        &detail,
        FaultKind::Refused,
        now_ms(),
    );
    if let Some(batch) = cx
        .ledger
        .job_payloads(&[id])
        .await
        .ok()
        .and_then(|p| p.first().map(|p| p.batch.raw()))
    {
        note_if_finished(&cx.ledger, &cx.board, batch).await;
    }
    Ok(Message::Verdicts {
        verdicts: vec![(
            job,
            Verdict::Refused {
                code: RESULT_TOO_LARGE.to_owned(),
                detail: bounded(detail),
            },
        )],
    })
}

/// What a refusal the hub decides does to the group.
fn effect_of(code: &str) -> RefusalEffect {
    match code {
        NONFINITE_LOGPROB => RefusalEffect::Reoffer,
        RESULT_TOO_LARGE => RefusalEffect::Fail,
        _ => RefusalEffect::KeepLease,
    }
}

async fn submit(cx: &WorkerContext, actor: &ActorId, results: Vec<JobResult>) -> Result<Message> {
    let (ledger, metrics) = (&cx.ledger, &cx.metrics);
    let ids: Vec<JobId> = results
        .iter()
        .map(|r| JobId::from_raw(i64::try_from(r.job).unwrap_or(i64::MAX)))
        .collect();
    let payloads = ledger
        .job_payloads(&ids)
        .await
        .context("read job payloads")?;
    let batch_of: HashMap<JobId, i64> = payloads.iter().map(|p| (p.job, p.batch.raw())).collect();
    let specs: HashMap<JobId, GroupSpec> = payloads
        .into_iter()
        .filter_map(|p| Some((p.job, GroupSpec::parse(&p.prompt)?)))
        .collect();
    let max_payload = ledger.config().max_result_bytes;
    let mut verdicts: Vec<Option<Verdict>> = vec![None; results.len()];
    let mut subs = Vec::new();
    let mut unscored = Vec::new();
    let mut refused = Vec::new();
    let mut placed = Vec::new();
    for (i, (r, id)) in results.iter().zip(&ids).enumerate() {
        let mut refuse = |code: &'static str, detail: String| {
            refused.push(HubRefusal {
                job: *id,
                code,
                effect: effect_of(code),
            });
            Some(Verdict::Refused {
                code: code.to_owned(),
                detail: bounded(detail),
            })
        };
        let Some(spec) = specs.get(id) else {
            verdicts[i] = Some(Verdict::Refused {
                code: "unknown_job".into(),
                detail: format!("no job {}", r.job),
            });
            continue;
        };
        let version = match Version::new(r.version) {
            Ok(v) => v,
            Err(e) => {
                verdicts[i] = refuse("invalid_result", e.to_string());
                continue;
            }
        };
        let (stored, tokens) = match judge_result(spec, r, &cx.text, cx.book.latest()) {
            Ok(judged) => judged,
            Err(e) => {
                let code = match e.code {
                    NONFINITE_LOGPROB => NONFINITE_LOGPROB,
                    _ => "invalid_result",
                };
                verdicts[i] = refuse(code, e.message);
                continue;
            }
        };
        let payload = serde_json::to_vec(&stored).context("encode a result")?;
        if payload.len() > max_payload {
            verdicts[i] = refuse(
                RESULT_TOO_LARGE,
                format!(
                    "job {}: the result is {} bytes stored, over the ledger's {max_payload}; the group fails",
                    r.job,
                    payload.len()
                ),
            );
            continue;
        }
        let service = Verifier::parse(&spec.verifier).is_none();
        if service {
            unscored.push(*id);
        }
        let rewards: Vec<f32> = if service {
            Vec::new()
        } else {
            stored.samples.iter().map(|s| s.reward).collect()
        };
        subs.push(ResultSubmission {
            job: *id,
            version,
            digest: Digest(r.digest),
            tokens,
            // Stored for information; τ is measured on the hub's clock.
            elapsed: Duration::from_micros(r.elapsed_us),
            payload,
        });
        placed.push((i, tokens, *id, rewards));
    }
    let call = SubmitCall {
        results: &subs,
        unscored: &unscored,
        refused: &refused,
        round_trip: Some(cx.conn.rtt()),
    };
    let outcomes = ledger
        .submit_call(actor, call, now())
        .await
        .context("submit results")?;
    let at = now_ms();
    let mut touched = std::collections::BTreeSet::new();
    for r in &refused {
        touched.insert(batch_of.get(&r.job).copied().unwrap_or(-1));
    }
    let mut waiting = false;
    // Results whose weight digest is not their version's: the actor's weights drifted.
    let mut fenced = vec![false; results.len()];
    for (o, (i, tokens, job, rewards)) in outcomes.into_iter().zip(placed) {
        verdicts[i] = Some(match o.verdict {
            Ok(()) => {
                metrics.accepted(u64::from(tokens));
                let batch = batch_of.get(&job).copied().unwrap_or(-1);
                cx.board
                    .result_accepted(actor.as_str(), batch, &rewards, u64::from(tokens), at);
                touched.insert(batch);
                waiting |= unscored.contains(&job);
                Verdict::Accepted
            }
            Err(why) => {
                fenced[i] = matches!(why, Rejection::DigestMismatch);
                Verdict::Refused {
                    code: why.code().to_owned(),
                    detail: bounded(why.to_string()),
                }
            }
        });
    }
    if waiting {
        cx.scorer.notify_one();
    }
    let verdicts = results
        .iter()
        .zip(verdicts)
        .zip(fenced)
        .map(|((r, v), fenced)| {
            let v = v.unwrap_or(Verdict::Refused {
                code: "internal".into(),
                detail: "not judged".into(),
            });
            if let Verdict::Refused { code, detail } = &v {
                metrics.refused(code);
                tracing::warn!(job = r.job, code = %code, "result refused: {detail}");
                let kind = if fenced {
                    FaultKind::Fenced
                } else {
                    FaultKind::Refused
                };
                cx.board
                    .result_refused(actor.as_str(), code, detail, kind, at);
            }
            (r.job, v)
        })
        .collect();
    for batch in touched {
        note_if_finished(ledger, &cx.board, batch).await;
    }
    Ok(Message::Verdicts { verdicts })
}

/// Tells the board when every job of `batch` is done or failed and every result readable
/// (once).
pub(crate) async fn note_if_finished(ledger: &Ledger, board: &Board, batch: i64) {
    if batch < 0 || board.batch_is_finished(batch) {
        return;
    }
    match ledger
        .batch_status(starling_ledger::BatchId::from_raw(batch))
        .await
    {
        Ok(s) if s.finished() => {
            board.batch_finished(batch, now_ms());
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(
            batch,
            "read batch status: {}",
            starling_process::error_chain(&e)
        ),
    }
}

/// Schedules posted batches and sweeps expired leases every `tick`, until the task is dropped.
pub(crate) async fn run_scheduler(
    ledger: Arc<Ledger>,
    metrics: Metrics,
    board: Arc<Board>,
    tick: Duration,
) {
    let mut timer = tokio::time::interval(tick);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        timer.tick().await;
        match ledger.expire(now()).await {
            Ok(r) => {
                let n = r.returned + r.failed;
                metrics.expired(n);
                metrics.released("unclaimed", r.unclaimed);
                metrics.released("silent", r.released);
                if r.unclaimed > 0 {
                    tracing::warn!(
                        jobs = r.unclaimed,
                        "shares not claimed within the claim timeout went back to the pool"
                    );
                }
                if n > 0 {
                    tracing::warn!(returned = r.returned, failed = r.failed, "leases expired");
                    board.leases_expired(n, now_ms());
                    // Failed jobs can finish a batch without another result arriving.
                    for batch in board.open_batches() {
                        note_if_finished(&ledger, &board, batch).await;
                    }
                }
            }
            Err(e) => tracing::error!("lease sweep failed: {}", starling_process::error_chain(&e)),
        }
        let batches = match ledger.unscheduled_batches(64).await {
            Ok(b) => b,
            Err(e) => {
                tracing::error!("read posted batches: {}", starling_process::error_chain(&e));
                continue;
            }
        };
        for b in batches {
            match ledger.schedule(b, now()).await {
                Ok(a) => {
                    tracing::info!(
                        batch = b.raw(),
                        version = a.version.number(),
                        actors = a.shares.len(),
                        "batch scheduled"
                    );
                    board.batch_scheduled(b.raw(), a.version.number(), a.shares.len(), now_ms());
                }
                // No actor can run it yet: try again next tick.
                Err(ScheduleError::NoEligibleActors(_)) => {}
                Err(e) => tracing::error!(
                    batch = b.raw(),
                    "schedule batch: {}",
                    starling_process::error_chain(&e)
                ),
            }
        }
    }
}

/// A group's token budget, which sizes its lease: every sample may run to `max_new_tokens`,
/// and the prompt is processed once per sample.
pub(crate) fn token_budget(spec: &GroupSpec) -> u64 {
    u64::from(spec.n) * (u64::from(spec.sampling.max_new_tokens) + spec.prompt_ids.len() as u64)
}

/// A refusal's detail within what the wire carries.
fn bounded(mut detail: String) -> String {
    let max = starling_proto::protocol::rollout::MAX_DETAIL_LEN;
    if detail.len() > max {
        let mut cut = max;
        while !detail.is_char_boundary(cut) {
            cut -= 1;
        }
        detail.truncate(cut);
    }
    detail
}
