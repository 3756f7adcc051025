//! The real run's vLLM server: one per `starling demo --model … --vllm` invocation, started
//! before the first cluster and shared by every mode of a `--compare`.
//!
//! vLLM's CPU build takes ~110 s to start on 2 cores; each mode's cluster used to have its
//! vLLM actor start a server of its own (`--vllm-cmd`). Now the demo starts one, from the
//! imported model directory (version 0), and each mode's vLLM actor attaches to it with
//! `--vllm-url` alone: the actor digests what the server holds (`starling_attach`) and, when
//! that is not its version 0 (the previous mode left its last version there), loads version 0
//! in full (`starling_load_full`) and checks the digest again before it takes any work
//! (`actor/src/vllm.rs`, `bring_up`).
//!
//! Invariants:
//! - The server listens on 127.0.0.1 only (its dev routes carry no authentication).
//! - The extension reads and writes files only under `STARLING_VLLM_ROOT`, set to the run's
//!   output directory: every mode's actor store (`OUT/rN-MODE/regions/…/vllm`, its patches
//!   and materialized versions) lies under it, and nothing else of this machine does.
//! - The server is a [`Proc`] leading its own process group: dropped (end of the run, an
//!   error) or on the demo's SIGTERM/SIGINT (`procs::stop_children_on_signal`), SIGTERM goes
//!   to the whole group, then SIGKILL after the grace period. No engine process outlives the
//!   demo.
//! - One vLLM actor per cluster at a time: two actors driving one server would patch each
//!   other's weights.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use starling_telemetry::http_client::{self, Limits};

use crate::cluster::free_tcp_port;
use crate::procs::{Proc, tail};

/// What the vLLM server needs.
#[derive(Debug, Clone)]
pub(crate) struct VllmSetup {
    /// A Python with vLLM's CPU build.
    pub(crate) python: PathBuf,
    /// The directory that holds the `starling_vllm` extension package.
    pub(crate) extension: PathBuf,
    /// vLLM's `--max-num-seqs`.
    pub(crate) max_num_seqs: u32,
}

/// A running vLLM server with Starling's worker extension; dropping it stops its process
/// group.
#[derive(Debug)]
pub(crate) struct VllmServer {
    /// `127.0.0.1:PORT`, what an actor's `--vllm-url` names.
    pub(crate) addr: SocketAddr,
    proc: Proc,
}

/// The longest the server may take to answer `/health` (it loads the model and warms up:
/// ~110 s on 2 busy cores).
const START_TIMEOUT: Duration = Duration::from_secs(900);

impl VllmServer {
    /// Starts vLLM on `model` (version 0) with the extension confined to `root`, its output
    /// in `log`, and waits for `/health`.
    pub(crate) fn start(setup: &VllmSetup, model: &Path, root: &Path, log: &Path) -> Result<Self> {
        let addr = free_tcp_port()?;
        let mut cmd = Command::new(&setup.python);
        cmd.env("VLLM_SERVER_DEV_MODE", "1")
            .env("PYTHONPATH", &setup.extension)
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_LOGGING_LEVEL", "WARNING")
            .env("STARLING_VLLM_ROOT", root)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
            .args([
                "--enforce-eager",
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "1024",
            ])
            .args(["--max-num-seqs", &setup.max_num_seqs.to_string()])
            .args(["--seed", "0", "--logprobs-mode", "processed_logprobs"])
            // Sampling as the job says, not as the model's generation_config.json would.
            .args(["--generation-config", "vllm"])
            .args([
                "--worker-extension-cls",
                "starling_vllm.extension.StarlingWorkerExtension",
            ]);
        let t = Instant::now();
        let mut proc = Proc::spawn_group("vLLM", cmd, log)?;
        println!(
            "   vLLM: starting one server for the whole run at http://{addr} (output in {})",
            log.display()
        );
        let deadline = t + START_TIMEOUT;
        loop {
            proc.check_alive().context("vLLM exited during start-up")?;
            if healthy(addr) {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "vLLM did not answer /health at {addr} within {} s; the end of {}:\n{}",
                    START_TIMEOUT.as_secs(),
                    log.display(),
                    tail(log, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        println!("   vLLM: ready ({:.0} s)", t.elapsed().as_secs_f64());
        Ok(Self { addr, proc })
    }

    /// Fails, with the end of its log, if the server has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        self.proc.check_alive()
    }
}

/// Whether the server answers `GET /health` with a success.
fn healthy(addr: SocketAddr) -> bool {
    http_client::request(
        &addr.to_string(),
        "GET",
        "/health",
        &[],
        None,
        Limits::timeout(Duration::from_secs(5)),
    )
    .is_ok_and(|r| r.ok())
}
