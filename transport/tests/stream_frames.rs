//! Delta frames read from a data stream over real QUIC on loopback: frames of every size back
//! to back, each byte of a large frame copied once into a buffer of exactly its size, and a
//! stream cut inside a frame or carrying a flipped byte refused.

mod common;
#[path = "common/streams.rs"]
mod streams;

use std::time::Duration;

use starling_proto::delta::container::{FrameKind, encode_frame};
use starling_transport::endpoint::connect;
use starling_transport::framed::{DataStreamReader, FramedError, ReadBudget};
use starling_transport::identity::Role;

/// A body whose every byte depends on its position, so a misplaced chunk shows.
fn body(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3] ^ seed)
        .collect()
}

#[tokio::test]
async fn frames_of_every_size_come_back_whole_and_in_order() {
    let sizes = [0usize, 17, 3 << 20, 64 << 10, 1, (1 << 20) + 3];
    let bodies: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| body(i as u8, n))
        .collect();
    let stream: Vec<u8> = bodies
        .iter()
        .flat_map(|b| encode_frame(FrameKind::Segment, b))
        .collect();
    let d = tempfile::tempdir().expect("tempdir");
    let (client, addr) = streams::serve_streams(d.path(), vec![stream]);
    let conn = connect(&client, addr, Role::Hub, "hub")
        .await
        .expect("connect");
    let t = Duration::from_secs(20);
    let recv = tokio::time::timeout(t, conn.accept_uni())
        .await
        .expect("in time")
        .expect("a stream");
    let mut r = DataStreamReader::within(recv, ReadBudget::new(8 << 20));
    for (i, b) in bodies.iter().enumerate() {
        let (f, _held) = tokio::time::timeout(t, r.budgeted_frame())
            .await
            .expect("in time")
            .expect("read")
            .expect("a frame");
        assert_eq!(f.body(), b.as_slice(), "frame {i}");
        if b.len() >= 1 << 20 {
            // Read into a buffer of its own size: no regrowth, nothing of the next frame.
            assert_eq!(f.bytes.capacity(), f.bytes.len(), "frame {i}");
        }
    }
    let end = tokio::time::timeout(t, r.frame()).await.expect("in time");
    assert!(matches!(end, Ok(None)), "{end:?}");
}

#[tokio::test]
async fn a_stream_cut_inside_a_frame_or_with_a_flipped_byte_is_refused() {
    let big = encode_frame(FrameKind::Segment, &body(7, 2 << 20));
    let cut = big[..big.len() - 1000].to_vec();
    let mut flipped = big.clone();
    flipped[1 << 20] ^= 0x10;
    let d = tempfile::tempdir().expect("tempdir");
    let (client, addr) = streams::serve_streams(d.path(), vec![cut, flipped]);
    let conn = connect(&client, addr, Role::Hub, "hub")
        .await
        .expect("connect");
    let t = Duration::from_secs(20);
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let recv = tokio::time::timeout(t, conn.accept_uni())
            .await
            .expect("in time")
            .expect("a stream");
        let mut r = DataStreamReader::new(recv);
        outcomes.push(tokio::time::timeout(t, r.frame()).await.expect("in time"));
    }
    // Streams may be accepted in either order.
    let truncated = outcomes
        .iter()
        .filter(|o| matches!(o, Err(FramedError::Truncated)))
        .count();
    let corrupt = outcomes
        .iter()
        .filter(|o| {
            matches!(
                o,
                Err(FramedError::Decode(
                    starling_proto::DecodeError::HashMismatch { .. }
                ))
            )
        })
        .count();
    assert_eq!((truncated, corrupt), (1, 1), "{outcomes:?}");
}
