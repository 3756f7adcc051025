//! Frames that queue up behind a slow staging reach the shell together, over real QUIC on
//! loopback: a server runs the relays' accept loop with one version in its book, and the
//! receiving core (`drive::run` over a real `Feed`) hands a shell whose first `stage` takes a
//! while the frames that arrived meanwhile in `stage_batch` calls, every frame once.

mod common;
#[path = "common/receiver.rs"]
mod receiver;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::delta::container::{FILE_HEADER_LEN, FrameKind, parse_frame};
use starling_proto::delta::encode::{DeltaHeader, EncoderConfig, encode_in_memory, flat_pairs};
use starling_proto::delta::manifest::TrustPolicy;
use starling_proto::delta::segment::CodecChoice;
use starling_proto::protocol::msg::{Message, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use starling_transport::book::VersionBook;
use starling_transport::connections::ConnectionCap;
use starling_transport::downstream::{Downstream, accept_subscribers};
use starling_transport::drive::{self, Shell};
use starling_transport::endpoint::server_endpoint;
use starling_transport::fanout::FanoutConfig;
use starling_transport::follow::{GaveUp, Notice};
use starling_transport::framed::{DataStreamReader, StreamFrame};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{Feed, SourceAddr, UpstreamError};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const LOOPBACK: &str = "127.0.0.1:0";

/// Version 1 of model `m` on top of version 0, in many small segments: the `.sdc` bytes.
fn delta() -> Vec<u8> {
    let mut old = BTreeMap::new();
    let mut new = BTreeMap::new();
    for t in 0..4 {
        let o: Vec<u16> = (0..20_000u32)
            .map(|i| 0x3c00 + ((i.wrapping_mul(2_654_435_761) >> 22) as u16))
            .collect();
        let n: Vec<u16> = o
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 29 == t { v + 1 } else { v })
            .collect();
        old.insert(format!("t{t}"), o);
        new.insert(format!("t{t}"), n);
    }
    let header = DeltaHeader {
        model_id: "m".into(),
        base_version: 0,
        version: 1,
        created_unix_ms: 0,
        pre_digest: None,
    };
    let cfg = EncoderConfig {
        part_elems: 1000,
        segment_target_bytes: 200,
        choice: CodecChoice::default(),
    };
    encode_in_memory(header, cfg, &flat_pairs(&old, &new), None).0
}

/// The hashes of the frames a receiver stages (segments and the manifest; not the file's
/// trailer) of `.sdc` bytes, sorted.
fn frame_hashes(sdc: &[u8]) -> Vec<[u8; 32]> {
    let mut at = FILE_HEADER_LEN;
    let mut hashes = Vec::new();
    while at < sdc.len() {
        let f = parse_frame(&sdc[at..]).expect("a frame");
        at += f.total_len();
        if f.kind != FrameKind::Trailer {
            hashes.push(f.hash);
        }
    }
    hashes.sort_unstable();
    hashes
}

/// Records the frames of each staging call; the first call takes [`SLOW_FIRST`], as a
/// staging that falls behind its link does; tells the test each call's frames when the
/// version activates.
#[derive(Debug)]
struct Batches {
    calls: Vec<Vec<[u8; 32]>>,
    done: mpsc::UnboundedSender<Vec<Vec<[u8; 32]>>>,
}

const SLOW_FIRST: Duration = Duration::from_millis(400);

impl Batches {
    fn record(&mut self, frames: &[StreamFrame]) {
        if self.calls.is_empty() {
            std::thread::sleep(SLOW_FIRST);
        }
        self.calls.push(frames.iter().map(|f| f.hash).collect());
    }
}

impl Shell for Batches {
    type Error = GaveUp;
    type Done = ();

    fn hello(&self) -> Message {
        receiver::hello()
    }
    fn begin(&mut self, _version: u64, _base: u64, _delta_id: [u8; 32]) -> bool {
        true
    }
    fn stage(&mut self, _version: u64, frame: StreamFrame) -> bool {
        self.record(&[frame]);
        true
    }
    fn stage_batch(&mut self, _version: u64, frames: Vec<StreamFrame>) -> bool {
        self.record(&frames);
        true
    }
    fn discard(&mut self, _version: u64) {}
    async fn activate(
        &mut self,
        _feed: &mut Feed,
        _version: u64,
        _started: Instant,
    ) -> Result<Option<bool>, GaveUp> {
        let _ = self.done.send(self.calls.clone());
        Ok(Some(true))
    }
    async fn background(&mut self) {
        std::future::pending().await
    }
    async fn finish(&mut self, _feed: &mut Feed, _done: ()) -> (u64, bool) {
        (0, false)
    }
    async fn restore(&mut self, _seal: AnchorSeal, _stream: DataStreamReader) -> bool {
        false
    }
    fn subscribed(&mut self, _source: &SourceAddr, _after: u64) {}
    fn left(&mut self, _source: &SourceAddr) {}
    fn not_reached(&mut self, _error: UpstreamError) -> Result<(), GaveUp> {
        Ok(())
    }
    fn notice(&mut self, _notice: Notice, _source: Option<&SourceAddr>) -> Result<(), GaveUp> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_that_queue_behind_a_slow_staging_reach_the_shell_together() {
    let d = tempfile::tempdir().expect("tempdir");
    let (hub, a1) = common::hub_and_actor(d.path());
    let sdc = delta();
    let want = frame_hashes(&sdc);
    assert!(want.len() >= 20, "{} frames", want.len());

    // The server: the relays' accept loop, version 1 in its book.
    let book = Arc::new(VersionBook::new(0, 4));
    book.load_delta(&sdc, &TrustPolicy::AnySigner)
        .expect("loads");
    let ep =
        server_endpoint(&hub, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("server");
    let addr: SocketAddr = ep.local_addr().expect("local addr");
    let accepting = CancellationToken::new();
    let downstream = Downstream {
        book,
        server: "relay".into(),
        model_id: "m".into(),
        serves: vec![MsgRole::Actor],
        subscriptions: ConnectionCap::new("subscription", 4),
        fanout: FanoutConfig::default(),
        metrics: Metrics::new(Component::Relay),
    };
    tokio::spawn(accept_subscribers(ep, downstream, accepting.clone()));

    // The receiver.
    let (mut feed, mut core) = receiver::receiver(&a1, &[addr]);
    let (tx, mut done) = mpsc::unbounded_channel();
    let mut shell = Batches {
        calls: Vec::new(),
        done: tx,
    };
    let stop = CancellationToken::new();
    let stopping = stop.clone();
    let receiver =
        tokio::spawn(async move { drive::run(&mut core, &mut feed, &mut shell, &stopping).await });

    let calls = tokio::time::timeout(Duration::from_secs(20), done.recv())
        .await
        .expect("version 1 activates in time")
        .expect("calls");
    let sizes: Vec<usize> = calls.iter().map(Vec::len).collect();
    let mut got: Vec<[u8; 32]> = calls.into_iter().flatten().collect();
    got.sort_unstable();
    assert_eq!(got, want, "every frame staged once; calls of {sizes:?}");
    assert!(
        sizes.iter().any(|&n| n > 1),
        "frames that came in together (and behind the slow first call) staged together: {sizes:?}"
    );
    assert!(sizes.iter().all(|&n| n <= 16), "{sizes:?}");

    stop.cancel();
    accepting.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), receiver).await;
}
