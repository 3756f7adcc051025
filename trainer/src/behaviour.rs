//! The trainer's own check that every rollout it consumes came from the version it is tagged
//! with: each sample's log-probabilities are recomputed with `starling-engine`'s
//! [`Model::score`] on the BF16 weights of that version (the bits the trainer itself
//! published) and compared **bit for bit** with what the actor returned.
//!
//! Why bit for bit: the built-in engine's kernels do not depend on batch composition, so a
//! forward pass over the same weights and tokens reproduces generation's log-probabilities
//! exactly (`docs/api.md`, "Log-probabilities"). Any difference means the tokens were not
//! produced by those weights: an actor that applied a delta wrongly, loaded the wrong version,
//! or forged its results. A tolerance would let a one-ULP weight error through.
//!
//! The trainer keeps the BF16 models of the versions results may still come from (the
//! newest `max_staleness + 2`); at 8B parameters that would be 16 GB each on the trainer, which
//! is why a production trainer recomputes log-probs in its own framework on the versions it
//! still holds; here the models are ~0.3 MB.

use std::collections::BTreeMap;
use std::sync::Arc;

use starling_engine::{Bf16Tensors, Model, ModelConfig};

use crate::hub::{GroupOut, SampleOut};

/// Why a sample's log-probabilities could not be checked or did not match.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Mismatch {
    #[error("version {0} is not held by the trainer (older than its window)")]
    UnknownVersion(u64),
    #[error("{tokens} tokens but {logprobs} log-probabilities")]
    Lengths { tokens: usize, logprobs: usize },
    #[error("version span [{start}, {end}) does not fit the sample's {len} tokens")]
    Span {
        start: usize,
        end: usize,
        len: usize,
    },
    #[error("the tokens cannot be scored: {0}")]
    Input(String),
    #[error(
        "token {index}: the actor reported log-prob {reported:e}, version {version} gives {recomputed:e}"
    )]
    Differs {
        index: usize,
        version: u64,
        reported: f32,
        recomputed: f32,
    },
}

/// The BF16 models of recent versions, by version.
#[derive(Debug)]
pub struct Versions {
    config: ModelConfig,
    models: BTreeMap<u64, Arc<Model>>,
    keep: usize,
}

impl Versions {
    /// Keeps the newest `keep` versions (at least 1).
    pub fn new(config: ModelConfig, keep: usize) -> Self {
        Self {
            config,
            models: BTreeMap::new(),
            keep: keep.max(1),
        }
    }

    /// Remembers `version` as the given BF16 tensors (exactly the published bits).
    pub fn insert(
        &mut self,
        version: u64,
        tensors: &Bf16Tensors,
    ) -> Result<(), starling_engine::LoadError> {
        let model = Model::from_tensors(self.config.clone(), tensors)?;
        self.models.insert(version, Arc::new(model));
        while self.models.len() > self.keep {
            self.models.pop_first();
        }
        Ok(())
    }

