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

use serde_json::{Value, json};
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

/// One change, as the event stream sends it: an SSE event name and its JSON data.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) kind: &'static str,
    pub(crate) data: Value,
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
    steps: VecDeque<Value>,
    faults: VecDeque<Value>,
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

/// A relay as the board has seen it.
#[derive(Debug, Clone)]
pub(crate) struct RelayView {
    pub(crate) region: String,
    pub(crate) json: Value,
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

    fn emit(&self, kind: &'static str, mut data: Value, at_ms: u64) {
        if let Value::Object(m) = &mut data {
            m.insert("at_ms".into(), json!(at_ms));
        }
        // No receivers is not an error: nobody is watching.
        let _ = self.events.send(Event { kind, data });
    }

    /// Records a fault and sends it to the stream.
    pub(crate) fn fault(
        &self,
        kind: &'static str,
        peer: Option<&str>,
        version: Option<u64>,
        detail: &str,
        at_ms: u64,
    ) {
        let entry = json!({
            "at_ms": at_ms, "kind": kind, "peer": peer, "version": version,
            "detail": bounded(detail),
        });
        {
            let mut s = self.state();
            s.faults.push_front(entry.clone());
            s.faults.truncate(MAX_FAULTS);
        }
        self.emit("fault", entry, at_ms);
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
        let ratio = ratio(checkpoint_bytes, bytes);
        self.emit(
            "published",
            json!({"version": version, "bytes": bytes, "changes": changes, "ratio": ratio}),
            at_ms,
        );
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
        self.emit(
            "connected",
            json!({"peer": name, "role": role.as_str(), "region": region}),
            at_ms,
        );
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
        self.emit(
            "disconnected",
            json!({"peer": name, "role": role.as_str(), "region": region}),
            at_ms,
        );
        if let Some(e) = error {
            self.fault("disconnect", Some(name), None, e, at_ms);
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
        self.emit(
            "connected",
            json!({"peer": name, "role": "worker", "region": region}),
            at_ms,
        );
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
        self.emit(
            "disconnected",
            json!({"peer": name, "role": "worker", "region": region}),
            at_ms,
        );
        if let Some(e) = error {
            self.fault("disconnect", Some(name), None, e, at_ms);
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
                        newly.push(("staged", v));
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
                newly.push(("active", v));
            }
        }
        for (kind, v) in newly {
            self.emit(kind, json!({"peer": name, "version": v}), at_ms);
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
        self.emit(
            "batch",
            json!({"id": id, "version": version, "size": size, "done": false}),
            at_ms,
        );
    }

    /// A batch was split over actors.
    pub(crate) fn batch_scheduled(&self, id: i64, version: u64, actors: usize, at_ms: u64) {
        self.emit(
            "batch",
            json!({"id": id, "version": version, "actors": actors, "done": false}),
            at_ms,
        );
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

    /// A refused result: counted per actor and reason, and logged as a fault; a result whose
    /// weight digest is not its version's is `fenced` (the actor's weights drifted: nothing it
    /// sends is accepted until it resynchronizes).
    pub(crate) fn result_refused(&self, actor: &str, code: &str, detail: &str, at_ms: u64) {
        {
            let mut s = self.state();
            if let Some(a) = actor_entry(&mut s.actors, actor) {
                *a.refused.entry(code.to_owned()).or_default() += 1;
            }
        }
        self.fault(
            if code == "digest" {
                "fenced"
            } else {
                "refused"
            },
            Some(actor),
            None,
            &format!("{code}: {detail}"),
            at_ms,
        );
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
            let step = json!({
                "batch": batch,
                "version": b.version,
                "groups": b.groups,
                "size": b.size,
                "samples": b.samples,
                "mean_reward": (b.samples > 0).then(|| b.reward_sum / b.samples as f64),
                "tokens": b.tokens,
                "seconds": seconds,
                "tokens_per_s": (seconds > 0.0).then(|| b.tokens as f64 / seconds),
                "done_at_ms": end,
            });
            s.steps.push_back(step.clone());
            while s.steps.len() > MAX_STEPS {
                s.steps.pop_front();
            }
            step
        };
        self.emit("step", step, at_ms);
        self.emit("batch", json!({"id": batch, "done": true}), at_ms);
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
                "lease_expired",
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
            due.then(|| json!({"peer": peer, "version": version, "bytes": sent}))
        };
        if let Some(e) = event {
            self.emit("transfer", e, at_ms);
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

    fn record_report(&self, peer: &str, version: u64, kind: &'static str, at_ms: u64) {
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
                    if kind == "staged"
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
                (PeerRole::Relay, Some(t)) if kind == "staged" => {
                    t.relay_staged.insert(peer.to_owned(), at_ms).is_none()
                }
                (PeerRole::Actor, Some(t)) if kind == "active" => {
                    if let Some(a) = actors.get_mut(peer) {
                        a.active = Some(version);
                    }
                    t.actor_active.insert(peer.to_owned(), at_ms).is_none()
                }
                _ => false,
            }
        };
        if newly {
            self.emit(kind, json!({"peer": peer, "version": version}), at_ms);
        }
    }

