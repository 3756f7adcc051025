//! [`LinkModel`]: the pure, clock-injected model of one link direction.
//!
//! The model never reads a clock, sleeps or touches a socket: the caller
//! passes the arrival time of each packet and gets back a [`Verdict`]. That
//! makes it exhaustively testable with virtual time, and the proxy uses the
//! very same code with `Instant::now()`.
//!
//! For each packet offered at time `now` with payload `len`:
//!
//! 1. **Loss.** With probability `loss` (one draw of the seeded loss
//!    generator per offered packet) the packet is dropped: [`DropReason::Loss`].
//!    Lost packets use no link capacity.
//! 2. **Queue (drop-tail).** With a rate set, the *backlog* is the wire bytes
//!    not yet serialized at `now`. If the link is busy and
//!    `backlog + len + overhead > queue_limit_bytes`, the packet is dropped:
//!    [`DropReason::Queue`]. An idle link always accepts one packet.
//! 3. **Serialization.** The packet departs at
//!    `max(now, previous departure) + (len + overhead) × 8 / rate`
//!    (a virtual clock; nanosecond resolution, rounded up).
//! 4. **Propagation.** It is delivered at `departure + delay + U[-jitter, +jitter]`,
//!    never earlier than its departure (one draw of the jitter generator per
//!    accepted packet).
//! 5. **Order.** Unless `reorder` is set, the delivery time is raised to the
//!    previous accepted packet's, so packets leave in the order they came.
//!
//! Invariants (tested below): delivery is never before `now + delay - jitter`
//! nor before departure; departures are spaced by at least each packet's
//! serialization time, so wire bytes delivered by any time `t` are at most
//! `rate × t` plus one packet; the backlog never exceeds the queue limit
//! except for a single packet accepted by an idle link; the same seed and the
//! same input give the same verdicts.

use std::time::{Duration, Instant};

use crate::error::NetemError;
use crate::profile::LinkProfile;
use crate::rng::SplitMix64;

/// Why the model dropped a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Random loss (the profile's `loss` probability).
    Loss,
    /// The queue in front of the rate limiter was full (drop-tail).
    Queue,
}

/// What happens to one offered packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The packet is dropped.
    Drop(DropReason),
    /// The packet is to be delivered at this instant.
    DeliverAt(Instant),
}

impl Verdict {
    /// The delivery instant, if the packet is delivered.
    pub fn deliver_at(self) -> Option<Instant> {
        match self {
            Self::DeliverAt(t) => Some(t),
            Self::Drop(_) => None,
        }
    }
}

/// Salt mixed into the seed of the jitter generator so that loss and jitter
/// draw from independent streams.
const JITTER_STREAM: u64 = 0x6a09_e667_f3bc_c908;

/// The state of one link direction. See the module documentation for the rules.
#[derive(Debug, Clone)]
pub struct LinkModel {
    profile: LinkProfile,
    loss_rng: SplitMix64,
    jitter_rng: SplitMix64,
    /// When the serializer finishes the last accepted packet.
    busy_until: Option<Instant>,
    /// Delivery time of the last accepted packet (for FIFO order).
    last_delivery: Option<Instant>,
}

impl LinkModel {
    /// A model in its initial state (idle link, generators at the seed).
    ///
    /// # Errors
    /// [`NetemError::InvalidProfile`] if [`LinkProfile::validate`] rejects it.
    pub fn new(profile: LinkProfile) -> Result<Self, NetemError> {
        profile.validate()?;
        Ok(Self {
            loss_rng: SplitMix64::new(profile.seed),
            jitter_rng: SplitMix64::new(profile.seed ^ JITTER_STREAM),
            profile,
            busy_until: None,
            last_delivery: None,
        })
    }

    /// The profile this model follows.
    pub fn profile(&self) -> &LinkProfile {
        &self.profile
    }

    /// Wire bytes of a payload of `len` bytes (payload + per-packet overhead).
    pub fn wire_bytes(&self, len: usize) -> u64 {
        (len as u64).saturating_add(self.profile.per_packet_overhead as u64)
    }

    /// Time to serialize a payload of `len` bytes at the link rate (zero
    /// when the rate is unlimited), rounded up to the nanosecond.
    pub fn serialization_time(&self, len: usize) -> Duration {
        match self.profile.rate_bps {
            None => Duration::ZERO,
            Some(rate) => nanos(ceil_div(
                u128::from(self.wire_bytes(len)) * 8 * 1_000_000_000,
                u128::from(rate),
            )),
        }
    }

