//! The records of a real-model run (`real`): one mode's `summary.json` ([`RealSummary`]) and
//! the comparison's `compare.json` ([`RealComparison`]), each a typed record that the writer
//! fills and every reader (the printed lines, the comparison's medians, the plots) reads by
//! field, so each name is spelled once. A figure that could not be measured is NaN in memory
//! and `null` in the file, read back as NaN ([`crate::summary::figure`]).
//!
//! The trainer's per-step report (`TrainerStep`, written by the Python trainer) is nested as it
//! came, with its behaviour check typed where the run aggregates it ([`StepCheck`]) and every
//! other key kept.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::summary::{RegionSummary, figure, figures};

/// One line of the trainer's report (`starling.grpo.trainer`), the fields used here.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct TrainerStep {
    pub(crate) step: u32,
    pub(crate) batch: u64,
    pub(crate) batch_version: u64,
    pub(crate) sample_versions: Vec<u64>,
    pub(crate) samples: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) mean_reward: f64,
    pub(crate) solved: f64,
    pub(crate) loss: f64,
    pub(crate) trained_samples: u64,
    pub(crate) check: StepCheck,
    pub(crate) per_actor_samples: BTreeMap<String, u64>,
    pub(crate) per_actor_tokens: BTreeMap<String, u64>,
    pub(crate) batch_created_at_ms: Option<f64>,
    pub(crate) last_accepted_at_ms: Option<f64>,
    pub(crate) loop_started_at_unix_ms: f64,
    pub(crate) ended_at_unix_ms: f64,
    pub(crate) published: Published,
    pub(crate) seconds: BTreeMap<String, f64>,
}

/// The version a step published.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct Published {
    pub(crate) version: u64,
    pub(crate) bytes: u64,
    pub(crate) changes: u64,
    pub(crate) density: f64,
    pub(crate) at_unix_ms: f64,
    pub(crate) path: PathBuf,
}

/// A step's behaviour check: the consumed rollouts' log-probabilities recomputed on the BF16
/// weights of their version, per engine that generated them.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub(crate) struct StepCheck {
    #[serde(default)]
    pub(crate) per_engine: BTreeMap<String, EngineCheck>,
    /// The groups the check refused (each as the trainer describes it).
    #[serde(default)]
    pub(crate) refused_groups: Vec<Value>,
    /// Whatever else the trainer reports, kept as it came.
    #[serde(flatten)]
    pub(crate) other: BTreeMap<String, Value>,
}

/// One engine's share of a behaviour check, or their sum over a run.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub(crate) struct EngineCheck {
    #[serde(default)]
    pub(crate) samples: f64,
    #[serde(default)]
    pub(crate) tokens: f64,
    #[serde(default)]
    pub(crate) tokens_over_tolerance: f64,
    #[serde(default)]
    pub(crate) exact_checked_samples: f64,
    #[serde(default)]
    pub(crate) exact_mismatches: f64,
    #[serde(default)]
    pub(crate) max_abs_logprob_diff: f64,
    #[serde(default)]
    pub(crate) tolerance: Option<f64>,
    /// What else the trainer reports per engine and step (not summed over a run).
    #[serde(flatten)]
    pub(crate) other: BTreeMap<String, Value>,
}

impl EngineCheck {
    /// Adds `step`'s counts to a run's sum: counts add, the largest difference is kept, the
    /// tolerance is the last one stated.
    pub(crate) fn add(&mut self, step: &EngineCheck) {
        self.samples += step.samples;
        self.tokens += step.tokens;
        self.tokens_over_tolerance += step.tokens_over_tolerance;
        self.exact_checked_samples += step.exact_checked_samples;
        self.exact_mismatches += step.exact_mismatches;
        self.max_abs_logprob_diff = self.max_abs_logprob_diff.max(step.max_abs_logprob_diff);
        if step.tolerance.is_some() {
            self.tolerance = step.tolerance;
        }
    }
}

