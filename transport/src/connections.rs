//! How many live connections of one kind a certificate may hold on a server at once.
//!
//! Admission ([`crate::admit`]) proves who a peer is, not how much it may take: without a
//! bound, one credential could open any number of connections, and every subscription is
//! sent every version (the whole delta stream) while every worker connection costs the hub a
//! ledger session. A server keeps one [`ConnectionCap`] per kind of connection — the hub one
//! for worker connections and one for subscriptions, a relay one for subscriptions — keyed by
//! the certificate's role and name (the pair a certificate proves; two certificates of
//! different roles may carry the same name).
//!
//! A connection takes a [`ConnectionSlot`] once it says what it is for (`Work`,
//! `Subscribe`), and holds it until it ends, however it ends: the slot is freed when it is
//! dropped, so a peer that was killed connects again as soon as the server has seen its old
//! connection end (at most the QUIC idle timeout later). The default bound,
//! [`DEFAULT_MAX`], lets a reconnect overlap the connection it replaces. A connection over
//! the bound is told `Refuse { TooManyConnections }` with the bound in its detail, the
//! refusal is logged, and the server ends the connection. A refused subscriber (the receiving
//! core, [`crate::follow`]) connects to the same server again after a pause, for up to
//! [`crate::follow::CROWDED_PATIENCE`], before it takes its next source: the places it waits
//! for are normally its own dead connections, freed within the idle timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use quinn::SendStream;
use starling_proto::protocol::msg::{Message, RefuseReason, Role as MsgRole};

use crate::framed::{FramedError, send};

/// The live connections of one kind a certificate may hold unless configured otherwise: a
/// reconnect may overlap its dead predecessor until the server sees that one end.
pub const DEFAULT_MAX: usize = 2;

/// How long a refusal waits for the peer to acknowledge it before the connection is dropped
/// (dropping it at once could lose the `Refuse` in flight).
const REFUSAL_LINGER: Duration = Duration::from_secs(2);

/// The live connections of one kind per certificate, shared by a server's connections.
#[derive(Debug)]
pub struct ConnectionCap {
    /// What the connections are for, in refusals and logs (`worker`, `subscription`).
    kind: &'static str,
    max: usize,
    live: Mutex<HashMap<(MsgRole, String), usize>>,
}

/// One admitted connection's place; dropping it frees the place.
#[derive(Debug)]
pub struct ConnectionSlot {
    owner: Arc<ConnectionCap>,
    key: (MsgRole, String),
    first: bool,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut live = self.owner.lock();
        if let Some(n) = live.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                live.remove(&self.key);
            }
        }
    }
}

impl ConnectionSlot {
    /// Whether this was its certificate's only live connection of the kind when it opened.
    pub fn first(&self) -> bool {
        self.first
    }

    /// Whether this is its certificate's only live connection of the kind now.
    pub fn alone(&self) -> bool {
        self.owner.lock().get(&self.key).is_none_or(|&n| n <= 1)
    }
}

impl ConnectionCap {
    /// At most `max` (at least 1) live connections of `kind` per certificate.
    pub fn new(kind: &'static str, max: usize) -> Arc<ConnectionCap> {
        Arc::new(ConnectionCap {
            kind,
            max: max.max(1),
            live: Mutex::default(),
        })
    }

    /// The most connections one certificate may hold.
    pub fn max(&self) -> usize {
        self.max
    }

    /// A place for one more connection of the certificate (`role`, `name`), if it holds
    /// fewer than the bound.
    pub fn open(self: &Arc<Self>, role: MsgRole, name: &str) -> Option<ConnectionSlot> {
        let key = (role, name.to_owned());
        let mut live = self.lock();
        let n = live.entry(key.clone()).or_default();
        if *n >= self.max {
            return None;
        }
        *n += 1;
        let first = *n == 1;
        drop(live);
        Some(ConnectionSlot {
            owner: self.clone(),
            key,
            first,
        })
    }

    /// [`open`](Self::open), or, over the bound, tells the peer on its `control` stream why
    /// (`Refuse { TooManyConnections }`), logs it, finishes the stream and gives the peer a
    /// moment to acknowledge it: `Ok(None)`, and the caller ends the connection.
    pub async fn take(
        self: &Arc<Self>,
        role: MsgRole,
        name: &str,
        control: &mut SendStream,
    ) -> Result<Option<ConnectionSlot>, FramedError> {
        if let Some(slot) = self.open(role, name) {
            return Ok(Some(slot));
        }
        let detail = format!(
            "{name} already holds {} {} connections, the most one certificate may hold: \
             close one (or wait for a dead one to time out) and connect again",
            self.max, self.kind
        );
        tracing::warn!(peer = %name, role = ?role, "{} connection refused: {detail}", self.kind);
        let refuse = Message::Refuse {
            reason: RefuseReason::TooManyConnections,
            detail,
        };
        send(control, &refuse).await?;
        let _ = control.finish();
        let _ = tokio::time::timeout(REFUSAL_LINGER, control.stopped()).await;
        Ok(None)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(MsgRole, String), usize>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_per_certificate_are_bounded_and_freed_on_drop() {
        let c = ConnectionCap::new("worker", 2);
        let a = c.open(MsgRole::Actor, "a1").expect("first");
        assert!(a.first() && a.alone());
        let b = c.open(MsgRole::Actor, "a1").expect("second");
        assert!(!b.first() && !a.alone());
        assert!(
            c.open(MsgRole::Actor, "a1").is_none(),
            "third of the same name"
        );
        assert!(
            c.open(MsgRole::Actor, "A1").is_some(),
            "names compare exactly"
        );
        assert!(
            c.open(MsgRole::Relay, "a1").is_some(),
            "another role's certificate of the same name is another certificate"
        );
        drop(a);
        assert!(b.alone());
        let _c = c.open(MsgRole::Actor, "a1").expect("a place was freed");
        drop(b);
        assert_eq!(c.max(), 2);
        assert_eq!(ConnectionCap::new("subscription", 0).max(), 1);
    }
}
