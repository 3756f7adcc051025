//! GRPO's objective: group-normalised advantages and the token-level clipped policy-gradient
//! loss, computed against the **behaviour** log-probabilities the actors returned.
//!
//! For a group of `n` samples of one prompt with rewards `r_i`,
//! `A_i = (r_i − mean(r)) / (std(r) + ε)` (population std): a group whose samples all scored
//! the same teaches nothing and contributes no gradient. Each completion token `t` of sample `i`
//! contributes `−min(ρ_t·A_i, clip(ρ_t, 1−ε_c, 1+ε_c)·A_i)` with
//! `ρ_t = exp(log π_θ(t) − log π_behaviour(t))`; the loss is the mean over every completion token
//! of the batch (token-level, so long completions are not down-weighted). The behaviour
//! log-probabilities come from the version that generated the tokens (up to `max_staleness`
//! behind), so the ratio corrects for the one-step lag as PPO's does.

use candle_core::{DType, Device, Tensor};

use crate::policy::{Policy, PolicyError, token_logprobs};

/// One sampled completion ready for the loss.
#[derive(Debug, Clone)]
pub struct Sample {
    pub prompt_ids: Vec<u32>,
    pub tokens: Vec<u32>,
    /// Behaviour log-probabilities, one per token.
    pub logprobs: Vec<f32>,
    pub advantage: f32,
}

/// Group-normalised advantages of one group's rewards.
pub fn advantages(rewards: &[f32], eps: f32) -> Vec<f32> {
    if rewards.is_empty() {
        return Vec::new();
    }
    let n = rewards.len() as f32;
    let mean = rewards.iter().sum::<f32>() / n;
    let var = rewards.iter().map(|r| (r - mean) * (r - mean)).sum::<f32>() / n;
    let std = var.sqrt();
    rewards.iter().map(|r| (r - mean) / (std + eps)).collect()
}

/// Statistics of one loss evaluation.
#[derive(Debug, Clone, Copy, Default)]
pub struct LossStats {
    pub tokens: usize,
    /// Share of tokens whose ratio was clipped.
    pub clipped: f32,
    /// Mean |log π_θ − log π_behaviour| over tokens: the trainer/actor mismatch plus lag.
    pub mean_abs_logratio: f32,
}

/// The clipped token-level policy-gradient loss of `samples` (a scalar tensor to
/// backpropagate) with its statistics.
pub fn loss(
    policy: &Policy,
    samples: &[Sample],
    temperature: f32,
    clip_eps: f32,
) -> Result<(Tensor, LossStats), PolicyError> {
    let dev = policy.device();
    let rows: Vec<Vec<u32>> = samples
        .iter()
        .map(|s| s.prompt_ids.iter().chain(&s.tokens).copied().collect())
        .collect();
    let len = rows.iter().map(Vec::len).max().unwrap_or(0);
    let b = rows.len();
    let mut input = vec![0u32; b * len];
    let mut target = vec![0u32; b * len];
    let mut mask = vec![0f32; b * len];
    let mut old = vec![0f32; b * len];
    let mut adv = vec![0f32; b];
    for (i, (s, row)) in samples.iter().zip(&rows).enumerate() {
        input[i * len..i * len + row.len()].copy_from_slice(row);
        let p = s.prompt_ids.len();
        for (j, (&tok, &lp)) in s.tokens.iter().zip(&s.logprobs).enumerate() {
            // Token j of the completion sits at p + j and is predicted at p + j − 1.
            let at = i * len + p + j - 1;
            target[at] = tok;
            mask[at] = 1.0;
            old[at] = lp;
        }
        adv[i] = s.advantage;
    }
    let tokens = mask.iter().filter(|&&m| m > 0.0).count();
    let input = Tensor::from_vec(input, (b, len), dev)?;
    let target = Tensor::from_vec(target, (b, len), dev)?;
    let mask = Tensor::from_vec(mask, (b, len), dev)?;
    let old = Tensor::from_vec(old, (b, len), dev)?;
    let adv = Tensor::from_vec(adv, (b, 1), dev)?;

    let new = token_logprobs(&policy.logits(&input)?, &target, temperature)?;
    // Masked positions get log-ratio 0 (ratio 1) before exp, so padding cannot overflow.
    let logratio = ((new - &old)? * &mask)?;
    let ratio = logratio.exp()?;
    let unclipped = ratio.broadcast_mul(&adv)?;
    let clipped = ratio
        .clamp(1.0 - clip_eps, 1.0 + clip_eps)?
        .broadcast_mul(&adv)?;
    let per_token = (unclipped.minimum(&clipped)?.neg()? * &mask)?;
    let denom = tokens.max(1) as f64;
    let loss = (per_token.sum_all()? / denom)?;

    let r = ratio.flatten_all()?.to_vec1::<f32>()?;
    let m = mask.flatten_all()?.to_vec1::<f32>()?;
    let lr = logratio.flatten_all()?.to_vec1::<f32>()?;
    let mut n_clip = 0usize;
    let mut abs_lr = 0f64;
    for ((r, m), l) in r.iter().zip(&m).zip(&lr) {
        if *m > 0.0 {
            if (r - 1.0).abs() > clip_eps {
                n_clip += 1;
            }
            abs_lr += f64::from(l.abs());
        }
    }
    Ok((
        loss,
        LossStats {
            tokens,
            clipped: n_clip as f32 / tokens.max(1) as f32,
            mean_abs_logratio: (abs_lr / tokens.max(1) as f64) as f32,
        },
    ))
}