/// One run of the real model in one mode (`summary.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RealSummary {
    /// `delta`, `no-transfer`, `full-broadcast` or `full-broadcast-exclusive`.
    pub(crate) mode: String,
    pub(crate) model: RealModel,
    pub(crate) task: String,
    pub(crate) settings: RealRunSettings,
    pub(crate) regions: Vec<RegionSummary>,
    pub(crate) reward: QuarterReward,
    pub(crate) bytes: VersionBytes,
    /// Mean share of weights a version changed.
    #[serde(with = "figure")]
    pub(crate) delta_density: f64,
    pub(crate) density_per_step: Vec<f64>,
    /// Per region: mean seconds from publish to every actor active, over the versions that
    /// arrived.
    #[serde(with = "figures")]
    pub(crate) mean_transfer_s: BTreeMap<String, f64>,
    /// How long after the run a version may still arrive and count.
    pub(crate) arrival_wait_s: u64,
    /// Per region, the versions that had not reached all its actors by then.
    pub(crate) not_arrived: BTreeMap<String, Vec<u64>>,
    /// Per region, what its emulated link carried.
    pub(crate) link_bytes: BTreeMap<String, LinkCarried>,
    pub(crate) throughput: SteadyThroughput,
    /// Accepted samples' share per actor.
    pub(crate) per_actor_share: BTreeMap<String, f64>,
    /// Each actor's throughput τ (tokens/s) as the hub's ledger had it at the end.
    pub(crate) tau_at_end: BTreeMap<String, f64>,
    /// Per actor, its share of the tokens against its share of the summed speed.
    pub(crate) share_vs_speed: BTreeMap<String, ShareVsSpeed>,
    pub(crate) makespans: Vec<Makespan>,
    pub(crate) behaviour_check: RunCheck,
    pub(crate) wall_s: f64,
    pub(crate) steps: Vec<RealStep>,
}

/// The model trained.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RealModel {
    pub(crate) dir: String,
    pub(crate) bf16_bytes: u64,
}

/// The run's options.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RealRunSettings {
    pub(crate) steps: u32,
    pub(crate) groups: usize,
    pub(crate) samples_per_group: u32,
    pub(crate) max_new_tokens: u32,
    pub(crate) temperature: f64,
    pub(crate) lr: f64,
    pub(crate) seed: u64,
    pub(crate) problems: usize,
    pub(crate) max_staleness: u32,
    pub(crate) engine_slowdown: f64,
    pub(crate) vllm: bool,
    pub(crate) exclude_late_region: bool,
}

/// Mean reward over the first and the last quarter of the steps.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct QuarterReward {
    #[serde(with = "figure")]
    pub(crate) first_quarter: f64,
    #[serde(with = "figure")]
    pub(crate) last_quarter: f64,
    pub(crate) steps_per_quarter: usize,
    pub(crate) per_step: Vec<f64>,
}

/// What the hub published per version, against the full BF16 checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct VersionBytes {
    #[serde(with = "figure")]
    pub(crate) per_version: f64,
    pub(crate) full_checkpoint: u64,
    #[serde(with = "figure")]
    pub(crate) ratio: f64,
    pub(crate) per_step: Vec<u64>,
}

/// What one region's emulated link carried, each way.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LinkCarried {
    pub(crate) to_region: u64,
    pub(crate) to_hub: u64,
}

/// Throughput in the steady state (from `steady_from_step`) and over the whole loop.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SteadyThroughput {
    pub(crate) steady_from_step: u32,
    #[serde(with = "figure")]
    pub(crate) steady_s: f64,
    #[serde(with = "figure")]
    pub(crate) steps_per_hour: f64,
    #[serde(with = "figure")]
    pub(crate) rollout_tokens_per_s: f64,
    #[serde(with = "figure")]
    pub(crate) loop_s: f64,
    #[serde(with = "figure")]
    pub(crate) loop_steps_per_hour: f64,
    #[serde(with = "figure")]
    pub(crate) median_step_s: f64,
}

/// An actor's share of the tokens generated over its share of the actors' summed throughput
/// (1.0: exactly in proportion to speed).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ShareVsSpeed {
    #[serde(with = "figure")]
    pub(crate) token_share: f64,
    #[serde(with = "figure")]
    pub(crate) speed_share: f64,
    #[serde(with = "figure")]
    pub(crate) ratio: f64,
}

/// A batch's makespan (posted → last accepted group) against the ideal: its tokens at the
/// actors' combined throughput.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Makespan {
    pub(crate) batch: u64,
    #[serde(with = "figure")]
    pub(crate) makespan_s: f64,
    #[serde(with = "figure")]
    pub(crate) ideal_s: f64,
    #[serde(with = "figure")]
    pub(crate) ratio: f64,
}

/// The behaviour checks of a run, summed per engine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RunCheck {
    pub(crate) per_engine: BTreeMap<String, EngineCheck>,
    pub(crate) refused_groups: usize,
}

/// One trainer step and when its version reached each region.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RealStep {
    pub(crate) trainer: TrainerStep,
    /// Region → seconds from publish to every actor active; `None` where it had not.
    pub(crate) arrival_s: Option<BTreeMap<String, Option<f64>>>,
}

/// The comparison of modes over rounds (`compare.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RealComparison {
    pub(crate) rounds: u32,
    pub(crate) wall_s: f64,
    pub(crate) modes: Vec<String>,
    /// Mode → figure ([`FIGURES`]) → median over its rounds.
    pub(crate) medians: BTreeMap<String, Figures>,
    pub(crate) ratios: Ratios,
    pub(crate) runs: Vec<RoundRun>,
}

/// A mode's figures by name.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct Figures(#[serde(with = "figures")] pub(crate) BTreeMap<String, f64>);

