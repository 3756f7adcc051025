//! Crash safety: a real child process (`ledger-stress`) claims and submits on an SQLite file
//! and prints each operation after its commit; we SIGKILL it mid-run, reopen the file, and
//! check that every acknowledged claim and acceptance is there, that the invariants hold over
//! all rows, and that the remaining work can be finished after the restart.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use starling_ledger::clock::{Clock, SystemClock};
use starling_ledger::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_run_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("crash.db").display());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ledger-stress"))
        .args([
            "--url",
            &url,
            "--jobs",
            "30000",
            "--actors",
            "8",
            "--claim",
            "8",
            "--seconds",
            "120",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start ledger-stress");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });

    let mut claimed: HashMap<i64, String> = HashMap::new();
    let mut accepted: HashMap<i64, String> = HashMap::new();
    let record =
        |line: &str, claimed: &mut HashMap<i64, String>, accepted: &mut HashMap<i64, String>| {
            let mut words = line.split_whitespace();
            let kind = words.next().unwrap_or("");
            if kind != "CLAIMED" && kind != "ACCEPTED" {
                return;
            }
            let actor = words.next().unwrap().to_owned();
            for id in words {
                let id: i64 = id.parse().unwrap();
                let map = if kind == "CLAIMED" {
                    &mut *claimed
                } else {
                    &mut *accepted
                };
                assert!(
                    map.insert(id, actor.clone()).is_none() || kind == "CLAIMED",
                    "accepted twice: {line}"
                );
            }
        };
    // Let it run until it has acknowledged a good amount of work, then kill it mid-flight.
    let deadline = Instant::now() + Duration::from_secs(90);
    while accepted.len() < 3_000 {
        assert!(
            Instant::now() < deadline,
            "ledger-stress made too little progress"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "ledger-stress ended before it was killed"
        );
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            assert_ne!(line, "DONE", "ledger-stress finished before it was killed");
            record(&line, &mut claimed, &mut accepted);
        }
    }
    child.kill().expect("SIGKILL ledger-stress");
    let status = child.wait().unwrap();
    assert!(!status.success(), "killed, not exited: {status:?}");
    reader.join().unwrap();
    // Lines already written before the kill are acknowledged operations too.
    for line in rx.try_iter() {
        record(&line, &mut claimed, &mut accepted);
    }
    println!(
        "acknowledged before SIGKILL: {} claims, {} acceptances",
        claimed.len(),
        accepted.len()
    );

    let ledger = Ledger::open(&url, LedgerConfig::default())
        .await
        .expect("reopen after crash");
    ledger
        .check_invariants()
        .await
        .expect("invariants after crash");
    let counts = ledger.job_counts().await.unwrap();
    assert_eq!(counts.total(), 30_000);
    assert!(counts.done >= accepted.len() as u64);
    for (id, actor) in &accepted {
        let job = ledger.job(JobId::from_raw(*id)).await.unwrap();
        assert_eq!(
            job.state,
            JobState::Done,
            "acknowledged acceptance of job {id} lost"
        );
        assert_eq!(
            job.accepted_from.as_ref().map(ActorId::as_str),
            Some(actor.as_str())
        );
    }
    for id in claimed.keys() {
        let job = ledger.job(JobId::from_raw(*id)).await.unwrap();
        assert!(job.attempts >= 1, "acknowledged claim of job {id} lost");
        assert!(
            matches!(job.state, JobState::Leased | JobState::Done),
            "job {id} is {:?}",
            job.state
        );
    }

    // After the restart: leases of the dead process expire and another actor finishes all work.
    let later = SystemClock.now().plus(Duration::from_secs(3_600));
    let returned = ledger.expire(later).await.unwrap();
    println!("after restart: {returned:?}");
    let survivor = ActorId::new("survivor").unwrap();
    let v0 = Version::new(0).unwrap();
    ledger
        .register_actor(&survivor, "local", "cpu", later)
        .await
        .unwrap();
    ledger
        .heartbeat(&survivor, Some(v0), None, later)
        .await
        .unwrap();
    let mut digest = [0u8; 16];
    digest[..8].copy_from_slice(&0u64.to_le_bytes());
    loop {
        let jobs = ledger.claim(&survivor, 1_000, later).await.unwrap();
        if jobs.is_empty() {
            break;
        }
        let results: Vec<ResultSubmission> = jobs
            .iter()
            .map(|j| ResultSubmission {
                job: j.id,
                version: v0,
                digest: Digest(digest),
                tokens: 1,
                elapsed: Duration::from_millis(1),
                payload: vec![],
            })
            .collect();
        let out = ledger.submit(&survivor, &results, later).await.unwrap();
        assert!(out.iter().all(|o| o.verdict.is_ok()));
    }
    let counts = ledger.job_counts().await.unwrap();
    assert_eq!(counts.done, 30_000, "{counts:?}");
    ledger
        .check_invariants()
        .await
        .expect("invariants after recovery");
    ledger.close().await;
}
