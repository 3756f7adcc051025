//! Weights from a shared directory instead of the network: the `--no-transfer` baseline.
//!
//! A benchmark needs the ideal that weight distribution is measured against: every actor
//! reading the trainer's full checkpoint from a shared filesystem the moment it exists, with
//! no bytes on any link. With `--weights-dir DIR` the actor subscribes to no relay and no hub
//! data stream; it polls `DIR` for the next version's checkpoint, named
//! [`version_file_name`] (`v00000007.safetensors`), loads it into the engine at the job
//! boundary and reports it active, exactly as the delta pipeline would. Jobs still flow over
//! the worker's own connection to the hub (and whatever link is in between), so the baseline
//! differs from delta mode only in how weights arrive.
//!
//! Whoever publishes writes the file under a temporary name and renames it (or hard-links a
//! finished checkpoint) once the hub has assigned the version; a half-written file is never
//! seen under the final name. The digest is computed here from the bits read, and the hub
//! checks it against the version's digest on every result, so a wrong file is refused there,
//! not trusted.
//!
//! Not for production: nothing here is verified against the hub's signature, and at scale a
//! shared filesystem that every actor reads a full checkpoint from is the bottleneck Starling
//! exists to avoid.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use starling_checkpoint::deltafile::Model;
use starling_checkpoint::safetensors::Checkpoint;
use starling_proto::delta::apply::{UndoLog, full_digest};
use starling_proto::delta::digest::StateDigest;
use starling_telemetry::Metrics;
use tokio::sync::watch;

use crate::engine::Engine;
use crate::worker::PipelineStatus;

/// How often the directory is looked at.
const POLL: Duration = Duration::from_millis(5);

/// The file that holds `version`'s full checkpoint in a shared weights directory.
pub fn version_file_name(version: u64) -> String {
    starling_checkpoint::deltafile::version_file_name(version, "safetensors")
}

/// Reads a full BF16 checkpoint and its digest.
fn read_version(path: &Path, model_id: &str) -> Result<(Model, StateDigest)> {
    let c = Checkpoint::open(path).with_context(|| format!("open {}", path.display()))?;
    let weights = c
        .read_all()
        .with_context(|| format!("read {}", path.display()))?;
    let names: Vec<String> = weights.keys().cloned().collect();
    let digest = full_digest(model_id, &weights, &names);
    Ok((weights, digest))
}

/// Where the actor starts and what it follows.
pub struct SharedDir<'a> {
    pub dir: PathBuf,
    pub init: &'a Path,
    pub model_id: &'a str,
    pub engine: Option<Arc<dyn Engine>>,
    pub status: watch::Sender<PipelineStatus>,
    pub metrics: &'a Metrics,
}

impl std::fmt::Debug for SharedDir<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedDir")
            .field("dir", &self.dir)
            .field("init", &self.init)
            .field("model_id", &self.model_id)
            .finish_non_exhaustive()
    }
}

impl SharedDir<'_> {
    /// Loads `weights` as `version` into the engine. With the version before it (`prev`), the
    /// engine is offered the change between the two, as the delta pipeline offers the commit's
    /// undo log: an engine that keeps its own copy of the weights (vLLM) then follows sparsely
    /// here too, so that the baseline differs from delta mode only in how weights arrive.
    async fn activate(
        &self,
        weights: &Model,
        version: u64,
        digest: StateDigest,
        prev: Option<(&Model, u64, StateDigest)>,
    ) -> Result<()> {
        let bytes = digest.to_bytes();
        if let Some(engine) = &self.engine {
            let change = prev.and_then(|(old, v, d)| UndoLog::between(v, d, old, weights));
            // A server being (re)started is waited for: this baseline loads every version
            // before it goes on.
            crate::engine::load_waiting(|| {
                tokio::task::block_in_place(|| {
                    engine.load(weights, version, bytes, change.as_ref())
                })
            })
            .await?;
        }
        // The shared directory has no staging: a version is active once loaded.
        self.status.send_modify(|s| s.activate(version, bytes));
        self.metrics.set_active(version);
        println!("active {version} {digest}");
        Ok(())
    }

    /// Loads `init` as version 0 (or the version it records), then follows the directory
    /// until the process stops. A file that cannot be read is retried: it may still be
    /// appearing on a slow filesystem.
    pub async fn follow(self) -> Result<()> {
        let c =
            Checkpoint::open(self.init).with_context(|| format!("open {}", self.init.display()))?;
        let mut version = c.version().unwrap_or(0);
        drop(c);
        let (mut weights, mut digest) = read_version(self.init, self.model_id)?;
        self.activate(&weights, version, digest, None).await?;
        let mut failures = 0u32;
        loop {
            let next = self.dir.join(version_file_name(version + 1));
            if !next.exists() {
                tokio::time::sleep(POLL).await;
                continue;
            }
            let model_id = self.model_id.to_owned();
            let path = next.clone();
            let read = tokio::task::spawn_blocking(move || read_version(&path, &model_id)).await?;
            match read {
                Ok((next_weights, next_digest)) => {
                    failures = 0;
                    self.activate(
                        &next_weights,
                        version + 1,
                        next_digest,
                        Some((&weights, version, digest)),
                    )
                    .await?;
                    version += 1;
                    (weights, digest) = (next_weights, next_digest);
                }
                Err(e) => {
                    failures += 1;
                    if failures >= 100 {
                        return Err(e.context(format!(
                            "version {} in {} stayed unreadable",
                            version + 1,
                            self.dir.display()
                        )));
                    }
                    tokio::time::sleep(POLL * 10).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_files_sort_by_version() {
        assert_eq!(version_file_name(7), "v00000007.safetensors");
        assert!(version_file_name(9) < version_file_name(10));
    }
}
