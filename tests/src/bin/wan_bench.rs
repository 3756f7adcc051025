//! Delivery of a delta over an emulated wide-area link: hub → (`starling-netem` link) →
//! relay → 2 actors, real processes on loopback, one run per (link, mode).
//!
//! Modes: cut-through with 4 stripes (the default), cut-through with 1 stream, and
//! store-and-forward with 4 stripes (the hub offers the version once its file is durable).
//! Per run it records the moments each process stamped itself, read from its `/v1/status`
//! (`docs/observability.md`) once it is there, never from log text: the first segment
//! encoded (the hub's `first_segment_at_ms`), the version received whole and then cached
//! (verified) on the relay (`received_at_ms`, `cached_at_ms`), the last actor staged and active
//! (`newest_staged_at_ms`, `active_at_ms`). Besides: the relay's control-stream round trips
//! (`Ping`/`Pong` every 20 ms, which `--print-rtt` prints) while the transfer runs; the bytes
//! the hub sent over the WAN (its `/metrics`); the packets the emulated link dropped (random
//! loss vs. queue overflow, from `starling-netem`'s counters); and the CPU time of every
//! process in the delivery window (`/proc/PID/stat`, sampled every 50 ms and interpolated at
//! the stamps), which shows when the 2-core machine rather than the link is the bottleneck.
//! Before the clock starts it waits, through the same endpoints, for the actors to run
//! version 0 and the hub to be at rest (`newest_anchor`, `newest_version_finite`).
//!
//! - **delivery / ideal** = (last actor staged − first segment encoded) ÷ (delta bytes ÷ link
//!   rate + RTT): the issue's cut-through target is ≤ 1.15.
//! - **delivery / (max(encode, wire) + RTT)**: the same against the best any pipeline can do
//!   when the encoder is slower than the link (it is on a 2-core machine shared by every
//!   process).
//! - **goodput** = delta bytes ÷ (relay received − hub started sending), as a share of the link
//!   rate: for store-and-forward the hub's `published_at_ms`, stamped once its delta file is
//!   durable, its frames offered and the ledger written (sending starts a few ms before it,
//!   so the figure is slightly high); with cut-through the first segment, and the sending is
//!   paced by the encoder, so goodput is not the link's figure.
//! - **full checkpoint** = the dense BF16 bytes at the measured goodput.
//! - **catch-up**: after the actors are active, a second relay behind an identical link
//!   fetches the same version from the hub's memory with no encoder and no staging actors
//!   running, so its goodput and control round trips are the transport's own, not the
//!   2-core machine's (QUIC handshake included in its time).
//!
//! `cargo build --release --workspace && target/release/wan-bench --help`

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::Value;
use starling_checkpoint::deltafile::delta_file_name;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};
use starling_proto::delta::container::{FILE_HEADER_LEN, TRAILER_FRAME_LEN};
use starling_tests::{Testbed, http_get, metric};

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
    /// The hub's codec policy (`--codecs`): auto (its default) chooses per version by the
    /// links; fast or small pins a set. The table says which set each run used.
    #[arg(long, default_value = "auto")]
    codecs: String,
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
        "| link (rate, RTT, loss) | mode | codecs (hub's choice) | delta MB | WAN bytes / delta | hub encode s | first segment → relay cached s | **goodput / link** | first segment → last actor staged s | **delivery / ideal** | delivery / (max(encode, wire) + RTT) | control RTT p50 / p99 / max ms (link RTT) | WAN packets dropped: random / queue | CPU busy, first segment → staged | last active s | full checkpoint at this goodput s | catch-up, machine otherwise idle: goodput / link | catch-up control RTT p50 / p99 / max ms | catch-up drops: random / queue |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    // The hub's reason for each run's codec set, printed under the table.
    let mut why = Vec::new();
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
            let r = run(
                &steps,
                l,
                stripes,
                cut,
                ceiling,
                args.segment_kib,
                &args.codecs,
            )?;
            let ideal = r.delta as f64 * 8.0 / (l.mbit as f64 * 1e6) + l.rtt_ms as f64 / 1e3;
            // No figure where the transfer ended within the stamps' millisecond (tiny runs).
            let goodput = if r.wan_s > 0.0 {
                r.delta as f64 * 8.0 / r.wan_s
            } else {
                f64::NAN
            };
            let wire = r.delta as f64 * 8.0 / (l.mbit as f64 * 1e6);
            let pipelined = r.encode_span_s.max(wire) + l.rtt_ms as f64 / 1e3;
            println!(
                "| {} Mbit/s, {} ms, {}% | {mode} | {} | {:.1} | {:.3} | {:.2} | {:.2} | **{:.0}%** | {:.2} | **{:.2}** | {:.2} | {:.0} / {:.0} / {:.0} ({}) | {} / {} | {:.0}% | {:.2} | {:.0} | **{:.0}%** | {:.0} / {:.0} / {:.0} | {} / {} |",
                l.mbit,
                l.rtt_ms,
                l.loss,
                r.codecs,
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
            why.push(format!(
                "- {} Mbit/s, {} ms, {}%, {mode}: {}",
                l.mbit, l.rtt_ms, l.loss, r.why
            ));
        }
    }
    println!("\nThe hub's codec choice per run (`/v1/status` `codecs.why`):");
    for w in why {
        println!("{w}");
    }
    Ok(())
}

