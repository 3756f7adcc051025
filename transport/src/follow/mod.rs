//! The receiving core shared by relays and actors: a version on its way in, from announce to
//! activation, with no I/O and no clock (quinn-proto's shape).
//!
//! A [`Follower`] is told what happened ([`Event`]: a source answered or was lost, a stripe
//! started, a frame arrived, a stripe ended, a `Commit`, a refusal, an anchor offered, a
//! staging or an activation done or failed, a probe's answer, a shutdown) with the current
//! time, and queues what to do about it ([`Action`]: connect, subscribe, send a request,
//! begin/stage/discard a version, activate one, restore an anchor, probe the preferred
//! source, disconnect). Timers are [`Follower::poll_timeout`] and
//! [`Follower::handle_timeout`]. Which source to follow, and when to leave or go back to one,
//! is the [`SourcePolicy`] beside it.
//!
//! The shells run the actions: the actor (`starling-actor`) stages frames into a `Stager`
//! against its active weights and activates by sealing and committing; the relay
//! (`starling-relay`) stages by forwarding to its subscribers and assembling, and activates by
//! verifying the whole version and caching it. Both run QUIC, disk and engine work; neither
//! decides anything this core decides.
//!
//! # Invariants (checked after every event by the simulation in `sim.rs`)
//! - Versions are activated in order, one at a time, each only once every frame of it is
//!   here, staged without error, and its `Commit` came: never out of order, never
//!   half-applied (the shell's activation verifies the whole before it writes anything).
//!   An anchor restore replaces the active version too: it never overlaps an activation (an
//!   anchor offered while one is under way is restored once it ended, and nothing activates
//!   while the anchor is restored).
//! - An actor stages a version only on top of its base ([`FollowConfig::stage_ahead`] off):
//!   later versions are buffered here until their base is active, then staged.
//! - A version that failed staging or activation, or came with a segment numbered beyond its
//!   manifest's count (it could never complete), is fetched again (never silently dropped:
//!   `Commit` is sent once, so a dropped version would never activate), up to
//!   [`Bounds::max_refetches`] times per source before the source counts as broken (counted
//!   per source and version: one source's failures are not held against the next).
//! - What a source sends is bounded before it is held ([`Bounds`]): a version at most the model
//!   coded densely, every version in flight at most twice that, none too far ahead. A source
//!   that breaks a bound is dropped with everything it sent and left alone for a while.
//! - A source that sends no frame for [`REQUEST_PATIENCE`] after it was asked for (part of) a
//!   version (`Fetch`, `Resume`) is left as lost: a source that withholds what it announced
//!   cannot hold a receiver for ever.
//! - A source that refuses the subscription for connections (`TooManyConnections`: the
//!   receiver's certificate holds the server's bound of live subscriptions there, normally
//!   connections of its own earlier incarnations that the server has not seen end yet) is not
//!   left for a farther one before it has refused for [`CROWDED_PATIENCE`] in a row: the
//!   receiver connects to it again after a pause ([`CROWDED_RETRY_MIN`] to
//!   [`CROWDED_RETRY_MAX`]). Every other refusal is handled as before.
//! - Events of a connection the core has left are ignored (each carries its [`ConnId`]).
//! - On a new connection a half-received version continues (`Resume`) only where the source
//!   holds it whole (its `Welcome` says so); otherwise the source streams it again and what is
//!   already here is dropped as duplicate. A refusal that comes once versions after the
//!   subscription's start are active here (they were here already) subscribes afresh to the
//!   same source rather than asking it for an anchor.

pub mod policy;
#[cfg(test)]
mod sim;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use starling_proto::protocol::msg::{MAX_SEQS, Message, RefuseReason};

use crate::reception::{Added, FrameInfo, Reception};
pub use policy::{Crowded, GaveUp, PolicyConfig, SourceId, SourcePolicy};

/// How long a receiver waits for the anchor it asked a source for before it leaves the
/// source (which then has neither the next delta nor a newer anchor).
pub const ANCHOR_PATIENCE: Duration = Duration::from_secs(2);

/// How long a source may send no frame at all after it was asked for (part of) a version
/// (`Fetch`, `Resume`) before the receiver leaves it as lost: an honest source answers at
/// once, with frames or a refusal (it sent those frames before, or holds the version whole);
/// one that stays silent is withholding, or its connection is dead without a word. Far
/// beyond QUIC's idle timeout (5 s), so that a busy receiver whose reads wait on its read
/// budget, or a congested link, is not taken for a withholding source: leaving a source costs a
/// WAN copy, while waiting this long on a hostile one costs only this delay.
pub const REQUEST_PATIENCE: Duration = Duration::from_secs(30);

/// How long a receiver keeps asking a source that refuses its subscription for connections
/// (`TooManyConnections`) before it leaves it for the next one (see
/// [`SourcePolicy::crowded`]), from its first refusal in a row. Such a refusal is transient by
/// nature: the server counts connections of this receiver's earlier incarnations (an actor or
/// relay restarted twice within the QUIC idle timeout) until it sees them end, at most the
/// idle timeout ([`crate::link::IDLE_TIMEOUT`], 5 s) after the peer died, and one of them
/// ending is enough. Twice the idle timeout leaves room for a server slow to notice; a source
/// still refusing after it is crowded for another reason (another live process with the same
/// certificate) and is left, as before. Meanwhile the receiver has no source: leaving costs
/// the region a WAN copy of every version it takes from the hub, waiting at most this delay
/// (what it missed is streamed once it subscribes).
pub const CROWDED_PATIENCE: Duration = Duration::from_secs(10);
const _: () = assert!(CROWDED_PATIENCE.as_millis() >= 2 * crate::link::IDLE_TIMEOUT.as_millis());

/// The first pause before a source that refused the subscription for connections is asked
/// again; it doubles up to [`CROWDED_RETRY_MAX`]. Each attempt costs a handshake on the
/// region's LAN and a logged refusal at the server, so not much less; the place it waits
/// for is freed at an unknown moment within the idle timeout, so not much more: at most
/// [`CROWDED_RETRY_MAX`] passes between a place freed and the receiver taking it, and about 6
/// attempts fill [`CROWDED_PATIENCE`].
pub const CROWDED_RETRY_MIN: Duration = Duration::from_secs(1);

/// The longest pause between two attempts at a source that refused for connections.
pub const CROWDED_RETRY_MAX: Duration = Duration::from_secs(2);

/// One connection to a source, numbered by the core; events name the connection they came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

/// What a receiver holds a source to (an actor's bounds against a hostile or broken source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The most wire bytes one version may take; every version in flight together at most
    /// twice this. A source that sends more of one version is dropped; versions beyond the
    /// next one that would take more than twice this together are dropped here (not the
    /// source: a subscriber far behind gets a run of versions back to back) and streamed
    /// again once the versions before them are active.
    pub version_cap: u64,
    /// The furthest ahead of the active version a source may announce a version out of
    /// order, and the furthest past the newest version it announced (an honest source never
    /// skips one: it streams each version after the one before, so a subscriber far behind
    /// sees a run of versions, never a jump; but the stripes of a run overtake each other on
    /// the way, so the next versions of a run may be announced before the last ones).
    pub max_ahead: u64,
    /// The furthest ahead a source may announce at all (what a long honest catch-up needs,
    /// and a bound on what the versions in flight cost here).
    pub max_versions: u64,
    /// How many times one version may be fetched again from one source.
    pub max_refetches: u32,
}

impl Bounds {
    /// The bounds for a model of `bf16_bytes` bytes: a delta is never larger than the model
    /// coded densely plus framing (an eighth more, and 1 MiB for a small model's manifest);
    /// a jump of at most 8 versions, a run of at most 1024; 5 refetches.
    pub fn for_model(bf16_bytes: u64) -> Self {
        Self {
            version_cap: bf16_bytes + bf16_bytes / 8 + (1 << 20),
            max_ahead: 8,
            max_versions: 1024,
            max_refetches: 5,
        }
    }
}

/// How a receiver receives.
#[derive(Debug, Clone)]
pub struct FollowConfig {
    /// Every version is staged at first sight (a relay forwards and assembles any version);
    /// else only the version after the active one is, and later ones are buffered here until
    /// their base is active (an actor decodes against its base's values).
    pub stage_ahead: bool,
    /// Bounds a source is held to (none: the source is trusted, as a relay trusts the hub).
    pub bounds: Option<Bounds>,
    /// The receiver can restore an anchor (a relay needs a disk cache for one).
    pub anchors: bool,
    /// When a source has neither the next delta nor a newer anchor: `None` tries the next
    /// source at once; `Some(pause)` the same source again after `pause`.
    pub unavailable_retry: Option<Duration>,
}

impl FollowConfig {
    /// An actor's: stages on top of its base only, bounded.
    pub fn actor(bounds: Bounds) -> Self {
        Self {
            stage_ahead: false,
            bounds: Some(bounds),
            anchors: true,
            unavailable_retry: None,
        }
    }

