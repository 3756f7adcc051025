//! Token selection and the log-probabilities reported with it.
//!
//! **Log-probability definition.** The log-probability reported for a token (by
//! [`crate::Model::generate`] and [`crate::Model::score`] alike) is
//! `log_softmax(logits / T)[token]` over the **full vocabulary**, with `T` the request's
//! temperature and `T = 1` when the temperature is 0 (greedy). It is *not* truncated or
//! renormalized by top-k / top-p: it is the tempered policy's probability, which a trainer
//! recomputes from its own forward pass with the same formula to form its importance ratio.
//! (With top-k/top-p on, the sampling distribution differs from this policy on the
//! truncated tail; that is the usual convention of inference engines and trainers.)
//!
//! **Sampling.** Temperature 0 is greedy argmax (ties to the lowest id). Otherwise the
//! logits are divided by `T`, top-k keeps the `k` largest (ties to lower ids), top-p keeps
//! the smallest prefix of the remaining tokens sorted by probability whose mass reaches
//! `p` of theirs (at least one token), and one token is drawn by inverse CDF with a uniform
//! from a **counter-based** generator keyed on `(seed, sample_index, position)`
//! ([`uniform`]). Nothing is carried from step to step and nothing depends on other
//! sequences, so a sample's tokens are a pure function of its request and the weights.

use starling_rng::{GAMMA, mix64};

use crate::input::InputError;
use crate::kernels;

/// How to pick tokens for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 = greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: u32,
    pub max_new_tokens: u32,
    /// Generation stops after any of these (which is kept as the last token).
    pub stop_token_ids: Vec<u32>,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 16,
            stop_token_ids: Vec::new(),
            seed: 0,
        }
    }
}

impl Sampling {
    /// Greedy decoding of up to `max_new_tokens`.
    pub fn greedy(max_new_tokens: u32) -> Self {
        Self {
            temperature: 0.0,
            max_new_tokens,
            ..Self::default()
        }
    }

    pub(crate) fn validate(&self) -> Result<(), InputError> {
        check_temperature(self.temperature)?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(InputError::TopP(self.top_p));
        }
        Ok(())
    }
}

pub(crate) fn check_temperature(t: f32) -> Result<(), InputError> {
    if t.is_finite() && t >= 0.0 {
        Ok(())
    } else {
        Err(InputError::Temperature(t))
    }
}

/// `logits / T` (T = 1 when the temperature is 0).
fn tempered(logits: &[f32], temperature: f32, out: &mut Vec<f32>) {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    out.clear();
    out.extend(logits.iter().map(|&l| l / t));
}

fn max(xs: &[f32]) -> f32 {
    xs.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `log_softmax(logits / T)[token]` over the full vocabulary (see the module doc).
pub fn token_logprob(logits: &[f32], temperature: f32, token: u32) -> f32 {
    let mut z = Vec::with_capacity(logits.len());
    tempered(logits, temperature, &mut z);
    let m = max(&z);
    let zt = z[token as usize];
    for v in z.iter_mut() {
        *v = (*v - m).exp();
    }
    (zt - m) - kernels::sum(&z).ln()
}

/// The full `log_softmax(logits / T)` (for tests and diagnostics; same formula as
/// [`token_logprob`]).
pub fn log_softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    let mut z = Vec::with_capacity(logits.len());
    tempered(logits, temperature, &mut z);
    let m = max(&z);
    let e: Vec<f32> = z.iter().map(|&v| (v - m).exp()).collect();
    let lse = kernels::sum(&e).ln();
    z.iter().map(|&v| (v - m) - lse).collect()
}

