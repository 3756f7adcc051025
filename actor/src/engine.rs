//! The actor's inference engines behind one trait, and the built-in one.
//!
//! An [`Engine`] is loaded with a committed version at a safe point, generates a batch of jobs
//! (each a group of `n` samples of one prompt), fingerprints what it holds, and says what it
//! can do. The actor loads a version only after the whole delta verified and committed, and
//! every `generate` call works on the version it found loaded when it started — the engine
//! swaps versions between calls, never inside one — so generation never sees half-applied
//! weights and every sample is tagged with the version that produced all of its tokens.
//!
//! While it generates, an engine counts the tokens of each job in a [`JobProgress`], which the
//! worker reports to the hub about every second: a lease lives as long as its generation
//! moves, however long that is.
//!
//! [`BuiltinEngine`] runs `starling_engine`'s Qwen3 decoder on the CPU from the actor's BF16
//! weights. It rebuilds its model from the committed weights at each load (O(model), fine
//! for the small models it exists for; the vLLM engine applies sparse changes in place). A
//! `slowdown` factor stretches each decoding step (so the progress it reports keeps pace with
//! the stretched time), so benchmarks can run actors at chosen relative speeds on one
//! machine.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use starling_engine::{
    FinishReason as EngineFinish, GenRequest, GenerateOptions, Model, ModelConfig, Sampling,
};
use starling_proto::delta::apply::{UndoLog, full_digest};
use starling_proto::protocol::rollout::{FinishReason, JobResult, JobSpec, Sample, VersionSpan};

/// What an engine can do.
#[derive(Debug, Clone)]
pub struct Capabilities {
    /// Its kind (`builtin`, `vllm`).
    pub engine: String,
    /// Sequences it decodes together.
    pub max_batch: u32,
    /// Generation calls the worker may run at once (they share `max_batch`): 1 for an engine
    /// that batches within a call only, more for one that batches whatever is in flight.
    pub calls: u32,
}

/// The weights an engine generates with: their version and state digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub version: u64,
    pub digest: [u8; 16],
}

/// Tokens generated so far for each job of one `generate` call (all its samples together), in
/// job order. The engine adds to it as it generates; the worker reads it for its `Progress`
/// reports from another thread, and sets its stop flag when it no longer wants the call's
/// results (its session ended), which an engine that can end a call early heeds.
#[derive(Debug, Default)]
pub struct JobProgress {
    tokens: Vec<AtomicU64>,
    stop: AtomicBool,
}

impl JobProgress {
    /// Counters for `jobs` jobs, at zero.
    pub fn new(jobs: usize) -> JobProgress {
        JobProgress {
            tokens: (0..jobs).map(|_| AtomicU64::new(0)).collect(),
            stop: AtomicBool::new(false),
        }
    }

    /// Asks the engine to end the call as soon as it can: its results are not wanted.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// The stop flag (set by [`JobProgress::stop`]).
    pub fn stop_flag(&self) -> &AtomicBool {
        &self.stop
    }

