//! An anchor whose sender stops sending is given up after the stall bound, over real QUIC on
//! loopback, and its partial file is removed.

mod common;

use std::time::Duration;

use starling_proto::delta::anchor::AnchorSeal;
use starling_transport::anchor_file::{AnchorFileError, receive_within};
use starling_transport::endpoint::{client_endpoint, connect, server_endpoint};
use starling_transport::framed::DataStreamReader;
use starling_transport::identity::Role;
use starling_transport::link::LinkProfile;

const LOOPBACK: &str = "127.0.0.1:0";

#[tokio::test]
async fn an_anchor_that_stops_coming_is_given_up() {
    let d = tempfile::tempdir().expect("tempdir");
    let (hub, a1) = common::hub_and_actor(d.path());

    // The sender writes 1000 of the sealed 1 MB and then nothing, keeping the stream open.
    let server =
        server_endpoint(&hub, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("server");
    let addr = server.local_addr().expect("addr");
    let accepting = server.clone();
    tokio::spawn(async move {
        let Some(incoming) = accepting.accept().await else {
            return;
        };
        let Ok(conn) = incoming.await else { return };
        let Ok(mut tx) = conn.open_uni().await else {
            return;
        };
        let _ = tx.write_all(&[7u8; 1000]).await;
        conn.closed().await;
        drop(tx);
    });
    let client =
        client_endpoint(&a1, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("client");
    let conn = connect(&client, addr, Role::Hub, "hub")
        .await
        .expect("connect");
    let recv = tokio::time::timeout(Duration::from_secs(20), conn.accept_uni())
        .await
        .expect("in time")
        .expect("a stream");
    let mut stream = DataStreamReader::new(recv);
    let seal = AnchorSeal {
        version: 3,
        size: 1_000_000,
        hash: [0; 32],
        signature: [0; 64],
    };
    let dest = d.path().join("anchor.partial");
    let got = tokio::time::timeout(
        Duration::from_secs(20),
        receive_within(&seal, &mut stream, &dest, Duration::from_millis(500)),
    )
    .await
    .expect("given up well before the test's own bound");
    assert!(
        matches!(
            got,
            Err(AnchorFileError::Stalled {
                got: 1000,
                sealed: 1_000_000,
                ..
            })
        ),
        "{got:?}"
    );
    assert!(!dest.exists(), "the partial anchor is removed");
    conn.close(0u32.into(), b"done");
    client.wait_idle().await;
}
