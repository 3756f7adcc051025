//! The receiving side of a subscription, shared by actors and relays: connect to the hub or
//! a relay over the process's one endpoint, say who we are ([`Upstream::connect`]), subscribe
//! after a version ([`Upstream::subscribe`]), and turn what arrives into events — each data
//! stream's start and end and every frame as soon as it arrived, its hash checked and its
//! kind and number parsed (so a relay can forward it and an actor stage it at once), and
//! each `Commit`. [`probe`] asks a source which version it holds without subscribing.
//!
//! What to do with the events is the receiving core's business ([`crate::follow`]); [`Feed`]
//! runs the core's connection actions and hands it the events.

use std::net::SocketAddr;

use quinn::{ClientConfig, Connection, Endpoint, SendStream};
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::protocol::msg::{Message, RefuseReason};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::endpoint::{EndpointError, connect_with};
use crate::framed::{
    BudgetHeld, DataStreamReader, FramedError, MessageReader, ReadBudget, StreamFrame, send,
};
use crate::identity::Role;
use crate::reception::FrameInfo;

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
    /// One frame of `version`, its BLAKE3 checked and its kind parsed, as soon as it arrived
    /// on a stripe of `transmission`.
    Frame {
        version: u64,
        delta_id: [u8; 32],
        transmission: u32,
        info: FrameInfo,
        frame: StreamFrame,
        /// Its bytes in the subscription's [`ReadBudget`], given back once the receiving
        /// core counts them.
        held: Option<BudgetHeld>,
    },
    /// A frame whose hash checked but whose content is not of the announced delta (or does not
    /// parse): dropped, not delivered.
    BadFrame {
        version: u64,
        error: String,
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

/// Why a source could not be reached or subscribed to.
#[derive(Debug, Error)]
pub enum UpstreamError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Framed(#[from] FramedError),
    #[error("open control stream")]
    Connection(#[from] quinn::ConnectionError),
    #[error("refused: {reason:?}: {detail}")]
    Refused {
        reason: RefuseReason,
        detail: String,
    },
    #[error("unexpected answer to Hello: {0}")]
    Unexpected(String),
}

/// A connection to a source that welcomed us; [`subscribe`](Self::subscribe) starts the
/// events.
#[derive(Debug)]
pub struct Upstream {
    pub conn: Connection,
    /// Our half of the control stream (for `Subscribe`, `Resume`, `Fetch`, `Active`).
    pub control: SendStream,
    /// The newest version the upstream had when it welcomed us.
    pub latest: u64,
    reader: Option<MessageReader>,
    events: mpsc::Receiver<UpstreamEvent>,
    tx: mpsc::Sender<UpstreamEvent>,
    /// The tasks that read the connection (control stream, each data stream): owned by the
    /// subscription, aborted when it is dropped.
    readers: JoinSet<()>,
}

impl Upstream {
    /// Connects over `endpoint` (with `config`: the link's transport parameters) to the
    /// server (`role`, `name`) at `addr` and says `hello`; the server's `Welcome` says what it
    /// holds.
    pub async fn connect(
        endpoint: &Endpoint,
        config: ClientConfig,
        addr: SocketAddr,
        role: Role,
        name: &str,
        hello: &Message,
    ) -> Result<Self, UpstreamError> {
        let conn = connect_with(endpoint, config, addr, role, name).await?;
        let (mut control, rx) = conn.open_bi().await?;
        let mut reader = MessageReader::new(rx);
        send(&mut control, hello).await?;
        let latest = match reader.next().await? {
            Some(Message::Welcome { latest_version }) => latest_version,
            Some(Message::Refuse { reason, detail }) => {
                return Err(UpstreamError::Refused { reason, detail });
            }
            other => return Err(UpstreamError::Unexpected(format!("{other:?}"))),
        };
        let (tx, events) = mpsc::channel(256);
        Ok(Self {
            conn,
            control,
            latest,
            reader: Some(reader),
            events,
            tx,
            readers: JoinSet::new(),
        })
    }

    /// Sends `message` on the control stream.
    pub async fn send(&mut self, message: &Message) -> Result<(), FramedError> {
        send(&mut self.control, message).await
    }

    /// Subscribes after `after_version` and starts reading what the source sends.
    pub async fn subscribe(&mut self, after_version: u64) -> Result<(), FramedError> {
        send(&mut self.control, &Message::Subscribe { after_version }).await?;
        let Some(mut reader) = self.reader.take() else {
            return Ok(());
        };
        let data_conn = self.conn.clone();
        let data_tx = self.tx.clone();
        // What the subscription's streams may hold of frames before the core has them.
        let budget = ReadBudget::new(ReadBudget::DEFAULT_BYTES);
        self.readers.spawn(async move {
            // Each data stream's reader is owned by this task, so by the subscription.
            let mut streams = JoinSet::new();
            while let Ok(recv) = data_conn.accept_uni().await {
                while streams.try_join_next().is_some() {}
                streams.spawn(read_data_stream(recv, budget.clone(), data_tx.clone()));
            }
            while streams.join_next().await.is_some() {}
        });
        let tx = self.tx.clone();
        self.readers.spawn(async move {
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
                    Err(e) => UpstreamEvent::Closed(starling_process::error_chain(&e)),
                };
                let closed = matches!(ev, UpstreamEvent::Closed(_));
                if tx.send(ev).await.is_err() || closed {
                    return;
                }
            }
        });
        Ok(())
    }

    /// The next event; `None` once the subscription's readers are gone.
    pub async fn next_event(&mut self) -> Option<UpstreamEvent> {
        self.events.recv().await
    }

    /// Closes the connection (the endpoint tells the peer; it outlives this subscription).
    pub fn close(self) {
        self.conn.close(0u32.into(), b"bye");
    }
}

