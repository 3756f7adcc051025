//! The actor's weight pipeline, first slice: connect to the hub, subscribe after the version
//! it holds, stage every announced delta against its active weights, and activate it on
//! `Commit` only once the whole delta verified (signature by the trusted hub key, every
//! segment hash, base version and digest, post digest). The weights never change in between:
//! [`starling_proto::apply`] makes the commit a bare overwrite after every check.
//!
//! The active weights are persisted after each commit (atomically: temporary file, fsync,
//! rename), so a restarted actor resumes from the version it last activated. An inference
//! engine is not attached yet; the engine trait arrives with the rollout work.
//!
//! Not yet here: relays (the actor talks to the hub directly), anchors for actors more than
//! the hub's retention behind, an in-place memory-mapped store (today a full rewrite per
//! version), metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ed25519_dalek::VerifyingKey;
use starling_checkpoint::deltafile::Model;
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::writer::SafetensorsWriter;
use starling_proto::apply::{VersionedWeights, full_digest};
use starling_proto::manifest::TrustPolicy;
use starling_proto::msg::{Message, PROTOCOL_VERSION, Role as MsgRole};
use starling_transport::endpoint::{client_endpoint, connect};
use starling_transport::framed::{DataStreamReader, MessageReader, StreamFrame, send};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use tokio::sync::mpsc;

/// What the actor needs.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// Credentials written by `starling-hub issue --role actor`.
    pub credentials: PathBuf,
    pub hub: SocketAddr,
    /// The checkpoint to start from when the store holds none yet.
    pub init: PathBuf,
    /// Where the active weights are kept.
    pub store: PathBuf,
    pub region: String,
    pub model_id: String,
    pub link: LinkProfile,
}

const CURRENT: &str = "current.safetensors";

/// Tensor names and shapes, in name order.
type Layout = Vec<(String, Vec<u64>)>;

/// Loads the active weights: the store's copy if there is one, else the initial checkpoint.
fn load(cfg: &ActorConfig) -> Result<(Model, Layout, u64)> {
    let stored = cfg.store.join(CURRENT);
    let path = if stored.exists() {
        stored
    } else {
        cfg.init.clone()
    };
    let c = Checkpoint::open(&path).with_context(|| format!("open {}", path.display()))?;
    let layout = c
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    Ok((c.read_all()?, layout, c.version().unwrap_or(0)))
}

fn persist(store: &Path, layout: &[(String, Vec<u64>)], w: &Model, version: u64) -> Result<()> {
    std::fs::create_dir_all(store).context("create store")?;
    let mut out = SafetensorsWriter::create(&store.join(CURRENT), layout, Some(version))
        .context("write weights")?;
    for t in w.values() {
        out.write(t).context("write weights")?;
    }
    out.finish().context("write weights")
}

enum Event {
    Delta {
        version: u64,
        frames: Vec<StreamFrame>,
    },
    Commit(u64),
    Closed(String),
}

