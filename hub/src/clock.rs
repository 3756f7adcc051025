//! The hub's wall clock: milliseconds since the Unix epoch, as the run board, the event
//! stream, the status page and delta headers carry it ([`now_ms`]), and as the ledger stores
//! it ([`now`]).
//!
//! One place that reads the clock, below every module that needs the time, so the time is
//! read and rounded the same way everywhere. A clock before 1970 reads as 0.

use std::time::{SystemTime, UNIX_EPOCH};

use starling_ledger::Timestamp;

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The current time as the ledger records it.
pub(crate) fn now() -> Timestamp {
    Timestamp::from_millis(i64::try_from(now_ms()).unwrap_or(i64::MAX))
}