    /// Counts `n` more tokens for job `index` (ignored beyond the call's jobs).
    pub fn add(&self, index: usize, n: u64) {
        if let Some(t) = self.tokens.get(index) {
            t.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The counts now, in job order.
    pub fn snapshot(&self) -> Vec<u64> {
        self.tokens
            .iter()
            .map(|t| t.load(Ordering::Relaxed))
            .collect()
    }
}

/// An inference engine the actor drives.
pub trait Engine: Send + Sync + 'static {
    /// What it can do.
    fn capabilities(&self) -> Capabilities;
    /// Loads committed `version` (digest `digest`) from the actor's weights, replacing the
    /// loaded one for every later `generate` call. `change` is what the commit wrote, when
    /// the version follows the one loaded before by one commit (none at start-up, after an
    /// anchor or a reload): an engine that keeps its own copy of the weights applies just
    /// that. On error the previous version stays, or the engine is fenced (its fingerprint
    /// no longer matches, so the worker takes no work) until a later load succeeds. An
    /// engine whose server is starting returns [`StillStarting`] rather than wait for it:
    /// the call must not hold the actor's weight pipeline for as long as a start takes.
    fn load(
        &self,
        weights: &BTreeMap<String, Vec<u16>>,
        version: u64,
        digest: [u8; 16],
        change: Option<&UndoLog>,
    ) -> Result<()>;
    /// Whether the engine lost what it held (its server died) and must be loaded again from
    /// the actor's weights before it can take work; the actor checks every second.
    fn needs_reload(&self) -> bool {
        false
    }
    /// Generates every job with the version loaded when the call starts, counting each job's
    /// tokens in `progress` as they are generated (as finely as the engine can tell).
    fn generate(&self, jobs: &[JobSpec], progress: &JobProgress) -> Result<Vec<JobResult>>;
    /// The version loaded now, proven from the weights it holds (none before a load).
    fn fingerprint(&self) -> Option<Fingerprint>;
}

/// What [`Engine::load`] returns while the engine's server is still starting (a vLLM server
/// takes tens of seconds to minutes): the load is not done and not failed. The actor asks
/// again at its next tick, and meanwhile stages and commits versions; the server is loaded
/// with the newest committed version once it answers.
#[derive(Debug, thiserror::Error)]
#[error("the engine's server is still starting")]
pub struct StillStarting;

/// How often a caller that waits for a starting engine looks again.
pub const STARTING_POLL: Duration = Duration::from_millis(500);

/// Runs `load` until it returns something other than [`StillStarting`], looking again every
/// [`STARTING_POLL`]: for the loads that must hold the engine's version before anything else
/// goes on (the actor's start-up, the shared-directory baseline). Dropping the future stops
/// the wait.
pub async fn load_waiting(mut load: impl FnMut() -> Result<()>) -> Result<()> {
    loop {
        match load() {
            Err(e) if e.is::<StillStarting>() => tokio::time::sleep(STARTING_POLL).await,
            done => return done,
        }
    }
}

impl std::fmt::Debug for dyn Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Engine({})", self.capabilities().engine)
    }
}

#[derive(Debug)]
struct Loaded {
    model: Model,
    fingerprint: Fingerprint,
}

/// The built-in CPU engine.
#[derive(Debug)]
pub struct BuiltinEngine {
    config: ModelConfig,
    model_id: String,
    max_batch: u32,
    slowdown: f64,
    loaded: RwLock<Option<Arc<Loaded>>>,
}

impl BuiltinEngine {
    /// An engine for the model described by `config` (HF `config.json`), not loaded yet.
    /// `slowdown` ≥ 1 stretches each generation call to that many times its compute time.
    pub fn new(config: ModelConfig, model_id: &str, max_batch: u32, slowdown: f64) -> Result<Self> {
        config.validate().context("model config")?;
        if !(slowdown.is_finite() && slowdown >= 1.0) {
            bail!("the engine slowdown must be a number ≥ 1, not {slowdown}");
        }
        Ok(Self {
            config,
            model_id: model_id.to_owned(),
            max_batch: max_batch.max(1),
            slowdown,
            loaded: RwLock::new(None),
        })
    }

    fn current(&self) -> Option<Arc<Loaded>> {
        self.loaded.read().ok().and_then(|l| l.clone())
    }
}

/// The seed of a group's samples: the batch's seed mixed with the group's index, so groups
/// sharing a seed still differ and a sample is reproducible from (seed, group, index).
pub fn group_seed(seed: u64, group: u32) -> u64 {
    starling_rng::mix64(seed ^ u64::from(group).wrapping_mul(starling_rng::GAMMA))
}

/// The version spans of a sample of `len` tokens all generated with `version` (none for an
/// empty sample): what an engine that swaps versions only between calls reports.
pub fn whole_span(version: u64, len: u32) -> Vec<VersionSpan> {
    if len > 0 {
        vec![VersionSpan {
            version,
            start: 0,
            end: len,
        }]
    } else {
        Vec::new()
    }
}

/// The engine requests of a job: its `n` samples.
pub fn requests(job: &JobSpec) -> Vec<GenRequest> {
    let s = &job.sampling;
    let sampling = Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        max_new_tokens: s.max_new_tokens,
        stop_token_ids: s.stop_token_ids.clone(),
        seed: group_seed(s.seed, job.group),
    };
    (0..job.n)
        .map(|i| GenRequest {
            prompt: job.prompt.clone(),
            sampling: sampling.clone(),
            sample_index: i,
        })
        .collect()
}