/// Supervised cross-entropy of `answers` given `prompts` (teacher forcing), for the warm start
/// that stands in for pre-training: the mean over answer tokens of `−log p(token)`.
pub fn supervised_loss(
    policy: &Policy,
    pairs: &[(Vec<u32>, Vec<u32>)],
) -> Result<Tensor, PolicyError> {
    let samples: Vec<Sample> = pairs
        .iter()
        .map(|(p, a)| Sample {
            prompt_ids: p.clone(),
            tokens: a.clone(),
            logprobs: vec![0.0; a.len()],
            advantage: 0.0,
        })
        .collect();
    let dev: &Device = policy.device();
    let len = samples
        .iter()
        .map(|s| s.prompt_ids.len() + s.tokens.len())
        .max()
        .unwrap_or(0);
    let b = samples.len();
    let mut input = vec![0u32; b * len];
    let mut target = vec![0u32; b * len];
    let mut mask = vec![0f32; b * len];
    for (i, s) in samples.iter().enumerate() {
        let p = s.prompt_ids.len();
        input[i * len..i * len + p].copy_from_slice(&s.prompt_ids);
        input[i * len + p..i * len + p + s.tokens.len()].copy_from_slice(&s.tokens);
        for (j, &tok) in s.tokens.iter().enumerate() {
            target[i * len + p + j - 1] = tok;
            mask[i * len + p + j - 1] = 1.0;
        }
    }
    let n = mask.iter().filter(|&&m| m > 0.0).count().max(1) as f64;
    let input = Tensor::from_vec(input, (b, len), dev)?;
    let target = Tensor::from_vec(target, (b, len), dev)?;
    let mask = Tensor::from_vec(mask, (b, len), dev)?.to_dtype(DType::F32)?;
    let lp = token_logprobs(&policy.logits(&input)?, &target, 1.0)?;
    Ok(((lp * mask)?.sum_all()?.neg()? / n)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_are_group_normalised() {
        let a = advantages(&[1.0, 0.0, 0.0, 1.0], 1e-6);
        for (x, want) in a.iter().zip([1.0, -1.0, -1.0, 1.0]) {
            assert!((x - want).abs() < 1e-4, "{a:?}");
        }
        assert!(advantages(&[0.5; 4], 1e-6).iter().all(|&x| x == 0.0));
        assert!(advantages(&[], 1e-6).is_empty());
    }
}
