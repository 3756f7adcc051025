//! [`LinkProfile`]: the parameters of one direction of an emulated link.
//!
//! A profile is plain data. [`LinkProfile::validate`] is the single place that
//! decides whether a profile is usable; the model and the proxy call it, so an
//! invalid profile never reaches a running link.

use std::fmt;
use std::time::Duration;

use crate::error::NetemError;
use crate::units::{format_duration, format_rate, format_size};

/// Bytes a UDP datagram costs on the wire beyond its payload: UDP header (8) +
/// IPv4 header (20) + Ethernet header (14). Preamble, FCS and inter-frame gap
/// are not counted, as `tc` does not count them either.
pub const UDP_IPV4_ETHERNET_OVERHEAD: usize = 42;

/// Slowest accepted rate (1 kbit/s): keeps one packet's serialization time
/// under a second.
pub const MIN_RATE_BPS: u64 = 1_000;

/// Longest accepted delay and jitter (one hour): keeps time arithmetic far
/// from overflow.
pub const MAX_DELAY: Duration = Duration::from_secs(3_600);

/// Default queue limit: 1 MB, about 80 ms at 100 Mbit/s.
pub const DEFAULT_QUEUE_LIMIT_BYTES: usize = 1_000_000;

/// One direction of an emulated wide-area link.
///
/// The order of effects on each packet is: random loss → serialization at
/// `rate_bps` behind the packets already queued → drop-tail if the queue is
/// full → propagation `delay` ± uniform `jitter` → delivery. See
/// [`crate::LinkModel`] for the exact rules.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkProfile {
    /// Bottleneck rate in bits per second; `None` means unlimited (no
    /// serialization delay and no queue).
    pub rate_bps: Option<u64>,
    /// Fixed one-way propagation delay added after serialization.
    pub delay: Duration,
    /// Half-width of the uniform jitter: each packet's delay is drawn from
    /// `[delay - jitter, delay + jitter]` (clamped at zero), as `tc netem`
    /// does with a uniform distribution.
    pub jitter: Duration,
    /// Probability in `0..=1` that a packet is lost (independently, before
    /// it reaches the queue).
    pub loss: f64,
    /// Drop-tail limit on the bytes (wire bytes, overhead included) waiting
    /// to be serialized. An idle link always accepts one packet, whatever
    /// its size. Ignored when `rate_bps` is `None`.
    pub queue_limit_bytes: usize,
    /// Wire bytes added to each payload for the rate computation
    /// (default [`UDP_IPV4_ETHERNET_OVERHEAD`]).
    pub per_packet_overhead: usize,
    /// Whether jitter may reorder packets. When `false` (the default) a
    /// packet is never delivered before the one offered ahead of it: its
    /// delivery time is raised to its predecessor's, which skews the delay
    /// distribution upwards when the jitter exceeds the packet gap. When
    /// `true`, packets are delivered strictly by their drawn times, which
    /// reorders them as `tc netem` does.
    pub reorder: bool,
    /// Seed of the loss and jitter generators: the same seed and the same
    /// sequence of packets give the same drops and the same delays.
    pub seed: u64,
}

impl Default for LinkProfile {
    fn default() -> Self {
        Self {
            rate_bps: None,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            queue_limit_bytes: DEFAULT_QUEUE_LIMIT_BYTES,
            per_packet_overhead: UDP_IPV4_ETHERNET_OVERHEAD,
            reorder: false,
            seed: 0,
        }
    }
}

impl LinkProfile {
    /// A perfect link: no rate limit, no delay, no loss.
    pub fn ideal() -> Self {
        Self::default()
    }

    /// Sets the bottleneck rate in bits per second.
    #[must_use]
    pub fn with_rate_bps(mut self, rate_bps: u64) -> Self {
        self.rate_bps = Some(rate_bps);
        self
    }

    /// Sets the fixed one-way delay.
    #[must_use]
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Sets the jitter half-width.
    #[must_use]
    pub fn with_jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Sets the loss probability (`0..=1`).
    #[must_use]
    pub fn with_loss(mut self, loss: f64) -> Self {
        self.loss = loss;
        self
    }

