//! The job ledger: the control plane's memory of versions, actors, batches, jobs, leases and
//! results, over SQL (SQLite by default, PostgreSQL by URL), with the throughput-aware
//! scheduler of SparrowRL §5.3 and the lease rules of §5.4.
//!
//! Architecture invariants:
//! - the database is the only source of truth: every state change is one transaction, and
//!   nothing the ledger decides is held in memory (leases, their sessions, throughput
//!   measurements and stalls are rows), so a restarted hub carries on from the database;
//! - a job is in exactly one state (`posted → pending → leased → done`, or back to `pending`
//!   on lease expiry or release, or `failed` after `max_attempts` leases), enforced by CHECK
//!   constraints and verified by [`Ledger::check_invariants`];
//! - a result is accepted at most once per job (transactional check + `UNIQUE (job_id)`), and
//!   only under a valid lease held by the submitter, with the job's version and that
//!   version's digest;
//! - the ledger never reads a clock: every operation takes `now` (see [`clock`]);
//! - every request is bounded ([`LedgerConfig`]).
//!
//! Code map: [`schedule`] (pure Algorithm 1 and the delivery interval τ is measured over),
//! `verdict` (pure acceptance rule), `lease` (pure lease sizing and progress), `sqlite` and
//! `postgres` (the two backends), `sql` (what they share), `run` (the hub's side: versions,
//! batch status, result stream by cursor, scoring), `retention` (archiving delivered
//! batches), [`invariants`] (checks over all rows). See `docs/ledger.md`.

pub mod clock;
mod config;
mod error;
mod ids;
pub mod invariants;
mod lease;
mod model;
mod postgres;
#[macro_use]
mod run;
mod retention;
pub mod schedule;
mod sql;
mod sqlite;
mod verdict;

use std::future::Future;
use std::time::Duration;

pub use config::{ConfigError, LeaseConfig, LedgerConfig};
pub use error::{
    ActorError, ArchiveError, CancelError, ClaimError, ExpireError, OpenError, PostError,
    ProgressError, ReadError, ReleaseError, ScheduleError, ScoreError, SubmitError, VersionError,
};
pub use ids::{
    ActorId, BatchId, Digest, InvalidActorId, JobId, Session, Timestamp, Version, VersionOutOfRange,
};
pub use invariants::{InvariantError, InvariantViolation};
pub use model::{
    ActorAssignment, ActorInfo, Assignment, BatchInfo, ClaimLimit, ClaimedJob, ExpireReport,
    FAIL_ATTEMPTS, FAIL_CANCELLED, HubRefusal, JobCounts, JobState, JobView, ProgressReport,
    RefusalEffect, Rejection, ReleaseReport, ResultSubmission, SubmitCall, SubmitOutcome, Unscored,
    VersionState,
};
pub use retention::Retention;
pub use run::{AcceptedResult, Archive, BatchStatus, JobPayload, ResultsPage, VersionRecord};

use error::Retryable;

/// Which database a ledger runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// An SQLite file.
    Sqlite,
    /// A PostgreSQL server.
    Postgres,
}

#[derive(Debug)]
enum Store {
    Sqlite(sqlite::SqliteStore),
    Postgres(postgres::PgStore),
}

/// Dispatches one call to the backend.
macro_rules! on_store {
    ($self:ident, $s:ident => $call:expr) => {
        match &$self.store {
            Store::Sqlite($s) => $call.await,
            Store::Postgres($s) => retry(|| $call).await,
        }
    };
}

/// Retries a PostgreSQL transaction that failed with a serialization failure or deadlock.
async fn retry<T, E: Retryable, F: Future<Output = Result<T, E>>>(
    mut f: impl FnMut() -> F,
) -> Result<T, E> {
    let mut attempt = 0u32;
    loop {
        match f().await {
            Err(e) if e.is_retryable() && attempt < 8 => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(u64::from(attempt) * 2)).await;
            }
            other => return other,
        }
    }
}

/// The job ledger. Cheap to share behind an `Arc`; all methods take `&self`.
#[derive(Debug)]
pub struct Ledger {
    store: Store,
    config: LedgerConfig,
}

/// The longest region or hardware label an actor registers with (bytes).
pub const MAX_LABEL: usize = 256;

/// The staleness bound of a batch posted without one: SparrowRL's one-step lag.
pub const DEFAULT_MAX_STALENESS: u64 = 1;

