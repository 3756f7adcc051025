//! [`Proxy`]: a UDP relay that applies a [`LinkModel`] to each direction.
//!
//! Threads (all owned by the [`ProxyHandle`]):
//! - `netem-listen` receives client datagrams on the listen socket. Each new
//!   client address gets its own upstream socket, connected to the upstream
//!   address, so the upstream sees one distinct peer per client (like NAT).
//! - `netem-client-PORT`, one per client, receives the upstream's replies on
//!   that client's upstream socket.
//! - `netem-up` and `netem-down` deliver each direction's packets at the
//!   times the model chose (see the private `delivery` module).
//!
//! Both directions share one model each across all clients: the emulated
//! link is the region's bottleneck, not a per-flow one.
//!
//! Invariants: a packet goes through its direction's model exactly once, and
//! it is queued for delivery under the model's lock, so FIFO verdicts stay
//! FIFO on the wire; receive threads wake at least every [`POLL`] to notice a
//! stop; [`ProxyHandle::shutdown`] (or drop) stops and joins every thread
//! within [`SHUTDOWN_BOUND`], after which every socket is closed.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

use crate::delivery::{DeliveryQueue, Outgoing};
use crate::error::NetemError;
use crate::model::{DropReason, LinkModel, Verdict};
use crate::profile::LinkProfile;
use crate::stats::{DirectionCounters, ProxyStats};

/// Requested `SO_RCVBUF`/`SO_SNDBUF` of every socket (the kernel caps it at
/// `net.core.rmem_max`/`wmem_max`). Default buffers lost ~30 % of datagrams
/// at 1 Gbit/s here.
pub const SOCKET_BUFFER_BYTES: usize = 4 * 1024 * 1024;

/// Receive timeout of the receive threads: the longest a stop waits for them.
pub const POLL: Duration = Duration::from_millis(50);

/// Longest [`ProxyHandle::shutdown`] waits for its threads.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(5);

/// Most distinct client addresses per proxy (one thread and socket each);
/// datagrams from further clients are counted in
/// [`ProxyStats::rejected_packets`] and dropped.
pub const MAX_CLIENTS: usize = 1024;

/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One direction: its model, its delivery queue and its counters.
#[derive(Debug)]
struct Link {
    model: Mutex<LinkModel>,
    queue: DeliveryQueue,
    counters: DirectionCounters,
}

impl Link {
    fn new(profile: LinkProfile) -> Result<Self, NetemError> {
        Ok(Self {
            model: Mutex::new(LinkModel::new(profile)?),
            queue: DeliveryQueue::default(),
            counters: DirectionCounters::default(),
        })
    }

    fn offer(&self, out: Outgoing) {
        self.counters.received(out.data.len());
        let mut model = lock(&self.model);
        let now = Instant::now();
        match model.on_packet(now, out.data.len()) {
            Verdict::Drop(DropReason::Loss) => self.counters.dropped_by_loss(),
            Verdict::Drop(DropReason::Queue) => self.counters.dropped_by_queue(),
            Verdict::DeliverAt(due) => {
                self.counters.queued(model.backlog_bytes(now));
                // Pushed under the model lock so equal due times keep model order.
                self.queue.push(due, out);
            }
        }
    }
}

#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    up: Link,
    down: Link,
    clients: AtomicU64,
    rejected: AtomicU64,
    client_threads: Mutex<Vec<(String, JoinHandle<()>)>>,
}

impl Shared {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn stats(&self) -> ProxyStats {
        ProxyStats {
            up: self.up.counters.snapshot(),
            down: self.down.counters.snapshot(),
            clients: self.clients.load(Ordering::Relaxed),
            rejected_packets: self.rejected.load(Ordering::Relaxed),
        }
    }
}

/// Starts UDP link emulators; see [`Proxy::start`].
#[derive(Debug, Clone, Copy)]
pub struct Proxy;

