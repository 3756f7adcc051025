//! The window ceiling over a real QUIC connection through an emulated bottleneck
//! (`starling-netem`, 40 Mbit/s, 40 ms RTT, drop-tail queue of 1.5× the BDP): a bulk transfer
//! striped over four streams, sent with the ceiling set from the stated link, never overflows
//! the bottleneck queue, while the same transfer with plain BBR does. This is the property that
//! keeps control messages from queueing behind data (`transport/src/ceiling.rs`); the latencies
//! themselves are measured by `wan-bench`, not asserted here.

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
/// and returns the packets the link's queue dropped on the way.
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
    stats.down.dropped_queue
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_sender_leaves_the_bottleneck_queue_alone_where_plain_bbr_overflows_it() {
    let capped = transfer(tempfile::tempdir().expect("tempdir").path(), true).await;
    // Plain BBR's overflow is the premise of the comparison; on a loaded 2-core machine one
    // run in a few happens to stay under the queue limit, so the premise gets three tries.
    let mut plain = 0;
    for _ in 0..3 {
        plain = transfer(tempfile::tempdir().expect("tempdir").path(), false).await;
        if plain > 0 {
            break;
        }
    }
    eprintln!("queue drops: capped {capped}, plain BBR {plain}");
    // Capped runs drop nothing unless a scheduling stall of the user-space link (2 cores, a
    // busy test machine) lets its queue grow; plain BBR drops 80-700 packets per run.
    assert!(
        plain > 0,
        "plain BBR no longer overflows a 1.5×BDP queue: re-examine whether the ceiling is needed"
    );
    assert!(
        capped * 4 < plain,
        "the ceiling overflowed the bottleneck queue nearly as often as plain BBR"
    );
}
