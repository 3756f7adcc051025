//! Watches when each actor activates each version, by polling the actors' `/metrics`
//! (`starling_actor_active_version`), so the demo can report how long each version took to reach
//! each region; and whether each actor's rollout worker is registered with the hub
//! (`starling_actor_worker_connected`), so the demo submits work only once every actor can get some. A thread owned by [`Watcher`]; dropping the watcher stops and joins it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use starling_telemetry::http_client::{self, Limits};

/// When each (actor, version) was first seen active.
pub(crate) type Seen = BTreeMap<(String, u64), Instant>;

/// The polling thread and what it has seen.
#[derive(Debug)]
pub(crate) struct Watcher {
    seen: Arc<Mutex<Seen>>,
    workers: Arc<Mutex<BTreeMap<String, bool>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Polls every actor's metrics endpoint every `every`.
    pub(crate) fn start(actors: Vec<(String, SocketAddr)>, every: Duration) -> Self {
        let seen = Arc::new(Mutex::new(Seen::new()));
        let workers = Arc::new(Mutex::new(BTreeMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, w, st) = (seen.clone(), workers.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                for (name, addr) in &actors {
                    let Some(text) = scrape(*addr) else {
                        continue;
                    };
                    let now = Instant::now();
                    if let Some(v) = gauge(&text, "starling_actor_active_version") {
                        let mut map = s.lock().unwrap_or_else(PoisonError::into_inner);
                        map.entry((name.clone(), v)).or_insert(now);
                    }
                    let connected = gauge(&text, "starling_actor_worker_connected") == Some(1);
                    w.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(name.clone(), connected);
                }
                std::thread::sleep(every);
            }
        });
        Self {
            seen,
            workers,
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

    /// Whether every one of `actors` has its rollout worker registered with the hub.
    pub(crate) fn workers_connected(&self, actors: &[String]) -> bool {
        let map = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        actors.iter().all(|a| map.get(a).copied().unwrap_or(false))
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

/// How long one scrape may take in all: what the hand-written scrape this replaced allowed a
/// silent actor (200 ms to connect, 500 ms for the answer), so one wedged actor delays the
/// others' readings no more than it did.
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(700);
/// The largest metrics text read from one actor.
const SCRAPE_LIMIT: u64 = 4 << 20;

/// The endpoint's metrics text, if it answers (whatever its status, as before: a page without
/// the gauges reads as an actor without them). An actor's scrape is a few kilobytes; the
/// limits keep a wedged or wrong endpoint from stalling the watch or filling its memory.
fn scrape(addr: SocketAddr) -> Option<String> {
    http_client::request(
        &addr.to_string(),
        "GET",
        "/metrics",
        &[],
        None,
        Limits::timeout(SCRAPE_TIMEOUT).body_limit(SCRAPE_LIMIT),
    )
    .ok()
    .map(|r| r.body)
}

/// An unlabelled gauge's value in a metrics text.
fn gauge(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn gauges_are_read_by_exact_name() {
        let text = "# TYPE starling_actor_active_version gauge\nstarling_actor_active_version 7\nstarling_actor_active_version_x 9\nstarling_actor_worker_connected 1\n";
        assert_eq!(super::gauge(text, "starling_actor_active_version"), Some(7));
        assert_eq!(
            super::gauge(text, "starling_actor_worker_connected"),
            Some(1)
        );
        assert_eq!(super::gauge(text, "starling_missing"), None);
    }
}