impl Ledger {
    /// Opens (creating if needed) the ledger at `url` — `sqlite:PATH` (or `sqlite://PATH`) or
    /// `postgres://…` — and applies the schema migrations.
    pub async fn open(url: &str, config: LedgerConfig) -> Result<Ledger, OpenError> {
        config.validate()?;
        let store = if url.starts_with("sqlite:") {
            Store::Sqlite(sqlite::SqliteStore::open(url).await?)
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Store::Postgres(postgres::PgStore::open(url, config.postgres_pool_size).await?)
        } else {
            return Err(OpenError::UnsupportedUrl(url.to_owned()));
        };
        Ok(Ledger { store, config })
    }

    /// Closes the connection pool, waiting for queries in flight.
    pub async fn close(&self) {
        match &self.store {
            Store::Sqlite(s) => s.close().await,
            Store::Postgres(s) => s.close().await,
        }
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        match self.store {
            Store::Sqlite(_) => Backend::Sqlite,
            Store::Postgres(_) => Backend::Postgres,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &LedgerConfig {
        &self.config
    }

    /// Registers version `version` (as staged) with its base and weight digest. Idempotent
    /// when repeated with the same base and digest.
    pub async fn register_version(
        &self,
        version: Version,
        base: Option<Version>,
        digest: Digest,
        now: Timestamp,
    ) -> Result<(), VersionError> {
        on_store!(self, s => s.register_version(version, base, digest, now))
    }

    /// Marks a version committed: batches may now be posted for it. Idempotent.
    pub async fn commit_version(
        &self,
        version: Version,
        now: Timestamp,
    ) -> Result<(), VersionError> {
        on_store!(self, s => s.commit_version(version, now))
    }

    /// Registers an actor (or updates its labels if known; its τ is kept) for a new job
    /// connection, and returns that connection's session: the leases it claims are tagged
    /// with it, and [`Ledger::release`] returns them when the connection closes.
    pub async fn register_actor(
        &self,
        id: &ActorId,
        region: &str,
        hardware: &str,
        now: Timestamp,
    ) -> Result<Session, ActorError> {
        if region.len() > MAX_LABEL {
            return Err(ActorError::LabelTooLong("region"));
        }
        if hardware.len() > MAX_LABEL {
            return Err(ActorError::LabelTooLong("hardware"));
        }
        let tau = self.config.initial_tau;
        on_store!(self, s => s.register_actor(id, region, hardware, tau, now))
    }

    /// Records an actor's heartbeat: the version it generates with and the one it has staged.
    pub async fn heartbeat(
        &self,
        actor: &ActorId,
        active: Option<Version>,
        staged: Option<Version>,
        now: Timestamp,
    ) -> Result<(), ActorError> {
        on_store!(self, s => s.heartbeat(actor, active, staged, now))
    }

    /// Posts a batch of prompts for a committed version, with the default staleness bound
    /// ([`DEFAULT_MAX_STALENESS`]). Its jobs wait in state `posted` until
    /// [`Ledger::schedule`] splits them over the eligible actors.
    pub async fn post_batch(
        &self,
        version: Version,
        prompts: &[Vec<u8>],
        sampling: &str,
        now: Timestamp,
    ) -> Result<BatchId, PostError> {
        self.post_batch_bounded(version, prompts, sampling, DEFAULT_MAX_STALENESS, now)
            .await
    }

    /// Posts a batch whose results are accepted only from versions at most `max_staleness`
    /// behind the newest committed version when they are judged (and never older than
    /// `version`).
    pub async fn post_batch_bounded(
        &self,
        version: Version,
        prompts: &[Vec<u8>],
        sampling: &str,
        max_staleness: u64,
        now: Timestamp,
    ) -> Result<BatchId, PostError> {
        let budgets = vec![0; prompts.len()];
        self.post_batch_budgeted(version, prompts, &budgets, sampling, max_staleness, now)
            .await
    }

    /// Posts a batch as [`Ledger::post_batch_bounded`] does, with each job's token budget
    /// (`n × max_new_tokens` + prompt tokens; 0 = unknown), which sizes its lease at claim.
    pub async fn post_batch_budgeted(
        &self,
        version: Version,
        prompts: &[Vec<u8>],
        budgets: &[u64],
        sampling: &str,
        max_staleness: u64,
        now: Timestamp,
    ) -> Result<BatchId, PostError> {
        let c = &self.config;
        if budgets.len() != prompts.len() {
            return Err(PostError::BudgetCount {
                prompts: prompts.len(),
                budgets: budgets.len(),
            });
        }
        if prompts.is_empty() {
            return Err(PostError::Empty);
        }
        if prompts.len() > c.max_batch_size {
            return Err(PostError::TooLarge(prompts.len(), c.max_batch_size));
        }
        if let Some((index, p)) = prompts
            .iter()
            .enumerate()
            .find(|(_, p)| p.len() > c.max_prompt_bytes)
        {
            return Err(PostError::PromptTooLarge {
                index,
                len: p.len(),
            });
        }
        if sampling.len() > c.max_sampling_bytes {
            return Err(PostError::SamplingTooLarge);
        }
        let bound = i64::try_from(max_staleness).unwrap_or(i64::MAX);
        on_store!(self, s => s.post_batch(version, prompts, budgets, sampling, bound, now))
    }

    /// Schedules a posted batch (Algorithm 1): splits it over the eligible actors in
    /// proportion to τ, reserves each actor's share, records who must get COMMIT(v), and
    /// decays τ of the excluded actors. Actors without a heartbeat within `actor_timeout`
    /// count as ineligible.
    pub async fn schedule(
        &self,
        batch: BatchId,
        now: Timestamp,
    ) -> Result<Assignment, ScheduleError> {
        let (alpha, timeout, split) = (
            self.config.alpha,
            self.config.actor_timeout,
            self.config.split,
        );
        on_store!(self, s => s.schedule(batch, now, alpha, timeout, split))
    }

    /// Leases up to `max` jobs to `actor`, tagged with its newest session: first from its own
    /// share of scheduled batches, then — only if it held no lease before this claim, so a
    /// pipelining actor does not take pooled jobs an idle one could start at once — from the
    /// shared pool (jobs returned by expiry, release or the claim timeout). Either way only
    /// jobs of versions it can run now: its active version, or the next one once it has
    /// staged it. Each lease covers the budget of everything the actor then holds at its
    /// measured throughput (see `lease`). The claim also tells the ledger the actor takes
    /// work (a stalled actor is scheduled again) and moves its delivery interval
    /// ([`schedule::interval_after_claim`]).
    pub async fn claim(
        &self,
        actor: &ActorId,
        max: usize,
        now: Timestamp,
    ) -> Result<Vec<ClaimedJob>, ClaimError> {
        self.claim_within(actor, ClaimLimit::jobs(max), now).await
    }

    /// [`Ledger::claim`] within `limit`: for one job connection of the actor (its leases are
    /// tagged with that session, whatever connection the actor opened since), and up to a
    /// byte budget, so that what is claimed fits one message to the actor.
    pub async fn claim_within(
        &self,
        actor: &ActorId,
        limit: ClaimLimit,
        now: Timestamp,
    ) -> Result<Vec<ClaimedJob>, ClaimError> {
        if limit.max > self.config.max_per_call {
            return Err(ClaimError::TooMany(limit.max, self.config.max_per_call));
        }
        let c = &self.config;
        on_store!(self, s => s.claim(actor, limit, now, &c.lease, c.max_claim_gap))
    }

    /// Records `actor`'s progress — tokens generated so far for each job it holds — and, if
    /// any count moved, extends the reported leases it still holds (see `lease`). Jobs it no
    /// longer holds are reported lost.
    pub async fn progress(
        &self,
        actor: &ActorId,
        jobs: &[(JobId, u64)],
        now: Timestamp,
    ) -> Result<ProgressReport, ProgressError> {
        if jobs.len() > self.config.max_per_call {
            return Err(ProgressError::TooMany(jobs.len(), self.config.max_per_call));
        }
        if jobs.is_empty() {
            return Ok(ProgressReport::default());
        }
        let lease = &self.config.lease;
        on_store!(self, s => s.progress(actor, jobs, now, lease))
    }

    /// The job connection `session` of `actor` closed: its leases go back to the shared pool
    /// at once (the attempt counts; a job on its last attempt fails), and if it was the
    /// actor's newest connection, the unclaimed rest of its shares too and its delivery
    /// interval ends.
    pub async fn release(
        &self,
        actor: &ActorId,
        session: Session,
        now: Timestamp,
    ) -> Result<ReleaseReport, ReleaseError> {
        let max_attempts = self.config.max_attempts;
        on_store!(self, s => s.release(actor, session, now, max_attempts))
    }

    /// `actor` connected as `keep` and holds no other live connection: the leases its earlier
    /// sessions still hold (their connections died, or a previous hub process served them)
    /// go back to the pool at once, as [`Ledger::release`] would have returned them.
    pub async fn release_others(
        &self,
        actor: &ActorId,
        keep: Session,
    ) -> Result<ReleaseReport, ReleaseError> {
        let max_attempts = self.config.max_attempts;
        on_store!(self, s => s.release_others(actor, keep, max_attempts))
    }

    /// Returns jobs whose lease expired before `now` to the shared pool (or fails them after
    /// `max_attempts`), releases unclaimed shares of actors silent for `actor_timeout`, and
    /// returns shares nobody claimed from for `claim_timeout` (marking their actors stalled).
    /// Handles at most `max_expire_per_sweep` leases per call.
    pub async fn expire(&self, now: Timestamp) -> Result<ExpireReport, ExpireError> {
        let c = &self.config;
        let (max_attempts, limit, timeout) =
            (c.max_attempts, c.max_expire_per_sweep, c.actor_timeout);
        let claim_cutoff = now.minus(c.claim_timeout);
        on_store!(self, s => s.expire(now, max_attempts, limit, timeout, claim_cutoff))
    }

    /// Submits results from `actor`, in one transaction. Each gets a verdict: accepted exactly
    /// once per job, or rejected with a [`Rejection`] the actor can act on. The accepted
    /// tokens over the wall time of the actor's delivery interval (on the hub's clock: from
    /// its previous accepted submit, or from the claim that ended its idleness) update its τ
    /// (EMA with β; the first measurement replaces the initial guess), and open the next
    /// interval.
    pub async fn submit(
        &self,
        actor: &ActorId,
        results: &[ResultSubmission],
        now: Timestamp,
    ) -> Result<Vec<SubmitOutcome>, SubmitError> {
        let call = SubmitCall {
            results,
            ..SubmitCall::default()
        };
        self.submit_call(actor, call, now).await
    }

    /// [`Ledger::submit`] as the hub makes it: the results in `call` are judged as there;
    /// those listed in `call.unscored` are accepted but not readable until
    /// [`Ledger::score`]; and the refusals the hub decided itself (`call.refused`) are
    /// counted with the ledger's and applied ([`RefusalEffect`]) — all in one transaction
    /// that is durable before it returns.
    pub async fn submit_call(
        &self,
        actor: &ActorId,
        call: SubmitCall<'_>,
        now: Timestamp,
    ) -> Result<Vec<SubmitOutcome>, SubmitError> {
        let c = &self.config;
        let results = call.results;
        if results.len() > c.max_per_call || call.refused.len() > c.max_per_call {
            return Err(SubmitError::TooMany(
                results.len().max(call.refused.len()),
                c.max_per_call,
            ));
        }
        if let Some(r) = results
            .iter()
            .find(|r| r.payload.len() > c.max_result_bytes)
        {
            return Err(SubmitError::PayloadTooLarge(r.payload.len()));
        }
        if results.is_empty() && call.refused.is_empty() {
            return Ok(Vec::new());
        }
        let (beta, attempts) = (c.beta, c.max_attempts);
        on_store!(self, s => s.submit(actor, call, now, beta, attempts))
    }

    /// Checks every invariant over all rows; returns the violated ones.
    pub async fn check_invariants(&self) -> Result<(), InvariantError> {
        let m = self.config.max_attempts;
        match &self.store {
            Store::Sqlite(s) => s.check_invariants(m).await,
            Store::Postgres(s) => s.check_invariants(m).await,
        }
    }

    /// One actor's row.
    pub async fn actor(&self, id: &ActorId) -> Result<ActorInfo, ReadError> {
        match &self.store {
            Store::Sqlite(s) => s.actor(id).await,
            Store::Postgres(s) => s.actor(id).await,
        }
    }

    /// One batch (with its sampling parameters).
    pub async fn batch(&self, id: BatchId) -> Result<BatchInfo, ReadError> {
        match &self.store {
            Store::Sqlite(s) => s.batch(id).await,
            Store::Postgres(s) => s.batch(id).await,
        }
    }

    /// The recorded assignment of a scheduled batch (to resend COMMIT after a restart, say).
    pub async fn assignment(&self, batch: BatchId) -> Result<Vec<ActorAssignment>, ReadError> {
        match &self.store {
            Store::Sqlite(s) => s.assignment(batch).await,
            Store::Postgres(s) => s.assignment(batch).await,
        }
    }

    /// One job's state, lease holder and accepted submitter.
    pub async fn job(&self, id: JobId) -> Result<JobView, ReadError> {
        match &self.store {
            Store::Sqlite(s) => s.job(id).await,
            Store::Postgres(s) => s.job(id).await,
        }
    }

    /// Whether a version is staged or committed.
    pub async fn version_state(&self, version: Version) -> Result<VersionState, ReadError> {
        match &self.store {
            Store::Sqlite(s) => s.version_state(version).await,
            Store::Postgres(s) => s.version_state(version).await,
        }
    }
}
