//! Serving versions to one subscriber: shared by the hub and the relays.
//!
//! For each version after the one the subscriber holds, in order, [`serve_subscriber`]
//! opens `stripes` unidirectional streams at once; stream *i* carries `Announce` and then
//! frames *i*, *i + stripes*, … of the [`LiveVersion`](crate::book::LiveVersion) — each sent the moment it exists, so a
//! version flows through while it is still being encoded (hub) or received (relay). Several
//! streams keep one lost packet from stalling the whole version behind it (QUIC delivers
//! each stream in order, not the connection). When the version is complete and every
//! stripe is written, `Commit` follows on the control stream, which has a higher send
//! priority than data so that control traffic is not queued behind a transfer.
//!
//! The subscriber may send `Fetch { version, seqs }` (those segments, or the whole version
//! when `seqs` is empty; answered with a new transmission and `Commit` again),
//! `Resume { version, have }` (after failing over: the version minus what it has),
//! `FetchAnchor` (answered with the newest anchor on its own stream, when the subscriber is
//! behind the retained deltas), `Ping` (answered with `Pong` at once) and `Active` (logged). A slow subscriber only delays
//! itself: it has its own tasks, reading from the shared book.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use quinn::{Connection, SendStream};
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::protocol::msg::{MAX_STRIPES, Message, RefuseReason};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::book::{Lookup, Next, Progress, VersionBook, WireFrame};
use crate::framed::{FramedError, MessageReader, send};
use starling_telemetry::Metrics;

