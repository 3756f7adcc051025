//! The hub's run board: what it has seen happen since it started, for `/v1/status`, the
//! event stream and the dashboard (`docs/observability.md`).
//!
//! The ledger holds what must survive a restart (versions, actors, batches, jobs, τ); the
//! board holds what only matters to someone watching: when each relay and actor got each
//! version, the transfer on its way to each relay, per-actor result counts, reward and
//! throughput per finished batch, and recent faults. Every list is bounded, so the board's
//! memory and a status response stay small however long the run and however many peers.
//!
//! Recording never blocks and never fails: a short critical section under a `std` mutex, and
//! each change is also sent to the event stream through a bounded broadcast channel, where a
//! slow subscriber loses events (it is told how many) instead of holding anyone up.
//! Every record takes its time from the caller (`crate::clock::now_ms`), except the transport's
//! observer callbacks, which read that clock themselves; tests pass times explicitly.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use starling_transport::fanout::SubscriberObserver;
use starling_transport::link::LinkProfile;
use tokio::sync::broadcast;

use crate::clock::now_ms;

/// Versions whose propagation is kept.
pub(crate) const MAX_VERSIONS: usize = 32;
/// Finished batches kept as steps.
pub(crate) const MAX_STEPS: usize = 500;
/// Faults kept.
pub(crate) const MAX_FAULTS: usize = 100;
/// Batches whose in-memory totals are kept (results may still arrive for older ones).
const MAX_BATCHES: usize = 64;
/// Peers and actors tracked; later names are not tracked (they still work, unseen here).
const MAX_PEERS: usize = 4096;
/// Events buffered per subscriber of the stream.
pub(crate) const EVENT_QUEUE: usize = 1024;
/// Least time between two `transfer` events for one peer.
const TRANSFER_EVENT_MS: u64 = 250;

/// One change, as the event stream sends it (`docs/observability.md`): an SSE event name
/// ([`Event::name`]) and its data, the variant's fields as one JSON object with `at_ms`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub(crate) enum Event {
    Published {
        version: u64,
        bytes: u64,
        changes: u64,
        ratio: Option<f64>,
        at_ms: u64,
    },
    /// Bytes sent so far of the version on its way to `peer`.
    Transfer {
        peer: String,
        version: u64,
        bytes: u64,
        at_ms: u64,
    },
    Staged(Report),
    Active(Report),
    Connected(Presence),
    Disconnected(Presence),
    Batch(BatchChange),
    Step(StepEvent),
    Fault(Fault),
}

impl Event {
    /// The SSE event name.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Event::Published { .. } => "published",
            Event::Transfer { .. } => "transfer",
            Event::Staged(_) => "staged",
            Event::Active(_) => "active",
            Event::Connected(_) => "connected",
            Event::Disconnected(_) => "disconnected",
            Event::Batch(_) => "batch",
            Event::Step(_) => "step",
            Event::Fault(_) => "fault",
        }
    }
}

/// A peer reported a version staged or active.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Report {
    pub(crate) peer: String,
    pub(crate) version: u64,
    pub(crate) at_ms: u64,
}

impl Report {
    fn new(peer: &str, version: u64, at_ms: u64) -> Self {
        Report {
            peer: peer.to_owned(),
            version,
            at_ms,
        }
    }
}

/// What a subscriber reported of a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Verified and held, ready to activate.
    Staged,
    /// Generating with it.
    Active,
}

/// A relay, an actor's subscription or an actor's rollout worker connected or went away.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Presence {
    pub(crate) peer: String,
    pub(crate) role: ConnectionRole,
    pub(crate) region: String,
    pub(crate) at_ms: u64,
}

/// Which of a peer's connections a [`Presence`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ConnectionRole {
    /// A relay's subscription.
    Relay,
    /// An actor's subscription to the hub.
    Actor,
    /// An actor's rollout worker (the job connection).
    Worker,
}

impl From<PeerRole> for ConnectionRole {
    fn from(r: PeerRole) -> Self {
        match r {
            PeerRole::Relay => ConnectionRole::Relay,
            PeerRole::Actor => ConnectionRole::Actor,
        }
    }
}

/// A batch posted (`version`, `size`), scheduled (`version`, `actors`) or finished (`id` and
/// `done` only): a field a change does not know is left out, not `null`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct BatchChange {
    pub(crate) id: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) version: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) actors: Option<usize>,
    pub(crate) done: bool,
    pub(crate) at_ms: u64,
}

/// The `step` event: the [`Step`] with the time it was sent.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct StepEvent {
    #[serde(flatten)]
    pub(crate) step: Step,
    pub(crate) at_ms: u64,
}

/// One finished batch: `steps` in the status, and the `step` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Step {
    pub(crate) batch: i64,
    pub(crate) version: u64,
    /// Accepted groups.
    pub(crate) groups: u64,
    /// Groups posted.
    pub(crate) size: u32,
    pub(crate) samples: u64,
    /// Of the accepted samples; `None` without any.
    pub(crate) mean_reward: Option<f64>,
    pub(crate) tokens: u64,
    /// From posting to the last accepted result.
    pub(crate) seconds: f64,
    pub(crate) tokens_per_s: Option<f64>,
    pub(crate) done_at_ms: u64,
}

/// One recent fault: `faults` in the status, and the `fault` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Fault {
    pub(crate) at_ms: u64,
    pub(crate) kind: FaultKind,
    pub(crate) peer: Option<String>,
    pub(crate) version: Option<u64>,
    /// At most 512 bytes and an ellipsis.
    pub(crate) detail: String,
}

