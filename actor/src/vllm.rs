//! The `vllm` engine: the actor drives a vLLM server beside it that runs Starling's worker
//! extension (`integrations/vllm`), following the interface agreed in `docs/vllm.md`.
//!
//! - **Weights in place.** Each committed version reaches vLLM as a patch file in the actor's
//!   store (`STORE/vllm/patch-N.safetensors`: per changed tensor its flat positions and new
//!   BF16 bits, the manifest's pre and post digests) applied by `starling_apply` between
//!   `POST /pause?mode=wait` and `POST /resume`. vLLM's answer carries the state digest it
//!   computed from its own parameters after the write; the version becomes the engine's only
//!   if that equals the digest the actor committed. Anything else (a refusal, a partial write,
//!   an HTTP error) fences the engine — its fingerprint is withdrawn, so the worker takes no
//!   work — and falls back to a full reload (`starling_load_full` of the committed weights,
//!   written once as `STORE/vllm/model/model.safetensors`), then to restarting the server.
//! - **Generation.** One streamed `POST /v1/completions` per job, with the prompt's token
//!   ids, `n` samples, the job's sampling parameters and seed, one log-probability per token
//!   and token ids back (`return_tokens_as_token_ids`). A call's jobs are sent side by side,
//!   up to `--max-batch` sequences in flight (`concurrent_jobs.rs`) shared with the next
//!   call, which the worker overlaps with it, so vLLM batches them continuously; each streamed token counts in the job's progress as it arrives
//!   (`completion_stream.rs`), which keeps a long generation's lease alive. A stream
//!   silent for [`GENERATE_IDLE`] is given up; there is no bound on a generation's length as
//!   such, only a generous one per token. Loads take the swap lock for writing and
//!   `generate` for reading, so a call never spans two versions: every sample's tokens carry
//!   one version.
//! - **The server.** With `--vllm-cmd` the actor starts vLLM itself (`{model}` in the command
//!   is replaced by the directory holding the actor's committed version). A load does not
//!   wait for the server to come up: it returns [`StillStarting`], and the actor asks again
//!   each second while its pipeline goes on staging and committing versions (a start takes
//!   tens of seconds here, minutes for a large model). Once `/health` answers, it attaches
//!   (`starling_attach`: vLLM digests all its parameters) and checks the
//!   digest; a server that exits is noticed (`needs_reload`) and started again from the
//!   actor's weights before the worker takes work again. With `--vllm-url` alone it attaches
//!   to a running server (resuming it first if an actor stopped between pause and resume left
//!   it paused) and, if that holds another version (the extension's `starling_status` says
//!   so, or attach's digest differs), loads the actor's in full. A full load
//!   runs between pause and resume as a patch does: the pause clears vLLM's prefix cache,
//!   whose blocks were computed with the weights being replaced.
//!
//! - **Who can reach it.** vLLM's dev routes carry no authentication, so the server stays on
//!   loopback: `--vllm-url` must be a loopback address and a started server is given `--host`
//!   of that address when its command names none (another host is refused), unless
//!   `--vllm-allow-remote`. The extension reads and writes files only under `STORE/vllm`
//!   (`STARLING_VLLM_ROOT`, set for the server the actor starts).
//! - **Kept honest.** Every `--vllm-verify-every` seconds while no generation runs, and at the
//!   first commit after that interval, the actor has vLLM digest all its parameters
//!   (`starling_fingerprint`) and compares with the version it proved; a mismatch (weights
//!   changed behind its back) fences the engine and reloads the committed version.
//!
//! Every failure becomes a sentence that says what to fix: no server at the address, a server
//! without `VLLM_SERVER_DEV_MODE=1` (its dev routes answer 404), a server without the
//! extension, a model whose parameters do not map, a patch for another model or base.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use starling_checkpoint::writer::SafetensorsWriter;
use starling_engine::ModelConfig;
use starling_proto::delta::apply::UndoLog;
use starling_proto::delta::manifest::{hex, parse_hex};
use starling_proto::protocol::rollout::{FinishReason, JobResult, JobSpec, Sample};
use starling_telemetry::http_client::{self, DEFAULT_BODY_LIMIT, Limits, Response};

use crate::completion_stream::{CompletionStream, StreamError};
use crate::concurrent_jobs::{SequenceBudget, run_within};
use crate::engine::{
    Capabilities, Engine, Fingerprint, JobProgress, StillStarting, group_seed, whole_span,
};

/// How the actor reaches (and possibly runs) its vLLM server.
#[derive(Debug, Clone)]
pub struct VllmSettings {
    /// `host:port` of vLLM's OpenAI-compatible server.
    pub addr: String,
    /// The command that starts vLLM (run with `sh -c`; `{model}` is replaced by the model
    /// directory the actor writes). None: attach to a server someone else runs.
    pub cmd: Option<String>,
    /// `starling_apply`'s mode: `auto`, `scatter` or `loader` (`docs/vllm.md`).
    pub apply_mode: String,
    /// The longest a started server may take to answer `/health`.
    pub start_timeout: Duration,
    /// Allow a server that is not on loopback (its dev routes are unauthenticated).
    pub allow_remote: bool,
    /// How often vLLM's whole digest is checked against the proven version (none: never).
    pub verify_every: Option<Duration>,
}

/// The environment variable naming the only directory the extension reads and writes files in.
const ROOT_ENV: &str = "STARLING_VLLM_ROOT";

/// The host of `host:port` (brackets of an IPv6 address removed).
fn host_of(addr: &str) -> &str {
    let host = match addr.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The value of `--host` in a command line, if it names one.
fn host_arg(cmd: &str) -> Option<&str> {
    flag_value(cmd, "--host")
}

/// The value of `flag` in a command line (`--flag v` or `--flag=v`), if it names one.
fn flag_value<'a>(cmd: &'a str, flag: &str) -> Option<&'a str> {
    let mut words = cmd.split_whitespace();
    while let Some(w) = words.next() {
        if w == flag {
            return words.next();
        }
        if let Some(v) = w.strip_prefix(flag).and_then(|v| v.strip_prefix('=')) {
            return Some(v);
        }
    }
    None
}

