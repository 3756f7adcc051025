//! Deterministic simulation of the receiving core (quinn-proto's `random_interaction` tests
//! are the model): a hub, one or two regions each with a relay and actors, and in some runs a
//! hostile relay, all in one process on a simulated clock. Every relay and actor runs the real
//! [`Follower`] and [`SourcePolicy`]; the network, the servers and the shells' staging and
//! activation are small models whose randomness all comes from the seed.
//!
//! Each seed draws the sizes (regions, actors, versions, segments, stripes, latencies, the
//! publish pace) and the faults: stripes cut mid-way (the frames after the cut are lost),
//! frames delayed and reordered across stripes, `Commit` overtaking data, whole versions sent
//! twice, frames that do not stage, connections dropped, relays and actors killed and
//! restarted (stores and caches survive), the hub restarted, and a hostile relay that floods,
//! jumps ahead, serves forged versions or junk, or serves versions with a segment more than
//! their manifest names. The hub and the relays hold each subscriber to [`SUBSCRIBER_CAP`] live
//! subscriptions, counting a connection until the server sees it end (a killed subscriber's
//! after 4–5 s, the idle timeout), so a subscriber restarted twice within that is refused
//! `TooManyConnections` for a while; and some seeds draw a crowd: places of a subscriber's
//! first source held by other connections of its name for 0.3–8 s, or for 11–30 s (longer
//! than [`CROWDED_PATIENCE`]). These draws come from a random stream of their own, so a seed
//! in which no subscription is refused runs as it did before they existed.
//!
//! After every event the invariants of [`super`] are checked:
//! - a version is begun (staged on top of its base) only when its base is active, and
//!   activated only in order, whole (every segment and the manifest staged, nothing that
//!   failed) and committed;
//! - a version said to be here (`Notice::Received`) has been begun and every frame of it
//!   staged (one still buffered on an actor, its base not active, is not said to be here),
//!   and none is said to be here after one of its frames failed to stage;
//! - what an actor holds of versions in flight stays within its bounds;
//! - no connection is asked for one version whole without end: at most
//!   [`Bounds::max_refetches`] failures and a few stripes cut before the manifest;
//! - while a region's relay is up and caught up (and the actor did not just lose it: its
//!   connection ended, a connect failed, or an anchor restore failed because the connection
//!   went), no version published [`GRACE`] later crosses the WAN to that region more than
//!   once;
//! - a receiver whose source refused it for connections (`TooManyConnections`) and did
//!   nothing else meanwhile (no connection of it ended or failed otherwise) does not connect to
//!   another source before [`CROWDED_PATIENCE`] has passed since the first of those refusals;
//! - once the faults stop and the sources stay up, every relay and actor reaches the last
//!   version.
//!
//! A failing seed panics with the seed, the broken invariant and the simulation's trace, and
//! replays alone: `STARLING_SIM_SEED=N cargo test -p starling-transport --release
//! follow::sim -- --nocapture` (the trace of any seed prints with `STARLING_SIM_TRACE=1`).
//! `STARLING_SIM_SEEDS` sets how many seeds CI runs (default [`CI_SEEDS`]); the
//! [`REGRESSION_SEEDS`] beyond them, each once a failure, run too.
//!
//! The servers answer as `fanout` does: a refused `Subscribe` ends the subscription (the
//! subscriber must restore an anchor and subscribe again), a refused `Resume` or `Fetch` only
//! that request.
//!
//! [`Regression`] puts back the two bugs the fault soak found, to show the simulation catches
//! them: the 2 s return probe and the buffered version dropped after a failed staging; and the
//! receiver that took a refusal for connections for a lost source.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use starling_netem::rng::SplitMix64;
use starling_proto::protocol::msg::{Message, RefuseReason};

use super::*;

/// Appends a line to the trace when one is kept (formatting costs nothing otherwise).
macro_rules! trace {
    ($sim:expr, $($arg:tt)*) => {
        if $sim.trace.is_some() {
            let line = format!($($arg)*);
            $sim.push_trace(line);
        }
    };
}

/// A message in one line.
fn brief_msg(m: &Msg) -> String {
    match m {
        Msg::Started {
            version,
            transmission,
            stripes,
            ..
        } => format!("start {version} tx {transmission} of {stripes}"),
        Msg::Frame(f, _) => format!(
            "frame {} {}{}",
            f.version,
            f.seq.map_or("manifest".to_owned(), |s| format!("seg {s}")),
            if f.bad { " (bad)" } else { "" }
        ),
        Msg::Ended {
            version,
            transmission,
            ..
        } => format!("end {version} tx {transmission}"),
        other => format!("{other:?}"),
    }
}

/// An action in one line.
fn brief(a: &Action<SimFrame>) -> String {
    match a {
        Action::Stage { version, frame } => format!(
            "stage {version} {}{}",
            frame
                .seq
                .map_or("manifest".to_owned(), |s| format!("seg {s}")),
            if frame.bad { " (bad)" } else { "" }
        ),
        Action::Send { conn, message } => {
            let m = format!("{message:?}");
            format!(
                "send on {conn:?}: {}",
                m.chars().take(120).collect::<String>()
            )
        }
        other => {
            let m = format!("{other:?}");
            m.chars().take(160).collect()
        }
    }
}

/// Seeds per CI run.
const CI_SEEDS: u64 = 10_000;

/// Seeds beyond [`CI_SEEDS`] that once broke an invariant, run on every CI run besides
/// `0..CI_SEEDS` (found over 200,000 seeds; each is fixed, see the module docs).
const REGRESSION_SEEDS: &[u64] = &[
    // An anchor restored while versions activated: the shell ended at an older version
    // than the core ("core and shell disagree", "staged off its base").
    24447, 69772, 71724, 115375,
    // A hostile relay that cut its own flood short under the bound and ignored every
    // `Fetch` held an actor whose relay had nothing to offer ("never caught up").
    10420, 11627, 18702, 29640, 34828, 37718, 42040, 45568, 67926, 68077, 71745, 74547, 77003,
    78322, 79419, 79952, 81029, 85697, 88967, 98599, 103234, 103607, 104749, 104762, 109376,
    111660, 113040, 119755, 120352, 121834, 123198, 123584, 124926, 126453, 138369, 138964, 140313,
    146651, 149466, 155008, 155732, 155894, 162332, 166638, 174116, 174516, 176153, 188124, 193035,
    // The model ended a subscription when a `Resume` was refused, unlike `fanout`
    // ("never caught up").
    37902, 44101, 106660,
    // A run of versions announced out of order taken for a jump: the relay dropped as
    // too far ahead ("more than one WAN copy").
    25139, 83353, 92255, 169035, 173895,
    // A refusal of versions no longer needed answered by asking for an anchor, then
    // leaving a relay that held every later version ("more than one WAN copy").
    10008, 97450,
    // An anchor restore that failed because the connection to the relay dropped, not
    // counted as losing the relay ("more than one WAN copy").
    46900, 72377, 129948, 146318, 147598, 169462, 170818, 179757,
    // A relay whose frames failed verification six times (injected faults), rightly left:
    // its catch-up from the hub was counted as a second WAN copy (found beyond 200,000).
    231270,
    // An actor refused by its relay for connections for 3 s (its killed incarnation's
    // connection not yet seen to end) waited for it, as it should, and fell behind what the
    // relay retains: the model counted the hub's catch-up as a second WAN copy, where it is
    // the cost of the relay's crowd ("more than one WAN copy"; the model's fault).
    46844,
];

/// How long after its relay is back and caught up a region must be fed one copy per version:
/// the preferred source is probed 100 ms after the last probe ended, a probe of a dead relay
/// gives up after 0.5 s, and a connection takes a few round trips; 1 s leaves room.
const GRACE: Duration = Duration::from_millis(1000);

/// A probe of a source that does not answer gives up after this (the shell's timeout).
use crate::upstream::PROBE_TIMEOUT;

