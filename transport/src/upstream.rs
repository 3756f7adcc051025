//! The receiving side of a subscription, shared by actors and relays: connect to the hub or
//! a relay, say who we are, subscribe after a version, and turn what arrives into events —
//! each data stream's start and end and every frame as soon as it arrived and its hash
//! checked (so a relay can forward it and an actor stage it at once), and each `Commit`.

use std::net::SocketAddr;

use quinn::{Connection, Endpoint, SendStream};
use starling_proto::anchor::AnchorSeal;
use starling_proto::msg::{Message, RefuseReason};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::endpoint::{EndpointError, client_endpoint, connect};
use crate::framed::{DataStreamReader, FramedError, MessageReader, StreamFrame, send};
use crate::identity::{Credentials, Role};
use crate::link::LinkProfile;

/// Something the upstream sent.
#[derive(Debug)]
pub enum UpstreamEvent {
    /// A data stream of `version` began (one stripe of a transmission).
    StreamStarted {
        version: u64,
        base: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
    },
    /// One frame of `version`, its BLAKE3 checked, as soon as it arrived.
    Frame {
        version: u64,
        delta_id: [u8; 32],
        frame: StreamFrame,
    },
    /// A data stream ended: cleanly, or with `error` (a frame failed its hash, the stream
    /// was cut); frames after the damage on that stream are lost, not delivered.
    StreamEnded {
        version: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
        error: Option<String>,
    },
    /// An anchor (full checkpoint) is arriving: `seal.size` bytes follow on `stream`.
    Anchor {
        seal: AnchorSeal,
        stream: DataStreamReader,
    },
    Commit(u64),
    Pong(u64),
    Refused {
        reason: RefuseReason,
        detail: String,
    },
    Closed(String),
}

/// Why a subscription could not be set up.
#[derive(Debug, Error)]
pub enum UpstreamError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Framed(#[from] FramedError),
    #[error("open control stream")]
    Connection(#[from] quinn::ConnectionError),
    #[error("refused: {0}")]
    Refused(String),
    #[error("unexpected answer to Hello: {0}")]
    Unexpected(String),
}

/// A live subscription.
#[derive(Debug)]
pub struct Upstream {
    pub endpoint: Endpoint,
    pub conn: Connection,
    /// Our half of the control stream (for `Fetch`, `Active`).
    pub control: SendStream,
    pub events: mpsc::Receiver<UpstreamEvent>,
    /// The newest version the upstream had when it welcomed us.
    pub latest: u64,
    /// The tasks that read the connection (control stream, each data stream): owned by the
    /// subscription, aborted when it is dropped.
    _readers: JoinSet<()>,
}

impl Upstream {
    /// Closes the connection and waits briefly for the peer to see it.
    pub async fn close(self) {
        self.conn.close(0u32.into(), b"bye");
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), self.endpoint.wait_idle())
            .await;
    }
}

/// Connects to the server (`role`, `name`) at `addr`, sends `hello`, and subscribes after
/// `after_version`.
pub async fn subscribe(
    creds: &Credentials,
    addr: SocketAddr,
    role: Role,
    name: &str,
    hello: &Message,
    after_version: u64,
    link: &LinkProfile,
) -> Result<Upstream, UpstreamError> {
    let bind: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .map_err(|_| UpstreamError::Unexpected("bind address".into()))?;
    let endpoint = client_endpoint(creds, bind, link)?;
    let conn = connect(&endpoint, addr, role, name).await?;
    let (mut control, rx) = conn.open_bi().await?;
    let mut reader = MessageReader::new(rx);
    send(&mut control, hello).await?;
    let latest = match reader.next().await? {
        Some(Message::Welcome { latest_version }) => latest_version,
        Some(Message::Refuse { reason, detail }) => {
            return Err(UpstreamError::Refused(format!("{reason:?}: {detail}")));
        }
        other => return Err(UpstreamError::Unexpected(format!("{other:?}"))),
    };
    send(&mut control, &Message::Subscribe { after_version }).await?;
    let (tx, events) = mpsc::channel(256);
    let data_conn = conn.clone();
    let data_tx = tx.clone();
    let mut readers = JoinSet::new();
    readers.spawn(async move {
        // Each data stream's reader is owned by this task, so by the subscription.
        let mut streams = JoinSet::new();
        while let Ok(recv) = data_conn.accept_uni().await {
            while streams.try_join_next().is_some() {}
            streams.spawn(read_data_stream(recv, data_tx.clone()));
        }
        while streams.join_next().await.is_some() {}
    });
    readers.spawn(async move {
        loop {
            let ev = match reader.next().await {
                Ok(Some(Message::Commit { version })) => UpstreamEvent::Commit(version),
                Ok(Some(Message::Pong { nonce })) => UpstreamEvent::Pong(nonce),
                Ok(Some(Message::Refuse { reason, detail })) => {
                    UpstreamEvent::Refused { reason, detail }
                }
                Ok(Some(other)) => {
                    tracing::debug!("upstream: ignored {other:?}");
                    continue;
                }
                Ok(None) => UpstreamEvent::Closed("upstream closed the control stream".into()),
                Err(e) => UpstreamEvent::Closed(starling_telemetry::error_chain(&e)),
            };
            let closed = matches!(ev, UpstreamEvent::Closed(_));
            if tx.send(ev).await.is_err() || closed {
                return;
            }
        }
    });
    Ok(Upstream {
        endpoint,
        conn,
        control,
        events,
        latest,
        _readers: readers,
    })
}

/// Turns one data stream into events: its start, each verified frame, its end.
async fn read_data_stream(recv: quinn::RecvStream, ev: mpsc::Sender<UpstreamEvent>) {
    let mut r = DataStreamReader::new(recv);
    let (version, base, delta_id, transmission, stripes) = match r.message().await {
        Ok(Message::Announce {
            version,
            base_version,
            delta_id,
            transmission,
            stripes,
        }) => (version, base_version, delta_id, transmission, stripes),
        Ok(Message::Anchor { seal }) => {
            let _ = ev.send(UpstreamEvent::Anchor { seal, stream: r }).await;
            return;
        }
        Ok(other) => return tracing::warn!("data stream began with {other:?}"),
        Err(e) => return tracing::warn!("data stream: {}", starling_telemetry::error_chain(&e)),
    };
    let started = UpstreamEvent::StreamStarted {
        version,
        base,
        delta_id,
        transmission,
        stripes,
    };
    if ev.send(started).await.is_err() {
        return;
    }
    let error = loop {
        match r.frame().await {
            Ok(Some(frame)) => {
                let f = UpstreamEvent::Frame {
                    version,
                    delta_id,
                    frame,
                };
                if ev.send(f).await.is_err() {
                    return;
                }
            }
            Ok(None) => break None,
            Err(e) => break Some(starling_telemetry::error_chain(&e)),
        }
    };
    let _ = ev
        .send(UpstreamEvent::StreamEnded {
            version,
            delta_id,
            transmission,
            stripes,
            error,
        })
        .await;
}
