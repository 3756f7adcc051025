//! Watches when each actor activates each version, by polling the actors' `/metrics`
//! (`starling_versions_active`), so the demo can report how long each version took to reach
//! each region. A thread owned by [`Watcher`]; dropping the watcher stops and joins it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// When each (actor, version) was first seen active.
pub(crate) type Seen = BTreeMap<(String, u64), Instant>;

/// The polling thread and what it has seen.
#[derive(Debug)]
pub(crate) struct Watcher {
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Polls every actor's metrics endpoint every `every`.
    pub(crate) fn start(actors: Vec<(String, SocketAddr)>, every: Duration) -> Self {
        let seen = Arc::new(Mutex::new(Seen::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                for (name, addr) in &actors {
                    if let Some(v) = active_version(*addr) {
                        let now = Instant::now();
                        let mut map = s.lock().unwrap_or_else(PoisonError::into_inner);
                        map.entry((name.clone(), v)).or_insert(now);
                    }
                }
                std::thread::sleep(every);
            }
        });
        Self {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// When `actor` was first seen at `version` or later.
    pub(crate) fn reached(&self, actor: &str, version: u64) -> Option<Instant> {
        let map = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        map.iter()
            .filter(|((a, v), _)| a == actor && *v >= version)
            .map(|(_, t)| *t)
            .min()
    }

    /// The newest version every one of `actors` has reached.
    pub(crate) fn all_reached(&self, actors: &[String]) -> Option<u64> {
        let map = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        actors
            .iter()
            .map(|a| map.keys().filter(|(n, _)| n == a).map(|(_, v)| *v).max())
            .collect::<Option<Vec<u64>>>()
            .and_then(|v| v.into_iter().min())
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The `starling_versions_active` gauge of the endpoint, if it answers.
fn active_version(addr: SocketAddr) -> Option<u64> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.lines()
        .find(|l| l.starts_with("starling_versions_active "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
}