/// The sequences the actor keeps in flight on vLLM: `--max-batch`, but no more than the
/// `--max-num-seqs` a started server runs at once. A request beyond that waits in vLLM's
/// queue, streaming nothing, and a long wait there would be taken for a hung server
/// ([`GENERATE_IDLE`]). Once a server answers, what it says it runs at once lowers this
/// further ([`VllmEngine::fit_budget_to_server`]): the only way to learn an attached
/// server's setting, or vLLM's default where the command names none.
fn sequence_budget(max_batch: u32, cmd: Option<&str>) -> u32 {
    let runs = cmd
        .and_then(|c| flag_value(c, "--max-num-seqs"))
        .and_then(|v| v.parse::<u32>().ok());
    match runs {
        Some(runs) if runs < max_batch => {
            tracing::info!(
                "--max-batch {max_batch} is above the --max-num-seqs {runs} that --vllm-cmd \
                 gives vLLM: keeping {runs} sequences in flight"
            );
            runs.max(1)
        }
        _ => max_batch.max(1),
    }
}

/// A server started from `--vllm-cmd` is given `--generation-config vllm` unless the command
/// names one: with vLLM's default (`auto`) the model's `generation_config.json` fills every
/// sampling parameter a request leaves out (`top_k`, `repetition_penalty`, …) and adds its
/// stop tokens to every request's, so a vLLM actor would sample differently from the job's
/// parameters and from a built-in actor, silently.
const NEUTRAL_GENERATION_CONFIG: &str = "--generation-config vllm";

/// One part of what a commit wrote: where it starts in a tensor, positions relative to that and
/// the new bits there.
type WrittenPart<'a> = (u64, &'a [u32], &'a [u16]);

/// The files of a model directory besides its weights and config that vLLM reads
/// (`special_tokens_map.json` overrides `tokenizer_config.json`'s special tokens in
/// transformers, which tokenizes for vLLM).
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// Requests that touch weights or digest the whole model may take this long, at least
/// ([`VllmEngine::rpc_timeout`] adds [`RPC_TIME_PER_PARAMETER`] for each parameter to the
/// `/collective_rpc` calls; `/pause` and `/resume` digest nothing and keep this bound).
const RPC_TIMEOUT: Duration = Duration::from_secs(600);
/// What a whole-model digest in the extension may take per parameter, with a margin: it
/// measured ~0.1 µs on 2 CPU cores (14 s for 135 M), so an 8B model's takes ~15 minutes,
/// beyond the fixed bound.
const RPC_TIME_PER_PARAMETER: Duration = Duration::from_nanos(250);
/// A streamed completion that sends nothing for this long is given up: vLLM hung, or a
/// request waited in its queue that long (the engine keeps its requests within `--max-batch`
/// sequences, but vLLM also admits and preempts sequences by the KV cache's free blocks, so a
/// request can wait under memory pressure). Prefilling a long prompt on a slow server fits
/// well inside it.
pub const GENERATE_IDLE: Duration = Duration::from_secs(600);
/// What a completion may take in all, beyond [`GENERATE_TIME_PER_TOKEN`] per new token: the
/// prompt's prefill and the wait for a slot.
const GENERATE_BASE: Duration = Duration::from_secs(600);
/// What each of a sample's new tokens may take at most (4 tokens/s per sequence, far below
/// any server that keeps up with RL): a bound for a server that trickles, not a pace.
const GENERATE_TIME_PER_TOKEN: Duration = Duration::from_millis(250);
/// A generous bound on what one generated token costs in a streamed completion: an event of
/// its own (the answer's id, the model's name, the token as `token_id:N`, its
/// log-probability, its top log-probabilities, its text offset and text), about 300 bytes
/// plus the model's name in vLLM's answers.
const STREAMED_BYTES_PER_TOKEN: u64 = 1024;

/// The longest a completion of `max_new_tokens` new tokens per sample may take.
fn completion_timeout(max_new_tokens: u32) -> Duration {
    GENERATE_BASE.saturating_add(GENERATE_TIME_PER_TOKEN.saturating_mul(max_new_tokens))
}

/// The most bytes read of a streamed completion of `n` samples of at most `max_new_tokens`
/// tokens each, served as `served`: every token at [`STREAMED_BYTES_PER_TOKEN`] plus the
/// name, plus the default body limit for the rest.
fn completion_limit(n: u32, max_new_tokens: u32, served: &str) -> u64 {
    u64::from(n)
        .saturating_mul(u64::from(max_new_tokens))
        .saturating_mul(STREAMED_BYTES_PER_TOKEN.saturating_add(served.len() as u64))
        .saturating_add(DEFAULT_BODY_LIMIT)
}

/// What the engine holds now.
#[derive(Debug, Default)]
struct Held {
    /// The server the actor started (with `--vllm-cmd`).
    child: Option<Child>,
    /// Set from the child's start until it first answers `/health`.
    starting: Option<Starting>,
    /// The model name the server serves (its `--served-model-name`, by default `--model`).
    served: Option<String>,
}

/// A server started and not yet answering.
#[derive(Debug, Clone, Copy)]
struct Starting {
    /// When it is given up ([`VllmSettings::start_timeout`] after its start).
    deadline: Instant,
    /// The version it was started from (materialized in the model directory).
    version: u64,
}

/// The `vllm` engine.
#[derive(Debug)]
pub struct VllmEngine {
    settings: VllmSettings,
    model_id: String,
    config: ModelConfig,
    /// `STORE/vllm`: patch files and the materialized model directory.
    dir: PathBuf,
    /// The sequences in flight on vLLM, shared by the generation calls that overlap.
    budget: SequenceBudget,
    held: Mutex<Held>,
    /// The version vLLM's parameters hold, proven by its digest; none while fenced. Apart
    /// from `held`, which a load keeps for minutes while a server starts: status reads and
    /// the worker's heartbeats never wait for that.
    proven: Mutex<Option<Fingerprint>>,
    /// Taken for reading by `generate`, for writing by `load`.
    swap: RwLock<()>,
    /// When vLLM's whole digest was last found equal to the proven version's.
    verified_at: Mutex<Instant>,
    /// What the last periodic check took: the next is due no sooner than
    /// [`VERIFY_DUTY`] times that, so checking costs at most 1/VERIFY_DUTY of the engine's
    /// time whatever the model's size (a whole digest is O(model): ~14 s for 135 M
    /// parameters on 2 CPU cores, minutes for a 70B model digested on the host).
    verify_cost: Mutex<Duration>,
}

/// The periodic digest check takes at most 1/20 of vLLM's time.
const VERIFY_DUTY: u32 = 20;

