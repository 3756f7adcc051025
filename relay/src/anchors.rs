//! The relay's anchor: the newest full checkpoint it fetched from the hub, kept in its disk
//! cache (`CACHE/anchors/vNNNNNNNN.safetensors` and `.seal`).
//!
//! Why: a relay that was down (or started late) for longer than the hub retains deltas cannot
//! follow the chain from where it stopped. It asks the hub for its newest anchor, restarts its
//! chain there, and offers the same anchor to its region's actors that are behind too — so
//! the full checkpoint crosses the WAN once per region, not once per actor, exactly as the
//! deltas do.
//!
//! The file arrives hashed against its seal ([`starling_transport::anchor_file`]); it is
//! renamed into place and its seal written last (atomically), so an anchor exists here only
//! once it is whole. Only the newest is kept: at 70B an anchor is ~140 GB of disk. On start
//! the seal's signature and the file's size are checked again; the bytes are hashed again by
//! every actor that receives them.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use starling_checkpoint::deltafile::version_file_name;
use starling_checkpoint::writer::AtomicFile;
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::delta::manifest::TrustPolicy;
use starling_transport::fanout::AnchorSource;
use starling_transport::framed::DataStreamReader;

/// The anchor a relay holds, if any.
#[derive(Debug)]
pub(crate) struct RelayAnchors {
    dir: PathBuf,
    model_id: String,
    trust: TrustPolicy,
    newest: Mutex<Option<AnchorSeal>>,
}

impl RelayAnchors {
    /// Opens `cache/anchors`, keeping the newest anchor whose seal verifies and whose file
    /// has the sealed size.
    pub(crate) fn open(cache: &Path, model_id: &str, trust: &TrustPolicy) -> Result<Self> {
        let dir = cache.join("anchors");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let anchors = Self {
            dir,
            model_id: model_id.to_owned(),
            trust: trust.clone(),
            newest: Mutex::new(None),
        };
        let mut newest: Option<AnchorSeal> = None;
        let listing = std::fs::read_dir(&anchors.dir)
            .with_context(|| format!("list {}", anchors.dir.display()))?;
        for entry in listing.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "partial") {
                // A download a stop or a crash cut short (named after its version, so the
                // next one would not overwrite it): up to a model's size nothing refers to.
                if let Err(e) = std::fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), "remove a partial anchor: {e}");
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "seal") {
                continue;
            }
            match anchors.check_stored(&path) {
                Ok(seal) if newest.is_none_or(|n| n.version < seal.version) => {
                    newest = Some(seal);
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(path = %path.display(), "anchor ignored: {e:#}"),
            }
        }
        *anchors.lock() = newest;
        Ok(anchors)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<AnchorSeal>> {
        self.newest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn file(&self, version: u64) -> PathBuf {
        self.dir.join(version_file_name(version, "safetensors"))
    }

    fn seal_file(&self, version: u64) -> PathBuf {
        self.dir.join(version_file_name(version, "seal"))
    }

    /// A stored seal that verifies, beside a file of its size.
    fn check_stored(&self, seal_path: &Path) -> Result<AnchorSeal> {
        let bytes = std::fs::read(seal_path)?;
        let seal = AnchorSeal::from_bytes(&bytes).context("not a seal")?;
        seal.verify(&self.model_id, &self.trust)
            .context("seal does not verify")?;
        let size = std::fs::metadata(self.file(seal.version))
            .context("anchor file")?
            .len();
        if size != seal.size {
            bail!("the file has {size} bytes, its seal says {}", seal.size);
        }
        Ok(seal)
    }

    /// The version of the anchor held, if any.
    pub(crate) fn newest_version(&self) -> Option<u64> {
        self.lock().map(|s| s.version)
    }

    /// Receives the anchor `seal` describes from `stream` (the seal is checked first), makes
    /// it the one held and removes the one before.
    pub(crate) async fn receive(
        &self,
        seal: AnchorSeal,
        stream: &mut DataStreamReader,
    ) -> Result<()> {
        seal.verify(&self.model_id, &self.trust)
            .context("anchor seal")?;
        let dest = self.file(seal.version);
        let partial = dest.with_extension("safetensors.partial");
        starling_transport::anchor_file::receive(&seal, stream, &partial).await?;
        let seal_path = self.seal_file(seal.version);
        tokio::task::block_in_place(|| -> Result<()> {
            std::fs::rename(&partial, &dest)
                .with_context(|| format!("install {}", dest.display()))?;
            let mut f = AtomicFile::create(&seal_path)?;
            f.write_all(&seal.to_bytes())?;
            f.commit()?;
            Ok(())
        })?;
        let before = self.lock().replace(seal);
        if let Some(old) = before.filter(|o| o.version != seal.version) {
            for p in [self.seal_file(old.version), self.file(old.version)] {
                if let Err(e) = std::fs::remove_file(&p) {
                    tracing::warn!(path = %p.display(), "remove old anchor: {e}");
                }
            }
        }
        Ok(())
    }
}

impl AnchorSource for RelayAnchors {
    fn newest(&self) -> Option<(PathBuf, AnchorSeal)> {
        let seal = (*self.lock())?;
        Some((self.file(seal.version), seal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_download_is_removed_when_the_anchors_are_opened() {
        let root = std::env::temp_dir().join(format!(
            "starling-relay-anchors-{}-{}",
            std::process::id(),
            line!()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("anchors");
        std::fs::create_dir_all(&dir).expect("dir");
        let partial = dir.join("100.safetensors.partial");
        std::fs::write(&partial, b"cut short").expect("write");
        let other = dir.join("notes.txt");
        std::fs::write(&other, b"kept").expect("write");
        let anchors = RelayAnchors::open(&root, "m", &TrustPolicy::AnySigner).expect("open");
        assert!(!partial.exists(), "the partial download is removed");
        assert!(other.exists(), "nothing else is touched");
        assert!(anchors.lock().is_none());
        let _ = std::fs::remove_dir_all(&root);
    }
}
