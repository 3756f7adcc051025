//! A subscription's read budget over real QUIC on loopback: a frame takes its bytes from the
//! budget before its body is read, a stream whose frame does not fit waits with next to
//! nothing read, and it goes on once the earlier frame is handed on.

mod common;
#[path = "common/streams.rs"]
mod streams;

use std::time::Duration;

use starling_proto::delta::container::{FrameKind, encode_frame};
use starling_transport::endpoint::connect;
use starling_transport::framed::{DataStreamReader, ReadBudget};
use starling_transport::identity::Role;

fn body(fill: u8, len: usize) -> Vec<u8> {
    vec![fill; len]
}

#[tokio::test]
async fn a_frame_that_does_not_fit_the_budget_waits_unread() {
    let d = tempfile::tempdir().expect("tempdir");
    // Three streams: two frames of 600 KiB, then one larger than the whole budget.
    let sizes = [600 << 10, 600 << 10, 1536 << 10];
    let frames = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| encode_frame(FrameKind::Segment, &body(i as u8, len)))
        .collect();
    let (client, addr) = streams::serve_streams(d.path(), frames);
    let conn = connect(&client, addr, Role::Hub, "hub")
        .await
        .expect("connect");
    let budget = ReadBudget::new(1 << 20);
    let t = Duration::from_secs(20);
    let accept = || async {
        let recv = tokio::time::timeout(t, conn.accept_uni())
            .await
            .expect("in time")
            .expect("a stream");
        DataStreamReader::within(recv, budget.clone())
    };
    let (mut a, mut b, mut c) = (accept().await, accept().await, accept().await);

    let (fa, held_a) = tokio::time::timeout(t, a.budgeted_frame())
        .await
        .expect("in time")
        .expect("read")
        .expect("a frame");
    assert_eq!(fa.body(), body(0, sizes[0]).as_slice());
    assert_eq!(budget.available(), (1 << 20) - fa.bytes.len());
    assert!(held_a.is_some());

    // b's frame does not fit beside a's: it waits, having read at most one chunk.
    let waited = tokio::time::timeout(Duration::from_millis(500), b.budgeted_frame()).await;
    assert!(waited.is_err(), "b's frame was read past the budget");
    assert!(
        b.buffered() <= 64 << 10,
        "b buffered {} bytes",
        b.buffered()
    );

    // a's frame handed on: b's is read.
    drop(held_a);
    let (fb, held_b) = tokio::time::timeout(t, b.budgeted_frame())
        .await
        .expect("in time")
        .expect("read")
        .expect("b's frame");
    assert_eq!(fb.body(), body(1, sizes[1]).as_slice());
    drop(held_b);

    // A frame larger than the whole budget takes all of it and is still read.
    let (fc, held_c) = tokio::time::timeout(t, c.budgeted_frame())
        .await
        .expect("in time")
        .expect("read")
        .expect("c's frame");
    assert_eq!(fc.body(), body(2, sizes[2]).as_slice());
    assert_eq!(budget.available(), 0);
    drop(held_c);
    assert_eq!(budget.available(), 1 << 20);
    conn.close(0u32.into(), b"done");
    client.wait_idle().await;
}
