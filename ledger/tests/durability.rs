//! Durability on SQLite: every acceptance the ledger acknowledges must be on disk before it
//! is acknowledged, so a power loss cannot take back a result an actor was told was accepted
//! (nor a version the hub announced: the same `durably` commit records both).
//!
//! A power loss cannot be staged in a test, but what survives one can be observed: data
//! written to a file survives it only once an `fsync`/`fdatasync` of that file returned. So
//! `ledger-stress` (one actor, printing `ACCEPTED …` after each submit commits) runs under
//! `strace`, which records every write to the WAL, every sync of it and every line printed,
//! in order; each `ACCEPTED` line must come after a completed sync of the WAL that follows
//! the last write to it. With `synchronous = NORMAL` (before) the WAL was synced only at
//! checkpoints, and almost every acknowledgement came before its commit was durable.
//! Needs `strace` (Debian's package; the test says so and passes without it).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::process::{Command, Stdio};

#[test]
fn acceptances_are_synced_to_disk_before_they_are_acknowledged() {
    if Command::new("strace").arg("-V").output().is_err() {
        println!("skipped: strace is not installed (apt-get install strace)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("durable.db");
    let trace = dir.path().join("trace");
    let status = Command::new("strace")
        .args(["-f", "-y", "-qq", "-s", "24", "-o"])
        .arg(&trace)
        .args([
            "-e",
            "trace=write,pwrite64,pwritev,pwritev2,fsync,fdatasync",
            "--",
            env!("CARGO_BIN_EXE_ledger-stress"),
            "--url",
        ])
        .arg(format!("sqlite:{}", db.display()))
        .args([
            "--jobs",
            "240",
            "--actors",
            "1",
            "--claim",
            "8",
            "--seconds",
            "60",
        ])
        .stdout(Stdio::null())
        .status()
        .expect("run ledger-stress under strace");
    assert!(status.success(), "ledger-stress failed: {status}");
    let text = std::fs::read_to_string(&trace).unwrap();
    let (acks, early) = acknowledged_before_sync(&text);
    assert!(acks >= 20, "{acks} acceptances seen in the trace");
    assert!(
        early.is_empty(),
        "{} of {acks} acceptances were acknowledged before the WAL was synced, e.g. line {}",
        early.len(),
        early[0]
    );
}

/// Walks an `strace -f -y` trace: returns how many `ACCEPTED` lines were printed, and the
/// trace lines of those printed while the WAL held writes no completed sync covered.
fn acknowledged_before_sync(trace: &str) -> (usize, Vec<usize>) {
    let mut dirty = false;
    // Syncs of the WAL a thread started and has not finished.
    let mut syncing: HashMap<&str, bool> = HashMap::new();
    let (mut acks, mut early) = (0, Vec::new());
    for (n, line) in trace.lines().enumerate() {
        let (pid, call) = line.split_once(' ').unwrap_or(("", line));
        let call = call.trim_start();
        let wal = call.contains("-wal>");
        let is_sync = call.starts_with("fdatasync(") || call.starts_with("fsync(");
        if call.starts_with("<... fdatasync resumed>") || call.starts_with("<... fsync resumed>") {
            if syncing.remove(pid).unwrap_or(false) && call.ends_with("= 0") {
                dirty = false;
            }
        } else if is_sync && wal {
            if call.contains("<unfinished ...>") {
                syncing.insert(pid, true);
            } else if call.ends_with("= 0") {
                dirty = false;
            }
        } else if call.starts_with("pwrite") && wal {
            dirty = true;
        } else if call.starts_with("write(1") && call.contains("\"ACCEPTED") {
            acks += 1;
            if dirty {
                early.push(n + 1);
            }
        }
    }
    (acks, early)
}

#[test]
fn the_trace_reader_tells_synced_from_unsynced() {
    let t = "1 pwrite64(5</d/x.db-wal>, \"\"..., 4120, 0) = 4120\n\
             1 fdatasync(5</d/x.db-wal> <unfinished ...>\n\
             2 write(1</dev/null>, \"ACCEPTED a 1\\n\", 13) = 13\n\
             1 <... fdatasync resumed>) = 0\n\
             2 write(1</dev/null>, \"ACCEPTED a 2\\n\", 13) = 13\n\
             1 pwrite64(5</d/x.db-wal>, \"\"..., 4120, 0) = 4120\n\
             2 write(1</dev/null>, \"ACCEPTED a 3\\n\", 13) = 13\n\
             1 pwrite64(4</d/x.db>, \"\"..., 4096, 0) = 4096\n\
             1 fdatasync(5</d/x.db-wal>) = 0\n\
             2 write(1</dev/null>, \"ACCEPTED a 4\\n\", 13) = 13\n";
    assert_eq!(acknowledged_before_sync(t), (4, vec![3, 7]));
}
