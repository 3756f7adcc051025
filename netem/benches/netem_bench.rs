//! Throughput and timing accuracy of the user-space link emulator.
//!
//! `cargo bench -p starling-netem --bench netem_bench [-- --secs 3] [--rate 300mbit]`
//!
//! For each scenario a paced sender pushes 1200-byte datagrams through a
//! [`Proxy`] (one direction shaped: rate, 10 ms delay) to a sink on
//! 127.0.0.1, all in this process. It reports:
//! - goodput: payload bits per second received in the steady window, and the
//!   ratio of wire bits (payload + 42 B) to the configured rate;
//! - added delay p50/p99: arrival time minus the time a perfect emulator
//!   would deliver (a replica [`LinkModel`] fed the *send* instants), i.e. the
//!   emulator's own lateness including two loopback hops;
//! - kernel drops (sent but never received by the proxy) and model drops.
//!
//! Without `--bench` (as under `cargo test --all-targets`) it runs one short
//! smoke scenario and fails only if nothing got through.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use starling_netem::units::format_rate;
use starling_netem::{LinkModel, LinkProfile, Proxy, Verdict};

const PAYLOAD: usize = 1200;
const OVERHEAD: usize = 42;
const DELAY: Duration = Duration::from_millis(10);
/// The sender wakes this often and sends every packet that is due.
const TICK: Duration = Duration::from_micros(250);

#[derive(Debug, Clone, Copy)]
struct Scenario {
    rate_bps: u64,
    offered_bps: u64,
    secs: f64,
}

#[derive(Debug)]
struct Outcome {
    sent: u64,
    offered_achieved_bps: f64,
    proxy_in: u64,
    model_drops: u64,
    received: u64,
    goodput_bps: f64,
    wire_ratio: f64,
    added_p50: Duration,
    added_p99: Duration,
    added_max: Duration,
}

fn socket() -> anyhow::Result<UdpSocket> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    s.set_recv_buffer_size(4 << 20)?;
    s.set_send_buffer_size(4 << 20)?;
    let addr: SocketAddr = "127.0.0.1:0".parse()?;
    s.bind(&addr.into())?;
    let s: UdpSocket = s.into();
    s.set_read_timeout(Some(Duration::from_millis(20)))?;
    Ok(s)
}

