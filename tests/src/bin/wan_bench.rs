//! Delivery of a delta over an emulated wide-area link: hub → (`starling-netem` link) →
//! relay → 2 actors, real processes on loopback, one run per (link, mode).
//!
//! Modes: cut-through with 4 stripes (the default), cut-through with 1 stream, and
//! store-and-forward with 4 stripes (the hub offers the version once its file is durable).
//! Per run it records, from the processes' own output: the first segment encoded (hub),
//! the version received whole and then cached (verified) on the relay, the last actor staged
//! and active, and the relay's control-stream round trips (`Ping`/`Pong` every 20 ms) while
//! the transfer runs; the bytes the hub sent over the WAN (its `/metrics`); the packets the
//! emulated link dropped (random loss vs. queue overflow); and the CPU time of every process
//! in the delivery window (`/proc/PID/stat`), which shows when the 2-core machine rather than
//! the link is the bottleneck.
//!
//! - **delivery / ideal** = (last actor staged − first segment encoded) ÷ (delta bytes ÷ link
//!   rate + RTT): the issue's cut-through target is ≤ 1.15.
//! - **delivery / (max(encode, wire) + RTT)**: the same against the best any pipeline can do
//!   when the encoder is slower than the link (it is on a 2-core machine shared by every
//!   process).
//! - **goodput** = delta bytes ÷ (relay received − hub started sending), as a share of the link
//!   rate: for store-and-forward the hub starts sending when `publish` returns; with
//!   cut-through the sending is paced by the encoder, so goodput is not the link's figure.
//! - **full checkpoint** = the dense BF16 bytes at the measured goodput.
//! - **catch-up**: after the actors are active, a second relay behind an identical link
//!   fetches the same version from the hub's memory with no encoder and no staging actors
//!   running, so its goodput and control round trips are the transport's own, not the
//!   2-core machine's (QUIC handshake included in its time).
//!
//! `cargo build --release --workspace && target/release/wan-bench --help`

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use starling_checkpoint::deltafile::delta_file_name;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};
use starling_proto::delta::container::{FILE_HEADER_LEN, TRAILER_FRAME_LEN};
use starling_tests::{Testbed, metric};

#[derive(Parser, Debug)]
#[command(about = "Delta delivery over an emulated WAN link (hub → netem → relay → actor)")]
struct Args {
    /// Workload generator preset.
    #[arg(long, default_value = "0.5b")]
    model: String,
    /// Learning rate of the generated step (sets the density, hence the delta size).
    #[arg(long, default_value_t = 1e-5)]
    lr: f32,
    /// Link profiles as RATE_MBIT:RTT_MS:LOSS_PERCENT.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "100:50:0,100:50:0.1,300:150:0.5,300:50:0.1"
    )]
    links: Vec<String>,
    /// Where to keep the generated checkpoints between runs.
    #[arg(long, default_value = "/var/tmp/starling-wan-bench")]
    work: PathBuf,
    /// Modes to run per link: ct4 (cut-through, 4 stripes), ct1 (1 stream), saf4
    /// (store-and-forward, 4 stripes). The relay states its WAN link to the hub, which caps
    /// its window at the link's BDP; a `-bbr` suffix (e.g. `saf4-bbr`) makes the hub ignore
    /// it (`--no-link-ceiling`), for plain BBR.
    #[arg(long, value_delimiter = ',', default_value = "ct4,ct1,saf4")]
    modes: Vec<String>,
    /// Segment size at the hub.
    #[arg(long, default_value_t = 2048)]
    segment_kib: usize,
}

struct Link {
    mbit: u64,
    rtt_ms: u64,
    loss: f64,
}

