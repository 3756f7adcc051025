//! End-to-end tests of the proxy over real UDP sockets on 127.0.0.1.
//!
//! Every wait is bounded by a deadline, every helper thread is joined, and
//! timing assertions are one-sided where the machine's noise could only make
//! things later (delivery is never early; a rate is never exceeded), with
//! generous bounds on the other side.

use std::collections::{BTreeSet, HashSet};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use starling_netem::{DropReason, LinkModel, LinkProfile, Proxy, ProxyHandle, Verdict};

const MS: Duration = Duration::from_millis(1);
const GENEROUS: Duration = Duration::from_secs(10);

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().expect("literal address")
}

/// A loopback socket with 4 MiB buffers (default buffers can overflow when
/// a test thread is descheduled) and a read timeout.
fn udp(read_timeout: Duration) -> UdpSocket {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)
        .expect("create socket");
    socket.set_recv_buffer_size(4 << 20).expect("rcvbuf");
    socket.set_send_buffer_size(4 << 20).expect("sndbuf");
    socket.bind(&localhost().into()).expect("bind 127.0.0.1:0");
    let socket: UdpSocket = socket.into();
    socket
        .set_read_timeout(Some(read_timeout))
        .expect("timeout");
    socket
}

fn addr(socket: &UdpSocket) -> SocketAddr {
    socket.local_addr().expect("local addr")
}

fn start(upstream: SocketAddr, up: LinkProfile, down: LinkProfile) -> ProxyHandle {
    Proxy::start(localhost(), upstream, up, down).expect("start proxy")
}

fn packet(seq: u32, len: usize) -> Vec<u8> {
    let mut p = vec![0u8; len.max(4)];
    p[..4].copy_from_slice(&seq.to_be_bytes());
    for (i, b) in p.iter_mut().enumerate().skip(4) {
        *b = (seq as usize).wrapping_mul(31).wrapping_add(i) as u8;
    }
    p
}

fn seq_of(p: &[u8]) -> u32 {
    u32::from_be_bytes([p[0], p[1], p[2], p[3]])
}

/// Polls `cond` every millisecond until it holds or `limit` passes.
fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(MS);
    }
}

/// A datagram seen by a [`Server`].
#[derive(Debug, Clone)]
struct Arrival {
    at: Instant,
    from: SocketAddr,
    data: Vec<u8>,
}

/// An upstream server on its own thread: records every datagram and, when
/// `echo` is set, sends it back to its sender. Stopped and joined on drop.
struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Arrival>>>,
}