    /// A relay's: forwards everything at once, trusts the hub, waits 5 s before asking again
    /// for what the hub does not have.
    pub fn relay(anchors: bool) -> Self {
        Self {
            stage_ahead: true,
            bounds: None,
            anchors,
            unavailable_retry: Some(Duration::from_secs(5)),
        }
    }
}

/// What happened, as the shell tells it. `F` is the shell's frame (its bytes); the core only
/// holds it while a version waits for its base, and hands it back in [`Action::Stage`].
#[derive(Debug)]
pub enum Event<F> {
    /// The source of `conn` answered `Hello`: it holds versions up to `latest`.
    Connected { conn: ConnId, latest: u64 },
    /// The source of `conn` was not reached (or refused this receiver for now).
    ConnectFailed { conn: ConnId },
    /// The connection ended.
    Lost { conn: ConnId },
    /// A stripe of a transmission of `version` began.
    StreamStarted {
        conn: ConnId,
        version: u64,
        base: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
    },
    /// A verified frame of `version` (`bytes` on the wire), on a stripe of `transmission`.
    Frame {
        conn: ConnId,
        version: u64,
        delta_id: [u8; 32],
        transmission: u32,
        info: FrameInfo,
        bytes: u64,
        frame: F,
    },
    /// A stripe ended, cleanly or broken (what came after the damage is lost).
    StreamEnded {
        conn: ConnId,
        version: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
    },
    /// The source committed `version`.
    Commit { conn: ConnId, version: u64 },
    /// The source refused a request.
    Refused { conn: ConnId, reason: RefuseReason },
    /// The source is sending an anchor of `version` on `conn`.
    AnchorOffered { conn: ConnId, version: u64 },
    /// The anchor asked for in [`Action::RestoreAnchor`] on `conn` is now the active version.
    AnchorRestored { conn: ConnId, version: u64 },
    /// The anchor offered on `conn` did not check out, or did not arrive (nothing changed).
    AnchorFailed { conn: ConnId },
    /// A frame of `version` did not stage (it does not decode against the base, or the
    /// shell could not start the version); what was staged of it is gone.
    StageFailed { version: u64 },
    /// `version` is active (committed, durable, reported).
    Activated { version: u64 },
    /// `version` did not verify as a whole; nothing of it was applied.
    ActivationFailed { version: u64 },
    /// A probe of `source` ended: it answered holding `latest`, or did not answer.
    Probed {
        source: SourceId,
        latest: Option<u64>,
    },
    /// The process is stopping: leave the source, start nothing new.
    Shutdown,
}

/// What to do, in order.
#[derive(Debug)]
pub enum Action<F> {
    /// Connect to `source` and say `Hello` holding `active`; answer with
    /// [`Event::Connected`] or [`Event::ConnectFailed`] for `conn`.
    Connect {
        conn: ConnId,
        source: SourceId,
        active: u64,
    },
    /// Send `message` (`Subscribe`, `Resume`, `Fetch`, `FetchAnchor`) on `conn`.
    Send { conn: ConnId, message: Message },
    /// Close `conn`; nothing more from it is wanted.
    Disconnect { conn: ConnId },
    /// Make ready to stage `version` (actor: a stager on the active weights; relay: a live
    /// version its subscribers are sent, and an assembler). Replaces an unfinished one.
    Begin {
        version: u64,
        base: u64,
        delta_id: [u8; 32],
    },
    /// Stage a frame of `version` (in the order given); on failure answer
    /// [`Event::StageFailed`].
    Stage { version: u64, frame: F },
    /// Forget what was staged of `version`.
    Discard { version: u64 },
    /// Verify `version` whole and make it active (its first stripe began at `started`);
    /// answer [`Event::Activated`] or [`Event::ActivationFailed`].
    Activate { version: u64, started: Instant },
    /// Receive the anchor of `version` offered on `conn`; answer [`Event::AnchorRestored`] or
    /// [`Event::AnchorFailed`].
    RestoreAnchor { conn: ConnId, version: u64 },
    /// Ask `source` (in a task of its own) which version it holds; answer [`Event::Probed`].
    Probe { source: SourceId, active: u64 },
    /// For logs, status and metrics.
    Notice(Notice),
    /// Every source failed too often: stop.
    GiveUp(GaveUp),
}

/// Things worth telling an operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// Every frame of `version` is here and handed to the shell to stage (its verification
    /// follows). A version buffered until its base is active is said to be here only once
    /// its frames are handed over.
    Received { version: u64 },
    /// `source` broke a bound and is left alone for a while.
    SourceDropped { source: SourceId, why: Misbehaviour },
    /// The preferred source answers again: leaving `from` for it.
    Returning { from: SourceId },
    /// `source` has neither the next delta nor an anchor newer than `after`.
    NothingToOffer { source: SourceId, after: u64 },
    /// `source` sent nothing for `waited` after it was asked for (part of) a version: left as
    /// lost.
    Unanswered { source: SourceId, waited: Duration },
    /// `source` refused the subscription for connections for `waited` in a row
    /// ([`CROWDED_PATIENCE`]): left as lost.
    Crowded { source: SourceId, waited: Duration },
}

/// One line for a log: what happened (the source is named by the shell, which knows it).
impl std::fmt::Display for Notice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Notice::Received { version } => write!(f, "every frame of version {version} is here"),
            Notice::SourceDropped { why, .. } => {
                write!(f, "dropping this source for a while: {why}")
            }
            Notice::Returning { .. } => {
                write!(f, "the preferred source answers again; returning to it")
            }
            Notice::NothingToOffer { after, .. } => write!(
                f,
                "neither the delta after {after} nor a newer anchor here; trying the next source"
            ),
            Notice::Unanswered { waited, .. } => write!(
                f,
                "nothing came for {waited:?} after a request for a version; trying the next source"
            ),
            Notice::Crowded { waited, .. } => write!(
                f,
                "refused for too many connections of this certificate for {waited:?} (another \
                 live process with the same name?); trying the next source"
            ),
        }
    }
}

/// How a source broke a bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Misbehaviour {
    #[error(
        "it announced version {version} after {newest}, more than {max_ahead} ahead of the active {active}"
    )]
    TooFarAhead {
        version: u64,
        newest: u64,
        active: u64,
        max_ahead: u64,
    },
    #[error(
        "it sent more than {cap} bytes of version {version}, more than the whole model coded densely"
    )]
    VersionTooLarge { version: u64, cap: u64 },
    #[error("version {version} failed verification {attempts} times from it")]
    KeepsFailing { version: u64, attempts: u32 },
}

/// Old behaviours the simulation replays to show it catches them (tests only).
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Regression {
    None,
    /// Before 7230b72: the preferred relay probed every 2 s, returned to only when a probe
    /// found nothing half-received.
    ProbeEvery2sBetweenVersionsOnly,
    /// Before 029593f: a buffered version that failed to stage when its base became active
    /// was dropped without being fetched again.
    DropBufferedOnStageFailure,
    /// Before the crowded backoff: a `TooManyConnections` refusal was not acted on, and the
    /// connection's end that follows it left the source as lost, for the next one at once.
    CrowdedIsLost,
}

/// Where a version on its way in stands.
#[derive(Debug)]
enum Stage<F> {
    /// Its base is not active yet: its frames wait here, as they came.
    Buffering(Vec<F>),
    /// Begun in the shell: each frame is staged on arrival.
    Staging,
}

#[derive(Debug)]
struct Pending<F> {
    reception: Reception,
    stage: Stage<F>,
    /// Wire bytes held for this version (buffered here or staged in the shell).
    held: u64,
    /// [`Notice::Received`] was given.
    said_received: bool,
    /// The newest transmission of it begun on this connection.
    newest_transmission: Option<u32>,
    /// It started over after a failure: frames of these transmissions and older (the same
    /// bytes that failed, still on their way) are not wanted.
    stale_through: Option<u32>,
    /// Its staging began from frames buffered while its base was not active.
    #[cfg(test)]
    from_buffer: bool,
}

#[derive(Debug, Clone, Copy)]
enum Link {
    /// No connection; the next attempt is due then.
    Down {
        retry_at: Instant,
    },
    Connecting {
        conn: ConnId,
        source: SourceId,
    },
    Up {
        conn: ConnId,
        source: SourceId,
        /// The subscription on this connection streams the versions after this one.
        after: u64,
        /// When an anchor was asked for on this connection.
        anchor_asked: Option<Instant>,
        /// An anchor is being restored from it (or was offered, and waits for `offered`).
        restoring: bool,
        /// The anchor offered, not yet handed to the shell: an activation is under way, and
        /// the two never overlap (both replace the active version).
        offered: Option<u64>,
        /// When the oldest request for (part of) a version was sent that no frame has
        /// followed yet (see [`REQUEST_PATIENCE`]).
        asked: Option<Instant>,
    },
    /// Shut down or given up.
    Stopped,
}

