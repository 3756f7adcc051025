//! A hostile (or badly broken) relay against real actors: this test plays a relay with the
//! cluster's relay credentials — so the actors' mutual TLS admits it — and sends what an
//! honest relay never would:
//! - `flood`: endless well-framed segments of a version after the next one, far more bytes
//!   than the whole model holds (an honest delta never exceeds the model coded densely);
//! - `ahead`: a version announced far ahead of what the actor runs;
//! - `junk`: segments of the next version that do not decode, sent again on every `Fetch`.
//!
//! Each actor must drop the relay (`starling_actor_sources_dropped_total{peer="evil"}`), go
//! on to the hub and activate the trainer's version bit for bit. The relay offers the flooded
//! actor ~380× the model: the actor must stop taking it once past its bound, and its peak
//! memory must stay within two versions' worth of the model plus allocator noise of the
//! `ahead` actor, which lived the same life without the flood. The control replaces a
//! before/after reading of one process: where "before" fell in start-up varied by 20 MB
//! between runs, more than the tiny model's whole bound.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use starling_proto::delta::container::{FrameKind, encode_frame};
use starling_proto::protocol::msg::{Message, Role as MsgRole};
use starling_tests::{Testbed, http_get, metric, wait_for};
use starling_transport::admit::admit;
use starling_transport::framed::send;
use starling_transport::identity::Credentials;
use starling_transport::link::LinkProfile;

/// Segments of 60 KiB the flooding relay offers: 123 MB, far beyond any bound of the tiny
/// model and beyond the allocator noise of a process, so an actor that buffered it all could
/// not pass.
const FLOOD_SEGMENTS: u32 = 2000;

/// A segment frame of the forged delta `id` with sequence number `seq` and `len` junk bytes.
fn junk_segment(id: [u8; 32], seq: u32, len: usize) -> Vec<u8> {
    let mut body = id.to_vec();
    let mut s = u64::from(seq);
    loop {
        let b = (s & 0x7f) as u8;
        s >>= 7;
        if s == 0 {
            body.push(b);
            break;
        }
        body.push(b | 0x80);
    }
    body.extend((0..len).map(|i| (i as u8).wrapping_mul(31) ^ 0x5a));
    encode_frame(FrameKind::Segment, &body)
}

/// Opens a data stream of `version` and writes `segments` junk segments on it (until the
/// peer stops reading). Returns the bytes written.
async fn stream_junk(conn: &quinn::Connection, version: u64, first_seq: u32, segments: u32) -> u64 {
    let id = [0xee; 32];
    let Ok(mut data) = conn.open_uni().await else {
        return 0;
    };
    let mut head = Vec::new();
    Message::Announce {
        version,
        base_version: version - 1,
        delta_id: id,
        transmission: first_seq,
        stripes: 1,
    }
    .encode(&mut head);
    if data.write_all(&head).await.is_err() {
        return 0;
    }
    let mut sent = 0u64;
    for seq in first_seq..first_seq + segments {
        let f = junk_segment(id, seq, 60 * 1024);
        if data.write_all(&f).await.is_err() {
            return sent;
        }
        sent += f.len() as u64;
    }
    let _ = data.finish();
    sent
}

/// Serves one actor as the hostile relay: its behaviour is chosen by the actor's name.
async fn serve_one(conn: quinn::Connection, offered: Arc<AtomicU64>) {
    let Ok(Some(mut a)) = admit(&conn, "relay", "tiny", &[MsgRole::Actor], 0).await else {
        return;
    };
    let after = match a.reader.next().await {
        Ok(Some(Message::Subscribe { after_version })) => after_version,
        _ => return,
    };
    match a.name.as_str() {
        // 123 MB of a version the actor can only buffer (its base is not active yet).
        "flood" => {
            let sent = stream_junk(&conn, after + 2, 0, FLOOD_SEGMENTS).await;
            offered.fetch_add(sent, Ordering::Relaxed);
        }
        "ahead" => {
            let _ = stream_junk(&conn, after + 1000, 0, 2).await;
        }
        // Junk for the next version, and junk again for every Fetch.
        _ => {
            let mut seq = 0;
            let _ = stream_junk(&conn, after + 1, seq, 2).await;
            while let Ok(Some(m)) = a.reader.next().await {
                if let Message::Fetch { version, .. } = m {
                    seq += 2;
                    let _ = stream_junk(&conn, version, seq, 2).await;
                }
            }
        }
    }
    // Keep the connection until the actor leaves it.
    let _ = send(&mut a.control, &Message::Ping { nonce: 0 }).await;
    conn.closed().await;
}

