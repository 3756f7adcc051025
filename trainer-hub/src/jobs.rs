//! Rollout work on the hub: the actors' job connections and the scheduler loop.
//!
//! An actor opens a connection of its own to the hub for work (the data subscription goes
//! through its region's relay), says `Work`, and then sends `Heartbeat`, `Claim` and `Submit`;
//! the hub answers `Claim` with `Jobs` and `Submit` with `Verdicts`. Every decision is the
//! ledger's: registration, heartbeats (which drive eligibility), leases, and exactly-once
//! acceptance under the batch's staleness bound. The hub adds what only it can: the group's
//! reference answer never leaves it, and rewards are computed here by the group's verifier
//! (`rollouts::judge_result`), so an actor can neither see the answer nor forge a reward.
//!
//! The scheduler loop ([`run_scheduler`]) splits posted batches over the eligible actors
//! (Algorithm 1, in the ledger) and sweeps expired leases back into the pool, every
//! `tick`; it is owned by the serve task and stops with it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use quinn::SendStream;
use starling_ledger::{ActorId, Digest, JobId, Ledger, ResultSubmission, ScheduleError, Version};
use starling_proto::msg::{Message, RefuseReason};
use starling_proto::rollout::{JobResult, Verdict};
use starling_telemetry::Metrics;
use starling_transport::framed::{MessageReader, send};

use crate::durable::now;
use crate::rollouts::{GroupSpec, judge_result};

/// Most jobs one `Claim` gets.
const MAX_CLAIM: u32 = 256;

/// Serves one actor's job connection until it closes.
pub(crate) async fn serve_worker(
    ledger: Arc<Ledger>,
    metrics: Metrics,
    mut tx: SendStream,
    mut reader: MessageReader,
    name: String,
    region: String,
    label: String,
) -> Result<()> {
    let actor = ActorId::new(name.clone()).context("actor name")?;
    ledger
        .register_actor(&actor, &region, &label, now())
        .await
        .with_context(|| format!("register actor {name}"))?;
    eprintln!("worker {name} ({label}) in region {region} registered");
    // The actor closes the connection when it stops: any end of the stream is normal.
    while let Ok(Some(m)) = reader.next().await {
        let reply = match m {
            Message::Heartbeat { active, staged } => {
                let active = active.map(|(v, _)| Version::new(v)).transpose();
                let staged = staged.map(Version::new).transpose();
                if let (Ok(active), Ok(staged)) = (active, staged) {
                    ledger
                        .heartbeat(&actor, active, staged, now())
                        .await
                        .context("record heartbeat")?;
                }
                None
            }
            Message::Claim { max } => Some(claim(&ledger, &metrics, &actor, max).await?),
            Message::Submit { results } => Some(submit(&ledger, &metrics, &actor, results).await?),
            other => Some(Message::Refuse {
                reason: RefuseReason::Protocol,
                detail: format!("a worker may send Heartbeat, Claim or Submit, not {other:?}"),
            }),
        };
        if let Some(reply) = reply {
            send(&mut tx, &reply).await?;
        }
    }
    Ok(())
}

async fn claim(ledger: &Ledger, metrics: &Metrics, actor: &ActorId, max: u32) -> Result<Message> {
    let max = max.min(MAX_CLAIM) as usize;
    let claimed = ledger
        .claim(actor, max, now())
        .await
        .context("claim jobs")?;
    metrics.leased(claimed.len() as u64);
    let mut jobs = Vec::with_capacity(claimed.len());
    for c in &claimed {
        match GroupSpec::parse(&c.prompt) {
            Some(spec) => jobs.push(spec.wire(c)),
            // Not a group the hub wrote: it expires and fails after its attempts.
            None => eprintln!("job {} holds no group spec; not handed out", c.id.raw()),
        }
    }
    Ok(Message::Jobs { jobs })
}

