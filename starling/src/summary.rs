//! `summary.json` of one toy run (`toy_run`), as one typed record: `toy_run` writes it,
//! `demo` prints from it, `compare` takes its figures and nests it in `compare.json`
//! (`docs/demo.md`). The fields are named here once; readers outside the binary (the demo's
//! integration test) read the same names from the file.
//!
//! A figure that could not be measured (no steps, no region reached) is NaN in memory and
//! `null` in the file, and `null` reads back as NaN ([`figure`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use starling_trainer::StepReport;

use crate::cluster::Mode;

/// One run in one mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Summary {
    pub(crate) mode: Mode,
    pub(crate) model: ModelSummary,
    pub(crate) task: String,
    pub(crate) settings: Settings,
    pub(crate) regions: Vec<RegionSummary>,
    pub(crate) reward: Reward,
    pub(crate) bytes: Bytes,
    /// Mean share of weights a version changed.
    #[serde(with = "figure")]
    pub(crate) delta_density: f64,
    /// Mean over regions of the bytes each link carried towards its region, per step.
    #[serde(with = "figure")]
    pub(crate) link_bytes_per_step: f64,
    /// Per region.
    pub(crate) link_bytes: BTreeMap<String, LinkBytes>,
    /// Per region: mean seconds from publish to every actor active.
    #[serde(with = "figures")]
    pub(crate) mean_transfer_s: BTreeMap<String, f64>,
    #[serde(with = "figure")]
    pub(crate) rollouts_per_s: f64,
    pub(crate) throughput: Throughput,
    pub(crate) behaviour_check: BehaviourCheck,
    /// Accepted samples' share per actor.
    pub(crate) per_actor_share: BTreeMap<String, f64>,
    pub(crate) wall_s: f64,
    pub(crate) steps: Vec<StepSummary>,
}

/// The model trained.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ModelSummary {
    pub(crate) parameters: u64,
    pub(crate) bf16_bytes: u64,
    pub(crate) config: starling_engine::ModelConfig,
}

/// The run's options.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Settings {
    pub(crate) steps: u32,
    pub(crate) groups: usize,
    pub(crate) samples_per_group: u32,
    pub(crate) lr: f64,
    pub(crate) warm_steps: u32,
    pub(crate) seed: u64,
    pub(crate) max_staleness: u32,
    pub(crate) engine_slowdown: f64,
}

/// One emulated region and its actors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RegionSummary {
    pub(crate) name: String,
    pub(crate) rate_mbit: f64,
    pub(crate) rtt_ms: u64,
    pub(crate) loss: f64,
    pub(crate) actors: Vec<ActorSummary>,
}

/// One actor of a region.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ActorSummary {
    pub(crate) name: String,
    pub(crate) speed: u32,
    pub(crate) vllm: bool,
}

/// Mean reward over the first and the last `averaged_over_steps` steps.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Reward {
    #[serde(with = "figure")]
    pub(crate) first: f64,
    #[serde(with = "figure")]
    pub(crate) last: f64,
    pub(crate) averaged_over_steps: usize,
}

/// What the hub encoded, against full BF16 checkpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Bytes {
    pub(crate) deltas: u64,
    pub(crate) per_step: f64,
    pub(crate) full_checkpoints: u64,
    pub(crate) ratio: f64,
}

/// What one region's emulated link carried.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LinkBytes {
    pub(crate) to_region: u64,
    pub(crate) to_hub: u64,
    pub(crate) lost_datagrams: u64,
}

/// Over the training loop (first submit to last publish).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Throughput {
    pub(crate) loop_s: f64,
    #[serde(with = "figure")]
    pub(crate) steps_per_hour: f64,
    #[serde(with = "figure")]
    pub(crate) rollout_tokens_per_s: f64,
    #[serde(with = "figure")]
    pub(crate) samples_per_s: f64,
    #[serde(with = "figure")]
    pub(crate) median_step_s: f64,
}

/// Consumed rollouts' log-probs recomputed on their version.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct BehaviourCheck {
    pub(crate) verified_samples: usize,
    pub(crate) mismatches: usize,
    pub(crate) first_mismatch: Option<String>,
}

/// One trainer step and when its version reached each region.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StepSummary {
    pub(crate) report: StepReport,
    /// Region → seconds from publish to every actor active; `None` where it had not.
    pub(crate) arrival_s: Option<BTreeMap<String, Option<f64>>>,
}

/// A region as the summaries state it.
pub(crate) fn region_summary(r: &crate::links::Region) -> RegionSummary {
    RegionSummary {
        name: r.name.to_owned(),
        rate_mbit: r.rate_mbit,
        rtt_ms: r.rtt_ms,
        loss: r.loss,
        actors: r
            .actors
            .iter()
            .map(|a| ActorSummary {
                name: a.name.to_owned(),
                speed: a.speed,
                vllm: a.vllm,
            })
            .collect(),
    }
}