impl Proxy {
    /// Binds `listen` (port 0 picks a free port) and relays every client's
    /// datagrams to `upstream` through a link shaped by `up_profile`, and the
    /// replies back through one shaped by `down_profile`.
    ///
    /// # Errors
    /// [`NetemError::InvalidProfile`] for a bad profile,
    /// [`NetemError::Bind`] if `listen` cannot be bound, and
    /// [`NetemError::Io`] if a socket option or a thread cannot be set up.
    pub fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        up_profile: LinkProfile,
        down_profile: LinkProfile,
    ) -> Result<ProxyHandle, NetemError> {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            up: Link::new(up_profile)?,
            down: Link::new(down_profile)?,
            clients: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            client_threads: Mutex::new(Vec::new()),
        });
        let socket = Arc::new(udp_socket(listen)?);
        let local_addr = socket
            .local_addr()
            .map_err(|e| NetemError::io("reading the listen address", e))?;
        let socket_buffers = socket_buffer_sizes(&socket);

        // From here on, the handle's drop stops whatever was started.
        let mut handle = ProxyHandle {
            local_addr,
            upstream,
            socket_buffers,
            shared: Arc::clone(&shared),
            threads: Vec::new(),
        };
        for (name, is_up) in [("netem-up", true), ("netem-down", false)] {
            let shared = Arc::clone(&shared);
            let thread = spawn(name.to_owned(), move || {
                let link = if is_up { &shared.up } else { &shared.down };
                link.queue.run(&link.counters);
            })?;
            handle.threads.push(thread);
        }
        let thread = spawn("netem-listen".to_owned(), move || {
            listen_loop(&shared, &socket, upstream);
        })?;
        handle.threads.push(thread);
        Ok(handle)
    }
}

/// A running proxy. Dropping it stops it, like [`ProxyHandle::shutdown`].
#[derive(Debug)]
pub struct ProxyHandle {
    local_addr: SocketAddr,
    upstream: SocketAddr,
    socket_buffers: (usize, usize),
    shared: Arc<Shared>,
    threads: Vec<(String, JoinHandle<()>)>,
}

impl ProxyHandle {
    /// The address clients should send to (the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The address datagrams are relayed to.
    pub fn upstream_addr(&self) -> SocketAddr {
        self.upstream
    }

    /// Effective `(SO_RCVBUF, SO_SNDBUF)` of the listen socket as the kernel
    /// reports them (Linux reports twice the usable size).
    pub fn socket_buffers(&self) -> (usize, usize) {
        self.socket_buffers
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ProxyStats {
        self.shared.stats()
    }

    /// Stops relaying, joins every thread (waiting at most
    /// [`SHUTDOWN_BOUND`]) and returns the final counters. Packets still
    /// waiting for their delivery time are discarded (they stay counted as
    /// in flight). Afterwards the listen port is free again.
    ///
    /// # Errors
    /// [`NetemError::ThreadPanicked`] if a thread panicked, or
    /// [`NetemError::ShutdownTimeout`] if some did not stop in time.
    pub fn shutdown(mut self) -> Result<ProxyStats, NetemError> {
        self.stop_and_join()?;
        Ok(self.shared.stats())
    }

    fn stop_and_join(&mut self) -> Result<(), NetemError> {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.up.queue.stop();
        self.shared.down.queue.stop();
        let deadline = Instant::now() + SHUTDOWN_BOUND;
        let mut joiner = Joiner::default();
        // The listen thread is last in `threads`; join it before taking the
        // client threads, since it is the one that spawns them.
        for (name, thread) in self.threads.drain(..).rev() {
            joiner.join(name, thread, deadline);
        }
        let clients = std::mem::take(&mut *lock(&self.shared.client_threads));
        for (name, thread) in clients {
            joiner.join(name, thread, deadline);
        }
        joiner.finish()
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; shutdown() reports them.
        let _ = self.stop_and_join();
    }
}

/// Joins threads against a common deadline, remembering the first failure.
#[derive(Debug, Default)]
struct Joiner {
    panicked: Option<String>,
    stuck: usize,
}

impl Joiner {
    fn join(&mut self, name: String, thread: JoinHandle<()>, deadline: Instant) {
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !thread.is_finished() {
            // Detached: it exits at its next wake-up and holds only sockets.
            self.stuck += 1;
            return;
        }
        if thread.join().is_err() && self.panicked.is_none() {
            self.panicked = Some(name);
        }
    }

