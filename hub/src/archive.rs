//! Retention on the hub: batches the trainer has read to their end are archived out of the
//! ledger (`starling_ledger::Retention` says which), so the ledger's size follows the work in
//! flight rather than the run's length.
//!
//! For each batch: its results are read page by page and written, one JSON document per line
//! in cursor order (exactly what the results endpoint serves), to `batch-<id>.jsonl` in the
//! archive directory, which is made durable (fsync, rename, fsync of the directory) before
//! the ledger deletes the rows (`Ledger::archive_batch`, which checks the count). The results
//! endpoint then serves the batch from the file, and the trainer can read the file itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use starling_checkpoint::writer::AtomicFile;
use starling_ledger::{BatchId, Ledger, Retention};

use crate::clock::now;
use crate::results;

/// Batches archived per round at most.
const PER_ROUND: u32 = 16;
/// Results read per page while archiving.
const PAGE: u32 = 256;

/// Archives what `policy` says every `every`, until the task is dropped.
pub(crate) async fn run(ledger: Arc<Ledger>, dir: PathBuf, policy: Retention, every: Duration) {
    let mut timer = tokio::time::interval(every);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        timer.tick().await;
        let due = match ledger.archivable(policy, now(), PER_ROUND).await {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(
                    "read batches to archive: {}",
                    starling_process::error_chain(&e)
                );
                continue;
            }
        };
        for batch in due {
            match archive(&ledger, &dir, batch).await {
                Ok(n) => tracing::info!(batch = batch.raw(), results = n, "batch archived"),
                Err(e) => tracing::error!(batch = batch.raw(), "archive batch: {e:#}"),
            }
        }
    }
}

/// The archive file of `batch` in `dir`.
pub(crate) fn path_of(dir: &Path, batch: BatchId) -> PathBuf {
    dir.join(format!("batch-{}.jsonl", batch.raw()))
}

/// Writes `batch`'s results to its file, durably, then deletes them from the ledger.
/// Returns how many results it archived.
pub(crate) async fn archive(ledger: &Ledger, dir: &Path, batch: BatchId) -> Result<u64> {
    let path = path_of(dir, batch);
    let dest = path.clone();
    let dir_owned = dir.to_owned();
    let mut file = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir_owned)?;
        AtomicFile::create(&dest)
    })
    .await
    .context("archive task")?
    .with_context(|| format!("create {}", path.display()))?;
    let mut cursor = 0;
    let mut count = 0u64;
    loop {
        let page = ledger
            .results_page(batch, cursor, PAGE, results::MAX_PAGE_BYTES as u64)
            .await
            .context("read results")?;
        let Some(last) = page.results.last() else {
            break;
        };
        cursor = last.cursor;
        let mut buf = Vec::new();
        for r in &page.results {
            buf.extend_from_slice(&results::render(batch.raw(), r)?);
            buf.push(b'\n');
            count += 1;
        }
        file = tokio::task::spawn_blocking(move || file.write_all(&buf).map(|()| file))
            .await
            .context("archive task")?
            .with_context(|| format!("write {}", path.display()))?;
        if !page.more {
            break;
        }
    }
    tokio::task::spawn_blocking(move || file.commit())
        .await
        .context("archive task")?
        .with_context(|| format!("write {}", path.display()))?;
    let text = path.display().to_string();
    // On an error nothing was deleted; the file is written again on a later round.
    ledger
        .archive_batch(batch, &text, count, now())
        .await
        .context("delete the archived rows from the ledger")?;
    Ok(count)
}
