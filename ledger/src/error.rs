//! One error enum per operation; each variant names the failure. Database failures are
//! carried as `Database`; PostgreSQL serialization failures and deadlocks are retried before
//! they surface (see [`Retryable`]).

use thiserror::Error;

use crate::config::ConfigError;
use crate::ids::{ActorId, BatchId, Version};

/// Opening a ledger failed.
#[derive(Debug, Error)]
pub enum OpenError {
    /// The URL is neither `sqlite:` nor `postgres:`/`postgresql:`.
    #[error("unsupported database URL {0:?}: expected sqlite:PATH or postgres://…")]
    UnsupportedUrl(String),
    /// The configuration is out of range.
    #[error("invalid ledger configuration")]
    Config(#[from] ConfigError),
    /// Connecting failed.
    #[error("connect to the ledger database")]
    Connect(#[source] sqlx::Error),
    /// Applying the schema migrations failed.
    #[error("migrate the ledger schema")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// Reading the lease history failed.
    #[error("load lease history")]
    Database(#[from] sqlx::Error),
}

/// Registering or committing a version failed.
#[derive(Debug, Error)]
pub enum VersionError {
    /// The version exists with another base or digest.
    #[error("{0} is already registered with another base or digest")]
    Conflict(Version),
    /// The declared base is not registered.
    #[error("base {0} is not registered")]
    UnknownBase(Version),
    /// The version is not registered.
    #[error("{0} is not registered")]
    UnknownVersion(Version),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Registering an actor or recording its heartbeat failed.
#[derive(Debug, Error)]
pub enum ActorError {
    /// The actor is not registered.
    #[error("actor {0} is not registered")]
    UnknownActor(ActorId),
    /// A label is longer than 256 bytes.
    #[error("{0} label longer than 256 bytes")]
    LabelTooLong(&'static str),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Posting a batch failed.
#[derive(Debug, Error)]
pub enum PostError {
    /// The version is not registered.
    #[error("{0} is not registered")]
    UnknownVersion(Version),
    /// The version is registered but not committed.
    #[error("{0} is not committed")]
    NotCommitted(Version),
    /// The batch has no prompts.
    #[error("empty batch")]
    Empty,
    /// More prompts than `max_batch_size`.
    #[error("batch of {0} prompts exceeds the limit of {1}")]
    TooLarge(usize, usize),
    /// A prompt is larger than `max_prompt_bytes`.
    #[error("prompt {index} is {len} bytes, above the limit")]
    PromptTooLarge {
        /// Position in the batch.
        index: usize,
        /// Its size.
        len: usize,
    },
    /// The budgets do not match the prompts one for one.
    #[error("{budgets} token budgets for {prompts} prompts")]
    BudgetCount {
        /// Prompts posted.
        prompts: usize,
        /// Budgets given.
        budgets: usize,
    },
    /// The sampling parameters are larger than `max_sampling_bytes`.
    #[error("sampling parameters above the size limit")]
    SamplingTooLarge,
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Scheduling a batch failed.
#[derive(Debug, Error)]
pub enum ScheduleError {
    /// The batch does not exist.
    #[error("{0} does not exist")]
    UnknownBatch(BatchId),
    /// The batch was scheduled before.
    #[error("{0} is already scheduled")]
    AlreadyScheduled(BatchId),
    /// No actor can run the batch's version; try again once actors catch up.
    #[error(transparent)]
    NoEligibleActors(#[from] crate::schedule::NoEligibleActors),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Claiming jobs failed.
#[derive(Debug, Error)]
pub enum ClaimError {
    /// The actor is not registered.
    #[error("actor {0} is not registered")]
    UnknownActor(ActorId),
    /// More jobs asked for than `max_per_call`.
    #[error("claim of {0} jobs exceeds the limit of {1}")]
    TooMany(usize, usize),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Recording progress (and extending leases) failed.
#[derive(Debug, Error)]
pub enum ProgressError {
    /// More jobs than `max_per_call`.
    #[error("progress report of {0} jobs exceeds the limit of {1}")]
    TooMany(usize, usize),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Releasing a closed connection's leases failed.
#[derive(Debug, Error)]
pub enum ReleaseError {
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Sweeping expired leases failed.
#[derive(Debug, Error)]
pub enum ExpireError {
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Submitting results failed as a whole (individual refusals are [`crate::Rejection`]s).
#[derive(Debug, Error)]
pub enum SubmitError {
    /// The actor is not registered.
    #[error("actor {0} is not registered")]
    UnknownActor(ActorId),
    /// More results than `max_per_call`.
    #[error("submission of {0} results exceeds the limit of {1}")]
    TooMany(usize, usize),
    /// A payload is larger than `max_result_bytes`.
    #[error("result payload of {0} bytes is above the limit")]
    PayloadTooLarge(usize),
    /// The database changed under the transaction in a way its checks exclude; nothing was
    /// written. (Should not happen; reported rather than accepting twice.)
    #[error("job rows changed during the submit transaction")]
    Conflict,
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Reading the ledger failed.
#[derive(Debug, Error)]
pub enum ReadError {
    /// The thing asked for does not exist.
    #[error("not found")]
    NotFound,
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Scoring a result (or failing its scoring) failed.
#[derive(Debug, Error)]
pub enum ScoreError {
    /// The scored payload is larger than `max_result_bytes`.
    #[error("scored result payload of {0} bytes is above the limit")]
    PayloadTooLarge(usize),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Archiving a batch failed.
#[derive(Debug, Error)]
pub enum ArchiveError {
    /// The batch does not exist.
    #[error("{0} does not exist")]
    UnknownBatch(BatchId),
    /// The batch changed since its results were written out (a result became readable or
    /// it was archived before): nothing was deleted.
    #[error("{0} changed while its results were archived")]
    Changed(BatchId),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}

/// Errors whose database failures may be transient (PostgreSQL serialization failures and
/// deadlocks), so that the whole transaction can be retried.
pub(crate) trait Retryable {
    fn is_retryable(&self) -> bool;
}

pub(crate) fn sqlx_is_retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("40001") | Some("40P01"))
        }
        _ => false,
    }
}

macro_rules! retryable {
    ($($t:ty),*) => {$(
        impl Retryable for $t {
            fn is_retryable(&self) -> bool {
                matches!(self, Self::Database(e) if sqlx_is_retryable(e))
            }
        }
    )*};
}
retryable!(
    VersionError,
    ActorError,
    PostError,
    ScheduleError,
    ClaimError,
    ProgressError,
    ReleaseError,
    ExpireError,
    SubmitError
);

/// Cancelling a batch failed.
#[derive(Debug, Error)]
pub enum CancelError {
    /// The batch does not exist.
    #[error("{0} does not exist")]
    UnknownBatch(BatchId),
    /// The batch was cancelled before.
    #[error("{0} is already cancelled")]
    AlreadyCancelled(BatchId),
    /// The database failed.
    #[error("ledger database")]
    Database(#[from] sqlx::Error),
}
