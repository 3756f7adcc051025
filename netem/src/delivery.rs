//! The time-ordered delivery queue of one direction and the body of its
//! dedicated delivery thread.
//!
//! Receive threads [`push`](DeliveryQueue::push) packets with the delivery
//! instant the [`LinkModel`](crate::LinkModel) chose; one thread per
//! direction runs [`DeliveryQueue::run`], which sleeps on a condition
//! variable until the earliest due time minus [`SPIN`], spins for the rest
//! (sleep wake-ups on Linux are late by ~50 µs of timer slack), then sends
//! every packet that is due. Tokio timers were measured to add ~1 ms of bias here, hence
//! a plain thread.
//!
//! Invariants: packets leave in `(due, push order)` order, never before their
//! due instant; the thread is woken only when a push makes a new earliest
//! packet (or on stop); after [`stop`](DeliveryQueue::stop) nothing more is
//! sent, queued packets (and the sockets they hold) are dropped, and `run`
//! returns promptly.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::stats::DirectionCounters;

/// How long before a due time the thread stops sleeping and starts spinning.
///
/// Zero: on this project's 2 shared, busy cores, spinning 30–100 µs per wake
/// *raised* the added p50/p99 delay (the spinning thread starves the receive
/// threads): at 300 Mbit/s p50 went from ~0.1–0.6 ms (no spin) to ~0.8–2.3 ms
/// (see `docs/netem.md`). On a quiet machine with spare cores, 50–100 µs buys
/// precision below the timer slack.
pub(crate) const SPIN: Duration = Duration::from_micros(0);

/// Most packets taken off the heap per lock acquisition, so that receive
/// threads are never blocked behind a long run of sends.
const MAX_BATCH: usize = 64;

/// A datagram ready to go out: on `socket`, to `to` (or to the socket's
/// connected peer when `None`).
#[derive(Debug)]
pub(crate) struct Outgoing {
    pub(crate) socket: Arc<UdpSocket>,
    pub(crate) to: Option<SocketAddr>,
    pub(crate) data: Vec<u8>,
}

#[derive(Debug)]
struct Entry {
    due: Instant,
    seq: u64,
    out: Outgoing,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    /// Reversed, so that `BinaryHeap` (a max-heap) pops the earliest first.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .due
            .cmp(&self.due)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Default)]
struct State {
    heap: BinaryHeap<Entry>,
    next_seq: u64,
    stopped: bool,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct DeliveryQueue {
    state: Mutex<State>,
    wake: Condvar,
}

/// Locks, recovering from poisoning: the state is a heap and two scalars,
/// valid after any panic in a holder.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DeliveryQueue {
    /// Queues `out` for sending at `due`. Dropped silently after `stop`.
    pub(crate) fn push(&self, due: Instant, out: Outgoing) {
        let mut st = lock(&self.state);
        if st.stopped {
            return;
        }
        let new_head = st.heap.peek().is_none_or(|head| due < head.due);
        let seq = st.next_seq;
        st.next_seq += 1;
        st.heap.push(Entry { due, seq, out });
        drop(st);
        if new_head {
            self.wake.notify_one();
        }
    }

    /// Stops the delivery thread and drops every queued packet.
    pub(crate) fn stop(&self) {
        let mut st = lock(&self.state);
        st.stopped = true;
        st.heap.clear();
        drop(st);
        self.wake.notify_all();
    }

    /// The delivery loop; returns after [`stop`](Self::stop).
    pub(crate) fn run(&self, counters: &DirectionCounters) {
        let mut batch: Vec<Outgoing> = Vec::with_capacity(MAX_BATCH);
        loop {
            let Some(due) = self.wait_for_head() else {
                return;
            };
            // Spin outside the lock for the last few microseconds.
            while Instant::now() < due {
                std::hint::spin_loop();
            }
            {
                let mut st = lock(&self.state);
                if st.stopped {
                    return;
                }
                let now = Instant::now();
                while batch.len() < MAX_BATCH && st.heap.peek().is_some_and(|e| e.due <= now) {
                    if let Some(entry) = st.heap.pop() {
                        batch.push(entry.out);
                    }
                }
            }
            for out in batch.drain(..) {
                send(&out, counters);
            }
        }
    }