    /// Serialization time still owed at `now` for the packets already accepted.
    pub fn backlog(&self, now: Instant) -> Duration {
        self.busy_until
            .map_or(Duration::ZERO, |t| t.saturating_duration_since(now))
    }

    /// Wire bytes accepted but not yet serialized at `now` (rounded up).
    pub fn backlog_bytes(&self, now: Instant) -> u64 {
        match self.profile.rate_bps {
            None => 0,
            Some(rate) => {
                let ns = self.backlog(now).as_nanos();
                u64::try_from(ceil_div(ns * u128::from(rate), 8 * 1_000_000_000))
                    .unwrap_or(u64::MAX)
            }
        }
    }

    /// Decides the fate of a packet of `len` payload bytes offered at `now`.
    ///
    /// `now` should not go backwards; if it does, the packet is treated as
    /// arriving at the time given and still never departs before the previous one.
    pub fn on_packet(&mut self, now: Instant, len: usize) -> Verdict {
        if self.profile.loss > 0.0 && self.loss_rng.next_f64() < self.profile.loss {
            return Verdict::Drop(DropReason::Loss);
        }

        let departure = if self.profile.rate_bps.is_some() {
            let backlog = self.backlog_bytes(now);
            let limit = self.profile.queue_limit_bytes as u64;
            if backlog > 0 && backlog.saturating_add(self.wire_bytes(len)) > limit {
                return Verdict::Drop(DropReason::Queue);
            }
            let start = self.busy_until.map_or(now, |busy| busy.max(now));
            let departure = start + self.serialization_time(len);
            self.busy_until = Some(departure);
            departure
        } else {
            now
        };

        let mut deliver = departure + self.propagation_delay();
        if !self.profile.reorder
            && let Some(last) = self.last_delivery
        {
            deliver = deliver.max(last);
        }
        self.last_delivery = Some(match self.last_delivery {
            Some(last) => last.max(deliver),
            None => deliver,
        });
        Verdict::DeliverAt(deliver)
    }

    /// `delay + U[-jitter, +jitter]`, clamped at zero.
    fn propagation_delay(&mut self) -> Duration {
        let delay = self.profile.delay.as_nanos();
        let jitter = self.profile.jitter.as_nanos();
        if jitter == 0 {
            return self.profile.delay;
        }
        let jitter = u64::try_from(jitter).unwrap_or(u64::MAX / 2);
        let draw = self.jitter_rng.next_up_to(jitter.saturating_mul(2));
        // total = delay - jitter + draw, clamped at zero.
        let total = (delay + u128::from(draw)).saturating_sub(u128::from(jitter));
        nanos(total)
    }
}

fn ceil_div(a: u128, b: u128) -> u128 {
    a.div_ceil(b)
}