/// Connecting to a dead server fails after the QUIC idle timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Versions a server keeps for laggards; anchors every `ANCHOR_EVERY` versions at the hub.
const RETAIN: u64 = 8;
const ANCHOR_EVERY: u64 = 4;

/// The actors' bound on a version's wire bytes (an honest version is at most 7 × 8 KiB).
const VERSION_CAP: u64 = 64 * 1024;

/// Live subscriptions per subscriber a server takes (`--subscriber-connections`' default).
const SUBSCRIBER_CAP: usize = 2;

/// Whole-version `Fetch`es of one version on one connection beyond the failures a source is
/// allowed (each a stripe cut before the manifest, a chance of 1 in 10 at most).
const WHOLE_FETCH_SLACK: u32 = 10;

/// A frame as the simulated wire carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SimFrame {
    version: u64,
    delta_id: [u8; 32],
    /// `None`: the manifest.
    seq: Option<u32>,
    /// It passes its hash but does not stage (a sender bug, a hostile source's junk).
    bad: bool,
    bytes: u64,
    /// The manifest's segment count.
    segments: u32,
}

impl SimFrame {
    fn info(&self) -> FrameInfo {
        match self.seq {
            Some(seq) => FrameInfo::Segment { seq },
            None => FrameInfo::Manifest {
                segments: self.segments as usize,
            },
        }
    }
}