/// Why serving a subscriber ended.
#[derive(Debug, Error)]
pub enum FanoutError {
    #[error(transparent)]
    Framed(#[from] FramedError),
    #[error("open data stream")]
    Open(#[from] quinn::ConnectionError),
    #[error("send data")]
    Write(#[from] quinn::WriteError),
    #[error("finish data stream")]
    Closed(#[from] quinn::ClosedStream),
    #[error("expected Subscribe, got {0}")]
    NoSubscribe(String),
    #[error("the control stream writer stopped")]
    ControlGone,
    #[error("anchor: {0}")]
    Anchor(String),
}

/// Send priority of the control stream (data streams have 0): a `Commit` or `Pong` goes
/// out ahead of queued segment bytes.
pub const CONTROL_PRIORITY: i32 = 100;

/// Where a server finds the anchor (full checkpoint) it offers to subscribers that are
/// further behind than its retained deltas.
pub trait AnchorSource: Send + Sync + std::fmt::Debug {
    /// The newest anchor: its file and seal.
    fn newest(&self) -> Option<(PathBuf, AnchorSeal)>;
}

/// What a server learns about its subscribers as it serves them, for its status page (the
/// hub's run board, a relay's own status). Every method has an empty default; calls come from
/// the subscriber's tasks and must return at once (no I/O, no awaiting).
pub trait SubscriberObserver: Send + Sync + std::fmt::Debug {
    /// `peer` subscribed after `after` (told by [`crate::downstream`]'s accept loop).
    fn subscribed(&self, _peer: &str, _after: u64) {}
    /// `peer`'s subscription ended (told by [`crate::downstream`]'s accept loop).
    fn left(&self, _peer: &str) {}
    /// `bytes` of `version` went out to `peer`.
    fn sent(&self, _peer: &str, _version: u64, _bytes: u64) {}
    /// Every frame of `version` went out to `peer` and `Commit` followed.
    fn delivered(&self, _peer: &str, _version: u64) {}
    /// `peer` reported `version` received whole and verified (`Staged` with nothing missing).
    fn staged(&self, _peer: &str, _version: u64) {}
    /// `peer` reported `version` active.
    fn active(&self, _peer: &str, _version: u64) {}
    /// `peer` asked for `segments` segments of `version` again (0: the whole version).
    fn refetch(&self, _peer: &str, _version: u64, _segments: usize) {}
}

/// How a server sends.
#[derive(Debug, Clone)]
pub struct FanoutConfig {
    /// Streams per transmission (1..=MAX_STRIPES).
    pub stripes: u16,
    /// Anchors offered on `FetchAnchor` (none: refused).
    pub anchors: Option<Arc<dyn AnchorSource>>,
    /// Told about each subscriber's progress (none: nobody listens).
    pub observer: Option<Arc<dyn SubscriberObserver>>,
}

impl Default for FanoutConfig {
    fn default() -> Self {
        Self {
            stripes: 4,
            anchors: None,
            observer: None,
        }
    }
}

/// The observer that ignores everything, for servers without one.
#[derive(Debug)]
struct Unobserved;

impl SubscriberObserver for Unobserved {}

/// Serves one subscriber after the caller accepted its `Hello` and sent `Welcome`: waits for
/// `Subscribe`, then streams versions until the connection ends.
pub async fn serve_subscriber(
    book: Arc<VersionBook>,
    conn: Connection,
    control: SendStream,
    mut reader: MessageReader,
    name: String,
    cfg: FanoutConfig,
    metrics: Metrics,
) -> Result<(), FanoutError> {
    let after = match reader.next().await? {
        Some(Message::Subscribe { after_version }) => after_version,
        other => return Err(FanoutError::NoSubscribe(format!("{other:?}"))),
    };
    serve_subscription(book, conn, control, reader, name, cfg, metrics, after).await
}

/// [`serve_subscriber`] once its `Subscribe { after_version: after }` was read (by a server
/// that reads a connection's first message itself to tell subscriptions from other work).
#[allow(clippy::too_many_arguments)]
pub async fn serve_subscription(
    book: Arc<VersionBook>,
    conn: Connection,
    control: SendStream,
    reader: MessageReader,
    name: String,
    cfg: FanoutConfig,
    metrics: Metrics,
    after: u64,
) -> Result<(), FanoutError> {
    let _ = control.set_priority(CONTROL_PRIORITY);
    let anchors = cfg.anchors.clone();
    let observer: Arc<dyn SubscriberObserver> =
        cfg.observer.clone().unwrap_or(Arc::new(Unobserved));
    let (ctl, control_writer) = control_writer(control);
    let sender = Arc::new(Sender {
        conn: conn.clone(),
        stripes: cfg.stripes.clamp(1, MAX_STRIPES),
        transmissions: AtomicU32::new(0),
        name: name.clone(),
        metrics,
        observer: observer.clone(),
    });
    // Requests from the subscriber, answered concurrently with the version stream. Every
    // task of this subscription lives in `owned`: when the subscription ends (or the future
    // serving it is dropped), they are aborted with it.
    let mut owned = JoinSet::new();
    owned.spawn(control_writer);
    owned.spawn(answer_requests(
        reader,
        book.clone(),
        sender.clone(),
        ctl.clone(),
        anchors,
    ));
    let mut next = after + 1;
    loop {
        let live = tokio::select! {
            l = book.wait_for(next) => l,
            _ = conn.closed() => return Ok(()),
        };
        let live = match live {
            Lookup::Live(l) => l,
            Lookup::Gone => {
                let detail = format!(
                    "version {next} is no longer retained here (oldest {})",
                    book.oldest()
                );
                ctl.send(Message::Refuse {
                    reason: RefuseReason::VersionUnavailable,
                    detail,
                })
                .await
                .map_err(|_| FanoutError::ControlGone)?;
                // The subscriber must restore from an anchor and subscribe again.
                conn.closed().await;
                return Ok(());
            }
        };
        match sender.transmit(&live, Filter::All).await? {
            Progress::Complete => {
                ctl.send(Message::Commit { version: next })
                    .await
                    .map_err(|_| FanoutError::ControlGone)?;
                tracing::info!(peer = %name, version = next, "version sent");
                sender.observer.delivered(&name, next);
                next += 1;
            }
            // The producer gave up on this attempt; the next one has the same number.
            Progress::Aborted | Progress::Streaming => {}
        }
    }
}

/// Answers `FetchAnchor`: the newest anchor, if it is newer than what the subscriber holds,
/// on its own stream (`Anchor { seal }`, then the file's bytes); else a refusal.
async fn send_anchor(
    conn: &Connection,
    ctl: &mpsc::Sender<Message>,
    anchors: Option<&dyn AnchorSource>,
    after_version: u64,
) -> Result<(), FanoutError> {
    use tokio::io::AsyncReadExt;
    let newest = anchors.and_then(|a| a.newest());
    let Some((path, seal)) = newest.filter(|(_, s)| s.version > after_version) else {
        let _ = ctl
            .send(Message::Refuse {
                reason: RefuseReason::VersionUnavailable,
                detail: format!("no anchor after version {after_version} here"),
            })
            .await;
        return Ok(());
    };
    let mut file = tokio::fs::File::open(&path)
        .await
        .map_err(|e| FanoutError::Anchor(format!("open {}: {e}", path.display())))?;
    let mut data = conn.open_uni().await?;
    let mut head = Vec::new();
    Message::Anchor { seal }.encode(&mut head);
    data.write_all(&head).await?;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = seal.size;
    while left > 0 {
        let n = file
            .read(&mut buf)
            .await
            .map_err(|e| FanoutError::Anchor(format!("read {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        let n = n.min(left as usize);
        data.write_all(&buf[..n]).await?;
        left -= n as u64;
    }
    data.finish()?;
    tracing::info!(version = seal.version, "anchor sent");
    Ok(())
}

/// Most `Fetch`/`Resume`/`FetchAnchor` requests of one subscriber answered at once; a further
/// request waits (and with it the subscriber's control stream: QUIC flow control pushes back)
/// until one is answered. Each answer is a whole transmission at most, so a subscriber cannot
/// make its server hold more than this many copies of its work in flight.
pub const MAX_REQUESTS_IN_FLIGHT: usize = 4;

/// Reads the subscriber's control stream and answers it until it ends: pings at once, the
/// heavier requests as tasks of their own (at most [`MAX_REQUESTS_IN_FLIGHT`]), owned here.
async fn answer_requests(
    mut reader: MessageReader,
    book: Arc<VersionBook>,
    sender: Arc<Sender>,
    ctl: mpsc::Sender<Message>,
    anchors: Option<Arc<dyn AnchorSource>>,
) {
    let mut requests: JoinSet<()> = JoinSet::new();
    while let Ok(Some(m)) = reader.next().await {
        while requests.try_join_next().is_some() {}
        let heavy = matches!(
            m,
            Message::Fetch { .. } | Message::Resume { .. } | Message::FetchAnchor { .. }
        );
        if heavy && requests.len() >= MAX_REQUESTS_IN_FLIGHT {
            tracing::debug!(peer = %sender.name, "request waits for one in flight");
            requests.join_next().await;
        }
        match m {
            Message::Fetch { version, seqs } => {
                tracing::warn!(peer = %sender.name, version, segments = seqs.len(), "refetch requested");
                sender.observer.refetch(&sender.name, version, seqs.len());
                let (book, sender, ctl) = (book.clone(), sender.clone(), ctl.clone());
                requests.spawn(async move {
                    let only = if seqs.is_empty() {
                        Filter::All
                    } else {
                        Filter::Only(Arc::new(seqs.into_iter().collect()))
                    };
                    if let Err(e) = sender.resend(&book, &ctl, version, only).await {
                        tracing::warn!(
                            peer = %sender.name,
                            version,
                            "resend failed: {}",
                            starling_process::error_chain(&e)
                        );
                    }
                });
            }
            Message::Resume { version, have } => {
                let (book, sender, ctl) = (book.clone(), sender.clone(), ctl.clone());
                requests.spawn(async move {
                    let skip = Filter::Except(Arc::new(have.into_iter().collect()));
                    if let Err(e) = sender.resend(&book, &ctl, version, skip).await {
                        tracing::warn!(
                            peer = %sender.name,
                            version,
                            "resume failed: {}",
                            starling_process::error_chain(&e)
                        );
                    }
                });
            }
            Message::FetchAnchor { after_version } => {
                let (conn, ctl) = (sender.conn.clone(), ctl.clone());
                let anchors = anchors.clone();
                let name = sender.name.clone();
                requests.spawn(async move {
                    if let Err(e) =
                        send_anchor(&conn, &ctl, anchors.as_deref(), after_version).await
                    {
                        tracing::warn!(
                            peer = %name,
                            "anchor not sent: {}",
                            starling_process::error_chain(&e)
                        );
                    }
                });
            }
            Message::Ping { nonce } => {
                if ctl.send(Message::Pong { nonce }).await.is_err() {
                    break;
                }
            }
            Message::Active { version, .. } => {
                tracing::info!(peer = %sender.name, version, "subscriber active");
                sender.observer.active(&sender.name, version);
            }
            Message::Staged { version, missing } if missing.is_empty() => {
                tracing::debug!(peer = %sender.name, version, "subscriber staged");
                sender.observer.staged(&sender.name, version);
            }
            other => tracing::debug!(peer = %sender.name, "ignored {other:?}"),
        }
    }
    // The control stream ended: requests still in flight finish (the connection may still
    // carry them), owned by this task until then.
    while requests.join_next().await.is_some() {}
}

/// Writes control messages from several tasks onto the one control stream, in order: the
/// sender, and the writer's future (to be spawned by the caller, who owns it).
fn control_writer(
    mut control: SendStream,
) -> (
    mpsc::Sender<Message>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, mut rx) = mpsc::channel::<Message>(256);
    let writer = async move {
        while let Some(m) = rx.recv().await {
            if send(&mut control, &m).await.is_err() {
                return;
            }
        }
        let _ = control.finish();
    };
    (tx, writer)
}

/// Which frames of a version a transmission carries.
#[derive(Debug, Clone)]
enum Filter {
    All,
    /// These segments only (a `Fetch` of what is missing).
    Only(Arc<BTreeSet<u32>>),
    /// Everything but these segments (a `Resume` on a new source).
    Except(Arc<BTreeSet<u32>>),
}

impl Filter {
    fn passes(&self, frame: &WireFrame) -> bool {
        match (self, frame.seq) {
            (Self::All, _) => true,
            (Self::Only(s), Some(seq)) => s.contains(&seq),
            (Self::Only(_), None) => false,
            (Self::Except(s), Some(seq)) => !s.contains(&seq),
            (Self::Except(_), None) => true,
        }
    }
}

#[derive(Debug)]
struct Sender {
    conn: Connection,
    stripes: u16,
    transmissions: AtomicU32,
    name: String,
    metrics: Metrics,
    observer: Arc<dyn SubscriberObserver>,
}

impl Sender {
    /// Sends one transmission of `live` — every frame, or only the segments in `only` — over
    /// up to `stripes` streams, following the version while it grows. Returns how the
    /// version ended.
    async fn transmit(
        &self,
        live: &Arc<crate::book::LiveVersion>,
        only: Filter,
    ) -> Result<Progress, FanoutError> {
        let transmission = self.transmissions.fetch_add(1, Ordering::Relaxed);
        let stripes = match &only {
            Filter::Only(s) => self.stripes.min(s.len().max(1) as u16),
            _ => self.stripes,
        };
        let corrupt = take_fault(live.version);
        // Owned here: if this transmission is dropped (its subscription ended), so are its
        // stripes.
        let mut tasks = JoinSet::new();
        for stripe in 0..stripes {
            let mut data = self.conn.open_uni().await?;
            let live = live.clone();
            let only = only.clone();
            let metrics = self.metrics.clone();
            let observer = self.observer.clone();
            let name = self.name.clone();
            tasks.spawn(async move {
                let mut head = Vec::new();
                Message::Announce {
                    version: live.version,
                    base_version: live.base,
                    delta_id: live.delta_id,
                    transmission,
                    stripes,
                }
                .encode(&mut head);
                data.write_all(&head).await?;
                let mut cursor = live.cursor();
                let mut index = usize::from(stripe);
                let mut sent = 0usize;
                let end = loop {
                    let frame = match cursor.get(index).await {
                        Next::Frame(f) => f,
                        Next::End(p) => break p,
                    };
                    index += usize::from(stripes);
                    if !only.passes(&frame) {
                        continue;
                    }
                    write_frame(&mut data, &frame, corrupt && stripe == 0 && sent == 0).await?;
                    sent += 1;
                    metrics.sent(
                        &name,
                        frame.bytes.len() as u64,
                        u64::from(frame.seq.is_some()),
                    );
                    observer.sent(&name, live.version, frame.bytes.len() as u64);
                };
                if end == Progress::Aborted {
                    let _ = data.reset(0u32.into());
                } else {
                    data.finish()?;
                }
                Ok::<Progress, FanoutError>(end)
            });
        }
        let mut progress = Progress::Complete;
        while let Some(t) = tasks.join_next().await {
            match t {
                Ok(Ok(p)) => {
                    if p != Progress::Complete {
                        progress = p;
                    }
                }
                Ok(Err(e)) => return Err(e),
                Err(join) => {
                    tracing::error!(version = live.version, "stripe task failed: {join}");
                    progress = Progress::Aborted;
                }
            }
        }
        Ok(progress)
    }

    /// Answers `Fetch`: the segments asked for (all frames when `seqs` is empty) of a
    /// version that is complete or still streaming here, then `Commit` again.
    async fn resend(
        &self,
        book: &VersionBook,
        ctl: &mpsc::Sender<Message>,
        version: u64,
        only: Filter,
    ) -> Result<(), FanoutError> {
        let Some(live) = book.get(version) else {
            let detail = format!("version {version} is not retained here");
            let _ = ctl
                .send(Message::Refuse {
                    reason: RefuseReason::VersionUnavailable,
                    detail,
                })
                .await;
            return Ok(());
        };
        if self.transmit(&live, only).await? == Progress::Complete {
            tracing::info!(peer = %self.name, version, "version sent again");
            let _ = ctl.send(Message::Commit { version }).await;
        }
        Ok(())
    }
}

/// A frame's bytes, lent to QUIC for as long as it holds them (until acknowledged): the
/// stream queues the frame itself, where writing a slice made QUIC copy it into a buffer of
/// its own for every subscriber first (the copy into each packet remains).
struct LentFrame(Arc<WireFrame>);

impl AsRef<[u8]> for LentFrame {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes
    }
}

async fn write_frame(
    data: &mut SendStream,
    frame: &Arc<WireFrame>,
    corrupt: bool,
) -> Result<(), FanoutError> {
    if corrupt && frame.bytes.len() > 64 {
        let mut bad = frame.bytes.to_vec();
        bad[40] ^= 0x01;
        tracing::warn!("fault injection: corrupted a segment in the first transmission");
        data.write_all(&bad).await?;
    } else {
        data.write_chunk(bytes::Bytes::from_owner(LentFrame(frame.clone())))
            .await?;
    }
    Ok(())
}

/// Test-only fault injection: the first transmission of `version` by this process gets one
/// byte flipped inside its first segment (the receivers must refuse it, fetch it again and
/// never apply the bad bytes).
///
/// Armed only by a call to this function, which no Starling binary makes: no environment
/// variable, flag or feature turns it on. The end-to-end tests arm it from a test binary of
/// their own (`starling-fault-hub` in `tests/src/bin`), so `cargo build --release --workspace`
/// can unify whatever features it likes: the binaries a user runs have no switch for it.
pub fn inject_corruption(version: u64) {
    tracing::warn!(
        version,
        "fault injection armed: the first transmission will be corrupted"
    );
    *CORRUPT_ONCE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(version);
}

/// The version whose first transmission [`inject_corruption`] armed, until it is taken.
static CORRUPT_ONCE: Mutex<Option<u64>> = Mutex::new(None);

fn take_fault(v: u64) -> bool {
    let mut armed = CORRUPT_ONCE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if *armed == Some(v) {
        *armed = None;
        true
    } else {
        false
    }
}
