//! The values that cross the ledger's API: what an actor claims, what it submits, what it is
//! told back, and read-only views of versions, actors and jobs. Plain data, no behaviour
//! beyond small accessors.

use std::time::Duration;

use crate::ids::{ActorId, BatchId, Digest, JobId, Timestamp, Version};

/// Where a version is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionState {
    /// D(v) exists and is being distributed; actors may stage it.
    Staged,
    /// The hub has committed v: batches may be posted for it and COMMIT(v) may be sent.
    Committed,
}

/// The state of one job. Every job is in exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobState {
    /// Posted with its batch, not yet scheduled.
    Posted,
    /// Scheduled: waiting in an actor's assignment or in the shared pool.
    Pending,
    /// Leased to an actor until its lease expires.
    Leased,
    /// Its one accepted result is stored.
    Done,
    /// Its lease expired `max_attempts` times.
    Failed,
}

impl JobState {
    pub(crate) fn parse(s: &str) -> Result<JobState, sqlx::Error> {
        Ok(match s {
            "posted" => JobState::Posted,
            "pending" => JobState::Pending,
            "leased" => JobState::Leased,
            "done" => JobState::Done,
            "failed" => JobState::Failed,
            other => {
                return Err(sqlx::Error::Decode(
                    format!("unknown job state {other:?}").into(),
                ));
            }
        })
    }
}

/// What an actor learns about one eligible actor's part of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorAssignment {
    /// The actor.
    pub actor: ActorId,
    /// Prompts reserved for it.
    pub count: u32,
    /// Whether it must be sent COMMIT(v) first (it is on v−1 with D(v) staged).
    pub commit: bool,
}

/// The outcome of scheduling one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// The batch.
    pub batch: BatchId,
    /// Its version.
    pub version: Version,
    /// One entry per eligible actor; counts sum to the batch size.
    pub shares: Vec<ActorAssignment>,
    /// Actors that were excluded (and whose τ decayed).
    pub excluded: Vec<ActorId>,
}

/// What one claim may take, and for which of the actor's job connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimLimit {
    /// The session the leases are tagged with (closing that connection releases them);
    /// `None`: the actor's newest.
    pub session: Option<crate::Session>,
    /// At most this many jobs.
    pub max: usize,
    /// At most this many bytes of stored prompts ([`ClaimedJob::prompt`]), counting
    /// `per_job` more for each job; the first job of a claim is leased whatever its size, so
    /// that no job is too large ever to be claimed.
    pub max_bytes: u64,
    /// Bytes counted for each job beyond its stored prompt.
    pub per_job: u64,
}

impl ClaimLimit {
    /// Up to `max` jobs of any size, for the actor's newest session.
    pub fn jobs(max: usize) -> Self {
        Self {
            session: None,
            max,
            max_bytes: u64::MAX,
            per_job: 0,
        }
    }
}

/// A job leased to an actor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedJob {
    /// The job.
    pub id: JobId,
    /// Its batch (for the sampling parameters, see [`crate::Ledger::batch`]).
    pub batch: BatchId,
    /// The version the result must be generated with.
    pub version: Version,
    /// The prompt.
    pub prompt: Vec<u8>,
    /// How many times it has been leased, this lease included.
    pub attempt: u32,
    /// When the lease ends unless renewed.
    pub lease_expires: Timestamp,
}

/// One result an actor submits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultSubmission {
    /// The job it answers.
    pub job: JobId,
    /// The version it was generated with.
    pub version: Version,
    /// The state digest of the weights it was generated with.
    pub digest: Digest,
    /// Tokens generated.
    pub tokens: u32,
    /// The generation time the actor reports for this result. Stored with the result for
    /// information only: τ is measured on the hub's clock, never from times an actor reports.
    pub elapsed: Duration,
    /// The rollout.
    pub payload: Vec<u8>,
}