/// The honest delta of `version` (generation 0) or a forged one.
fn delta_id(version: u64, forged: bool) -> [u8; 32] {
    let mut id = [0u8; 32];
    id[..8].copy_from_slice(&version.to_le_bytes());
    id[8] = if forged { 0xee } else { 0x01 };
    id
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Hub,
    Relay(usize),
    Hostile(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hostility {
    /// Floods a version it can only be buffered with far more than a version's bytes.
    Flood,
    /// Announces a version far ahead.
    Ahead,
    /// Serves forged versions that stage but never verify, again on every `Fetch`.
    Forged,
    /// Serves segments that do not stage, again on every `Fetch`.
    Junk,
    /// Serves forged versions with a segment numbered beyond the manifest's count (its hash
    /// checks out) anywhere in them, again on every `Fetch`.
    Beyond,
}

#[derive(Debug, Clone, Copy)]
enum Role {
    Relay { region: usize },
    Actor { region: usize },
}

/// What a version's staging area holds in a shell.
#[derive(Debug, Clone)]
struct Area {
    delta_id: [u8; 32],
    segs: BTreeSet<u32>,
    manifest: bool,
    /// The core said it is here (`Notice::Received`).
    said: bool,
}

/// A relay or an actor: the real core, and a model of its shell.
struct Node {
    name: String,
    role: Role,
    sources: Vec<Server>,
    alive: bool,
    incarnation: u32,
    core: Option<Follower<SimFrame>>,
    /// The version applied (actor) or verified and cached (relay): durable.
    store: u64,
    /// A relay's restored anchor (it serves deltas after it, and the anchor).
    anchor: Option<u64>,
    areas: BTreeMap<u64, Area>,
    /// Areas the shell dropped itself (a frame did not stage) and not begun again.
    failed: BTreeSet<u64>,
    activating: Option<u64>,
    /// Core connection → simulated connection.
    nets: BTreeMap<ConnId, usize>,
    wake: Option<Duration>,
    /// When an actor last lost its relay through no choice of its own (or, after it dropped
    /// its relay for failing verification, when that relay's quarantine ends).
    left_relay: Duration,
    restarted: Duration,
    /// Its source (by index) refused it for connections, with nothing else in between, since
    /// then.
    crowded: Option<(usize, Duration)>,
}

/// Places of `node`'s subscriptions at `server` held by other connections of its name (a
/// crowd drawn by the seed), from `from` until `until`.
#[derive(Debug, Clone, Copy)]
struct Crowd {
    server: Server,
    node: usize,
    places: usize,
    from: Duration,
    until: Duration,
}

/// A simulated connection, client node to server.
struct Net {
    node: usize,
    incarnation: u32,
    conn: ConnId,
    server: Server,
    server_incarnation: u32,
    alive: bool,
    wan: bool,
    latency: Duration,
    /// The next version the server streams to this subscriber (none: not subscribed).
    next: Option<u64>,
    /// The server is writing a transmission until then.
    busy_until: Duration,
    transmissions: u32,
    /// Refused (the subscriber must restore an anchor): nothing more is streamed.
    refused: bool,
    /// Its subscription was admitted: it holds a place among its subscriber's until the
    /// server sees it end.
    slot: bool,
    /// Its subscription was refused for connections (the server closes it).
    crowded: bool,
    /// When the server sees the connection end (none: not yet ended).
    server_end: Option<Duration>,
    /// Version → how many times the client asked for it whole on this connection.
    whole_fetches: BTreeMap<u64, u32>,
}

#[derive(Debug, Clone)]
enum Msg {
    Started {
        version: u64,
        base: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
    },
    Frame(SimFrame, u32),
    Ended {
        version: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
    },
    Commit(u64),
    Refused,
    /// `Subscribe` refused `TooManyConnections` (the server closes the connection).
    TooMany,
    Anchor(u64),
}

#[derive(Debug, Clone)]
enum Ev {
    Publish(u64),
    Deliver {
        net: usize,
        msg: Msg,
    },
    ToServer {
        net: usize,
        msg: Message,
    },
    ServerReady {
        net: usize,
    },
    Connected {
        net: usize,
    },
    ConnectFailed {
        node: usize,
        inc: u32,
        conn: ConnId,
        /// An actor's attempt at its region's relay.
        relay: bool,
    },
    Lost {
        net: usize,
    },
    /// The server closes a connection it refused for connections.
    Closed {
        net: usize,
    },
    Wake {
        node: usize,
        inc: u32,
    },
    Activated {
        node: usize,
        inc: u32,
        version: u64,
    },
    Restored {
        net: usize,
        version: u64,
    },
    Probed {
        node: usize,
        inc: u32,
        server: Server,
    },
    Kill {
        node: usize,
        down: Duration,
    },
    Restart {
        node: usize,
    },
    DropNet {
        net: usize,
    },
    HubRestart,
}

/// A broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Violation {
    kind: &'static str,
    detail: String,
}

/// The seed's draws.
#[derive(Debug, Clone)]
struct Params {
    versions: u64,
    segments: Vec<u32>,
    frame_bytes: u64,
    stripes: u16,
    wan_latency: Duration,
    lan_latency: Duration,
    jitter: f64,
    cut: f64,
    bad: f64,
    twice: f64,
    drop_mean: Option<Duration>,
    hostile: Option<Hostility>,
    activation: Duration,
}

struct Sim {
    rng: SplitMix64,
    /// The draws of the subscription bound's model (crowds, when a server sees a connection
    /// end): apart, so that a seed without refusals for connections runs as before it.
    crowd_rng: SplitMix64,
    crowds: Vec<Crowd>,
    base: Instant,
    now: Duration,
    queue: BTreeMap<(Duration, u64), Ev>,
    seq: u64,
    events: u64,
    trace: Option<Vec<String>>,
    p: Params,
    regression: Regression,
    published: u64,
    published_at: Vec<Duration>,
    hub_incarnation: u32,
    nodes: Vec<Node>,
    nets: Vec<Net>,
    /// Per region: since when its relay is up and caught up.
    settled: Vec<Option<Duration>>,
    /// (region, version) → the nodes of the region that received it from the hub.
    wan: BTreeMap<(usize, u64), BTreeSet<usize>>,
    faults_until: Duration,
    violation: Option<Violation>,
}

/// What a run did.
#[derive(Debug)]
struct Outcome {
    events: u64,
    violation: Option<Violation>,
}

impl Sim {
    fn new(seed: u64, regression: Regression, trace: bool) -> Self {
        let mut rng = SplitMix64::new(seed ^ 0x5157_f011_0000_0001);
        let versions = 10 + rng.next_up_to(20);
        let segments = (0..=versions)
            .map(|_| 1 + rng.next_up_to(5) as u32)
            .collect();
        let wan_ms = 10 + rng.next_up_to(50);
        let lan_us = 200 + rng.next_up_to(1800);
        let p = Params {
            versions,
            segments,
            frame_bytes: 1024 * (1 + rng.next_up_to(7)),
            stripes: 1 + rng.next_up_to(3) as u16,
            wan_latency: Duration::from_millis(wan_ms),
            lan_latency: Duration::from_micros(lan_us),
            jitter: rng.next_f64() * 0.8,
            cut: rng.next_f64() * 0.1,
            bad: if rng.next_f64() < 0.5 {
                rng.next_f64() * 0.02
            } else {
                0.0
            },
            twice: rng.next_f64() * 0.05,
            drop_mean: (rng.next_f64() < 0.5)
                .then(|| Duration::from_millis(2000 + rng.next_up_to(18_000))),
            hostile: match rng.next_up_to(7) {
                0 => Some(Hostility::Flood),
                1 => Some(Hostility::Ahead),
                2 => Some(Hostility::Forged),
                3 => Some(Hostility::Junk),
                4 => Some(Hostility::Beyond),
                _ => None,
            },
            activation: Duration::from_millis(rng.next_up_to(20)),
        };
        let regions = 1 + rng.next_up_to(1) as usize;
        let mut nodes = Vec::new();
        for r in 0..regions {
            nodes.push(Node::new(
                format!("relay{r}"),
                Role::Relay { region: r },
                vec![Server::Hub],
            ));
            let actors = 1 + rng.next_up_to(2) as usize;
            for a in 0..actors {
                let mut sources = vec![Server::Relay(r)];
                if p.hostile.is_some() {
                    sources.push(Server::Hostile(r));
                }
                sources.push(Server::Hub);
                nodes.push(Node::new(
                    format!("r{r}a{a}"),
                    Role::Actor { region: r },
                    sources,
                ));
            }
        }
        let mut sim = Sim {
            rng,
            crowd_rng: SplitMix64::new(seed ^ 0xc70d_0c0a_0000_0002),
            crowds: Vec::new(),
            base: Instant::now(),
            now: Duration::ZERO,
            queue: BTreeMap::new(),
            seq: 0,
            events: 0,
            trace: trace.then(Vec::new),
            p,
            regression,
            published: 0,
            published_at: vec![Duration::ZERO],
            hub_incarnation: 0,
            nodes,
            nets: Vec::new(),
            settled: vec![None; regions],
            wan: BTreeMap::new(),
            faults_until: Duration::ZERO,
            violation: None,
        };
        sim.schedule_run();
        sim
    }

    fn at(&self) -> Instant {
        self.base + self.now
    }

    fn push(&mut self, after: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.insert((self.now + after, self.seq), ev);
    }

    fn push_trace(&mut self, line: String) {
        let now = self.now.as_secs_f64();
        if let Some(t) = &mut self.trace {
            t.push(format!("{now:>9.3}s {line}"));
        }
    }

    fn fail(&mut self, kind: &'static str, detail: String) {
        if self.violation.is_none() {
            trace!(self, "VIOLATION {kind}: {detail}");
            self.violation = Some(Violation { kind, detail });
        }
    }

    fn uniform(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = hi.saturating_sub(lo).as_micros() as u64;
        lo + Duration::from_micros(self.rng.next_up_to(span))
    }

    /// The publish schedule and the faults, drawn up front.
    fn schedule_run(&mut self) {
        let mut t = Duration::from_millis(200);
        for v in 1..=self.p.versions {
            let gap = Duration::from_millis(30 + self.rng.next_up_to(370));
            t += gap;
            self.seq += 1;
            self.queue.insert((t, self.seq), Ev::Publish(v));
        }
        self.faults_until = t;
        let n = self.nodes.len();
        for node in 0..n {
            let kills = self.rng.next_up_to(2);
            for _ in 0..kills {
                let at = Duration::from_micros(self.rng.next_up_to(t.as_micros() as u64));
                let down = match self.nodes[node].role {
                    Role::Relay { .. } => {
                        self.uniform(Duration::from_millis(300), Duration::from_secs(3))
                    }
                    Role::Actor { .. } => {
                        self.uniform(Duration::from_millis(200), Duration::from_secs(2))
                    }
                };
                self.seq += 1;
                self.queue.insert((at, self.seq), Ev::Kill { node, down });
            }
        }
        if self.rng.next_f64() < 0.3 {
            let at = Duration::from_micros(self.rng.next_up_to(t.as_micros() as u64));
            self.seq += 1;
            self.queue.insert((at, self.seq), Ev::HubRestart);
        }
        for node in 0..n {
            if self.crowd_rng.next_f64() < 0.25 {
                let from = Duration::from_micros(self.crowd_rng.next_up_to(t.as_micros() as u64));
                let long = self.crowd_rng.next_f64() < 0.2;
                let len = if long {
                    self.crowd_uniform(Duration::from_secs(11), Duration::from_secs(30))
                } else {
                    self.crowd_uniform(Duration::from_millis(300), Duration::from_secs(8))
                };
                self.crowds.push(Crowd {
                    server: self.nodes[node].sources[0],
                    node,
                    places: 1 + self.crowd_rng.next_up_to(1) as usize,
                    from,
                    until: from + len,
                });
            }
        }
        for node in 0..n {
            self.nodes[node].alive = true;
            self.start_node(node);
        }
    }

    fn crowd_uniform(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = hi.saturating_sub(lo).as_micros() as u64;
        lo + Duration::from_micros(self.crowd_rng.next_up_to(span))
    }

    /// The places of `node`'s subscriptions `server` counts now: its connections whose end
    /// the server has not seen, and a crowd.
    fn places(&self, server: Server, node: usize) -> usize {
        let incarnation = self.server_incarnation(server);
        let own = self
            .nets
            .iter()
            .filter(|n| {
                n.node == node
                    && n.server == server
                    && n.slot
                    && n.server_incarnation == incarnation
                    && n.server_end.is_none_or(|t| t > self.now)
            })
            .count();
        let crowd: usize = self
            .crowds
            .iter()
            .filter(|c| {
                c.server == server && c.node == node && c.from <= self.now && self.now < c.until
            })
            .map(|c| c.places)
            .sum();
        own + crowd
    }

    /// The server refuses `net`'s subscription for connections and closes it.
    fn refuse_crowded(&mut self, net: usize) {
        let n = &mut self.nets[net];
        n.refused = true;
        n.crowded = true;
        n.server_end.get_or_insert(self.now);
        let d = n.latency;
        self.push(
            d,
            Ev::Deliver {
                net,
                msg: Msg::TooMany,
            },
        );
        self.push(d + Duration::from_millis(1), Ev::Closed { net });
    }

    /// An actor refused by its relay for connections is without it until it is served again
    /// (the relay had no place for it, through no fault of its core): what it takes from the
    /// hub because of that wait (the relay no longer retains the version after its own) is
    /// the cost of the crowd, as of a lost relay.
    fn regained(&mut self, node: usize, server: Server) {
        if let (Role::Actor { .. }, Server::Relay(_)) = (self.nodes[node].role, server) {
            let n = &mut self.nodes[node];
            n.left_relay = n.left_relay.max(self.now);
        }
    }

    /// A connection of `node` (`conn`) ended or failed other than by a refusal for
    /// connections: if it is the one its core follows, the core leaves its source, and
    /// refusals for connections count afresh.
    fn ended_otherwise(&mut self, node: usize, conn: ConnId) {
        let current = self.nodes[node]
            .core
            .as_ref()
            .is_some_and(|c| c.connection() == Some(conn));
        if current {
            self.nodes[node].crowded = None;
        }
    }

    fn start_node(&mut self, node: usize) {
        let now = self.at();
        let n = &mut self.nodes[node];
        n.incarnation += 1;
        n.alive = true;
        n.areas.clear();
        n.failed.clear();
        n.activating = None;
        n.nets.clear();
        n.wake = None;
        n.restarted = self.now;
        n.crowded = None;
        let mut core = match n.role {
            Role::Relay { .. } => Follower::new(
                FollowConfig::relay(true),
                SourcePolicy::new(PolicyConfig::relay(), n.sources.len()),
                n.store,
                now,
            ),
            Role::Actor { .. } => {
                let mut bounds = Bounds::for_model(0);
                bounds.version_cap = VERSION_CAP;
                Follower::new(
                    FollowConfig::actor(bounds),
                    SourcePolicy::new(PolicyConfig::actor(), n.sources.len()),
                    n.store,
                    now,
                )
            }
        };
        core.regression = self.regression;
        core.policy.regression = self.regression;
        n.core = Some(core);
        trace!(
            self,
            "{} starts at {}", self.nodes[node].name, self.nodes[node].store
        );
        self.drive(node);
    }

    /// Runs the node's core until it has nothing more to do now, and schedules its timer.
    fn drive(&mut self, node: usize) {
        while let Some(action) = self.nodes[node].core.as_mut().and_then(|c| c.poll_action()) {
            self.act(node, action);
            if self.violation.is_some() {
                return;
            }
        }
        self.check_node(node);
        let next = self.nodes[node]
            .core
            .as_ref()
            .and_then(|c| c.poll_timeout());
        let next = next.map(|t| t.saturating_duration_since(self.base));
        if next != self.nodes[node].wake
            && let Some(t) = next
        {
            self.nodes[node].wake = Some(t);
            let inc = self.nodes[node].incarnation;
            let after = t.saturating_sub(self.now);
            self.push(after, Ev::Wake { node, inc });
        }
        self.nodes[node].wake = next;
    }

    fn handle(&mut self, node: usize, ev: Event<SimFrame>) {
        let now = self.at();
        if let Some(c) = self.nodes[node].core.as_mut() {
            c.handle(now, ev);
        }
        self.drive(node);
    }

    /// Runs one action of `node`'s core, as its shell would.
    fn act(&mut self, node: usize, action: Action<SimFrame>) {
        trace!(self, "{}: {}", self.nodes[node].name, brief(&action));
        match action {
            Action::Connect { conn, source, .. } => {
                if let Some((crowded, since)) = self.nodes[node].crowded
                    && crowded != source.0
                {
                    if self.now < since + CROWDED_PATIENCE {
                        let detail = format!(
                            "{} connects to {:?}, its {:?} refused it only for connections, \
                             since {:.3}s",
                            self.nodes[node].name,
                            self.nodes[node].sources[source.0],
                            self.nodes[node].sources[crowded],
                            since.as_secs_f64()
                        );
                        return self.fail("left a crowded source", detail);
                    }
                    self.nodes[node].crowded = None;
                }
                let server = self.nodes[node].sources[source.0];
                let inc = self.nodes[node].incarnation;
                if !self.server_alive(server) {
                    let relay = matches!(self.nodes[node].role, Role::Actor { .. })
                        && matches!(server, Server::Relay(_));
                    if relay {
                        self.nodes[node].left_relay = self.now;
                    }
                    self.push(
                        CONNECT_TIMEOUT,
                        Ev::ConnectFailed {
                            node,
                            inc,
                            conn,
                            relay,
                        },
                    );
                    return;
                }
                let region = match self.nodes[node].role {
                    Role::Relay { region } | Role::Actor { region } => region,
                };
                let wan = server == Server::Hub;
                let _ = region;
                let latency = if wan {
                    self.p.wan_latency
                } else {
                    self.p.lan_latency
                };
                let net = self.nets.len();
                self.nets.push(Net {
                    node,
                    incarnation: inc,
                    conn,
                    server,
                    server_incarnation: self.server_incarnation(server),
                    alive: true,
                    wan,
                    latency,
                    next: None,
                    busy_until: Duration::ZERO,
                    transmissions: 0,
                    refused: false,
                    slot: false,
                    crowded: false,
                    server_end: None,
                    whole_fetches: BTreeMap::new(),
                });
                self.nodes[node].nets.insert(conn, net);
                self.push(latency * 3, Ev::Connected { net });
                if let Some(mean) = self.p.drop_mean
                    && self.now < self.faults_until
                {
                    let f = -(1.0 - self.rng.next_f64()).ln();
                    let after = mean.mul_f64(f.min(20.0));
                    self.push(after, Ev::DropNet { net });
                }
            }
            Action::Send { conn, message } => {
                if let Some(&net) = self.nodes[node].nets.get(&conn) {
                    if let Message::Fetch { version, seqs } = &message
                        && seqs.is_empty()
                    {
                        let n = self.nets[net].whole_fetches.entry(*version).or_default();
                        *n += 1;
                        let n = *n;
                        let limit = Bounds::for_model(0).max_refetches + WHOLE_FETCH_SLACK;
                        if n > limit {
                            let detail = format!(
                                "{} asked {:?} for {version} whole {n} times on one connection",
                                self.nodes[node].name, self.nets[net].server
                            );
                            return self.fail("fetched without end", detail);
                        }
                    }
                    let d = self.nets[net].latency;
                    self.push(d, Ev::ToServer { net, msg: message });
                }
            }
            Action::Disconnect { conn } => {
                if let Some(net) = self.nodes[node].nets.remove(&conn) {
                    self.nets[net].alive = false;
                    let end = self.now + self.nets[net].latency;
                    self.nets[net].server_end.get_or_insert(end);
                    if !self.nets[net].crowded {
                        // Left for another reason: refusals for connections count afresh.
                        self.nodes[node].crowded = None;
                    }
                }
            }
            Action::Begin {
                version,
                base,
                delta_id,
            } => {
                let n = &self.nodes[node];
                if let Role::Actor { .. } = n.role
                    && (n.store + 1 != version || n.activating.is_some() || base != n.store)
                {
                    let detail = format!(
                        "{} began staging {version} (base {base}) while {} is active{}",
                        n.name,
                        n.store,
                        if n.activating.is_some() {
                            " and another activates"
                        } else {
                            ""
                        }
                    );
                    return self.fail("staged off its base", detail);
                }
                let n = &mut self.nodes[node];
                n.failed.remove(&version);
                n.areas.insert(
                    version,
                    Area {
                        delta_id,
                        segs: BTreeSet::new(),
                        manifest: false,
                        said: false,
                    },
                );
            }
            Action::Stage { version, frame } => {
                let n = &mut self.nodes[node];
                if n.failed.contains(&version) {
                    return;
                }
                let Some(area) = n.areas.get_mut(&version) else {
                    return self.fail(
                        "staged without a stager",
                        format!(
                            "{} was given a frame of {version} it never began",
                            self.nodes[node].name.clone()
                        ),
                    );
                };
                if frame.version != version || frame.delta_id != area.delta_id {
                    return self.fail(
                        "staged a foreign frame",
                        format!(
                            "{}: {frame:?} into {version}",
                            self.nodes[node].name.clone()
                        ),
                    );
                }
                if frame.bad {
                    n.areas.remove(&version);
                    n.failed.insert(version);
                    let now = self.at();
                    if let Some(c) = self.nodes[node].core.as_mut() {
                        c.handle(now, Event::StageFailed { version });
                    }
                    return;
                }
                match frame.seq {
                    Some(s) => {
                        area.segs.insert(s);
                    }
                    None => area.manifest = true,
                }
            }
            Action::Discard { version } => {
                let n = &mut self.nodes[node];
                n.areas.remove(&version);
                n.failed.remove(&version);
            }
            Action::Activate { version, .. } => {
                let n = &self.nodes[node];
                if version != n.store + 1 || n.activating.is_some() {
                    let detail = format!(
                        "{} asked to activate {version} with {} active{}",
                        n.name,
                        n.store,
                        if n.activating.is_some() {
                            " and another activating"
                        } else {
                            ""
                        }
                    );
                    return self.fail("out of order", detail);
                }
                let segments = self.p.segments[version as usize];
                let whole = n.areas.get(&version).is_some_and(|a| {
                    a.manifest
                        && a.segs.len() == segments as usize
                        && a.segs.iter().all(|&s| s < segments)
                });
                let forged = n
                    .areas
                    .get(&version)
                    .is_some_and(|a| a.delta_id != delta_id(version, false));
                if !whole && !forged {
                    let detail = format!(
                        "{} asked to activate {version}, not all of it staged: {:?}",
                        n.name,
                        n.areas.get(&version)
                    );
                    return self.fail("half-applied", detail);
                }
                if !n.areas.get(&version).is_some_and(|a| a.said) {
                    // Status and heartbeats would never have called it staged.
                    let detail = format!("{}: {version}", n.name);
                    return self.fail("activated, never said here", detail);
                }
                let inc = n.incarnation;
                self.nodes[node].activating = Some(version);
                let d = self.p.activation
                    + match self.nodes[node].role {
                        Role::Relay { .. } => Duration::from_millis(5),
                        Role::Actor { .. } => Duration::ZERO,
                    };
                if forged {
                    // The signature does not verify: nothing is applied.
                    self.nodes[node].activating = None;
                    self.nodes[node].areas.remove(&version);
                    let now = self.at();
                    if let Some(c) = self.nodes[node].core.as_mut() {
                        c.handle(now, Event::ActivationFailed { version });
                    }
                    return;
                }
                self.push(d, Ev::Activated { node, inc, version });
            }
            Action::RestoreAnchor { conn, version } => {
                if let Some(&net) = self.nodes[node].nets.get(&conn) {
                    self.push(Duration::from_millis(100), Ev::Restored { net, version });
                } else {
                    let now = self.at();
                    if let Some(c) = self.nodes[node].core.as_mut() {
                        c.handle(now, Event::AnchorFailed { conn });
                    }
                }
            }
            Action::Probe { source, .. } => {
                let server = self.nodes[node].sources[source.0];
                let inc = self.nodes[node].incarnation;
                let d = if self.server_alive(server) {
                    self.p.lan_latency * 3
                } else {
                    PROBE_TIMEOUT
                };
                self.push(d, Ev::Probed { node, inc, server });
            }
            // A version said to be here has been begun and has every frame staged: the
            // actor's `staged` stamp and what its heartbeat calls staged rest on that.
            Action::Notice(Notice::Received { version }) => {
                let n = &self.nodes[node];
                if n.failed.contains(&version) {
                    let detail = format!("{}: {version}, whose staging failed", n.name);
                    return self.fail("said here after a frame failed", detail);
                }
                let Some(area) = n.areas.get(&version) else {
                    // Buffered in the core, not begun here: nothing of it is staged yet.
                    let detail = format!("{}: {version}, not begun", n.name);
                    return self.fail("said here before staged", detail);
                };
                let segments = self.p.segments.get(version as usize).copied().unwrap_or(0);
                let whole = area.manifest && area.segs.len() == segments as usize;
                if !whole && area.delta_id == delta_id(version, false) {
                    let detail = format!("{}: {version} with {area:?}", n.name);
                    return self.fail("said here before staged", detail);
                }
                if let Some(area) = self.nodes[node].areas.get_mut(&version) {
                    area.said = true;
                }
            }
            // An actor that leaves its relay because the relay's frames keep failing
            // verification (here, from the faults injected on its links) rightly takes the
            // next versions from the hub while the relay is quarantined: that is the cost of
            // the broken relay, as of a lost one, so the relay counts as left until the
            // quarantine ends. Only this reason: a relay dropped for a bound it did not break
            // is the core's fault, and must still count (seed 83353).
            //
            // A relay that refused an actor for connections through the whole patience is
            // left for the quarantine too (it is crowded by other connections of the actor's
            // name): like a lost relay, what the actor takes from the hub meanwhile is that
            // cost.
            Action::Notice(
                Notice::SourceDropped {
                    source,
                    why: Misbehaviour::KeepsFailing { .. },
                }
                | Notice::Crowded { source, .. },
            ) => {
                let relay = matches!(self.nodes[node].role, Role::Actor { .. })
                    && matches!(
                        self.nodes[node].sources.get(source.0),
                        Some(Server::Relay(_))
                    );
                if relay {
                    self.nodes[node].left_relay = self.now + PolicyConfig::actor().quarantine;
                }
            }
            Action::Notice(_) => {}
            Action::GiveUp(e) => {
                let detail = format!("{}: {e}", self.nodes[node].name.clone());
                self.fail("gave up", detail);
            }
        }
    }

    fn server_alive(&self, s: Server) -> bool {
        match s {
            Server::Hub | Server::Hostile(_) => true,
            Server::Relay(r) => self.relay_of(r).is_some_and(|i| self.nodes[i].alive),
        }
    }

    fn server_incarnation(&self, s: Server) -> u32 {
        match s {
            Server::Hub => self.hub_incarnation,
            Server::Hostile(_) => 0,
            Server::Relay(r) => self.relay_of(r).map_or(0, |i| self.nodes[i].incarnation),
        }
    }

    fn relay_of(&self, region: usize) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| matches!(n.role, Role::Relay { region: r } if r == region))
    }

    fn net_ok(&self, net: usize) -> bool {
        let n = &self.nets[net];
        n.alive
            && self.nodes[n.node].alive
            && self.nodes[n.node].incarnation == n.incarnation
            && self.server_alive(n.server)
            && self.server_incarnation(n.server) == n.server_incarnation
    }

    /// What `server` holds: its newest version, and the oldest it still sends deltas of.
    fn holds(&self, s: Server) -> (u64, u64) {
        match s {
            Server::Hub => (self.published, self.published.saturating_sub(RETAIN) + 1),
            Server::Relay(r) => {
                let Some(i) = self.relay_of(r) else {
                    return (0, 1);
                };
                let n = &self.nodes[i];
                let floor = n.anchor.map_or(1, |a| a + 1);
                (n.store, n.store.saturating_sub(RETAIN).max(floor - 1) + 1)
            }
            Server::Hostile(_) => (0, 1),
        }
    }

    fn newest_anchor(&self, s: Server) -> Option<u64> {
        match s {
            Server::Hub => Some(self.published / ANCHOR_EVERY * ANCHOR_EVERY).filter(|&a| a > 0),
            Server::Relay(r) => self.relay_of(r).and_then(|i| self.nodes[i].anchor),
            Server::Hostile(_) => None,
        }
    }

    /// Sends the frames of `version` (all, or only `only`, or all but `except`) on `net`,
    /// striped, then `Commit`.
    fn transmit(&mut self, net: usize, version: u64, only: Option<&[u32]>, except: Option<&[u32]>) {
        let forged_by = match self.nets[net].server {
            Server::Hostile(_) => self.p.hostile,
            _ => None,
        };
        let segments = self.p.segments[version as usize];
        let id = delta_id(version, forged_by.is_some());
        let mut frames: Vec<SimFrame> = (0..segments)
            .filter(|s| only.is_none_or(|o| o.is_empty() || o.contains(s)))
            .filter(|s| except.is_none_or(|e| !e.contains(s)))
            .map(|s| SimFrame {
                version,
                delta_id: id,
                seq: Some(s),
                bad: false,
                bytes: self.p.frame_bytes,
                segments,
            })
            .collect();
        if only.is_none_or(|o| o.is_empty()) {
            frames.push(SimFrame {
                version,
                delta_id: id,
                seq: None,
                bad: false,
                bytes: 512,
                segments,
            });
        }
        if forged_by == Some(Hostility::Beyond) {
            let at = self.rng.next_up_to(frames.len() as u64) as usize;
            let beyond = SimFrame {
                seq: Some(segments + self.rng.next_up_to(2) as u32),
                ..frames[0]
            };
            frames.insert(at, beyond);
        }
        for f in &mut frames {
            f.bad = match forged_by {
                Some(Hostility::Junk) => f.seq.is_some(),
                Some(_) => false,
                None => self.rng.next_f64() < self.p.bad,
            };
        }
        let times = if self.rng.next_f64() < self.p.twice {
            2
        } else {
            1
        };
        let mut end = self.now;
        for _ in 0..times {
            end = end.max(self.send_frames(net, version, id, &frames));
        }
        self.nets[net].busy_until = end;
        let latency = self.nets[net].latency;
        let j = self.jitter(latency);
        let commit_after = end.saturating_sub(self.now) + latency + j;
        self.push(
            commit_after,
            Ev::Deliver {
                net,
                msg: Msg::Commit(version),
            },
        );
        let ready = end.saturating_sub(self.now);
        self.push(ready, Ev::ServerReady { net });
    }

    fn jitter(&mut self, latency: Duration) -> Duration {
        latency.mul_f64(self.p.jitter * self.rng.next_f64())
    }

    /// One transmission: returns when its last frame leaves the server.
    fn send_frames(
        &mut self,
        net: usize,
        version: u64,
        id: [u8; 32],
        frames: &[SimFrame],
    ) -> Duration {
        let tx = self.nets[net].transmissions;
        self.nets[net].transmissions += 1;
        let stripes = self.p.stripes.min(frames.len().max(1) as u16);
        let latency = self.nets[net].latency;
        let per_frame = if self.nets[net].wan {
            Duration::from_micros(400)
        } else {
            Duration::from_micros(20)
        };
        let mut last = self.now;
        for stripe in 0..stripes {
            let offset = self.jitter(latency);
            let cut = (self.rng.next_f64() < self.p.cut)
                .then(|| self.rng.next_up_to(frames.len() as u64) as usize);
            let mut t = latency + offset;
            let start = Msg::Started {
                version,
                base: version - 1,
                delta_id: id,
                transmission: tx,
                stripes,
            };
            self.push(t, Ev::Deliver { net, msg: start });
            for (i, f) in frames
                .iter()
                .enumerate()
                .filter(|(i, _)| i % stripes as usize == stripe as usize)
            {
                if cut.is_some_and(|c| i >= c) {
                    break;
                }
                t += per_frame;
                self.push(
                    t,
                    Ev::Deliver {
                        net,
                        msg: Msg::Frame(*f, tx),
                    },
                );
            }
            t += per_frame;
            let end = Msg::Ended {
                version,
                delta_id: id,
                transmission: tx,
                stripes,
            };
            self.push(t, Ev::Deliver { net, msg: end });
            last = last.max(self.now + t - latency - offset);
        }
        last
    }

    /// Streams the subscriber's next version if the server has it and is not busy.
    fn pump(&mut self, net: usize) {
        if !self.net_ok(net) || self.nets[net].refused || self.nets[net].busy_until > self.now {
            return;
        }
        let Some(next) = self.nets[net].next else {
            return;
        };
        let server = self.nets[net].server;
        if let Server::Hostile(_) = server {
            return;
        }
        let (latest, oldest) = self.holds(server);
        if next < oldest && next <= latest {
            self.refuse(net);
            return;
        }
        if next > latest {
            return;
        }
        self.nets[net].next = Some(next + 1);
        self.transmit(net, next, None, None);
    }

    fn pump_relay(&mut self, region: usize) {
        for net in 0..self.nets.len() {
            if self.nets[net].server == Server::Relay(region) {
                self.pump(net);
            }
        }
    }

    fn refuse(&mut self, net: usize) {
        self.nets[net].refused = true;
        let d = self.nets[net].latency;
        self.push(
            d,
            Ev::Deliver {
                net,
                msg: Msg::Refused,
            },
        );
    }

    /// A request reaches the server of `net`.
    fn at_server(&mut self, net: usize, msg: Message) {
        if !self.net_ok(net) {
            return;
        }
        let server = self.nets[net].server;
        if let Server::Hostile(_) = server {
            return self.hostile(net, msg);
        }
        let (latest, oldest) = self.holds(server);
        match msg {
            Message::Subscribe { after_version } => {
                let node = self.nets[net].node;
                if self.places(server, node) >= SUBSCRIBER_CAP {
                    trace!(
                        self,
                        "{server:?} refuses {} for connections", self.nodes[node].name
                    );
                    return self.refuse_crowded(net);
                }
                self.nets[net].slot = true;
                if self.nodes[node].crowded.take().is_some() {
                    self.regained(node, server);
                }
                self.nets[net].next = Some(after_version + 1);
                self.pump(net);
            }
            // As in `fanout`, a `Resume` or `Fetch` the server cannot answer is refused
            // alone: the subscription goes on (only a refused `Subscribe` ends it).
            Message::Resume { version, have } => {
                if version <= latest && version >= oldest {
                    self.transmit(net, version, None, Some(&have));
                } else {
                    let d = self.nets[net].latency;
                    self.push(
                        d,
                        Ev::Deliver {
                            net,
                            msg: Msg::Refused,
                        },
                    );
                }
            }
            Message::Fetch { version, seqs } => {
                if version <= latest && version >= oldest {
                    self.transmit(net, version, Some(&seqs), None);
                } else {
                    let d = self.nets[net].latency;
                    self.push(
                        d,
                        Ev::Deliver {
                            net,
                            msg: Msg::Refused,
                        },
                    );
                }
            }
            Message::FetchAnchor { after_version } => match self.newest_anchor(server) {
                Some(a) if a > after_version => {
                    let d = self.nets[net].latency;
                    self.push(
                        d,
                        Ev::Deliver {
                            net,
                            msg: Msg::Anchor(a),
                        },
                    );
                }
                _ => {
                    let d = self.nets[net].latency;
                    self.push(
                        d,
                        Ev::Deliver {
                            net,
                            msg: Msg::Refused,
                        },
                    );
                }
            },
            _ => {}
        }
    }

    /// The hostile relay's answers.
    fn hostile(&mut self, net: usize, msg: Message) {
        let Some(h) = self.p.hostile else {
            return;
        };
        match (h, msg) {
            (Hostility::Flood, Message::Subscribe { after_version }) => {
                let v = after_version + 2;
                let id = delta_id(v, true);
                let frames: Vec<SimFrame> = (0..40)
                    .map(|s| SimFrame {
                        version: v,
                        delta_id: id,
                        seq: Some(s),
                        bad: false,
                        bytes: 4096,
                        segments: 40,
                    })
                    .collect();
                self.send_frames(net, v, id, &frames);
            }
            (Hostility::Ahead, Message::Subscribe { after_version }) => {
                let v = after_version + 1000;
                let id = delta_id(v, true);
                let f = SimFrame {
                    version: v,
                    delta_id: id,
                    seq: Some(0),
                    bad: false,
                    bytes: 4096,
                    segments: 1,
                };
                self.send_frames(net, v, id, &[f]);
            }
            (
                Hostility::Forged | Hostility::Junk | Hostility::Beyond,
                Message::Subscribe { after_version },
            ) if after_version < self.p.versions => {
                self.transmit(net, after_version + 1, None, None);
            }
            (
                Hostility::Forged | Hostility::Junk | Hostility::Beyond,
                Message::Fetch { version, .. } | Message::Resume { version, .. },
            ) if version <= self.p.versions => {
                self.transmit(net, version, None, None);
            }
            _ => {}
        }
    }

    /// A message reaches the client of `net`.
    fn deliver(&mut self, net: usize, msg: Msg) {
        if !self.net_ok(net) {
            return;
        }
        let (node, conn) = (self.nets[net].node, self.nets[net].conn);
        trace!(
            self,
            "{} <- {:?} on {conn:?}: {}",
            self.nodes[node].name,
            self.nets[net].server,
            brief_msg(&msg)
        );
        let ev = match msg {
            Msg::Started {
                version,
                base,
                delta_id,
                transmission,
                stripes,
            } => Event::StreamStarted {
                conn,
                version,
                base,
                delta_id,
                transmission,
                stripes,
            },
            Msg::Frame(f, transmission) => {
                if self.nets[net].server == Server::Hub {
                    self.wan_copy(node, f.version);
                }
                Event::Frame {
                    conn,
                    version: f.version,
                    delta_id: f.delta_id,
                    transmission,
                    info: f.info(),
                    bytes: f.bytes,
                    frame: f,
                }
            }
            Msg::Ended {
                version,
                delta_id,
                transmission,
                stripes,
            } => Event::StreamEnded {
                conn,
                version,
                delta_id,
                transmission,
                stripes,
            },
            Msg::Commit(version) => Event::Commit { conn, version },
            Msg::Refused => Event::Refused {
                conn,
                reason: RefuseReason::VersionUnavailable,
            },
            Msg::TooMany => {
                let server = self.nets[net].server;
                self.regained(node, server);
                let source = self.nodes[node].sources.iter().position(|&s| s == server);
                if let Some(s) = source
                    && self.nodes[node].crowded.is_none_or(|(c, _)| c != s)
                {
                    self.nodes[node].crowded = Some((s, self.now));
                }
                Event::Refused {
                    conn,
                    reason: RefuseReason::TooManyConnections,
                }
            }
            Msg::Anchor(version) => Event::AnchorOffered { conn, version },
        };
        self.handle(node, ev);
    }

    /// `node` received a frame of `version` over the WAN.
    fn wan_copy(&mut self, node: usize, version: u64) {
        let region = match self.nodes[node].role {
            Role::Relay { region } | Role::Actor { region } => region,
        };
        let copies = self.wan.entry((region, version)).or_default();
        copies.insert(node);
        if copies.len() < 2 {
            return;
        }
        let Role::Actor { .. } = self.nodes[node].role else {
            return;
        };
        let published = self
            .published_at
            .get(version as usize)
            .copied()
            .unwrap_or(self.now);
        let settled = self.settled[region].is_some_and(|s| s + GRACE <= published);
        let n = &self.nodes[node];
        if settled && n.left_relay + GRACE <= published && n.restarted + GRACE <= published {
            let detail = format!(
                "{} took version {version} (published at {:.3}s) from the hub; region {region}'s relay up and caught up since {:.3}s; {} copies",
                n.name,
                published.as_secs_f64(),
                self.settled[region].unwrap_or_default().as_secs_f64(),
                copies_len(&self.wan, region, version),
            );
            self.fail("more than one WAN copy", detail);
        }
    }

    /// Invariants of one node after an event.
    fn check_node(&mut self, node: usize) {
        let n = &self.nodes[node];
        let Some(c) = &n.core else {
            return;
        };
        if c.active() != n.store {
            let detail = format!("{}: core at {}, shell at {}", n.name, c.active(), n.store);
            return self.fail("core and shell disagree", detail);
        }
        if let Role::Actor { .. } = n.role {
            let held = c.held_bytes();
            let count = c.pending_versions().count() as u64;
            if held > 2 * VERSION_CAP || count > Bounds::for_model(0).max_versions {
                let detail = format!("{} holds {held} bytes in {count} versions", n.name);
                self.fail("memory beyond its bound", detail);
            }
        }
    }

    /// Whether each region's relay is up and caught up.
    fn update_settled(&mut self) {
        for r in 0..self.settled.len() {
            let Some(i) = self.relay_of(r) else {
                continue;
            };
            let n = &self.nodes[i];
            let up = n.alive
                && n.core.as_ref().is_some_and(|c| c.connection().is_some())
                && n.store + 2 >= self.published;
            match (up, self.settled[r]) {
                (true, None) => self.settled[r] = Some(self.now),
                (false, Some(_)) if !n.alive => self.settled[r] = None,
                _ => {}
            }
        }
    }

    fn kill(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        if !n.alive {
            return;
        }
        n.alive = false;
        n.core = None;
        n.activating = None;
        trace!(self, "{} killed", self.nodes[node].name);
        // Its servers see its connections go silent: they count them until the idle timeout
        // (keep-alives every second, 5 s).
        for net in 0..self.nets.len() {
            if self.nets[net].node == node && self.nets[net].server_end.is_none() {
                let d = self.crowd_uniform(Duration::from_secs(4), Duration::from_secs(5));
                self.nets[net].server_end = Some(self.now + d);
            }
        }
        // Its clients see the connection go silent: they notice within the idle timeout.
        if let Role::Relay { region } = self.nodes[node].role {
            self.settled[region] = None;
            for net in 0..self.nets.len() {
                if self.nets[net].server == Server::Relay(region) && self.nets[net].alive {
                    self.nets[net].alive = false;
                    let d = self.uniform(Duration::from_millis(50), Duration::from_secs(5));
                    let (client, inc) = (self.nets[net].node, self.nets[net].incarnation);
                    let conn = self.nets[net].conn;
                    self.push(d, Ev::Lost { net });
                    let _ = (client, inc, conn);
                }
            }
        }
    }

    fn step(&mut self) -> bool {
        let Some(((t, _), ev)) = self.queue.pop_first() else {
            return false;
        };
        self.now = t;
        self.events += 1;
        match ev {
            Ev::Publish(v) => {
                self.published = v;
                self.published_at.push(self.now);
                trace!(self, "hub publishes {v}");
                for net in 0..self.nets.len() {
                    if self.nets[net].server == Server::Hub {
                        self.pump(net);
                    }
                }
            }
            Ev::Deliver { net, msg } => self.deliver(net, msg),
            Ev::ToServer { net, msg } => self.at_server(net, msg),
            Ev::ServerReady { net } => self.pump(net),
            Ev::Connected { net } => {
                if self.net_ok(net) {
                    let (node, conn) = (self.nets[net].node, self.nets[net].conn);
                    let (latest, _) = self.holds(self.nets[net].server);
                    self.handle(node, Event::Connected { conn, latest });
                } else if self.nodes[self.nets[net].node].alive
                    && self.nodes[self.nets[net].node].incarnation == self.nets[net].incarnation
                    && self.nets[net].alive
                {
                    let (node, conn) = (self.nets[net].node, self.nets[net].conn);
                    self.ended_otherwise(node, conn);
                    self.handle(node, Event::ConnectFailed { conn });
                }
            }
            Ev::ConnectFailed {
                node,
                inc,
                conn,
                relay,
            } => {
                if self.nodes[node].alive && self.nodes[node].incarnation == inc {
                    if relay {
                        // The actor learns only now that its relay did not answer: it was
                        // without a source since it tried, and its catch-up from the next
                        // one is the cost of the relay's outage.
                        self.nodes[node].left_relay = self.now;
                    }
                    self.ended_otherwise(node, conn);
                    self.handle(node, Event::ConnectFailed { conn });
                }
            }
            Ev::Lost { net } => {
                let (node, inc, conn) = (
                    self.nets[net].node,
                    self.nets[net].incarnation,
                    self.nets[net].conn,
                );
                if self.nodes[node].alive && self.nodes[node].incarnation == inc {
                    if let (Role::Actor { .. }, Server::Relay(_)) =
                        (self.nodes[node].role, self.nets[net].server)
                    {
                        self.nodes[node].left_relay = self.now;
                    }
                    self.ended_otherwise(node, conn);
                    self.handle(node, Event::Lost { conn });
                }
            }
            // The end of a connection the server refused for connections: no loss of the
            // source (the core left it at the refusal, unless it took it for one).
            Ev::Closed { net } => {
                if self.net_ok(net) {
                    let (node, conn) = (self.nets[net].node, self.nets[net].conn);
                    self.nets[net].alive = false;
                    self.handle(node, Event::Lost { conn });
                }
            }
            Ev::DropNet { net } => {
                if self.net_ok(net) {
                    self.nets[net].alive = false;
                    let seen = self.crowd_uniform(Duration::from_millis(1), Duration::from_secs(5));
                    self.nets[net].server_end = Some(self.now + seen);
                    let d = self.uniform(Duration::from_millis(1), Duration::from_secs(5));
                    trace!(self, "connection {net} drops");
                    self.push(d, Ev::Lost { net });
                }
            }
            Ev::Wake { node, inc } => {
                if self.nodes[node].alive
                    && self.nodes[node].incarnation == inc
                    && self.nodes[node].wake == Some(self.now)
                {
                    let now = self.at();
                    self.nodes[node].wake = None;
                    if let Some(c) = self.nodes[node].core.as_mut() {
                        c.handle_timeout(now);
                    }
                    self.drive(node);
                }
            }
            Ev::Activated { node, inc, version } => {
                if self.nodes[node].alive && self.nodes[node].incarnation == inc {
                    let n = &mut self.nodes[node];
                    n.activating = None;
                    n.store = version;
                    n.areas.remove(&version);
                    self.handle(node, Event::Activated { version });
                    if let Role::Relay { region } = self.nodes[node].role {
                        self.pump_relay(region);
                    }
                }
            }
            Ev::Restored { net, version } => {
                let (node, conn) = (self.nets[net].node, self.nets[net].conn);
                if self.nodes[node].alive
                    && self.nodes[node].incarnation == self.nets[net].incarnation
                {
                    if self.net_ok(net) && version > self.nodes[node].store {
                        let n = &mut self.nodes[node];
                        n.store = version;
                        n.areas.clear();
                        n.failed.clear();
                        let relay = match n.role {
                            Role::Relay { region } => {
                                n.anchor = Some(version);
                                Some(region)
                            }
                            Role::Actor { .. } => None,
                        };
                        self.handle(node, Event::AnchorRestored { conn, version });
                        // Its subscribers waiting for an older version learn it is gone.
                        if let Some(region) = relay {
                            self.pump_relay(region);
                        }
                    } else {
                        if !self.net_ok(net)
                            && let (Role::Actor { .. }, Server::Relay(_)) =
                                (self.nodes[node].role, self.nets[net].server)
                        {
                            // The connection went while the anchor came over it: the actor
                            // learns only now that it lost its relay, as from `Lost`.
                            self.nodes[node].left_relay = self.now;
                        }
                        self.handle(node, Event::AnchorFailed { conn });
                    }
                }
            }
            Ev::Probed { node, inc, server } => {
                if self.nodes[node].alive && self.nodes[node].incarnation == inc {
                    let latest = self.server_alive(server).then(|| self.holds(server).0);
                    self.handle(
                        node,
                        Event::Probed {
                            source: SourceId(0),
                            latest,
                        },
                    );
                }
            }
            Ev::Kill { node, down } => {
                if self.nodes[node].alive {
                    self.kill(node);
                    self.push(down, Ev::Restart { node });
                }
            }
            Ev::Restart { node } => {
                if !self.nodes[node].alive {
                    self.start_node(node);
                }
            }
            Ev::HubRestart => {
                self.hub_incarnation += 1;
                trace!(self, "hub restarts");
                for net in 0..self.nets.len() {
                    if self.nets[net].server == Server::Hub && self.nets[net].alive {
                        self.nets[net].alive = false;
                        let d = self.uniform(Duration::from_millis(1), Duration::from_millis(300));
                        self.push(d, Ev::Lost { net });
                    }
                }
            }
        }
        self.update_settled();
        true
    }

    fn run(mut self) -> (Outcome, Option<Vec<String>>) {
        let end = self.faults_until + Duration::from_secs(150);
        while self.violation.is_none() && self.now < end && self.step() {}
        if self.violation.is_none() {
            let last = self.p.versions;
            let behind: Vec<String> = self
                .nodes
                .iter()
                .filter(|n| n.store != last)
                .map(|n| format!("{} at {} (alive {})", n.name, n.store, n.alive))
                .collect();
            if !behind.is_empty() {
                self.fail(
                    "never caught up",
                    format!("good sources stayed up, the last version is {last}: {behind:?}"),
                );
            }
        }
        (
            Outcome {
                events: self.events,
                violation: self.violation,
            },
            self.trace,
        )
    }
}