struct RunResult {
    /// The codec set the hub used (`/v1/status` `codecs.chosen`), with its policy.
    codecs: String,
    /// Why (`codecs.why`).
    why: String,
    /// Frame bytes of the delta (what crosses the wire, without file header and trailer).
    delta: u64,
    wan_bytes: f64,
    encode_s: f64,
    /// Seconds from the first segment encoded to the hub's `published_at_ms` (the encoder's
    /// span, with the delta file's seal and the ledger write).
    encode_span_s: f64,
    /// Seconds from the moment the hub starts sending (cut-through: its first segment;
    /// store-and-forward: the version published) to the relay's last byte received.
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

/// The number after `name` in a `starling-netem` counter line (0 when absent).
fn counter(line: &str, name: &str) -> u64 {
    line.split_once(name)
        .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// User + system CPU seconds used so far by the processes `pids`.
fn cpu_seconds(pids: &[u32]) -> f64 {
    // Clock ticks are 1/100 s on Linux (USER_HZ); utime and stime are fields 14 and 15.
    const TICKS: f64 = 100.0;
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // The command name (field 2) may hold spaces: count fields after its ')'.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / TICKS)
        })
        .sum()
}

/// Samples the CPU time of a set of processes every [`CPU_SAMPLE`], stamped in Unix ms, so
/// that the CPU used between two moments the processes stamped themselves (read afterwards
/// from their status) can be interpolated. Reading `/proc` costs next to nothing, where
/// polling the processes' status that often would load them.
struct CpuSampler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<(u64, f64)>>>,
}

const CPU_SAMPLE: Duration = Duration::from_millis(50);

impl CpuSampler {
    fn start(pids: Vec<u32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                samples.push((unix_ms(), cpu_seconds(&pids)));
                std::thread::sleep(CPU_SAMPLE);
            }
            samples.push((unix_ms(), cpu_seconds(&pids)));
            samples
        });
        CpuSampler {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; the CPU seconds used between Unix ms `from` and `to`.
    fn between(mut self, from: u64, to: u64) -> Result<f64> {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self
            .thread
            .take()
            .context("CPU sampler already stopped")?
            .join()
            .map_err(|_| anyhow::anyhow!("CPU sampler panicked"))?;
        Ok(interpolate(&samples, to) - interpolate(&samples, from))
    }
}

