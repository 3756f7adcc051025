//! A congestion controller that never keeps more than the link's bandwidth-delay product
//! (plus a little headroom) in flight, so a bulk transfer leaves no standing queue at the
//! bottleneck and control messages on the same path still cross it in about one RTT.
//!
//! Why: quinn's BBR sets a congestion window of 2× its estimated BDP and paces at
//! 1.25 × window / RTT, i.e. it is window-limited, not pace-limited. A saturating transfer
//! therefore keeps up to one BDP queued at the bottleneck (a standing queue of one RTT) and
//! overflows drop-tail queues; every Pong and Commit waits behind that queue, and a lost
//! control packet blocks the control stream for a retransmission that queues again
//! (`wan-bench`, 50 ms links: control-RTT p99 0.29–0.38 s with plain BBR, 75–103 ms with the
//! cap). When the operator states the link's rate (`LinkProfile`, per peer), the sender knows
//! the BDP exactly:
//! rate × the *measured* minimum RTT. `Ceiling` caps BBR's window there, plus a headroom of
//! `max(HEADROOM_MIN, min_rtt / 8)` worth of bytes for ACK clocking jitter; below the cap
//! BBR behaves as before (so a link slower than stated is still handled by BBR).
//!
//! The cap is a [`RateCeiling`] handle shared with the connection's owner, because the peer
//! (and hence its link) is only known after the TLS handshake, when the controller already
//! exists: the server builds each connection's controller with a fresh handle and sets the
//! rate once it has identified the peer. A rate of 0 means no ceiling (pure BBR).

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, ControllerMetrics};
use quinn_proto::RttEstimator;

/// The least headroom above the BDP: ACK clocking and the receiver's scheduling delay, which
/// on short fast paths dwarfs the RTT (on a busy 2-core host, 1 Gbit/s with a 0.1 ms RTT: one
/// stream reached 58% of the link with 3 ms of headroom, 87% with 8 ms; `benches/tbf-bench.sh`).
/// It bounds the queue the sender can build at a bottleneck: 8 ms.
pub const HEADROOM_MIN: Duration = Duration::from_millis(8);

/// The longest stated RTT taken at its word (a peer may state anything).
pub const MAX_STATED_RTT: Duration = Duration::from_secs(10);

/// The ceiling's rate, settable after the controller was built.
#[derive(Debug, Clone, Default)]
pub struct RateCeiling {
    rate_bps: Arc<AtomicU64>,
    /// The stated RTT in µs, used until the connection has measured one.
    rtt_us: Arc<AtomicU64>,
}

impl RateCeiling {
    /// No ceiling until [`set`](Self::set).
    pub fn none() -> Self {
        Self::default()
    }

    /// Caps the window at `rate_bps` × (min RTT + headroom); `rate_bps` 0 removes the cap.
    /// Both may come from a peer's `Hello`, so any value is safe: the RTT is clamped to
    /// [`MAX_STATED_RTT`] and the arithmetic saturates.
    pub fn set(&self, rate_bps: u64, stated_rtt: Duration) {
        let rtt_us = stated_rtt.min(MAX_STATED_RTT).as_micros() as u64;
        self.rtt_us.store(rtt_us, Ordering::Relaxed);
        self.rate_bps.store(rate_bps, Ordering::Relaxed);
    }

    /// The rate in bits per second (0: none).
    pub fn rate_bps(&self) -> u64 {
        self.rate_bps.load(Ordering::Relaxed)
    }

    /// The window cap in bytes for a minimum RTT of `min_rtt` (or the stated RTT when the
    /// connection has no sample yet), never below `floor`; `None` without a rate.
    pub fn cap(&self, min_rtt: Option<Duration>, floor: u64) -> Option<u64> {
        let rate = self.rate_bps();
        if rate == 0 {
            return None;
        }
        let rtt =
            min_rtt.unwrap_or_else(|| Duration::from_micros(self.rtt_us.load(Ordering::Relaxed)));
        let horizon = rtt.saturating_add(HEADROOM_MIN.max(rtt / 8));
        let bytes = (rate as u128).saturating_mul(horizon.as_nanos()) / 8 / 1_000_000_000;
        Some(u64::try_from(bytes).unwrap_or(u64::MAX).max(floor))
    }
}

/// Builds a `Ceiling` around BBR for each connection, all sharing one [`RateCeiling`].
#[derive(Debug)]
pub struct CeilingConfig {
    bbr: Arc<BbrConfig>,
    ceiling: RateCeiling,
}

impl CeilingConfig {
    pub fn new(ceiling: RateCeiling) -> Self {
        Self {
            bbr: Arc::new(BbrConfig::default()),
            ceiling,
        }
    }
}

impl ControllerFactory for CeilingConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(Ceiling {
            inner: self.bbr.clone().build(now, current_mtu),
            ceiling: self.ceiling.clone(),
            min_rtt: None,
            mtu: current_mtu,
        })
    }
}

/// BBR with its window capped at the link's BDP plus headroom (see the module docs).
struct Ceiling {
    inner: Box<dyn Controller>,
    ceiling: RateCeiling,
    min_rtt: Option<Duration>,
    mtu: u16,
}

impl Controller for Ceiling {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.inner.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &RttEstimator,
    ) {
        self.min_rtt = Some(rtt.min());
        self.inner.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.mtu = new_mtu;
        self.inner.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        let w = self.inner.window();
        match self.ceiling.cap(self.min_rtt, 4 * u64::from(self.mtu)) {
            Some(cap) => w.min(cap),
            None => w,
        }
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut m = self.inner.metrics();
        m.congestion_window = self.window();
        m
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Ceiling {
            inner: self.inner.clone_box(),
            ceiling: self.ceiling.clone(),
            min_rtt: self.min_rtt,
            mtu: self.mtu,
        })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_the_measured_bdp_plus_headroom_and_only_when_a_rate_is_set() {
        let c = RateCeiling::none();
        assert_eq!(c.cap(Some(Duration::from_millis(50)), 0), None);
        // 100 Mbit/s with 50 ms stated: 12.5 MB/s × (50 + 8) ms (RTT/8 is below the minimum).
        c.set(100_000_000, Duration::from_millis(50));
        assert_eq!(c.cap(None, 0), Some(725_000));
        // A measured minimum RTT replaces the stated one: 150 ms → 12.5 MB/s × 168.75 ms.
        assert_eq!(c.cap(Some(Duration::from_millis(150)), 0), Some(2_109_375));
        // Short paths keep at least the floor and the 8 ms headroom.
        assert_eq!(
            c.cap(Some(Duration::from_micros(100)), 200_000),
            Some(200_000)
        );
        assert_eq!(
            c.cap(Some(Duration::from_micros(100)), 0),
            Some(12_500_000 * 81 / 10_000)
        );
        c.set(0, Duration::ZERO);
        assert_eq!(c.cap(None, 0), None);
    }

    #[test]
    fn absurd_stated_links_neither_panic_nor_overflow() {
        let c = RateCeiling::none();
        c.set(u64::MAX, Duration::MAX);
        let stated = c.cap(None, 0).expect("a rate is set");
        assert!(stated > 0);
        assert_eq!(c.cap(Some(Duration::MAX), 0), Some(u64::MAX));
        c.set(1, Duration::ZERO);
        assert_eq!(
            c.cap(None, 4800),
            Some(4800),
            "a tiny rate leaves the floor"
        );
    }
}