/// How long a look at a starting server's `/health` may take: the look is made on the
/// actor's weight pipeline, once a second, until the server answers.
const START_POLL_TIMEOUT: Duration = Duration::from_secs(1);

impl VllmEngine {
    /// An engine for the model of `model_config` (HF `config.json`, copied beside the weights
    /// the server loads), keeping its files under `store/vllm`. Nothing is started yet: the
    /// first [`Engine::load`] starts or attaches to the server.
    pub fn new(
        settings: VllmSettings,
        model_config: &Path,
        model_id: &str,
        store: &Path,
        max_batch: u32,
    ) -> Result<Self> {
        let config = ModelConfig::from_file(model_config)
            .with_context(|| format!("read {}", model_config.display()))?;
        let dir = store.join("vllm");
        std::fs::create_dir_all(dir.join("model"))
            .with_context(|| format!("create {}", dir.display()))?;
        std::fs::copy(model_config, dir.join("model/config.json"))
            .with_context(|| format!("copy {} beside the model", model_config.display()))?;
        // The tokenizer files of a real model go with it: vLLM tokenizes chat prompts and
        // decodes with its own tokenizer (a generated model has none; vLLM then runs with
        // --skip-tokenizer-init).
        if let Some(src) = model_config.parent() {
            for name in TOKENIZER_FILES {
                let (from, to) = (src.join(name), dir.join("model").join(name));
                if from.exists() {
                    std::fs::copy(&from, &to)
                        .with_context(|| format!("copy {} beside the model", from.display()))?;
                } else {
                    let _ = std::fs::remove_file(&to);
                }
            }
        }
        let host = host_of(&settings.addr);
        if !settings.allow_remote && !is_loopback(host) {
            bail!(
                "--vllm-url {} is not a loopback address: vLLM's dev routes (/collective_rpc, \
                 /pause) carry no authentication, so the actor keeps vLLM on 127.0.0.1 beside \
                 it; pass --vllm-allow-remote only if that network is yours alone",
                settings.addr
            );
        }
        if let Some(h) = settings.cmd.as_deref().and_then(host_arg)
            && !settings.allow_remote
            && !is_loopback(h)
        {
            bail!(
                "--vllm-cmd binds vLLM to --host {h}: its dev routes carry no authentication; \
                 leave --host out (the actor binds it to {host}) or pass --vllm-allow-remote"
            );
        }
        if !["auto", "scatter", "loader"].contains(&settings.apply_mode.as_str()) {
            bail!(
                "--vllm-apply must be auto, scatter or loader, not {:?}",
                settings.apply_mode
            );
        }
        let max_batch = sequence_budget(max_batch, settings.cmd.as_deref());
        Ok(Self {
            settings,
            model_id: model_id.to_owned(),
            config,
            dir,
            budget: SequenceBudget::new(max_batch),
            held: Mutex::new(Held::default()),
            proven: Mutex::new(None),
            swap: RwLock::new(()),
            verified_at: Mutex::new(Instant::now()),
            verify_cost: Mutex::new(Duration::ZERO),
        })
    }