impl Drop for CpuSampler {
    /// A run that ends early (an error before `between`) stops the sampling thread too.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The cumulative CPU seconds at Unix ms `at`, linear between the samples around it (the
/// first or last sample outside them).
fn interpolate(samples: &[(u64, f64)], at: u64) -> f64 {
    let after = samples.partition_point(|&(t, _)| t < at);
    match (
        after.checked_sub(1).and_then(|i| samples.get(i)),
        samples.get(after),
    ) {
        (Some(&(t0, c0)), Some(&(t1, c1))) if t1 > t0 => {
            c0 + (c1 - c0) * (at - t0) as f64 / (t1 - t0) as f64
        }
        (_, Some(&(_, c))) | (Some(&(_, c)), None) => c,
        (None, None) => 0.0,
    }
}

/// Wall-clock now in Unix ms: the clock the processes stamp their own events with.
fn unix_ms() -> u64 {
    starling_telemetry::unix_ms()
}

/// A process's `/v1/status`.
fn status(http: &str) -> Result<Value> {
    serde_json::from_str(&http_get(http, "/v1/status"))
        .with_context(|| format!("status of {http} is not JSON"))
}

/// Polls `probe` every [`POLL`] until it gives a value (or `dl` passes).
fn poll<T>(what: &str, dl: Instant, mut probe: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    loop {
        if let Some(v) = probe()? {
            return Ok(v);
        }
        if Instant::now() >= dl {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(POLL);
    }
}

/// How often the harness reads a status while it waits. Every time it reports comes from the
/// processes' own stamps, so this sets only how soon it notices, not what it measures.
const POLL: Duration = Duration::from_millis(100);

/// `field` of `v` as a u64, once it is at least `version`.
fn reached(v: &Value, field: &str, version: u64) -> bool {
    v[field].as_u64().is_some_and(|x| x >= version)
}

/// `field` of a status as a Unix ms stamp.
fn stamp(v: &Value, field: &str) -> Result<u64> {
    v[field]
        .as_u64()
        .with_context(|| format!("status without {field}: {v}"))
}

/// Control round trips in ms, each stamped in Unix ms as it arrived.
type Rtts = mpsc::Receiver<(u64, f64)>;

/// Collects the `rtt-us MICROS` lines a relay prints (`--print-rtt`), each stamped in Unix ms
/// as it arrives.
fn rtt_lines(rx: mpsc::Receiver<String>) -> Rtts {
    let (tx, out) = mpsc::channel();
    std::thread::spawn(move || {
        for line in rx {
            if let Some(us) = line.strip_prefix("rtt-us ")
                && let Ok(us) = us.parse::<f64>()
                && tx.send((unix_ms(), us / 1e3)).is_err()
            {
                break;
            }
        }
    });
    out
}

/// The round trips (ms) stamped within `[from, to]`.
fn rtts_within(rx: &Rtts, from: u64, to: u64) -> Vec<f64> {
    rx.try_iter()
        .filter(|&(t, _)| (from..=to).contains(&t))
        .map(|(_, ms)| ms)
        .collect()
}

/// A relay behind an emulated link (`relay_args` include `--http` and `--print-rtt`): its
/// QUIC address, its status address, and its control round trips as they arrive.
fn relay_with_status(
    tb: &mut Testbed,
    name: &str,
    netem: &[&str],
    relay_args: &[&str],
) -> Result<(String, String, Rtts)> {
    let (addr, out) = tb.relay_behind_link(name, netem, relay_args);
    let http = tb
        .relay_http
        .get(name)
        .with_context(|| format!("relay {name} serves no status"))?
        .clone();
    Ok((addr, http, rtt_lines(out)))
}

/// Starts an actor with a status endpoint; returns its HTTP address and its stdout, which
/// the caller keeps open for the run (an actor whose stdout closes stops on its next line).
fn actor_with_status(
    tb: &mut Testbed,
    name: &str,
    relay: &str,
    dl: Instant,
) -> Result<(String, mpsc::Receiver<String>)> {
    let out = tb.actor_with(name, &[relay.to_owned()], &["--http", "127.0.0.1:0"]);
    loop {
        let left = dl.saturating_duration_since(Instant::now());
        let line = out
            .recv_timeout(left)
            .with_context(|| format!("waiting for actor {name} to serve its status"))?;
        if let Some(http) = line.strip_prefix("http on ") {
            return Ok((http.to_owned(), out));
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
    codecs: &str,
) -> Result<RunResult> {
    let dir = tempfile::tempdir_in("/var/tmp")?;
    let seg = segment_kib.to_string();
    let mut hub_args = vec![
        "--stripes",
        stripes,
        "--segment-kib",
        &seg,
        "--codecs",
        codecs,
    ];
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
        "--http",
        "127.0.0.1:0",
    ];
    let dl = Instant::now() + Duration::from_secs(900);
    let (raddr, relay_http, rtts) = relay_with_status(&mut tb, "r", &netem, &relay_args)?;
    let relay = format!("r@{raddr}");
    let (actors, _actor_out): (Vec<String>, Vec<_>) = ["a1", "a2"]
        .iter()
        .map(|a| actor_with_status(&mut tb, a, &relay, dl))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .unzip();
    for a in &actors {
        poll("an actor active at version 0", dl, || {
            Ok(reached(&status(a)?, "active_version", 0).then_some(()))
        })?;
    }
    // A steady-state publish: the hub's background start-up work (the seed's anchor, a full
    // checkpoint copy, and the scan that finds the newest version finite) is done before the
    // clock starts.
    poll(
        "the hub at rest (anchor 0 written, version 0 known finite)",
        dl,
        || {
            let s = tb.hub_status();
            Ok(
                (s["newest_anchor"].as_u64() == Some(0) && s["newest_version_finite"] == true)
                    .then_some(()),
            )
        },
    )?;
    let pids: Vec<u32> = tb.procs.0.iter().map(|c| c.id()).collect();
    let cpu = CpuSampler::start(pids);
    let t0 = unix_ms();
    // The publish's outcome: when it returned, or that it failed (its panic is on stderr),
    // which ends the waits below at once instead of at the deadline.
    let (published_tx, published_rx) = mpsc::channel();
    {
        let (hub, cluster, step) = (tb.hub_addr.clone(), tb.cluster.clone(), steps[1].clone());
        std::thread::spawn(move || {
            let done = std::panic::catch_unwind(|| {
                starling_tests::publish_to(&hub, &cluster, &step);
            });
            let _ = published_tx.send(done.is_ok().then(unix_ms));
        });
    }
    let mut published = None;
    let relay_done = poll("relay r cached version 1", dl, || {
        publish_outcome(&published_rx, &mut published)?;
        let s = status(&relay_http)?;
        Ok(reached(&s, "cached_version", 1).then_some(s))
    })?;
    let mut staged = Vec::new();
    for a in &actors {
        let s = poll("an actor staged version 1", dl, || {
            let s = status(a)?;
            Ok(reached(&s, "newest_staged_version", 1).then_some(s))
        })?;
        staged.push(stamp(&s, "newest_staged_at_ms")?);
    }
    let mut active = Vec::new();
    for a in &actors {
        let s = poll("an actor active at version 1", dl, || {
            let s = status(a)?;
            Ok(reached(&s, "active_version", 1).then_some(s))
        })?;
        active.push(stamp(&s, "active_at_ms")?);
    }
    let published = match published {
        Some(t) => t,
        None => published_rx
            .recv_timeout(dl.saturating_duration_since(Instant::now()))
            .context("waiting for the publish to return")?
            .context("the publish failed (its panic is above)")?,
    };
    // The hub serves its status from a cache refreshed at most every `STATUS_TTL`: poll.
    let (v1, chosen, why) = poll("version 1 in the hub's status", dl, || {
        let hub = tb.hub_status();
        let text = |v: &Value| v.as_str().unwrap_or("?").to_owned();
        let (chosen, why) = (text(&hub["codecs"]["chosen"]), text(&hub["codecs"]["why"]));
        Ok(hub["versions"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["version"] == 1))
            .map(|v| (v.clone(), chosen, why)))
    })?;
    let first = stamp(&v1, "first_segment_at_ms")?;
    // When the hub recorded the version published: its delta file durable, its frames
    // offered (store-and-forward starts sending then), the ledger written.
    let hub_published = stamp(&v1, "published_at_ms")?;
    let cached = stamp(&relay_done, "cached_at_ms")?;
    let received = stamp(&relay_done, "received_at_ms")?;
    let staged = staged.into_iter().max().unwrap_or(first);
    let active = active.into_iter().max().unwrap_or(first);
    let cpu_in_window = cpu.between(first, staged)?;
    let file = std::fs::metadata(tb.root.join("hub-store/deltas").join(delta_file_name(1)))?.len();
    let delta = file - (FILE_HEADER_LEN + TRAILER_FRAME_LEN) as u64;
    let wan_bytes = metric(
        &tb.hub_metrics(),
        "starling_hub_delta_sent_bytes_total{peer=\"r\"}",
    )
    .context("hub metrics: bytes sent to the relay")?;
    // The link's counters for the hub → relay direction, as of about now.
    let drops = link_drops(&tb.links_out[0]);
    let rtt_ms = percentiles(rtts_within(&rtts, first, cached));
    let (catchup, catchup_rtts) = catch_up(&mut tb, &netem, &relay_args, dl)?;
    let send_start = if cut { first } else { hub_published };
    let window = secs(first, staged)?;
    let result = RunResult {
        codecs: format!("{chosen} ({codecs})"),
        why,
        delta,
        wan_bytes,
        encode_s: secs(t0, published)?,
        encode_span_s: secs(first, hub_published)?,
        // Store-and-forward starts sending a few ms before `published_at_ms`: at the tiny
        // preset the whole transfer can end before it.
        wan_s: secs(send_start, received).unwrap_or(0.0),
        cached_s: secs(first, cached)?,
        staged_s: window,
        active_s: secs(first, active)?,
        rtt_ms,
        drops,
        cpu_busy: if window > 0.0 {
            cpu_in_window
                / (std::thread::available_parallelism().map_or(1, |n| n.get()) as f64 * window)
        } else {
            f64::NAN
        },
        catchup,
    };
    // The processes go first: each prints to a pipe read by a thread these receivers feed,
    // and a process whose stdout reader is gone stops on its next line.
    drop(tb);
    drop((rtts, catchup_rtts, _actor_out));
    Ok(result)
}

/// Seconds from Unix ms `from` to `to`; an error where `to` is earlier (stamps out of order
/// would otherwise print as a plausible zero).
fn secs(from: u64, to: u64) -> Result<f64> {
    to.checked_sub(from)
        .map(|ms| ms as f64 / 1e3)
        .with_context(|| format!("stamp {to} is before {from}"))
}

/// Takes the publish's outcome once it is there: its return time, or an error if it failed.
fn publish_outcome(rx: &mpsc::Receiver<Option<u64>>, published: &mut Option<u64>) -> Result<()> {
    if published.is_none()
        && let Ok(outcome) = rx.try_recv()
    {
        *published = Some(outcome.context("the publish failed (its panic is above)")?);
    }
    Ok(())
}

/// Starts a second relay (`r2`) behind a link like the first one's and lets it fetch the
/// published version from the hub's memory while nothing else runs.
fn catch_up(
    tb: &mut Testbed,
    netem: &[&str],
    relay_args: &[&str],
    dl: Instant,
) -> Result<(Transfer, Rtts)> {
    let start = unix_ms();
    let (_, http, rtts) = relay_with_status(tb, "r2", netem, relay_args)?;
    let done = poll("catch-up relay r2 received version 1", dl, || {
        let s = status(&http)?;
        Ok(reached(&s, "received_version", 1).then_some(s))
    })?;
    let received = stamp(&done, "received_at_ms")?;
    // One more stats interval of the link (500 ms), so its counters cover the transfer.
    std::thread::sleep(Duration::from_millis(600));
    let transfer = Transfer {
        wan_s: secs(start, received)?,
        rtt_ms: percentiles(rtts_within(&rtts, start, received)),
        drops: link_drops(&tb.links_out[1]),
    };
    Ok((transfer, rtts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_interpolated_between_samples_and_held_outside_them() {
        let samples = [(1_000, 2.0), (1_050, 2.5), (1_100, 2.5), (1_200, 4.5)];
        assert_eq!(interpolate(&samples, 1_025), 2.25);
        assert_eq!(interpolate(&samples, 1_050), 2.5);
        assert_eq!(interpolate(&samples, 1_150), 3.5);
        assert_eq!(interpolate(&samples, 900), 2.0);
        assert_eq!(interpolate(&samples, 1_300), 4.5);
        assert_eq!(interpolate(&[], 1_000), 0.0);
    }

    #[test]
    fn stamps_out_of_order_are_an_error_not_a_zero() {
        assert_eq!(secs(1_000, 3_500).ok(), Some(2.5));
        assert!(secs(3_500, 1_000).is_err());
    }
}
