//! `starling-hub serve`: the hub's distribution service, first slice.
//!
//! The hub listens for QUIC connections from relays, actors and the trainer (all with
//! cluster credentials; see `starling_transport`). The trainer sends `Publish { path }`: the
//! hub diffs that checkpoint against the last published one, writes the signed delta into
//! its store (atomically: a version is listed only once its bytes are durable), and
//! announces it. Every subscriber gets each version after the one it holds on its own
//! unidirectional stream (`Announce`, then the `.sdc` frames), followed by `Commit` on its
//! control stream; `Fetch` asks for a version again (after a corrupted or lost stream).
//!
//! Not yet here (see docs/ARCHITECTURE.md): cut-through streaming of segments while they are
//! encoded, relays, anchors for late joiners, striping, metrics. The hub keeps the *path* of
//! the last published checkpoint as its snapshot, so the trainer must keep that file until
//! the next publish.

use std::collections::BTreeMap;
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
use starling_transport::endpoint::{client_endpoint, connect, server_endpoint, verify_peer};
use starling_transport::framed::{MessageReader, send};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use tokio::sync::{Mutex, broadcast, mpsc};

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

#[derive(Debug, Clone)]
struct Published {
    path: PathBuf,
    base: u64,
    delta_id: [u8; 32],
}

#[derive(Debug)]
struct State {
    version: u64,
    snapshot: PathBuf,
    deltas: BTreeMap<u64, Published>,
}

#[derive(Debug)]
struct Hub {
    cfg: ServeConfig,
    signing: SigningKey,
    state: Mutex<State>,
    versions: broadcast::Sender<u64>,
    /// Test-only fault injection: the first stream of this version gets one byte flipped.
    corrupt_once: std::sync::Mutex<Option<u64>>,
}

/// Environment variable naming a version whose first transmission is corrupted (one
/// flipped byte inside the first segment), for fault tests. Never set it in production.
pub const FAULT_CORRUPT_VERSION: &str = "STARLING_HUB_TEST_CORRUPT_VERSION";

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
    let (versions, _) = broadcast::channel(1024);
    let hub = Arc::new(Hub {
        state: Mutex::new(State {
            version: cfg.init_version,
            snapshot: cfg.init.clone(),
            deltas: BTreeMap::new(),
        }),
        cfg,
        signing,
        versions,
        corrupt_once: std::sync::Mutex::new(
            std::env::var(FAULT_CORRUPT_VERSION)
                .ok()
                .and_then(|v| v.parse().ok()),
        ),
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
    let (mut tx, rx) = conn.accept_bi().await.context("accept control stream")?;
    let mut reader = MessageReader::new(rx);
    let Some(Message::Hello {
        protocol,
        role,
        name,
        model_id,
        ..
    }) = reader.next().await?
    else {
        bail!("first message was not Hello");
    };
    let refuse = |reason, detail: String| Message::Refuse { reason, detail };
    if protocol != PROTOCOL_VERSION {
        send(
            &mut tx,
            &refuse(
                RefuseReason::ProtocolVersion,
                format!("hub speaks {PROTOCOL_VERSION}, peer {protocol}"),
            ),
        )
        .await?;
        return Ok(());
    }
    let (cert_role, cert_name) = match role {
        MsgRole::Relay => (Role::Relay, name.as_str()),
        MsgRole::Actor => (Role::Actor, name.as_str()),
        MsgRole::Trainer => (Role::Hub, "hub"),
    };
    if let Err(e) = verify_peer(&conn, cert_role, cert_name) {
        send(&mut tx, &refuse(RefuseReason::NotAuthorized, e.to_string())).await?;
        return Ok(());
    }
    if model_id != hub.cfg.model_id {
        send(
            &mut tx,
            &refuse(
                RefuseReason::Protocol,
                format!(
                    "hub serves model {}, peer holds {model_id}",
                    hub.cfg.model_id
                ),
            ),
        )
        .await?;
        return Ok(());
    }
    let latest = hub.state.lock().await.version;
    send(
        &mut tx,
        &Message::Welcome {
            latest_version: latest,
        },
    )
    .await?;
    if role == MsgRole::Trainer {
        return serve_trainer(hub, tx, reader).await;
    }
    let Some(Message::Subscribe { after_version }) = reader.next().await? else {
        bail!("{name}: expected Subscribe");
    };
    eprintln!("{name} subscribed after version {after_version}");
    // Control messages from the subscriber: fetch requests go to the sender loop; reports
    // are logged.
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
    let mut events = hub.versions.subscribe();
    let mut next = after_version + 1;
    loop {
        let latest = hub.state.lock().await.version;
        while next <= latest {
            send_version(&hub, &conn, &mut tx, next).await?;
            next += 1;
        }
        tokio::select! {
            e = events.recv() => {
                if let Err(broadcast::error::RecvError::Closed) = e {
                    return Ok(());
                }
            }
            f = fetch_rx.recv() => match f {
                Some(v) if v < next => send_version(&hub, &conn, &mut tx, v).await?,
                Some(_) => {}
                None => return Ok(()),
            },
            _ = conn.closed() => return Ok(()),
        }
    }
}

/// Streams version `v` on a new unidirectional stream, then sends `Commit(v)`.
async fn send_version(
    hub: &Hub,
    conn: &Connection,
    control: &mut SendStream,
    v: u64,
) -> Result<()> {
    let published = hub.state.lock().await.deltas.get(&v).cloned();
    let Some(p) = published else {
        send(
            control,
            &Message::Refuse {
                reason: RefuseReason::VersionUnavailable,
                detail: format!("version {v} is not retained"),
            },
        )
        .await?;
        return Ok(());
    };
    let bytes = tokio::fs::read(&p.path)
        .await
        .with_context(|| format!("read {}", p.path.display()))?;
    let frames = bytes
        .get(FILE_HEADER_LEN..)
        .ok_or_else(|| anyhow!("{} is shorter than a header", p.path.display()))?;
    let corrupt = {
        let mut c = hub
            .corrupt_once
            .lock()
            .map_err(|_| anyhow!("fault hook lock poisoned"))?;
        if *c == Some(v) {
            c.take().is_some()
        } else {
            false
        }
    };
    let mut owned;
    let frames = if corrupt && frames.len() > 64 {
        owned = frames.to_vec();
        owned[40] ^= 0x01;
        eprintln!("fault injection: corrupted the first transmission of version {v}");
        &owned[..]
    } else {
        frames
    };
    let mut data = conn.open_uni().await.context("open data stream")?;
    let mut announce = Vec::new();
    Message::Announce {
        version: v,
        base_version: p.base,
        delta_id: p.delta_id,
    }
    .encode(&mut announce);
    data.write_all(&announce).await.context("send announce")?;
    data.write_all(frames).await.context("send delta")?;
    data.finish().context("finish data stream")?;
    send(control, &Message::Commit { version: v }).await?;
    Ok(())
}

async fn serve_trainer(hub: Arc<Hub>, mut tx: SendStream, mut reader: MessageReader) -> Result<()> {
    while let Some(m) = reader.next().await? {
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
    state.deltas.insert(
        version,
        Published {
            path: dest,
            base,
            delta_id: summary.manifest.delta_id(),
        },
    );
    state.version = version;
    state.snapshot = path.to_owned();
    drop(state);
    let _ = hub.versions.send(version);
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
