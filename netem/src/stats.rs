//! Packet and byte counters of a running proxy, per direction.
//!
//! The live counters (`DirectionCounters`, crate-private) are relaxed atomics updated by the
//! receive and delivery threads; [`DirectionStats`] and [`ProxyStats`] are
//! plain snapshots of them. Each counter only grows. A packet is counted
//! in `packets_in` when received, then exactly once more when its fate is
//! known: dropped by loss, dropped by the queue, delivered, or failed to
//! send; until then it is [`in flight`](DirectionStats::in_flight).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::units::format_size;

/// Live counters of one direction (crate-internal).
#[derive(Debug, Default)]
pub(crate) struct DirectionCounters {
    packets_in: AtomicU64,
    bytes_in: AtomicU64,
    dropped_loss: AtomicU64,
    dropped_queue: AtomicU64,
    delivered_packets: AtomicU64,
    delivered_bytes: AtomicU64,
    send_errors: AtomicU64,
    peak_queue_bytes: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl DirectionCounters {
    pub(crate) fn received(&self, len: usize) {
        bump(&self.packets_in, 1);
        bump(&self.bytes_in, len as u64);
    }

    pub(crate) fn dropped_by_loss(&self) {
        bump(&self.dropped_loss, 1);
    }

    pub(crate) fn dropped_by_queue(&self) {
        bump(&self.dropped_queue, 1);
    }

    pub(crate) fn delivered(&self, len: usize) {
        bump(&self.delivered_packets, 1);
        bump(&self.delivered_bytes, len as u64);
    }

    pub(crate) fn send_failed(&self) {
        bump(&self.send_errors, 1);
    }

    /// Records the queue's backlog (wire bytes) right after a packet joined it.
    pub(crate) fn queued(&self, backlog_bytes: u64) {
        self.peak_queue_bytes
            .fetch_max(backlog_bytes, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> DirectionStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DirectionStats {
            packets_in: get(&self.packets_in),
            bytes_in: get(&self.bytes_in),
            dropped_loss: get(&self.dropped_loss),
            dropped_queue: get(&self.dropped_queue),
            delivered_packets: get(&self.delivered_packets),
            delivered_bytes: get(&self.delivered_bytes),
            send_errors: get(&self.send_errors),
            peak_queue_bytes: get(&self.peak_queue_bytes),
        }
    }
}

/// A snapshot of one direction's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionStats {
    /// Datagrams received from the sender side.
    pub packets_in: u64,
    /// Payload bytes received from the sender side.
    pub bytes_in: u64,
    /// Datagrams dropped by random loss.
    pub dropped_loss: u64,
    /// Datagrams dropped because the queue was full.
    pub dropped_queue: u64,
    /// Datagrams sent on to the receiver side.
    pub delivered_packets: u64,
    /// Payload bytes sent on to the receiver side.
    pub delivered_bytes: u64,
    /// Datagrams whose final send failed (e.g. the receiver's port is closed).
    pub send_errors: u64,
    /// The largest backlog of the rate limiter's queue, in wire bytes, seen right after a
    /// packet joined it (the packet included); 0 without a rate. Divided by the rate it is
    /// the worst queueing delay any packet met on this direction.
    pub peak_queue_bytes: u64,
}

impl DirectionStats {
    /// Datagrams received whose fate is not yet known (waiting for their
    /// delivery time, or discarded by a shutdown).
    pub fn in_flight(&self) -> u64 {
        self.packets_in.saturating_sub(
            self.dropped_loss + self.dropped_queue + self.delivered_packets + self.send_errors,
        )
    }
}

impl fmt::Display for DirectionStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "in {} pkts ({}), delivered {} pkts ({}), lost {}, queue-dropped {}, peak queue {}, send errors {}, in flight {}",
            self.packets_in,
            format_size(self.bytes_in),
            self.delivered_packets,
            format_size(self.delivered_bytes),
            self.dropped_loss,
            self.dropped_queue,
            format_size(self.peak_queue_bytes),
            self.send_errors,
            self.in_flight(),
        )
    }
}

/// A snapshot of a proxy's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Client → upstream.
    pub up: DirectionStats,
    /// Upstream → client.
    pub down: DirectionStats,
    /// Distinct client addresses seen (each got its own upstream socket).
    pub clients: u64,
    /// Datagrams from new clients refused (client limit reached or no
    /// socket could be opened for them); not counted in `up`.
    pub rejected_packets: u64,
}

impl fmt::Display for ProxyStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "up   (client -> upstream): {}", self.up)?;
        writeln!(f, "down (upstream -> client): {}", self.down)?;
        write!(
            f,
            "clients: {}, rejected packets from new clients: {}",
            self.clients, self.rejected_packets
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up() {
        let c = DirectionCounters::default();
        for _ in 0..5 {
            c.received(100);
        }
        c.dropped_by_loss();
        c.dropped_by_queue();
        c.delivered(100);
        c.send_failed();
        let s = c.snapshot();
        assert_eq!(s.packets_in, 5);
        assert_eq!(s.bytes_in, 500);
        assert_eq!(s.delivered_bytes, 100);
        assert_eq!(s.in_flight(), 1);
        let text = ProxyStats {
            up: s,
            ..ProxyStats::default()
        }
        .to_string();
        assert!(text.contains("in 5 pkts (500B)"), "{text}");
        assert!(text.contains("lost 1"), "{text}");
    }
}