async fn submit(
    ledger: &Ledger,
    metrics: &Metrics,
    actor: &ActorId,
    results: Vec<JobResult>,
) -> Result<Message> {
    let ids: Vec<JobId> = results
        .iter()
        .map(|r| JobId::from_raw(i64::try_from(r.job).unwrap_or(i64::MAX)))
        .collect();
    let specs: HashMap<JobId, GroupSpec> = ledger
        .job_payloads(&ids)
        .await
        .context("read job payloads")?
        .into_iter()
        .filter_map(|p| Some((p.job, GroupSpec::parse(&p.prompt)?)))
        .collect();
    let mut verdicts: Vec<Option<Verdict>> = vec![None; results.len()];
    let mut subs = Vec::new();
    let mut placed = Vec::new();
    for (i, (r, id)) in results.iter().zip(&ids).enumerate() {
        let refused = |code: &str, detail: String| Verdict::Refused {
            code: code.to_owned(),
            detail: bounded(detail),
        };
        let Some(spec) = specs.get(id) else {
            verdicts[i] = Some(refused("unknown_job", format!("no job {}", r.job)));
            continue;
        };
        let version = match Version::new(r.version) {
            Ok(v) => v,
            Err(e) => {
                verdicts[i] = Some(refused("invalid_result", e.to_string()));
                continue;
            }
        };
        match judge_result(spec, r) {
            Ok((stored, tokens)) => {
                subs.push(ResultSubmission {
                    job: *id,
                    version,
                    digest: Digest(r.digest),
                    tokens,
                    elapsed: Duration::from_micros(r.elapsed_us),
                    payload: serde_json::to_vec(&stored).unwrap_or_default(),
                });
                placed.push((i, tokens));
            }
            Err(e) => verdicts[i] = Some(refused(e.code, e.message)),
        }
    }
    let outcomes = ledger
        .submit(actor, &subs, now())
        .await
        .context("submit results")?;
    for (o, (i, tokens)) in outcomes.into_iter().zip(placed) {
        verdicts[i] = Some(match o.verdict {
            Ok(()) => {
                metrics.accepted(u64::from(tokens));
                Verdict::Accepted
            }
            Err(why) => Verdict::Refused {
                code: why.code().to_owned(),
                detail: bounded(why.to_string()),
            },
        });
    }
    let verdicts = results
        .iter()
        .zip(verdicts)
        .map(|(r, v)| {
            let v = v.unwrap_or(Verdict::Refused {
                code: "internal".into(),
                detail: "not judged".into(),
            });
            if let Verdict::Refused { code, .. } = &v {
                metrics.refused(code);
            }
            (r.job, v)
        })
        .collect();
    Ok(Message::Verdicts { verdicts })
}

/// Schedules posted batches and sweeps expired leases every `tick`, until the task is dropped.
pub(crate) async fn run_scheduler(ledger: Arc<Ledger>, metrics: Metrics, tick: Duration) {
    let mut timer = tokio::time::interval(tick);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        timer.tick().await;
        match ledger.expire(now()).await {
            Ok(r) => metrics.expired(r.returned + r.failed),
            Err(e) => eprintln!("lease sweep failed: {e:#}"),
        }
        let batches = match ledger.unscheduled_batches(64).await {
            Ok(b) => b,
            Err(e) => {
                eprintln!("read posted batches: {e:#}");
                continue;
            }
        };
        for b in batches {
            match ledger.schedule(b, now()).await {
                Ok(a) => eprintln!(
                    "scheduled batch {} (version {}) over {} actors",
                    b.raw(),
                    a.version.number(),
                    a.shares.len()
                ),
                // No actor can run it yet: try again next tick.
                Err(ScheduleError::NoEligibleActors(_)) => {}
                Err(e) => eprintln!("schedule batch {}: {e:#}", b.raw()),
            }
        }
    }
}

/// A refusal's detail within what the wire carries.
fn bounded(mut detail: String) -> String {
    let max = starling_proto::rollout::MAX_DETAIL_LEN;
    if detail.len() > max {
        let mut cut = max;
        while !detail.is_char_boundary(cut) {
            cut -= 1;
        }
        detail.truncate(cut);
    }
    detail
}