/// Index of the largest logit, the lowest such index on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The uniform in `[0, 1)` (53 bits) used to draw the token at `position` (0-based, in the
/// whole sequence) of sample `sample_index` under `seed`: SplitMix64's finalizer chained
/// over the three keys. Stateless, so any token can be redrawn on its own.
pub fn uniform(seed: u64, sample_index: u32, position: u64) -> f64 {
    let mut s = mix64(seed ^ 0x5851_F42D_4C95_7F2D);
    s = mix64(s ^ u64::from(sample_index).wrapping_mul(GAMMA));
    s = mix64(s ^ position.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (s >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Reusable buffers for [`sample`].
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    z: Vec<f32>,
    cand: Vec<u32>,
}

/// Orders by probability, descending, then by id.
fn by_prob(z: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    |&a, &b| {
        z[b as usize]
            .total_cmp(&z[a as usize])
            .then_with(|| a.cmp(&b))
    }
}

/// Picks the token at `position` of sample `sample_index` (see the module doc).
pub(crate) fn sample(
    logits: &[f32],
    s: &Sampling,
    sample_index: u32,
    position: u64,
    scratch: &mut Scratch,
) -> u32 {
    if s.temperature == 0.0 {
        return argmax(logits);
    }
    let Scratch { z, cand } = scratch;
    tempered(logits, s.temperature, z);
    let m = max(z);
    let vocab = z.len();
    cand.clear();
    cand.extend(0..vocab as u32);
    let k = s.top_k as usize;
    let sorted = if k > 0 && k < vocab {
        cand.select_nth_unstable_by(k - 1, by_prob(z));
        cand.truncate(k);
        cand.sort_unstable_by(by_prob(z));
        true
    } else {
        false
    };
    let w = |i: u32| f64::from((z[i as usize] - m).exp());
    if s.top_p < 1.0 {
        let total: f64 = cand.iter().map(|&i| w(i)).sum();
        let need = f64::from(s.top_p) * total;
        if !sorted {
            // Sort only the tokens that can be in the nucleus: those above a threshold
            // holding at least the needed mass (falling back to all when rounding says
            // the threshold was too tight).
            let mut tau = 0.1f64;
            loop {
                let mass: f64 = cand.iter().map(|&i| w(i)).filter(|&x| x >= tau).sum();
                if mass >= need || tau < 1e-30 {
                    break;
                }
                tau *= 0.01;
            }
            let all = cand.clone();
            cand.retain(|&i| w(i) >= tau);
            cand.sort_unstable_by(by_prob(z));
            let reach: f64 = cand.iter().map(|&i| w(i)).sum();
            if reach < need {
                *cand = all;
                cand.sort_unstable_by(by_prob(z));
            }
        }
        let mut cum = 0.0;
        let mut keep = cand.len();
        for (j, &i) in cand.iter().enumerate() {
            cum += w(i);
            if cum >= need {
                keep = j + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
    }
    let mass: f64 = cand.iter().map(|&i| w(i)).sum();
    let target = uniform(s.seed, sample_index, position) * mass;
    let mut cum = 0.0;
    for &i in cand.iter() {
        cum += w(i);
        if cum > target {
            return i;
        }
    }
    cand.last().copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_draws_are_pinned() {
        // Reference outputs (53-bit numerators): every seeded sample depends on them.
        let scale = 1.0 / (1u64 << 53) as f64;
        assert_eq!(uniform(0, 0, 0), 636_713_938_271_307.0 * scale);
        assert_eq!(uniform(1, 2, 3), 7_018_592_952_155_167.0 * scale);
        assert_eq!(uniform(42, 7, 1000), 7_637_032_441_220_791.0 * scale);
    }

    fn run(logits: &[f32], s: &Sampling, pos: u64) -> u32 {
        sample(logits, s, 0, pos, &mut Scratch::default())
    }

    #[test]
    fn greedy_picks_lowest_id_on_ties() {
        assert_eq!(argmax(&[0.0, 2.0, 1.0, 2.0]), 1);
        assert_eq!(run(&[0.0, 2.0, 1.0, 2.0], &Sampling::greedy(1), 0), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [3.0, 2.9, 0.0, -1.0, 2.95, -5.0];
        let topk = Sampling {
            top_k: 2,
            ..Sampling::default()
        };
        // top_p small: only the most likely token survives.
        let topp = Sampling {
            top_p: 0.05,
            ..Sampling::default()
        };
        let mut seen_k = std::collections::BTreeSet::new();
        for pos in 0..400 {
            seen_k.insert(run(&logits, &topk, pos));
            assert_eq!(run(&logits, &topp, pos), 0);
        }
        assert_eq!(seen_k, [0, 4].into_iter().collect());
        // Plain sampling reaches the unlikely tokens too.
        let plain = Sampling::default();
        let all: std::collections::BTreeSet<u32> =
            (0..2000).map(|p| run(&logits, &plain, p)).collect();
        assert!(all.contains(&2) && all.contains(&3), "{all:?}");
    }

    #[test]
    fn nucleus_keeps_the_smallest_prefix_reaching_p() {
        // Probabilities ∝ e^z: 0.5, 0.3, 0.2 (after normalization).
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let s = Sampling {
            top_p: 0.75,
            ..Sampling::default()
        };
        let seen: std::collections::BTreeSet<u32> = (0..500).map(|p| run(&logits, &s, p)).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn uniform_is_keyed_on_all_three_counters() {
        let u = uniform(1, 2, 3);
        assert!((0.0..1.0).contains(&u));
        assert_ne!(u, uniform(2, 2, 3));
        assert_ne!(u, uniform(1, 3, 3));
        assert_ne!(u, uniform(1, 2, 4));
        assert_eq!(u, uniform(1, 2, 3));
    }

    #[test]
    fn log_softmax_normalizes_and_matches_token_logprob() {
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 / 7.0).collect();
        for t in [0.0, 0.7, 1.0, 2.0] {
            let ls = log_softmax(&logits, t);
            let total: f64 = ls.iter().map(|&l| f64::from(l).exp()).sum();
            assert!((total - 1.0).abs() < 1e-5, "t {t}: {total}");
            for tok in [0u32, 17, 299] {
                assert_eq!(
                    ls[tok as usize].to_bits(),
                    token_logprob(&logits, t, tok).to_bits()
                );
            }
        }
    }
}
