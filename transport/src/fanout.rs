//! Serving retained versions to subscribers: shared by the hub and the relays.
//!
//! A [`VersionBook`] holds the deltas a server can send (each as the `.sdc` frames after the
//! file header, verified before they were inserted) and announces each new version. For each
//! subscriber, [`serve_subscriber`] sends every version after the one it holds, in order,
//! each on its own unidirectional stream (`Announce`, then the frames), then `Commit` on the
//! control stream; it resends a version on `Fetch`. A slow subscriber only delays itself:
//! each has its own task, reading from the shared book.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use quinn::{Connection, SendStream};
use starling_proto::msg::{Message, RefuseReason};
use thiserror::Error;
use tokio::sync::{broadcast, mpsc};

use crate::framed::{FramedError, MessageReader, send};

/// One retained delta.
#[derive(Debug, Clone)]
pub struct Retained {
    pub version: u64,
    pub base: u64,
    pub delta_id: [u8; 32],
    /// The frames of the `.sdc` (everything after the 16-byte file header).
    pub frames: Arc<Vec<u8>>,
}

/// The versions a server can send, newest last.
#[derive(Debug)]
pub struct VersionBook {
    inner: Mutex<BookState>,
    events: broadcast::Sender<u64>,
    retain: usize,
}

#[derive(Debug)]
struct BookState {
    latest: u64,
    deltas: BTreeMap<u64, Retained>,
}

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
    #[error("version book lock poisoned")]
    Poisoned,
}

impl VersionBook {
    /// An empty book whose holder is at `latest`; keeps the newest `retain` deltas.
    pub fn new(latest: u64, retain: usize) -> Self {
        let (events, _) = broadcast::channel(1024);
        Self {
            inner: Mutex::new(BookState {
                latest,
                deltas: BTreeMap::new(),
            }),
            events,
            retain: retain.max(1),
        }
    }

    pub fn latest(&self) -> u64 {
        self.inner.lock().map(|s| s.latest).unwrap_or(0)
    }

    pub fn get(&self, version: u64) -> Option<Retained> {
        self.inner
            .lock()
            .ok()
            .and_then(|s| s.deltas.get(&version).cloned())
    }

    /// Adds the next version (must follow `latest`) and wakes every subscriber.
    pub fn insert(&self, r: Retained) -> Result<(), FanoutError> {
        let v = r.version;
        {
            let mut s = self.inner.lock().map_err(|_| FanoutError::Poisoned)?;
            s.deltas.insert(v, r);
            s.latest = s.latest.max(v);
            while s.deltas.len() > self.retain {
                let Some(&oldest) = s.deltas.keys().next() else {
                    break;
                };
                s.deltas.remove(&oldest);
            }
        }
        let _ = self.events.send(v);
        Ok(())
    }

    pub fn subscribe(&self) -> broadcast::Receiver<u64> {
        self.events.subscribe()
    }
}

/// Serves one subscriber after the caller accepted its `Hello` and sent `Welcome`: waits for
/// `Subscribe`, then streams versions until the connection ends.
pub async fn serve_subscriber(
    book: Arc<VersionBook>,
    conn: Connection,
    mut control: SendStream,
    mut reader: MessageReader,
    name: String,
) -> Result<(), FanoutError> {
    let after = match reader.next().await? {
        Some(Message::Subscribe { after_version }) => after_version,
        other => return Err(FanoutError::NoSubscribe(format!("{other:?}"))),
    };
    let (fetch_tx, mut fetch_rx) = mpsc::channel::<u64>(64);
    let who = name.clone();
    tokio::spawn(async move {
        while let Ok(Some(m)) = reader.next().await {
            match m {
                Message::Fetch { version, .. } => {
                    if fetch_tx.send(version).await.is_err() {
                        break;
                    }
                }
                Message::Active { version, .. } => eprintln!("{who} active at version {version}"),
                other => eprintln!("{who}: ignored {other:?}"),
            }
        }
    });
    let mut events = book.subscribe();
    let mut next = after + 1;
    loop {
        while next <= book.latest() {
            send_version(&book, &conn, &mut control, next).await?;
            eprintln!("sent version {next} to {name}");
            next += 1;
        }
        tokio::select! {
            e = events.recv() => {
                if let Err(broadcast::error::RecvError::Closed) = e {
                    return Ok(());
                }
            }
            f = fetch_rx.recv() => match f {
                Some(v) if v < next => {
                    send_version(&book, &conn, &mut control, v).await?;
                    eprintln!("sent version {v} to {name} again");
                }
                Some(_) => {}
                None => return Ok(()),
            },
            _ = conn.closed() => return Ok(()),
        }
    }
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

/// Streams version `v` on a new unidirectional stream, then sends `Commit(v)`.
async fn send_version(
    book: &VersionBook,
    conn: &Connection,
    control: &mut SendStream,
    v: u64,
) -> Result<(), FanoutError> {
    let Some(r) = book.get(v) else {
        send(
            control,
            &Message::Refuse {
                reason: RefuseReason::VersionUnavailable,
                detail: format!("version {v} is not retained here"),
            },
        )
        .await?;
        return Ok(());
    };
    let mut data = conn.open_uni().await?;
    let mut announce = Vec::new();
    Message::Announce {
        version: v,
        base_version: r.base,
        delta_id: r.delta_id,
    }
    .encode(&mut announce);
    data.write_all(&announce).await?;
    if take_fault(v) && r.frames.len() > 64 {
        let mut bad = r.frames.to_vec();
        bad[40] ^= 0x01;
        eprintln!("fault injection: corrupted the first transmission of version {v}");
        data.write_all(&bad).await?;
    } else {
        data.write_all(&r.frames).await?;
    }
    data.finish()?;
    send(control, &Message::Commit { version: v }).await?;
    Ok(())
}