fn copies_len(wan: &BTreeMap<(usize, u64), BTreeSet<usize>>, r: usize, v: u64) -> usize {
    wan.get(&(r, v)).map_or(0, BTreeSet::len)
}

impl Node {
    fn new(name: String, role: Role, sources: Vec<Server>) -> Self {
        Self {
            name,
            role,
            sources,
            alive: false,
            incarnation: 0,
            core: None,
            store: 0,
            anchor: None,
            areas: BTreeMap::new(),
            failed: BTreeSet::new(),
            activating: None,
            nets: BTreeMap::new(),
            wake: None,
            left_relay: Duration::ZERO,
            restarted: Duration::ZERO,
            crowded: None,
        }
    }
}

/// Runs `seed`; on a broken invariant, runs it again with the trace on and returns both.
fn run_seed(seed: u64, regression: Regression) -> (Outcome, Option<String>) {
    let trace = std::env::var_os("STARLING_SIM_TRACE").is_some();
    let (out, lines) = Sim::new(seed, regression, trace).run();
    if out.violation.is_none() && !trace {
        return (out, None);
    }
    let lines = match lines {
        Some(l) => l,
        None => Sim::new(seed, regression, true).run().1.unwrap_or_default(),
    };
    let mut text = String::new();
    let skip = lines.len().saturating_sub(400);
    if skip > 0 {
        let _ = writeln!(
            text,
            "… {skip} earlier lines (STARLING_SIM_TRACE=1 prints all)"
        );
    }
    for l in lines.iter().skip(if trace { 0 } else { skip }) {
        let _ = writeln!(text, "{l}");
    }
    (out, Some(text))
}

