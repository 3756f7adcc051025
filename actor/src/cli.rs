//! `starling-actor`'s command line: parses it and runs the actor until the hub goes away or
//! the process is stopped.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

/// Starling actor: keeps a local copy of the policy's weights in step with the hub, applying
/// each signed delta only after verifying all of it.
#[derive(Parser, Debug)]
#[command(name = "starling-actor", version)]
struct Args {
    /// Credentials directory written by `starling-hub issue --role actor`.
    #[arg(long, env = "STARLING_ACTOR_CREDENTIALS")]
    credentials: PathBuf,
    /// The hub's QUIC address (the last resort when no relay answers).
    #[arg(long, default_value = "127.0.0.1:7443", env = "STARLING_ACTOR_HUB")]
    hub: SocketAddr,
    /// A relay of this actor's region, as NAME@ADDR (repeatable; tried in order, before the hub).
    #[arg(long = "relay", env = "STARLING_ACTOR_RELAYS", value_delimiter = ',')]
    relays: Vec<String>,
    /// Checkpoint to start from when the store holds none yet: a safetensors file, or a model
    /// directory (e.g. one `starling model import` wrote).
    #[arg(long, env = "STARLING_ACTOR_INIT")]
    init: PathBuf,
    /// Directory for the active weights (survives restarts).
    #[arg(long, default_value = "actor-store", env = "STARLING_ACTOR_STORE")]
    store: PathBuf,
    #[arg(long, default_value = "default", env = "STARLING_ACTOR_REGION")]
    region: String,
    #[arg(long, default_value = "model", env = "STARLING_ACTOR_MODEL_ID")]
    model_id: String,
    /// Serve `/metrics` and `/v1/status` here.
    #[arg(long, env = "STARLING_ACTOR_HTTP")]
    http: Option<SocketAddr>,
    /// Generate rollouts: `builtin` (the CPU engine), `vllm` (a vLLM server with Starling's
    /// worker extension, docs/vllm.md) or `none` (hold weights only).
    #[arg(long, default_value = "none", env = "STARLING_ACTOR_ENGINE")]
    engine: String,
    /// The model's HF config.json (default: config.json in --init when it is a model
    /// directory, else beside it). The vLLM engine also copies the tokenizer files found
    /// beside it (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    /// generation_config.json, chat_template.jinja), so vLLM serves the model with its own
    /// tokenizer.
    #[arg(long, env = "STARLING_ACTOR_MODEL_CONFIG")]
    model_config: Option<PathBuf>,
    /// Sequences the engine decodes together.
    #[arg(long, default_value_t = 32, env = "STARLING_ACTOR_MAX_BATCH")]
    max_batch: u32,
    /// Groups claimed per generation call.
    #[arg(long, default_value_t = 4, env = "STARLING_ACTOR_CLAIM")]
    claim: u32,
    /// Run the engine this many times slower than it can (≥ 1), to emulate slower hardware
    /// in benchmarks.
    #[arg(long, default_value_t = 1.0, env = "STARLING_ACTOR_ENGINE_SLOWDOWN")]
    engine_slowdown: f64,
    /// No weight transfer: read version V's full checkpoint from DIR/vVVVVVVVV.safetensors
    /// (a shared filesystem) instead of receiving deltas; relays are not used. The baseline
    /// that benchmarks measure delta distribution against; not for production.
    #[arg(long, env = "STARLING_ACTOR_WEIGHTS_DIR")]
    weights_dir: Option<PathBuf>,
    /// With `--engine vllm`: the vLLM server's address (HOST:PORT).
    #[arg(
        long,
        default_value = "127.0.0.1:8000",
        env = "STARLING_ACTOR_VLLM_URL"
    )]
    vllm_url: String,
    /// With `--engine vllm`: the command that starts vLLM (`sh -c`; `{model}` becomes the
    /// directory the actor writes its version to). Without it the actor attaches to a server
    /// already running at --vllm-url.
    #[arg(long, env = "STARLING_ACTOR_VLLM_CMD")]
    vllm_cmd: Option<String>,
    /// With `--engine vllm`: how vLLM writes a version in place: auto, scatter or loader.
    #[arg(long, default_value = "auto", env = "STARLING_ACTOR_VLLM_APPLY")]
    vllm_apply: String,
    /// With `--engine vllm --vllm-cmd`: the longest vLLM may take to start (seconds).
    #[arg(long, default_value_t = 900)]
    vllm_start_timeout_s: u64,
    /// With `--engine vllm`: allow a vLLM server that is not on loopback. Its dev routes
    /// (/collective_rpc, /pause) carry no authentication: anyone who reaches them can swap
    /// its weights. Without this, --vllm-url must be a loopback address and a started server
    /// is bound to it.
    #[arg(long, env = "STARLING_ACTOR_VLLM_ALLOW_REMOTE")]
    vllm_allow_remote: bool,
    /// With `--engine vllm`: every this many seconds while no generation runs (and at the
    /// first commit after it), vLLM digests all its parameters and the actor compares the
    /// digest with the version it proved; a mismatch fences vLLM and reloads the committed
    /// version. O(model) in vLLM (~0.1 µs per parameter on a CPU), so the interval also
    /// grows to 20 times the last check's duration (at most 5% of vLLM's time); 0 turns it
    /// off.
    #[arg(long, default_value_t = 60.0, env = "STARLING_ACTOR_VLLM_VERIFY_EVERY")]
    vllm_verify_every: f64,
    /// A label for this actor's hardware, reported to the hub.
    #[arg(long, default_value = "cpu", env = "STARLING_ACTOR_HARDWARE")]
    hardware: String,
    #[command(flatten)]
    log: starling_process::logging::LogArgs,
}