fn run(sc: Scenario) -> anyhow::Result<Outcome> {
    let profile = LinkProfile::ideal()
        .with_rate_bps(sc.rate_bps)
        .with_delay(DELAY)
        .with_queue_limit_bytes(1_000_000);
    let sink = socket()?;
    let proxy = Proxy::start(
        "127.0.0.1:0".parse()?,
        sink.local_addr()?,
        profile.clone(),
        LinkProfile::ideal(),
    )?;
    let target = proxy.local_addr();

    // Sink thread: (seq, arrival) of every datagram until told to stop and drained.
    let stop = Arc::new(AtomicBool::new(false));
    let sink_thread = {
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("bench-sink".into())
            .spawn(move || {
                let mut got: Vec<(u32, Instant)> = Vec::with_capacity(1 << 20);
                let mut buf = vec![0u8; 2048];
                loop {
                    match sink.recv(&mut buf) {
                        Ok(n) if n >= 4 => {
                            got.push((
                                u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]),
                                Instant::now(),
                            ));
                        }
                        Ok(_) => {}
                        Err(_) if stop.load(Ordering::Relaxed) => break,
                        Err(_) => {}
                    }
                }
                got
            })?
    };

    let client = socket()?;
    let interval_ns = ((PAYLOAD + OVERHEAD) as f64 * 8.0 * 1e9 / sc.offered_bps as f64) as u64;
    let total = (sc.secs * 1e9 / interval_ns as f64) as u64;
    let mut sent_at: Vec<Instant> = Vec::with_capacity(total as usize);
    let mut payload = vec![0u8; PAYLOAD];
    let start = Instant::now();
    let mut seq: u64 = 0;
    while seq < total {
        let now = Instant::now();
        let due = ((now - start).as_nanos() as u64 / interval_ns + 1).min(total);
        while seq < due {
            payload[..4].copy_from_slice(&(seq as u32).to_be_bytes());
            sent_at.push(Instant::now());
            client.send_to(&payload, target)?;
            seq += 1;
        }
        std::thread::sleep(TICK);
    }
    let send_secs = start.elapsed().as_secs_f64();
    // Let the queue drain (1 MB at the rate) plus the delay.
    let drain = Duration::from_secs_f64(1_000_000.0 * 8.0 / sc.rate_bps as f64) + DELAY;
    std::thread::sleep(drain + Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let got = sink_thread
        .join()
        .map_err(|_| anyhow::anyhow!("sink thread panicked"))?;
    let stats = proxy.shutdown()?;

    // What a perfect emulator would have done with the send instants.
    let mut replica = LinkModel::new(profile)?;
    let expected: Vec<Option<Instant>> = sent_at
        .iter()
        .map(|t| match replica.on_packet(*t, PAYLOAD) {
            Verdict::DeliverAt(at) => Some(at),
            Verdict::Drop(_) => None,
        })
        .collect();

    let Some(&(_, first)) = got.first() else {
        bail!("nothing arrived: {stats}");
    };
    let warmup = first + Duration::from_millis(300);
    let mut added: Vec<Duration> = Vec::with_capacity(got.len());
    let mut window_packets = 0u64;
    let mut window_end = warmup;
    for &(seq, at) in &got {
        if let Some(Some(exp)) = expected.get(seq as usize) {
            added.push(at.saturating_duration_since(*exp));
        }
        if at >= warmup {
            window_packets += 1;
            window_end = at;
        }
    }
    added.sort();
    let pct = |p: f64| -> Duration {
        added
            .get(((added.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or_default()
    };
    let window = (window_end - warmup).as_secs_f64().max(1e-9);
    let goodput_bps = window_packets as f64 * PAYLOAD as f64 * 8.0 / window;
    Ok(Outcome {
        sent: seq,
        offered_achieved_bps: seq as f64 * (PAYLOAD + OVERHEAD) as f64 * 8.0 / send_secs,
        proxy_in: stats.up.packets_in,
        model_drops: stats.up.dropped_queue + stats.up.dropped_loss,
        received: got.len() as u64,
        goodput_bps,
        wire_ratio: goodput_bps * (PAYLOAD + OVERHEAD) as f64 / PAYLOAD as f64 / sc.rate_bps as f64,
        added_p50: pct(0.50),
        added_p99: pct(0.99),
        added_max: pct(1.0),
    })
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "--bench");
    let secs = args
        .iter()
        .position(|a| a == "--secs")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse::<f64>())
        .transpose()
        .context("--secs takes a number")?
        .unwrap_or(3.0);
    let only = args
        .iter()
        .position(|a| a == "--rate")
        .and_then(|i| args.get(i + 1))
        .map(|s| starling_netem::units::parse_rate(s))
        .transpose()?;

    let scenarios: Vec<Scenario> = if bench {
        let mut v = Vec::new();
        let rates = only.map_or(vec![100_000_000u64, 300_000_000, 1_000_000_000], |r| {
            vec![r]
        });
        for rate in rates {
            for load in [0.9, 1.2] {
                v.push(Scenario {
                    rate_bps: rate,
                    offered_bps: (rate as f64 * load) as u64,
                    secs,
                });
            }
        }
        v
    } else {
        println!("smoke run (use `cargo bench -p starling-netem --bench netem_bench` to measure)");
        vec![Scenario {
            rate_bps: 10_000_000,
            offered_bps: 5_000_000,
            secs: 0.6,
        }]
    };

    println!(
        "| rate | offered (achieved) | sent | kernel drops | model drops | received | goodput | wire/rate | added p50 ms | added p99 ms | added max ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for sc in scenarios {
        let o = run(sc)?;
        println!(
            "| {} | {} ({}) | {} | {} | {} | {} | {} | {:.3} | {} | {} | {} |",
            format_rate(sc.rate_bps),
            format_rate(sc.offered_bps),
            format_rate(o.offered_achieved_bps as u64),
            o.sent,
            o.sent.saturating_sub(o.proxy_in),
            o.model_drops,
            o.received,
            format_rate(o.goodput_bps as u64),
            o.wire_ratio,
            ms(o.added_p50),
            ms(o.added_p99),
            ms(o.added_max),
        );
        if !bench && o.received == 0 {
            bail!("smoke run delivered nothing");
        }
    }
    Ok(())
}