    /// Sets the drop-tail queue limit in wire bytes.
    #[must_use]
    pub fn with_queue_limit_bytes(mut self, bytes: usize) -> Self {
        self.queue_limit_bytes = bytes;
        self
    }

    /// Allows or forbids reordering by jitter.
    #[must_use]
    pub fn with_reorder(mut self, reorder: bool) -> Self {
        self.reorder = reorder;
        self
    }

    /// Sets the seed of the loss and jitter generators.
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Checks that the profile is usable.
    ///
    /// # Errors
    /// [`NetemError::InvalidProfile`] if the loss is not a probability, the
    /// rate is below [`MIN_RATE_BPS`] or a delay exceeds [`MAX_DELAY`].
    pub fn validate(&self) -> Result<(), NetemError> {
        if !(self.loss.is_finite() && (0.0..=1.0).contains(&self.loss)) {
            return Err(NetemError::InvalidProfile(format!(
                "loss must be a probability in 0..=1, got {}",
                self.loss
            )));
        }
        if let Some(rate) = self.rate_bps
            && rate < MIN_RATE_BPS
        {
            return Err(NetemError::InvalidProfile(format!(
                "rate must be at least {MIN_RATE_BPS} bit/s (leave it unset for an unlimited link), got {rate}"
            )));
        }
        if self.delay > MAX_DELAY || self.jitter > MAX_DELAY {
            return Err(NetemError::InvalidProfile(format!(
                "delay and jitter must be at most {} s",
                MAX_DELAY.as_secs()
            )));
        }
        Ok(())
    }
}

impl fmt::Display for LinkProfile {
    /// E.g. `rate 100mbit, delay 25ms ± 1ms, loss 0.1%, queue 1.5MB, overhead 42B, fifo, seed 1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rate_bps {
            Some(rate) => write!(f, "rate {}", format_rate(rate))?,
            None => write!(f, "rate unlimited")?,
        }
        write!(f, ", delay {}", format_duration(self.delay))?;
        if !self.jitter.is_zero() {
            write!(f, " ± {}", format_duration(self.jitter))?;
        }
        write!(f, ", loss {}%", self.loss * 100.0)?;
        if self.rate_bps.is_some() {
            write!(f, ", queue {}", format_size(self.queue_limit_bytes as u64))?;
        }
        write!(
            f,
            ", overhead {}B, {}, seed {}",
            self.per_packet_overhead,
            if self.reorder { "reordering" } else { "fifo" },
            self.seed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_an_ideal_valid_link() {
        let p = LinkProfile::ideal();
        assert!(p.validate().is_ok());
        assert_eq!(p.rate_bps, None);
        assert_eq!(p.per_packet_overhead, 42);
        assert!(!p.reorder);
    }

    #[test]
    fn displays_every_parameter() {
        let p = LinkProfile::ideal()
            .with_rate_bps(100_000_000)
            .with_delay(Duration::from_millis(25))
            .with_jitter(Duration::from_millis(1))
            .with_loss(0.001)
            .with_queue_limit_bytes(1_500_000)
            .with_seed(1);
        assert_eq!(
            p.to_string(),
            "rate 100mbit, delay 25ms ± 1ms, loss 0.1%, queue 1.5MB, overhead 42B, fifo, seed 1"
        );
        assert_eq!(
            LinkProfile::ideal().to_string(),
            "rate unlimited, delay 0, loss 0%, overhead 42B, fifo, seed 0"
        );
    }

    #[test]
    fn rejects_bad_loss_and_zero_rate() {
        for loss in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(LinkProfile::ideal().with_loss(loss).validate().is_err());
        }
        assert!(LinkProfile::ideal().with_loss(1.0).validate().is_ok());
        assert!(LinkProfile::ideal().with_rate_bps(0).validate().is_err());
        assert!(LinkProfile::ideal().with_rate_bps(999).validate().is_err());
        assert!(LinkProfile::ideal().with_rate_bps(1_000).validate().is_ok());
        let too_long = MAX_DELAY + Duration::from_secs(1);
        assert!(
            LinkProfile::ideal()
                .with_delay(too_long)
                .validate()
                .is_err()
        );
        assert!(
            LinkProfile::ideal()
                .with_jitter(too_long)
                .validate()
                .is_err()
        );
    }
}
