//! Tunables of the ledger: the scheduler's α and β, lease sizing, attempts, the claim timeout,
//! and the bounds on every request. [`LedgerConfig::validate`] refuses configurations that
//! would make the scheduler or the lease rules meaningless (α or β outside `[0, 1]`, floor
//! above ceiling, …).

use std::time::Duration;

use thiserror::Error;

/// How leases are sized (see `lease`): a claimed job's lease covers the token budget of every
/// job its actor holds at the actor's measured throughput, times `margin`, within
/// `[floor, ceiling]`; `initial` before the actor is measured. Progress extends a lease to
/// `now + max(floor, margin × time since the previous progress)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseConfig {
    /// Safety factor over the expected generation time (and over the progress interval).
    pub margin: f64,
    /// Shortest lease ever granted, and the shortest extension by progress: a job whose
    /// generation stopped moving expires this long after its last progress.
    pub floor: Duration,
    /// Longest lease ever granted at claim.
    pub ceiling: Duration,
    /// Lease granted to an actor not yet measured (or for a job of unknown budget).
    pub initial: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            margin: 2.0,
            floor: Duration::from_secs(10),
            ceiling: Duration::from_secs(3_600),
            initial: Duration::from_secs(120),
        }
    }
}

/// Configuration of a [`crate::Ledger`].
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerConfig {
    /// Exclusion decay: an ineligible actor's τ is multiplied by α at each scheduling round.
    pub alpha: f64,
    /// EMA factor: on each accepted result τ ← β·τ + (1−β)·tokens/elapsed.
    pub beta: f64,
    /// τ (tokens/s) of a newly registered actor.
    pub initial_tau: f64,
    /// Lease sizing.
    pub lease: LeaseConfig,
    /// A job whose lease expires this many times is marked failed instead of returned.
    pub max_attempts: u32,
    /// An actor without a heartbeat for this long is not scheduled, and the unclaimed jobs
    /// assigned to it return to the shared pool at the next expiry sweep.
    pub actor_timeout: Duration,
    /// A share of a batch from which its actor has claimed nothing for this long (counted
    /// from the batch's scheduling, then from its last claim from the share) returns to the
    /// shared pool at the next sweep, and the actor is not scheduled again until it claims.
    pub claim_timeout: Duration,
    /// The longest gap between an actor's accepted submit and its next successful claim that
    /// still counts as its own round trip in its throughput (longer: it was idle, and the
    /// next measurement starts at the claim).
    pub max_claim_gap: Duration,
    /// Largest number of prompts in one batch.
    pub max_batch_size: usize,
    /// Largest number of jobs in one claim, renew or submit call.
    pub max_per_call: usize,
    /// Largest prompt payload, in bytes.
    pub max_prompt_bytes: usize,
    /// Largest result payload, in bytes.
    pub max_result_bytes: usize,
    /// Largest sampling-parameters document, in bytes.
    pub max_sampling_bytes: usize,
    /// Most leases returned by one expiry sweep (call again if more remain).
    pub max_expire_per_sweep: usize,
    /// PostgreSQL connection pool size (SQLite always uses one writer connection).
    pub postgres_pool_size: u32,
    /// How batches are split (Algorithm 1's proportional split; uniform for comparison).
    pub split: crate::schedule::Split,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            alpha: 0.5,
            beta: 0.9,
            initial_tau: 1_000.0,
            lease: LeaseConfig::default(),
            max_attempts: 5,
            actor_timeout: Duration::from_secs(60),
            claim_timeout: Duration::from_secs(10),
            max_claim_gap: Duration::from_secs(2),
            max_batch_size: 1 << 20,
            max_per_call: 4096,
            max_prompt_bytes: 1 << 20,
            max_result_bytes: 16 << 20,
            max_sampling_bytes: 64 << 10,
            max_expire_per_sweep: 100_000,
            postgres_pool_size: 16,
            split: crate::schedule::Split::Proportional,
        }
    }
}

/// A configuration value out of its meaningful range.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConfigError {
    /// α must be in `[0, 1]`.
    #[error("alpha {0} is outside [0, 1]")]
    Alpha(f64),
    /// β must be in `[0, 1)`.
    #[error("beta {0} is outside [0, 1)")]
    Beta(f64),
    /// The initial τ must be finite and positive.
    #[error("initial tau {0} must be finite and positive")]
    InitialTau(f64),
    /// The lease margin must be finite and at least 1.
    #[error("lease margin {0} must be a finite number of at least 1")]
    LeaseMargin(f64),
    /// The lease floor, initial value and ceiling must be ordered and non-zero.
    #[error("lease bounds must satisfy 0 < floor <= initial <= ceiling")]
    LeaseBounds,
    /// The claim timeout must be positive.
    #[error("the claim timeout must be positive")]
    ClaimTimeout,
    /// Every size bound must be at least 1.
    #[error("{0} must be at least 1")]
    ZeroBound(&'static str),
}

impl LedgerConfig {
    /// Checks that every value is in its meaningful range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(ConfigError::Alpha(self.alpha));
        }
        if !(0.0..1.0).contains(&self.beta) {
            return Err(ConfigError::Beta(self.beta));
        }
        if !(self.initial_tau.is_finite() && self.initial_tau > 0.0) {
            return Err(ConfigError::InitialTau(self.initial_tau));
        }
        let l = &self.lease;
        if !(l.margin.is_finite() && l.margin >= 1.0) {
            return Err(ConfigError::LeaseMargin(l.margin));
        }
        if self.claim_timeout.is_zero() {
            return Err(ConfigError::ClaimTimeout);
        }
        if l.floor.is_zero() || l.floor > l.initial || l.initial > l.ceiling {
            return Err(ConfigError::LeaseBounds);
        }
        for (name, v) in [
            ("max_attempts", self.max_attempts as usize),
            ("max_batch_size", self.max_batch_size),
            ("max_per_call", self.max_per_call),
            ("max_prompt_bytes", self.max_prompt_bytes),
            ("max_result_bytes", self.max_result_bytes),
            ("max_sampling_bytes", self.max_sampling_bytes),
            ("max_expire_per_sweep", self.max_expire_per_sweep),
            ("postgres_pool_size", self.postgres_pool_size as usize),
        ] {
            if v == 0 {
                return Err(ConfigError::ZeroBound(name));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_bad_values_are_named() {
        assert_eq!(LedgerConfig::default().validate(), Ok(()));
        let bad = LedgerConfig {
            beta: 1.0,
            ..LedgerConfig::default()
        };
        assert_eq!(bad.validate(), Err(ConfigError::Beta(1.0)));
        let mut bad = LedgerConfig::default();
        bad.lease.floor = Duration::from_secs(1_000);
        assert_eq!(bad.validate(), Err(ConfigError::LeaseBounds));
        let bad = LedgerConfig {
            max_per_call: 0,
            ..LedgerConfig::default()
        };
        assert_eq!(bad.validate(), Err(ConfigError::ZeroBound("max_per_call")));
        let mut bad = LedgerConfig::default();
        bad.lease.margin = 0.5;
        assert_eq!(bad.validate(), Err(ConfigError::LeaseMargin(0.5)));
    }
}
