//! `starling-relay`'s command line: parses it and runs the relay.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use starling_transport::link::LinkProfile;

/// Starling relay: receives each delta once per region over the WAN, verifies it, caches it
/// and serves the region's actors.
#[derive(Parser, Debug)]
#[command(name = "starling-relay", version)]
struct Args {
    /// Credentials directory written by `starling-hub issue --role relay`.
    #[arg(long, env = "STARLING_RELAY_CREDENTIALS")]
    credentials: PathBuf,
    #[arg(long, default_value = "127.0.0.1:7443", env = "STARLING_RELAY_HUB")]
    hub: SocketAddr,
    /// Where actors of the region connect.
    #[arg(long, default_value = "0.0.0.0:7444", env = "STARLING_RELAY_LISTEN")]
    listen: SocketAddr,
    #[arg(long, default_value = "default", env = "STARLING_RELAY_REGION")]
    region: String,
    #[arg(long, default_value = "model", env = "STARLING_RELAY_MODEL_ID")]
    model_id: String,
    /// Cache versions after this one.
    #[arg(long, default_value_t = 0)]
    from_version: u64,
    /// WAN rate to the hub in Mbit/s (sizes receive windows to the bandwidth-delay product).
    #[arg(long, default_value_t = 1000.0)]
    wan_mbit: f64,
    /// WAN round-trip time to the hub in milliseconds.
    #[arg(long, default_value_t = 50)]
    wan_rtt_ms: u64,
    /// Streams each version is striped over, per actor.
    #[arg(long, default_value_t = 4)]
    stripes: u16,
    /// Disk cache of complete versions (survives restarts).
    #[arg(long, env = "STARLING_RELAY_CACHE")]
    cache: Option<PathBuf>,
    /// Serve `/metrics` and `/v1/status` here.
    #[arg(long, env = "STARLING_RELAY_HTTP")]
    http: Option<SocketAddr>,
    /// Versions kept in memory for laggards and late joiners.
    #[arg(long, default_value_t = 32)]
    retain: usize,
    /// Measure the control round trip to the hub this often (milliseconds).
    #[arg(long, default_value_t = 1000)]
    ping_ms: u64,
    /// Print each control round trip as `rtt-us MICROS` (benchmarks).
    #[arg(long)]
    print_rtt: bool,
    /// Most live subscription connections one actor certificate may hold (a reconnect may
    /// overlap its dead predecessor until the idle timeout); more are refused
    /// (TooManyConnections) and closed; the
    /// refused actor asks again for up to 10 s before it takes the hub.
    #[arg(long, default_value_t = starling_transport::connections::DEFAULT_MAX)]
    subscriber_connections: usize,
    #[command(flatten)]
    log: starling_process::logging::LogArgs,
}

/// Parses `args` (the first is the program name) and runs until the process is stopped.
/// The `starling-relay` binary calls it; `starling-hub demo` runs the same in child processes of
/// its own binary, so `cargo run -p starling-hub -- demo` needs no other binary.
pub fn main_from<I, T>(args: I) -> std::process::ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let a = Args::parse_from(args);
    if let Err(e) = starling_process::logging::init(&a.log) {
        eprintln!("error: {}", starling_process::error_chain(&e));
        return std::process::ExitCode::from(2);
    }
    if !(a.wan_mbit.is_finite() && a.wan_mbit > 0.0) {
        eprintln!(
            "error: --wan-mbit must be a positive number of Mbit/s, not {}",
            a.wan_mbit
        );
        return std::process::ExitCode::from(2);
    }
    if a.subscriber_connections == 0 {
        eprintln!("error: --subscriber-connections must be at least 1");
        return std::process::ExitCode::from(2);
    }
    let cfg = crate::RelayConfig {
        credentials: a.credentials,
        hub: a.hub,
        listen: a.listen,
        region: a.region,
        model_id: a.model_id,
        from_version: a.from_version,
        wan: LinkProfile {
            rate_bps: (a.wan_mbit * 1e6) as u64,
            rtt: Duration::from_millis(a.wan_rtt_ms),
        },
        lan: LinkProfile::LAN,
        stripes: a.stripes,
        cache: a.cache,
        http: a.http,
        retain: a.retain,
        ping: Duration::from_millis(a.ping_ms.max(1)),
        print_rtt: a.print_rtt,
        subscriber_connections: a.subscriber_connections,
    };
    starling_process::service::run_service(|stop| crate::run(cfg, stop))
}
