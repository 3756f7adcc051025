//! The distribution path with real processes on loopback: a hub (`starling-hub serve`),
//! relays (`starling-relay`), actors (`starling-actor`), the trainer publishing versions
//! (`starling-hub publish`). Every actor must reach every version bit-identically; a corrupted
//! transmission is refused and fetched again, never applied; an actor killed with SIGKILL and
//! restarted resumes from its store; a killed relay's actors fail over to the hub.

use starling_tests::{Testbed, next_event, wait_for};

#[test]
fn hub_delivers_every_version_to_every_actor_bit_identically() {
    let peers = [("actor", "a1"), ("actor", "a2")];
    let mut tb = Testbed::new(5, 5, &peers, &[("STARLING_TEST_CORRUPT_VERSION", "2")]);
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

#[test]
fn relays_carry_one_copy_per_region_and_actors_fail_over_to_the_hub() {
    let peers = [
        ("relay", "r-eu"),
        ("relay", "r-us"),
        ("actor", "eu-1"),
        ("actor", "eu-2"),
        ("actor", "us-1"),
    ];
    let mut tb = Testbed::new(4, 8, &peers, &[]);
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
    // The hub sent each version exactly once per region (to the two relays), never to actors.
    let mut sent: Vec<String> = (0..6)
        .map(|_| wait_for(&tb.hub_log, "sent version ", dl))
        .collect();
    sent.sort();
    let expected: Vec<String> = (1..=3)
        .flat_map(|k| {
            [
                format!("sent version {k} to r-eu"),
                format!("sent version {k} to r-us"),
            ]
        })
        .collect();
    assert_eq!(sent, expected);
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
}

/// The headline scenario at small scale: 1 hub, 2 regions behind emulated WAN links
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
    let mut sent: Vec<String> = (0..40)
        .map(|_| wait_for(&tb.hub_log, "sent version ", dl))
        .collect();
    sent.sort();
    let mut expected: Vec<String> = (1..=20)
        .flat_map(|k| {
            [
                format!("sent version {k} to r-a"),
                format!("sent version {k} to r-b"),
            ]
        })
        .collect();
    expected.sort();
    assert_eq!(
        sent, expected,
        "each version crossed each WAN link exactly once"
    );
}