fn parse_link(s: &str) -> Result<Link> {
    let p: Vec<&str> = s.split(':').collect();
    if p.len() != 3 {
        bail!("link {s:?} is not RATE_MBIT:RTT_MS:LOSS_PERCENT");
    }
    Ok(Link {
        mbit: p[0].parse()?,
        rtt_ms: p[1].parse()?,
        loss: p[2].parse()?,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let links: Vec<Link> = args
        .links
        .iter()
        .map(|s| parse_link(s))
        .collect::<Result<_>>()?;
    let spec = ModelSpec::preset(&args.model).context("unknown model preset")?;
    let ckpt = args.work.join(format!("{}-lr{}", args.model, args.lr));
    let steps = if ckpt.join("step-0001.safetensors").exists() {
        vec![
            ckpt.join("step-0000.safetensors"),
            ckpt.join("step-0001.safetensors"),
        ]
    } else {
        eprintln!("generating {} (once)…", ckpt.display());
        generate_to_dir(
            &spec,
            1,
            &TrainConfig {
                seed: 3,
                lr: args.lr,
                ..TrainConfig::default()
            },
            &ckpt,
            &|_| {},
        )?
    };
    let dense = std::fs::metadata(&steps[1])?.len();
    println!(
        "# wan-bench: model {} ({:.0} MB BF16 checkpoint), lr {:e}\n",
        args.model,
        dense as f64 / 1e6,
        args.lr
    );
    println!(
        "| link (rate, RTT, loss) | mode | delta MB | WAN bytes / delta | hub encode s | first segment → relay cached s | **goodput / link** | first segment → last actor staged s | **delivery / ideal** | delivery / (max(encode, wire) + RTT) | control RTT p50 / p99 / max ms (link RTT) | WAN packets dropped: random / queue | CPU busy, first segment → staged | last active s | full checkpoint at this goodput s | catch-up, machine otherwise idle: goodput / link | catch-up control RTT p50 / p99 / max ms | catch-up drops: random / queue |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for l in &links {
        for mode in &args.modes {
            let (base, ceiling) = match mode.strip_suffix("-bbr") {
                Some(b) => (b, false),
                None => (mode.as_str(), true),
            };
            let (stripes, cut) = match base {
                "ct4" => ("4", true),
                "ct1" => ("1", true),
                "saf4" => ("4", false),
                other => bail!("unknown mode {other:?} (ct4, ct1, saf4, each optionally -bbr)"),
            };
            let r = run(&steps, l, stripes, cut, ceiling, args.segment_kib)?;
            let ideal = r.delta as f64 * 8.0 / (l.mbit as f64 * 1e6) + l.rtt_ms as f64 / 1e3;
            let goodput = r.delta as f64 * 8.0 / r.wan_s;
            let wire = r.delta as f64 * 8.0 / (l.mbit as f64 * 1e6);
            let pipelined = r.encode_span_s.max(wire) + l.rtt_ms as f64 / 1e3;
            println!(
                "| {} Mbit/s, {} ms, {}% | {mode} | {:.1} | {:.3} | {:.2} | {:.2} | **{:.0}%** | {:.2} | **{:.2}** | {:.2} | {:.0} / {:.0} / {:.0} ({}) | {} / {} | {:.0}% | {:.2} | {:.0} | **{:.0}%** | {:.0} / {:.0} / {:.0} | {} / {} |",
                l.mbit,
                l.rtt_ms,
                l.loss,
                r.delta as f64 / 1e6,
                r.wan_bytes / r.delta as f64,
                r.encode_s,
                r.cached_s,
                100.0 * goodput / (l.mbit as f64 * 1e6),
                r.staged_s,
                r.staged_s / ideal,
                r.staged_s / pipelined,
                r.rtt_ms.0,
                r.rtt_ms.1,
                r.rtt_ms.2,
                l.rtt_ms,
                r.drops.0,
                r.drops.1,
                100.0 * r.cpu_busy,
                r.active_s,
                dense as f64 * 8.0 / goodput,
                100.0 * r.delta as f64 * 8.0 / r.catchup.wan_s / (l.mbit as f64 * 1e6),
                r.catchup.rtt_ms.0,
                r.catchup.rtt_ms.1,
                r.catchup.rtt_ms.2,
                r.catchup.drops.0,
                r.catchup.drops.1,
            );
        }
    }
    Ok(())
}

struct RunResult {
    /// Frame bytes of the delta (what crosses the wire, without file header and trailer).
    delta: u64,
    wan_bytes: f64,
    encode_s: f64,
    /// Seconds from the first segment encoded to the delta durable (the encoder's span).
    encode_span_s: f64,
    /// Seconds from the moment the hub starts sending to relay cached.
    wan_s: f64,
    cached_s: f64,
    staged_s: f64,
    active_s: f64,
    /// Control round trips while the version was on its way to the relay: p50, p99, max.
    rtt_ms: (f64, f64, f64),
    /// Packets the emulated link dropped towards the relay: (random loss, queue overflow).
    drops: (u64, u64),
    /// CPU time of every process of the run from the first segment to the last actor staged,
    /// as a share of all cores over that window (1.0: the machine was the bottleneck).
    cpu_busy: f64,
    /// The same version fetched afterwards by a second relay behind an identical link.
    catchup: Transfer,
}

/// A transfer of a finished version to a relay with nothing else running: the transport's
/// own figures, without the encoder and staging actors competing for the 2 cores.
struct Transfer {
    /// Seconds from starting the relay (QUIC handshake included) to its last byte received.
    wan_s: f64,
    rtt_ms: (f64, f64, f64),
    drops: (u64, u64),
}

/// p50, p99 and max of `v` (NaN when empty).
fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        v.get(((v.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    (pct(0.5), pct(0.99), pct(1.0))
}

/// The (random loss, queue overflow) drop counters of the newest `starling-netem` stats line
/// for the hub → relay direction in `out`.
fn link_drops(out: &mpsc::Receiver<String>) -> (u64, u64) {
    let mut drops = (0, 0);
    for line in out.try_iter() {
        if let Some(d) = line.trim_start().strip_prefix("down") {
            drops = (counter(d, "lost "), counter(d, "queue-dropped "));
        }
    }
    drops
}

/// User + system CPU seconds used so far by every process of the test bed.
fn cpu_seconds(tb: &Testbed) -> f64 {
    // Clock ticks are 1/100 s on Linux (USER_HZ); utime and stime are fields 14 and 15.
    const TICKS: f64 = 100.0;
    tb.procs
        .0
        .iter()
        .filter_map(|c| std::fs::read_to_string(format!("/proc/{}/stat", c.id())).ok())
        .filter_map(|stat| {
            // The command name (field 2) may hold spaces: count fields after its ')'.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / TICKS)
        })
        .sum()
}

/// The number after `name` in a `starling-netem` counter line (0 when absent).
fn counter(line: &str, name: &str) -> u64 {
    line.split_once(name)
        .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Timestamps every line of a process's output as it arrives.
fn stamped(rx: mpsc::Receiver<String>) -> mpsc::Receiver<(Instant, String)> {
    let (tx, out) = mpsc::channel();
    std::thread::spawn(move || {
        for line in rx {
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    out
}

fn until(rx: &mpsc::Receiver<(Instant, String)>, what: &str, dl: Instant) -> Result<Instant> {
    loop {
        let left = dl.saturating_duration_since(Instant::now());
        let (t, line) = rx
            .recv_timeout(left)
            .with_context(|| format!("waiting for {what:?}"))?;
        if line.starts_with(what) {
            return Ok(t);
        }
    }
}

fn run(
    steps: &[PathBuf],
    l: &Link,
    stripes: &str,
    cut: bool,
    ceiling: bool,
    segment_kib: usize,
) -> Result<RunResult> {
    let dir = tempfile::tempdir_in("/var/tmp")?;
    let seg = segment_kib.to_string();
    let mut hub_args = vec!["--stripes", stripes, "--segment-kib", &seg];
    if !ceiling {
        hub_args.push("--no-link-ceiling");
    }
    if !cut {
        hub_args.push("--store-and-forward");
    }
    let peers = [
        ("relay", "r"),
        ("actor", "a1"),
        ("actor", "a2"),
        ("relay", "r2"),
    ];
    let mut tb = Testbed::with_checkpoints(dir, steps.to_vec(), &peers, &[], &hub_args);
    let bdp = (l.mbit as f64 * 1e6 / 8.0 * l.rtt_ms as f64 / 1e3) as u64;
    let netem = [
        "--rate".to_owned(),
        format!("{}mbit", l.mbit),
        "--delay".to_owned(),
        format!("{}ms", l.rtt_ms as f64 / 2.0),
        "--loss".to_owned(),
        format!("{}%", l.loss),
        "--queue".to_owned(),
        format!("{}", (bdp * 3 / 2).max(256 * 1024)),
        "--stats-every".to_owned(),
        "500ms".to_owned(),
    ];
    let netem: Vec<&str> = netem.iter().map(String::as_str).collect();
    let (mbit, rtt) = (l.mbit.to_string(), l.rtt_ms.to_string());
    let relay_args = [
        "--wan-mbit",
        &mbit,
        "--wan-rtt-ms",
        &rtt,
        "--stripes",
        stripes,
        "--ping-ms",
        "20",
        "--print-rtt",
    ];
    let (raddr, rout) = tb.relay_behind_link("r", &netem, &relay_args);
    let rout = stamped(rout);
    let actors: Vec<_> = ["a1", "a2"]
        .iter()
        .map(|a| stamped(tb.actor(a, &[format!("r@{raddr}")])))
        .collect();
    let dl = Instant::now() + Duration::from_secs(900);
    for a in &actors {
        until(a, "active 0 ", dl)?;
    }
    let hub_out = std::mem::replace(&mut tb.hub_out, mpsc::channel().1);
    let hub_out = stamped(hub_out);
    // A steady-state publish: the hub's background start-up work (the initial anchor, a full
    // checkpoint copy, and the initial snapshot's digest) is done before the clock starts.
    let mut waiting = vec!["anchor 0", "base-digest 0"];
    while !waiting.is_empty() {
        let left = dl.saturating_duration_since(Instant::now());
        let (_, line) = hub_out
            .recv_timeout(left)
            .with_context(|| format!("waiting for {waiting:?}"))?;
        waiting.retain(|w| line != *w);
    }
    let t0 = Instant::now();
    let publisher = {
        let (hub, cluster, step) = (tb.hub_addr.clone(), tb.cluster.clone(), steps[1].clone());
        std::thread::spawn(move || {
            starling_tests::publish_to(&hub, &cluster, &step);
            Instant::now()
        })
    };
    let first = until(&hub_out, "first-segment 1", dl)?;
    let cpu_at_first = cpu_seconds(&tb);
    // Relay output until cached: the control round trips seen meanwhile.
    let mut rtts = Vec::new();
    let mut received = None;
    let cached = loop {
        let left = dl.saturating_duration_since(Instant::now());
        let (t, line) = rout.recv_timeout(left).context("waiting for cached 1")?;
        if let Some(us) = line.strip_prefix("rtt-us ") {
            if t >= first {
                rtts.push(us.parse::<f64>().unwrap_or(f64::NAN) / 1e3);
            }
        } else if line == "received 1" {
            received = Some(t);
        } else if line == "cached 1" {
            break t;
        }
    };
    let published = publisher
        .join()
        .map_err(|_| anyhow::anyhow!("publish thread panicked"))?;
    let mut staged = first;
    let mut active = first;
    for a in &actors {
        staged = staged.max(until(a, "staged 1", dl)?);
    }
    let cpu_in_window = cpu_seconds(&tb) - cpu_at_first;
    for a in &actors {
        active = active.max(until(a, "active 1 ", dl)?);
    }
    let file = std::fs::metadata(tb.root.join("hub-store/deltas").join(delta_file_name(1)))?.len();
    let delta = file - (FILE_HEADER_LEN + TRAILER_FRAME_LEN) as u64;
    let wan_bytes = metric(
        &tb.hub_metrics(),
        "starling_hub_delta_sent_bytes_total{peer=\"r\"}",
    )
    .context("hub metrics: bytes sent to the relay")?;
    // The link's counters for the hub → relay direction, as of about now.
    let drops = link_drops(&tb.links_out[0]);
    let catchup = catch_up(&mut tb, &netem, &relay_args, dl)?;
    let send_start = if cut { first } else { published };
    Ok(RunResult {
        delta,
        wan_bytes,
        encode_s: (published - t0).as_secs_f64(),
        encode_span_s: published.saturating_duration_since(first).as_secs_f64(),
        wan_s: (received.unwrap_or(cached) - send_start).as_secs_f64(),
        cached_s: (cached - first).as_secs_f64(),
        staged_s: (staged - first).as_secs_f64(),
        active_s: (active - first).as_secs_f64(),
        rtt_ms: percentiles(rtts),
        drops,
        cpu_busy: cpu_in_window
            / (std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
                * (staged - first).as_secs_f64()),
        catchup,
    })
}

/// Starts a second relay (`r2`) behind a link like the first one's and lets it fetch the
/// published version from the hub's memory while nothing else runs.
fn catch_up(
    tb: &mut Testbed,
    netem: &[&str],
    relay_args: &[&str],
    dl: Instant,
) -> Result<Transfer> {
    let start = Instant::now();
    let (_, out) = tb.relay_behind_link("r2", netem, relay_args);
    let out = stamped(out);
    let mut rtts = Vec::new();
    let received = loop {
        let left = dl.saturating_duration_since(Instant::now());
        let (t, line) = out
            .recv_timeout(left)
            .context("catch-up: waiting for received 1")?;
        if let Some(us) = line.strip_prefix("rtt-us ") {
            rtts.push(us.parse::<f64>().unwrap_or(f64::NAN) / 1e3);
        } else if line == "received 1" {
            break t;
        }
    };
    // One more stats interval of the link (500 ms), so its counters cover the transfer.
    std::thread::sleep(Duration::from_millis(600));
    Ok(Transfer {
        wan_s: (received - start).as_secs_f64(),
        rtt_ms: percentiles(rtts),
        drops: link_drops(&tb.links_out[1]),
    })
}
