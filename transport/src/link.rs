//! Transport parameters derived from a link profile.
//!
//! Measured on this kind of machine (see `shared/notes/wan-emulation.md` and
//! `docs/benchmarks.md`): loss-based congestion control collapses on long lossy links
//! (Cubic ~10% of a 100 Mbit/s, 50 ms, 0.1%-loss link) while BBR reaches 84–94%. Two further
//! rules keep control messages fast while a transfer fills the link:
//!
//! 1. **What is in flight is bounded by the sender**, at the link's bandwidth-delay product:
//!    quinn's BBR alone keeps up to one BDP queued at the bottleneck (57,000–71,000 packets
//!    dropped by a drop-tail queue per 136 MB transfer in `wan-bench`; none with the cap). Once it knows the peer's link (stated by the peer in
//!    `Hello`, or by the server's operator), a server caps its window there
//!    ([`crate::ceiling`]). Receive windows used to do this job, crudely (1.5–3× BDP).
//! 2. **Connection-level limits never bind before stream-level ones.** When the data streams
//!    exhaust the connection's credit (the peer's connection receive window, or the local
//!    send buffer), every stream waits for credit, and quinn hands freed credit to waiting
//!    streams in LIFO order: the control stream lost that race for up to 0.6 s per `Pong`
//!    (traced in `wan-bench`). So each stream may have 2× BDP outstanding (one stream can
//!    fill the link), the connection [`CONNECTION_STREAMS`] times that (four stripes, a
//!    refetch and control all fit), and the send buffer is never the limit
//!    ([`SEND_BUFFER`]: what is buffered is bounded by the peer's credit anyway).
//!
//! These windows are receiver-side settings, so every endpoint derives them from the
//! profile of the link it receives over.

use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, TransportConfig, VarInt};

use crate::ceiling::{CeilingConfig, RateCeiling};

/// Keep-alive period on every connection.
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// A connection silent for this long is dead (see `transport_config`).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The floor for windows, so that short or fast links still keep enough bytes in flight.
const MIN_WINDOW: u64 = 256 * 1024;
/// The connection receive window, in stream windows.
pub const CONNECTION_STREAMS: u64 = 10;
/// The local send buffer: large, because the peer's connection credit already bounds what
/// can be buffered, and a smaller buffer would make the control stream race the data
/// streams for space.
pub const SEND_BUFFER: u64 = 1 << 30;

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

    /// As carried in `Hello`: (rate in bit/s, RTT in µs).
    pub fn stated(&self) -> (u64, u64) {
        (self.rate_bps, self.rtt.as_micros() as u64)
    }

    /// From `Hello`'s (rate in bit/s, RTT in µs).
    pub fn from_stated((rate_bps, rtt_us): (u64, u64)) -> Self {
        Self {
            rate_bps,
            rtt: Duration::from_micros(rtt_us),
        }
    }

    /// Bytes in flight that fill the link: rate × RTT.
    pub fn bdp_bytes(&self) -> u64 {
        (self.rate_bps as u128 * self.rtt.as_nanos() / 8 / 1_000_000_000) as u64
    }

    /// (stream receive window, connection receive window) in bytes: 2× the BDP, and
    /// [`CONNECTION_STREAMS`] times that.
    pub fn windows(&self) -> (u64, u64) {
        let stream = 2 * self.bdp_bytes().max(MIN_WINDOW);
        (stream, CONNECTION_STREAMS * stream)
    }

    /// QUIC transport parameters for receiving over this link: BBR, windows from the BDP,
    /// the RTT as the initial estimate, keep-alives well inside the idle timeout. Sending is
    /// plain BBR; see [`transport_config_capped`](Self::transport_config_capped).
    pub fn transport_config(&self) -> TransportConfig {
        self.transport_config_capped(RateCeiling::none())
    }

    /// As [`transport_config`](Self::transport_config), with the sender's window capped by
    /// `ceiling` (set it once the peer, hence its link, is known: `crate::ceiling`).
    pub fn transport_config_capped(&self, ceiling: RateCeiling) -> TransportConfig {
        let (stream, conn) = self.windows();
        let mut t = TransportConfig::default();
        t.congestion_controller_factory(Arc::new(CeilingConfig::new(ceiling)));
        t.stream_receive_window(VarInt::from_u64(stream).unwrap_or(VarInt::MAX));
        t.receive_window(VarInt::from_u64(conn).unwrap_or(VarInt::MAX));
        t.send_window(SEND_BUFFER);
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

/// Why a link profile could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("link profile {0:?}: expected RATE_MBIT:RTT_MS, e.g. 250:150")]
pub struct BadLinkProfile(String);

impl std::str::FromStr for LinkProfile {
    type Err = BadLinkProfile;

    /// `RATE_MBIT:RTT_MS`, e.g. `1000:30` or `250:150` (fractions allowed).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadLinkProfile(s.to_owned());
        let (rate, rtt) = s.split_once(':').ok_or_else(bad)?;
        let rate: f64 = rate.trim().parse().map_err(|_| bad())?;
        let rtt: f64 = rtt.trim().parse().map_err(|_| bad())?;
        if !(rate > 0.0 && rate.is_finite() && rtt >= 0.0 && rtt.is_finite()) {
            return Err(bad());
        }
        Ok(LinkProfile {
            rate_bps: (rate * 1e6) as u64,
            rtt: Duration::try_from_secs_f64(rtt / 1e3).map_err(|_| bad())?,
        })
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
        assert_eq!(l.windows(), (6_400_000, 64_000_000));
        // 10 Gbit/s × 0.5 ms = 625 kB.
        assert_eq!(LinkProfile::LAN.windows(), (1_250_000, 12_500_000));
        // A short slow link's BDP is tiny: the floor applies.
        let fast_short = LinkProfile {
            rate_bps: 1_000_000,
            rtt: Duration::from_millis(1),
        };
        assert_eq!(fast_short.windows(), (2 * MIN_WINDOW, 20 * MIN_WINDOW));
    }

    #[test]
    fn profiles_parse_from_rate_and_rtt() {
        let p: LinkProfile = "250:150".parse().expect("parse");
        assert_eq!(p.rate_bps, 250_000_000);
        assert_eq!(p.rtt, Duration::from_millis(150));
        let p: LinkProfile = "0.5:0.25".parse().expect("parse");
        assert_eq!((p.rate_bps, p.rtt), (500_000, Duration::from_micros(250)));
        for bad in [
            "", "100", "100:", ":50", "x:50", "0:50", "-1:50", "100:-5", "inf:1", "100:1e30",
        ] {
            assert!(bad.parse::<LinkProfile>().is_err(), "{bad:?} parsed");
        }
    }
}