/// The receiving core: see the module docs.
#[derive(Debug)]
pub struct Follower<F> {
    cfg: FollowConfig,
    policy: SourcePolicy,
    active: u64,
    pending: BTreeMap<u64, Pending<F>>,
    commits: BTreeSet<u64>,
    /// Failed verifications per source and version (see [`Bounds::max_refetches`]).
    retries: BTreeMap<(SourceId, u64), u32>,
    /// The version the shell is activating.
    activating: Option<u64>,
    /// The newest version announced on this connection (or done when it began).
    newest_announced: u64,
    /// Versions were dropped to stay within the bound: subscribe again once the next one is
    /// active.
    shed: bool,
    link: Link,
    next_conn: u64,
    out: VecDeque<Action<F>>,
    #[cfg(test)]
    pub(crate) regression: Regression,
}

impl<F> Follower<F> {
    /// A receiver holding `active`, about to connect to the first usable source.
    pub fn new(cfg: FollowConfig, policy: SourcePolicy, active: u64, now: Instant) -> Self {
        Self {
            cfg,
            policy,
            active,
            pending: BTreeMap::new(),
            commits: BTreeSet::new(),
            retries: BTreeMap::new(),
            activating: None,
            newest_announced: active,
            shed: false,
            link: Link::Down { retry_at: now },
            next_conn: 0,
            out: VecDeque::new(),
            #[cfg(test)]
            regression: Regression::None,
        }
    }

    /// The newest active version.
    pub fn active(&self) -> u64 {
        self.active
    }

    /// The newest version that needs nothing more from a source: active, or being activated.
    pub fn done_through(&self) -> u64 {
        self.active.max(self.activating.unwrap_or(0))
    }

    /// Wire bytes held for versions on their way in (buffered here or staged in the shell).
    pub fn held_bytes(&self) -> u64 {
        self.pending.values().map(|p| p.held).sum()
    }

