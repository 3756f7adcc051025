//! The hub's anchors: a full checkpoint every `every` versions, kept in the store beside the
//! deltas, so that a receiver further behind than the retained deltas restores from the
//! newest anchor plus the deltas after it.
//!
//! Layout: `anchors/vNNNNNNNN.safetensors` (one file, whatever the trainer's sharding, with
//! the version in its metadata) and `anchors/vNNNNNNNN.seal` (the signed size and BLAKE3;
//! see `starling_proto::delta::anchor`). Both are written atomically, the seal last, so an anchor
//! exists only once it is whole. Retention: the newest `keep` anchors, and the delta files
//! from the oldest kept anchor on — older deltas can no longer be the shortest way anywhere.
//!
//! Scale: an anchor is a full BF16 checkpoint (16 GB at 8B, 140 GB at 70B), written by a
//! background task from the trainer's file with memory bounded by the largest tensor; at one
//! anchor per 16–64 steps the write costs a few percent of the hub's disk bandwidth.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use ed25519_dalek::SigningKey;
use starling_checkpoint::deltafile::version_file_name;
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::writer::{AtomicFile, SafetensorsWriter};
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::delta::manifest::TrustPolicy;
use starling_transport::fanout::AnchorSource;

/// The anchors of one hub.
#[derive(Debug)]
pub struct Anchors {
    dir: PathBuf,
    deltas: PathBuf,
    model_id: String,
    key: SigningKey,
    keep: usize,
    index: Mutex<BTreeMap<u64, AnchorSeal>>,
}

impl Anchors {
    /// Opens `store/anchors`, keeping the anchors whose seal verifies under `key`.
    pub fn open(store: &Path, model_id: &str, key: SigningKey, keep: usize) -> Result<Self> {
        let dir = store.join("anchors");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let trust = TrustPolicy::Keys(vec![key.verifying_key()]);
        let mut index = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).with_context(|| format!("list {}", dir.display()))? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "seal") {
                continue;
            }
            match read_seal(&path) {
                Ok(seal) if seal.verify(model_id, &trust).is_ok() => {
                    index.insert(seal.version, seal);
                }
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "anchor seal does not verify; ignored")
                }
                Err(e) => tracing::warn!(path = %path.display(), "anchor ignored: {e:#}"),
            }
        }
        Ok(Self {
            dir,
            deltas: store.join("deltas"),
            model_id: model_id.to_owned(),
            key,
            keep: keep.max(1),
            index: Mutex::new(index),
        })
    }

    fn file(&self, version: u64) -> PathBuf {
        self.dir.join(version_file_name(version, "safetensors"))
    }

    fn seal_file(&self, version: u64) -> PathBuf {
        self.dir.join(version_file_name(version, "seal"))
    }

    pub fn has(&self, version: u64) -> bool {
        self.index
            .lock()
            .map(|i| i.contains_key(&version))
            .unwrap_or(false)
    }

    /// Writes the anchor of `version` from `checkpoint` (a file or sharded directory), then
    /// applies the retention policy. Blocking: run it off the async runtime.
    pub fn write(&self, checkpoint: &Path, version: u64) -> Result<AnchorSeal> {
        let src = Checkpoint::open(checkpoint)
            .with_context(|| format!("open {}", checkpoint.display()))?;
        let layout: Vec<(String, Vec<u64>)> = src
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let dest = self.file(version);
        let mut out = SafetensorsWriter::create(&dest, &layout, Some(version))
            .with_context(|| format!("create {}", dest.display()))?;
        for t in src.tensors() {
            out.write(&src.read_tensor(t)?)
                .with_context(|| format!("write {}", dest.display()))?;
        }
        out.finish()
            .with_context(|| format!("write {}", dest.display()))?;
        let (size, hash) = hash_file(&dest)?;
        let seal = AnchorSeal::sign(&self.key, &self.model_id, version, size, hash);
        let mut s = AtomicFile::create(&self.seal_file(version))?;
        s.write_all(&seal.to_bytes())?;
        s.commit()?;
        if let Ok(mut i) = self.index.lock() {
            i.insert(version, seal);
        }
        self.prune();
        Ok(seal)
    }

    /// Keeps the newest `keep` anchors and the deltas from the oldest of them on.
    fn prune(&self) {
        let Ok(mut index) = self.index.lock() else {
            return;
        };
        while index.len() > self.keep {
            let Some((&old, _)) = index.iter().next() else {
                break;
            };
            index.remove(&old);
            for p in [self.seal_file(old), self.file(old)] {
                if let Err(e) = std::fs::remove_file(&p) {
                    tracing::warn!(path = %p.display(), "remove old anchor: {e}");
                }
            }
        }
        let Some(&oldest) = index.keys().next() else {
            return;
        };
        starling_checkpoint::deltafile::remove_deltas_through(&self.deltas, oldest);
    }
}

impl AnchorSource for Anchors {
    fn newest(&self) -> Option<(PathBuf, AnchorSeal)> {
        let index = self.index.lock().ok()?;
        let (&v, seal) = index.iter().next_back()?;
        Some((self.file(v), *seal))
    }
}

fn hash_file(path: &Path) -> Result<(u64, [u8; 32])> {
    let mut f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, *h.finalize().as_bytes()))
}

fn read_seal(path: &Path) -> Result<AnchorSeal> {
    let b = std::fs::read(path)?;
    AnchorSeal::from_bytes(&b).with_context(|| {
        format!(
            "a seal is {} bytes, this one {}",
            starling_proto::delta::anchor::SEAL_LEN,
            b.len()
        )
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};

    #[test]
    fn anchors_are_sealed_reloaded_and_pruned_with_older_deltas() {
        let dir = tempfile::tempdir().unwrap();
        let steps = generate_to_dir(
            &ModelSpec::preset("tiny").unwrap(),
            1,
            &TrainConfig::default(),
            &dir.path().join("ckpt"),
            &|_| {},
        )
        .unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir_all(store.join("deltas")).unwrap();
        for v in 1..=6 {
            std::fs::write(
                store
                    .join("deltas")
                    .join(starling_checkpoint::deltafile::delta_file_name(v)),
                b"x",
            )
            .unwrap();
        }
        let key = SigningKey::from_bytes(&[5; 32]);
        let a = Anchors::open(&store, "tiny", key.clone(), 2).unwrap();
        for v in [2, 4, 6] {
            let seal = a.write(&steps[1], v).unwrap();
            let (size, hash) = hash_file(&a.file(v)).unwrap();
            assert_eq!((seal.size, seal.hash), (size, hash));
        }
        assert!(!a.has(2) && a.has(4) && a.has(6));
        assert!(!a.file(2).exists());
        let left: Vec<bool> = (1..=6)
            .map(|v| {
                store
                    .join("deltas")
                    .join(starling_checkpoint::deltafile::delta_file_name(v))
                    .exists()
            })
            .collect();
        assert_eq!(left, [false, false, false, false, true, true]);
        let again = Anchors::open(&store, "tiny", key, 2).unwrap();
        assert_eq!(again.newest().map(|(_, s)| s.version), Some(6));
        let other = Anchors::open(&store, "tiny", SigningKey::from_bytes(&[6; 32]), 2).unwrap();
        assert!(
            other.newest().is_none(),
            "another key's seals are not trusted"
        );
        let copy = Checkpoint::open(&a.file(6)).unwrap();
        assert_eq!(copy.version(), Some(6));
        assert_eq!(
            copy.read_all().unwrap(),
            Checkpoint::open(&steps[1]).unwrap().read_all().unwrap()
        );
    }
}