/// An `f64` that is `null` in the file when it is not finite, and NaN when read back from
/// `null` (serde_json writes NaN and ±Inf as `null` but refuses `null` for an `f64`).
pub(crate) mod figure {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else {
            s.serialize_none()
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// [`figure`] for every value of a map.
pub(crate) mod figures {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(crate) fn serialize<S: Serializer>(
        m: &BTreeMap<String, f64>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let m: BTreeMap<&str, Option<f64>> = m
            .iter()
            .map(|(k, x)| (k.as_str(), x.is_finite().then_some(*x)))
            .collect();
        m.serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, f64>, D::Error> {
        let m = BTreeMap::<String, Option<f64>>::deserialize(d)?;
        Ok(m.into_iter()
            .map(|(k, x)| (k, x.unwrap_or(f64::NAN)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary() -> Summary {
        let config = starling_trainer::demo_model_config();
        Summary {
            mode: Mode::NoTransfer,
            model: ModelSummary {
                parameters: config.parameter_count(),
                bf16_bytes: 2 * config.parameter_count(),
                config,
            },
            task: "t".into(),
            settings: Settings {
                steps: 2,
                groups: 8,
                samples_per_group: 8,
                lr: 1e-3,
                warm_steps: 10,
                seed: 7,
                max_staleness: 1,
                engine_slowdown: 1.0,
            },
            regions: vec![RegionSummary {
                name: "eu".into(),
                rate_mbit: 100.0,
                rtt_ms: 40,
                loss: 0.0,
                actors: vec![ActorSummary {
                    name: "eu-a1".into(),
                    speed: 3,
                    vllm: false,
                }],
            }],
            reward: Reward {
                first: 0.25,
                last: f64::NAN,
                averaged_over_steps: 1,
            },
            bytes: Bytes {
                deltas: 10,
                per_step: 5.0,
                full_checkpoints: 100,
                ratio: 0.1,
            },
            delta_density: 0.5,
            link_bytes_per_step: 7.0,
            link_bytes: [(
                "eu".to_owned(),
                LinkBytes {
                    to_region: 14,
                    to_hub: 3,
                    lost_datagrams: 0,
                },
            )]
            .into(),
            mean_transfer_s: [("eu".to_owned(), 0.5), ("ap".to_owned(), f64::NAN)].into(),
            rollouts_per_s: 3.0,
            throughput: Throughput {
                loop_s: 2.0,
                steps_per_hour: 3600.0,
                rollout_tokens_per_s: 10.0,
                samples_per_s: 1.0,
                median_step_s: 1.0,
            },
            behaviour_check: BehaviourCheck {
                verified_samples: 128,
                mismatches: 0,
                first_mismatch: None,
            },
            per_actor_share: [("eu-a1".to_owned(), 1.0)].into(),
            wall_s: 3.0,
            steps: Vec::new(),
        }
    }

    /// The names `docs/demo.md`, the demo's integration test and `compare.json` readers use.
    #[test]
    fn the_file_keeps_its_names_and_reads_back() {
        let s = summary();
        let v = serde_json::to_value(&s).expect("serializes");
        assert_eq!(v["mode"], "no-transfer");
        assert_eq!(v["bytes"]["deltas"], 10);
        assert_eq!(v["bytes"]["full_checkpoints"], 100);
        assert_eq!(v["link_bytes"]["eu"]["to_region"], 14);
        assert_eq!(v["mean_transfer_s"]["eu"], 0.5);
        assert_eq!(v["per_actor_share"]["eu-a1"], 1.0);
        assert_eq!(v["behaviour_check"]["verified_samples"], 128);
        assert_eq!(v["throughput"]["steps_per_hour"], 3600.0);
        assert_eq!(v["settings"]["samples_per_group"], 8);
        assert_eq!(v["regions"][0]["actors"][0]["speed"], 3);
        assert!(v["steps"].as_array().is_some_and(Vec::is_empty));
        // What could not be measured is `null`, and NaN again when read back.
        assert!(v["reward"]["last"].is_null() && v["mean_transfer_s"]["ap"].is_null());
        let text = serde_json::to_string_pretty(&s).expect("serializes");
        let back: Summary = serde_json::from_str(&text).expect("reads back");
        assert!(back.reward.last.is_nan() && back.mean_transfer_s["ap"].is_nan());
        assert_eq!(back.reward.first, 0.25);
        assert_eq!(serde_json::to_value(&back).expect("serializes"), v);
    }
}
