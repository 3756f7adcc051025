//! The distribution path with real processes on loopback: a hub (`starling-hub serve`),
//! relays (`starling-relay`), actors (`starling-actor`), the trainer publishing versions
//! (`starling-hub publish`). Every actor must reach every version bit-identically; a corrupted
//! transmission is refused and fetched again, never applied; an actor killed with SIGKILL and
//! restarted resumes from its store; a killed relay's actors fail over to the hub.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use starling_tests::{CORRUPT_VERSION_VAR, Testbed, bin, http_get, metric, next_event, wait_for};

#[test]
fn hub_delivers_every_version_to_every_actor_bit_identically() {
    let peers = [("actor", "a1"), ("actor", "a2")];
    // The hub is `starling-fault-hub` (the test bed picks it for this variable).
    let mut tb = Testbed::new(5, 5, &peers, &[(CORRUPT_VERSION_VAR, "2")]);
    let dl = tb.deadline;
    let a1 = tb.actor("a1", &[]);
    let mut a2 = tb.actor("a2", &[]);
    wait_for(&a1, "active 0 ", dl);
    wait_for(&a2, "active 0 ", dl);
    for k in 1..=3 {
        tb.publish(k);
        let want = tb.active_line(k);
        // The hub corrupts one byte of version 2's first transmission (to whichever actor
        // it serves first): that actor must refuse it, fetch it again, and only then
        // activate the right bits.
        let mut refetched = false;
        for rx in [&a1, &a2] {
            let mut line = next_event(rx, dl);
            if line.starts_with("refetch ") {
                assert_eq!(line, format!("refetch {k}"));
                refetched = true;
                line = next_event(rx, dl);
            }
            assert_eq!(line, want);
        }
        assert_eq!(refetched, k == 2, "exactly version 2 was refetched, once");
    }
    // SIGKILL actor 2 at version 3, publish version 4 without it, restart it from its store.
    tb.kill(2);
    tb.publish(4);
    assert_eq!(wait_for(&a1, "active 4 ", dl), tb.active_line(4));
    a2 = tb.actor("a2", &[]);
    assert_eq!(
        wait_for(&a2, "active 3 ", dl),
        tb.active_line(3),
        "resumed from its store"
    );
    assert_eq!(
        wait_for(&a2, "active 4 ", dl),
        tb.active_line(4),
        "caught up"
    );
    tb.publish(5);
    for rx in [&a1, &a2] {
        assert_eq!(wait_for(rx, "active 5 ", dl), tb.active_line(5));
    }
    tb.assert_store_is("a1", 5);
    tb.assert_store_is("a2", 5);
}

/// The corruption hook above is armed only by the tests' own `starling-fault-hub`: the
/// binaries a user builds (`cargo build --release --workspace` unifies every package's
/// features, the tests' included) neither contain the hook's variable nor act on it.
#[test]
fn released_binaries_ignore_the_fault_hooks_variable() {
    let contains = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    let var = CORRUPT_VERSION_VAR.as_bytes();
    for name in [
        "starling-hub",
        "starling-relay",
        "starling-actor",
        "starling",
    ] {
        let bytes = std::fs::read(bin(name)).expect("read the binary");
        assert!(
            !contains(&bytes, var),
            "{name} carries the test-only variable {CORRUPT_VERSION_VAR}"
        );
    }
    // The check sees the variable where it is meant to be.
    let fault_hub = std::fs::read(bin("starling-fault-hub")).expect("read starling-fault-hub");
    assert!(contains(&fault_hub, var));

    // And by behaviour: the released hub, started with the variable naming version 1, sends
    // version 1 intact (the fault hub would corrupt it and the actor would refetch it).
    let mut tb = Testbed::new(2, 9, &[("actor", "a1")], &[]);
    let dl = tb.deadline;
    tb.kill_hub();
    tb.restart_hub_with_env(&[(CORRUPT_VERSION_VAR, "1")]);
    let a1 = tb.actor("a1", &[]);
    wait_for(&a1, "active 0 ", dl);
    for k in 1..=2 {
        tb.publish(k);
        assert_eq!(
            next_event(&a1, dl),
            tb.active_line(k),
            "version {k}, not refetched"
        );
    }
}