    /// Versions with frames here, not yet active.
    pub fn pending_versions(&self) -> impl Iterator<Item = u64> + '_ {
        self.pending.keys().copied()
    }

    /// The source followed now (connected or being connected to).
    pub fn source(&self) -> Option<SourceId> {
        match self.link {
            Link::Connecting { source, .. } | Link::Up { source, .. } => Some(source),
            _ => None,
        }
    }

    /// The connection followed now.
    pub fn connection(&self) -> Option<ConnId> {
        match self.link {
            Link::Connecting { conn, .. } | Link::Up { conn, .. } => Some(conn),
            _ => None,
        }
    }

    /// Whether the core stopped (shut down or gave up).
    pub fn is_stopped(&self) -> bool {
        matches!(self.link, Link::Stopped)
    }

    pub fn policy(&self) -> &SourcePolicy {
        &self.policy
    }

    /// The next action to run.
    pub fn poll_action(&mut self) -> Option<Action<F>> {
        self.out.pop_front()
    }

    /// The frame of the next action, taken, if that action stages a frame of `version`: for
    /// a shell that stages together the frames handed over one after another. Any other
    /// next action stays queued.
    pub fn poll_stage(&mut self, version: u64) -> Option<F> {
        if !matches!(self.out.front(), Some(Action::Stage { version: v, .. }) if *v == version) {
            return None;
        }
        match self.out.pop_front() {
            Some(Action::Stage { frame, .. }) => Some(frame),
            _ => None,
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) is due next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let retry = match self.link {
            Link::Down { retry_at } => Some(retry_at),
            _ => None,
        };
        let probe = match self.link {
            Link::Up { .. } => self.policy.probe_due(),
            _ => None,
        };
        let anchor = match self.link {
            Link::Up {
                anchor_asked: Some(at),
                restoring: false,
                ..
            } => Some(at + ANCHOR_PATIENCE),
            _ => None,
        };
        let answer = match self.link {
            Link::Up {
                asked: Some(at),
                restoring: false,
                ..
            } => Some(at + REQUEST_PATIENCE),
            _ => None,
        };
        [retry, probe, anchor, answer].into_iter().flatten().min()
    }

    /// Runs what is due at `now`: the next connection attempt, leaving a source that does
    /// not answer, a probe.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Link::Down { retry_at } = self.link
            && retry_at <= now
        {
            match self.policy.choose(now) {
                Ok(source) => {
                    let conn = ConnId(self.next_conn);
                    self.next_conn += 1;
                    self.link = Link::Connecting { conn, source };
                    self.out.push_back(Action::Connect {
                        conn,
                        source,
                        active: self.active,
                    });
                }
                Err(at) => self.link = Link::Down { retry_at: at },
            }
        }
        if let Link::Up {
            anchor_asked: Some(at),
            restoring: false,
            ..
        } = self.link
            && at + ANCHOR_PATIENCE <= now
        {
            self.nothing_to_offer(now);
        }
        if let Link::Up {
            asked: Some(at),
            restoring: false,
            ..
        } = self.link
            && at + REQUEST_PATIENCE <= now
        {
            self.unanswered(now);
        }
        if matches!(self.link, Link::Up { .. })
            && let Some(source) = self.policy.start_probe(now)
        {
            self.out.push_back(Action::Probe {
                source,
                active: self.active,
            });
        }
    }

    /// Handles one event at `now`.
    pub fn handle(&mut self, now: Instant, event: Event<F>) {
        match event {
            Event::Connected { conn, latest } => self.connected(now, conn, latest),
            Event::ConnectFailed { conn } => {
                if let Link::Connecting { conn: c, source } = self.link
                    && c == conn
                {
                    match self.policy.not_reached(source, now) {
                        Ok(retry_at) => self.link = Link::Down { retry_at },
                        Err(e) => self.give_up(e),
                    }
                }
            }
            Event::Lost { conn } => {
                if let Some(source) = self.source_of(conn) {
                    self.link = Link::Down { retry_at: now };
                    if let Err(e) = self.policy.lost(source) {
                        self.give_up(e);
                    }
                }
            }
            Event::StreamStarted {
                conn,
                version,
                base,
                delta_id,
                transmission,
                stripes,
            } => {
                if self.receiving(conn) {
                    self.stream_started(now, version, base, delta_id, transmission, stripes);
                }
            }
            Event::Frame {
                conn,
                version,
                delta_id,
                transmission,
                info,
                bytes,
                frame,
            } => {
                if self.receiving(conn) {
                    // The source answers: whatever was asked of it is on its way.
                    if let Link::Up { asked, .. } = &mut self.link {
                        *asked = None;
                    }
                    self.frame(now, version, delta_id, transmission, info, bytes, frame);
                }
            }
            Event::StreamEnded {
                conn,
                version,
                delta_id,
                transmission,
                stripes,
            } => {
                if self.receiving(conn)
                    && let Some(p) = self.pending.get_mut(&version)
                    && p.reception.delta_id == delta_id
                    && let Some(seqs) = p.reception.stream_ended(transmission, stripes)
                {
                    self.refetch(now, version, seqs, false);
                }
            }
            Event::Commit { conn, version } => {
                let ahead = self.cfg.bounds.map_or(u64::MAX, |b| b.max_versions);
                if self.receiving(conn)
                    && version > self.active
                    && version <= self.active.saturating_add(ahead)
                {
                    self.commits.insert(version);
                }
            }
            Event::Refused { conn, reason } => {
                if self.receiving(conn) {
                    if let Link::Up { asked, .. } = &mut self.link {
                        *asked = None;
                    }
                    match reason {
                        RefuseReason::VersionUnavailable => self.unavailable(now),
                        RefuseReason::TooManyConnections => self.crowded(now),
                        _ => {}
                    }
                }
            }
            Event::AnchorOffered { conn, version } => {
                if self.receiving(conn) {
                    if version > self.done_through() && self.cfg.anchors {
                        // Nothing more is taken from the source, and nothing more activated,
                        // until the anchor is in (`restore_ready` hands it to the shell once
                        // no activation is under way).
                        if let Link::Up {
                            restoring, offered, ..
                        } = &mut self.link
                        {
                            *restoring = true;
                            *offered = Some(version);
                        }
                    } else {
                        self.leave(now, false);
                    }
                }
            }
            Event::AnchorRestored { conn, version } => self.restored(now, conn, version),
            Event::AnchorFailed { conn } => {
                if let Link::Up {
                    conn: c,
                    restoring: true,
                    ..
                } = self.link
                    && c == conn
                {
                    self.leave(now, false);
                }
            }
            Event::StageFailed { version } => self.stage_failed(now, version),
            Event::Activated { version } => {
                self.activated(version);
                if self.shed && self.activating.is_none() {
                    // Versions were dropped to stay within the bound: the source streams
                    // them again after what is active now.
                    self.shed = false;
                    self.leave(now, true);
                }
            }
            Event::ActivationFailed { version } => {
                if self.activating == Some(version) {
                    self.activating = None;
                    self.start_over(now, version, true);
                }
            }
            Event::Probed { source, latest } => {
                let half = self.pending.contains_key(&(self.active + 1));
                // Not in the middle of restoring an anchor: probe again later.
                let restoring = matches!(
                    self.link,
                    Link::Up {
                        restoring: true,
                        ..
                    }
                );
                let latest = latest.filter(|_| !restoring);
                if source == SourceId(0)
                    && self.policy.probed(latest, self.active, half, now)
                    && let Link::Up { conn, source, .. } = self.link
                {
                    self.out
                        .push_back(Action::Notice(Notice::Returning { from: source }));
                    self.out.push_back(Action::Disconnect { conn });
                    self.policy.go_back();
                    self.link = Link::Down { retry_at: now };
                    self.handle_timeout(now);
                }
            }
            Event::Shutdown => {
                if let Some(conn) = self.connection() {
                    self.out.push_back(Action::Disconnect { conn });
                }
                self.link = Link::Stopped;
            }
        }
        self.check_bounds(now);
        self.restore_ready();
        self.activate_ready();
    }

    fn source_of(&self, conn: ConnId) -> Option<SourceId> {
        match self.link {
            Link::Connecting { conn: c, source }
            | Link::Up {
                conn: c, source, ..
            } if c == conn => Some(source),
            _ => None,
        }
    }

    /// Whether data events of `conn` count: it is the connection followed, not restoring.
    fn receiving(&self, conn: ConnId) -> bool {
        matches!(self.link, Link::Up { conn: c, restoring: false, .. } if c == conn)
    }

    fn connected(&mut self, now: Instant, conn: ConnId, latest: u64) {
        let Link::Connecting { conn: c, source } = self.link else {
            return;
        };
        if c != conn {
            return;
        }
        self.policy.connected(source, now);
        self.shed = false;
        // A new source numbers its transmissions afresh: what was outstanding is not.
        for p in self.pending.values_mut() {
            p.reception.reset_requests();
            p.newest_transmission = None;
            p.stale_through = None;
        }
        let next = self.done_through() + 1;
        // Continue the next version from what is here only where the source holds it whole;
        // else it is streamed again and what is here is dropped as duplicate.
        let resume = self
            .pending
            .get(&next)
            .map(|p| p.reception.have())
            .filter(|have| latest >= next && !have.is_empty() && have.len() <= MAX_SEQS);
        let after = if resume.is_some() { next } else { next - 1 };
        let asked = resume.is_some().then_some(now);
        self.newest_announced = after;
        self.out.push_back(Action::Send {
            conn,
            message: Message::Subscribe {
                after_version: after,
            },
        });
        if let Some(have) = resume {
            self.out.push_back(Action::Send {
                conn,
                message: Message::Resume {
                    version: next,
                    have,
                },
            });
        }
        self.link = Link::Up {
            conn,
            source,
            after,
            anchor_asked: None,
            restoring: false,
            offered: None,
            asked,
        };
    }

    fn stream_started(
        &mut self,
        now: Instant,
        version: u64,
        base: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
    ) {
        if version <= self.done_through() {
            return;
        }
        if let Some(b) = self.cfg.bounds {
            // A run of versions streamed back to back reaches the receiver on several
            // stripes each, not always in order: a version up to `max_ahead` past the newest
            // announced is the run going on, not a jump.
            let jump = version > self.newest_announced.saturating_add(b.max_ahead);
            if version > self.active.saturating_add(b.max_versions)
                || (jump && version > self.active.saturating_add(b.max_ahead))
            {
                return self.misbehaved(
                    now,
                    Misbehaviour::TooFarAhead {
                        version,
                        newest: self.newest_announced,
                        active: self.active,
                        max_ahead: b.max_ahead,
                    },
                );
            }
        }
        self.newest_announced = self.newest_announced.max(version);
        let same = self
            .pending
            .get(&version)
            .is_some_and(|p| p.reception.delta_id == delta_id);
        if !same {
            // A different delta under the same number replaces an unfinished one (its
            // producer failed and published again).
            if self.pending.contains_key(&version) {
                self.forget(version);
            }
            let stage = if self.cfg.stage_ahead || version == self.active + 1 {
                self.out.push_back(Action::Begin {
                    version,
                    base,
                    delta_id,
                });
                Stage::Staging
            } else {
                Stage::Buffering(Vec::new())
            };
            self.pending.insert(
                version,
                Pending {
                    reception: Reception::new(version, base, delta_id, now),
                    stage,
                    held: 0,
                    said_received: false,
                    newest_transmission: None,
                    stale_through: None,
                    #[cfg(test)]
                    from_buffer: false,
                },
            );
        }
        if let Some(p) = self.pending.get_mut(&version) {
            p.reception.stream_started(transmission, stripes);
            p.newest_transmission = p.newest_transmission.max(Some(transmission));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn frame(
        &mut self,
        now: Instant,
        version: u64,
        delta_id: [u8; 32],
        transmission: u32,
        info: FrameInfo,
        bytes: u64,
        frame: F,
    ) {
        let Some(p) = self.pending.get_mut(&version) else {
            return;
        };
        if p.reception.delta_id != delta_id || p.stale_through.is_some_and(|t| transmission <= t) {
            return;
        }
        match p.reception.frame(info) {
            Added::New => {}
            Added::Duplicate => return,
            // Being activated, it is whole: the frame beyond it is only not kept.
            Added::Beyond { .. } if self.activating == Some(version) => return,
            // The version can never complete from what came: it failed, from the current
            // source where the segment beyond came from it (what was staged of it, and this
            // frame, are dropped).
            Added::Beyond { from_current } => return self.start_over(now, version, from_current),
        }
        p.held += bytes;
        match &mut p.stage {
            Stage::Buffering(frames) => frames.push(frame),
            Stage::Staging => self.out.push_back(Action::Stage { version, frame }),
        }
        // After the last frame's `Stage`: a receiver that stages as frames come has staged
        // every frame when it hears the version is here (its `staged` stamp means that). A
        // version still buffered is said to be here once its frames are staged, when its
        // base becomes active (`activated`).
        if matches!(p.stage, Stage::Staging) && p.reception.complete() && !p.said_received {
            p.said_received = true;
            self.out
                .push_back(Action::Notice(Notice::Received { version }));
        }
    }

    /// The bounds on what the current source sent: a source that sent more of one version
    /// than a version can hold is dropped; versions beyond the next one that take more than
    /// the bound for everything in flight are dropped (newest first), to be streamed again.
    fn check_bounds(&mut self, now: Instant) {
        let Some(b) = self.cfg.bounds else {
            return;
        };
        let over = self
            .pending
            .iter()
            .find(|(_, p)| p.held > b.version_cap)
            .map(|(&version, _)| version);
        if let Some(version) = over {
            return self.misbehaved(
                now,
                Misbehaviour::VersionTooLarge {
                    version,
                    cap: b.version_cap,
                },
            );
        }
        while self.held_bytes() > 2 * b.version_cap {
            let Some(&newest) = self.pending.keys().next_back() else {
                break;
            };
            if newest <= self.active + 1 {
                break;
            }
            self.forget(newest);
            self.shed = true;
        }
    }

    /// Drops the current source for breaking a bound, with everything it sent.
    fn misbehaved(&mut self, now: Instant, why: Misbehaviour) {
        let (Link::Up { conn, source, .. } | Link::Connecting { conn, source }) = self.link else {
            return;
        };
        self.out
            .push_back(Action::Notice(Notice::SourceDropped { source, why }));
        let versions: Vec<u64> = self.pending.keys().copied().collect();
        for v in versions {
            self.forget(v);
        }
        self.out.push_back(Action::Disconnect { conn });
        self.link = Link::Down { retry_at: now };
        if let Err(e) = self.policy.misbehaved(source, now) {
            self.give_up(e);
        }
    }

    /// Leaves the current source (it has nothing for us, or we subscribe afresh): `again`
    /// comes back to the same one.
    fn leave(&mut self, now: Instant, again: bool) {
        if let Some(conn) = self.connection()
            && let Some(source) = self.source()
        {
            self.out.push_back(Action::Disconnect { conn });
            self.policy.leave(source, again);
            self.link = Link::Down { retry_at: now };
        }
    }

    /// The source does not retain what was asked for: ask it for its newest anchor, once per
    /// connection. Refusals that follow are of requests sent before (a `Subscribe` and a
    /// `Resume` can both be refused); whether an anchor comes is decided by
    /// [`ANCHOR_PATIENCE`] in [`handle_timeout`](Self::handle_timeout).
    ///
    /// Where versions after the subscription's start became active here meanwhile (what was
    /// already here when it subscribed), what was refused may be only what is no longer
    /// needed: the receiver subscribes afresh on a new connection to the same source (a
    /// refused subscription ends there), after what it holds now. Asking for an anchor
    /// instead would find none newer, and leave a source that holds every version it needs.
    fn unavailable(&mut self, now: Instant) {
        let done = self.done_through();
        let Link::Up {
            conn,
            after,
            anchor_asked,
            ..
        } = &mut self.link
        else {
            return;
        };
        let conn = *conn;
        if anchor_asked.is_some() {
            return;
        }
        if done > *after {
            return self.leave(now, true);
        }
        if !self.cfg.anchors {
            return self.nothing_to_offer(now);
        }
        *anchor_asked = Some(now);
        let after_version = self.done_through();
        self.out.push_back(Action::Send {
            conn,
            message: Message::FetchAnchor { after_version },
        });
    }

    /// The source refused the subscription for connections (its server closes the
    /// connection; the end that follows is of a connection left here, and ignored): the same
    /// source is connected to again after a pause, or, once it has refused for
    /// [`CROWDED_PATIENCE`] in a row, left as lost (see [`SourcePolicy::crowded`]).
    fn crowded(&mut self, now: Instant) {
        #[cfg(test)]
        if self.regression == Regression::CrowdedIsLost {
            return;
        }
        let Link::Up { conn, source, .. } = self.link else {
            return;
        };
        self.out.push_back(Action::Disconnect { conn });
        self.link = Link::Down { retry_at: now };
        match self.policy.crowded(source, now) {
            Ok(Crowded::Retry(retry_at)) => self.link = Link::Down { retry_at },
            Ok(Crowded::Leave { waited }) => self
                .out
                .push_back(Action::Notice(Notice::Crowded { source, waited })),
            Err(e) => self.give_up(e),
        }
    }

    /// The source has neither the next delta nor a newer anchor: leave it.
    fn nothing_to_offer(&mut self, now: Instant) {
        let Some(source) = self.source() else {
            return;
        };
        let after = self.done_through();
        self.policy.nothing_to_offer(source, after);
        self.out
            .push_back(Action::Notice(Notice::NothingToOffer { source, after }));
        match self.cfg.unavailable_retry {
            None => self.leave(now, false),
            Some(pause) => {
                self.leave(now, true);
                self.link = Link::Down {
                    retry_at: now + pause,
                };
            }
        }
    }

    fn restored(&mut self, now: Instant, conn: ConnId, version: u64) {
        let restoring = matches!(self.link, Link::Up { conn: c, restoring: true, .. } if c == conn);
        if !restoring || version <= self.active {
            return;
        }
        let versions: Vec<u64> = self.pending.keys().copied().collect();
        for v in versions {
            self.forget(v);
        }
        self.active = version;
        self.activating = None;
        self.commits.clear();
        self.retries.clear();
        // The subscription was after the old version: subscribe afresh, from the preferred
        // source on (it may hold the deltas after the anchor though it had no anchor).
        if let Some(conn) = self.connection() {
            self.out.push_back(Action::Disconnect { conn });
        }
        self.policy.go_back();
        self.link = Link::Down { retry_at: now };
    }

    /// Drops what is held of `version`, here and in the shell.
    fn forget(&mut self, version: u64) {
        if let Some(p) = self.pending.remove(&version)
            && matches!(p.stage, Stage::Staging)
        {
            self.out.push_back(Action::Discard { version });
        }
    }

    /// A frame of `version` did not stage: what is staged of it is gone in the shell. The
    /// version starts over and is fetched whole again.
    fn stage_failed(&mut self, now: Instant, version: u64) {
        let Some(_p) = self.pending.get(&version) else {
            return;
        };
        // A `Begin` of it still queued means it started over after the frames that failed
        // were handed over (the shell staged frames heard before an event that restarted the
        // version, `drive`'s batches): the failure is the earlier attempt's, which the queued
        // `Discard` and `Begin` end anyway. Counting it would restart the new attempt too.
        if self
            .out
            .iter()
            .any(|a| matches!(a, Action::Begin { version: v, .. } if *v == version))
        {
            return;
        }
        #[cfg(test)]
        if self.regression == Regression::DropBufferedOnStageFailure && _p.from_buffer {
            // Before 029593f the actor dropped a version whose buffered frames failed to
            // stage at its base's activation, and fetched nothing.
            self.forget(version);
            return;
        }
        // What was queued for it behind the frame that failed is moot: its other frames, the
        // notice that it is here (it is said again once it is here again), and an activation
        // asked for when its last frame came in.
        let queued_activation = self
            .out
            .iter()
            .any(|a| matches!(a, Action::Activate { version: v, .. } if *v == version));
        self.out.retain(|a| {
            !matches!(a, Action::Stage { version: v, .. } | Action::Activate { version: v, .. }
                | Action::Notice(Notice::Received { version: v }) if *v == version)
        });
        if self.activating == Some(version) {
            if !queued_activation {
                // The shell took the activation already: its ActivationFailed starts over.
                return;
            }
            self.activating = None;
        }
        self.start_over(now, version, true);
    }

    /// `version` failed staging or activation, or came with a segment beyond its manifest's
    /// count: what is here of it is dropped (here and in the shell), its transmission
    /// bookkeeping kept (stripes still under way keep counting), and the whole version is
    /// fetched again. `failed`: counted against the current source (see
    /// [`refetch`](Self::refetch)).
    fn start_over(&mut self, now: Instant, version: u64, failed: bool) {
        let Some(p) = self.pending.get_mut(&version) else {
            return;
        };
        let staging = matches!(p.stage, Stage::Staging);
        p.reception.restart();
        p.held = 0;
        p.said_received = false;
        p.stale_through = p.newest_transmission;
        p.stage = Stage::Buffering(Vec::new());
        let (base, delta_id) = (p.reception.base, p.reception.delta_id);
        if staging {
            self.out.push_back(Action::Discard { version });
        }
        if self.cfg.stage_ahead || version == self.active + 1 {
            if let Some(p) = self.pending.get_mut(&version) {
                p.stage = Stage::Staging;
            }
            self.out.push_back(Action::Begin {
                version,
                base,
                delta_id,
            });
        }
        self.refetch(now, version, Vec::new(), failed);
    }

    /// Asks the source for `seqs` of `version` again (all of it when empty). `failed`: what
    /// it sent failed verification (counted against [`Bounds::max_refetches`] for this source
    /// and version, over all its connections); else parts of it were lost on the way (a
    /// stripe cut short), which says nothing against the source.
    fn refetch(&mut self, now: Instant, version: u64, seqs: Vec<u32>, failed: bool) {
        // Only on a subscription: a connection still being made streams every version after
        // what is done once it subscribes.
        let Link::Up {
            conn,
            source,
            asked,
            ..
        } = self.link
        else {
            return;
        };
        if failed {
            let n = self.retries.entry((source, version)).or_default();
            *n += 1;
            let attempts = *n;
            if let Some(b) = self.cfg.bounds
                && attempts > b.max_refetches
            {
                // This source keeps sending what does not verify: it is dropped, and starts
                // afresh once it is used again.
                self.retries.remove(&(source, version));
                return self.misbehaved(
                    now,
                    Misbehaviour::KeepsFailing {
                        version,
                        attempts: b.max_refetches,
                    },
                );
            }
        }
        if asked.is_none()
            && let Link::Up { asked, .. } = &mut self.link
        {
            *asked = Some(now);
        }
        self.out.push_back(Action::Send {
            conn,
            message: Message::Fetch { version, seqs },
        });
    }

    fn activated(&mut self, version: u64) {
        if self.activating != Some(version) {
            return;
        }
        self.activating = None;
        self.pending.remove(&version);
        self.commits.remove(&version);
        self.retries.retain(|&(_, v), _| v > version);
        self.active = version;
        self.policy.activated();
        if let Link::Up { anchor_asked, .. } = &mut self.link {
            *anchor_asked = None;
        }
        self.commits.retain(|&v| v > version);
        // Versions at or below the active one will not be needed again.
        let stale: Vec<u64> = self.pending.range(..=version).map(|(&v, _)| v).collect();
        for v in stale {
            self.forget(v);
        }
        // The next version becomes the one staged on arrival: what was buffered of it is
        // staged now, in the order it came.
        let next = version + 1;
        if let Some(p) = self.pending.get_mut(&next)
            && let Stage::Buffering(frames) = std::mem::replace(&mut p.stage, Stage::Staging)
        {
            #[cfg(test)]
            {
                p.from_buffer = true;
            }
            self.out.push_back(Action::Begin {
                version: next,
                base: p.reception.base,
                delta_id: p.reception.delta_id,
            });
            for frame in frames {
                self.out.push_back(Action::Stage {
                    version: next,
                    frame,
                });
            }
            if p.reception.complete() && !p.said_received {
                p.said_received = true;
                self.out
                    .push_back(Action::Notice(Notice::Received { version: next }));
            }
        }
    }

    /// Asks the shell to restore the anchor offered once no activation is under way (an
    /// anchor replaces the active version too: the two never overlap, and no activation
    /// starts while a restore is under way, see [`activate_ready`](Self::activate_ready)).
    fn restore_ready(&mut self) {
        if self.activating.is_some() {
            return;
        }
        if let Link::Up { conn, offered, .. } = &mut self.link
            && let Some(version) = offered.take()
        {
            let conn = *conn;
            self.out.push_back(Action::RestoreAnchor { conn, version });
        }
    }

    /// The source sent no frame for [`REQUEST_PATIENCE`] after it was asked for (part of) a
    /// version: it is left as lost (what is here of the versions stays), and the next source
    /// is tried.
    fn unanswered(&mut self, now: Instant) {
        let Link::Up { conn, source, .. } = self.link else {
            return;
        };
        self.out.push_back(Action::Notice(Notice::Unanswered {
            source,
            waited: REQUEST_PATIENCE,
        }));
        self.out.push_back(Action::Disconnect { conn });
        self.link = Link::Down { retry_at: now };
        if let Err(e) = self.policy.lost(source) {
            self.give_up(e);
        }
    }

    /// Asks the shell to activate the next version once it is whole, staged and committed
    /// (one at a time, in order, never while an anchor is being restored).
    fn activate_ready(&mut self) {
        let restoring = matches!(
            self.link,
            Link::Up {
                restoring: true,
                ..
            }
        );
        if self.activating.is_some() || self.is_stopped() || restoring {
            return;
        }
        let next = self.active + 1;
        let Some(p) = self.pending.get(&next) else {
            return;
        };
        if self.commits.contains(&next)
            && p.reception.complete()
            && matches!(p.stage, Stage::Staging)
        {
            self.activating = Some(next);
            self.out.push_back(Action::Activate {
                version: next,
                started: p.reception.started,
            });
        }
    }

    fn give_up(&mut self, e: GaveUp) {
        if let Some(conn) = self.connection() {
            self.out.push_back(Action::Disconnect { conn });
        }
        self.link = Link::Stopped;
        self.out.push_back(Action::GiveUp(e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: [u8; 32] = [7; 32];
    /// Version 1 has this many segments; a frame carries its segment number (the manifest
    /// [`MANIFEST`]).
    const SEGMENTS: u32 = 3;
    const MANIFEST: u32 = 99;

    fn actor(now: Instant, sources: usize) -> Follower<u32> {
        Follower::new(
            FollowConfig::actor(Bounds::for_model(1 << 20)),
            SourcePolicy::new(PolicyConfig::actor(), sources),
            0,
            now,
        )
    }

    fn drain(c: &mut Follower<u32>) -> Vec<Action<u32>> {
        std::iter::from_fn(|| c.poll_action()).collect()
    }

    /// Connects to the next source (which holds version 1).
    fn connect(c: &mut Follower<u32>, now: Instant) -> ConnId {
        c.handle_timeout(now);
        let conn = c.connection().expect("a source to connect to");
        c.handle(now, Event::Connected { conn, latest: 1 });
        drain(c);
        conn
    }

    /// Transmission `tx` of version 1 on one stripe: `frames` in order, then its end.
    fn transmit(c: &mut Follower<u32>, now: Instant, conn: ConnId, tx: u32, frames: &[u32]) {
        transmit_version(c, now, conn, 1, tx, frames);
    }

    /// Transmission `tx` of `version` (of [`SEGMENTS`] segments, like version 1) on one stripe.
    fn transmit_version(
        c: &mut Follower<u32>,
        now: Instant,
        conn: ConnId,
        version: u64,
        tx: u32,
        frames: &[u32],
    ) {
        c.handle(
            now,
            Event::StreamStarted {
                conn,
                version,
                base: version - 1,
                delta_id: ID,
                transmission: tx,
                stripes: 1,
            },
        );
        for &f in frames {
            let info = if f == MANIFEST {
                FrameInfo::Manifest {
                    segments: SEGMENTS as usize,
                }
            } else {
                FrameInfo::Segment { seq: f }
            };
            c.handle(
                now,
                Event::Frame {
                    conn,
                    version,
                    delta_id: ID,
                    transmission: tx,
                    info,
                    bytes: 100,
                    frame: f,
                },
            );
        }
        c.handle(
            now,
            Event::StreamEnded {
                conn,
                version,
                delta_id: ID,
                transmission: tx,
                stripes: 1,
            },
        );
    }

    fn fetched_whole(actions: &[Action<u32>]) -> bool {
        actions.iter().any(|a| {
            matches!(a, Action::Send { message: Message::Fetch { version: 1, seqs }, .. }
                if seqs.is_empty())
        })
    }

    fn dropped(actions: &[Action<u32>]) -> Option<(SourceId, Misbehaviour)> {
        actions.iter().find_map(|a| match a {
            Action::Notice(Notice::SourceDropped { source, why }) => Some((*source, *why)),
            _ => None,
        })
    }

    /// Version 1 comes whole and committed, and fails activation: what that queued.
    fn fails_activation(
        c: &mut Follower<u32>,
        now: Instant,
        conn: ConnId,
        tx: u32,
    ) -> Vec<Action<u32>> {
        transmit(c, now, conn, tx, &[0, 1, 2, MANIFEST]);
        c.handle(now, Event::Commit { conn, version: 1 });
        let a = drain(c);
        assert!(
            a.iter()
                .any(|a| matches!(a, Action::Activate { version: 1, .. })),
            "{a:?}"
        );
        c.handle(now, Event::ActivationFailed { version: 1 });
        drain(c)
    }

    /// A segment numbered beyond what the manifest names (before or after the manifest) is
    /// never staged for good: the version starts over as failed, and a source that keeps
    /// sending one is dropped after `max_refetches` refetches instead of being asked for the
    /// version forever.
    #[test]
    fn a_segment_beyond_the_manifest_fails_the_version_from_its_source() {
        let max = Bounds::for_model(1 << 20).max_refetches;
        for frames in [[0, 1, 2, MANIFEST, SEGMENTS], [0, SEGMENTS, 1, 2, MANIFEST]] {
            let now = Instant::now();
            let mut c = actor(now, 2);
            let conn = connect(&mut c, now);
            for tx in 0..=max {
                transmit(&mut c, now, conn, tx, &frames);
                let a = drain(&mut c);
                // The manifest first: the frame beyond is not even staged (else what was
                // staged is discarded).
                let staged_beyond = a
                    .iter()
                    .any(|a| matches!(a, Action::Stage { frame, .. } if *frame == SEGMENTS));
                assert_eq!(staged_beyond, frames[3] != MANIFEST, "{frames:?}: {a:?}");
                if tx < max {
                    assert!(fetched_whole(&a), "{frames:?} tx {tx}: {a:?}");
                    assert!(
                        a.iter()
                            .any(|a| matches!(a, Action::Discard { version: 1 })),
                        "{frames:?} tx {tx}: {a:?}"
                    );
                    assert_eq!(dropped(&a), None, "{frames:?} tx {tx}");
                } else {
                    assert_eq!(
                        dropped(&a),
                        Some((
                            SourceId(0),
                            Misbehaviour::KeepsFailing {
                                version: 1,
                                attempts: max
                            }
                        )),
                        "{frames:?}: {a:?}"
                    );
                }
            }
            // The next source sends it whole: it activates.
            let conn = connect(&mut c, now);
            assert_eq!(c.source(), Some(SourceId(1)));
            transmit(&mut c, now, conn, 0, &[0, 1, 2, MANIFEST]);
            c.handle(now, Event::Commit { conn, version: 1 });
            let a = drain(&mut c);
            assert!(
                a.iter()
                    .any(|a| matches!(a, Action::Activate { version: 1, .. })),
                "{a:?}"
            );
        }
    }

    /// The manifest first, then a segment beyond it: that frame is not staged.
    #[test]
    fn a_segment_beyond_a_manifest_here_is_not_staged() {
        let now = Instant::now();
        let mut c = actor(now, 1);
        let conn = connect(&mut c, now);
        transmit(&mut c, now, conn, 0, &[MANIFEST, 0, SEGMENTS + 4]);
        let a = drain(&mut c);
        let staged: Vec<u32> = a
            .iter()
            .filter_map(|a| match a {
                Action::Stage { frame, .. } => Some(*frame),
                _ => None,
            })
            .collect();
        assert_eq!(staged, vec![MANIFEST, 0], "{a:?}");
        assert!(fetched_whole(&a), "{a:?}");
    }

    /// Frames handed over one after another can be taken together (`poll_stage`), only
    /// for the version asked about: the actions come out in the same order as one by one.
    #[test]
    fn frames_taken_together_keep_the_order_of_the_actions() {
        let now = Instant::now();
        let (mut one, mut batched) = (actor(now, 1), actor(now, 1));
        for c in [&mut one, &mut batched] {
            let conn = connect(c, now);
            transmit(c, now, conn, 0, &[2, 0, 1, MANIFEST]);
        }
        let singly = drain(&mut one);
        let mut together = Vec::new();
        let mut largest = 0;
        while let Some(a) = batched.poll_action() {
            let Action::Stage { version, frame } = a else {
                together.push(a);
                continue;
            };
            assert_eq!(
                batched.poll_stage(version + 1),
                None,
                "another version's frame"
            );
            let mut frames = vec![frame];
            frames.extend(std::iter::from_fn(|| batched.poll_stage(version)));
            largest = largest.max(frames.len());
            together.extend(
                frames
                    .into_iter()
                    .map(|frame| Action::Stage { version, frame }),
            );
        }
        assert_eq!(format!("{together:?}"), format!("{singly:?}"));
        assert_eq!(largest, 4, "{singly:?}");
    }

    /// Frames handed over before an event that restarted their version (here a segment beyond
    /// the manifest, heard before the shell staged them) fail in the shell: that failure is
    /// the earlier attempt's, and changes nothing the core queued for the new one.
    #[test]
    fn a_staging_failure_from_before_a_restart_is_not_counted_again() {
        let now = Instant::now();
        let (mut ok, mut failed) = (actor(now, 1), actor(now, 1));
        for c in [&mut ok, &mut failed] {
            let conn = connect(c, now);
            transmit(c, now, conn, 0, &[MANIFEST, 0, SEGMENTS + 4]);
        }
        let mut before = Vec::new();
        let (version, first) = loop {
            match failed.poll_action() {
                Some(Action::Stage { version, frame }) => break (version, frame),
                Some(a) => before.push(a),
                None => panic!("nothing staged: {before:?}"),
            }
        };
        let mut batch = vec![first];
        batch.extend(std::iter::from_fn(|| failed.poll_stage(version)));
        assert_eq!(batch, vec![MANIFEST, 0]);
        failed.handle(now, Event::StageFailed { version });
        let after_failure = drain(&mut failed);
        assert!(
            after_failure
                .iter()
                .any(|a| matches!(a, Action::Begin { version: 1, .. })),
            "{after_failure:?}"
        );
        let all_ok = drain(&mut ok);
        let after_ok = &all_ok[before.len() + batch.len()..];
        assert_eq!(format!("{after_failure:?}"), format!("{after_ok:?}"));
    }

    /// A segment beyond the manifest's count that came from a source before is not held against
    /// the source whose manifest shows it.
    #[test]
    fn a_segment_beyond_from_an_earlier_source_is_not_held_against_the_next() {
        let max = Bounds::for_model(1 << 20).max_refetches;
        let now = Instant::now();
        let mut c = actor(now, 2);
        let conn = connect(&mut c, now);
        transmit(&mut c, now, conn, 0, &[0, SEGMENTS]);
        c.handle(now, Event::Lost { conn });
        drain(&mut c);
        let conn = connect(&mut c, now);
        assert_eq!(c.source(), Some(SourceId(1)));
        transmit(&mut c, now, conn, 0, &[1, 2, MANIFEST]);
        let a = drain(&mut c);
        assert!(fetched_whole(&a), "{a:?}");
        // Source 1 still has every one of its refetches.
        for tx in 1..=max {
            let a = fails_activation(&mut c, now, conn, tx);
            assert_eq!(dropped(&a), None, "failure {tx}: {a:?}");
        }
        let a = fails_activation(&mut c, now, conn, max + 1);
        assert!(matches!(dropped(&a), Some((SourceId(1), _))), "{a:?}");
    }

    /// Failed verifications from one source are not held against the next: each source
    /// gets `max_refetches` refetches of a version.
    #[test]
    fn failed_verifications_count_per_source() {
        let max = Bounds::for_model(1 << 20).max_refetches;
        let now = Instant::now();
        let mut c = actor(now, 2);
        let conn = connect(&mut c, now);
        for tx in 0..max - 1 {
            let a = fails_activation(&mut c, now, conn, tx);
            assert_eq!(dropped(&a), None, "{a:?}");
        }
        c.handle(now, Event::Lost { conn });
        drain(&mut c);
        let conn = connect(&mut c, now);
        assert_eq!(c.source(), Some(SourceId(1)));
        for tx in 0..max {
            let a = fails_activation(&mut c, now, conn, tx);
            assert_eq!(dropped(&a), None, "source 1's failure {}: {a:?}", tx + 1);
            assert!(fetched_whole(&a), "{a:?}");
        }
        let a = fails_activation(&mut c, now, conn, max);
        assert_eq!(
            dropped(&a),
            Some((
                SourceId(1),
                Misbehaviour::KeepsFailing {
                    version: 1,
                    attempts: max
                }
            )),
            "{a:?}"
        );
    }

    /// A source's failures count over all its connections: losing it does not start its
    /// count afresh.
    #[test]
    fn a_sources_failures_count_over_its_connections() {
        let max = Bounds::for_model(1 << 20).max_refetches;
        let now = Instant::now();
        let mut c = actor(now, 2);
        let conn = connect(&mut c, now);
        for tx in 0..max {
            fails_activation(&mut c, now, conn, tx);
        }
        c.handle(now, Event::Lost { conn });
        let conn = connect(&mut c, now);
        assert_eq!(c.source(), Some(SourceId(1)));
        c.handle(now, Event::Lost { conn });
        let conn = connect(&mut c, now);
        assert_eq!(c.source(), Some(SourceId(0)));
        let a = fails_activation(&mut c, now, conn, 0);
        assert!(matches!(dropped(&a), Some((SourceId(0), _))), "{a:?}");
    }
    fn started_anchor(actions: &[Action<u32>]) -> Option<u64> {
        actions.iter().find_map(|a| match a {
            Action::RestoreAnchor { version, .. } => Some(*version),
            _ => None,
        })
    }

    fn activates(actions: &[Action<u32>]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Activate { version, .. } => Some(*version),
                _ => None,
            })
            .collect()
    }

    /// An anchor offered while a version activates is restored once the activation ended,
    /// and nothing activates while it is restored: both replace the active version (seeds
    /// 24447, 69772, 71724 and 115375 had the shell activate versions under a restore, and
    /// come out at the older one).
    #[test]
    fn an_anchor_and_an_activation_never_overlap() {
        let now = Instant::now();
        let mut c = actor(now, 1);
        let conn = connect(&mut c, now);
        // Versions 1 and 2 whole and committed: 1 activates, 2 waits for it.
        transmit_version(&mut c, now, conn, 1, 0, &[0, 1, 2, MANIFEST]);
        transmit_version(&mut c, now, conn, 2, 1, &[0, 1, 2, MANIFEST]);
        c.handle(now, Event::Commit { conn, version: 1 });
        c.handle(now, Event::Commit { conn, version: 2 });
        assert_eq!(activates(&drain(&mut c)), [1]);
        c.handle(now, Event::AnchorOffered { conn, version: 8 });
        let a = drain(&mut c);
        assert_eq!(started_anchor(&a), None, "1 still activates: {a:?}");
        c.handle(now, Event::Activated { version: 1 });
        let a = drain(&mut c);
        assert_eq!(started_anchor(&a), Some(8), "{a:?}");
        assert_eq!(
            activates(&a),
            [] as [u64; 0],
            "2 waits for the anchor: {a:?}"
        );
        c.handle(now, Event::AnchorRestored { conn, version: 8 });
        let a = drain(&mut c);
        assert_eq!(c.active(), 8);
        assert_eq!(activates(&a), [] as [u64; 0], "{a:?}");
    }

    /// A source that sends nothing after it was asked for a version is left as lost after
    /// [`REQUEST_PATIENCE`], for the next source; one that answers is not (seed 10420: a
    /// hostile relay that cut its own flood short under the bound and ignored every `Fetch`
    /// held an actor forever).
    #[test]
    fn a_source_that_does_not_answer_a_fetch_is_left() {
        let now = Instant::now();
        let mut c = actor(now, 2);
        let conn = connect(&mut c, now);
        // Two segments, the stripe ends: the rest is asked for.
        transmit(&mut c, now, conn, 0, &[0, 1]);
        assert!(fetched_whole(&drain(&mut c)));
        assert_eq!(c.poll_timeout(), Some(now + REQUEST_PATIENCE));
        // It answers (a frame comes): it stays past the patience since the first request;
        // its stripe ends without the manifest, which is asked for in turn.
        let later = now + REQUEST_PATIENCE / 2;
        transmit(&mut c, later, conn, 1, &[2]);
        drain(&mut c);
        c.handle_timeout(now + REQUEST_PATIENCE);
        assert_eq!(c.connection(), Some(conn));
        // Nothing more comes: it is left, and the next source is tried.
        let asked = c.poll_timeout().expect("a request outstanding");
        assert_eq!(asked, later + REQUEST_PATIENCE);
        c.handle_timeout(asked - Duration::from_millis(1));
        assert_eq!(c.connection(), Some(conn), "not yet");
        c.handle_timeout(asked);
        let a = drain(&mut c);
        assert!(
            a.iter().any(|a| matches!(
                a,
                Action::Notice(Notice::Unanswered {
                    source: SourceId(0),
                    ..
                })
            )),
            "{a:?}"
        );
        assert!(
            a.iter()
                .any(|a| matches!(a, Action::Disconnect { conn: c } if *c == conn)),
            "{a:?}"
        );
        c.handle_timeout(asked);
        assert_eq!(c.source(), Some(SourceId(1)), "{a:?}");
    }

    /// A refusal that comes once the receiver is past where its subscription started (versions
    /// that were here already became active meanwhile) subscribes afresh to the same source
    /// after what is active, instead of asking for an anchor it does not need (seeds 10008
    /// and 97450: no newer anchor there, the actor left a relay holding every version it
    /// needed, for the hub).
    #[test]
    fn a_refusal_of_what_is_no_longer_needed_subscribes_afresh() {
        let now = Instant::now();
        let mut c = actor(now, 2);
        let conn = connect(&mut c, now);
        transmit_version(&mut c, now, conn, 1, 0, &[0, 1, 2, MANIFEST]);
        transmit_version(&mut c, now, conn, 2, 1, &[0, 1, 2, MANIFEST]);
        c.handle(now, Event::Commit { conn, version: 1 });
        c.handle(now, Event::Commit { conn, version: 2 });
        assert_eq!(activates(&drain(&mut c)), [1]);
        c.handle(now, Event::Lost { conn });
        drain(&mut c);
        // The next source, subscribed after 1 (being activated), while 2 is here.
        let conn = connect(&mut c, now);
        assert_eq!(c.source(), Some(SourceId(1)));
        c.handle(now, Event::Activated { version: 1 });
        assert_eq!(activates(&drain(&mut c)), [2]);
        c.handle(
            now,
            Event::Refused {
                conn,
                reason: RefuseReason::VersionUnavailable,
            },
        );
        c.handle_timeout(now);
        let a = drain(&mut c);
        assert!(
            !a.iter().any(|a| matches!(
                a,
                Action::Send {
                    message: Message::FetchAnchor { .. },
                    ..
                }
            )),
            "{a:?}"
        );
        assert!(
            a.iter().any(|a| matches!(
                a,
                Action::Connect {
                    source: SourceId(1),
                    ..
                }
            )),
            "{a:?}"
        );
        // Refused again after the new subscription: now it asks for an anchor.
        let conn = c.connection().expect("connecting");
        c.handle(now, Event::Connected { conn, latest: 2 });
        drain(&mut c);
        c.handle(
            now,
            Event::Refused {
                conn,
                reason: RefuseReason::VersionUnavailable,
            },
        );
        let a = drain(&mut c);
        assert!(
            a.iter().any(|a| matches!(
                a,
                Action::Send {
                    message: Message::FetchAnchor { after_version: 2 },
                    ..
                }
            )),
            "{a:?}"
        );
    }

    fn connects_to(actions: &[Action<u32>]) -> Vec<SourceId> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Connect { source, .. } => Some(*source),
                _ => None,
            })
            .collect()
    }

    /// `conn`'s subscription refused for connections at `now`, and its connection closed by
    /// the server: what the core does about it.
    fn crowded_out(c: &mut Follower<u32>, now: Instant, conn: ConnId) -> Vec<Action<u32>> {
        c.handle(
            now,
            Event::Refused {
                conn,
                reason: RefuseReason::TooManyConnections,
            },
        );
        c.handle(now, Event::Lost { conn });
        c.handle_timeout(now);
        drain(c)
    }

    /// A relay that refuses an actor's subscription because the actor's certificate still
    /// holds its bound of subscriptions there (connections of the actor's earlier
    /// incarnations, not yet seen to end) is asked again after 1, 2, 2, … s, not left for the
    /// hub: the refusal is over as soon as one of those connections times out. Only once it
    /// has refused for `CROWDED_PATIENCE` in a row is it left, as a lost source is, and not
    /// returned to by a probe for the quarantine (a probe gets a `Welcome` from it).
    #[test]
    fn a_source_refusing_for_connections_is_asked_again_before_it_is_left() {
        let start = Instant::now();
        let mut c = actor(start, 2);
        let conn = connect(&mut c, start);
        assert_eq!(c.source(), Some(SourceId(0)));
        let a = crowded_out(&mut c, start, conn);
        assert!(
            a.iter()
                .any(|a| matches!(a, Action::Disconnect { conn: d } if *d == conn)),
            "the refused connection is left: {a:?}"
        );
        assert_eq!(connects_to(&a), [], "no other source: {a:?}");
        assert_eq!(c.source(), None);
        let mut retries = Vec::new();
        loop {
            let at = c.poll_timeout().expect("a retry is due");
            c.handle_timeout(at - Duration::from_millis(1));
            assert_eq!(connects_to(&drain(&mut c)), [], "not before its time");
            c.handle_timeout(at);
            let a = drain(&mut c);
            assert_eq!(
                connects_to(&a),
                [SourceId(0)],
                "the same source again: {a:?}"
            );
            retries.push((at - start).as_millis());
            let conn = c.connection().expect("connecting");
            c.handle(at, Event::Connected { conn, latest: 1 });
            drain(&mut c);
            let a = crowded_out(&mut c, at, conn);
            let left = a.iter().find_map(|a| match a {
                Action::Notice(Notice::Crowded { source, waited }) => Some((*source, *waited)),
                _ => None,
            });
            if at - start >= CROWDED_PATIENCE {
                // It refused through the whole patience: the hub, at once.
                assert_eq!(left, Some((SourceId(0), CROWDED_PATIENCE)), "{a:?}");
                assert_eq!(connects_to(&a), [SourceId(1)], "{a:?}");
                break;
            }
            assert_eq!(left, None, "{a:?}");
            assert_eq!(connects_to(&a), [], "{a:?}");
        }
        assert_eq!(retries, [1000, 3000, 5000, 7000, 9000, 10000]);
        // On the hub, the relay is not probed before the quarantine is over.
        let conn = c.connection().expect("connecting to the hub");
        let on_hub = start + CROWDED_PATIENCE;
        c.handle(on_hub, Event::Connected { conn, latest: 1 });
        drain(&mut c);
        let quarantine = PolicyConfig::actor().quarantine;
        assert_eq!(c.poll_timeout(), Some(on_hub + quarantine));
    }

    /// Every other refusal of a subscription is handled as before: the connection's end that
    /// follows leaves the source, for the next one at once.
    #[test]
    fn other_refusals_of_a_subscription_leave_the_source_as_before() {
        let now = Instant::now();
        let mut c = actor(now, 2);
        let conn = connect(&mut c, now);
        c.handle(
            now,
            Event::Refused {
                conn,
                reason: RefuseReason::RateLimited,
            },
        );
        assert!(drain(&mut c).is_empty());
        assert_eq!(c.connection(), Some(conn), "still the connection followed");
        c.handle(now, Event::Lost { conn });
        c.handle_timeout(now);
        assert_eq!(connects_to(&drain(&mut c)), [SourceId(1)]);
    }

    /// The stripes of a run of versions overtake each other: a version announced up to
    /// `max_ahead` past the newest one announced is the run going on, one further is a jump
    /// (seeds 83353 and 173895: an honest relay streaming a run was dropped as too far ahead).
    #[test]
    fn a_run_announced_out_of_order_is_not_a_jump() {
        let max_ahead = Bounds::for_model(1 << 20).max_ahead;
        let now = Instant::now();
        let started = |c: &mut Follower<u32>, conn, version| {
            c.handle(
                now,
                Event::StreamStarted {
                    conn,
                    version,
                    base: version - 1,
                    delta_id: ID,
                    transmission: version as u32,
                    stripes: 2,
                },
            );
            drain(c)
        };
        let mut c = actor(now, 2);
        let conn = connect(&mut c, now);
        for v in 1..=max_ahead - 1 {
            started(&mut c, conn, v);
        }
        // Past `max_ahead` ahead of the active 0, before the one before it.
        let a = started(&mut c, conn, max_ahead + 1);
        assert_eq!(dropped(&a), None, "{a:?}");
        let a = started(&mut c, conn, max_ahead);
        assert_eq!(dropped(&a), None, "{a:?}");
        let a = started(&mut c, conn, 2 * max_ahead + 2);
        assert!(
            matches!(
                dropped(&a),
                Some((SourceId(0), Misbehaviour::TooFarAhead { .. }))
            ),
            "{a:?}"
        );
    }
}
