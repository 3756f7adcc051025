//! Where `now` comes from. The ledger's operations take the current time as a parameter; this
//! module gives callers a [`Clock`] to produce it: [`SystemClock`] in production and
//! [`ManualClock`] in tests and simulations, so that lease expiry is tested without sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::ids::{Timestamp, duration_millis};

/// A source of the current time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(duration_millis)
            .unwrap_or(0);
        Timestamp::from_millis(ms)
    }
}

/// A clock that moves only when told to. Cloning shares the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock that reads `start`.
    pub fn new(start: Timestamp) -> ManualClock {
        ManualClock(Arc::new(AtomicI64::new(start.millis())))
    }

    /// Moves the clock forward by `d` and returns the new time.
    pub fn advance(&self, d: Duration) -> Timestamp {
        let d = duration_millis(d);
        Timestamp::from_millis(self.0.fetch_add(d, Ordering::SeqCst).saturating_add(d))
    }

    /// Sets the clock to `t` (never backwards: a later time already set wins).
    pub fn set(&self, t: Timestamp) {
        self.0.fetch_max(t.millis(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.0.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_forward() {
        let c = ManualClock::new(Timestamp::from_millis(1_000));
        assert_eq!(
            c.advance(Duration::from_millis(500)),
            Timestamp::from_millis(1_500)
        );
        c.set(Timestamp::from_millis(1_200));
        assert_eq!(c.now(), Timestamp::from_millis(1_500));
        let shared = c.clone();
        shared.set(Timestamp::from_millis(9_000));
        assert_eq!(c.now(), Timestamp::from_millis(9_000));
        assert!(SystemClock.now().millis() > 1_600_000_000_000);
    }
}