#[test]
fn relays_carry_one_copy_per_region_and_actors_fail_over_to_the_hub_and_back() {
    let peers = [
        ("relay", "r-eu"),
        ("relay", "r-us"),
        ("actor", "eu-1"),
        ("actor", "eu-2"),
        ("actor", "us-1"),
    ];
    let mut tb = Testbed::new(5, 8, &peers, &[]);
    let dl = tb.deadline;
    let (eu_addr, eu_out) = tb.relay("r-eu");
    let (us_addr, us_out) = tb.relay("r-us");
    let mut actors = Vec::new();
    for (name, relay) in [
        ("eu-1", format!("r-eu@{eu_addr}")),
        ("eu-2", format!("r-eu@{eu_addr}")),
        ("us-1", format!("r-us@{us_addr}")),
    ] {
        let out = tb.actor(name, std::slice::from_ref(&relay));
        let relay_name = relay.split('@').next().unwrap_or_default().to_owned();
        assert_eq!(
            wait_for(&out, "upstream ", dl),
            format!("upstream relay {relay_name}")
        );
        actors.push(out);
    }
    for k in 1..=3 {
        tb.publish(k);
        for out in [&eu_out, &us_out] {
            assert_eq!(wait_for(out, "cached ", dl), format!("cached {k}"));
        }
        for out in &actors {
            assert_eq!(
                wait_for(out, &format!("active {k} "), dl),
                tb.active_line(k)
            );
        }
    }
    // The hub sent each version exactly once per region (to the two relays), never to actors:
    // in bytes (its metrics) and as its status shows each version's propagation.
    let m = tb.hub_metrics();
    let frames = tb.delta_frame_bytes(1..=3) as f64;
    for relay in ["r-eu", "r-us"] {
        let series = format!("starling_hub_delta_sent_bytes_total{{peer=\"{relay}\"}}");
        assert_eq!(metric(&m, &series), Some(frames), "{series}");
    }
    for actor in ["eu-1", "eu-2", "us-1"] {
        assert!(
            !m.contains(&format!("peer=\"{actor}\"")),
            "the hub sent to {actor}"
        );
    }
    // The relays' `Staged` reports reach the hub a moment after they cached the version.
    let propagated = |status: &serde_json::Value| {
        (1..=3u64).all(|k| {
            status["versions"]
                .as_array()
                .and_then(|vs| vs.iter().find(|v| v["version"] == k))
                .and_then(|v| v["regions"].as_array())
                .is_some_and(|regions| {
                    regions.len() == 2
                        && regions.iter().all(|r| {
                            r["relay_sent_at_ms"].is_u64() && r["relay_staged_at_ms"].is_u64()
                        })
                })
        })
    };
    loop {
        let status = tb.hub_status();
        if propagated(&status) {
            break;
        }
        assert!(
            Instant::now() < dl,
            "versions 1-3 through both relays in the status: {status}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Kill the EU relay (started right after the hub): its actors fail over to the hub.
    tb.kill(1);
    for out in &actors[..2] {
        assert_eq!(wait_for(out, "upstream ", dl), "upstream hub hub");
    }
    tb.publish(4);
    for out in &actors {
        assert_eq!(wait_for(out, "active 4 ", dl), tb.active_line(4));
    }
    for name in ["eu-1", "eu-2", "us-1"] {
        tb.assert_store_is(name, 4);
    }

    // The relay comes back on its address: once it holds what they hold, its actors return to
    // it at a version boundary, and the next version crosses to the region once again.
    let hub_addr = tb.hub_addr.clone();
    let (again, _eu_back) = tb.relay_on("r-eu", &eu_addr, &hub_addr, &[]);
    assert_eq!(again, eu_addr);
    for out in &actors[..2] {
        assert_eq!(wait_for(out, "upstream ", dl), "upstream relay r-eu");
    }
    let to_eu_actors = |m: &str| {
        ["eu-1", "eu-2"].map(|a| {
            let series = format!("starling_hub_delta_sent_bytes_total{{peer=\"{a}\"}}");
            metric(m, &series).unwrap_or(0.0)
        })
    };
    let before = to_eu_actors(&tb.hub_metrics());
    assert!(
        before.iter().all(|&b| b > 0.0),
        "version 4 went to them from the hub"
    );
    tb.publish(5);
    for out in &actors {
        assert_eq!(wait_for(out, "active 5 ", dl), tb.active_line(5));
    }
    assert_eq!(
        to_eu_actors(&tb.hub_metrics()),
        before,
        "version 5 reached eu's actors through their relay, not from the hub"
    );
    for name in ["eu-1", "eu-2", "us-1"] {
        tb.assert_store_is(name, 5);
    }
}

/// The issue's headline scenario at small scale: 1 hub, 2 regions behind emulated WAN links
/// (user-space `starling-netem`: 100 Mbit/s, 30 ms and 60 ms RTT, 0.1% loss on the second),
/// 3 actors per region, 20 versions. After every version every actor's stored weights are
/// checked bit for bit (BLAKE3 of every tensor), and each version crossed each WAN link once.
#[test]
fn twenty_versions_reach_three_actors_in_each_of_two_regions_over_emulated_links() {
    let regions = [
        ("r-a", ["a-1", "a-2", "a-3"]),
        ("r-b", ["b-1", "b-2", "b-3"]),
    ];
    let mut peers = Vec::new();
    for (relay, actors) in &regions {
        peers.push(("relay", *relay));
        for a in actors {
            peers.push(("actor", *a));
        }
    }
    let mut tb = Testbed::new(20, 21, &peers, &[]);
    let dl = tb.deadline;
    let links = [
        ["--rate", "100mbit", "--delay", "15ms", "--loss", "0%"],
        ["--rate", "100mbit", "--delay", "30ms", "--loss", "0.1%"],
    ];
    let mut relay_outs = Vec::new();
    let mut actor_outs = Vec::new();
    for ((relay, actors), link) in regions.iter().zip(&links) {
        let (addr, out) =
            tb.relay_behind_link(relay, link, &["--wan-mbit", "100", "--wan-rtt-ms", "60"]);
        relay_outs.push(out);
        for a in actors {
            let out = tb.actor(a, &[format!("{relay}@{addr}")]);
            assert_eq!(
                wait_for(&out, "upstream ", dl),
                format!("upstream relay {relay}")
            );
            actor_outs.push((*a, out));
        }
    }
    for k in 1..=20 {
        tb.publish(k);
        for out in &relay_outs {
            assert_eq!(wait_for(out, "cached ", dl), format!("cached {k}"));
        }
        let want = tb.active_line(k);
        for (name, out) in &actor_outs {
            assert_eq!(wait_for(out, &format!("active {k} "), dl), want, "{name}");
            tb.assert_store_is(name, k);
        }
    }
    // Each version crossed each WAN link exactly once: the hub sent each relay exactly the
    // frames of the 20 deltas, once, and nothing to any actor.
    let delta_frames = tb.delta_frame_bytes(1..=20) as f64;
    let m = tb.hub_metrics();
    for (relay, _) in &regions {
        let series = format!("starling_hub_delta_sent_bytes_total{{peer=\"{relay}\"}}");
        assert_eq!(metric(&m, &series), Some(delta_frames), "{series}");
    }
    let peers = m
        .lines()
        .filter(|l| l.starts_with("starling_hub_delta_sent_segments_total{"))
        .count();
    assert_eq!(peers, regions.len(), "only relays were sent segments:\n{m}");
}

/// A slow region for the mid-stream fault tests: a hub with `small` checkpoints (14 MB of
/// BF16; ~0.5 MB deltas in 32 KiB segments, ~2 s on the link), a relay `r` behind a
/// 2 Mbit/s, 20 ms `starling-netem` link serving `/metrics`, and actors `a1`, `a2` on the
/// relay with version 1 active. Processes: 0 hub, 1 link, 2 relay, 3–4 actors.
struct SlowRegion {
    tb: Testbed,
    /// The link's address, to start it again on the same port.
    link_addr: String,
    relay_out: mpsc::Receiver<String>,
    actors: Vec<mpsc::Receiver<String>>,
}

const SLOW_LINK: [&str; 6] = ["--rate", "2mbit", "--delay", "10ms", "--loss", "0%"];

fn slow_region(seed: u64) -> SlowRegion {
    let peers = [("relay", "r"), ("actor", "a1"), ("actor", "a2")];
    let hub_args = ["--segment-kib", "32"];
    let mut tb = Testbed::with_model("small", 1e-5, 2, seed, &peers, &[], &hub_args);
    let dl = tb.deadline;
    let link_addr = tb.link_to_hub("127.0.0.1:0", &SLOW_LINK);
    let relay_args = ["--wan-mbit", "2", "--wan-rtt-ms", "20"];
    let relay_args = [&relay_args[..], &["--http", "127.0.0.1:0"]].concat();
    let (addr, relay_out) = tb.relay_at("r", &link_addr, &relay_args);
    let actors: Vec<_> = ["a1", "a2"]
        .iter()
        .map(|a| tb.actor(a, &[format!("r@{addr}")]))
        .collect();
    for out in &actors {
        assert_eq!(wait_for(out, "upstream ", dl), "upstream relay r");
    }
    tb.publish(1);
    for out in &actors {
        assert_eq!(wait_for(out, "active 1 ", dl), tb.active_line(1));
    }
    assert_eq!(wait_for(&relay_out, "cached ", dl), "cached 1");
    SlowRegion {
        tb,
        link_addr,
        relay_out,
        actors,
    }
}

/// The least of the relay's `/metrics` counters `series` (0 when absent).
fn relay_counter(tb: &Testbed, series: &[String]) -> f64 {
    let m = http_get(&tb.relay_http["r"], "/metrics");
    series
        .iter()
        .map(|s| metric(&m, s).unwrap_or(0.0))
        .fold(f64::INFINITY, f64::min)
}

/// Publishes version 2 in the background and returns once `series` (relay counters) grew.
fn publish_2_until(tb: &Testbed, series: &[String]) -> std::thread::JoinHandle<()> {
    let before = relay_counter(tb, series);
    let publisher = {
        let (hub, cluster, step) = (tb.hub_addr.clone(), tb.cluster.clone(), tb.steps[2].clone());
        std::thread::spawn(move || starling_tests::publish_to(&hub, &cluster, &step))
    };
    while relay_counter(tb, series) <= before {
        assert!(Instant::now() < tb.deadline, "{series:?} never grew");
        std::thread::sleep(Duration::from_millis(20));
    }
    publisher
}

/// A relay SIGKILLed while a version streams through it: its actors keep the segments they
/// staged, resume on the hub with only the rest (`Resume`), and activate the right bits.
#[test]
fn actors_finish_a_version_through_the_hub_when_their_relay_dies_mid_stream() {
    let SlowRegion { mut tb, actors, .. } = slow_region(31);
    let dl = tb.deadline;
    // Kill the relay once it has forwarded (cut-through) some but not all of version 2 to
    // both actors.
    let forwarded =
        ["a1", "a2"].map(|a| format!("starling_relay_delta_sent_segments_total{{peer=\"{a}\"}}"));
    let publisher = publish_2_until(&tb, &forwarded);
    // Loopback delivers what was written in far less; the link needs seconds for the rest.
    std::thread::sleep(Duration::from_millis(100));
    tb.kill(2);
    publisher.join().expect("publish");
    for out in &actors {
        let resume = wait_for(out, "resume 2 have ", dl);
        let have: usize = resume["resume 2 have ".len()..].parse().expect("count");
        assert!(have > 0, "kept the segments staged before the relay died");
        assert_eq!(wait_for(out, "active 2 ", dl), tb.active_line(2));
    }
    for name in ["a1", "a2"] {
        tb.assert_store_is(name, 2);
    }
}

/// The WAN link of a relay goes down for longer than the QUIC idle timeout while version 2
/// streams over it: the relay reconnects when the link is back, resumes the version from the
/// segments it has, and its actors (still subscribed to it) finish from the relay, never
/// failing over to the hub.
#[test]
fn a_relay_reconnects_after_a_wan_outage_and_resumes_the_version_for_its_actors() {
    let SlowRegion {
        mut tb,
        link_addr,
        relay_out,
        actors,
    } = slow_region(37);
    let dl = tb.deadline;
    let received = ["starling_relay_delta_received_segments_total{peer=\"hub\"}".to_owned()];
    let publisher = publish_2_until(&tb, &received);
    // The link dies and stays down past the 5 s idle timeout, so the relay's connection to
    // the hub is really lost.
    tb.kill(1);
    publisher.join().expect("publish");
    std::thread::sleep(Duration::from_secs(7));
    tb.link_to_hub(&link_addr, &SLOW_LINK);
    assert_eq!(wait_for(&relay_out, "upstream ", dl), "upstream hub");
    let resume = wait_for(&relay_out, "resume 2 have ", dl);
    let have: usize = resume["resume 2 have ".len()..].parse().expect("count");
    assert!(
        have > 0,
        "the relay kept the segments it had before the outage"
    );
    assert_eq!(wait_for(&relay_out, "cached ", dl), "cached 2");
    for out in &actors {
        // Everything the actor prints up to version 2: it never changed its upstream.
        loop {
            let line = wait_for(out, "", dl);
            assert!(
                !line.starts_with("upstream "),
                "the actor failed over: {line}"
            );
            if line.starts_with("active 2 ") {
                assert_eq!(line, tb.active_line(2));
                break;
            }
        }
    }
    for name in ["a1", "a2"] {
        tb.assert_store_is(name, 2);
    }
}

/// A hub that retains 3 deltas, writes an anchor every 4 versions and keeps 2, over `versions`
/// checkpoints of the `tiny` preset: what the anchor tests need to get behind its retention.
fn anchoring_hub(versions: u32, seed: u64, peers: &[(&str, &str)]) -> Testbed {
    let hub_args = [
        "--retain",
        "3",
        "--anchor-every",
        "4",
        "--keep-anchors",
        "2",
    ];
    Testbed::with_model("tiny", 1e-5, versions, seed, peers, &[], &hub_args)
}

/// An actor that joins after 10 versions, when neither its relay nor the hub retains the
/// deltas from its initial checkpoint on: it restores the hub's newest anchor (sealed,
/// hashed, checked) and then follows the chain from its relay.
#[test]
fn a_late_actor_restores_from_an_anchor_and_catches_up_on_the_chain() {
    let peers = [("relay", "r"), ("actor", "early"), ("actor", "late")];
    let mut tb = anchoring_hub(10, 41, &peers);
    let dl = tb.deadline;
    let (addr, _relay_out) = tb.relay_with("r", &["--retain", "3"]);
    let early = tb.actor("early", &[format!("r@{addr}")]);
    for k in 1..=10 {
        tb.publish(k);
        assert_eq!(
            wait_for(&early, &format!("active {k} "), dl),
            tb.active_line(k)
        );
    }
    wait_for(&tb.hub_out, "anchor 8", dl);
    let late = tb.actor("late", &[format!("r@{addr}")]);
    assert_eq!(wait_for(&late, "restored anchor ", dl), "restored anchor 8");
    assert_eq!(wait_for(&late, "active 8 ", dl), tb.active_line(8));
    assert_eq!(wait_for(&late, "active 10 ", dl), tb.active_line(10));
    tb.assert_store_is("late", 10);
    // Two anchors are kept (4 and 8); anchor 0 was pruned, with the deltas up to anchor 4.
    let store = tb.root.join("hub-store");
    assert!(!store.join("anchors/v00000000.safetensors").exists());
    assert!(store.join("anchors/v00000004.safetensors").exists());
    assert!(store.join("anchors/v00000008.safetensors").exists());
    assert!(!store.join("deltas/v00000004.sdc").exists());
    assert!(store.join("deltas/v00000005.sdc").exists());
}

/// A relay that was away while the hub moved past its retained deltas: it restores the hub's
/// newest anchor into its disk cache, restarts its chain there and follows the deltas after
/// it; its actor, behind too, restores the same anchor from the relay (never from the hub:
/// one full checkpoint over the WAN per region). Restarted with the same command, the relay
/// resumes from its anchor and cache without fetching the anchor again.
#[test]
fn a_relay_behind_the_hubs_retention_restores_an_anchor_and_serves_it_to_its_actor() {
    let peers = [("relay", "r"), ("actor", "a")];
    let mut tb = anchoring_hub(11, 43, &peers);
    let dl = tb.deadline;
    for k in 1..=10 {
        tb.publish(k);
    }
    wait_for(&tb.hub_out, "anchor 8", dl);
    let cache = tb.root.join("r-cache");
    let cache_arg = cache.display().to_string();
    let (addr, relay) = tb.relay_with("r", &["--cache", &cache_arg]);
    assert_eq!(
        wait_for(&relay, "restored anchor ", dl),
        "restored anchor 8"
    );
    wait_for(&relay, "cached 10", dl);
    assert!(cache.join("anchors/v00000008.safetensors").exists());
    assert!(cache.join("anchors/v00000008.seal").exists());

    let a = tb.actor("a", &[format!("r@{addr}")]);
    // Every source the actor subscribed to before it restored: the relay only.
    let mut upstreams = Vec::new();
    loop {
        let line = wait_for(&a, "", dl);
        if let Some(u) = line.strip_prefix("upstream ") {
            upstreams.push(u.to_owned());
        }
        if line.starts_with("restored anchor ") {
            assert_eq!(line, "restored anchor 8");
            break;
        }
    }
    assert_eq!(upstreams, ["relay r"], "the anchor came from the relay");
    assert_eq!(wait_for(&a, "active 8 ", dl), tb.active_line(8));
    assert_eq!(wait_for(&a, "active 10 ", dl), tb.active_line(10));

    // The relay, stopped and started with the very same command, holds anchor 8 and the
    // deltas after it: it does not fetch the anchor again, and version 11 flows through it.
    // Processes: 0 hub, 1 relay, 2 actor.
    let (status, _) = tb.terminate(1, Duration::from_secs(5));
    assert!(status.success(), "the relay on SIGTERM: {status}");
    let listen = addr.clone();
    let hub = tb.hub_addr.clone();
    let (_, relay) = tb.relay_on("r", &listen, &hub, &["--cache", &cache_arg]);
    tb.publish(11);
    let mut relay_lines = Vec::new();
    loop {
        let line = wait_for(&relay, "", dl);
        let done = line == "cached 11";
        relay_lines.push(line);
        if done {
            break;
        }
    }
    assert!(
        !relay_lines.iter().any(|l| l.starts_with("restored anchor")),
        "resumed from its own anchor: {relay_lines:?}"
    );
    assert_eq!(wait_for(&a, "active 11 ", dl), tb.active_line(11));
    tb.assert_store_is("a", 11);
}

/// An actor started with another cluster's credentials cannot complete a handshake with the
/// hub: it says so once, naming the cause and what to do, and exits instead of retrying.
#[test]
fn an_actor_with_another_clusters_credentials_says_so_and_exits() {
    let tb = Testbed::new(1, 3, &[("actor", "a1")], &[]);
    let hub = starling_tests::bin("starling-hub");
    let other = tb.root.join("other-cluster");
    starling_tests::run_ok(
        std::process::Command::new(&hub)
            .args(["init", "--name", "other", "--dir"])
            .arg(&other),
    );
    starling_tests::run_ok(
        std::process::Command::new(&hub)
            .args(["issue", "--role", "actor", "--name", "a1", "--dir"])
            .arg(&other)
            .arg("-o")
            .arg(tb.root.join("foreign-a1")),
    );
    let started = Instant::now();
    let out = std::process::Command::new("timeout")
        .arg("60")
        .arg(starling_tests::bin("starling-actor"))
        .args(["--model-id", "tiny", "--hub", &tb.hub_addr, "--credentials"])
        .arg(tb.root.join("foreign-a1"))
        .arg("--init")
        .arg(&tb.steps[0])
        .arg("--store")
        .arg(tb.root.join("foreign-store"))
        .output()
        .expect("run the actor");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exits with an error: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "gave up at once, not after retries"
    );
    assert_eq!(
        err.matches("do not belong to the same cluster").count(),
        1,
        "said once: {err}"
    );
    assert!(err.contains("starling-hub issue"), "{err}");
}

/// SIGTERM to an actor and then to its relay while version 2 streams through them: each exits
/// 0 within its grace period; the other actor fails over to the hub and activates version 2,
/// and the stopped actor, started again with the same store, resumes from it (a whole version,
/// never a half-applied one) and reaches version 2 bit-identically.
#[test]
fn an_actor_and_a_relay_stop_cleanly_on_sigterm_mid_transfer() {
    let SlowRegion { mut tb, actors, .. } = slow_region(41);
    let dl = tb.deadline;
    let received = ["starling_relay_delta_received_segments_total{peer=\"hub\"}".to_owned()];
    let publisher = publish_2_until(&tb, &received);
    let grace = Duration::from_secs(5);
    // Processes: 0 hub, 1 link, 2 relay, 3 a1, 4 a2.
    let (status, took) = tb.terminate(3, grace);
    assert!(
        status.success(),
        "actor a1 on SIGTERM: {status} after {took:?}"
    );
    let (status, took) = tb.terminate(2, grace);
    assert!(
        status.success(),
        "the relay on SIGTERM: {status} after {took:?}"
    );
    publisher.join().expect("publish");
    assert_eq!(wait_for(&actors[1], "active 2 ", dl), tb.active_line(2));
    tb.assert_store_is("a2", 2);

    let a1 = tb.actor("a1", &[]);
    let first = wait_for(&a1, "active ", dl);
    assert!(
        first == tb.active_line(1) || first == tb.active_line(2),
        "a1 resumed from a whole version in its store: {first}"
    );
    if first != tb.active_line(2) {
        assert_eq!(wait_for(&a1, "active 2 ", dl), tb.active_line(2));
    }
    tb.assert_store_is("a1", 2);
}