    /// How long a request that touches weights or digests the whole model may take: the
    /// fixed bound plus the digest's time for this model's parameters.
    fn rpc_timeout(&self) -> Duration {
        let params = u32::try_from(self.config.parameter_count() / 1_000_000).unwrap_or(u32::MAX);
        RPC_TIMEOUT + RPC_TIME_PER_PARAMETER * 1_000_000 * params
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn proven(&self) -> Option<Fingerprint> {
        *self
            .proven
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_proven(&self, fp: Option<Fingerprint>) {
        *self
            .proven
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fp;
    }

    fn model_dir(&self) -> PathBuf {
        self.dir.join("model")
    }

    /// The committed weights the server loads at its start ([`VllmEngine::materialize`]).
    fn model_file(&self) -> PathBuf {
        self.model_dir().join("model.safetensors")
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        limits: Limits,
    ) -> Result<Response> {
        let body = body.map(Value::to_string);
        http_client::request(
            &self.settings.addr,
            method,
            path,
            &[],
            body.as_deref(),
            limits,
        )
        .with_context(|| {
            format!(
                "{method} {path}: no answer from the vLLM server at {}",
                self.settings.addr
            )
        })
    }

    /// `POST /collective_rpc`: every worker's answer, each required `ok`.
    fn rpc(&self, method: &str, args: &[&str]) -> Result<Vec<Value>> {
        let r = self.call(
            "POST",
            "/collective_rpc",
            Some(&json!({"method": method, "args": args})),
            Limits::timeout(self.rpc_timeout()),
        )?;
        if r.status == 404 {
            bail!(
                "vLLM at {} has no /collective_rpc route: start it with VLLM_SERVER_DEV_MODE=1",
                self.settings.addr
            );
        }
        if !r.ok() {
            if r.body.contains("has no attribute 'starling_") {
                bail!(
                    "vLLM at {} runs without Starling's worker extension: start it with \
                     --worker-extension-cls starling_vllm.extension.StarlingWorkerExtension \
                     (integrations/vllm on its PYTHONPATH)",
                    self.settings.addr
                );
            }
            bail!(
                "vLLM answered {} to {method}: {}",
                r.status,
                r.body.chars().take(400).collect::<String>()
            );
        }
        let v: Value = serde_json::from_str(&r.body).context("vLLM's answer is not JSON")?;
        let results = v["results"]
            .as_array()
            .filter(|a| !a.is_empty())
            .with_context(|| format!("vLLM's answer to {method} has no results"))?
            .clone();
        for w in &results {
            if w["ok"].as_bool() != Some(true) {
                bail!(
                    "{method} failed in vLLM{}: {}",
                    if w["fenced"].as_bool() == Some(true) {
                        " (weights may be partly written)"
                    } else {
                        " (nothing was changed)"
                    },
                    w["error"].as_str().unwrap_or("no reason given")
                );
            }
        }
        Ok(results)
    }

    /// The digest every worker reports (one worker at tensor parallelism 1).
    fn digest_of(results: &[Value]) -> Result<[u8; 16]> {
        let hex_digest = results[0]["digest"]
            .as_str()
            .context("vLLM's answer has no digest")?;
        parse_digest(hex_digest)
    }

    /// Whether the server answers `/health`, and has the dev routes the actor needs.
    fn healthy(&self) -> bool {
        self.answers_health(Duration::from_secs(5))
    }

    fn answers_health(&self, timeout: Duration) -> bool {
        self.call("GET", "/health", None, Limits::timeout(timeout))
            .is_ok_and(|r| r.ok())
    }

    /// Probes the dev routes (`GET /is_paused`) and answers whether generation is paused.
    fn probe_dev_routes(&self) -> Result<bool> {
        let r = self.call(
            "GET",
            "/is_paused",
            None,
            Limits::timeout(Duration::from_secs(30)),
        )?;
        if r.status == 404 {
            bail!(
                "vLLM at {} has no /is_paused route: start it with VLLM_SERVER_DEV_MODE=1 (the \
                 actor pauses generation around each weight update)",
                self.settings.addr
            );
        }
        let v: Value = serde_json::from_str(&r.body).context("/is_paused is not JSON")?;
        Ok(v["is_paused"].as_bool() == Some(true))
    }

    fn resume(&self) -> Result<()> {
        let r = self.call("POST", "/resume", None, Limits::timeout(RPC_TIMEOUT))?;
        if !r.ok() {
            bail!("vLLM did not resume ({}): {}", r.status, r.body.trim());
        }
        Ok(())
    }

    /// Writes the committed weights where the server loads them from: one safetensors file
    /// with the version in its metadata, beside `config.json`. O(model): at start-up, after a
    /// server death, and for a full reload.
    fn materialize(&self, weights: &BTreeMap<String, Vec<u16>>, version: u64) -> Result<PathBuf> {
        let layout: Vec<(String, Vec<u64>)> = self
            .config
            .tensor_shapes()
            .into_iter()
            .map(|(n, s)| (n, s.into_iter().map(|d| d as u64).collect()))
            .collect();
        let path = self.model_file();
        let mut out = SafetensorsWriter::create(&path, &layout, Some(version))
            .with_context(|| format!("create {}", path.display()))?;
        for (name, _) in &layout {
            let bits = weights
                .get(name)
                .with_context(|| format!("the actor's weights have no tensor {name}"))?;
            out.write(bits)
                .with_context(|| format!("write {}", path.display()))?;
        }
        out.finish()
            .with_context(|| format!("write {}", path.display()))?;
        Ok(path)
    }

    /// Starts the server with `--vllm-cmd` on the materialized `version`, without waiting for
    /// it ([`VllmEngine::started`] says when it answers).
    fn spawn(&self, held: &mut Held, version: u64) -> Result<()> {
        let Some(cmd) = &self.settings.cmd else {
            bail!(
                "no vLLM server answers at {} and the actor has no --vllm-cmd to start one",
                self.settings.addr
            );
        };
        let mut line = cmd.replace("{model}", &self.model_dir().display().to_string());
        if host_arg(&line).is_none() {
            // vLLM listens on every interface by default: not its unauthenticated dev routes.
            line.push_str(&format!(" --host {}", host_of(&self.settings.addr)));
        }
        if flag_value(&line, "--generation-config").is_none() {
            line.push(' ');
            line.push_str(NEUTRAL_GENERATION_CONFIG);
        }
        let log = std::fs::File::create(self.dir.join("vllm.log")).context("create vllm.log")?;
        let err = log.try_clone().context("vllm.log")?;
        tracing::info!(version, command = %line, "starting vLLM");
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {line}"))
            .env(ROOT_ENV, &self.dir)
            // Its own process group: vLLM runs its engine in child processes, and stopping
            // the server means stopping all of them.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .with_context(|| format!("start vLLM: {line}"))?;
        held.child = Some(child);
        held.starting = Some(Starting {
            deadline: Instant::now() + self.settings.start_timeout,
            version,
        });
        Ok(())
    }

    /// Whether the server started by [`VllmEngine::spawn`] answers `/health` now (then it is
    /// no longer starting). One that exited or did not answer within the start timeout is
    /// stopped, and that is the error.
    fn started(&self, held: &mut Held) -> Result<bool> {
        let Some(starting) = held.starting else {
            return Ok(true);
        };
        let exited = match held.child.as_mut() {
            Some(c) => c.try_wait().context("wait for vLLM")?,
            None => {
                held.starting = None;
                bail!("the vLLM server being started is gone")
            }
        };
        if let Some(status) = exited {
            Self::stop_child(held);
            bail!(
                "vLLM exited during start-up ({status}); its output is in {}",
                self.dir.join("vllm.log").display()
            );
        }
        if self.answers_health(START_POLL_TIMEOUT) {
            held.starting = None;
            return Ok(true);
        }
        if Instant::now() > starting.deadline {
            Self::stop_child(held);
            bail!(
                "vLLM did not answer /health at {} within {:?}; its output is in {}",
                self.settings.addr,
                self.settings.start_timeout,
                self.dir.join("vllm.log").display()
            );
        }
        Ok(false)
    }

    fn stop_child(held: &mut Held) {
        held.starting = None;
        if let Some(mut c) = held.child.take() {
            kill_group(&mut c);
        }
    }

    /// The model name the server answers to (`GET /v1/models`).
    fn served_name(&self) -> Result<String> {
        let r = self.call(
            "GET",
            "/v1/models",
            None,
            Limits::timeout(Duration::from_secs(30)),
        )?;
        let v: Value = serde_json::from_str(&r.body).context("/v1/models is not JSON")?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .context("vLLM serves no model")
    }

    /// Brings a server that holds nothing of ours (just started, or attached to) to the
    /// committed version: attach if it was started from it, else load it in full. A server
    /// that does not answer is started from the committed weights, and until it answers
    /// the call returns [`StillStarting`] at once.
    fn bring_up(
        &self,
        held: &mut Held,
        weights: &BTreeMap<String, Vec<u16>>,
        version: u64,
        digest: [u8; 16],
    ) -> Result<()> {
        self.set_proven(None);
        // The version the server was started from, when the actor started it.
        let started_from = match held.starting {
            Some(s) => Some(s.version),
            None if !self.healthy() => {
                self.materialize(weights, version)?;
                Self::stop_child(held);
                self.spawn(held, version)?;
                Some(version)
            }
            None => None,
        };
        if !self.started(held)? {
            return Err(StillStarting.into());
        }
        // The file the server was started from, when it holds the committed version (one
        // committed while the server started is written over it and loaded in full below).
        let materialized = started_from
            .filter(|&v| v == version)
            .map(|_| self.model_file());
        if self.probe_dev_routes()? {
            // Left paused by an actor stopped between pause and resume (a server attached to
            // outlives its actors): generation would wait forever. Whatever it wrote, the
            // attach digest below finds.
            tracing::warn!(addr = %self.settings.addr, "vLLM was paused; resuming it");
            self.resume()?;
        }
        held.served = Some(self.served_name()?);
        // The extension's own record (no digest computed); none from an older extension.
        let status = self.rpc("starling_status", &[]).ok();
        let status = status.as_ref().and_then(|r| r.first());
        self.fit_budget_to_server(status);
        let t = Instant::now();
        // A server attached to that says it holds another version (what the actor before
        // this one left), or one started from a version older than the committed one, is
        // loaded in full at once: that load is digested and checked, and attach's
        // whole-model digest (tens of seconds on 2 busy cores) would only confirm the
        // mismatch.
        let other = match started_from {
            Some(v) => v != version,
            None => status.is_some_and(|st| self.claims_other(st, digest)),
        };
        let load = other || {
            let version_s = version.to_string();
            let attached = self.rpc("starling_attach", &[&self.model_id, &version_s])?;
            Self::digest_of(&attached)? != digest
        };
        if load {
            // It holds another version: load ours.
            let path = match materialized {
                Some(p) => p,
                None => self.materialize(weights, version)?,
            };
            self.load_full(&path, version, digest)?;
        }
        tracing::info!(
            version,
            how = if load { "loaded in full" } else { "attached" },
            ms = t.elapsed().as_millis() as u64,
            "vLLM holds the actor's version"
        );
        // Attach and the full load both digested the whole model.
        self.whole_digest_checked();
        self.set_proven(Some(Fingerprint { version, digest }));
        Ok(())
    }

    /// Lowers the sequence budget to what the server says its scheduler runs at once
    /// (`starling_status`'s `max_num_seqs`). No answer, or an extension too old to say,
    /// leaves the budget as it is.
    fn fit_budget_to_server(&self, status: Option<&Value>) {
        let Some(runs) = status
            .and_then(|st| st["max_num_seqs"].as_u64())
            .and_then(|n| u32::try_from(n).ok())
        else {
            return;
        };
        let before = self.budget.max();
        if self.budget.lower_to(runs) {
            tracing::info!(
                "vLLM at {} runs at most {runs} sequences at once: keeping {} in flight, not \
                 {before}",
                self.settings.addr,
                self.budget.max()
            );
        }
    }

    /// Whether the extension's own record (`starling_status`) says the server holds
    /// something other than `digest`: another model or version, or a fenced state. A record
    /// without a digest: false (attach decides).
    fn claims_other(&self, st: &Value, digest: [u8; 16]) -> bool {
        if st["fenced"].as_bool() == Some(true) {
            return true;
        }
        match st["digest"].as_str().and_then(|d| parse_digest(d).ok()) {
            Some(held) => held != digest || st["model_id"].as_str() != Some(&self.model_id),
            None => false,
        }
    }

    fn whole_digest_checked(&self) {
        *self
            .verified_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }

    /// `starling_load_full` of a materialized checkpoint, checked against `digest`, between
    /// `POST /pause?mode=wait` and `POST /resume` as a patch is: the pause also clears vLLM's
    /// prefix cache, whose blocks hold keys and values computed with the weights being
    /// replaced (a server attached to after another run, which generated for the same
    /// prompts on other weights, would otherwise serve them).
    fn load_full(&self, path: &Path, version: u64, digest: [u8; 16]) -> Result<()> {
        let r = self.call(
            "POST",
            "/pause?mode=wait",
            None,
            Limits::timeout(RPC_TIMEOUT),
        )?;
        if !r.ok() {
            bail!("vLLM refused to pause ({}): {}", r.status, r.body.trim());
        }
        let (p, v) = (path.display().to_string(), version.to_string());
        let loaded = self.rpc("starling_load_full", &[&p, &self.model_id, &v]);
        let resumed = self.resume();
        let got = Self::digest_of(&loaded?)?;
        if got != digest {
            bail!(
                "vLLM holds digest {} after loading version {version} in full, not {}",
                hex(&got),
                hex(&digest)
            );
        }
        resumed
    }

    /// Writes the patch that turns `base` into `version` (`docs/vllm.md`), atomically.
    fn write_patch(&self, change: &UndoLog, version: u64, digest: [u8; 16]) -> Result<PathBuf> {
        let (base, pre) = change.base();
        let shapes: BTreeMap<String, Vec<usize>> =
            self.config.tensor_shapes().into_iter().collect();
        // A tensor's parts cover disjoint ranges: sorted by their first position, their
        // positions are ascending over the whole tensor.
        let mut by_tensor: BTreeMap<&str, Vec<WrittenPart<'_>>> = BTreeMap::new();
        for (tensor, start, positions, new) in change.written() {
            if !positions.is_empty() {
                by_tensor
                    .entry(tensor)
                    .or_default()
                    .push((start, positions, new));
            }
        }
        let mut tensors: Vec<(String, Vec<u8>, Vec<u8>, usize)> = Vec::new();
        let mut shape_json = serde_json::Map::new();
        for (tensor, mut parts) in by_tensor {
            parts.sort_by_key(|&(start, _, _)| start);
            let n: usize = parts.iter().map(|(_, p, _)| p.len()).sum();
            let mut idx = Vec::with_capacity(n * 8);
            let mut val = Vec::with_capacity(n * 2);
            for (start, p, v) in parts {
                for &i in p {
                    idx.extend_from_slice(&((start + u64::from(i)) as i64).to_le_bytes());
                }
                for &b in v {
                    val.extend_from_slice(&b.to_le_bytes());
                }
            }
            let shape = shapes
                .get(tensor)
                .with_context(|| format!("{tensor} is not in the model's config"))?;
            shape_json.insert(tensor.to_owned(), json!(shape));
            tensors.push((tensor.to_owned(), idx, val, n));
        }
        let mut metadata = std::collections::HashMap::new();
        metadata.insert("format".to_owned(), "starling-patch-v1".to_owned());
        metadata.insert("model_id".to_owned(), self.model_id.clone());
        metadata.insert("base_version".to_owned(), base.to_string());
        metadata.insert("starling_version".to_owned(), version.to_string());
        metadata.insert("pre_digest".to_owned(), hex(&pre.to_bytes()));
        metadata.insert("post_digest".to_owned(), hex(&digest));
        metadata.insert("shapes".to_owned(), Value::Object(shape_json).to_string());
        let mut views = Vec::new();
        for (name, idx, val, n) in &tensors {
            views.push((
                format!("{name}.indices"),
                safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![*n], idx)
                    .context("patch indices")?,
            ));
            views.push((
                format!("{name}.values"),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![*n], val)
                    .context("patch values")?,
            ));
        }
        let path = self.dir.join(format!("patch-{version}.safetensors"));
        let tmp = path.with_extension("safetensors.tmp");
        safetensors::tensor::serialize_to_file(views, Some(metadata), &tmp)
            .with_context(|| format!("write {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("write {}", path.display()))?;
        // The previous patch is kept for diagnosis until this one replaces it.
        if let Some(old) = version.checked_sub(2) {
            let _ = std::fs::remove_file(self.dir.join(format!("patch-{old}.safetensors")));
        }
        Ok(path)
    }

    /// The sparse update: pause, apply the patch, resume; the digest vLLM computed from its
    /// parameters must equal the committed one.
    fn apply_patch(&self, path: &Path, digest: [u8; 16]) -> Result<()> {
        let r = self.call(
            "POST",
            "/pause?mode=wait",
            None,
            Limits::timeout(RPC_TIMEOUT),
        )?;
        if !r.ok() {
            bail!("vLLM refused to pause ({}): {}", r.status, r.body.trim());
        }
        let p = path.display().to_string();
        let applied = self.rpc("starling_apply", &[&p, &self.settings.apply_mode]);
        let resumed = self.resume();
        let got = Self::digest_of(&applied?)?;
        if got != digest {
            bail!(
                "vLLM's parameters hash to {} after the patch, not the committed {}",
                hex(&got),
                hex(&digest)
            );
        }
        resumed
    }

    /// Whether the periodic check of vLLM's whole digest is due.
    fn verify_due(&self) -> bool {
        self.settings.verify_every.is_some_and(|every| {
            let cost = *self
                .verify_cost
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.verified_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .elapsed()
                >= every.max(cost * VERIFY_DUTY)
        })
    }

    /// Has vLLM digest all its parameters and compares with the proven version's digest
    /// (O(model) in vLLM). Call with no generation running (the swap lock held).
    fn verify(&self, proven: Fingerprint) -> Result<()> {
        let t = Instant::now();
        let r = self.rpc("starling_fingerprint", &[&self.model_id])?;
        let got = Self::digest_of(&r)?;
        self.whole_digest_checked();
        *self
            .verify_cost
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = t.elapsed();
        if got != proven.digest {
            bail!(
                "vLLM's parameters hash to {}, not version {}'s {}: its weights changed behind \
                 the actor's back",
                hex(&got),
                proven.version,
                hex(&proven.digest)
            );
        }
        tracing::debug!(
            version = proven.version,
            ms = t.elapsed().as_millis() as u64,
            "vLLM's digest checked"
        );
        Ok(())
    }

    /// One job's samples through a streamed `/v1/completions`, counting each token in
    /// `progress` as it arrives. Greedy (temperature 0) samples are one request's answer `n`
    /// times: vLLM refuses `n > 1` with greedy sampling, and greedy decoding of one prompt on
    /// one version has one answer (each of its tokens counts `n` times).
    ///
    /// `stop` set (another job of the call failed) ends the stream at its next line: the
    /// connection closes, and vLLM aborts the request.
    fn complete(
        &self,
        served: &str,
        job: &JobSpec,
        fp: Fingerprint,
        stop: &AtomicBool,
        progress: impl Fn(u64),
    ) -> Result<Vec<Sample>> {
        let s = &job.sampling;
        let greedy = s.temperature == 0.0;
        let n = if greedy { 1 } else { job.n };
        let copies = u64::from(job.n / n);
        let body = json!({
            "model": served,
            "prompt": job.prompt,
            "n": n,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": group_seed(s.seed, job.group) & 0x7fff_ffff_ffff_ffff,
            "logprobs": 1,
            "return_tokens_as_token_ids": true,
            "stream": true,
            // Stop only on the job's stop tokens, as the built-in engine does.
            "ignore_eos": true,
            "stop_token_ids": s.stop_token_ids,
            // Every sampling parameter, neutral where the job has none: a parameter left out
            // takes the model's `generation_config.json` value on a server started without
            // `--generation-config vllm` (an attached one, `--vllm-url`).
            "top_k": s.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        })
        .to_string();
        let started = Instant::now();
        let limits = Limits::timeout(completion_timeout(s.max_new_tokens))
            .idle(GENERATE_IDLE)
            .body_limit(completion_limit(n, s.max_new_tokens, served));
        let mut stream = CompletionStream::new(n as usize, started);
        let mut malformed = None;
        let r = http_client::request_lines(
            &self.settings.addr,
            "POST",
            "/v1/completions",
            &[],
            Some(&body),
            limits,
            |line| match stream.line(line, Instant::now()) {
                _ if stop.load(Ordering::Relaxed) => ControlFlow::Break(()),
                Ok(tokens) => {
                    progress(tokens * copies);
                    if stream.is_done() {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                }
                Err(e) => {
                    malformed = Some(e);
                    ControlFlow::Break(())
                }
            },
        )
        .with_context(|| {
            format!(
                "job {}: no whole completion from the vLLM server at {}",
                job.job, self.settings.addr
            )
        })?;
        // vLLM refuses this job's request itself (its prompt leaves no room under the
        // server's --max-model-len, say), before streaming (HTTP 400) or in the stream (an
        // error event with code 400, from checks vLLM runs once the stream has begun): the
        // job goes back aborted, which the hub refuses for this job alone; the call's other
        // jobs keep their samples, and the actor its connection.
        let refused = match (&malformed, r.status) {
            (_, 400) => Some(r.body.chars().take(400).collect::<String>()),
            (
                Some(StreamError::Reported {
                    message,
                    code: Some(400),
                }),
                _,
            ) => Some(message.clone()),
            _ => None,
        };
        if let Some(why) = refused {
            tracing::warn!(
                job = job.job,
                "vLLM refused the job's completion (400), so it goes back as aborted: {why}"
            );
            let aborted = Sample {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish: FinishReason::Aborted,
                spans: whole_span(fp.version, 0),
                ttft_us: 0,
                decode_us: 0,
            };
            return Ok(vec![aborted; job.n as usize]);
        }
        if !r.ok() {
            bail!(
                "job {}: vLLM answered {} to a completion: {}",
                job.job,
                r.status,
                r.body.chars().take(400).collect::<String>()
            );
        }
        if let Some(e) = malformed {
            bail!("job {}: vLLM's streamed completion: {e}", job.job);
        }
        if stop.load(Ordering::Relaxed) {
            bail!("job {}: stopped, another job of the call failed", job.job);
        }
        let mut samples = stream
            .samples()
            .with_context(|| format!("job {}: vLLM's streamed completion", job.job))?;
        if greedy {
            samples = vec![samples[0].clone(); job.n as usize];
        }
        Ok(samples
            .into_iter()
            .map(|sample| {
                let len = u32::try_from(sample.tokens.len()).unwrap_or(u32::MAX);
                let mut finish = match sample.finish_reason.as_str() {
                    "length" => FinishReason::Length,
                    "stop" => FinishReason::Stop,
                    _ => FinishReason::Aborted,
                };
                if finish == FinishReason::Length && len < s.max_new_tokens {
                    // vLLM shortens max_tokens to what its --max-model-len leaves after the
                    // prompt, without a word: such a sample would train as if the model had
                    // stopped there. It goes back as aborted, which the hub refuses for this
                    // job alone; the other jobs of the call keep their samples.
                    tracing::error!(
                        job = job.job,
                        "vLLM ended a sample at its length limit after {len} of the job's {} \
                         new tokens: its --max-model-len is below the prompt's {} tokens plus \
                         max_new_tokens; start vLLM with a --max-model-len of at least {}",
                        s.max_new_tokens,
                        job.prompt.len(),
                        job.prompt.len() as u64 + u64::from(s.max_new_tokens)
                    );
                    finish = FinishReason::Aborted;
                }
                Sample {
                    spans: whole_span(fp.version, len),
                    finish,
                    ttft_us: u64::try_from(sample.ttft.as_micros()).unwrap_or(u64::MAX),
                    decode_us: u64::try_from(sample.decode.as_micros()).unwrap_or(u64::MAX),
                    tokens: sample.tokens,
                    logprobs: sample.logprobs,
                }
            })
            .collect())
    }
}

/// Stops a server started by [`VllmEngine::start`] and every process of its group (SIGKILL:
/// its state is worthless once the actor stops trusting it), and reaps it.
fn kill_group(child: &mut Child) {
    let group = format!("-{}", child.id());
    let killed = Command::new("kill")
        .args(["-KILL", "--", &group])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !killed.is_ok_and(|s| s.success()) {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// A state digest from its 32 hex digits.
fn parse_digest(s: &str) -> Result<[u8; 16]> {
    parse_hex(s).with_context(|| format!("a digest is 32 hex digits, not {s:?}"))
}

impl Engine for VllmEngine {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            engine: "vllm".into(),
            max_batch: self.budget.max(),
            // Two calls overlap: the next one's jobs take up the sequences the current one's
            // last jobs leave idle (`concurrent_jobs`).
            calls: 2,
        }
    }

    fn load(
        &self,
        weights: &BTreeMap<String, Vec<u16>>,
        version: u64,
        digest: [u8; 16],
        change: Option<&UndoLog>,
    ) -> Result<()> {
        let _swap = self
            .swap
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut held = self.held();
        let sparse = match (self.proven(), change) {
            (Some(fp), Some(c))
                if c.base().0 == fp.version && c.base().1.to_bytes() == fp.digest =>
            {
                Some(c)
            }
            _ => None,
        };
        let Some(change) = sparse else {
            return self.bring_up(&mut held, weights, version, digest);
        };
        // Fenced from here until vLLM proves it holds `version`.
        self.set_proven(None);
        let t = Instant::now();
        let fp = Fingerprint { version, digest };
        let sparse = self
            .write_patch(change, version, digest)
            .and_then(|path| self.apply_patch(&path, digest))
            // The periodic whole check, when due, before the version takes any work.
            .and_then(|()| {
                if self.verify_due() {
                    self.verify(fp)
                } else {
                    Ok(())
                }
            });
        match sparse {
            Ok(()) => {
                tracing::info!(
                    version,
                    changes = change.changes(),
                    ms = t.elapsed().as_millis() as u64,
                    "version live in vLLM"
                );
                self.set_proven(Some(fp));
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    version,
                    "sparse update of vLLM failed, reloading in full: {e:#}"
                );
                let full = self
                    .materialize(weights, version)
                    .and_then(|path| self.load_full(&path, version, digest));
                match full {
                    Ok(()) => {
                        self.whole_digest_checked();
                        self.set_proven(Some(Fingerprint { version, digest }));
                        Ok(())
                    }
                    Err(e) if held.child.is_some() => {
                        tracing::error!(version, "full reload failed, restarting vLLM: {e:#}");
                        Self::stop_child(&mut held);
                        self.bring_up(&mut held, weights, version, digest)
                    }
                    Err(e) => {
                        Err(e.context(format!("version {version} could not be made live in vLLM")))
                    }
                }
            }
        }
    }

    fn generate(&self, jobs: &[JobSpec], progress: &JobProgress) -> Result<Vec<JobResult>> {
        let _swap = self
            .swap
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (fp, served) = (self.proven(), self.held().served.clone());
        let (Some(fp), Some(served)) = (fp, served) else {
            bail!("vLLM holds no verified version (fenced)");
        };
        let started = Instant::now();
        // Greedy jobs send one sequence (their samples are copies of it).
        let sizes: Vec<u32> = jobs
            .iter()
            .map(|j| {
                if j.sampling.temperature == 0.0 {
                    1
                } else {
                    j.n
                }
            })
            .collect();
        let mut results = run_within(&sizes, &self.budget, progress.stop_flag(), |i, stop| {
            let j = &jobs[i];
            let samples = self.complete(&served, j, fp, stop, |tokens| progress.add(i, tokens))?;
            Ok(JobResult {
                job: j.job,
                attempt: j.attempt,
                version: fp.version,
                digest: fp.digest,
                elapsed_us: 0,
                samples,
            })
        })?;
        // The call's time, shared in proportion to each job's samples (the ledger's τ).
        let total: u64 = jobs.iter().map(|j| u64::from(j.n)).sum::<u64>().max(1);
        let elapsed = started.elapsed();
        for (r, j) in results.iter_mut().zip(jobs) {
            r.elapsed_us =
                u64::try_from(elapsed.mul_f64(f64::from(j.n) / total as f64).as_micros())
                    .unwrap_or(u64::MAX);
        }
        Ok(results)
    }

    fn fingerprint(&self) -> Option<Fingerprint> {
        self.proven()
    }

    fn needs_reload(&self) -> bool {
        let mut held = self.held();
        let died = match held.child.as_mut() {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            // Attached to a server someone else runs: lost when it stops answering.
            None => self.proven().is_some() && !self.healthy(),
        };
        if died {
            tracing::error!(addr = %self.settings.addr, "vLLM is gone; fenced until it is back with the active version");
            // What is left of its process group (engine processes) goes with it.
            Self::stop_child(&mut held);
            self.set_proven(None);
            return true;
        }
        let Some(proven) = self.proven() else {
            return held.served.is_some();
        };
        // The periodic check, only while no generation runs (a load or a generation holds
        // the swap lock; the check waits for the next idle moment).
        if self.verify_due()
            && let Ok(_idle) = self.swap.try_write()
            && let Err(e) = self.verify(proven)
        {
            tracing::error!(
                version = proven.version,
                "fencing vLLM and reloading the committed version: {e:#}"
            );
            self.set_proven(None);
            return true;
        }
        false
    }
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        Self::stop_child(&mut self.held());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_from_their_hex_and_nothing_else() {
        let d = [
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0, 1, 2, 3, 4, 5, 6, 0xff,
        ];
        assert_eq!(parse_digest(&hex(&d)).expect("hex"), d);
        assert!(parse_digest("0123").is_err());
        assert!(parse_digest(&"zz".repeat(16)).is_err());
    }

    #[test]
    fn a_completion_may_be_as_large_and_as_long_as_its_tokens_allow() {
        assert_eq!(completion_limit(0, 100, "m"), DEFAULT_BODY_LIMIT);
        assert_eq!(
            completion_limit(8, 1024, "/store/vllm/model"),
            DEFAULT_BODY_LIMIT + 8 * 1024 * (STREAMED_BYTES_PER_TOKEN + 17)
        );
        assert_eq!(completion_limit(u32::MAX, u32::MAX, "m"), u64::MAX);
        assert_eq!(completion_timeout(0), GENERATE_BASE);
        // A 32k-token reasoning trace is not cut short by the bound.
        assert!(completion_timeout(32_768) > Duration::from_secs(8000));
        assert_eq!(
            completion_timeout(u32::MAX),
            Duration::MAX.min(completion_timeout(u32::MAX))
        );
    }

    #[test]
    fn the_sequences_in_flight_stay_within_what_a_started_server_runs() {
        assert_eq!(sequence_budget(32, None), 32);
        assert_eq!(
            sequence_budget(32, Some("vllm serve {model} --max-num-seqs 8")),
            8
        );
        assert_eq!(
            sequence_budget(32, Some("vllm serve {model} --max-num-seqs=64")),
            32
        );
        assert_eq!(
            sequence_budget(32, Some("vllm serve {model} --max-num-seqs x")),
            32
        );
        assert_eq!(sequence_budget(0, Some("vllm serve {model}")), 1);
        assert_eq!(sequence_budget(4, Some("vllm --max-num-seqs 0")), 1);
    }

    #[test]
    fn hosts_and_loopback_are_read_as_the_actor_will_connect() {
        assert_eq!(host_of("127.0.0.1:8000"), "127.0.0.1");
        assert_eq!(host_of("[::1]:8000"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
        assert_eq!(host_of("10.0.0.7:80"), "10.0.0.7");
        for h in ["127.0.0.1", "127.3.2.1", "::1", "localhost"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in [
            "0.0.0.0",
            "::",
            "10.0.0.7",
            "example.com",
            "localhost.evil.example",
        ] {
            assert!(!is_loopback(h), "{h}");
        }
        assert_eq!(
            host_arg("vllm serve --host 0.0.0.0 --port 1"),
            Some("0.0.0.0")
        );
        assert_eq!(host_arg("vllm serve --host=::1"), Some("::1"));
        assert_eq!(host_arg("vllm serve --hostname x --port 1"), None);
        assert_eq!(host_arg("vllm serve --host"), None);
        assert_eq!(host_arg("vllm serve --host-x=1"), None);
        assert_eq!(
            flag_value("vllm serve --generation-config=auto", "--generation-config"),
            Some("auto")
        );
        assert_eq!(
            flag_value("vllm serve --generation-config-x 1", "--generation-config"),
            None
        );
    }

    fn settings(addr: &str, cmd: Option<&str>, allow_remote: bool) -> VllmSettings {
        VllmSettings {
            addr: addr.to_owned(),
            cmd: cmd.map(str::to_owned),
            apply_mode: "auto".to_owned(),
            start_timeout: Duration::from_secs(1),
            allow_remote,
            verify_every: None,
        }
    }

    #[test]
    fn a_server_off_loopback_is_refused_unless_allowed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("config.json");
        let tiny = serde_json::json!({
            "model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true
        });
        std::fs::write(&config, tiny.to_string()).expect("write config");
        let new = |s| VllmEngine::new(s, &config, "m", dir.path(), 4);
        let err = |s| match new(s) {
            Ok(_) => String::new(),
            Err(e) => format!("{e:#}"),
        };
        new(settings(
            "127.0.0.1:8000",
            Some("vllm serve --port 8000"),
            false,
        ))
        .expect("loopback, no --host");
        new(settings("[::1]:8000", Some("vllm serve --host ::1"), false)).expect("::1");
        assert!(err(settings("10.0.0.7:8000", None, false)).contains("not a loopback address"));
        assert!(err(settings("0.0.0.0:8000", None, false)).contains("not a loopback address"));
        assert!(
            err(settings(
                "127.0.0.1:8000",
                Some("vllm serve --host 0.0.0.0"),
                false
            ))
            .contains("--host 0.0.0.0")
        );
        new(settings(
            "10.0.0.7:8000",
            Some("vllm serve --host 0.0.0.0"),
            true,
        ))
        .expect("allowed remote");
    }
}