impl Figures {
    /// The figure `name` (NaN when the mode has none).
    pub(crate) fn get(&self, name: &str) -> f64 {
        self.0.get(name).copied().unwrap_or(f64::NAN)
    }
}

/// Delta's steady-state figures over the baselines'.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Ratios {
    #[serde(with = "figure")]
    pub(crate) delta_over_full_broadcast_steps_per_hour: f64,
    #[serde(with = "figure")]
    pub(crate) delta_over_full_broadcast_exclusive_steps_per_hour: f64,
    #[serde(with = "figure")]
    pub(crate) delta_over_no_transfer_steps_per_hour: f64,
    #[serde(with = "figure")]
    pub(crate) delta_over_no_transfer_tokens_per_s: f64,
}

/// One mode's run in one round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RoundRun {
    pub(crate) round: u32,
    pub(crate) mode: String,
    pub(crate) summary: RealSummary,
}

/// One figure of a run's summary (NaN where the run did not measure it).
pub(crate) type Figure = fn(&RealSummary) -> f64;

/// The figures runs are compared on.
pub(crate) const FIGURES: [(&str, Figure); 8] = [
    ("steps_per_hour", |s| s.throughput.steps_per_hour),
    ("rollout_tokens_per_s", |s| {
        s.throughput.rollout_tokens_per_s
    }),
    ("median_step_s", |s| s.throughput.median_step_s),
    ("bytes_per_version", |s| s.bytes.per_version),
    ("transfer_eu_s", |s| transfer_s(s, "eu")),
    ("transfer_ap_s", |s| transfer_s(s, "ap")),
    ("reward_first_quarter", |s| s.reward.first_quarter),
    ("reward_last_quarter", |s| s.reward.last_quarter),
];

/// A region's mean transfer time (NaN when the run had no such region or none arrived).
fn transfer_s(s: &RealSummary, region: &str) -> f64 {
    s.mean_transfer_s.get(region).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trainer report line as `starling.grpo.trainer` writes it (keys it adds that this
    /// side does not read are kept).
    const TRAINER_LINE: &str = r#"{"step": 4, "batch": 4, "batch_version": 3,
        "sample_versions": [3, 3], "samples": 2, "completion_tokens": 40, "mean_reward": 0.5,
        "solved": 0.5, "loss": 0.1, "trained_samples": 2,
        "check": {"per_engine": {"vllm": {"samples": 2, "tokens": 40,
            "tokens_over_tolerance": 1, "max_abs_logprob_diff": 0.3, "tolerance": 0.25,
            "mean_abs_logprob_diff": 0.01}},
            "refused_groups": [], "verified": 2},
        "per_actor_samples": {"eu-a1": 2}, "per_actor_tokens": {"eu-a1": 40},
        "batch_created_at_ms": 1000.0, "last_accepted_at_ms": 5000.0,
        "loop_started_at_unix_ms": 0.0, "ended_at_unix_ms": 9000.0,
        "published": {"version": 4, "bytes": 650000, "changes": 700000, "density": 0.005,
            "at_unix_ms": 8000.0, "path": "/tmp/x.safetensors"},
        "seconds": {"step": 9.0}}"#;

    #[test]
    fn a_trainer_line_keeps_what_it_does_not_name_and_its_checks_add_up() {
        let step: TrainerStep = serde_json::from_str(TRAINER_LINE).expect("a trainer line");
        assert_eq!(step.check.other.get("verified"), Some(&Value::from(2)));
        let back = serde_json::to_value(&step).expect("serialize");
        assert_eq!(back["check"]["verified"], Value::from(2));
        assert_eq!(
            back["check"]["per_engine"]["vllm"]["mean_abs_logprob_diff"],
            Value::from(0.01)
        );
        let mut sum = EngineCheck::default();
        sum.add(&step.check.per_engine["vllm"]);
        sum.add(&EngineCheck {
            samples: 1.0,
            max_abs_logprob_diff: 0.1,
            ..EngineCheck::default()
        });
        assert_eq!(
            (sum.samples, sum.max_abs_logprob_diff, sum.tolerance),
            (3.0, 0.3, Some(0.25))
        );
    }

    #[test]
    fn unmeasured_figures_are_null_in_the_file_and_nan_when_read_back() {
        let figures = Figures(BTreeMap::from([
            ("steps_per_hour".to_owned(), 87.0),
            ("transfer_ap_s".to_owned(), f64::NAN),
        ]));
        let text = serde_json::to_string(&figures).expect("serialize");
        assert_eq!(text, r#"{"steps_per_hour":87.0,"transfer_ap_s":null}"#);
        let back: Figures = serde_json::from_str(&text).expect("read back");
        assert_eq!(back.get("steps_per_hour"), 87.0);
        assert!(back.get("transfer_ap_s").is_nan() && back.get("absent").is_nan());
    }
}
