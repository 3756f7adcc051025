//! Delivery of a delta over an emulated wide-area link: hub → (starling-netem link) → relay
//! → actor, with real processes on loopback.
//!
//! For each link profile it publishes one generated version and times: the hub's diff and
//! durable write (publish → `Published`), the WAN transfer to the relay (→ `cached`), and the
//! last hop with staging and commit on the actor (→ `active`). Goodput is the delta's bytes
//! over the WAN transfer time, as a fraction of the emulated rate. The same transfer as a
//! full BF16 checkpoint is estimated at the measured goodput.
//!
//! `cargo build --release --workspace && target/release/wan-bench --help`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir};
use starling_tests::{Testbed, wait_for};

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
        "| link (rate, RTT, loss) | delta MB | hub diff+write s | WAN transfer s | **goodput / link rate** | relay→actor incl. commit s | full checkpoint at this goodput s | delta vs full |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for l in &links {
        let dir = tempfile::tempdir()?;
        let mut tb = Testbed::with_checkpoints(
            dir,
            steps.clone(),
            &[("relay", "r"), ("actor", "a")],
            &[],
            &[],
        );
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
        ];
        let netem: Vec<&str> = netem.iter().map(String::as_str).collect();
        let (mbit, rtt) = (l.mbit.to_string(), l.rtt_ms.to_string());
        let (raddr, rout) =
            tb.relay_behind_link("r", &netem, &["--wan-mbit", &mbit, "--wan-rtt-ms", &rtt]);
        let a = tb.actor("a", &[format!("r@{raddr}")]);
        let dl = Instant::now() + Duration::from_secs(600);
        wait_for(&a, "active 0 ", dl);
        let t0 = Instant::now();
        tb.publish(1);
        let t1 = Instant::now();
        wait_for(&rout, "cached 1", dl);
        let t2 = Instant::now();
        wait_for(&a, "active 1 ", dl);
        let t3 = Instant::now();
        let delta = std::fs::metadata(tb.root.join("hub-store/deltas/v00000001.sdc"))?.len();
        let wan = (t2 - t1).as_secs_f64();
        let goodput = delta as f64 * 8.0 / wan;
        let full = dense as f64 * 8.0 / goodput;
        println!(
            "| {} Mbit/s, {} ms, {}% | {:.1} | {:.2} | {:.2} | **{:.0}%** | {:.2} | {:.0} | {:.0}× less time |",
            l.mbit,
            l.rtt_ms,
            l.loss,
            delta as f64 / 1e6,
            (t1 - t0).as_secs_f64(),
            wan,
            100.0 * goodput / (l.mbit as f64 * 1e6),
            (t3 - t2).as_secs_f64(),
            full,
            full / wan,
        );
    }
    Ok(())
}
