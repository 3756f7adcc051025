//! The hub's wall clock: milliseconds since the Unix epoch, as the run board, the event
//! stream, the status page and delta headers carry it ([`now_ms`]), and as the ledger stores
//! it ([`now`]).
//!
//! One place that reads the clock, below every module that needs the time, so the time is
//! read and rounded the same way everywhere. A clock before 1970 reads as 0.

use starling_ledger::Timestamp;

/// Milliseconds since the Unix epoch ([`starling_telemetry::unix_ms`], the clock the relay's
/// and the actor's status documents read too).
pub(crate) fn now_ms() -> u64 {
    starling_telemetry::unix_ms()
}

/// The current time as the ledger records it.
pub(crate) fn now() -> Timestamp {
    Timestamp::from_millis(i64::try_from(now_ms()).unwrap_or(i64::MAX))
}
