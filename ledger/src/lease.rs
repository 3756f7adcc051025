//! Lease sizing: a bounded window of recent completion times (claim → accepted submit, as the
//! ledger observed them) and the rule `lease = clamp(multiple × median, floor, ceiling)`.
//!
//! The window is derived state: it lives in memory and is rebuilt from the `results` table when
//! the ledger opens, so the database stays the only source of truth. Pure: no clock, no I/O.

use std::collections::VecDeque;
use std::time::Duration;

use crate::config::LeaseConfig;

/// Recent completion times and the lease length they imply.
#[derive(Debug, Clone)]
pub(crate) struct LeaseEstimator {
    config: LeaseConfig,
    recent: VecDeque<u64>,
}

impl LeaseEstimator {
    pub(crate) fn new(config: LeaseConfig) -> LeaseEstimator {
        LeaseEstimator {
            recent: VecDeque::with_capacity(config.window),
            config,
        }
    }

    /// Records one observed completion time, forgetting the oldest beyond the window.
    pub(crate) fn observe(&mut self, completion: Duration) {
        if self.recent.len() == self.config.window {
            self.recent.pop_front();
        }
        self.recent
            .push_back(u64::try_from(completion.as_millis()).unwrap_or(u64::MAX));
    }

    /// The median of the window, if anything was observed.
    pub(crate) fn median(&self) -> Option<Duration> {
        if self.recent.is_empty() {
            return None;
        }
        let mut v: Vec<u64> = self.recent.iter().copied().collect();
        let mid = v.len() / 2;
        let (_, m, _) = v.select_nth_unstable(mid);
        Some(Duration::from_millis(*m))
    }

    /// The lease to grant now.
    pub(crate) fn lease(&self) -> Duration {
        let c = &self.config;
        match self.median() {
            None => c.initial,
            Some(m) => m.mul_f64(c.multiple).clamp(c.floor, c.ceiling),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> LeaseConfig {
        LeaseConfig {
            multiple: 2.0,
            floor: Duration::from_secs(1),
            ceiling: Duration::from_secs(100),
            initial: Duration::from_secs(30),
            window: 5,
        }
    }

    #[test]
    fn initial_then_multiple_of_median_within_bounds() {
        let mut e = LeaseEstimator::new(config());
        assert_eq!(e.lease(), Duration::from_secs(30));
        for s in [10, 20, 1000, 11, 12] {
            e.observe(Duration::from_secs(s));
        }
        // median of {10, 11, 12, 20, 1000} is 12 → 24 s: an outlier does not move it.
        assert_eq!(e.median(), Some(Duration::from_secs(12)));
        assert_eq!(e.lease(), Duration::from_secs(24));
        for _ in 0..5 {
            e.observe(Duration::from_millis(10));
        }
        assert_eq!(e.lease(), Duration::from_secs(1), "floor applies");
        for _ in 0..5 {
            e.observe(Duration::from_secs(500));
        }
        assert_eq!(e.lease(), Duration::from_secs(100), "ceiling applies");
        assert_eq!(e.recent.len(), 5, "window is bounded");
    }
}