/// What went wrong (`docs/observability.md` describes each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FaultKind {
    /// A peer's connection ended with an error.
    Disconnect,
    /// A receiver asked for segments again.
    Refetch,
    /// A result refused.
    Refused,
    /// A result whose weight digest is not its version's.
    Fenced,
    LeaseExpired,
    PublishFailed,
    AnchorFailed,
    /// A group's reward service failed every try.
    RewardService,
}

/// One version and its propagation: an entry of `versions` in the status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct VersionView {
    pub(crate) version: u64,
    pub(crate) base: u64,
    pub(crate) first_segment_at_ms: Option<u64>,
    pub(crate) published_at_ms: u64,
    pub(crate) bytes: u64,
    pub(crate) changes: u64,
    pub(crate) ratio: Option<f64>,
    pub(crate) step: Option<u64>,
    pub(crate) encode_ms: u64,
    pub(crate) regions: Vec<RegionPropagation>,
    pub(crate) actors: Vec<ActorPropagation>,
}

/// A version in one region: its relay's times and its actors'.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RegionPropagation {
    pub(crate) region: String,
    pub(crate) relay: Option<String>,
    pub(crate) relay_sent_at_ms: Option<u64>,
    pub(crate) relay_staged_at_ms: Option<u64>,
    /// Actors in the region.
    pub(crate) actors: usize,
    pub(crate) actors_active: usize,
    pub(crate) first_active_at_ms: Option<u64>,
    /// Once every actor of the region has activated it.
    pub(crate) all_active_at_ms: Option<u64>,
}

/// A version at one actor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ActorPropagation {
    pub(crate) actor: String,
    pub(crate) region: String,
    pub(crate) staged_at_ms: Option<u64>,
    pub(crate) active_at_ms: Option<u64>,
}

/// What a subscriber of the hub is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PeerRole {
    Relay,
    Actor,
}

impl PeerRole {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PeerRole::Relay => "relay",
            PeerRole::Actor => "actor",
        }
    }
}

#[derive(Debug)]
pub(crate) struct Board {
    started_at_ms: u64,
    events: broadcast::Sender<Event>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    versions: BTreeMap<u64, VersionTrack>,
    peers: BTreeMap<String, PeerTrack>,
    actors: BTreeMap<String, ActorTrack>,
    batches: BTreeMap<i64, BatchTrack>,
    steps: VecDeque<Step>,
    faults: VecDeque<Fault>,
    /// Actors that reported a version staged before the hub recorded it (with cut-through an
    /// actor can hold the whole delta before the hub's file is durable): version → actor →
    /// when. Applied when the version is published; only versions above the newest are kept.
    early_staged: BTreeMap<u64, BTreeMap<String, u64>>,
    /// The same for relays that reported a version verified and cached before it was
    /// recorded, and for the moment the encoder emitted a version's first segment.
    early_relay_staged: BTreeMap<u64, BTreeMap<String, u64>>,
    early_first_segment: BTreeMap<u64, u64>,
}

#[derive(Debug, Default)]
struct VersionTrack {
    base: u64,
    /// When the encoder emitted the version's first segment (cut-through sends it then).
    first_segment_at_ms: Option<u64>,
    published_at_ms: u64,
    bytes: u64,
    changes: u64,
    step: Option<u64>,
    encode_ms: u64,
    /// Relay name → when the hub finished sending the version to it.
    relay_sent: BTreeMap<String, u64>,
    /// Relay name → when it reported the version verified and cached.
    relay_staged: BTreeMap<String, u64>,
    /// Actor name → when it was first seen staged, then active.
    actor_staged: BTreeMap<String, u64>,
    actor_active: BTreeMap<String, u64>,
}

#[derive(Debug)]
struct PeerTrack {
    role: PeerRole,
    region: String,
    connected: bool,
    since_ms: u64,
    link: Option<LinkProfile>,
    bytes_sent: u64,
    /// Newest version it reported staged (relay) or active (actor subscribed to the hub).
    version: Option<u64>,
    transfer: Option<Transfer>,
    last_transfer_event_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Transfer {
    version: u64,
    bytes: u64,
    started_at_ms: u64,
    last_at_ms: u64,
    done: bool,
}

#[derive(Debug, Default)]
struct ActorTrack {
    region: String,
    engine: String,
    worker_connected: bool,
    /// Where its subscription is: `hub` when it subscribed here, else `relay` once its worker
    /// reports staged versions the hub did not send it.
    subscribed_here: bool,
    active: Option<u64>,
    staged: Option<u64>,
    accepted: u64,
    refused: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
struct BatchTrack {
    version: u64,
    size: u32,
    posted_at_ms: u64,
    groups: u64,
    samples: u64,
    reward_sum: f64,
    tokens: u64,
    last_result_ms: u64,
    finished: bool,
}

/// The per-actor part of the board, merged with the ledger's actor rows by `status`.
#[derive(Debug, Clone, Default)]
pub(crate) struct ActorView {
    pub(crate) engine: String,
    pub(crate) worker_connected: bool,
    pub(crate) source: Option<&'static str>,
    pub(crate) accepted: u64,
    pub(crate) refused: BTreeMap<String, u64>,
}

/// A relay as the board has seen it: an entry of a region's `relays` in the status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RelayView {
    /// Where the status lists it, not one of its fields.
    #[serde(skip)]
    pub(crate) region: String,
    pub(crate) name: String,
    pub(crate) connected: bool,
    pub(crate) since_ms: u64,
    pub(crate) link: Option<LinkView>,
    /// Newest version it reported staged.
    pub(crate) version: Option<u64>,
    pub(crate) bytes_sent: u64,
    pub(crate) transfer: Option<TransferView>,
}

/// The link a relay stated in its `Hello`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct LinkView {
    pub(crate) rate_mbit: f64,
    pub(crate) rtt_ms: f64,
}