fn nanos(ns: u128) -> Duration {
    Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const US: Duration = Duration::from_micros(1);

    fn model(p: LinkProfile) -> LinkModel {
        LinkModel::new(p).expect("valid profile")
    }

    fn at(v: Verdict) -> Instant {
        v.deliver_at().expect("delivered")
    }

    #[test]
    fn ideal_link_delivers_immediately() {
        let mut m = model(LinkProfile::ideal());
        let t0 = Instant::now();
        for i in 0..1000u32 {
            let now = t0 + US * i;
            assert_eq!(m.on_packet(now, 1200), Verdict::DeliverAt(now));
        }
        assert_eq!(m.backlog_bytes(t0), 0);
    }

    #[test]
    fn fixed_delay_is_exact() {
        let mut m = model(LinkProfile::ideal().with_delay(25 * MS));
        let t0 = Instant::now();
        for i in 0..100u32 {
            let now = t0 + MS * i / 3;
            assert_eq!(m.on_packet(now, 100), Verdict::DeliverAt(now + 25 * MS));
        }
    }

    #[test]
    fn serialization_follows_the_virtual_clock() {
        // 8 Mbit/s = 1 µs per byte; 958 + 42 = 1000 wire bytes = 1 ms.
        let mut m = model(LinkProfile::ideal().with_rate_bps(8_000_000));
        assert_eq!(m.serialization_time(958), MS);
        assert_eq!(m.wire_bytes(958), 1000);
        let t0 = Instant::now();
        // Back-to-back burst: departures every 1 ms.
        for k in 1..=5u32 {
            assert_eq!(at(m.on_packet(t0, 958)), t0 + MS * k);
        }
        assert_eq!(m.backlog(t0), 5 * MS);
        assert_eq!(m.backlog_bytes(t0), 5000);
        assert_eq!(m.backlog_bytes(t0 + 2500 * US), 2500);
        // Arriving while busy: waits for the serializer.
        assert_eq!(at(m.on_packet(t0 + 2 * MS, 958)), t0 + 6 * MS);
        // Arriving after the link went idle: departs one packet time later.
        let late = t0 + 100 * MS;
        assert_eq!(m.backlog(late), Duration::ZERO);
        assert_eq!(at(m.on_packet(late, 958)), late + MS);
    }

    #[test]
    fn serialization_rounds_up_and_delay_adds_after_it() {
        // 3 bit/s-ish awkward rate: 300 Mbit/s, 1242 wire bytes = 33.12 µs.
        let mut m = model(
            LinkProfile::ideal()
                .with_rate_bps(300_000_000)
                .with_delay(10 * MS),
        );
        assert_eq!(m.serialization_time(1200), Duration::from_nanos(33_120));
        let t0 = Instant::now();
        assert_eq!(
            at(m.on_packet(t0, 1200)),
            t0 + Duration::from_nanos(33_120) + 10 * MS
        );
        // 1 Mbit/s, 1 wire byte (no overhead) = 8 µs exactly; 1 bit short rounds up.
        let m = model(LinkProfile {
            rate_bps: Some(1_000_000),
            per_packet_overhead: 0,
            ..LinkProfile::ideal()
        });
        assert_eq!(m.serialization_time(1), 8 * US);
        let m = model(LinkProfile {
            rate_bps: Some(3_000),
            per_packet_overhead: 0,
            ..LinkProfile::ideal()
        });
        // 8 bits at 3000 bit/s = 2666666.67 ns -> rounded up.
        assert_eq!(m.serialization_time(1), Duration::from_nanos(2_666_667));
    }

    #[test]
    fn queue_drops_tail_at_the_limit_and_recovers() {
        // 1 µs per wire byte; 1000-byte wire packets; 10 packets of queue.
        let mut m = model(
            LinkProfile::ideal()
                .with_rate_bps(8_000_000)
                .with_queue_limit_bytes(10_000),
        );
        let t0 = Instant::now();
        let verdicts: Vec<Verdict> = (0..25).map(|_| m.on_packet(t0, 958)).collect();
        let accepted = verdicts.iter().filter(|v| v.deliver_at().is_some()).count();
        assert_eq!(accepted, 10);
        assert!(
            verdicts[10..]
                .iter()
                .all(|v| *v == Verdict::Drop(DropReason::Queue))
        );
        assert_eq!(m.backlog_bytes(t0), 10_000);
        // A packet that fits exactly is accepted once 1 ms drained.
        assert_eq!(
            m.on_packet(t0 + 999 * US, 958),
            Verdict::Drop(DropReason::Queue)
        );
        assert_eq!(at(m.on_packet(t0 + MS, 958)), t0 + 11 * MS);
        // Smaller packets still fit into a partly drained queue.
        assert_eq!(
            at(m.on_packet(t0 + MS + 100 * US, 58)),
            t0 + 11 * MS + 100 * US
        );
    }

    #[test]
    fn idle_link_accepts_one_oversized_packet() {
        let mut m = model(
            LinkProfile::ideal()
                .with_rate_bps(8_000_000)
                .with_queue_limit_bytes(100),
        );
        let t0 = Instant::now();
        assert_eq!(at(m.on_packet(t0, 1458)), t0 + Duration::from_micros(1500));
        assert_eq!(m.on_packet(t0, 10), Verdict::Drop(DropReason::Queue));
        // Queue limit zero: only an idle link takes a packet.
        let mut m = model(
            LinkProfile::ideal()
                .with_rate_bps(8_000_000)
                .with_queue_limit_bytes(0),
        );
        assert!(m.on_packet(t0, 958).deliver_at().is_some());
        assert_eq!(m.on_packet(t0, 958), Verdict::Drop(DropReason::Queue));
        assert!(m.on_packet(t0 + MS, 958).deliver_at().is_some());
    }

    #[test]
    fn unlimited_rate_ignores_the_queue_limit() {
        let mut m = model(LinkProfile::ideal().with_queue_limit_bytes(0));
        let t0 = Instant::now();
        for _ in 0..100 {
            assert_eq!(m.on_packet(t0, 1500), Verdict::DeliverAt(t0));
        }
    }

    /// Random arrivals (bursts and gaps, random sizes) against a rate-limited
    /// link: departures never outpace the rate, the backlog never exceeds
    /// the limit, and delivery is never before arrival + delay.
    #[test]
    fn random_traffic_never_beats_the_rate_or_the_queue() {
        for &(rate, limit) in &[
            (8_000_000u64, 20_000usize),
            (100_000_000, 1_500_000),
            (300_000_000, 64 * 1024),
            (1_234_567, 3_000),
        ] {
            let delay = 5 * MS;
            let mut m = model(
                LinkProfile::ideal()
                    .with_rate_bps(rate)
                    .with_delay(delay)
                    .with_queue_limit_bytes(limit),
            );
            let mut rng = SplitMix64::new(rate);
            let t0 = Instant::now();
            let mut now = t0;
            let mut delivered: Vec<(Instant, u64)> = Vec::new();
            let mut last = t0;
            for _ in 0..20_000 {
                // Mostly bursts (0 gap), sometimes long gaps.
                let gap = match rng.next_up_to(9) {
                    0..=5 => 0,
                    6..=8 => rng.next_up_to(200),
                    _ => rng.next_up_to(20_000),
                };
                now += Duration::from_micros(gap);
                let len = 1 + rng.next_up_to(1499) as usize;
                match m.on_packet(now, len) {
                    Verdict::DeliverAt(t) => {
                        assert!(t >= now + delay + m.serialization_time(len));
                        assert!(t >= last, "FIFO by default");
                        last = t;
                        delivered.push((t, m.wire_bytes(len)));
                        assert!(m.backlog_bytes(now) <= limit as u64 + 1500 + 42);
                    }
                    Verdict::Drop(reason) => assert_eq!(reason, DropReason::Queue),
                }
                // After any accepted packet beyond the first of a busy period,
                // the backlog stays within the limit (+1 byte of rounding).
                let b = m.backlog_bytes(now);
                assert!(
                    b <= (limit as u64).max(1542) + 1,
                    "backlog {b} > limit {limit}"
                );
            }
            // Wire bytes delivered by time t <= rate * (t - t0 - delay) + one packet.
            let mut bytes = 0u64;
            for (t, wire) in &delivered {
                bytes += wire;
                let elapsed = t.saturating_duration_since(t0 + delay).as_nanos();
                let allowed = elapsed * u128::from(rate) / 8_000_000_000 + 1542;
                assert!(
                    u128::from(bytes) <= allowed,
                    "rate {rate}: {bytes} B delivered by {elapsed} ns, allowed {allowed}"
                );
            }
            assert!(delivered.len() > 100);
        }
    }

    #[test]
    fn jitter_stays_within_bounds_and_covers_them() {
        let delay = 20 * MS;
        let jitter = 5 * MS;
        let mut m = model(
            LinkProfile::ideal()
                .with_delay(delay)
                .with_jitter(jitter)
                .with_reorder(true)
                .with_seed(42),
        );
        let t0 = Instant::now();
        let mut min = Duration::MAX;
        let mut max = Duration::ZERO;
        let mut sum = 0u128;
        let n = 50_000u32;
        for i in 0..n {
            let now = t0 + US * i;
            let d = at(m.on_packet(now, 100)) - now;
            assert!(d >= delay - jitter && d <= delay + jitter, "{d:?}");
            min = min.min(d);
            max = max.max(d);
            sum += d.as_nanos();
        }
        // 50k uniform draws over 10 ms: the extremes are within 10 µs of the
        // bounds with probability 1 - 2e-22 (exp(-50000 * 0.001)).
        assert!(min < delay - jitter + 10 * US, "min {min:?}");
        assert!(max > delay + jitter - 10 * US, "max {max:?}");
        // Mean within 5 sigma: sigma = 10 ms / sqrt(12 n) = 12.9 µs.
        let mean = nanos(sum / u128::from(n));
        let err = mean.abs_diff(delay);
        assert!(err < 65 * US, "mean {mean:?}");
    }

    #[test]
    fn jitter_reorders_only_when_allowed() {
        let t0 = Instant::now();
        let run = |reorder: bool| {
            let mut m = model(
                LinkProfile::ideal()
                    .with_delay(10 * MS)
                    .with_jitter(2 * MS)
                    .with_reorder(reorder)
                    .with_seed(9),
            );
            (0..10_000u32)
                .map(|i| at(m.on_packet(t0 + 100 * US * i, 100)))
                .collect::<Vec<_>>()
        };
        let inversions = |v: &[Instant]| v.windows(2).filter(|w| w[1] < w[0]).count();
        // Gap 0.1 ms, jitter ±2 ms: neighbours swap about half the time.
        assert!(inversions(&run(true)) > 1_000);
        let fifo = run(false);
        assert_eq!(inversions(&fifo), 0);
        // FIFO delivery is still never earlier than delay - jitter.
        for (i, t) in fifo.iter().enumerate() {
            assert!(*t >= t0 + 100 * US * i as u32 + 8 * MS);
        }
    }

    #[test]
    fn jitter_larger_than_delay_is_clamped_at_zero() {
        let mut m = model(
            LinkProfile::ideal()
                .with_delay(MS)
                .with_jitter(5 * MS)
                .with_reorder(true),
        );
        let t0 = Instant::now();
        let mut zero = 0;
        for i in 0..10_000u32 {
            let now = t0 + US * i;
            let t = at(m.on_packet(now, 100));
            assert!(t >= now && t <= now + 6 * MS);
            zero += usize::from(t == now);
        }
        // P(draw <= -1 ms) = 0.4.
        assert!(zero > 3_000 && zero < 5_000, "{zero}");
    }

    fn loss_pattern(p: f64, seed: u64, n: usize) -> Vec<bool> {
        let mut m = model(LinkProfile::ideal().with_loss(p).with_seed(seed));
        let t0 = Instant::now();
        (0..n)
            .map(|_| m.on_packet(t0, 100) == Verdict::Drop(DropReason::Loss))
            .collect()
    }

    #[test]
    fn loss_fraction_is_within_five_sigma() {
        let n = 200_000usize;
        for &p in &[0.001, 0.01, 0.1, 0.5] {
            for seed in 0..3 {
                let lost = loss_pattern(p, seed, n).iter().filter(|l| **l).count();
                let sigma = (n as f64 * p * (1.0 - p)).sqrt();
                let expected = n as f64 * p;
                assert!(
                    (lost as f64 - expected).abs() <= 5.0 * sigma,
                    "p={p} seed={seed}: lost {lost}, expected {expected:.0} ± {sigma:.1}"
                );
            }
        }
        assert!(!loss_pattern(0.0, 1, 10_000).contains(&true));
        assert!(loss_pattern(1.0, 1, 10_000).iter().all(|l| *l));
    }

    #[test]
    fn same_seed_drops_the_same_packets() {
        let a = loss_pattern(0.05, 1234, 50_000);
        assert_eq!(a, loss_pattern(0.05, 1234, 50_000));
        assert_ne!(a, loss_pattern(0.05, 1235, 50_000));
        // The loss of packet i does not depend on jitter, rate or timing.
        let mut m = model(
            LinkProfile::ideal()
                .with_loss(0.05)
                .with_seed(1234)
                .with_jitter(3 * MS)
                .with_delay(5 * MS)
                .with_rate_bps(1_000_000_000)
                .with_queue_limit_bytes(usize::MAX),
        );
        let t0 = Instant::now();
        let b: Vec<bool> = (0..50_000u32)
            .map(|i| m.on_packet(t0 + US * i, 1000) == Verdict::Drop(DropReason::Loss))
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn full_verdict_sequences_are_reproducible() {
        let p = LinkProfile::ideal()
            .with_rate_bps(50_000_000)
            .with_delay(3 * MS)
            .with_jitter(MS)
            .with_loss(0.02)
            .with_queue_limit_bytes(30_000)
            .with_reorder(true)
            .with_seed(77);
        let t0 = Instant::now();
        let run = || {
            let mut m = model(p.clone());
            (0..5_000u32)
                .map(|i| m.on_packet(t0 + US * (i * 37 % 500), 1200))
                .collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.contains(&Verdict::Drop(DropReason::Loss)));
        assert!(a.contains(&Verdict::Drop(DropReason::Queue)));
    }

    #[test]
    fn time_going_backwards_never_departs_early() {
        let mut m = model(LinkProfile::ideal().with_rate_bps(8_000_000));
        let t0 = Instant::now() + Duration::from_secs(1);
        let first = at(m.on_packet(t0, 958));
        let second = at(m.on_packet(t0 - 500 * US, 958));
        assert_eq!(second, first + MS);
    }

    #[test]
    fn invalid_profiles_are_rejected() {
        assert!(LinkModel::new(LinkProfile::ideal().with_loss(2.0)).is_err());
    }
}
