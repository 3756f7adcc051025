//! `starling-hub serve`: the hub's distribution service, first slice.
//!
//! The hub listens for QUIC connections from relays, actors and the trainer (all with
//! cluster credentials; see `starling_transport`). The trainer sends `Publish { path }`: the
//! hub diffs that checkpoint against the last published one, writes the signed delta into
//! its store (atomically: a version is listed only once its bytes are durable), and
//! announces it. Every subscriber gets each version after the one it holds on its own
//! unidirectional stream (`Announce`, then the `.sdc` frames), followed by `Commit` on its
//! control stream; `Fetch` asks for a version again (after a corrupted or lost stream). The
//! sending side is shared with the relays (`starling_transport::fanout`).
//!
//! Not yet here (see docs/ARCHITECTURE.md): cut-through streaming of segments while they are
//! encoded, relays, anchors for late joiners, striping, metrics. The hub keeps the *path* of
//! the last published checkpoint as its snapshot, so the trainer must keep that file until
//! the next publish.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use ed25519_dalek::SigningKey;
use quinn::{Connection, SendStream};
use starling_checkpoint::deltafile::{DiffOptions, diff_to_file};
use starling_checkpoint::safetensors::Checkpoint;
use starling_proto::container::FILE_HEADER_LEN;
use starling_proto::msg::{Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole};
use starling_transport::admit::admit;
use starling_transport::endpoint::{client_endpoint, connect, server_endpoint};
use starling_transport::fanout::{Retained, VersionBook, serve_subscriber};
use starling_transport::framed::{MessageReader, send};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use tokio::sync::Mutex;

/// What `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub cluster: PathBuf,
    pub store: PathBuf,
    pub listen: SocketAddr,
    /// The checkpoint of version `init_version`, the base of the first publish.
    pub init: PathBuf,
    pub init_version: u64,
    pub model_id: String,
    pub link: LinkProfile,
}

#[derive(Debug)]
struct State {
    version: u64,
    snapshot: PathBuf,
}

#[derive(Debug)]
struct Hub {
    cfg: ServeConfig,
    signing: SigningKey,
    state: Mutex<State>,
    book: Arc<VersionBook>,
}

/// Deltas kept in memory for subscribers that fall behind (older ones: from the store).
const RETAIN: usize = 256;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Runs the hub until the process is stopped. Prints `listening on ADDR` once ready.
pub async fn serve(cfg: ServeConfig) -> Result<()> {
    let creds = Credentials::load_hub(&cfg.cluster).context("load hub credentials")?;
    let signing = crate::keys::load_signing(&cfg.cluster.join("signing.key"))?;
    Checkpoint::open(&cfg.init)
        .with_context(|| format!("open initial checkpoint {}", cfg.init.display()))?;
    std::fs::create_dir_all(cfg.store.join("deltas")).context("create store")?;
    let endpoint = server_endpoint(&creds, cfg.listen, &cfg.link).context("listen")?;
    let addr = endpoint.local_addr().context("local address")?;
    let hub = Arc::new(Hub {
        state: Mutex::new(State {
            version: cfg.init_version,
            snapshot: cfg.init.clone(),
        }),
        book: Arc::new(VersionBook::new(cfg.init_version, RETAIN)),
        cfg,
        signing,
    });
    println!("listening on {addr}");
    while let Some(incoming) = endpoint.accept().await {
        let hub = hub.clone();
        tokio::spawn(async move {
            match incoming.await {
                Ok(conn) => {
                    if let Err(e) = serve_connection(hub, conn.clone()).await {
                        eprintln!("connection {}: {e:#}", conn.remote_address());
                        conn.close(1u32.into(), b"error");
                    }
                }
                Err(e) => eprintln!("refused a connection during the handshake: {e}"),
            }
        });
    }
    Ok(())
}

async fn serve_connection(hub: Arc<Hub>, conn: Connection) -> Result<()> {
    let latest = hub.state.lock().await.version;
    let serves = [MsgRole::Relay, MsgRole::Actor, MsgRole::Trainer];
    let Some(a) = admit(&conn, "hub", &hub.cfg.model_id, &serves, latest).await? else {
        return Ok(());
    };
    if a.role == MsgRole::Trainer {
        return serve_trainer(hub, a.control, a.reader).await;
    }
    eprintln!("{} connected", a.name);
    serve_subscriber(hub.book.clone(), conn, a.control, a.reader, a.name).await?;
    Ok(())
}