/// Runs until the hub connection ends. Prints `active VERSION DIGEST` after each activation
/// and `refetch VERSION` when a delta failed verification and is requested again.
pub async fn run(cfg: ActorConfig) -> Result<()> {
    let creds = Credentials::load_peer(&cfg.credentials).context("load credentials")?;
    if creds.role != Role::Actor {
        bail!(
            "{} holds {} credentials, not an actor's",
            cfg.credentials.display(),
            creds.role.as_str()
        );
    }
    let trusted =
        std::fs::read_to_string(cfg.credentials.join("signing.pub")).context("read signing.pub")?;
    let trust = TrustPolicy::Keys(vec![parse_key(&trusted)?]);
    let (weights, layout, version) = load(&cfg)?;
    let names: Vec<String> = weights.keys().cloned().collect();
    let digest = full_digest(&cfg.model_id, &weights, &names);
    let mut state = VersionedWeights::new(&cfg.model_id, weights, version, digest);
    println!("active {} {}", state.version(), state.digest());

    let bind: SocketAddr = if cfg.hub.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()?;
    let ep = client_endpoint(&creds, bind, &cfg.link)?;
    let conn = connect(&ep, cfg.hub, Role::Hub, "hub").await?;
    let (mut tx, rx) = conn.open_bi().await.context("open control stream")?;
    let mut reader = MessageReader::new(rx);
    send(
        &mut tx,
        &Message::Hello {
            protocol: PROTOCOL_VERSION,
            role: MsgRole::Actor,
            name: creds.name.clone(),
            region: cfg.region.clone(),
            model_id: cfg.model_id.clone(),
            active: Some((state.version(), state.digest().to_bytes())),
        },
    )
    .await?;
    match reader.next().await? {
        Some(Message::Welcome { .. }) => {}
        Some(Message::Refuse { reason, detail }) => bail!("hub refused ({reason:?}): {detail}"),
        other => bail!("unexpected answer {other:?}"),
    }
    send(
        &mut tx,
        &Message::Subscribe {
            after_version: state.version(),
        },
    )
    .await?;

    let (events_tx, mut events) = mpsc::channel::<Event>(64);
    let data_conn = conn.clone();
    let data_events = events_tx.clone();
    tokio::spawn(async move {
        // One stream per version: Announce, then the delta's frames.
        while let Ok(recv) = data_conn.accept_uni().await {
            let ev = data_events.clone();
            tokio::spawn(async move {
                let mut r = DataStreamReader::new(recv);
                let version = match r.message().await {
                    Ok(Message::Announce { version, .. }) => version,
                    Ok(other) => return eprintln!("data stream began with {other:?}"),
                    Err(e) => return eprintln!("data stream: {e}"),
                };
                let mut frames = Vec::new();
                loop {
                    match r.frame().await {
                        Ok(Some(f)) => frames.push(f),
                        Ok(None) => break,
                        // A corrupted or cut stream: deliver what arrived; staging finds the
                        // gap and the actor asks for the version again.
                        Err(e) => {
                            eprintln!("version {version}: {e}");
                            break;
                        }
                    }
                }
                let _ = ev.send(Event::Delta { version, frames }).await;
            });
        }
    });
    tokio::spawn(async move {
        loop {
            match reader.next().await {
                Ok(Some(Message::Commit { version })) => {
                    if events_tx.send(Event::Commit(version)).await.is_err() {
                        return;
                    }
                }
                Ok(Some(Message::Refuse { reason, detail })) => {
                    eprintln!("hub: {reason:?}: {detail}")
                }
                Ok(Some(other)) => eprintln!("hub: ignored {other:?}"),
                Ok(None) => {
                    return drop(
                        events_tx
                            .send(Event::Closed("hub closed the control stream".into()))
                            .await,
                    );
                }
                Err(e) => return drop(events_tx.send(Event::Closed(e.to_string())).await),
            }
        }
    });

    let mut pending: BTreeMap<u64, Vec<StreamFrame>> = BTreeMap::new();
    let mut commits: BTreeSet<u64> = BTreeSet::new();
    let mut retries: BTreeMap<u64, u32> = BTreeMap::new();
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Delta { version, frames } => {
                pending.insert(version, frames);
            }
            Event::Commit(v) => {
                commits.insert(v);
            }
            Event::Closed(why) => {
                conn.close(0u32.into(), b"bye");
                ep.wait_idle().await;
                bail!("{why}");
            }
        }
        // Activate every next version that is both fully received and committed.
        loop {
            let next = state.version() + 1;
            if !commits.contains(&next) {
                break;
            }
            let Some(frames) = pending.remove(&next) else {
                break;
            };
            match stage_and_commit(&mut state, &frames, &trust) {
                Ok(()) => {
                    commits.remove(&next);
                    persist(&cfg.store, &layout, state.weights(), state.version())?;
                    println!("active {} {}", state.version(), state.digest());
                    send(
                        &mut tx,
                        &Message::Active {
                            version: state.version(),
                            digest: state.digest().to_bytes(),
                        },
                    )
                    .await?;
                }
                Err(e) => {
                    let n = retries.entry(next).or_default();
                    *n += 1;
                    eprintln!("version {next} refused ({e:#}); fetching it again (attempt {n})");
                    println!("refetch {next}");
                    if *n > 5 {
                        bail!("version {next} failed verification {n} times: {e:#}");
                    }
                    send(
                        &mut tx,
                        &Message::Fetch {
                            version: next,
                            seqs: Vec::new(),
                        },
                    )
                    .await?;
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Stages all frames against the active weights, seals and commits. The weights are
/// untouched unless every check passed.
fn stage_and_commit(
    state: &mut VersionedWeights<Model>,
    frames: &[StreamFrame],
    trust: &TrustPolicy,
) -> Result<()> {
    let mut stager = state.stager();
    for f in frames {
        stager.stage_frame(f.as_frame(), state.weights())?;
    }
    let sealed = stager.seal(trust)?;
    state.commit(sealed)?;
    Ok(())
}

fn parse_key(text: &str) -> Result<VerifyingKey> {
    let t = text.trim();
    if t.len() != 64 {
        bail!("signing.pub must hold 64 hex characters");
    }
    let mut b = [0u8; 32];
    for (i, o) in b.iter_mut().enumerate() {
        *o = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).context("signing.pub is not hex")?;
    }
    VerifyingKey::from_bytes(&b).context("signing.pub is not an ed25519 key")
}
