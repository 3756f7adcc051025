//! Serving versions to one subscriber: shared by the hub and the relays.
//!
//! For each version after the one the subscriber holds, in order, [`serve_subscriber`]
//! opens `stripes` unidirectional streams at once; stream *i* carries `Announce` and then
//! frames *i*, *i + stripes*, … of the [`LiveVersion`] — each sent the moment it exists, so a
//! version flows through while it is still being encoded (hub) or received (relay). Several
//! streams keep one lost packet from stalling the whole version behind it (QUIC delivers
//! each stream in order, not the connection). When the version is complete and every
//! stripe is written, `Commit` follows on the control stream, which has a higher send
//! priority than data so that control traffic is not queued behind a transfer.
//!
//! The subscriber may send `Fetch { version, seqs }` (those segments, or the whole version
//! when `seqs` is empty; answered with a new transmission and `Commit` again), `Ping`
//! (answered with `Pong` at once) and `Active` (logged). A slow subscriber only delays
//! itself: it has its own tasks, reading from the shared book.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use quinn::{Connection, SendStream};
use starling_proto::msg::{MAX_STRIPES, Message, RefuseReason};
use thiserror::Error;
use tokio::sync::mpsc;

use crate::book::{Lookup, Next, Progress, VersionBook, WireFrame};
use crate::framed::{FramedError, MessageReader, send};
use starling_telemetry::Metrics;

/// Why serving a subscriber ended.
#[derive(Debug, Error)]
pub enum FanoutError {
    #[error(transparent)]
    Framed(#[from] FramedError),
    #[error("open data stream: {0}")]
    Open(#[from] quinn::ConnectionError),
    #[error("send data: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("finish data stream: {0}")]
    Closed(#[from] quinn::ClosedStream),
    #[error("expected Subscribe, got {0}")]
    NoSubscribe(String),
    #[error("the control stream writer stopped")]
    ControlGone,
}

/// Send priority of the control stream (data streams have 0): a `Commit` or `Pong` goes
/// out ahead of queued segment bytes.
pub const CONTROL_PRIORITY: i32 = 100;

/// How a server sends.
#[derive(Debug, Clone)]
pub struct FanoutConfig {
    /// Streams per transmission (1..=MAX_STRIPES).
    pub stripes: u16,
}

impl Default for FanoutConfig {
    fn default() -> Self {
        Self { stripes: 4 }
    }
}

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
    let _ = control.set_priority(CONTROL_PRIORITY);
    let ctl = spawn_control_writer(control);
    let sender = Arc::new(Sender {
        conn: conn.clone(),
        stripes: cfg.stripes.clamp(1, MAX_STRIPES),
        transmissions: AtomicU32::new(0),
        name: name.clone(),
        metrics,
    });
    // Requests from the subscriber, answered concurrently with the version stream.
    {
        let book = book.clone();
        let sender = sender.clone();
        let ctl = ctl.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = reader.next().await {
                match m {
                    Message::Fetch { version, seqs } => {
                        let (book, sender, ctl) = (book.clone(), sender.clone(), ctl.clone());
                        tokio::spawn(async move {
                            if let Err(e) = sender.resend(&book, &ctl, version, seqs).await {
                                eprintln!("resend {version} to {}: {e}", sender.name);
                            }
                        });
                    }
                    Message::Ping { nonce } => {
                        if ctl.send(Message::Pong { nonce }).await.is_err() {
                            break;
                        }
                    }
                    Message::Active { version, .. } => {
                        eprintln!("{} active at version {version}", sender.name)
                    }
                    other => eprintln!("{}: ignored {other:?}", sender.name),
                }
            }
        });
    }
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
        match sender.transmit(&live, None).await? {
            Progress::Complete => {
                ctl.send(Message::Commit { version: next })
                    .await
                    .map_err(|_| FanoutError::ControlGone)?;
                eprintln!("sent version {next} to {name}");
                next += 1;
            }
            // The producer gave up on this attempt; the next one has the same number.
            Progress::Aborted | Progress::Streaming => {}
        }
    }
}

