//! Transport parameters derived from a link profile.
//!
//! Measured on this kind of machine (see `shared/notes/wan-emulation.md`): loss-based
//! congestion control collapses on long lossy links (Cubic ~10% of a 100 Mbit/s, 50 ms,
//! 0.1%-loss link) while BBR reaches 84–94%; but BBR with an unlimited connection receive
//! window and several streams overfilled the bottleneck (~50% of packets dropped), which
//! would starve control traffic sharing the link. Capping the receiver's connection window
//! near 1.5× the bandwidth-delay product and each stream's near 1× fixed it — for four
//! streams. Starling sends a version on one stream today, and at 1× BDP that stream was
//! window-limited (`wan-bench`: 57% of a 100 Mbit/s, 50 ms, 0.1%-loss link); 2× per stream
//! and 3× per connection gave 74–76% without overfilling the bottleneck. When versions are
//! striped over several streams, the per-stream window should shrink accordingly. These
//! windows are receiver-side settings, so every endpoint derives them from the profile of the
//! link it receives over.

use std::sync::Arc;
use std::time::Duration;

use quinn::congestion::BbrConfig;
use quinn::{IdleTimeout, TransportConfig, VarInt};

/// Keep-alive period on every connection.
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// A connection silent for this long is dead (see `transport_config`).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The floor for windows, so that short or fast links still keep enough bytes in flight.
const MIN_WINDOW: u64 = 256 * 1024;

/// The emulated or expected link to a peer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkProfile {
    pub rate_bps: u64,
    pub rtt: Duration,
}

impl LinkProfile {
    /// A LAN inside a region.
    pub const LAN: LinkProfile = LinkProfile {
        rate_bps: 10_000_000_000,
        rtt: Duration::from_micros(500),
    };

    /// Bytes in flight that fill the link: rate × RTT.
    pub fn bdp_bytes(&self) -> u64 {
        (self.rate_bps as u128 * self.rtt.as_nanos() / 8 / 1_000_000_000) as u64
    }

    /// (stream receive window, connection receive window) in bytes: 2× and 3× the BDP.
    pub fn windows(&self) -> (u64, u64) {
        let bdp = self.bdp_bytes().max(MIN_WINDOW);
        (2 * bdp, 3 * bdp)
    }

    /// QUIC transport parameters for receiving over this link: BBR, windows from the BDP,
    /// the RTT as the initial estimate, keep-alives well inside the idle timeout.
    pub fn transport_config(&self) -> TransportConfig {
        let (stream, conn) = self.windows();
        let mut t = TransportConfig::default();
        t.congestion_controller_factory(Arc::new(BbrConfig::default()));
        t.stream_receive_window(VarInt::from_u64(stream).unwrap_or(VarInt::MAX));
        t.receive_window(VarInt::from_u64(conn).unwrap_or(VarInt::MAX));
        t.send_window(conn.saturating_mul(2));
        t.initial_rtt(self.rtt.max(Duration::from_micros(100)));
        t.max_concurrent_uni_streams(VarInt::from_u32(256));
        // A peer that vanished (SIGKILL, power loss) sends no close: the idle timeout is how
        // fast its subscribers fail over. Keep-alives make an idle but live link never time
        // out; five seconds also rides out a few lost keep-alives on a lossy WAN.
        t.keep_alive_interval(Some(KEEP_ALIVE));
        t.max_idle_timeout(IdleTimeout::try_from(IDLE_TIMEOUT).ok());
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_the_bandwidth_delay_product() {
        // 256 Mbit/s × 100 ms ≈ 3.2 MB in flight.
        let l = LinkProfile {
            rate_bps: 256_000_000,
            rtt: Duration::from_millis(100),
        };
        assert_eq!(l.bdp_bytes(), 3_200_000);
        assert_eq!(l.windows(), (6_400_000, 9_600_000));
        // 10 Gbit/s × 0.5 ms = 625 kB.
        assert_eq!(LinkProfile::LAN.windows(), (1_250_000, 1_875_000));
        // A short slow link's BDP is tiny: the floor applies.
        let fast_short = LinkProfile {
            rate_bps: 1_000_000,
            rtt: Duration::from_millis(1),
        };
        assert_eq!(fast_short.windows(), (2 * MIN_WINDOW, 3 * MIN_WINDOW));
    }
}
