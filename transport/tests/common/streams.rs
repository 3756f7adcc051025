//! A hub on loopback that writes given bytes on uni streams, for the tests that read delta
//! frames from streams (`read_budget`, `stream_frames`).

use std::net::SocketAddr;
use std::path::Path;

use starling_transport::endpoint::{client_endpoint, server_endpoint};
use starling_transport::link::LinkProfile;

/// A hub's server on loopback whose first connection gets one uni stream per entry of
/// `streams` (each written whole, then finished), and actor `a1`'s client endpoint (the
/// cluster lives under `dir`) with the server's address.
pub(crate) fn serve_streams(dir: &Path, streams: Vec<Vec<u8>>) -> (quinn::Endpoint, SocketAddr) {
    let (hub, a1) = crate::common::hub_and_actor(dir);
    let loopback = "127.0.0.1:0".parse().expect("addr");
    let server = server_endpoint(&hub, loopback, &LinkProfile::LAN).expect("server");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(async move {
        let Some(incoming) = server.accept().await else {
            return;
        };
        let Ok(conn) = incoming.await else { return };
        for bytes in streams {
            let Ok(mut tx) = conn.open_uni().await else {
                return;
            };
            tokio::spawn(async move {
                let _ = tx.write_all(&bytes).await;
                let _ = tx.finish();
                let _ = tx.stopped().await;
            });
        }
        conn.closed().await;
    });
    let client = client_endpoint(&a1, loopback, &LinkProfile::LAN).expect("client");
    (client, addr)
}