    /// Checks one sample of `group` at `temperature`: every token's log-probability,
    /// recomputed under the version that produced it.
    pub fn check(
        &self,
        group: &GroupOut,
        sample: &SampleOut,
        temperature: f32,
    ) -> Result<(), Mismatch> {
        let len = sample.tokens.len();
        if sample.logprobs.len() != len {
            return Err(Mismatch::Lengths {
                tokens: len,
                logprobs: sample.logprobs.len(),
            });
        }
        let whole = [crate::hub::VersionSpan {
            version: group.version,
            start: 0,
            end: len,
        }];
        let spans = if sample.versions.is_empty() {
            &whole[..]
        } else {
            &sample.versions[..]
        };
        for span in spans {
            if span.start > span.end || span.end > len {
                return Err(Mismatch::Span {
                    start: span.start,
                    end: span.end,
                    len,
                });
            }
            if span.start == span.end {
                continue;
            }
            let model = self
                .models
                .get(&span.version)
                .ok_or(Mismatch::UnknownVersion(span.version))?;
            let recomputed = model
                .score(&group.prompt_ids, &sample.tokens[..span.end], temperature)
                .map_err(|e| Mismatch::Input(e.to_string()))?;
            let reported = &sample.logprobs[span.start..span.end];
            let again = &recomputed[span.start..span.end];
            if let Some(k) =
                (0..reported.len()).find(|&k| reported[k].to_bits() != again[k].to_bits())
            {
                return Err(Mismatch::Differs {
                    index: span.start + k,
                    version: span.version,
                    reported: reported[k],
                    recomputed: again[k],
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::VersionSpan;
    use starling_engine::{GenRequest, GenerateOptions, Sampling, random_bf16};

    fn generated(model: &Model, version: u64) -> (GroupOut, SampleOut) {
        let prompt = vec![1, 52, 53, 54];
        let req = GenRequest {
            prompt: prompt.clone(),
            sampling: Sampling {
                temperature: 1.0,
                max_new_tokens: 6,
                seed: 7,
                ..Sampling::default()
            },
            sample_index: 0,
        };
        let out = model
            .generate(&[req], GenerateOptions::default())
            .expect("generate")
            .remove(0);
        let group = GroupOut {
            cursor: 1,
            group: 0,
            actor: "a".into(),
            version,
            prompt_ids: prompt,
            samples: Vec::new(),
        };
        let sample = SampleOut {
            tokens: out.tokens.clone(),
            logprobs: out.logprobs.clone(),
            reward: 0.0,
            tokens_per_s: 0.0,
            versions: vec![VersionSpan {
                version,
                start: 0,
                end: out.tokens.len(),
            }],
        };
        (group, sample)
    }

    #[test]
    fn a_sample_checks_against_its_own_version_and_no_other() {
        let config = crate::demo_model_config();
        let v3 = random_bf16(&config, 3);
        let mut v4 = v3.clone();
        // Version 4 differs from 3 in one BF16 ULP of one weight.
        let t = v4.0.get_mut("lm_head.weight").expect("lm_head");
        t.bits[0] ^= 1;
        let mut versions = Versions::new(config.clone(), 2);
        versions.insert(3, &v3).expect("v3");
        versions.insert(4, &v4).expect("v4");
        let m3 = Model::from_tensors(config, &v3).expect("model");
        let (group, sample) = generated(&m3, 3);
        assert_eq!(versions.check(&group, &sample, 1.0), Ok(()));

        // The same tokens claimed for version 4: one ULP of lm_head shows.
        let mut as_v4 = group.clone();
        as_v4.version = 4;
        let mut s4 = sample.clone();
        s4.versions[0].version = 4;
        assert!(matches!(
            versions.check(&as_v4, &s4, 1.0),
            Err(Mismatch::Differs { version: 4, .. })
        ));

        // A log-prob changed by one ULP is caught.
        let mut forged = sample.clone();
        forged.logprobs[1] = f32::from_bits(forged.logprobs[1].to_bits() + 1);
        assert!(matches!(
            versions.check(&group, &forged, 1.0),
            Err(Mismatch::Differs { index: 1, .. })
        ));

        // Versions outside the window, spans that do not fit, lengths that disagree.
        let mut old = sample.clone();
        old.versions[0].version = 2;
        assert_eq!(
            versions.check(&group, &old, 1.0),
            Err(Mismatch::UnknownVersion(2))
        );
        let mut long = sample.clone();
        long.versions[0].end = sample.tokens.len() + 1;
        assert!(matches!(
            versions.check(&group, &long, 1.0),
            Err(Mismatch::Span { .. })
        ));
        let mut short = sample;
        short.logprobs.pop();
        assert!(matches!(
            versions.check(&group, &short, 1.0),
            Err(Mismatch::Lengths { .. })
        ));
    }

    #[test]
    fn only_the_newest_versions_are_kept() {
        let config = crate::demo_model_config();
        let w = random_bf16(&config, 1);
        let mut versions = Versions::new(config, 2);
        for v in 0..4 {
            versions.insert(v, &w).expect("insert");
        }
        assert_eq!(versions.models.keys().copied().collect::<Vec<_>>(), [2, 3]);
    }
}
