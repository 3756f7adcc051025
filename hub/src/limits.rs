//! Per-actor limits on the job protocol: how fast one worker connection may send each kind of
//! message, and how many worker connections one certificate may hold at once (counted by a
//! [`starling_transport::connections::ConnectionCap`], the type that bounds subscriptions
//! too).
//!
//! An honest worker stays far below every bound (a heartbeat a second and on each version
//! change, a progress report a second, a claim per generation call or per 100 ms while idle,
//! a submit per generation call), so a bound reached is a broken or hostile client: it gets a
//! named `Refuse` (`RateLimited`, `TooManyConnections`), the refusal is counted in
//! `starling_hub_worker_refusals_total{reason}`, and the connection is closed — every
//! message it sends costs the hub a ledger transaction, so the cost of a misbehaving
//! certificate is bounded by these numbers. The rate check is a token bucket per kind and
//! connection (`burst` = 2 s worth of the rate): a few lines of arithmetic on the caller's
//! clock, so it needs no crate and is tested without sleeping.

use std::time::Instant;

/// The bounds, from `starling-hub serve`'s flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerLimits {
    /// `Heartbeat`s per second, and separately `StagingTime` and `Progress` reports per
    /// second.
    pub heartbeats_per_s: f64,
    /// `Submit`s per second, and separately `Claim`s per second.
    pub submits_per_s: f64,
    /// Live worker connections per certificate name.
    pub connections: usize,
}

impl Default for WorkerLimits {
    fn default() -> Self {
        WorkerLimits {
            heartbeats_per_s: 20.0,
            submits_per_s: 50.0,
            connections: starling_transport::connections::DEFAULT_MAX,
        }
    }
}

/// The kinds of message a worker sends, each with its own bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Heartbeat,
    StagingTime,
    Progress,
    Claim,
    Submit,
}

impl Kind {
    /// The refusal's reason code (metrics label).
    pub(crate) fn code(self) -> &'static str {
        match self {
            Kind::Heartbeat => "heartbeat_rate",
            Kind::StagingTime => "staging_time_rate",
            Kind::Progress => "progress_rate",
            Kind::Claim => "claim_rate",
            Kind::Submit => "submit_rate",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Heartbeat => "heartbeats",
            Kind::StagingTime => "staging reports",
            Kind::Progress => "progress reports",
            Kind::Claim => "claims",
            Kind::Submit => "submits",
        }
    }
}

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
#[derive(Debug, Clone)]
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: f64, now: Instant) -> Bucket {
        let burst = (2.0 * rate).max(2.0);
        Bucket {
            rate,
            burst,
            tokens: burst,
            last: now,
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A bound a connection reached: the refusal's detail and reason code.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Limited {
    pub(crate) kind: Kind,
    pub(crate) detail: String,
}

/// The rate buckets of one worker connection.
#[derive(Debug)]
pub(crate) struct RateLimiter {
    buckets: [(Kind, Bucket); 5],
}

impl RateLimiter {
    pub(crate) fn new(limits: &WorkerLimits, now: Instant) -> RateLimiter {
        let (h, s) = (limits.heartbeats_per_s, limits.submits_per_s);
        RateLimiter {
            buckets: [
                (Kind::Heartbeat, Bucket::new(h, now)),
                (Kind::StagingTime, Bucket::new(h, now)),
                (Kind::Progress, Bucket::new(h, now)),
                (Kind::Claim, Bucket::new(s, now)),
                (Kind::Submit, Bucket::new(s, now)),
            ],
        }
    }

    /// Takes one message of `kind` at `now`, or says which bound it broke.
    pub(crate) fn admit(&mut self, kind: Kind, now: Instant) -> Result<(), Limited> {
        let Some((_, b)) = self.buckets.iter_mut().find(|(k, _)| *k == kind) else {
            return Ok(());
        };
        if b.take(now) {
            return Ok(());
        }
        Err(Limited {
            kind,
            detail: format!(
                "{} arrive faster than the {:.0}/s (burst {:.0}) one actor may send; closing this connection",
                kind.name(),
                b.rate,
                b.burst
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_burst_passes_a_sustained_excess_is_refused_with_its_name() {
        let t0 = Instant::now();
        let limits = WorkerLimits {
            heartbeats_per_s: 10.0,
            submits_per_s: 5.0,
            connections: 2,
        };
        let mut r = RateLimiter::new(&limits, t0);
        // 2 s worth at once is fine; the next one, at the same instant, is not.
        for _ in 0..20 {
            assert_eq!(r.admit(Kind::Heartbeat, t0), Ok(()));
        }
        let e = r.admit(Kind::Heartbeat, t0).expect_err("over the burst");
        assert_eq!(e.kind.code(), "heartbeat_rate");
        assert!(e.detail.contains("10/s"), "{}", e.detail);
        // Other kinds have their own buckets.
        assert_eq!(r.admit(Kind::Progress, t0), Ok(()));
        assert_eq!(r.admit(Kind::Submit, t0), Ok(()));
        // The rate refills it: one heartbeat per 100 ms is sustainable forever.
        let mut t = t0;
        for _ in 0..1_000 {
            t += Duration::from_millis(100);
            assert_eq!(r.admit(Kind::Heartbeat, t), Ok(()));
        }
        // Twice the rate is not: it runs dry within the burst.
        let refused = (0..100)
            .filter(|_| {
                t += Duration::from_millis(50);
                r.admit(Kind::Heartbeat, t).is_err()
            })
            .count();
        assert!(refused >= 40, "{refused} of 100 refused");
    }
}
