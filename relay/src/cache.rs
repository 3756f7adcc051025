//! The relay's disk cache of verified versions (`--cache DIR`): each version it vouched for
//! is kept as a `.sdc` delta file (the hub's store format), the newest `--retain` of them, so
//! a restarted relay serves its region's laggards and late joiners without the WAN. On
//! start the files that continue the chain are loaded back, each verified again under the
//! cluster's trusted key; a file that fails ends the chain there (it is fetched again).

use std::path::Path;

use anyhow::{Context, Result};
use starling_checkpoint::deltafile::{delta_file_name, delta_files, write_frames};
use starling_proto::delta::manifest::TrustPolicy;
use starling_transport::book::{LiveVersion, VersionBook};

/// The oldest version in the cache.
pub(crate) fn oldest(dir: &Path) -> Option<u64> {
    delta_files(dir).into_iter().map(|(v, _)| v).min()
}

/// Writes a complete version (segments in order, manifest, trailer), and forgets `stale`
/// whether or not the write succeeded: the disk keeps what memory keeps.
pub(crate) fn store(dir: &Path, live: &LiveVersion, stale: Option<u64>) -> Result<()> {
    let written = write(dir, live);
    if let Some(old) = stale {
        let _ = std::fs::remove_file(dir.join(delta_file_name(old)));
    }
    written
}

fn write(dir: &Path, live: &LiveVersion) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let frames = live.snapshot();
    let bytes: Vec<&[u8]> = frames.iter().map(|f| f.bytes.as_slice()).collect();
    write_frames(&dir.join(delta_file_name(live.version)), &bytes)?;
    Ok(())
}

/// Loads the cached versions that continue the book's chain, each verified again; returns
/// how many.
pub(crate) fn load(dir: &Path, book: &VersionBook, trust: &TrustPolicy) -> usize {
    let mut n = 0;
    loop {
        let path = dir.join(delta_file_name(book.latest() + 1));
        let Ok(bytes) = std::fs::read(&path) else {
            return n;
        };
        if let Err(e) = book.load_delta(&bytes, trust) {
            tracing::warn!(
                path = %path.display(),
                "cache file refused: {}; ignoring the cache from here",
                starling_process::error_chain(&e)
            );
            return n;
        }
        n += 1;
    }
}
