//! Receiving an anchor (a full checkpoint, see `starling_proto::delta::anchor`) into a file: the
//! bytes that follow `Anchor { seal }` on its stream, hashed as they arrive and written on a
//! blocking thread, so a multi-gigabyte anchor never stalls the receiver's event loop.
//!
//! Used by actors (the anchor becomes their snapshot) and relays (the anchor restarts their
//! chain and is offered to their region's actors). The seal's signature is the caller's to
//! check first: this module checks that the bytes are the ones the seal describes — exactly
//! `seal.size` of them, with BLAKE3 `seal.hash` — and makes them durable before it returns.
//! A stream that runs past the sealed size is cut off at once, so a broken or hostile sender
//! cannot fill the disk.

use std::io::Write;
use std::path::{Path, PathBuf};

use starling_proto::delta::anchor::AnchorSeal;
use thiserror::Error;
use tokio::sync::mpsc;

use crate::framed::{DataStreamReader, FramedError};

/// Chunks queued between the stream and the writer thread (each up to 64 KiB): bounds the
/// memory an anchor in flight takes, whatever the disk's speed.
const QUEUED_CHUNKS: usize = 64;

#[derive(Debug, Error)]
pub enum AnchorFileError {
    #[error("anchor stream")]
    Stream(#[from] FramedError),
    #[error("write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the anchor is longer than its sealed {sealed} bytes")]
    TooLong { sealed: u64 },
    #[error("the anchor's bytes do not match its seal ({got} of {sealed} bytes)")]
    Mismatch { got: u64, sealed: u64 },
    #[error("the anchor writer thread failed")]
    Writer,
    #[error("no anchor bytes for {secs} s ({got} of {sealed} bytes here)")]
    Stalled { secs: f64, got: u64, sealed: u64 },
}

/// An anchor whose sender sends nothing for this long is given up (the source is left and
/// another one asked): a connection kept alive with nothing on it would otherwise hold the
/// receiver for good.
pub const ANCHOR_STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// Receives the anchor sealed by `seal` from `stream` into `dest` (created or truncated),
/// checks size and hash against the seal and syncs the file. On any error the partial file
/// is removed.
pub async fn receive(
    seal: &AnchorSeal,
    stream: &mut DataStreamReader,
    dest: &Path,
) -> Result<(), AnchorFileError> {
    receive_within(seal, stream, dest, ANCHOR_STALL).await
}

/// As [`receive`], giving up after `stall` without a byte ([`ANCHOR_STALL`] there).
pub async fn receive_within(
    seal: &AnchorSeal,
    stream: &mut DataStreamReader,
    dest: &Path,
    stall: std::time::Duration,
) -> Result<(), AnchorFileError> {
    let received = receive_inner(seal, stream, dest, stall).await;
    if received.is_err() {
        let _ = std::fs::remove_file(dest);
    }
    received
}

async fn receive_inner(
    seal: &AnchorSeal,
    stream: &mut DataStreamReader,
    dest: &Path,
    stall: std::time::Duration,
) -> Result<(), AnchorFileError> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>(QUEUED_CHUNKS);
    let writer = {
        let dest = dest.to_owned();
        tokio::task::spawn_blocking(move || write_hashed(&dest, rx))
    };
    let mut size = 0u64;
    let mut failed = None;
    loop {
        let Ok(next) = tokio::time::timeout(stall, stream.chunk()).await else {
            failed = Some(AnchorFileError::Stalled {
                secs: stall.as_secs_f64(),
                got: size,
                sealed: seal.size,
            });
            break;
        };
        match next {
            Ok(Some(chunk)) => {
                size += chunk.len() as u64;
                if size > seal.size {
                    failed = Some(AnchorFileError::TooLong { sealed: seal.size });
                    break;
                }
                if tx.send(chunk).await.is_err() {
                    // The writer stopped: its error says why.
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                failed = Some(e.into());
                break;
            }
        }
    }
    drop(tx);
    let written = writer.await.map_err(|_| AnchorFileError::Writer)?;
    if let Some(e) = failed {
        return Err(e);
    }
    let (got, hash) = written?;
    if got != seal.size || hash != seal.hash {
        return Err(AnchorFileError::Mismatch {
            got,
            sealed: seal.size,
        });
    }
    Ok(())
}

/// The writer thread: appends every chunk to `dest` while hashing it, then syncs; returns
/// the size and BLAKE3 of what it wrote.
fn write_hashed(
    dest: &Path,
    mut rx: mpsc::Receiver<Vec<u8>>,
) -> Result<(u64, [u8; 32]), AnchorFileError> {
    let io = |source| AnchorFileError::Write {
        path: dest.to_owned(),
        source,
    };
    let mut file = std::fs::File::create(dest).map_err(io)?;
    let mut hasher = blake3::Hasher::new();
    let mut size = 0u64;
    while let Some(chunk) = rx.blocking_recv() {
        hasher.update(&chunk);
        file.write_all(&chunk).map_err(io)?;
        size += chunk.len() as u64;
    }
    file.sync_all().map_err(io)?;
    Ok((size, *hasher.finalize().as_bytes()))
}
