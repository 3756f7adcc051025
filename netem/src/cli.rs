//! Command-line arguments of the `starling-netem` binary, and their mapping
//! to one [`LinkProfile`] per direction.
//!
//! Invariant: every flag without a `--down-` twin applies to both directions;
//! a `--down-...` flag overrides its twin for the upstream → client direction
//! only. The down direction's seed is `seed + 1`, so the two directions drop
//! different packets.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::error::NetemError;
use crate::profile::{LinkProfile, UDP_IPV4_ETHERNET_OVERHEAD};
use crate::units::{parse_duration, parse_percent, parse_rate, parse_size};

const ABOUT: &str = "User-space UDP link emulator: relays datagrams between clients and one \
upstream through an emulated wide-area link (rate, delay, jitter, loss, queue).";

const LONG_ABOUT: &str = "User-space UDP link emulator: relays datagrams between clients and one \
upstream through an emulated wide-area link.

Clients send to --listen; each client address gets its own socket towards --upstream (so the \
upstream sees distinct peers, as behind NAT) and replies come back the same way. Each packet, \
in each direction, goes through:

  loss      dropped with probability --loss (seeded: the same --seed drops the same packets)
  queue     dropped if the bytes waiting for the rate limiter exceed --queue (drop-tail)
  rate      serialized at --rate, counting payload + --overhead bytes per packet
  delay     held for --delay ± a uniform draw within --jitter
  delivery  sent on, in arrival order unless --reorder

Flags apply to both directions; --down-* flags override them for upstream -> client.
Units: rates in bits/s (250kbit, 100mbit, 1gbit), durations (2.5ms, 100us, 1s), \
percentages (0.1%), sizes in bytes (1500, 64KiB, 1.5MB).

Limits: on a 2-core machine the user-space delay line keeps up to about 300 Mbit/s; for \
1 Gbit/s use `tc tbf` in a network namespace without added delay. Ctrl-C or SIGTERM stops \
the proxy and prints its counters.";

const EXAMPLES: &str = "Examples:
  # A 100 Mbit/s, 25 ms link with 0.1 % loss in front of a server on port 7001:
  starling-netem --listen 127.0.0.1:7000 --upstream 127.0.0.1:7001 \\
      --rate 100mbit --delay 25ms --jitter 1ms --loss 0.1% --queue 1.5MB

  # Asymmetric: fast downlink, slow lossy uplink, stats every 5 s:
  starling-netem --listen 127.0.0.1:7000 --upstream 127.0.0.1:7001 \\
      --rate 20mbit --loss 1% --down-rate 200mbit --down-loss 0 --stats-every 5s";

/// A rate limit as written on the command line: a rate or `unlimited`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit(pub Option<u64>);

/// Parses `100mbit` etc. (see [`parse_rate`]), or `unlimited`/`none`.
///
/// # Errors
/// As [`parse_rate`].
pub fn parse_rate_limit(input: &str) -> Result<RateLimit, NetemError> {
    match input.trim().to_ascii_lowercase().as_str() {
        "unlimited" | "none" => Ok(RateLimit(None)),
        _ => parse_rate(input).map(|bps| RateLimit(Some(bps))),
    }
}

/// The arguments of `starling-netem`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "starling-netem",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = EXAMPLES
)]
pub struct Args {
    /// Address clients send to (port 0 picks a free port, printed at start).
    #[arg(long, env = "NETEM_LISTEN", value_name = "ADDR:PORT")]
    pub listen: SocketAddr,

    /// Address every datagram is relayed to.
    #[arg(long, env = "NETEM_UPSTREAM", value_name = "ADDR:PORT")]
    pub upstream: SocketAddr,

    /// Bottleneck rate in bits/s (e.g. 100mbit, 1gbit, 250kbit) or `unlimited`.
    #[arg(long, value_parser = parse_rate_limit, default_value = "unlimited")]
    pub rate: RateLimit,

    /// One-way delay added after serialization (e.g. 25ms, 2.5ms).
    #[arg(long, value_parser = parse_duration, default_value = "0")]
    pub delay: Duration,

    /// Uniform jitter half-width: each delay is drawn from delay ± jitter.
    #[arg(long, value_parser = parse_duration, default_value = "0")]
    pub jitter: Duration,

    /// Random loss probability as a percentage (e.g. 0.1%).
    #[arg(long, value_parser = parse_percent, default_value = "0")]
    pub loss: f64,

    /// Drop-tail limit on bytes waiting for the rate limiter (e.g. 1.5MB, 64KiB).
    #[arg(long, value_parser = parse_size, default_value = "1MB")]
    pub queue: usize,

    /// Wire bytes added to each payload for the rate (UDP + IPv4 + Ethernet = 42).
    #[arg(long, default_value_t = UDP_IPV4_ETHERNET_OVERHEAD, value_name = "BYTES")]
    pub overhead: usize,

    /// Let jitter reorder packets (as tc netem does); default keeps arrival order.
    #[arg(long)]
    pub reorder: bool,