/// Asks the server (`role`, `name`) at `addr` which version it holds (its `Welcome`), and
/// closes the connection without subscribing.
pub async fn probe(
    endpoint: &Endpoint,
    config: ClientConfig,
    addr: SocketAddr,
    role: Role,
    name: &str,
    hello: &Message,
) -> Result<u64, UpstreamError> {
    let up = Upstream::connect(endpoint, config, addr, role, name, hello).await?;
    let latest = up.latest;
    up.close();
    Ok(latest)
}

/// Turns one data stream into events: its start, each verified frame, its end.
async fn read_data_stream(
    recv: quinn::RecvStream,
    budget: ReadBudget,
    ev: mpsc::Sender<UpstreamEvent>,
) {
    let mut r = DataStreamReader::within(recv, budget);
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
        Err(e) => return tracing::warn!("data stream: {}", starling_process::error_chain(&e)),
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
        match r.budgeted_frame().await {
            Ok(Some((frame, held))) => {
                let f = match FrameInfo::parse(frame.kind, frame.body(), delta_id) {
                    Ok(info) => UpstreamEvent::Frame {
                        version,
                        delta_id,
                        transmission,
                        info,
                        frame,
                        held,
                    },
                    Err(e) => UpstreamEvent::BadFrame {
                        version,
                        error: e.to_string(),
                    },
                };
                if ev.send(f).await.is_err() {
                    return;
                }
            }
            Ok(None) => break None,
            Err(e) => break Some(starling_process::error_chain(&e)),
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

/// A source a receiver may follow: who it is and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceAddr {
    pub role: Role,
    pub name: String,
    pub addr: SocketAddr,
}

/// How long a probe of the preferred source may take: a source on the region's LAN answers
/// in milliseconds (tens under load); a dead one never does, and QUIC resends its first
/// packet with a doubling delay, so a probe begun long before a relay came back would notice
/// it late — a new one every [`PolicyConfig::probe_every`](crate::follow::PolicyConfig) after
/// this notices it at once.
pub const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// What the [`Feed`] has for its shell.
#[derive(Debug)]
pub enum Input {
    /// For the receiving core.
    Event(crate::follow::Event<StreamFrame>),
    /// The source of `conn` was not reached or refused this receiver (`error` says which:
    /// some are fatal to a shell, such as credentials of another cluster).
    ConnectFailed {
        conn: crate::follow::ConnId,
        error: UpstreamError,
    },
    /// The upstream answered a [`Feed::ping`] after this round trip (the control stream's,
    /// queued behind whatever data the link carries).
    Pong(std::time::Duration),
}

/// The I/O side of following sources, shared by the relay's and the actor's shells: runs the
/// receiving core's connection actions (connect, subscribe, send, disconnect, probe) over the
/// process's one endpoint, each connection attempt and probe in a task of its own (owned here,
/// never awaited inside the shell's wait), and turns what arrives into core events. Frames are
/// counted in `metrics` (received bytes by source name); broken stripes, frames that do not
/// parse, refusals and lost connections are logged here.
#[derive(Debug)]
pub struct Feed {
    endpoint: Endpoint,
    config: ClientConfig,
    sources: Vec<SourceAddr>,
    metrics: starling_telemetry::Metrics,
    up: Option<(crate::follow::ConnId, crate::follow::SourceId, Upstream)>,
    connecting: Option<Pending<Result<Upstream, UpstreamError>>>,
    probing: Option<Pending<Option<u64>>>,
    anchor: Option<(crate::follow::ConnId, AnchorSeal, DataStreamReader)>,
    /// The clock of ping nonces (microseconds since the feed was made).
    epoch: std::time::Instant,
}

/// A task of the feed's: what it is for and its handle.
#[derive(Debug)]
struct Pending<T> {
    conn: crate::follow::ConnId,
    source: crate::follow::SourceId,
    task: tokio_util::task::AbortOnDropHandle<T>,
}

impl Feed {
    /// A feed over `endpoint`, connecting with `config` (the link's transport parameters).
    pub fn new(
        endpoint: Endpoint,
        config: ClientConfig,
        sources: Vec<SourceAddr>,
        metrics: starling_telemetry::Metrics,
    ) -> Self {
        Self {
            endpoint,
            config,
            sources,
            metrics,
            up: None,
            connecting: None,
            probing: None,
            anchor: None,
            epoch: std::time::Instant::now(),
        }
    }

    /// Sends `Ping` on the current subscription's control stream; its `Pong` comes back as
    /// [`Input::Pong`] with the round trip.
    pub async fn ping(&mut self) -> bool {
        let nonce = self.epoch.elapsed().as_micros() as u64;
        self.send_current(&Message::Ping { nonce }).await
    }

    /// The source at `source`.
    pub fn source(&self, source: crate::follow::SourceId) -> Option<&SourceAddr> {
        self.sources.get(source.0)
    }

    /// The source followed now, if connected.
    pub fn current(&self) -> Option<&SourceAddr> {
        self.up.as_ref().and_then(|(_, s, _)| self.source(*s))
    }

    /// Starts connecting to `source` as `conn`, saying `hello`; the answer comes from
    /// [`next`](Self::next). A connection attempt under way is abandoned.
    pub fn connect(
        &mut self,
        conn: crate::follow::ConnId,
        source: crate::follow::SourceId,
        hello: Message,
    ) {
        let Some(s) = self.source(source).cloned() else {
            return;
        };
        let (endpoint, config) = (self.endpoint.clone(), self.config.clone());
        let task = tokio::spawn(async move {
            Upstream::connect(&endpoint, config, s.addr, s.role, &s.name, &hello).await
        });
        self.connecting = Some(Pending {
            conn,
            source,
            task: tokio_util::task::AbortOnDropHandle::new(task),
        });
    }

    /// Sends `message` on `conn` (`Subscribe` starts its events); `false` if `conn` is not
    /// the connection followed or the send failed (the connection's end arrives as an event).
    pub async fn send(&mut self, conn: crate::follow::ConnId, message: &Message) -> bool {
        let Some((c, _, up)) = &mut self.up else {
            return false;
        };
        if *c != conn {
            return false;
        }
        let sent = match message {
            Message::Subscribe { after_version } => up.subscribe(*after_version).await,
            m => up.send(m).await,
        };
        if let Err(e) = &sent {
            tracing::debug!("not sent upstream: {}", starling_process::error_chain(e));
        }
        sent.is_ok()
    }

    /// Notes that (`segments` segments of; 0: all of) `version` is asked for again from the
    /// source followed now: logged, and counted by source.
    pub fn refetching(&self, version: u64, segments: usize) {
        let name = self.current().map(|s| s.name.as_str()).unwrap_or_default();
        tracing::warn!(
            source = name,
            version,
            segments,
            "fetching it again (0 segments: all)"
        );
        self.metrics.refetch(name);
    }

    /// Sends `message` on the connection followed now, if any (reports: `Active`, `Staged`,
    /// `Ping`).
    pub async fn send_current(&mut self, message: &Message) -> bool {
        match self.up.as_ref().map(|(c, _, _)| *c) {
            Some(conn) => self.send(conn, message).await,
            None => false,
        }
    }

    /// Closes `conn` (or abandons connecting as `conn`); returns the source it was to.
    pub fn disconnect(&mut self, conn: crate::follow::ConnId) -> Option<crate::follow::SourceId> {
        if self.connecting.as_ref().is_some_and(|p| p.conn == conn) {
            return self.connecting.take().map(|p| p.source);
        }
        if self.up.as_ref().is_some_and(|(c, _, _)| *c == conn) {
            self.anchor = None;
            return self.up.take().map(|(_, source, up)| {
                up.close();
                source
            });
        }
        None
    }

    /// Asks `source` which version it holds, saying `hello`, in a task of its own (at most
    /// [`PROBE_TIMEOUT`]); the answer comes from [`next`](Self::next).
    pub fn probe(&mut self, source: crate::follow::SourceId, hello: Message) {
        let Some(s) = self.source(source).cloned() else {
            return;
        };
        let (endpoint, config) = (self.endpoint.clone(), self.config.clone());
        let task = tokio::spawn(async move {
            let asked = probe(&endpoint, config, s.addr, s.role, &s.name, &hello);
            tokio::time::timeout(PROBE_TIMEOUT, asked)
                .await
                .ok()
                .and_then(Result::ok)
        });
        self.probing = Some(Pending {
            conn: crate::follow::ConnId(u64::MAX),
            source,
            task: tokio_util::task::AbortOnDropHandle::new(task),
        });
    }

    /// The anchor offered on `conn`: its seal and the stream its bytes follow on.
    pub fn take_anchor(
        &mut self,
        conn: crate::follow::ConnId,
    ) -> Option<(AnchorSeal, DataStreamReader)> {
        match self.anchor.take() {
            Some((c, seal, stream)) if c == conn => Some((seal, stream)),
            _ => None,
        }
    }

    /// The next thing for the shell. Cancellation-safe: nothing is lost when another branch
    /// of the shell's `select!` wins.
    pub async fn next(&mut self) -> Input {
        use crate::follow::Event;
        loop {
            tokio::select! {
                ev = async {
                    match &mut self.up {
                        Some((_, _, up)) => up.next_event().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if let Some(input) = self.upstream_event(ev) {
                        return input;
                    }
                }
                done = async {
                    match &mut self.connecting {
                        Some(p) => (&mut p.task).await,
                        None => std::future::pending().await,
                    }
                } => {
                    let Some(p) = self.connecting.take() else { continue };
                    let result = done.unwrap_or_else(|e| {
                        Err(UpstreamError::Unexpected(format!("connection task: {e}")))
                    });
                    match result {
                        Ok(up) => {
                            let latest = up.latest;
                            self.up = Some((p.conn, p.source, up));
                            return Input::Event(Event::Connected { conn: p.conn, latest });
                        }
                        Err(error) => return Input::ConnectFailed { conn: p.conn, error },
                    }
                }
                done = async {
                    match &mut self.probing {
                        Some(p) => (&mut p.task).await,
                        None => std::future::pending().await,
                    }
                } => {
                    let Some(p) = self.probing.take() else { continue };
                    let latest = done.ok().flatten();
                    return Input::Event(Event::Probed { source: p.source, latest });
                }
            }
        }
    }

    /// An upstream event as the core's, or `None` for what only needed logging.
    fn upstream_event(&mut self, ev: Option<UpstreamEvent>) -> Option<Input> {
        use crate::follow::Event;
        let (conn, source, _) = self.up.as_ref()?;
        let (conn, source) = (*conn, *source);
        let name = self
            .source(source)
            .map(|s| s.name.clone())
            .unwrap_or_default();
        let ev = match ev {
            None => UpstreamEvent::Closed("the subscription ended".into()),
            Some(ev) => ev,
        };
        Some(Input::Event(match ev {
            UpstreamEvent::StreamStarted {
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
            UpstreamEvent::Frame {
                version,
                delta_id,
                transmission,
                info,
                frame,
                held: _,
            } => {
                let bytes = frame.bytes.len() as u64;
                self.metrics.received(&name, bytes, 1);
                Event::Frame {
                    conn,
                    version,
                    delta_id,
                    transmission,
                    info,
                    bytes,
                    frame,
                }
            }
            UpstreamEvent::BadFrame { version, error } => {
                tracing::warn!(source = %name, version, "dropped a frame: {error}");
                return None;
            }
            UpstreamEvent::StreamEnded {
                version,
                delta_id,
                transmission,
                stripes,
                error,
            } => {
                if let Some(e) = error {
                    tracing::warn!(source = %name, version, "a stream broke: {e}");
                }
                Event::StreamEnded {
                    conn,
                    version,
                    delta_id,
                    transmission,
                    stripes,
                }
            }
            UpstreamEvent::Anchor { seal, stream } => {
                let version = seal.version;
                self.anchor = Some((conn, seal, stream));
                Event::AnchorOffered { conn, version }
            }
            UpstreamEvent::Commit(version) => Event::Commit { conn, version },
            UpstreamEvent::Pong(nonce) => {
                let now = self.epoch.elapsed().as_micros() as u64;
                let rtt = std::time::Duration::from_micros(now.saturating_sub(nonce));
                return Some(Input::Pong(rtt));
            }
            UpstreamEvent::Refused { reason, detail } => {
                tracing::warn!(source = %name, "upstream refused: {reason:?}: {detail}");
                Event::Refused { conn, reason }
            }
            UpstreamEvent::Closed(why) => {
                tracing::warn!(source = %name, "source lost: {why}");
                if let Some((_, _, up)) = self.up.take() {
                    up.close();
                }
                self.anchor = None;
                Event::Lost { conn }
            }
        }))
    }
}