    fn finish(self) -> Result<(), NetemError> {
        if let Some(name) = self.panicked {
            return Err(NetemError::ThreadPanicked(name));
        }
        if self.stuck > 0 {
            return Err(NetemError::ShutdownTimeout {
                stuck: self.stuck,
                timeout_ms: SHUTDOWN_BOUND.as_millis() as u64,
            });
        }
        Ok(())
    }
}

fn spawn(
    name: String,
    body: impl FnOnce() + Send + 'static,
) -> Result<(String, JoinHandle<()>), NetemError> {
    let thread = std::thread::Builder::new()
        .name(name.clone())
        .spawn(body)
        .map_err(|e| NetemError::io("spawning a netem thread", e))?;
    Ok((name, thread))
}

/// A bound UDP socket with large buffers and a [`POLL`] receive timeout.
fn udp_socket(addr: SocketAddr) -> Result<UdpSocket, NetemError> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| NetemError::io("creating a UDP socket", e))?;
    // Best effort: the kernel silently caps these at rmem_max/wmem_max.
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    socket
        .bind(&addr.into())
        .map_err(|source| NetemError::Bind { addr, source })?;
    let socket: UdpSocket = socket.into();
    socket
        .set_read_timeout(Some(POLL))
        .map_err(|e| NetemError::io("setting the receive timeout", e))?;
    // Bounds a send stuck on a full buffer, and so the shutdown.
    socket
        .set_write_timeout(Some(Duration::from_secs(1)))
        .map_err(|e| NetemError::io("setting the send timeout", e))?;
    Ok(socket)
}

fn socket_buffer_sizes(socket: &UdpSocket) -> (usize, usize) {
    let socket = socket2::SockRef::from(socket);
    (
        socket.recv_buffer_size().unwrap_or(0),
        socket.send_buffer_size().unwrap_or(0),
    )
}

/// Whether a receive error is just the timeout or a transient condition.
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock
            | io::ErrorKind::TimedOut
            | io::ErrorKind::Interrupted
            // ICMP port unreachable from an upstream that is not listening yet.
            | io::ErrorKind::ConnectionRefused
    )
}

fn back_off_on(e: &io::Error) {
    if !is_transient(e) {
        // Unexpected error: do not spin on it; the stop flag is rechecked.
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn listen_loop(shared: &Arc<Shared>, listen: &Arc<UdpSocket>, upstream: SocketAddr) {
    let mut clients: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    while !shared.stopped() {
        let (len, from) = match listen.recv_from(&mut buf) {
            Ok(received) => received,
            Err(e) => {
                back_off_on(&e);
                continue;
            }
        };
        let socket = match clients.get(&from) {
            Some(socket) => Arc::clone(socket),
            None => {
                let opened = if clients.len() < MAX_CLIENTS {
                    open_client(shared, listen, from, upstream).ok()
                } else {
                    None
                };
                let Some(socket) = opened else {
                    shared.rejected.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                clients.insert(from, Arc::clone(&socket));
                socket
            }
        };
        shared.up.offer(Outgoing {
            socket,
            to: None,
            data: buf[..len].to_vec(),
        });
    }
}

/// Opens `client`'s upstream socket and starts the thread that relays the
/// upstream's replies back to `client`.
fn open_client(
    shared: &Arc<Shared>,
    listen: &Arc<UdpSocket>,
    client: SocketAddr,
    upstream: SocketAddr,
) -> Result<Arc<UdpSocket>, NetemError> {
    let local_ip = match (upstream.ip().is_loopback(), upstream) {
        (true, SocketAddr::V4(_)) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        (true, SocketAddr::V6(_)) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        (false, SocketAddr::V4(_)) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        (false, SocketAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let socket = udp_socket(SocketAddr::new(local_ip, 0))?;
    socket
        .connect(upstream)
        .map_err(|e| NetemError::io("connecting a client's upstream socket", e))?;
    let socket = Arc::new(socket);
    let name = format!("netem-client-{}", client.port());
    let thread = {
        let (shared, socket, listen) =
            (Arc::clone(shared), Arc::clone(&socket), Arc::clone(listen));
        spawn(name, move || client_loop(&shared, &socket, &listen, client))?
    };
    lock(&shared.client_threads).push(thread);
    shared.clients.fetch_add(1, Ordering::Relaxed);
    Ok(socket)
}

fn client_loop(shared: &Shared, socket: &UdpSocket, listen: &Arc<UdpSocket>, client: SocketAddr) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    while !shared.stopped() {
        match socket.recv(&mut buf) {
            Ok(len) => shared.down.offer(Outgoing {
                socket: Arc::clone(listen),
                to: Some(client),
                data: buf[..len].to_vec(),
            }),
            Err(e) => back_off_on(&e),
        }
    }
}
