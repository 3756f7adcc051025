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
//! Sources are tried in order (the region's relays, then the hub); when one dies the actor
//! subscribes to the next after the version it holds, so nothing it activated is lost.
//!
//! Not yet here: anchors for actors more than the retention behind, resuming a half-received
//! version segment by segment (a version is refetched whole), an in-place memory-mapped store
//! (today a full rewrite per version), safe points of an inference engine, metrics.

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
use starling_transport::framed::{StreamFrame, send};
use starling_transport::identity::{Credentials, Role, manifest_key};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{UpstreamEvent, subscribe};

/// Where to subscribe: relays of the actor's region first, then the hub.
#[derive(Debug, Clone)]
pub struct Source {
    pub role: Role,
    pub name: String,
    pub addr: SocketAddr,
}

/// What the actor needs.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// Credentials written by `starling-hub issue --role actor`.
    pub credentials: PathBuf,
    /// Tried in order; on failure or disconnect the next one (then around again).
    pub sources: Vec<Source>,
    /// The checkpoint to start from when the store holds none yet.
    pub init: PathBuf,
    /// Where the active weights are kept.
    pub store: PathBuf,
    pub region: String,
    pub model_id: String,
    pub link: LinkProfile,
}

/// How many times in a row the actor may fail to reach any source before it gives up.
const MAX_FAILOVERS: u32 = 50;

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

/// Runs until every source failed too often or the process is stopped. Prints `active
/// VERSION DIGEST` after each activation, `refetch VERSION` when a delta failed verification
/// and is requested again, and `upstream ROLE NAME` when it (re)subscribes.
pub async fn run(cfg: ActorConfig) -> Result<()> {
    let creds = Credentials::load_peer(&cfg.credentials).context("load credentials")?;
    if creds.role != Role::Actor {
        bail!(
            "{} holds {} credentials, not an actor's",
            cfg.credentials.display(),
            creds.role.as_str()
        );
    }
    if cfg.sources.is_empty() {
        bail!("no hub or relay to subscribe to");
    }
    let key = VerifyingKey::from_bytes(&manifest_key(&cfg.credentials)?)
        .context("signing.pub is not an ed25519 key")?;
    let trust = TrustPolicy::Keys(vec![key]);
    let (weights, layout, version) = load(&cfg)?;
    let names: Vec<String> = weights.keys().cloned().collect();
    let digest = full_digest(&cfg.model_id, &weights, &names);
    let mut state = VersionedWeights::new(&cfg.model_id, weights, version, digest);
    println!("active {} {}", state.version(), state.digest());

    let mut pending: BTreeMap<u64, Vec<StreamFrame>> = BTreeMap::new();
    let mut commits: BTreeSet<u64> = BTreeSet::new();
    let mut retries: BTreeMap<u64, u32> = BTreeMap::new();
    let mut failures = 0u32;
    for source in cfg.sources.iter().cycle() {
        let hello = Message::Hello {
            protocol: PROTOCOL_VERSION,
            role: MsgRole::Actor,
            name: creds.name.clone(),
            region: cfg.region.clone(),
            model_id: cfg.model_id.clone(),
            active: Some((state.version(), state.digest().to_bytes())),
        };
        let mut up = match subscribe(
            &creds,
            source.addr,
            source.role,
            &source.name,
            &hello,
            state.version(),
            &cfg.link,
        )
        .await
        {
            Ok(up) => up,
            Err(e) => {
                failures += 1;
                eprintln!(
                    "{} {} at {}: {e}",
                    source.role.as_str(),
                    source.name,
                    source.addr
                );
                if failures > MAX_FAILOVERS {
                    bail!("no source reachable after {failures} attempts: {e}");
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                continue;
            }
        };
        println!("upstream {} {}", source.role.as_str(), source.name);
        // Versions already active will not be needed again; later ones are resent anyway.
        pending.retain(|&v, _| v > state.version());
        commits.retain(|&v| v > state.version());
        while let Some(ev) = up.events.recv().await {
            match ev {
                UpstreamEvent::Delta { version, frames } => {
                    pending.insert(version, frames);
                }
                UpstreamEvent::Commit(v) => {
                    commits.insert(v);
                }
                UpstreamEvent::Refused(why) => eprintln!("upstream refused: {why}"),
                UpstreamEvent::Closed(why) => {
                    eprintln!("upstream {} {}: {why}", source.role.as_str(), source.name);
                    break;
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
                        failures = 0;
                        commits.remove(&next);
                        persist(&cfg.store, &layout, state.weights(), state.version())?;
                        println!("active {} {}", state.version(), state.digest());
                        let _ = send(
                            &mut up.control,
                            &Message::Active {
                                version: state.version(),
                                digest: state.digest().to_bytes(),
                            },
                        )
                        .await;
                    }
                    Err(e) => {
                        let n = retries.entry(next).or_default();
                        *n += 1;
                        eprintln!(
                            "version {next} refused ({e:#}); fetching it again (attempt {n})"
                        );
                        println!("refetch {next}");
                        if *n > 5 {
                            bail!("version {next} failed verification {n} times: {e:#}");
                        }
                        let _ = send(
                            &mut up.control,
                            &Message::Fetch {
                                version: next,
                                seqs: Vec::new(),
                            },
                        )
                        .await;
                        break;
                    }
                }
            }
        }
        up.close().await;
        failures += 1;
        if failures > MAX_FAILOVERS {
            bail!("lost every upstream {failures} times in a row");
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