async fn serve_trainer(hub: Arc<Hub>, mut tx: SendStream, mut reader: MessageReader) -> Result<()> {
    // The trainer closes the connection when it is done: any end of the stream is normal.
    while let Ok(Some(m)) = reader.next().await {
        let Message::Publish { path } = m else {
            send(
                &mut tx,
                &Message::Refuse {
                    reason: RefuseReason::Protocol,
                    detail: "the trainer may only publish".into(),
                },
            )
            .await?;
            continue;
        };
        let reply = match publish(&hub, Path::new(&path)).await {
            Ok(r) => r,
            Err(e) => Message::Refuse {
                reason: RefuseReason::Protocol,
                detail: format!("publish {path}: {e:#}"),
            },
        };
        send(&mut tx, &reply).await?;
    }
    Ok(())
}

async fn publish(hub: &Arc<Hub>, path: &Path) -> Result<Message> {
    // One publish at a time: the state lock is held across the diff.
    let mut state = hub.state.lock().await;
    let base = state.version;
    let version = base + 1;
    let old = state.snapshot.clone();
    let new = path.to_owned();
    let dest = hub
        .cfg
        .store
        .join("deltas")
        .join(format!("v{version:08}.sdc"));
    let mut opts = DiffOptions::new(&hub.cfg.model_id, base, version, now_ms());
    opts.signing_key = Some(hub.signing.clone());
    let dest2 = dest.clone();
    let summary = tokio::task::spawn_blocking(move || -> Result<_> {
        let o =
            Checkpoint::open(&old).with_context(|| format!("open snapshot {}", old.display()))?;
        let n = Checkpoint::open(&new).with_context(|| format!("open {}", new.display()))?;
        Ok(diff_to_file(&o, &n, &dest2, &opts, &|_| {})?)
    })
    .await
    .context("diff task")??;
    let bytes = tokio::fs::read(&dest)
        .await
        .with_context(|| format!("read {}", dest.display()))?;
    let frames = bytes
        .get(FILE_HEADER_LEN..)
        .ok_or_else(|| anyhow!("{} is shorter than a header", dest.display()))?;
    hub.book.insert(Retained {
        version,
        base,
        delta_id: summary.manifest.delta_id(),
        frames: Arc::new(frames.to_vec()),
    })?;
    state.version = version;
    state.snapshot = path.to_owned();
    drop(state);
    eprintln!(
        "published version {version}: {} changes, {} bytes",
        summary.manifest.total_changes(),
        summary.delta_bytes
    );
    Ok(Message::Published {
        version,
        changes: summary.manifest.total_changes(),
        bytes: summary.delta_bytes,
    })
}

/// `starling-hub publish`: asks a running hub to publish a checkpoint.
pub async fn publish_remote(
    cluster: &Path,
    hub_addr: SocketAddr,
    model_id: &str,
    path: &Path,
) -> Result<(u64, u64, u64)> {
    let creds = Credentials::load_hub(cluster).context("load hub credentials")?;
    let bind: SocketAddr = if hub_addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()?;
    let ep = client_endpoint(&creds, bind, &LinkProfile::LAN)?;
    let conn = connect(&ep, hub_addr, Role::Hub, "hub").await?;
    let (mut tx, rx) = conn.open_bi().await?;
    let mut reader = MessageReader::new(rx);
    send(
        &mut tx,
        &Message::Hello {
            protocol: PROTOCOL_VERSION,
            role: MsgRole::Trainer,
            name: "trainer".into(),
            region: String::new(),
            model_id: model_id.to_owned(),
            active: None,
        },
    )
    .await?;
    match reader.next().await? {
        Some(Message::Welcome { .. }) => {}
        Some(Message::Refuse { detail, .. }) => bail!("hub refused: {detail}"),
        other => bail!("unexpected answer {other:?}"),
    }
    let abs = std::fs::canonicalize(path).with_context(|| format!("resolve {}", path.display()))?;
    send(
        &mut tx,
        &Message::Publish {
            path: abs.to_string_lossy().into_owned(),
        },
    )
    .await?;
    let out = match reader.next().await? {
        Some(Message::Published {
            version,
            changes,
            bytes,
        }) => (version, changes, bytes),
        Some(Message::Refuse { detail, .. }) => bail!("{detail}"),
        other => bail!("unexpected answer {other:?}"),
    };
    let _ = tx.finish();
    conn.close(0u32.into(), b"done");
    ep.wait_idle().await;
    Ok(out)
}