    /// The versions, newest first, with their propagation per region and actor.
    /// `actor_regions` maps every known actor to its region (from the ledger).
    pub(crate) fn versions_json(
        &self,
        actor_regions: &BTreeMap<String, String>,
        checkpoint_bytes: u64,
    ) -> Vec<Value> {
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
                let per_region: Vec<Value> = regions
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
                        json!({
                            "region": region,
                            "relay": relay,
                            "relay_sent_at_ms": relay.and_then(|n| t.relay_sent.get(n)),
                            "relay_staged_at_ms": relay.and_then(|n| t.relay_staged.get(n)),
                            "actors": total,
                            "actors_active": in_region.len(),
                            "first_active_at_ms": in_region.iter().min(),
                            "all_active_at_ms": (total > 0 && in_region.len() == total)
                                .then(|| in_region.iter().max()).flatten(),
                        })
                    })
                    .collect();
                let actors: Vec<Value> = actor_regions
                    .iter()
                    .map(|(a, region)| {
                        json!({
                            "actor": a,
                            "region": region,
                            "staged_at_ms": t.actor_staged.get(a),
                            "active_at_ms": t.actor_active.get(a),
                        })
                    })
                    .collect();
                json!({
                    "version": v,
                    "base": t.base,
                    "first_segment_at_ms": t.first_segment_at_ms,
                    "published_at_ms": t.published_at_ms,
                    "bytes": t.bytes,
                    "changes": t.changes,
                    "ratio": ratio(checkpoint_bytes, t.bytes),
                    "step": t.step,
                    "encode_ms": t.encode_ms,
                    "regions": per_region,
                    "actors": actors,
                })
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
            .map(|(name, p)| {
                let transfer = p.transfer.map(|t| {
                    let secs = t.last_at_ms.saturating_sub(t.started_at_ms) as f64 / 1000.0;
                    json!({
                        "version": t.version,
                        "bytes": t.bytes,
                        "of_bytes": delta_bytes(t.version),
                        "started_at_ms": t.started_at_ms,
                        "last_at_ms": t.last_at_ms,
                        "goodput_mbit": (secs > 0.0).then(|| t.bytes as f64 * 8.0 / secs / 1e6),
                        "done": t.done,
                    })
                });
                RelayView {
                    region: p.region.clone(),
                    json: json!({
                        "name": name,
                        "connected": p.connected,
                        "since_ms": p.since_ms,
                        "link": p.link.map(|l| json!({
                            "rate_mbit": l.rate_bps as f64 / 1e6,
                            "rtt_ms": l.rtt.as_secs_f64() * 1e3,
                        })),
                        "version": p.version,
                        "bytes_sent": p.bytes_sent,
                        "transfer": transfer,
                    }),
                }
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
    pub(crate) fn steps(&self) -> Vec<Value> {
        self.state().steps.iter().cloned().collect()
    }

    /// Recent faults, newest first.
    pub(crate) fn faults(&self) -> Vec<Value> {
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
        self.record_report(peer, version, "staged", now_ms());
    }

    fn active(&self, peer: &str, version: u64) {
        self.record_report(peer, version, "active", now_ms());
    }

    fn refetch(&self, peer: &str, version: u64, segments: usize) {
        let what = if segments == 0 {
            "the whole version".to_owned()
        } else {
            format!("{segments} segment(s)")
        };
        self.fault(
            "refetch",
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
        b.record_report("eu-relay", 1, "staged", 104);
        b.heartbeat("eu-a1", Some(0), Some(1), 105);
        b.heartbeat("eu-a1", Some(1), None, 110);
        b.heartbeat("eu-a2", Some(1), None, 120);
        b.heartbeat("eu-a2", Some(1), None, 130); // a repeat changes nothing

        let v = b.versions_json(&regions(&[("eu-a1", "eu"), ("eu-a2", "eu")]), 100_000);
        assert_eq!(v.len(), 1);
        let r = &v[0]["regions"][0];
        assert_eq!(r["region"], "eu");
        assert_eq!(r["relay"], "eu-relay");
        assert_eq!(r["relay_sent_at_ms"], 103);
        assert_eq!(r["relay_staged_at_ms"], 104);
        assert_eq!(r["actors_active"], 2);
        assert_eq!(r["first_active_at_ms"], 110);
        assert_eq!(r["all_active_at_ms"], 120);
        assert_eq!(v[0]["ratio"], 100.0);
        assert_eq!(v[0]["actors"][0]["staged_at_ms"], 105);

        let relays = b.relays();
        let t = &relays[0].json["transfer"];
        assert_eq!(
            (t["bytes"].clone(), t["of_bytes"].clone()),
            (json!(1000), json!(1000))
        );
        assert_eq!(t["done"], true);

        let mut kinds = Vec::new();
        while let Ok(e) = events.try_recv() {
            kinds.push(e.kind);
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
        let v = b.versions_json(&regions(&[("a1", "eu")]), 100);
        assert_eq!(v[0]["version"], 2);
        assert_eq!(v[0]["actors"][0]["staged_at_ms"], 20);
        assert_eq!(v[0]["actors"][0]["active_at_ms"], 30);
    }

    #[test]
    fn steps_average_rewards_and_finish_once() {
        let b = Board::new(0);
        b.batch_posted(7, 3, 2, 1000);
        b.result_accepted("a1", 7, &[1.0, 0.0], 10, 1500);
        b.result_accepted("a2", 7, &[1.0, 1.0], 30, 3000);
        b.result_refused("a2", "stale", "too old", 3100);
        assert_eq!(b.open_batches(), [7]);
        b.batch_finished(7, 3200);
        b.batch_finished(7, 3300);
        let steps = b.steps();
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0]["mean_reward"], 0.75);
        assert_eq!(steps[0]["tokens"], 40);
        assert_eq!(steps[0]["seconds"], 2.0);
        assert_eq!(steps[0]["tokens_per_s"], 20.0);
        assert!(b.open_batches().is_empty());
        let actors = b.actors();
        assert_eq!(actors["a2"].accepted, 1);
        assert_eq!(actors["a2"].refused["stale"], 1);
        assert_eq!(b.faults()[0]["kind"], "refused");
        b.result_refused("a1", "digest", "weights drifted", 3200);
        assert_eq!(b.faults()[0]["kind"], "fenced");
    }

    #[test]
    fn lists_stay_bounded_and_slow_subscribers_lag() {
        let b = Board::new(0);
        let mut slow = b.subscribe();
        for v in 1..=(MAX_VERSIONS as u64 + 10) {
            b.published(v, v - 1, 10, 1, None, 1, 100, v);
        }
        for i in 0..(MAX_FAULTS + 5) {
            b.fault("refetch", Some("r"), None, &"x".repeat(2000), i as u64);
        }
        assert_eq!(b.versions_json(&BTreeMap::new(), 100).len(), MAX_VERSIONS);
        let faults = b.faults();
        assert_eq!(faults.len(), MAX_FAULTS);
        assert!(faults[0]["detail"].as_str().is_some_and(|d| d.len() < 600));
        for _ in 0..EVENT_QUEUE {
            b.fault("refetch", None, None, "more", 0);
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
        assert_eq!(b.faults()[0]["kind"], "disconnect");
        assert_eq!(b.relays()[0].json["connected"], false);
    }
}
