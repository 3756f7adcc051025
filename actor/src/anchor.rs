//! Restoring an anchor (a full checkpoint the hub sealed) when the delta chain from the active
//! version is no longer on offer: the file is received next to the store while hashed (on a
//! writer thread), then checked against the hub's seal, this model and the sealed version
//! before anything uses it. Nothing here touches the active weights: the pipeline swaps them
//! only once [`receive`] returned a verified checkpoint.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use starling_checkpoint::deltafile::Model;
use starling_checkpoint::safetensors::Checkpoint;
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::delta::apply::full_digest;
use starling_proto::delta::digest::StateDigest;
use starling_proto::delta::manifest::TrustPolicy;
use starling_transport::framed::DataStreamReader;

use crate::store::Layout;

/// A received and verified anchor: its file beside the store, its weights and their digest.
pub(crate) struct Verified {
    pub(crate) file: PathBuf,
    pub(crate) weights: Model,
    pub(crate) digest: StateDigest,
}

/// What a received anchor must be.
pub(crate) struct Expect<'a> {
    pub(crate) model_id: &'a str,
    pub(crate) trust: &'a TrustPolicy,
    pub(crate) layout: &'a Layout,
    /// The active version: an anchor must be newer.
    pub(crate) active: u64,
}

/// Receives the anchor `seal` announces into `store_dir/anchor.partial` and checks it: the
/// seal's signature, a version newer than the active one, size and hash (while receiving),
/// the version the file states, and this model's tensor layout.
pub(crate) async fn receive(
    seal: &AnchorSeal,
    stream: &mut DataStreamReader,
    store_dir: &Path,
    expect: Expect<'_>,
) -> Result<Verified> {
    seal.verify(expect.model_id, expect.trust)
        .context("anchor seal")?;
    if seal.version <= expect.active {
        bail!(
            "anchor {} is not newer than active {}",
            seal.version,
            expect.active
        );
    }
    std::fs::create_dir_all(store_dir).context("create store")?;
    let file = store_dir.join("anchor.partial");
    starling_transport::anchor_file::receive(seal, stream, &file).await?;
    let (weights, digest) = tokio::task::block_in_place(|| -> Result<_> {
        let c = Checkpoint::open(&file).context("open anchor")?;
        if c.version() != Some(seal.version) {
            bail!("anchor file says version {:?}", c.version());
        }
        let found: Layout = c
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        if &found != expect.layout {
            bail!("anchor is not this model (tensor layout differs)");
        }
        let weights = c.read_all()?;
        let names: Vec<String> = weights.keys().cloned().collect();
        let digest = full_digest(expect.model_id, &weights, &names);
        Ok((weights, digest))
    })?;
    Ok(Verified {
        file,
        weights,
        digest,
    })
}