impl Server {
    fn start(echo: bool) -> Self {
        let socket = udp(Duration::from_millis(10));
        let addr = addr(&socket);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut buf = vec![0u8; 65_536];
                // After a stop, drain what is already queued (at most 1 s).
                let mut drain_until: Option<Instant> = None;
                loop {
                    if drain_until.is_none() && stop.load(Ordering::Relaxed) {
                        drain_until = Some(Instant::now() + Duration::from_secs(1));
                    }
                    match socket.recv_from(&mut buf) {
                        Ok((n, from)) => {
                            let at = Instant::now();
                            if echo {
                                socket.send_to(&buf[..n], from).expect("echo");
                            }
                            seen.push(Arrival {
                                at,
                                from,
                                data: buf[..n].to_vec(),
                            });
                        }
                        Err(_) if drain_until.is_some() => break,
                        Err(_) => {}
                    }
                    if drain_until.is_some_and(|t| Instant::now() >= t) {
                        break;
                    }
                }
                seen
            })
        };
        Self {
            addr,
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> Vec<Arrival> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .map(|t| t.join().expect("server thread"))
            .unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits until the proxy has received `n` packets upstream-bound and none
/// is still waiting for its delivery time.
fn settle_up(proxy: &ProxyHandle, n: u64) {
    let settled = wait_until(GENEROUS, || {
        let s = proxy.stats().up;
        s.packets_in == n && s.in_flight() == 0
    });
    assert!(settled, "proxy did not settle: {}", proxy.stats());
}

#[test]
fn ideal_link_echoes_every_packet_intact_and_in_order() {
    let server = Server::start(true);
    let proxy = start(server.addr, LinkProfile::ideal(), LinkProfile::ideal());
    let client = udp(Duration::from_secs(5));
    let mut received = Vec::new();
    let mut buf = vec![0u8; 65_536];
    let sizes = [0usize, 1, 4, 100, 1200, 1472, 9000, 65_507];
    let n = 1_000u32;
    // Windows of 50 so that no socket buffer can overflow.
    for window in 0..(n / 50) {
        for seq in window * 50..(window + 1) * 50 {
            let len = sizes[seq as usize % sizes.len()];
            client
                .send_to(&packet(seq, len), proxy.local_addr())
                .expect("send");
        }
        for _ in 0..50 {
            let (len, from) = client.recv_from(&mut buf).expect("echo within 5 s");
            assert_eq!(from, proxy.local_addr());
            received.push(buf[..len].to_vec());
        }
    }
    for (seq, data) in received.iter().enumerate() {
        let len = sizes[seq % sizes.len()];
        assert_eq!(*data, packet(seq as u32, len), "packet {seq} differs");
    }
    let stats = proxy.shutdown().expect("shutdown");
    assert_eq!(stats.up.delivered_packets, u64::from(n));
    assert_eq!(stats.down.delivered_packets, u64::from(n));
    assert_eq!(stats.up.bytes_in, stats.down.delivered_bytes);
    assert_eq!(stats.clients, 1);
    assert_eq!(server.finish().len(), n as usize);
}

#[test]
fn delayed_link_is_never_early_and_close_to_the_delay() {
    let delay = 30 * MS;
    let server = Server::start(false);
    let proxy = start(
        server.addr,
        LinkProfile::ideal().with_delay(delay),
        LinkProfile::ideal(),
    );
    let client = udp(Duration::from_secs(5));
    let n = 100u32;
    let mut sent_at = Vec::new();
    for seq in 0..n {
        sent_at.push(Instant::now());
        client
            .send_to(&packet(seq, 200), proxy.local_addr())
            .expect("send");
        std::thread::sleep(MS);
    }
    settle_up(&proxy, u64::from(n));
    let arrivals = server.finish();
    assert_eq!(arrivals.len(), n as usize);
    let mut one_way: Vec<Duration> = arrivals
        .iter()
        .map(|a| a.at - sent_at[seq_of(&a.data) as usize])
        .collect();
    for d in &one_way {
        assert!(*d >= delay, "a packet arrived after {d:?} < {delay:?}");
    }
    one_way.sort();
    let median = one_way[one_way.len() / 2];
    assert!(median < delay + 20 * MS, "median one-way {median:?}");
    proxy.shutdown().expect("shutdown");
}

#[test]
fn round_trip_adds_both_directions_and_jitter_stays_bounded() {
    let (up_delay, down_delay, jitter) = (10 * MS, 20 * MS, 5 * MS);
    let server = Server::start(true);
    let proxy = start(
        server.addr,
        LinkProfile::ideal()
            .with_delay(up_delay)
            .with_jitter(jitter),
        LinkProfile::ideal()
            .with_delay(down_delay)
            .with_jitter(jitter)
            .with_seed(1),
    );
    let client = udp(Duration::from_secs(5));
    let mut buf = [0u8; 64];
    for seq in 0..40u32 {
        let start = Instant::now();
        client
            .send_to(&packet(seq, 16), proxy.local_addr())
            .expect("send");
        let (len, _) = client.recv_from(&mut buf).expect("reply within 5 s");
        let rtt = start.elapsed();
        assert_eq!(seq_of(&buf[..len]), seq);
        let floor = up_delay + down_delay - 2 * jitter;
        assert!(rtt >= floor, "round trip {rtt:?} < {floor:?}");
    }
    proxy.shutdown().expect("shutdown");
}

/// The real proxy drops exactly the packets the pure model says it drops,
/// and two proxies with the same seed drop the same packets.
#[test]
fn loss_is_seeded_and_matches_the_model() {
    let n = 2_000u32;
    let p = 0.2;
    let profile = LinkProfile::ideal().with_loss(p).with_seed(4242);
    let mut model = LinkModel::new(profile.clone()).expect("model");
    let t0 = Instant::now();
    let predicted: BTreeSet<u32> = (0..n)
        .filter(|_| model.on_packet(t0, 100) == Verdict::Drop(DropReason::Loss))
        .collect();
    let sigma = (f64::from(n) * p * (1.0 - p)).sqrt();
    let expected = f64::from(n) * p;
    assert!((predicted.len() as f64 - expected).abs() <= 5.0 * sigma);

    for _run in 0..2 {
        let server = Server::start(false);
        let proxy = start(server.addr, profile.clone(), LinkProfile::ideal());
        let client = udp(Duration::from_secs(5));
        for seq in 0..n {
            client
                .send_to(&packet(seq, 100), proxy.local_addr())
                .expect("send");
            if seq % 100 == 99 {
                std::thread::sleep(MS);
            }
        }
        settle_up(&proxy, u64::from(n));
        let stats = proxy.shutdown().expect("shutdown");
        let arrived: HashSet<u32> = server.finish().iter().map(|a| seq_of(&a.data)).collect();
        let lost: BTreeSet<u32> = (0..n).filter(|s| !arrived.contains(s)).collect();
        assert_eq!(lost, predicted);
        assert_eq!(stats.up.dropped_loss, predicted.len() as u64);
    }
}

/// Bytes delivered by time t never exceed rate × t + one packet, measured
/// from the first send; and the transfer is not absurdly slower than the rate.
#[test]
fn rate_limited_link_never_outpaces_its_rate() {
    let rate = 8_000_000u64; // 1 MB/s: a 958 B payload is 1000 wire bytes = 1 ms.
    let server = Server::start(false);
    let proxy = start(
        server.addr,
        LinkProfile::ideal()
            .with_rate_bps(rate)
            .with_queue_limit_bytes(10_000_000),
        LinkProfile::ideal(),
    );
    let client = udp(Duration::from_secs(5));
    let n = 300u32;
    let first_send = Instant::now();
    for seq in 0..n {
        client
            .send_to(&packet(seq, 958), proxy.local_addr())
            .expect("send");
    }
    settle_up(&proxy, u64::from(n));
    let arrivals = server.finish();
    assert_eq!(arrivals.len(), n as usize);
    let mut wire_bytes = 0u128;
    for a in &arrivals {
        wire_bytes += (a.data.len() + 42) as u128;
        let allowed = (a.at - first_send).as_nanos() * u128::from(rate) / 8_000_000_000 + 1000;
        assert!(
            wire_bytes <= allowed,
            "{wire_bytes} B by {:?}",
            a.at - first_send
        );
    }
    let took = arrivals
        .last()
        .map(|a| a.at - first_send)
        .expect("arrivals");
    assert!(took >= 299 * MS, "300 KB at 1 MB/s took only {took:?}");
    assert!(
        took < 3 * Duration::from_secs(1),
        "300 KB at 1 MB/s took {took:?}"
    );
    let seqs: Vec<u32> = arrivals.iter().map(|a| seq_of(&a.data)).collect();
    assert_eq!(seqs, (0..n).collect::<Vec<_>>(), "FIFO order");
    proxy.shutdown().expect("shutdown");
}

#[test]
fn full_queue_drops_the_tail() {
    let server = Server::start(false);
    let proxy = start(
        server.addr,
        LinkProfile::ideal()
            .with_rate_bps(8_000_000)
            .with_queue_limit_bytes(20_000),
        LinkProfile::ideal(),
    );
    let client = udp(Duration::from_secs(5));
    let n = 300u32;
    for seq in 0..n {
        client
            .send_to(&packet(seq, 958), proxy.local_addr())
            .expect("send");
    }
    settle_up(&proxy, u64::from(n));
    let stats = proxy.shutdown().expect("shutdown");
    let arrivals = server.finish();
    // 300 KB offered in a burst into a 20 KB queue drained at 1 MB/s: only a
    // sender stalled for ~280 ms could avoid drops.
    assert!(stats.up.dropped_queue > 0, "{stats}");
    assert_eq!(
        stats.up.delivered_packets + stats.up.dropped_queue,
        u64::from(n)
    );
    assert_eq!(arrivals.len() as u64, stats.up.delivered_packets);
    // The burst filled the queue to within a packet of its limit, and never past it.
    assert!(
        (19_000..=20_000).contains(&stats.up.peak_queue_bytes),
        "{stats}"
    );
    assert_eq!(stats.down.peak_queue_bytes, 0, "no rate, no queue: {stats}");
    // Drop-tail: the first 20 packets (the queue's worth) always get through.
    let seqs: Vec<u32> = arrivals.iter().map(|a| seq_of(&a.data)).collect();
    assert_eq!(seqs[..20], (0..20).collect::<Vec<_>>());
}

#[test]
fn each_client_gets_its_own_upstream_peer() {
    let server = Server::start(true);
    let proxy = start(server.addr, LinkProfile::ideal(), LinkProfile::ideal());
    let clients: Vec<UdpSocket> = (0..3).map(|_| udp(Duration::from_secs(5))).collect();
    let mut buf = [0u8; 64];
    for round in 0..5u32 {
        for (i, client) in clients.iter().enumerate() {
            let seq = round * 10 + i as u32;
            client
                .send_to(&packet(seq, 8), proxy.local_addr())
                .expect("send");
            let (len, _) = client.recv_from(&mut buf).expect("reply within 5 s");
            assert_eq!(seq_of(&buf[..len]), seq, "reply routed to the wrong client");
        }
    }
    let stats = proxy.shutdown().expect("shutdown");
    assert_eq!(stats.clients, 3);
    let peers: HashSet<SocketAddr> = server.finish().iter().map(|a| a.from).collect();
    assert_eq!(peers.len(), 3);
    for client in &clients {
        assert!(
            !peers.contains(&addr(client)),
            "upstream must not see the client itself"
        );
    }
}

/// Shutdown with packets still held by a long delay returns promptly and
/// frees the listen port and the per-client upstream ports.
#[test]
fn shutdown_is_prompt_and_releases_ports() {
    let server = Server::start(true);
    let proxy = start(
        server.addr,
        LinkProfile::ideal(),
        LinkProfile::ideal().with_delay(Duration::from_secs(60)),
    );
    let listen = proxy.local_addr();
    let client = udp(Duration::from_secs(5));
    client.send_to(&packet(0, 8), listen).expect("send");
    // The echo is now held in the 60 s down queue.
    assert!(wait_until(GENEROUS, || proxy.stats().down.packets_in == 1));

    let began = Instant::now();
    let stats = proxy.shutdown().expect("shutdown joins every thread");
    let took = began.elapsed();
    assert!(took < Duration::from_secs(3), "shutdown took {took:?}");
    assert_eq!(stats.down.in_flight(), 1);
    let upstream_peer = server.finish()[0].from;
    UdpSocket::bind(listen).expect("listen port released");
    UdpSocket::bind(upstream_peer).expect("client's upstream port released");
}

#[test]
fn dropping_the_handle_stops_the_proxy() {
    let proxy = start(
        "127.0.0.1:9".parse().expect("literal"),
        LinkProfile::ideal(),
        LinkProfile::ideal(),
    );
    let listen = proxy.local_addr();
    drop(proxy);
    UdpSocket::bind(listen).expect("listen port released on drop");
}

#[test]
fn bind_errors_and_bad_profiles_are_reported() {
    let taken = udp(Duration::from_secs(1));
    let err = Proxy::start(
        addr(&taken),
        localhost(),
        LinkProfile::ideal(),
        LinkProfile::ideal(),
    )
    .expect_err("port in use");
    assert!(err.to_string().contains("cannot bind"), "{err}");
    let err = Proxy::start(
        localhost(),
        localhost(),
        LinkProfile::ideal().with_loss(1.5),
        LinkProfile::ideal(),
    )
    .expect_err("bad loss");
    assert!(err.to_string().contains("loss"), "{err}");
}

/// Sending to an upstream that is not listening counts send errors (ICMP
/// port unreachable) instead of killing the relay.
#[test]
fn closed_upstream_is_survived() {
    let closed = {
        let s = udp(Duration::from_secs(1));
        addr(&s)
    };
    let proxy = start(closed, LinkProfile::ideal(), LinkProfile::ideal());
    let client = udp(Duration::from_secs(1));
    for seq in 0..20u32 {
        client
            .send_to(&packet(seq, 8), proxy.local_addr())
            .expect("send");
        std::thread::sleep(MS);
    }
    settle_up(&proxy, 20);
    let stats = proxy.shutdown().expect("shutdown");
    assert_eq!(stats.up.delivered_packets + stats.up.send_errors, 20);
}