impl Engine for BuiltinEngine {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            engine: "builtin".into(),
            max_batch: self.max_batch,
            calls: 1,
        }
    }

    fn load(
        &self,
        weights: &BTreeMap<String, Vec<u16>>,
        version: u64,
        digest: [u8; 16],
        _change: Option<&UndoLog>,
    ) -> Result<()> {
        let shapes: BTreeMap<String, Vec<usize>> =
            self.config.tensor_shapes().into_iter().collect();
        let lookup = |name: &str| -> Option<(&[usize], &[u16])> {
            let bits = weights.get(name)?;
            let shape = shapes.get(name)?;
            Some((shape.as_slice(), bits.as_slice()))
        };
        let model = Model::from_bf16(self.config.clone(), lookup)
            .with_context(|| format!("load version {version} into the built-in engine"))?;
        // Prove what was loaded: the digest of the bits the model was built from.
        let names: Vec<String> = weights.keys().cloned().collect();
        let held = full_digest(&self.model_id, weights, &names).to_bytes();
        if held != digest {
            bail!("version {version}: the weights handed to the engine do not match their digest");
        }
        let loaded = Arc::new(Loaded {
            model,
            fingerprint: Fingerprint {
                version,
                digest: held,
            },
        });
        match self.loaded.write() {
            Ok(mut slot) => *slot = Some(loaded),
            Err(p) => *p.into_inner() = Some(loaded),
        }
        Ok(())
    }

    fn generate(&self, jobs: &[JobSpec], progress: &JobProgress) -> Result<Vec<JobResult>> {
        // The version for the whole call: taken once, at the job boundary.
        let Some(loaded) = self.current() else {
            bail!("no version loaded");
        };
        let started = Instant::now();
        let mut reqs = Vec::new();
        let mut job_of = Vec::new();
        for (i, j) in jobs.iter().enumerate() {
            let r = requests(j);
            job_of.extend(std::iter::repeat_n(i, r.len()));
            reqs.extend(r);
        }
        let opts = GenerateOptions {
            max_batch: self.max_batch as usize,
        };
        // After each decoding step: count its tokens, and stretch it by the slowdown.
        let mut step_start = Instant::now();
        let mut on_step = |sampled: &[usize]| {
            for &r in sampled {
                progress.add(job_of.get(r).copied().unwrap_or(usize::MAX), 1);
            }
            if self.slowdown > 1.0 {
                std::thread::sleep(step_start.elapsed().mul_f64(self.slowdown - 1.0));
            }
            step_start = Instant::now();
        };
        let outs = loaded
            .model
            .generate_observed(&reqs, opts, &mut on_step)
            .context("generate")?;
        let elapsed = started.elapsed();
        let fp = loaded.fingerprint;
        let mut outs = outs.into_iter();
        let total: u64 = jobs.iter().map(|j| u64::from(j.n)).sum::<u64>().max(1);
        let mut results = Vec::with_capacity(jobs.len());
        for j in jobs {
            let samples: Vec<Sample> = outs
                .by_ref()
                .take(j.n as usize)
                .map(|o| {
                    let len = u32::try_from(o.tokens.len()).unwrap_or(u32::MAX);
                    Sample {
                        spans: whole_span(fp.version, len),
                        finish: match o.finish {
                            EngineFinish::Stop => FinishReason::Stop,
                            EngineFinish::Length => FinishReason::Length,
                        },
                        // The prompt's step is measured before its stretch; the decoding time
                        // spans the stretched steps.
                        ttft_us: micros(o.prefill_time.mul_f64(self.slowdown)),
                        decode_us: micros(o.decode_time),
                        tokens: o.tokens,
                        logprobs: o.logprobs,
                    }
                })
                .collect();
            results.push(JobResult {
                job: j.job,
                attempt: j.attempt,
                version: fp.version,
                digest: fp.digest,
                // The call's time, shared in proportion to the job's samples (the ledger's τ).
                elapsed_us: micros(elapsed.mul_f64(f64::from(j.n) / total as f64)),
                samples,
            });
        }
        Ok(results)
    }

    fn fingerprint(&self) -> Option<Fingerprint> {
        self.current().map(|l| l.fingerprint)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_seeds_are_pinned() {
        // Reference outputs: a sample is reproducible from (seed, group, index) across
        // versions only while these hold.
        assert_eq!(group_seed(0, 0), 0);
        assert_eq!(group_seed(5, 7), 0x2298_eb42_cbbe_fdb8);
        assert_eq!(group_seed(u64::MAX, u32::MAX), 0x3a9b_57c2_77b2_2e0a);
    }
}
