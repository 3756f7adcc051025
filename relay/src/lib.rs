//! The regional relay, first slice: one upstream subscription to the hub, so each version
//! crosses the WAN once per region; every version verified as a whole (every frame's BLAKE3,
//! every segment the manifest names, the manifest's signature by the trusted hub key) before
//! it is cached and offered downstream; actors of the region served with the same protocol
//! as the hub (`starling_transport::fanout`), including `Fetch` for retransmissions.
//!
//! Not yet here: cut-through forwarding of segments while a version is still arriving
//! (today a version is forwarded once complete and verified), a disk cache for restarts,
//! striping over several streams, metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use ed25519_dalek::VerifyingKey;
use quinn::Connection;
use starling_proto::container::{DeltaAssembler, FrameKind, encode_frame};
use starling_proto::manifest::TrustPolicy;
use starling_proto::msg::{Message, PROTOCOL_VERSION, Role as MsgRole};
use starling_transport::admit::admit;
use starling_transport::endpoint::server_endpoint;
use starling_transport::fanout::{Retained, VersionBook, serve_subscriber};
use starling_transport::framed::{StreamFrame, send};
use starling_transport::identity::{Credentials, Role, manifest_key};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{UpstreamEvent, subscribe};

/// What the relay needs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Credentials written by `starling-hub issue --role relay`.
    pub credentials: PathBuf,
    pub hub: SocketAddr,
    pub listen: SocketAddr,
    pub region: String,
    pub model_id: String,
    /// Versions after this one are fetched and cached.
    pub from_version: u64,
    /// The WAN link to the hub (sizes the receive windows).
    pub wan: LinkProfile,
    /// The LAN to the actors.
    pub lan: LinkProfile,
}

/// Versions kept for laggards and late joiners.
const RETAIN: usize = 256;

/// Runs the relay until the hub goes away or the process is stopped. Prints `listening on
/// ADDR` once actors can connect and `cached VERSION` for each verified version.
pub async fn run(cfg: RelayConfig) -> Result<()> {
    let creds = Credentials::load_peer(&cfg.credentials).context("load credentials")?;
    if creds.role != Role::Relay {
        bail!(
            "{} holds {} credentials, not a relay's",
            cfg.credentials.display(),
            creds.role.as_str()
        );
    }
    let key = VerifyingKey::from_bytes(&manifest_key(&cfg.credentials)?)
        .context("signing.pub is not an ed25519 key")?;
    let trust = TrustPolicy::Keys(vec![key]);
    let book = Arc::new(VersionBook::new(cfg.from_version, RETAIN));
    let endpoint = server_endpoint(&creds, cfg.listen, &cfg.lan).context("listen")?;
    println!(
        "listening on {}",
        endpoint.local_addr().context("local address")?
    );
    let downstream = {
        let book = book.clone();
        let model_id = cfg.model_id.clone();
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let book = book.clone();
                let model_id = model_id.clone();
                tokio::spawn(async move {
                    match incoming.await {
                        Ok(conn) => {
                            if let Err(e) = serve_actor(book, conn.clone(), &model_id).await {
                                eprintln!("actor {}: {e:#}", conn.remote_address());
                            }
                        }
                        Err(e) => eprintln!("refused a connection during the handshake: {e}"),
                    }
                });
            }
        })
    };
    let result = follow_hub(&cfg, &creds, &trust, &book).await;
    downstream.abort();
    result
}

async fn serve_actor(book: Arc<VersionBook>, conn: Connection, model_id: &str) -> Result<()> {
    let Some(a) = admit(&conn, "relay", model_id, &[MsgRole::Actor], book.latest()).await? else {
        return Ok(());
    };
    serve_subscriber(book, conn, a.control, a.reader, a.name).await?;
    Ok(())
}

/// Checks a received version as a whole and re-frames it for forwarding.
fn verify(frames: &[StreamFrame], trust: &TrustPolicy) -> Result<Retained> {
    let mut asm = DeltaAssembler::new();
    for f in frames {
        asm.add(f.as_frame())?;
    }
    let delta = asm.finish(trust)?;
    let m = &delta.manifest.manifest;
    let mut bytes = Vec::with_capacity(frames.iter().map(|f| f.body.len() + 40).sum());
    for f in frames {
        bytes.extend_from_slice(&encode_frame(f.kind, &f.body));
    }
    if !frames.iter().any(|f| f.kind == FrameKind::Trailer) {
        bail!("version {} arrived without its trailer", m.version);
    }
    Ok(Retained {
        version: m.version,
        base: m.base_version,
        delta_id: m.delta_id(),
        frames: Arc::new(bytes),
    })
}

async fn follow_hub(
    cfg: &RelayConfig,
    creds: &Credentials,
    trust: &TrustPolicy,
    book: &VersionBook,
) -> Result<()> {
    let hello = Message::Hello {
        protocol: PROTOCOL_VERSION,
        role: MsgRole::Relay,
        name: creds.name.clone(),
        region: cfg.region.clone(),
        model_id: cfg.model_id.clone(),
        active: None,
    };
    let mut up = subscribe(
        creds,
        cfg.hub,
        Role::Hub,
        "hub",
        &hello,
        book.latest(),
        &cfg.wan,
    )
    .await
    .context("subscribe to the hub")?;
    let mut verified: BTreeMap<u64, Retained> = BTreeMap::new();
    let mut commits: BTreeSet<u64> = BTreeSet::new();
    while let Some(ev) = up.events.recv().await {
        match ev {
            UpstreamEvent::Delta { version, frames } => match verify(&frames, trust) {
                Ok(r) if r.version == version => {
                    verified.insert(version, r);
                }
                Ok(r) => eprintln!(
                    "stream announced version {version} but carried {}",
                    r.version
                ),
                Err(e) => {
                    eprintln!("version {version} refused ({e:#}); fetching it again");
                    println!("refetch {version}");
                    send(
                        &mut up.control,
                        &Message::Fetch {
                            version,
                            seqs: Vec::new(),
                        },
                    )
                    .await?;
                }
            },
            UpstreamEvent::Commit(v) => {
                commits.insert(v);
            }
            UpstreamEvent::Refused(why) => eprintln!("hub refused: {why}"),
            UpstreamEvent::Closed(why) => {
                up.close().await;
                bail!("hub connection ended: {why}");
            }
        }
        // Offer every next version that is verified and committed upstream.
        loop {
            let next = book.latest() + 1;
            if !commits.remove(&next) {
                break;
            }
            let Some(r) = verified.remove(&next) else {
                commits.insert(next);
                break;
            };
            book.insert(r)?;
            println!("cached {next}");
        }
    }
    Ok(())
}