/// The version now (or last) on its way to a relay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct TransferView {
    pub(crate) version: u64,
    /// Sent so far.
    pub(crate) bytes: u64,
    /// The delta's size, while the board still holds the version.
    pub(crate) of_bytes: Option<u64>,
    pub(crate) started_at_ms: u64,
    pub(crate) last_at_ms: u64,
    pub(crate) goodput_mbit: Option<f64>,
    pub(crate) done: bool,
}

impl Board {
    pub(crate) fn new(started_at_ms: u64) -> Self {
        let (events, _) = broadcast::channel(EVENT_QUEUE);
        Board {
            started_at_ms,
            events,
            state: Mutex::new(State::default()),
        }
    }

    pub(crate) fn started_at_ms(&self) -> u64 {
        self.started_at_ms
    }

    /// A new receiver of every event from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing panics while the lock is held, but a poisoned board is still a valid board.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn emit(&self, event: Event) {
        // No receivers is not an error: nobody is watching.
        let _ = self.events.send(event);
    }

    /// Records a fault and sends it to the stream.
    pub(crate) fn fault(
        &self,
        kind: FaultKind,
        peer: Option<&str>,
        version: Option<u64>,
        detail: &str,
        at_ms: u64,
    ) {
        let entry = Fault {
            at_ms,
            kind,
            peer: peer.map(str::to_owned),
            version,
            detail: bounded(detail),
        };
        {
            let mut s = self.state();
            s.faults.push_front(entry.clone());
            s.faults.truncate(MAX_FAULTS);
        }
        self.emit(Event::Fault(entry));
    }

    /// A version was published (its delta durable and recorded).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn published(
        &self,
        version: u64,
        base: u64,
        bytes: u64,
        changes: u64,
        step: Option<u64>,
        encode_ms: u64,
        checkpoint_bytes: u64,
        at_ms: u64,
    ) {
        {
            let mut s = self.state();
            let actor_staged = s.early_staged.remove(&version).unwrap_or_default();
            s.early_staged.retain(|&v, _| v > version);
            let relay_staged = s.early_relay_staged.remove(&version).unwrap_or_default();
            s.early_relay_staged.retain(|&v, _| v > version);
            let first_segment_at_ms = s.early_first_segment.remove(&version);
            s.early_first_segment.retain(|&v, _| v > version);
            s.versions.insert(
                version,
                VersionTrack {
                    base,
                    published_at_ms: at_ms,
                    bytes,
                    changes,
                    step,
                    encode_ms,
                    actor_staged,
                    relay_staged,
                    first_segment_at_ms,
                    ..VersionTrack::default()
                },
            );
            while s.versions.len() > MAX_VERSIONS {
                s.versions.pop_first();
            }
        }
        self.emit(Event::Published {
            version,
            bytes,
            changes,
            ratio: ratio(checkpoint_bytes, bytes),
            at_ms,
        });
    }

    /// The encoder emitted the first segment of `version` (before it is published).
    pub(crate) fn first_segment(&self, version: u64, at_ms: u64) {
        let mut s = self.state();
        if s.early_first_segment.len() < MAX_VERSIONS {
            s.early_first_segment.entry(version).or_insert(at_ms);
        }
    }

    /// A relay or an actor subscribed.
    pub(crate) fn peer_connected(
        &self,
        name: &str,
        role: PeerRole,
        region: &str,
        link: Option<LinkProfile>,
        at_ms: u64,
    ) {
        {
            let mut s = self.state();
            if s.peers.len() >= MAX_PEERS && !s.peers.contains_key(name) {
                return;
            }
            let p = s.peers.entry(name.to_owned()).or_insert(PeerTrack {
                role,
                region: region.to_owned(),
                connected: true,
                since_ms: at_ms,
                link,
                bytes_sent: 0,
                version: None,
                transfer: None,
                last_transfer_event_ms: None,
            });
            p.role = role;
            p.region = region.to_owned();
            p.connected = true;
            p.since_ms = at_ms;
            p.link = link.or(p.link);
            if role == PeerRole::Actor {
                let a = actor_entry(&mut s.actors, name);
                if let Some(a) = a {
                    a.subscribed_here = true;
                    a.region = region.to_owned();
                }
            }
        }
        self.emit(Event::Connected(Presence {
            peer: name.to_owned(),
            role: role.into(),
            region: region.to_owned(),
            at_ms,
        }));
    }

    /// A subscriber's connection ended; `error` says why, if it was not a clean close.
    pub(crate) fn peer_disconnected(&self, name: &str, error: Option<&str>, at_ms: u64) {
        let (role, region) = {
            let mut s = self.state();
            let Some(p) = s.peers.get_mut(name) else {
                return;
            };
            p.connected = false;
            p.since_ms = at_ms;
            let (role, region) = (p.role, p.region.clone());
            if role == PeerRole::Actor
                && let Some(a) = s.actors.get_mut(name)
            {
                a.subscribed_here = false;
            }
            (role, region)
        };
        self.emit(Event::Disconnected(Presence {
            peer: name.to_owned(),
            role: role.into(),
            region,
            at_ms,
        }));
        if let Some(e) = error {
            self.fault(FaultKind::Disconnect, Some(name), None, e, at_ms);
        }
    }

    /// An actor's rollout worker registered.
    pub(crate) fn worker_connected(&self, name: &str, region: &str, engine: &str, at_ms: u64) {
        {
            let mut s = self.state();
            if let Some(a) = actor_entry(&mut s.actors, name) {
                a.region = region.to_owned();
                a.engine = engine.to_owned();
                a.worker_connected = true;
            }
        }
        self.emit(Event::Connected(Presence {
            peer: name.to_owned(),
            role: ConnectionRole::Worker,
            region: region.to_owned(),
            at_ms,
        }));
    }

    /// An actor's rollout worker's connection ended.
    pub(crate) fn worker_disconnected(&self, name: &str, error: Option<&str>, at_ms: u64) {
        let region = {
            let mut s = self.state();
            let Some(a) = s.actors.get_mut(name) else {
                return;
            };
            a.worker_connected = false;
            a.region.clone()
        };
        self.emit(Event::Disconnected(Presence {
            peer: name.to_owned(),
            role: ConnectionRole::Worker,
            region,
            at_ms,
        }));
        if let Some(e) = error {
            self.fault(FaultKind::Disconnect, Some(name), None, e, at_ms);
        }
    }

    /// An actor's heartbeat: the version it generates with and the one it has staged.
    pub(crate) fn heartbeat(
        &self,
        name: &str,
        active: Option<u64>,
        staged: Option<u64>,
        at_ms: u64,
    ) {
        let mut newly = Vec::new();
        {
            let mut s = self.state();
            let State {
                actors,
                versions,
                early_staged,
                ..
            } = &mut *s;
            let Some(a) = actor_entry(actors, name) else {
                return;
            };
            a.active = active;
            a.staged = staged;
            let newest = versions.last_key_value().map_or(0, |(v, _)| *v);
            if let Some(v) = staged {
                if let Some(t) = versions.get_mut(&v) {
                    if !t.actor_staged.contains_key(name) {
                        t.actor_staged.insert(name.to_owned(), at_ms);
                        newly.push(Event::Staged(Report::new(name, v, at_ms)));
                    }
                } else if v > newest && early_staged.len() < MAX_VERSIONS {
                    early_staged
                        .entry(v)
                        .or_default()
                        .entry(name.to_owned())
                        .or_insert(at_ms);
                }
            }
            if let Some(v) = active
                && let Some(t) = versions.get_mut(&v)
                && !t.actor_active.contains_key(name)
            {
                t.actor_active.insert(name.to_owned(), at_ms);
                newly.push(Event::Active(Report::new(name, v, at_ms)));
            }
        }
        for e in newly {
            self.emit(e);
        }
    }

    /// A batch was posted.
    pub(crate) fn batch_posted(&self, id: i64, version: u64, size: u32, at_ms: u64) {
        {
            let mut s = self.state();
            s.batches.insert(
                id,
                BatchTrack {
                    version,
                    size,
                    posted_at_ms: at_ms,
                    ..BatchTrack::default()
                },
            );
            while s.batches.len() > MAX_BATCHES {
                s.batches.pop_first();
            }
        }
        self.emit(Event::Batch(BatchChange {
            id,
            version: Some(version),
            size: Some(size),
            actors: None,
            done: false,
            at_ms,
        }));
    }

    /// A batch was split over actors.
    pub(crate) fn batch_scheduled(&self, id: i64, version: u64, actors: usize, at_ms: u64) {
        self.emit(Event::Batch(BatchChange {
            id,
            version: Some(version),
            size: None,
            actors: Some(actors),
            done: false,
            at_ms,
        }));
    }

    /// An accepted group: its samples' rewards and its tokens.
    pub(crate) fn result_accepted(
        &self,
        actor: &str,
        batch: i64,
        rewards: &[f32],
        tokens: u64,
        at_ms: u64,
    ) {
        let mut s = self.state();
        if let Some(a) = actor_entry(&mut s.actors, actor) {
            a.accepted += 1;
        }
        if let Some(b) = s.batches.get_mut(&batch) {
            b.groups += 1;
            b.samples += rewards.len() as u64;
            b.reward_sum += rewards.iter().map(|&r| f64::from(r)).sum::<f64>();
            b.tokens += tokens;
            b.last_result_ms = at_ms;
        }
    }

    /// A refused result: counted per actor and reason code, and logged as a fault of `kind`:
    /// [`FaultKind::Fenced`] for a result whose weight digest is not its version's (the actor's
    /// weights drifted: nothing it sends is accepted until it resynchronizes), else
    /// [`FaultKind::Refused`].
    pub(crate) fn result_refused(
        &self,
        actor: &str,
        code: &str,
        detail: &str,
        kind: FaultKind,
        at_ms: u64,
    ) {
        {
            let mut s = self.state();
            if let Some(a) = actor_entry(&mut s.actors, actor) {
                *a.refused.entry(code.to_owned()).or_default() += 1;
            }
        }
        self.fault(kind, Some(actor), None, &format!("{code}: {detail}"), at_ms);
    }

    /// Every job of `batch` is done or failed: its totals become a step.
    pub(crate) fn batch_finished(&self, batch: i64, at_ms: u64) {
        let step = {
            let mut s = self.state();
            let Some(b) = s.batches.get_mut(&batch) else {
                return;
            };
            if b.finished {
                return;
            }
            b.finished = true;
            let end = if b.last_result_ms > 0 {
                b.last_result_ms
            } else {
                at_ms
            };
            let seconds = end.saturating_sub(b.posted_at_ms) as f64 / 1000.0;
            let step = Step {
                batch,
                version: b.version,
                groups: b.groups,
                size: b.size,
                samples: b.samples,
                mean_reward: (b.samples > 0).then(|| b.reward_sum / b.samples as f64),
                tokens: b.tokens,
                seconds,
                tokens_per_s: (seconds > 0.0).then(|| b.tokens as f64 / seconds),
                done_at_ms: end,
            };
            s.steps.push_back(step.clone());
            while s.steps.len() > MAX_STEPS {
                s.steps.pop_front();
            }
            step
        };
        self.emit(Event::Step(StepEvent { step, at_ms }));
        self.emit(Event::Batch(BatchChange {
            id: batch,
            version: None,
            size: None,
            actors: None,
            done: true,
            at_ms,
        }));
    }

    /// Whether the board has seen `batch` finish.
    pub(crate) fn batch_is_finished(&self, batch: i64) -> bool {
        self.state().batches.get(&batch).is_some_and(|b| b.finished)
    }

    /// The ids of batches posted here that have not finished.
    pub(crate) fn open_batches(&self) -> Vec<i64> {
        let s = self.state();
        s.batches
            .iter()
            .filter(|(_, b)| !b.finished)
            .map(|(id, _)| *id)
            .collect()
    }

    /// `n` leases expired in one sweep.
    pub(crate) fn leases_expired(&self, n: u64, at_ms: u64) {
        if n > 0 {
            self.fault(
                FaultKind::LeaseExpired,
                None,
                None,
                &format!("{n} lease(s) expired; their jobs went back to the pool or failed"),
                at_ms,
            );
        }
    }

    fn record_sent(&self, peer: &str, version: u64, bytes: u64, at_ms: u64) {
        let event = {
            let mut s = self.state();
            let Some(p) = s.peers.get_mut(peer) else {
                return;
            };
            p.bytes_sent += bytes;
            match &mut p.transfer {
                Some(t) if t.version == version => {
                    t.bytes += bytes;
                    t.last_at_ms = at_ms;
                }
                Some(t) if t.version > version => {} // a resend of an older version
                _ => {
                    p.transfer = Some(Transfer {
                        version,
                        bytes,
                        started_at_ms: at_ms,
                        last_at_ms: at_ms,
                        done: false,
                    })
                }
            }
            let due = p
                .last_transfer_event_ms
                .is_none_or(|last| at_ms >= last + TRANSFER_EVENT_MS);
            if due {
                p.last_transfer_event_ms = Some(at_ms);
            }
            let sent = p.transfer.map_or(0, |t| t.bytes);
            due.then(|| Event::Transfer {
                peer: peer.to_owned(),
                version,
                bytes: sent,
                at_ms,
            })
        };
        if let Some(e) = event {
            self.emit(e);
        }
    }

    fn record_delivered(&self, peer: &str, version: u64, at_ms: u64) {
        let mut s = self.state();
        let State {
            peers, versions, ..
        } = &mut *s;
        let Some(p) = peers.get_mut(peer) else {
            return;
        };
        if let Some(t) = &mut p.transfer
            && t.version == version
        {
            t.done = true;
        }
        if p.role == PeerRole::Relay
            && let Some(t) = versions.get_mut(&version)
        {
            t.relay_sent.entry(peer.to_owned()).or_insert(at_ms);
        }
    }

    fn record_report(&self, peer: &str, version: u64, stage: Stage, at_ms: u64) {
        let newly = {
            let mut s = self.state();
            let State {
                peers,
                versions,
                actors,
                early_relay_staged,
                ..
            } = &mut *s;
            let Some(p) = peers.get_mut(peer) else {
                return;
            };
            p.version = Some(p.version.map_or(version, |v| v.max(version)));
            let role = p.role;
            let newest = versions.last_key_value().map_or(0, |(v, _)| *v);
            match (role, versions.get_mut(&version)) {
                // Cut-through: a relay can hold the whole version before it is recorded.
                (PeerRole::Relay, None)
                    if stage == Stage::Staged
                        && version > newest
                        && early_relay_staged.len() < MAX_VERSIONS =>
                {
                    early_relay_staged
                        .entry(version)
                        .or_default()
                        .entry(peer.to_owned())
                        .or_insert(at_ms);
                    false
                }
                (PeerRole::Relay, Some(t)) if stage == Stage::Staged => {
                    t.relay_staged.insert(peer.to_owned(), at_ms).is_none()
                }
                (PeerRole::Actor, Some(t)) if stage == Stage::Active => {
                    if let Some(a) = actors.get_mut(peer) {
                        a.active = Some(version);
                    }
                    t.actor_active.insert(peer.to_owned(), at_ms).is_none()
                }
                _ => false,
            }
        };
        if newly {
            let report = Report::new(peer, version, at_ms);
            self.emit(match stage {
                Stage::Staged => Event::Staged(report),
                Stage::Active => Event::Active(report),
            });
        }
    }

    /// The versions, newest first, with their propagation per region and actor.
    /// `actor_regions` maps every known actor to its region (from the ledger).
    pub(crate) fn versions(
        &self,
        actor_regions: &BTreeMap<String, String>,
        checkpoint_bytes: u64,
    ) -> Vec<VersionView> {
        let s = self.state();
        let relay_region: HashMap<&str, &str> = s
            .peers
            .iter()
            .filter(|(_, p)| p.role == PeerRole::Relay)
            .map(|(n, p)| (n.as_str(), p.region.as_str()))
            .collect();
        let mut regions: BTreeMap<&str, ()> =
            actor_regions.values().map(|r| (r.as_str(), ())).collect();
        regions.extend(relay_region.values().map(|r| (*r, ())));
        s.versions
            .iter()
            .rev()
            .map(|(&v, t)| {
                let per_region = regions
                    .keys()
                    .map(|region| {
                        let relay = relay_region
                            .iter()
                            .find(|(_, r)| *r == region)
                            .map(|(n, _)| *n);
                        let in_region: Vec<u64> = actor_regions
                            .iter()
                            .filter(|(_, r)| r.as_str() == *region)
                            .filter_map(|(a, _)| t.actor_active.get(a).copied())
                            .collect();
                        let total = actor_regions.values().filter(|r| r == region).count();
                        RegionPropagation {
                            region: (*region).to_owned(),
                            relay: relay.map(str::to_owned),
                            relay_sent_at_ms: relay.and_then(|n| t.relay_sent.get(n)).copied(),
                            relay_staged_at_ms: relay.and_then(|n| t.relay_staged.get(n)).copied(),
                            actors: total,
                            actors_active: in_region.len(),
                            first_active_at_ms: in_region.iter().min().copied(),
                            all_active_at_ms: (total > 0 && in_region.len() == total)
                                .then(|| in_region.iter().max().copied())
                                .flatten(),
                        }
                    })
                    .collect();
                let actors = actor_regions
                    .iter()
                    .map(|(a, region)| ActorPropagation {
                        actor: a.clone(),
                        region: region.clone(),
                        staged_at_ms: t.actor_staged.get(a).copied(),
                        active_at_ms: t.actor_active.get(a).copied(),
                    })
                    .collect();
                VersionView {
                    version: v,
                    base: t.base,
                    first_segment_at_ms: t.first_segment_at_ms,
                    published_at_ms: t.published_at_ms,
                    bytes: t.bytes,
                    changes: t.changes,
                    ratio: ratio(checkpoint_bytes, t.bytes),
                    step: t.step,
                    encode_ms: t.encode_ms,
                    regions: per_region,
                    actors,
                }
            })
            .collect()
    }

    /// The link of every connected subscriber that has one (a relay, or an actor subscribed
    /// to the hub): what the codec choice plans delivery over (`crate::codecs`).
    pub(crate) fn links(&self) -> Vec<crate::codecs::PeerLink> {
        self.state()
            .peers
            .iter()
            .filter(|(_, p)| p.connected)
            .filter_map(|(name, p)| {
                Some(crate::codecs::PeerLink {
                    peer: name.clone(),
                    region: p.region.clone(),
                    link: p.link?,
                })
            })
            .collect()
    }

    /// Every relay the board has seen, with its transfer measured against the delta's size
    /// when the board still holds that version.
    pub(crate) fn relays(&self) -> Vec<RelayView> {
        let s = self.state();
        let delta_bytes = |v: u64| s.versions.get(&v).map(|t| t.bytes);
        s.peers
            .iter()
            .filter(|(_, p)| p.role == PeerRole::Relay)
            .map(|(name, p)| RelayView {
                region: p.region.clone(),
                name: name.clone(),
                connected: p.connected,
                since_ms: p.since_ms,
                link: p.link.map(|l| LinkView {
                    rate_mbit: l.rate_bps as f64 / 1e6,
                    rtt_ms: l.rtt.as_secs_f64() * 1e3,
                }),
                version: p.version,
                bytes_sent: p.bytes_sent,
                transfer: p.transfer.map(|t| {
                    let secs = t.last_at_ms.saturating_sub(t.started_at_ms) as f64 / 1000.0;
                    TransferView {
                        version: t.version,
                        bytes: t.bytes,
                        of_bytes: delta_bytes(t.version),
                        started_at_ms: t.started_at_ms,
                        last_at_ms: t.last_at_ms,
                        goodput_mbit: (secs > 0.0).then(|| t.bytes as f64 * 8.0 / secs / 1e6),
                        done: t.done,
                    }
                }),
            })
            .collect()
    }

    /// What the board knows of each actor.
    pub(crate) fn actors(&self) -> BTreeMap<String, ActorView> {
        let s = self.state();
        s.actors
            .iter()
            .map(|(name, a)| {
                let relay_fed = a.staged.or(a.active).is_some() && !a.subscribed_here;
                let source = if a.subscribed_here {
                    Some("hub")
                } else if relay_fed {
                    Some("relay")
                } else {
                    None
                };
                (
                    name.clone(),
                    ActorView {
                        engine: a.engine.clone(),
                        worker_connected: a.worker_connected,
                        source,
                        accepted: a.accepted,
                        refused: a.refused.clone(),
                    },
                )
            })
            .collect()
    }

    /// Finished batches, oldest first.
    pub(crate) fn steps(&self) -> Vec<Step> {
        self.state().steps.iter().cloned().collect()
    }

    /// Recent faults, newest first.
    pub(crate) fn faults(&self) -> Vec<Fault> {
        self.state().faults.iter().cloned().collect()
    }
}

