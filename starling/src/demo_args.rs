//! `starling demo`'s command-line options ([`DemoArgs`], with [`RealArgs`] for `--model`) and
//! the defaults that depend on which run they ask for.
//!
//! Every kind of run the demo does reads them: the toy run (`toy_run`), `--compare`
//! (`compare`) and the real run (`real`). They live apart from `demo`, which picks among
//! those runs, so that the runs import the options from below instead of from the module
//! that calls them.

use std::path::PathBuf;

use clap::Args;

/// `starling demo`'s options.
#[derive(Args, Debug, Clone)]
pub(crate) struct DemoArgs {
    /// Output directory (created; must not exist).
    #[arg(long, default_value = "starling-demo")]
    pub(crate) out: PathBuf,
    /// RL steps (each: a batch of rollouts, one optimizer step, one published version)
    /// [default: 60; with --model 12].
    #[arg(long)]
    steps: Option<u32>,
    /// Prompt groups per batch [default: 32; with --model 8].
    #[arg(long)]
    groups: Option<usize>,
    /// Samples per group [default: 8; with --model 2: on 2 cores, half the generation, behaviour
    /// check and backward pass per step; a group of two still has advantages ±1 when its
    /// samples' rewards differ].
    #[arg(short = 'n', long)]
    samples: Option<u32>,
    /// The trainer's AdamW learning rate [default: 3e-3 for the demo's toy model; with
    /// --model 3e-6, an RL fine-tune's].
    #[arg(long)]
    lr: Option<f64>,
    /// Supervised warm-start steps before RL (stand-in for pre-training).
    #[arg(long, default_value_t = 60)]
    pub(crate) warm_steps: u32,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Ship each version as a full BF16 checkpoint (dense, byte planes + zstd-1) instead of
    /// a delta: the baseline.
    #[arg(long, conflicts_with_all = ["no_transfer", "compare"])]
    pub(crate) full_broadcast: bool,
    /// No weight transfer: every actor reads each version's checkpoint from a shared
    /// directory the trainer links it into (no relays); jobs still cross the emulated links.
    /// The ideal delta mode is measured against.
    #[arg(long, conflicts_with = "compare")]
    pub(crate) no_transfer: bool,
    /// Run every mode (delta, no-transfer, full-broadcast) in turn, `--rounds` times, from the
    /// same initial checkpoint, each in a subdirectory of the output; then compare them.
    #[arg(long)]
    pub(crate) compare: bool,
    /// Rounds of `--compare` (modes interleaved, so drift on a noisy machine hits all).
    #[arg(long, default_value_t = 1, requires = "compare")]
    pub(crate) rounds: u32,
    /// Override a region's link rate: NAME=MBIT (repeatable or comma-separated: eu=4,ap=1).
    #[arg(long, value_delimiter = ',')]
    pub(crate) link_mbit: Vec<String>,
    /// Run every actor's engine this many times slower again, on top of its 1:2:3 speed
    /// (`--engine-slowdown K·3/speed`). With K ≥ 4 actors mostly wait instead of computing, so
    /// they behave as independent devices rather than three processes sharing this machine's
    /// cores (where excluding one actor just hands its CPU to the others).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) engine_slowdown: f64,
    /// The hub's HTTP port (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub(crate) http_port: u16,
    /// The real run: a pretrained model's directory (`scripts/fetch-model.sh` prints one)
    /// trained by the SDK's PyTorch GRPO trainer (docs/real-run.md).
    #[command(flatten)]
    pub(crate) real: RealArgs,
}

/// `starling demo --model DIR`'s options (docs/real-run.md).
#[derive(Args, Debug, Clone)]
pub(crate) struct RealArgs {
    /// Train this model directory (Hugging Face layout: config.json, model.safetensors,
    /// tokenizer) with the SDK's PyTorch GRPO trainer instead of the built-in toy model.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// A Python with torch and transformers (and vLLM's CPU build for --vllm).
    #[arg(
        long,
        env = "STARLING_PYTHON",
        default_value = "python3",
        requires = "model"
    )]
    pub(crate) python: PathBuf,
    /// Add a vLLM actor to the near region, attached to a vLLM server the demo starts once
    /// with --python and shares between the modes of --compare.
    #[arg(long, requires = "model")]
    pub(crate) vllm: bool,
    /// The quick demo's links (eu 200 Mbit/s, ap 50 Mbit/s) instead of links where a full
    /// checkpoint takes as long as an 8B model's over 0.5-1 Gbit/s (eu 17, ap 8 Mbit/s).
    #[arg(long, requires = "model")]
    pub(crate) fast_links: bool,
    /// With --compare: the runs, in the order each round runs them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "delta,no-transfer,full-broadcast,full-broadcast-exclusive",
        requires = "model"
    )]
    pub(crate) modes: Vec<String>,
    /// With --compare: steps of the full-broadcast runs (each version waits for a full
    /// checkpoint to cross the links: minutes per step).
    #[arg(long, default_value_t = 3, requires = "model")]
    pub(crate) full_steps: u32,
    /// Completion tokens per sample at most.
    #[arg(long, default_value_t = 48, requires = "model")]
    pub(crate) max_new_tokens: u32,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.7, requires = "model")]
    pub(crate) temperature: f64,
    /// PyTorch threads of the trainer (default: PyTorch's, one per core).
    #[arg(long, requires = "model")]
    pub(crate) trainer_threads: Option<u32>,
    /// The trainer's training set: this many seeded problems, dealt in a new order each pass
    /// (0: a new problem every time). Default: one quarter of the run's prompts (groups x
    /// steps / 4), so that the first and the last quarter of the steps see the same problems
    /// and the reward's rise measures learning, not the problems the seed dealt.
    #[arg(long, requires = "model")]
    pub(crate) problems: Option<usize>,
    /// With --compare: keep each mode's weight files (the trainer's checkpoints, the hub's
    /// store, the actors' versions: ~5 GB a mode) instead of removing them once the mode's
    /// summary is written.
    #[arg(long, requires = "model")]
    pub(crate) keep_weights: bool,
}

impl DemoArgs {
    fn real(&self) -> bool {
        self.real.model.is_some()
    }
    pub(crate) fn steps(&self) -> u32 {
        self.steps.unwrap_or(if self.real() { 12 } else { 60 })
    }
    pub(crate) fn groups(&self) -> usize {
        self.groups.unwrap_or(if self.real() { 8 } else { 32 })
    }
    pub(crate) fn samples(&self) -> u32 {
        self.samples.unwrap_or(if self.real() { 2 } else { 8 })
    }
    pub(crate) fn lr(&self) -> f64 {
        self.lr.unwrap_or(if self.real() { 3e-6 } else { 3e-3 })
    }
}
