//! The built-in trainer's loop: GRPO through the hub's trainer API, exactly as an external
//! trainer would drive it (HTTP, a trainer token, checkpoints the hub reads by path).
//!
//! Each step: collect batch `k`'s accepted groups (rewards computed by the hub), submit batch
//! `k+1` for the newest version **before** training (so actors generate it while the trainer
//! computes the update: SparrowRL's one-step lag, enforced by the hub's `max_staleness`), take
//! one AdamW step on the FP32 master weights with the GRPO loss, cast to BF16, write the
//! checkpoint atomically and publish it; the hub diffs it and ships the delta. With
//! `pipelined = false` batch `k+1` is submitted only after version `k+1` is published (fully
//! on-policy, slower).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::behaviour::Versions;
use crate::grpo::{self, Sample};
use crate::hub::{GroupOut, HubClient, HubError, Published};
use crate::policy::{Policy, PolicyError, write_bf16};
use crate::task::{Problem, ReverseDigits};
use starling_engine::Bf16Tensors;
use starling_rng::SplitMix64;

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Hub(#[from] HubError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("batch {batch} did not finish within {secs} s ({accepted} groups accepted)")]
    BatchTimeout {
        batch: u64,
        secs: u64,
        accepted: usize,
    },
    #[error("keep version {version} for the log-prob check")]
    Keep {
        version: u64,
        source: starling_engine::LoadError,
    },
    #[error("create checkpoint directory {path}")]
    Dir {
        path: String,
        source: std::io::Error,
    },
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub steps: u32,
    pub groups_per_batch: usize,
    pub samples_per_group: u32,
    pub temperature: f32,
    pub lr: f64,
    pub clip_eps: f32,
    pub max_grad_norm: f64,
    pub max_staleness: u32,
    /// The hub verifier that scores completions (`char_match` or `exact_match`).
    pub verifier: String,
    pub seed: u64,
    pub pipelined: bool,
    /// Where checkpoints are written; the hub must be able to read them by the same path.
    pub checkpoint_dir: PathBuf,
    /// Hand each step's file over to the hub, which takes it by a rename instead of copying
    /// it (`docs/api.md`, "Handover"): the trainer never reads it again, and the directory
    /// then keeps only the files the hub could not take.
    pub handover: bool,
    pub task: ReverseDigits,
    /// Give up on a batch after this long.
    pub batch_timeout: Duration,
    /// Recompute every consumed sample's log-probs on its version's BF16 weights and train
    /// only on samples that match bit for bit ([`crate::behaviour`]).
    pub verify_logprobs: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 20,
            groups_per_batch: 32,
            samples_per_group: 8,
            temperature: 1.0,
            lr: 2e-3,
            clip_eps: 0.2,
            max_grad_norm: 1.0,
            max_staleness: 1,
            verifier: "char_match".into(),
            seed: 1,
            pipelined: true,
            checkpoint_dir: PathBuf::from("checkpoints"),
            handover: true,
            task: ReverseDigits::default(),
            batch_timeout: Duration::from_secs(300),
            verify_logprobs: true,
        }
    }
}

/// What one step did, for progress lines, the summary and the plot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepReport {
    pub step: u32,
    pub batch: u64,
    /// The version the batch was submitted for.
    pub batch_version: u64,
    /// Versions that produced the accepted tokens (min, max).
    pub sample_versions: (u64, u64),
    pub groups_accepted: usize,
    pub groups_failed: usize,
    pub samples: usize,
    pub tokens: usize,
    pub mean_reward: f32,
    /// Share of samples whose reward is 1 (fully correct).
    pub solved: f32,
    pub loss: f32,
    pub grad_norm: f32,
    pub clipped: f32,
    pub mean_abs_logratio: f32,
    /// Seconds from submitting the batch to its last accepted group.
    pub rollout_s: f64,
    /// Seconds the trainer waited for results (0 when the batch was already done).
    pub wait_s: f64,
    pub train_s: f64,
    /// Seconds the publish call took (diff, durable write, ledger row).
    pub publish_s: f64,
    pub step_s: f64,
    /// Samples per second of rollout time.
    pub rollouts_per_s: f64,
    pub published: PublishedReport,
    /// The BF16 checkpoint this step wrote and published (the hub's now, and gone from this
    /// path, when it was handed over).
    pub checkpoint: PathBuf,
    /// Accepted samples per actor.
    pub per_actor: BTreeMap<String, usize>,
    /// Samples whose log-probs were recomputed on their version's weights.
    pub verified_samples: usize,
    /// Of those, samples that did not match bit for bit (their groups were not trained on).
    pub logprob_mismatches: usize,
    /// The first mismatch's explanation, if any.
    pub first_mismatch: Option<String>,
    /// Seconds the log-prob recomputation took.
    pub verify_s: f64,
}