    /// Sleeps until the earliest packet is due within [`SPIN`]; returns its
    /// due instant, or `None` once stopped.
    fn wait_for_head(&self) -> Option<Instant> {
        let mut st = lock(&self.state);
        loop {
            if st.stopped {
                return None;
            }
            let now = Instant::now();
            let Some(due) = st.heap.peek().map(|e| e.due) else {
                st = self.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            let wake_at = due.checked_sub(SPIN).unwrap_or(due);
            if wake_at <= now {
                return Some(due);
            }
            st = self
                .wake
                .wait_timeout(st, wake_at - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

fn send(out: &Outgoing, counters: &DirectionCounters) {
    let result = match out.to {
        Some(to) => out.socket.send_to(&out.data, to),
        None => out.socket.send(&out.data),
    };
    match result {
        Ok(_) => counters.delivered(out.data.len()),
        Err(_) => counters.send_failed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outgoing(socket: &Arc<UdpSocket>, to: SocketAddr, byte: u8) -> Outgoing {
        Outgoing {
            socket: Arc::clone(socket),
            to: Some(to),
            data: vec![byte],
        }
    }

    #[test]
    fn heap_pops_earliest_then_push_order() {
        let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").expect("bind"));
        let to = socket.local_addr().expect("addr");
        let t0 = Instant::now();
        let mut heap = BinaryHeap::new();
        let dues = [3u64, 1, 2, 1, 0];
        for (seq, d) in dues.iter().enumerate() {
            heap.push(Entry {
                due: t0 + Duration::from_millis(*d),
                seq: seq as u64,
                out: outgoing(&socket, to, seq as u8),
            });
        }
        let order: Vec<u8> = std::iter::from_fn(|| heap.pop().map(|e| e.out.data[0])).collect();
        assert_eq!(order, vec![4, 1, 3, 2, 0]);
    }

    /// Real sockets: packets pushed out of order arrive sorted by due time
    /// and never early; stop ends the thread.
    #[test]
    fn delivers_in_due_order_and_never_early() {
        let sender = Arc::new(UdpSocket::bind("127.0.0.1:0").expect("bind sender"));
        let receiver = UdpSocket::bind("127.0.0.1:0").expect("bind receiver");
        receiver
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let to = receiver.local_addr().expect("addr");
        let queue = Arc::new(DeliveryQueue::default());
        let counters = Arc::new(DirectionCounters::default());
        let thread = {
            let (q, c) = (Arc::clone(&queue), Arc::clone(&counters));
            std::thread::spawn(move || q.run(&c))
        };
        let t0 = Instant::now() + Duration::from_millis(20);
        let offsets_ms = [30u64, 10, 20, 0, 40];
        for (i, ms) in offsets_ms.iter().enumerate() {
            queue.push(
                t0 + Duration::from_millis(*ms),
                outgoing(&sender, to, i as u8),
            );
        }
        let mut got = Vec::new();
        let mut buf = [0u8; 16];
        for _ in 0..offsets_ms.len() {
            let (n, _) = receiver.recv_from(&mut buf).expect("packet within 5 s");
            assert_eq!(n, 1);
            let idx = usize::from(buf[0]);
            assert!(
                Instant::now() >= t0 + Duration::from_millis(offsets_ms[idx]),
                "packet {idx} arrived early"
            );
            got.push(buf[0]);
        }
        assert_eq!(got, vec![3, 1, 2, 0, 4]);
        queue.stop();
        thread.join().expect("delivery thread");
        assert_eq!(counters.snapshot().delivered_packets, 5);
    }
}