/// Writes control messages from several tasks onto the one control stream, in order.
fn spawn_control_writer(mut control: SendStream) -> mpsc::Sender<Message> {
    let (tx, mut rx) = mpsc::channel::<Message>(256);
    tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if send(&mut control, &m).await.is_err() {
                return;
            }
        }
        let _ = control.finish();
    });
    tx
}

#[derive(Debug)]
struct Sender {
    conn: Connection,
    stripes: u16,
    transmissions: AtomicU32,
    name: String,
    metrics: Metrics,
}

impl Sender {
    /// Sends one transmission of `live` — every frame, or only the segments in `only` — over
    /// up to `stripes` streams, following the version while it grows. Returns how the
    /// version ended.
    async fn transmit(
        &self,
        live: &Arc<crate::book::LiveVersion>,
        only: Option<Arc<BTreeSet<u32>>>,
    ) -> Result<Progress, FanoutError> {
        let transmission = self.transmissions.fetch_add(1, Ordering::Relaxed);
        let stripes = match &only {
            Some(s) => self.stripes.min(s.len().max(1) as u16),
            None => self.stripes,
        };
        let corrupt = take_fault(live.version);
        let mut tasks = Vec::with_capacity(stripes as usize);
        for stripe in 0..stripes {
            let mut data = self.conn.open_uni().await?;
            let live = live.clone();
            let only = only.clone();
            let metrics = self.metrics.clone();
            let name = self.name.clone();
            tasks.push(tokio::spawn(async move {
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
                    if let Some(set) = &only
                        && !frame.seq.is_some_and(|s| set.contains(&s))
                    {
                        continue;
                    }
                    write_frame(&mut data, &frame, corrupt && stripe == 0 && sent == 0).await?;
                    sent += 1;
                    metrics.sent(
                        &name,
                        frame.bytes.len() as u64,
                        u64::from(frame.seq.is_some()),
                    );
                };
                if end == Progress::Aborted {
                    let _ = data.reset(0u32.into());
                } else {
                    data.finish()?;
                }
                Ok::<Progress, FanoutError>(end)
            }));
        }
        let mut progress = Progress::Complete;
        for t in tasks {
            match t.await {
                Ok(Ok(p)) => {
                    if p != Progress::Complete {
                        progress = p;
                    }
                }
                Ok(Err(e)) => return Err(e),
                Err(join) => {
                    eprintln!("stripe task of version {}: {join}", live.version);
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
        seqs: Vec<u32>,
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
        let only = (!seqs.is_empty()).then(|| Arc::new(seqs.into_iter().collect()));
        if self.transmit(&live, only).await? == Progress::Complete {
            eprintln!("sent version {version} to {} again", self.name);
            let _ = ctl.send(Message::Commit { version }).await;
        }
        Ok(())
    }
}

async fn write_frame(
    data: &mut SendStream,
    frame: &WireFrame,
    corrupt: bool,
) -> Result<(), FanoutError> {
    if corrupt && frame.bytes.len() > 64 {
        let mut bad = frame.bytes.clone();
        bad[40] ^= 0x01;
        eprintln!("fault injection: corrupted a segment in the first transmission");
        data.write_all(&bad).await?;
    } else {
        data.write_all(&frame.bytes).await?;
    }
    Ok(())
}

/// Test-only fault injection: a version whose first transmission by this process gets one
/// byte flipped inside its first segment. Never set in production.
pub const FAULT_CORRUPT_VERSION: &str = "STARLING_TEST_CORRUPT_VERSION";

static CORRUPT_ONCE: Mutex<Option<Option<u64>>> = Mutex::new(None);

fn take_fault(v: u64) -> bool {
    let Ok(mut c) = CORRUPT_ONCE.lock() else {
        return false;
    };
    let armed = c.get_or_insert_with(|| {
        std::env::var(FAULT_CORRUPT_VERSION)
            .ok()
            .and_then(|s| s.parse().ok())
    });
    if *armed == Some(v) {
        *armed = None;
        true
    } else {
        false
    }
}