impl SubscriberObserver for Board {
    fn sent(&self, peer: &str, version: u64, bytes: u64) {
        self.record_sent(peer, version, bytes, now_ms());
    }

    fn delivered(&self, peer: &str, version: u64) {
        self.record_delivered(peer, version, now_ms());
    }

    fn staged(&self, peer: &str, version: u64) {
        self.record_report(peer, version, Stage::Staged, now_ms());
    }

    fn active(&self, peer: &str, version: u64) {
        self.record_report(peer, version, Stage::Active, now_ms());
    }

    fn refetch(&self, peer: &str, version: u64, segments: usize) {
        let what = if segments == 0 {
            "the whole version".to_owned()
        } else {
            format!("{segments} segment(s)")
        };
        self.fault(
            FaultKind::Refetch,
            Some(peer),
            Some(version),
            &format!("asked for {what} again"),
            now_ms(),
        );
    }
}

/// The actor's track, created on first sight while there is room.
fn actor_entry<'a>(
    actors: &'a mut BTreeMap<String, ActorTrack>,
    name: &str,
) -> Option<&'a mut ActorTrack> {
    if actors.len() >= MAX_PEERS && !actors.contains_key(name) {
        return None;
    }
    Some(actors.entry(name.to_owned()).or_default())
}

/// How many times smaller than the full BF16 checkpoint a delta of `bytes` is.
pub(crate) fn ratio(checkpoint_bytes: u64, bytes: u64) -> Option<f64> {
    (bytes > 0 && checkpoint_bytes > 0).then(|| checkpoint_bytes as f64 / bytes as f64)
}