/// Parses `args` (the first is the program name) and runs until the process is stopped.
/// The `starling-actor` binary calls it; `starling-hub demo` runs the same in child processes of
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
    let mut sources = Vec::new();
    for r in &a.relays {
        let parsed = r
            .split_once('@')
            .and_then(|(n, addr)| addr.parse::<SocketAddr>().ok().map(|addr| (n, addr)));
        let Some((name, addr)) = parsed else {
            eprintln!("error: --relay {r:?} is not NAME@ADDR");
            return std::process::ExitCode::from(2);
        };
        sources.push(crate::Source {
            role: starling_transport::identity::Role::Relay,
            name: name.to_owned(),
            addr,
        });
    }
    sources.push(crate::Source {
        role: starling_transport::identity::Role::Hub,
        name: "hub".into(),
        addr: a.hub,
    });
    let vllm = (a.engine == "vllm").then(|| crate::vllm::VllmSettings {
        addr: a
            .vllm_url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned(),
        cmd: a.vllm_cmd.clone(),
        apply_mode: a.vllm_apply.clone(),
        start_timeout: std::time::Duration::from_secs(a.vllm_start_timeout_s),
        allow_remote: a.vllm_allow_remote,
        verify_every: (a.vllm_verify_every.is_finite() && a.vllm_verify_every > 0.0)
            .then(|| std::time::Duration::from_secs_f64(a.vllm_verify_every.min(1e9))),
    });
    let engine = match a.engine.as_str() {
        "none" => None,
        "builtin" | "vllm" => Some(crate::EngineSettings {
            // --init is a model directory (config.json in it) or a checkpoint file (config.json
            // beside it).
            model_config: a.model_config.clone().unwrap_or_else(|| {
                if a.init.is_dir() {
                    a.init.join("config.json")
                } else {
                    a.init
                        .parent()
                        .map(|d| d.join("config.json"))
                        .unwrap_or_else(|| PathBuf::from("config.json"))
                }
            }),
            max_batch: a.max_batch,
            claim: a.claim,
            slowdown: a.engine_slowdown,
            hardware: a.hardware.clone(),
            vllm,
        }),
        other => {
            eprintln!("error: --engine {other:?} is not known: use builtin, vllm or none");
            return std::process::ExitCode::from(2);
        }
    };
    let cfg = crate::ActorConfig {
        credentials: a.credentials,
        sources,
        init: a.init,
        store: a.store,
        region: a.region,
        model_id: a.model_id,
        link: starling_transport::link::LinkProfile::LAN,
        http: a.http,
        engine,
        weights_dir: a.weights_dir,
    };
    starling_process::service::run_service(|stop| crate::run(cfg, stop))
}