/// Why a result was refused, and so what the actor should do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The job does not exist: drop the result.
    #[error("unknown job")]
    UnknownJob,
    /// A result for this job was already accepted (maybe this one, sent twice): drop it.
    #[error("a result for this job was already accepted")]
    AlreadyAccepted,
    /// The job ran out of attempts and is failed: drop the result.
    #[error("the job failed after too many expired leases")]
    JobFailed,
    /// Generated with a version older than the job's: the actor is behind, it should drop
    /// the result and catch up before claiming again.
    #[error("result from {result} for a job of {job}")]
    StaleVersion {
        /// The job's version.
        job: Version,
        /// The version the result claims.
        result: Version,
    },
    /// Generated with a version more than the batch's `max_staleness` behind the newest
    /// committed one: too old for the trainer; drop it and catch up.
    #[error("result from {result} is beyond the staleness bound (latest is {latest})")]
    TooStale {
        /// The version the result claims.
        result: Version,
        /// The newest committed version when it was judged.
        latest: Version,
    },
    /// The result names a version that is not committed: drop it.
    #[error("result from {0}, which is not a committed version")]
    UnknownVersion(Version),
    /// The job's batch was cancelled: drop the result.
    #[error("the batch was cancelled")]
    Cancelled,
    /// The weight digest is not the digest of the version the result names: the actor's
    /// weights have drifted;
    /// it must refuse to generate and resynchronize (anchor + chain).
    #[error("weight digest does not match the digest of the version the result names")]
    DigestMismatch,
    /// The lease ran out before the result arrived (whether or not the job was swept yet):
    /// drop the result, and claim less at a time or renew sooner.
    #[error("lease expired at {expired_at:?}")]
    LeaseExpired {
        /// When the lease ended, if still known.
        expired_at: Option<Timestamp>,
    },
    /// The job is now leased to another actor (ours expired and it was re-leased): drop it.
    #[error("the job is leased to another actor")]
    NotLeaseHolder,
}

impl Rejection {
    /// A stable short name for the reason (metrics labels, the `refusals` table, API bodies).
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::UnknownJob => "unknown_job",
            Rejection::AlreadyAccepted => "duplicate",
            Rejection::JobFailed => "job_failed",
            Rejection::StaleVersion { .. } => "behind_job",
            Rejection::TooStale { .. } => "stale",
            Rejection::UnknownVersion(_) => "unknown_version",
            Rejection::Cancelled => "cancelled",
            Rejection::DigestMismatch => "digest",
            Rejection::LeaseExpired { .. } => "lease_expired",
            Rejection::NotLeaseHolder => "not_lease_holder",
        }
    }
}

/// The verdict on one submitted result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitOutcome {
    /// The job.
    pub job: JobId,
    /// `Ok(())` if accepted (exactly once per job), otherwise the reason.
    pub verdict: Result<(), Rejection>,
}

/// The outcome of a progress report.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProgressReport {
    /// Leases that were extended (the report showed the actor's generation moving).
    pub extended: Vec<JobId>,
    /// Leases still held but not extended (nothing the actor reported moved).
    pub unmoved: Vec<JobId>,
    /// Jobs whose lease the actor no longer holds (expired, released, re-leased, done,
    /// unknown): stop working on them.
    pub lost: Vec<JobId>,
}

/// What releasing a closed connection's leases did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReleaseReport {
    /// Leased jobs that went back to the shared pool (their attempt counts).
    pub returned: u64,
    /// Leased jobs that had used their last attempt and failed.
    pub failed: u64,
    /// Unclaimed jobs of the actor's shares that went back to the shared pool (only when the
    /// closed connection was the actor's newest).
    pub unassigned: u64,
}

/// What an expiry sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpireReport {
    /// Expired leases whose jobs went back to the shared pool.
    pub returned: u64,
    /// Expired leases whose jobs ran out of attempts and failed.
    pub failed: u64,
    /// Unclaimed jobs taken back from actors that stopped sending heartbeats.
    pub released: u64,
    /// Unclaimed jobs taken back from shares their actor did not claim from within the claim
    /// timeout.
    pub unclaimed: u64,
}

impl ExpireReport {
    /// Job state transitions made.
    pub fn transitions(&self) -> u64 {
        self.returned + self.failed
    }
}

