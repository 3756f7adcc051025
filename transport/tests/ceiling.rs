//! The window ceiling over a real QUIC connection through an emulated bottleneck
//! (`starling-netem`, 40 Mbit/s, 40 ms RTT, drop-tail queue of 1.5× the BDP): a bulk transfer
//! striped over four streams, sent with the ceiling set from the stated link, keeps the
//! bottleneck queue under half its limit, while the same transfer with plain BBR fills it past
//! one BDP (BBR's startup probes at 2.89× the rate it measured). This is the property that keeps
//! control messages from queueing behind data (`transport/src/ceiling.rs`); the latencies
//! themselves are measured by `wan-bench`, not asserted here.
//!
//! The measure is the link's peak backlog, which is the worst queueing delay a control message
//! could meet. Queue drops are printed too but not asserted: whether plain BBR's overshoot
//! passes the 1.5×BDP limit, and by how many packets, depends on the machine's timing (80–700
//! drops per run on one machine, none in three runs on another), while its peak backlog stays
//! above one BDP.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use starling_netem::{LinkProfile as NetemProfile, Proxy};
use starling_transport::endpoint::{
    accept_capped, client_endpoint, connect, server_config, server_endpoint,
};
use starling_transport::identity::{Credentials, Role, init_cluster, issue};
use starling_transport::link::LinkProfile;

const RATE_BPS: u64 = 40_000_000;
const RTT: Duration = Duration::from_millis(40);
const STREAMS: usize = 4;
const BYTES_PER_STREAM: usize = 3 << 20;

/// Sends `STREAMS` × `BYTES_PER_STREAM` from a server to a client through the emulated link
/// and returns the peak backlog of the link's queue, in wire bytes.
async fn transfer(dir: &Path, ceiling: bool) -> u64 {
    init_cluster(dir, "c", [3; 32]).expect("init");
    issue(dir, Role::Relay, "r1", &dir.join("r1")).expect("issue");
    let hub = Credentials::load_hub(dir).expect("hub creds");
    let relay = Credentials::load_peer(&dir.join("r1")).expect("relay creds");
    let link = LinkProfile {
        rate_bps: RATE_BPS,
        rtt: RTT,
    };
    let server = server_endpoint(&hub, "127.0.0.1:0".parse().expect("addr"), &link)
        .expect("server endpoint");
    let server_addr = server.local_addr().expect("server address");
    let base = server_config(&hub, &link).expect("server config");

    let bdp = (RATE_BPS / 8) as f64 * RTT.as_secs_f64();
    let wan = NetemProfile::ideal()
        .with_rate_bps(RATE_BPS)
        .with_delay(RTT / 2)
        .with_queue_limit_bytes((1.5 * bdp) as usize);
    let proxy = Proxy::start(
        "127.0.0.1:0".parse().expect("addr"),
        server_addr,
        wan.clone(),
        wan.with_seed(1),
    )
    .expect("netem proxy");

    let sender = tokio::spawn(async move {
        let incoming = server.accept().await.expect("incoming");
        let (connecting, cap) = accept_capped(incoming, &base, &link).expect("accept");
        let conn = connecting.await.expect("handshake");
        if ceiling {
            cap.set(link.rate_bps, link.rtt);
        }
        let payload = Arc::new(vec![0x5a_u8; BYTES_PER_STREAM]);
        let mut tasks = Vec::new();
        for _ in 0..STREAMS {
            let mut s = conn.open_uni().await.expect("open stream");
            let payload = payload.clone();
            tasks.push(tokio::spawn(async move {
                s.write_all(&payload).await.expect("write");
                s.finish().expect("finish");
            }));
        }
        for t in tasks {
            t.await.expect("stream task");
        }
        // Keep the connection until the client has read everything and closes it.
        conn.closed().await;
    });

    let client = client_endpoint(&relay, "127.0.0.1:0".parse().expect("addr"), &link)
        .expect("client endpoint");
    let via: SocketAddr = proxy.local_addr();
    let conn = connect(&client, via, Role::Hub, "hub")
        .await
        .expect("connect");
    let mut received = 0;
    for _ in 0..STREAMS {
        let mut s = conn.accept_uni().await.expect("accept stream");
        received += s
            .read_to_end(BYTES_PER_STREAM + 1)
            .await
            .expect("read")
            .len();
    }
    assert_eq!(received, STREAMS * BYTES_PER_STREAM);
    conn.close(0u32.into(), b"done");
    let _ = tokio::time::timeout(Duration::from_secs(5), sender).await;
    let stats = proxy.shutdown().expect("netem stats");
    assert!(
        stats.down.delivered_bytes >= (STREAMS * BYTES_PER_STREAM) as u64,
        "the data went through the emulated link: {stats}"
    );
    eprintln!(
        "ceiling {ceiling}: queue drops {}, peak queue {} B",
        stats.down.dropped_queue, stats.down.peak_queue_bytes
    );
    stats.down.peak_queue_bytes
}

/// The link's bandwidth-delay product in bytes.
fn bdp() -> u64 {
    (RATE_BPS / 8) * RTT.as_millis() as u64 / 1000
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_sender_keeps_the_bottleneck_queue_short_where_plain_bbr_fills_it() {
    let capped = transfer(tempfile::tempdir().expect("tempdir").path(), true).await;
    // Plain BBR's standing queue is the premise of the comparison, so it gets three tries; the
    // capped run, which is the claim, gets one.
    let mut plain = 0;
    for _ in 0..3 {
        plain = plain.max(transfer(tempfile::tempdir().expect("tempdir").path(), false).await);
        if plain >= bdp() {
            break;
        }
    }
    let bdp = bdp();
    eprintln!("peak queue: capped {capped} B, plain BBR {plain} B, BDP {bdp} B");
    assert!(
        plain >= bdp,
        "plain BBR no longer queues a BDP at the bottleneck: re-examine whether the ceiling is needed"
    );
    // Capped runs peak at 0.25-0.45 BDP (a burst of a few packets over the paced rate); the
    // bound leaves room for a ~10 ms scheduling stall of the user-space link on a busy machine.
    assert!(
        capped * 4 <= bdp * 3,
        "the capped sender queued {capped} B at the bottleneck, over 0.75 BDP ({bdp} B)"
    );
}