/// The hub's answer to this step's publish.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublishedReport {
    pub version: u64,
    pub changes: u64,
    pub delta_bytes: u64,
    pub digest: String,
    /// Whether the hub took the step's file (handover) rather than copying it.
    #[serde(default)]
    pub handed_over: bool,
}

impl From<Published> for PublishedReport {
    fn from(p: Published) -> Self {
        Self {
            version: p.version,
            changes: p.changes,
            delta_bytes: p.bytes,
            digest: p.digest,
            handed_over: p.handed_over,
        }
    }
}

struct Pending {
    batch: u64,
    version: u64,
    problems: Vec<Problem>,
    submitted: Instant,
}

/// The GRPO trainer bound to a hub.
#[derive(Debug)]
pub struct Trainer {
    policy: Policy,
    opt: AdamW,
    cfg: TrainConfig,
    hub: HubClient,
    problems_issued: u64,
    /// The BF16 models of the versions results may still come from.
    versions: Versions,
}

impl Trainer {
    /// A trainer starting from `policy`, whose weights must be the hub's latest version.
    pub fn new(policy: Policy, cfg: TrainConfig, hub: HubClient) -> Result<Self, TrainError> {
        let opt = AdamW::new(
            policy.vars(),
            ParamsAdamW {
                lr: cfg.lr,
                // No decay: a weight with no gradient keeps its exact bits, as most weights of
                // an RL step do, so the delta carries only what the update touched.
                weight_decay: 0.0,
                ..ParamsAdamW::default()
            },
        )?;
        let versions = Versions::new(policy.config().clone(), cfg.max_staleness as usize + 2);
        Ok(Self {
            policy,
            opt,
            cfg,
            hub,
            problems_issued: 0,
            versions,
        })
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Runs `cfg.steps` steps starting at hub version `start_version`; calls `on_step` after
    /// each publish.
    pub fn run(
        &mut self,
        start_version: u64,
        mut on_step: impl FnMut(&StepReport),
    ) -> Result<Vec<StepReport>, TrainError> {
        std::fs::create_dir_all(&self.cfg.checkpoint_dir).map_err(|source| TrainError::Dir {
            path: self.cfg.checkpoint_dir.display().to_string(),
            source,
        })?;
        let mut reports = Vec::new();
        let mut latest = start_version;
        self.keep_version(start_version, &self.policy.to_bf16()?)?;
        let mut pending = self.submit(latest)?;
        for step in 0..self.cfg.steps {
            let t0 = Instant::now();
            let (groups, failed, rollout_s) = self.collect(&pending)?;
            let wait_s = t0.elapsed().as_secs_f64();
            let tv = Instant::now();
            let check = self.check_behaviour(&groups);
            let verify_s = tv.elapsed().as_secs_f64();
            let last = step + 1 == self.cfg.steps;
            let next = if self.cfg.pipelined && !last {
                Some(self.submit(latest)?)
            } else {
                None
            };
            let t1 = Instant::now();
            let (samples, stats) = self.samples(&groups, &check.bad_groups);
            let (loss, grad_norm, ls) = self.update(&samples)?;
            let train_s = t1.elapsed().as_secs_f64();
            let t2 = Instant::now();
            let path = self
                .cfg
                .checkpoint_dir
                .join(format!("step-{:06}.safetensors", step + 1));
            let bf16 = self.policy.to_bf16()?;
            write_bf16(&bf16, &path)?;
            let published = self
                .hub
                .publish(&path, u64::from(step) + 1, self.cfg.handover)?;
            let publish_s = t2.elapsed().as_secs_f64();
            latest = published.version;
            self.keep_version(latest, &bf16)?;
            let report = StepReport {
                step: step + 1,
                batch: pending.batch,
                batch_version: pending.version,
                sample_versions: stats.versions,
                groups_accepted: groups.len(),
                groups_failed: failed,
                samples: stats.samples,
                tokens: stats.tokens,
                mean_reward: stats.mean_reward,
                solved: stats.solved,
                loss,
                grad_norm,
                clipped: ls.clipped,
                mean_abs_logratio: ls.mean_abs_logratio,
                rollout_s,
                wait_s,
                train_s,
                publish_s,
                step_s: t0.elapsed().as_secs_f64(),
                rollouts_per_s: stats.samples as f64 / rollout_s.max(1e-9),
                published: published.into(),
                checkpoint: path,
                per_actor: stats.per_actor,
                verified_samples: check.verified,
                logprob_mismatches: check.mismatches,
                first_mismatch: check.first,
                verify_s,
            };
            on_step(&report);
            reports.push(report);
            pending = match next {
                Some(p) => p,
                None if !last => self.submit(latest)?,
                None => break,
            };
        }
        Ok(reports)
    }

    fn submit(&mut self, version: u64) -> Result<Pending, TrainError> {
        let problems: Vec<Problem> = (0..self.cfg.groups_per_batch)
            .map(|i| {
                self.cfg
                    .task
                    .problem(self.cfg.seed, self.problems_issued + i as u64)
            })
            .collect();
        self.problems_issued += problems.len() as u64;
        let mut rng = SplitMix64::new(self.cfg.seed ^ self.problems_issued);
        let body = json!({
            "version": version,
            "max_staleness": self.cfg.max_staleness,
            "sampling": {
                "temperature": self.cfg.temperature,
                "max_new_tokens": self.cfg.task.max_answer_tokens() + 2,
                "stop_token_ids": [starling_engine::ByteTokenizer::EOS],
                "seed": rng.next_u64() >> 11,
            },
            "groups": problems.iter().map(|p| json!({
                "prompt": p.prompt, "n": self.cfg.samples_per_group,
                "verifier": self.cfg.verifier, "answer": p.answer,
            })).collect::<Vec<_>>(),
        });
        let s = self.hub.submit(&body)?;
        Ok(Pending {
            batch: s.batch,
            version: s.version,
            problems,
            submitted: Instant::now(),
        })
    }

    /// Every accepted group of the batch, the number that failed, and the rollout time.
    fn collect(&self, p: &Pending) -> Result<(Vec<GroupOut>, usize, f64), TrainError> {
        let mut groups = Vec::new();
        let mut cursor = 0;
        let mut rollout_s = 0.0;
        loop {
            let page = self.hub.results(p.batch, cursor, 5_000)?;
            if !page.results.is_empty() {
                rollout_s = p.submitted.elapsed().as_secs_f64();
            }
            cursor = page.cursor.max(cursor);
            groups.extend(page.results);
            if page.done {
                break;
            }
            if p.submitted.elapsed() > self.cfg.batch_timeout {
                return Err(TrainError::BatchTimeout {
                    batch: p.batch,
                    secs: self.cfg.batch_timeout.as_secs(),
                    accepted: groups.len(),
                });
            }
        }
        let failed = p.problems.len().saturating_sub(groups.len());
        Ok((groups, failed, rollout_s))
    }

    fn keep_version(&mut self, version: u64, bf16: &Bf16Tensors) -> Result<(), TrainError> {
        self.versions
            .insert(version, bf16)
            .map_err(|source| TrainError::Keep { version, source })
    }

    /// Recomputes every sample's log-probs on its version (in parallel over the machine's
    /// cores); a group with any mismatching sample is not trained on.
    fn check_behaviour(&self, groups: &[GroupOut]) -> BehaviourCheck {
        let mut out = BehaviourCheck::default();
        if !self.cfg.verify_logprobs {
            return out;
        }
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(groups.len().max(1));
        let chunk = groups.len().div_ceil(threads).max(1);
        let temperature = self.cfg.temperature;
        let versions = &self.versions;
        let results: Vec<Vec<(usize, usize, Option<String>)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .chunks(chunk)
                .enumerate()
                .map(|(c, part)| {
                    scope.spawn(move || {
                        part.iter()
                            .enumerate()
                            .map(|(i, g)| {
                                let mut bad = 0;
                                let mut first = None;
                                for s in &g.samples {
                                    if let Err(e) = versions.check(g, s, temperature) {
                                        bad += 1;
                                        first.get_or_insert_with(|| {
                                            format!(
                                                "group {} from {} (version {}): {e}",
                                                g.group, g.actor, g.version
                                            )
                                        });
                                    }
                                }
                                (c * chunk + i, bad, first)
                            })
                            .collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(c, h)| {
                    // A check that panicked proves nothing: its groups count as mismatched.
                    h.join().unwrap_or_else(|_| {
                        (c * chunk..((c + 1) * chunk).min(groups.len()))
                            .map(|i| {
                                let why = format!("group {}: the check panicked", groups[i].group);
                                (i, groups[i].samples.len(), Some(why))
                            })
                            .collect()
                    })
                })
                .collect()
        });
        for (index, bad, first) in results.into_iter().flatten() {
            out.verified += groups[index].samples.len();
            if bad > 0 {
                out.mismatches += bad;
                out.bad_groups.insert(index);
                if out.first.is_none() {
                    out.first = first;
                }
            }
        }
        out
    }

    fn samples(
        &self,
        groups: &[GroupOut],
        bad_groups: &std::collections::BTreeSet<usize>,
    ) -> (Vec<Sample>, BatchStats) {
        let mut out = Vec::new();
        let mut st = BatchStats {
            versions: (u64::MAX, 0),
            ..BatchStats::default()
        };
        let mut reward_sum = 0f64;
        let mut solved = 0usize;
        for (index, g) in groups.iter().enumerate() {
            let trusted = !bad_groups.contains(&index);
            let rewards: Vec<f32> = g.samples.iter().map(|s| s.reward).collect();
            let adv = grpo::advantages(&rewards, 1e-4);
            st.versions = (st.versions.0.min(g.version), st.versions.1.max(g.version));
            *st.per_actor.entry(g.actor.clone()).or_default() += g.samples.len();
            for (s, a) in g.samples.iter().zip(adv) {
                st.samples += 1;
                st.tokens += s.tokens.len();
                reward_sum += f64::from(s.reward);
                solved += usize::from(s.reward >= 1.0);
                if trusted && a != 0.0 && !s.tokens.is_empty() && s.tokens.len() == s.logprobs.len()
                {
                    out.push(Sample {
                        prompt_ids: g.prompt_ids.clone(),
                        tokens: s.tokens.clone(),
                        logprobs: s.logprobs.clone(),
                        advantage: a,
                    });
                }
            }
        }
        if st.samples == 0 {
            st.versions = (0, 0);
        }
        st.mean_reward = (reward_sum / st.samples.max(1) as f64) as f32;
        st.solved = solved as f32 / st.samples.max(1) as f32;
        (out, st)
    }

    /// One optimizer step; returns the loss, the gradient norm before clipping and the loss
    /// statistics. A batch with no informative sample (every group scored uniformly) leaves the
    /// weights unchanged.
    fn update(&mut self, samples: &[Sample]) -> Result<(f32, f32, grpo::LossStats), TrainError> {
        if samples.is_empty() {
            return Ok((0.0, 0.0, grpo::LossStats::default()));
        }
        let (loss, stats) = grpo::loss(
            &self.policy,
            samples,
            self.cfg.temperature,
            self.cfg.clip_eps,
        )?;
        let norm = crate::optim::clipped_step(
            &mut self.opt,
            &self.policy.vars(),
            &loss,
            self.cfg.max_grad_norm,
        )?;
        Ok((loss.to_scalar::<f32>()?, norm as f32, stats))
    }
}

/// The outcome of [`Trainer::check_behaviour`] for one batch.
#[derive(Debug, Default)]
struct BehaviourCheck {
    verified: usize,
    mismatches: usize,
    first: Option<String>,
    /// Indices of groups not to train on.
    bad_groups: std::collections::BTreeSet<usize>,
}

#[derive(Debug, Default)]
struct BatchStats {
    versions: (u64, u64),
    samples: usize,
    tokens: usize,
    mean_reward: f32,
    solved: f32,
    per_actor: BTreeMap<String, usize>,
}