/// A registered actor, as the ledger sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorInfo {
    /// The actor.
    pub id: ActorId,
    /// Its region.
    pub region: String,
    /// Its hardware label (e.g. `H100`).
    pub hardware: String,
    /// The version it generates with.
    pub active: Option<Version>,
    /// The version it has staged.
    pub staged: Option<Version>,
    /// Throughput estimate τ, tokens per second, as the hub measured it (its initial guess
    /// until `measured`).
    pub tau: f64,
    /// How many deliveries τ was measured from.
    pub measured: u64,
    /// The round trip its first delivery after idleness costs beyond its work, in seconds,
    /// once measured (`schedule::learn`).
    pub latency_s: Option<f64>,
    /// Last heartbeat.
    pub last_heartbeat: Timestamp,
    /// When a share of it last timed out unclaimed, if it has not claimed since.
    pub stalled_since: Option<Timestamp>,
}

/// A posted batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchInfo {
    /// The batch.
    pub id: BatchId,
    /// Its version.
    pub version: Version,
    /// Number of prompts, B.
    pub size: u32,
    /// Sampling parameters, as posted (opaque to the ledger).
    pub sampling: String,
    /// Whether it has been scheduled.
    pub scheduled: bool,
}

/// Number of jobs in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JobCounts {
    /// Posted, not scheduled.
    pub posted: u64,
    /// Waiting for a claim.
    pub pending: u64,
    /// Leased.
    pub leased: u64,
    /// Done.
    pub done: u64,
    /// Failed.
    pub failed: u64,
}

impl JobCounts {
    /// All jobs.
    pub fn total(&self) -> u64 {
        self.posted + self.pending + self.leased + self.done + self.failed
    }
}

/// One job row, for inspection and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobView {
    /// The job.
    pub id: JobId,
    /// Its state.
    pub state: JobState,
    /// Times leased.
    pub attempts: u32,
    /// Current lease holder.
    pub holder: Option<ActorId>,
    /// The actor whose accepted result is stored, if done.
    pub accepted_from: Option<ActorId>,
}

/// What becomes of a group whose result the hub refused before the ledger judged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalEffect {
    /// Nothing: the lease stays, the group is re-offered if no valid result comes before it
    /// ends (a malformed result).
    KeepLease,
    /// The lease ends now and the group goes back to the shared pool (or fails, counted as
    /// `attempts`, once it has used all its attempts): a result that can never be accepted
    /// from this attempt, such as one with a NaN log-probability.
    Reoffer,
    /// The group fails at once with the refusal's code as its reason: a result that can
    /// never be delivered.
    Fail,
}

/// A refusal the hub decided itself (the result's shape, its log-probabilities, its size),
/// counted in the batch's `refusals` with the ledger's own, in the same transaction. Applies
/// only to a job leased to the submitting actor; otherwise it is only counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HubRefusal {
    /// The job.
    pub job: JobId,
    /// Its stable code (`invalid_result`, `nonfinite_logprob`, `result_too_large`, …).
    pub code: &'static str,
    /// What becomes of the group.
    pub effect: RefusalEffect,
}

/// One submit call as the hub makes it: the results to judge, which of them wait for a
/// reward service (accepted but not readable until scored), and the refusals it decided
/// itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct SubmitCall<'a> {
    /// Results for the ledger to judge.
    pub results: &'a [ResultSubmission],
    /// Jobs among `results` whose rewards come later ([`crate::Ledger::score`]).
    pub unscored: &'a [JobId],
    /// Refusals the hub decided.
    pub refused: &'a [HubRefusal],
    /// The hub's estimate of the round-trip time to the actor (its connection's), which the
    /// first delivery after idleness is measured without (`schedule::learn`).
    pub round_trip: Option<std::time::Duration>,
}

/// An accepted result waiting for its reward service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unscored {
    /// The job.
    pub job: JobId,
    /// Its batch.
    pub batch: BatchId,
    /// The version the result was generated with.
    pub version: Version,
    /// The job's prompt payload, as posted.
    pub prompt: Vec<u8>,
    /// The stored result, as accepted.
    pub payload: Vec<u8>,
}

/// Why a group failed (`failures` in a batch's status).
pub const FAIL_ATTEMPTS: &str = "attempts";
/// A cancelled batch's unfinished groups.
pub const FAIL_CANCELLED: &str = "cancelled";
