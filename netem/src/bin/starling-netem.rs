//! The `starling-netem` binary: starts one [`Proxy`] from the command line,
//! runs until Ctrl-C or SIGTERM, then stops it and prints its counters.
//!
//! The first line on stdout is `listening on ADDR` (the real port when
//! `--listen` asked for port 0), so scripts and tests can find the proxy.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM};
use starling_netem::Proxy;
use starling_netem::cli::Args;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (up, down) = args.profiles()?;

    let stop = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing the Ctrl-C/SIGTERM handler")?;
    }

    let proxy = Proxy::start(args.listen, args.upstream, up.clone(), down.clone())
        .with_context(|| format!("starting the proxy on {}", args.listen))?;
    let (rcvbuf, sndbuf) = proxy.socket_buffers();
    println!("listening on {}", proxy.local_addr());
    println!("relaying to {}", proxy.upstream_addr());
    println!("up   (client -> upstream): {up}");
    println!("down (upstream -> client): {down}");
    println!("socket buffers: rcv {rcvbuf} B, snd {sndbuf} B (as reported by the kernel)");
    std::io::stdout().flush().context("writing to stdout")?;

    let mut next_report = args.stats_every.map(|every| Instant::now() + every);
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        if let (Some(at), Some(every)) = (next_report, args.stats_every)
            && Instant::now() >= at
        {
            println!("{}", proxy.stats());
            next_report = Some(at + every.max(Duration::from_millis(100)));
        }
    }

    let stats = proxy.shutdown().context("stopping the proxy")?;
    println!("stopped; final counters:");
    println!("{stats}");
    Ok(())
}