/// A detail cut to at most 512 bytes (at a character boundary).
fn bounded(detail: &str) -> String {
    const MAX: usize = 512;
    if detail.len() <= MAX {
        return detail.to_owned();
    }
    let mut cut = MAX;
    while !detail.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &detail[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(record: &impl Serialize) -> serde_json::Value {
        serde_json::to_value(record).expect("a record serializes")
    }

    fn regions(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(a, r)| (a.to_string(), r.to_string()))
            .collect()
    }

    #[test]
    fn a_version_propagates_through_relay_and_actors() {
        let b = Board::new(0);
        let mut events = b.subscribe();
        b.peer_connected("eu-relay", PeerRole::Relay, "eu", None, 10);
        b.worker_connected("eu-a1", "eu", "builtin", 11);
        b.worker_connected("eu-a2", "eu", "builtin", 12);
        b.published(1, 0, 1000, 50, Some(1), 30, 100_000, 100);
        b.record_sent("eu-relay", 1, 600, 101);
        b.record_sent("eu-relay", 1, 400, 102);
        b.record_delivered("eu-relay", 1, 103);
        b.record_report("eu-relay", 1, Stage::Staged, 104);
        b.heartbeat("eu-a1", Some(0), Some(1), 105);
        b.heartbeat("eu-a1", Some(1), None, 110);
        b.heartbeat("eu-a2", Some(1), None, 120);
        b.heartbeat("eu-a2", Some(1), None, 130); // a repeat changes nothing

        let v = b.versions(&regions(&[("eu-a1", "eu"), ("eu-a2", "eu")]), 100_000);
        assert_eq!(v.len(), 1);
        assert_eq!(
            v[0].regions,
            [RegionPropagation {
                region: "eu".into(),
                relay: Some("eu-relay".into()),
                relay_sent_at_ms: Some(103),
                relay_staged_at_ms: Some(104),
                actors: 2,
                actors_active: 2,
                first_active_at_ms: Some(110),
                all_active_at_ms: Some(120),
            }]
        );
        assert_eq!(v[0].ratio, Some(100.0));
        assert_eq!(v[0].actors[0].staged_at_ms, Some(105));

        let relays = b.relays();
        let t = relays[0].transfer.expect("a transfer");
        assert_eq!((t.bytes, t.of_bytes), (1000, Some(1000)));
        assert!(t.done);

        let mut kinds = Vec::new();
        while let Ok(e) = events.try_recv() {
            kinds.push(e.name());
        }
        assert_eq!(
            kinds,
            [
                "connected",
                "connected",
                "connected",
                "published",
                "transfer",
                "staged",
                "staged",
                "active",
                "active"
            ]
        );
    }

    #[test]
    fn an_actor_staged_before_the_hub_recorded_the_version_keeps_its_time() {
        let b = Board::new(0);
        b.worker_connected("a1", "eu", "builtin", 1);
        b.published(1, 0, 10, 1, None, 1, 100, 10);
        // Cut-through: the actor holds version 2 before the hub's publish is recorded.
        b.heartbeat("a1", Some(1), Some(2), 20);
        b.published(2, 1, 10, 1, None, 1, 100, 25);
        b.heartbeat("a1", Some(2), None, 30);
        let v = b.versions(&regions(&[("a1", "eu")]), 100);
        assert_eq!(v[0].version, 2);
        assert_eq!(v[0].actors[0].staged_at_ms, Some(20));
        assert_eq!(v[0].actors[0].active_at_ms, Some(30));
    }

    #[test]
    fn steps_average_rewards_and_finish_once() {
        let b = Board::new(0);
        b.batch_posted(7, 3, 2, 1000);
        b.result_accepted("a1", 7, &[1.0, 0.0], 10, 1500);
        b.result_accepted("a2", 7, &[1.0, 1.0], 30, 3000);
        b.result_refused("a2", "stale", "too old", FaultKind::Refused, 3100);
        assert_eq!(b.open_batches(), [7]);
        b.batch_finished(7, 3200);
        b.batch_finished(7, 3300);
        let steps = b.steps();
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].mean_reward, Some(0.75));
        assert_eq!(steps[0].tokens, 40);
        assert_eq!(steps[0].seconds, 2.0);
        assert_eq!(steps[0].tokens_per_s, Some(20.0));
        assert!(b.open_batches().is_empty());
        let actors = b.actors();
        assert_eq!(actors["a2"].accepted, 1);
        assert_eq!(actors["a2"].refused["stale"], 1);
        assert_eq!(b.faults()[0].kind, FaultKind::Refused);
        b.result_refused("a1", "digest", "weights drifted", FaultKind::Fenced, 3200);
        assert_eq!(b.faults()[0].kind, FaultKind::Fenced);
    }

    #[test]
    fn lists_stay_bounded_and_slow_subscribers_lag() {
        let b = Board::new(0);
        let mut slow = b.subscribe();
        for v in 1..=(MAX_VERSIONS as u64 + 10) {
            b.published(v, v - 1, 10, 1, None, 1, 100, v);
        }
        for i in 0..(MAX_FAULTS + 5) {
            b.fault(
                FaultKind::Refetch,
                Some("r"),
                None,
                &"x".repeat(2000),
                i as u64,
            );
        }
        assert_eq!(b.versions(&BTreeMap::new(), 100).len(), MAX_VERSIONS);
        let faults = b.faults();
        assert_eq!(faults.len(), MAX_FAULTS);
        assert!(faults[0].detail.len() < 600);
        for _ in 0..EVENT_QUEUE {
            b.fault(FaultKind::Refetch, None, None, "more", 0);
        }
        assert!(matches!(
            slow.try_recv(),
            Err(broadcast::error::TryRecvError::Lagged(_))
        ));
    }

    #[test]
    fn a_disconnect_with_an_error_is_a_fault() {
        let b = Board::new(0);
        b.peer_connected("ap-relay", PeerRole::Relay, "ap", None, 1);
        b.peer_disconnected("ap-relay", None, 2);
        assert!(b.faults().is_empty());
        b.peer_disconnected("ap-relay", Some("timed out"), 3);
        assert_eq!(b.faults()[0].kind, FaultKind::Disconnect);
        assert!(!b.relays()[0].connected);
    }

    /// The JSON `/v1/status`, `/v1/events` and the dashboard read: field names, `null` for
    /// what is not known, and the fields a batch change leaves out (`docs/observability.md`).
    #[test]
    fn records_keep_their_json_shape() {
        let b = Board::new(0);
        let mut events = b.subscribe();
        let link = LinkProfile {
            rate_bps: 200_000_000,
            rtt: std::time::Duration::from_millis(40),
        };
        b.peer_connected("eu-relay", PeerRole::Relay, "eu", Some(link), 1);
        b.worker_connected("eu-a1", "eu", "builtin", 2);
        b.published(7, 6, 1000, 50, Some(7), 31, 21_000, 10);
        b.record_sent("eu-relay", 7, 400, 11);
        b.record_report("eu-relay", 7, Stage::Staged, 12);
        b.batch_posted(3, 7, 2, 20);
        b.batch_scheduled(3, 7, 1, 21);
        b.result_accepted("eu-a1", 3, &[1.0], 8, 1020);
        b.batch_finished(3, 1030);
        b.fault(
            FaultKind::LeaseExpired,
            None,
            None,
            "1 lease(s) expired",
            1040,
        );

        let versions = b.versions(&regions(&[("eu-a1", "eu")]), 21_000);
        assert_eq!(
            json(&versions[0]),
            serde_json::json!({
                "version": 7, "base": 6, "first_segment_at_ms": null, "published_at_ms": 10,
                "bytes": 1000, "changes": 50, "ratio": 21.0, "step": 7, "encode_ms": 31,
                "regions": [{"region": "eu", "relay": "eu-relay", "relay_sent_at_ms": null,
                             "relay_staged_at_ms": 12, "actors": 1, "actors_active": 0,
                             "first_active_at_ms": null, "all_active_at_ms": null}],
                "actors": [{"actor": "eu-a1", "region": "eu", "staged_at_ms": null,
                            "active_at_ms": null}],
            })
        );
        assert_eq!(
            json(&b.relays()[0]),
            serde_json::json!({
                "name": "eu-relay", "connected": true, "since_ms": 1,
                "link": {"rate_mbit": 200.0, "rtt_ms": 40.0}, "version": 7, "bytes_sent": 400,
                "transfer": {"version": 7, "bytes": 400, "of_bytes": 1000, "started_at_ms": 11,
                             "last_at_ms": 11, "goodput_mbit": null, "done": false},
            })
        );
        let step = serde_json::json!({
            "batch": 3, "version": 7, "groups": 1, "size": 2, "samples": 1, "mean_reward": 1.0,
            "tokens": 8, "seconds": 1.0, "tokens_per_s": 8.0, "done_at_ms": 1020,
        });
        assert_eq!(json(&b.steps()[0]), step);
        let fault = serde_json::json!({
            "at_ms": 1040, "kind": "lease_expired", "peer": null, "version": null,
            "detail": "1 lease(s) expired",
        });
        assert_eq!(json(&b.faults()[0]), fault);

        let mut step_event = step;
        step_event["at_ms"] = 1030.into();
        let expected = [
            (
                "connected",
                serde_json::json!({"peer": "eu-relay", "role": "relay", "region": "eu", "at_ms": 1}),
            ),
            (
                "connected",
                serde_json::json!({"peer": "eu-a1", "role": "worker", "region": "eu", "at_ms": 2}),
            ),
            (
                "published",
                serde_json::json!({"version": 7, "bytes": 1000, "changes": 50, "ratio": 21.0, "at_ms": 10}),
            ),
            (
                "transfer",
                serde_json::json!({"peer": "eu-relay", "version": 7, "bytes": 400, "at_ms": 11}),
            ),
            (
                "staged",
                serde_json::json!({"peer": "eu-relay", "version": 7, "at_ms": 12}),
            ),
            (
                "batch",
                serde_json::json!({"id": 3, "version": 7, "size": 2, "done": false, "at_ms": 20}),
            ),
            (
                "batch",
                serde_json::json!({"id": 3, "version": 7, "actors": 1, "done": false, "at_ms": 21}),
            ),
            ("step", step_event),
            (
                "batch",
                serde_json::json!({"id": 3, "done": true, "at_ms": 1030}),
            ),
            ("fault", fault),
        ];
        for (name, data) in expected {
            let e = events.try_recv().expect("an event");
            assert_eq!((e.name(), json(&e)), (name, data));
        }
        assert!(events.try_recv().is_err());
    }
}