    /// Seed of the loss and jitter draws (the down direction uses seed + 1).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Rate of the upstream -> client direction, overriding --rate.
    #[arg(long, value_parser = parse_rate_limit, value_name = "RATE")]
    pub down_rate: Option<RateLimit>,

    /// Delay of the upstream -> client direction, overriding --delay.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub down_delay: Option<Duration>,

    /// Jitter of the upstream -> client direction, overriding --jitter.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub down_jitter: Option<Duration>,

    /// Loss of the upstream -> client direction, overriding --loss.
    #[arg(long, value_parser = parse_percent, value_name = "PERCENT")]
    pub down_loss: Option<f64>,

    /// Queue limit of the upstream -> client direction, overriding --queue.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub down_queue: Option<usize>,

    /// Print the counters at this interval (e.g. 5s); always printed at exit.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub stats_every: Option<Duration>,
}

impl Args {
    /// The `(up, down)` profiles: client → upstream and upstream → client.
    ///
    /// # Errors
    /// [`NetemError::InvalidProfile`] if either profile fails validation.
    pub fn profiles(&self) -> Result<(LinkProfile, LinkProfile), NetemError> {
        let up = LinkProfile {
            rate_bps: self.rate.0,
            delay: self.delay,
            jitter: self.jitter,
            loss: self.loss,
            queue_limit_bytes: self.queue,
            per_packet_overhead: self.overhead,
            reorder: self.reorder,
            seed: self.seed,
        };
        let down = LinkProfile {
            rate_bps: self.down_rate.map_or(up.rate_bps, |r| r.0),
            delay: self.down_delay.unwrap_or(up.delay),
            jitter: self.down_jitter.unwrap_or(up.jitter),
            loss: self.down_loss.unwrap_or(up.loss),
            queue_limit_bytes: self.down_queue.unwrap_or(up.queue_limit_bytes),
            seed: self.seed.wrapping_add(1),
            ..up.clone()
        };
        up.validate()?;
        down.validate()?;
        Ok((up, down))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use clap::CommandFactory;

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let mut argv = vec![
            "starling-netem",
            "--listen",
            "127.0.0.1:7000",
            "--upstream",
            "127.0.0.1:7001",
        ];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv)
    }

    #[test]
    fn the_documented_example_parses() {
        let args = parse(&[
            "--rate", "100mbit", "--delay", "25ms", "--jitter", "1ms", "--loss", "0.1%", "--queue",
            "1.5MB",
        ])
        .unwrap();
        let (up, down) = args.profiles().unwrap();
        assert_eq!(up.rate_bps, Some(100_000_000));
        assert_eq!(up.delay, Duration::from_millis(25));
        assert_eq!(up.jitter, Duration::from_millis(1));
        assert_eq!(up.loss, 0.001);
        assert_eq!(up.queue_limit_bytes, 1_500_000);
        assert_eq!(up.per_packet_overhead, 42);
        assert_eq!(up.seed, 1);
        assert_eq!(down, LinkProfile { seed: 2, ..up });
    }

    #[test]
    fn down_flags_override_one_direction() {
        let args = parse(&[
            "--rate",
            "20mbit",
            "--loss",
            "1%",
            "--down-rate",
            "unlimited",
            "--down-loss",
            "0",
            "--down-delay",
            "5ms",
            "--down-queue",
            "64KiB",
            "--reorder",
        ])
        .unwrap();
        let (up, down) = args.profiles().unwrap();
        assert_eq!(up.rate_bps, Some(20_000_000));
        assert_eq!(up.loss, 0.01);
        assert_eq!(up.delay, Duration::ZERO);
        assert_eq!(down.rate_bps, None);
        assert_eq!(down.loss, 0.0);
        assert_eq!(down.delay, Duration::from_millis(5));
        assert_eq!(down.queue_limit_bytes, 65_536);
        assert!(up.reorder && down.reorder);
    }

    #[test]
    fn defaults_are_an_ideal_link() {
        let (up, down) = parse(&[]).unwrap().profiles().unwrap();
        assert_eq!(up.rate_bps, None);
        assert_eq!(up.delay, Duration::ZERO);
        assert_eq!(up.loss, 0.0);
        assert_eq!(down.rate_bps, None);
    }

    #[test]
    fn bad_values_are_rejected_with_a_hint() {
        let err = parse(&["--rate", "100mbps"]).unwrap_err().to_string();
        assert!(err.contains("ambiguous"), "{err}");
        assert!(parse(&["--loss", "5"]).is_err());
        assert!(parse(&["--delay", "25"]).is_err());
        assert!(parse(&["--rate", "10bit"]).unwrap().profiles().is_err());
        assert!(Args::try_parse_from(["starling-netem", "--listen", "127.0.0.1:1"]).is_err());
    }

    #[test]
    fn help_teaches_the_model_and_units() {
        Args::command().debug_assert();
        let help = Args::command().render_long_help().to_string();
        for needle in [
            "--down-rate",
            "drop-tail",
            "100mbit",
            "1.5MB",
            "tc tbf",
            "Examples",
        ] {
            assert!(help.contains(needle), "help lacks {needle:?}");
        }
    }
}