/// The hostile relay: accepts actors until the runtime ends.
async fn hostile_relay(
    creds: Credentials,
    offered: Arc<AtomicU64>,
) -> (SocketAddr, quinn::Endpoint) {
    let ep = starling_transport::endpoint::server_endpoint(
        &creds,
        "127.0.0.1:0".parse().expect("addr"),
        &LinkProfile::LAN,
    )
    .expect("listen");
    let addr = ep.local_addr().expect("addr");
    let accept = ep.clone();
    tokio::spawn(async move {
        while let Some(incoming) = accept.accept().await {
            let offered = offered.clone();
            tokio::spawn(async move {
                if let Ok(conn) = incoming.await {
                    serve_one(conn, offered).await;
                }
            });
        }
    });
    (addr, ep)
}

#[test]
fn actors_drop_a_hostile_relay_keep_their_memory_bounded_and_take_versions_from_the_hub() {
    let peers = [
        ("relay", "evil"),
        ("actor", "flood"),
        ("actor", "ahead"),
        ("actor", "junk"),
    ];
    let mut tb = Testbed::new(1, 5, &peers, &[]);
    let dl = tb.deadline;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let offered = Arc::new(AtomicU64::new(0));
    let creds = Credentials::load_peer(&tb.root.join("evil")).expect("relay credentials");
    let (addr, _endpoint) = rt.block_on(hostile_relay(creds, offered.clone()));
    let model_bytes = std::fs::metadata(&tb.steps[0]).expect("checkpoint").len();

    let mut actors = Vec::new();
    let mut pid_of = std::collections::HashMap::new();
    for name in ["flood", "ahead", "junk"] {
        let out = tb.actor_with(name, &[format!("evil@{addr}")], &["--http", "127.0.0.1:0"]);
        pid_of.insert(name, tb.procs.0.last().map(|c| c.id()).unwrap_or(0));
        let http = wait_for(&out, "http on ", dl)
            .trim_start_matches("http on ")
            .to_owned();
        actors.push((name, out, http));
    }
    for (_, out, _) in &actors {
        wait_for(out, "active 0 ", dl);
    }
    let dropped = |http: &str| {
        metric(
            &http_get(http, "/metrics"),
            "starling_actor_sources_dropped_total{peer=\"evil\"}",
        )
        .unwrap_or(0.0)
    };
    for (name, _, http) in &actors {
        while dropped(http) < 1.0 {
            assert!(
                std::time::Instant::now() < dl,
                "{name} never dropped the hostile relay"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // Peaks once every actor is done with the relay: the flooded one and its control.
    let flood_peak = status_kib(pid_of["flood"], "VmHWM:");
    let control_peak = status_kib(pid_of["ahead"], "VmHWM:");
    tb.publish(1);
    for (name, out, http) in &actors {
        assert_eq!(
            wait_for(out, "active 1 ", dl),
            tb.active_line(1),
            "{name} took version 1 from the hub"
        );
        assert_eq!(dropped(http), 1.0, "{name} dropped it once (quarantined)");
        tb.assert_store_is(name, 1);
    }
    // The relay got more than a version's bound into the actor before it was dropped, and
    // far less than it offered: the actor stopped reading.
    let offered = offered.load(Ordering::Relaxed);
    let cap = model_bytes + model_bytes / 8 + (1 << 20);
    let flood_bytes = u64::from(FLOOD_SEGMENTS) * 60 * 1024;
    assert!(
        offered > cap,
        "the flood reached the actor's bound ({offered} of {cap} bytes)"
    );
    assert!(
        offered < flood_bytes / 4,
        "the actor kept reading the flood ({offered} of {flood_bytes} bytes)"
    );
    // Its peak is within two versions' worth of the control's, plus allocator noise (arenas
    // and thread stacks: the three actors' peaks differed by up to 14 MiB here without the flood).
    let bound_kib = 2 * cap / 1024 + 32 * 1024;
    let grew = flood_peak.saturating_sub(control_peak);
    eprintln!(
        "flood: {offered} of {flood_bytes} bytes taken ({:.1}× the model); peak RSS {flood_peak} KiB, control {control_peak} KiB (+{grew}), bound +{bound_kib} KiB",
        offered as f64 / model_bytes.max(1) as f64
    );
    assert!(
        grew < bound_kib,
        "the flooded actor peaked {grew} KiB above its control, more than {bound_kib} KiB"
    );
    drop(rt);
}

/// A `/proc/PID/status` field in KiB (`VmRSS:`, `VmHWM:`).
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("process status")
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("field")
}