/// `STARLING_SIM_SEED` alone, or `0..STARLING_SIM_SEEDS` and the [`REGRESSION_SEEDS`] beyond.
fn seeds() -> Vec<u64> {
    if let Some(s) = std::env::var("STARLING_SIM_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        return vec![s];
    }
    let n = std::env::var("STARLING_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CI_SEEDS);
    let beyond = REGRESSION_SEEDS.iter().copied().filter(|&s| s >= n);
    (0..n).chain(beyond).collect()
}

#[test]
fn every_seed_keeps_the_invariants() {
    let started = std::time::Instant::now();
    let mut events = 0u64;
    let mut n = 0u64;
    for seed in seeds() {
        let (out, trace) = run_seed(seed, Regression::None);
        events += out.events;
        n += 1;
        if let Some(v) = out.violation {
            panic!(
                "seed {seed}: {}: {}\n{}\nreplay: STARLING_SIM_SEED={seed} cargo test -p starling-transport --release follow::sim -- --nocapture",
                v.kind,
                v.detail,
                trace.unwrap_or_default()
            );
        }
        if let Some(t) = trace {
            eprintln!("{t}");
        }
    }
    eprintln!(
        "follow sim: {n} seeds, {events} events ({} per seed), {:.1} s",
        events / n.max(1),
        started.elapsed().as_secs_f64()
    );
}

/// The first seed below `limit` on which `regression` breaks `kind`.
fn first_failure(regression: Regression, kind: &str, limit: u64) -> Option<(u64, Violation)> {
    (0..limit).find_map(|seed| {
        let (out, _) = run_seed(seed, regression);
        out.violation.filter(|v| v.kind == kind).map(|v| (seed, v))
    })
}

#[test]
fn the_2s_return_probe_is_caught() {
    let found = first_failure(
        Regression::ProbeEvery2sBetweenVersionsOnly,
        "more than one WAN copy",
        500,
    );
    let (seed, v) = found.expect("the simulation should catch the 2 s return probe");
    eprintln!("2 s return probe: seed {seed}: {}", v.detail);
}

#[test]
fn a_refusal_for_connections_taken_for_a_lost_source_is_caught() {
    let found = first_failure(Regression::CrowdedIsLost, "left a crowded source", 500);
    let (seed, v) = found.expect("the simulation should catch leaving a crowded source");
    eprintln!(
        "refusal for connections taken for a lost source: seed {seed}: {}",
        v.detail
    );
}

#[test]
fn the_buffered_version_dropped_after_a_failed_staging_is_caught() {
    let found = first_failure(
        Regression::DropBufferedOnStageFailure,
        "never caught up",
        500,
    );
    let (seed, v) = found.expect("the simulation should catch the dropped buffered version");
    eprintln!("dropped buffered version: seed {seed}: {}", v.detail);
}
