//! One optimizer step with global gradient-norm clipping, and the supervised warm start.

use candle_core::{Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

use crate::grpo;
use crate::policy::{Policy, PolicyError};
use crate::task::ReverseDigits;

/// Backpropagates `loss`, scales the gradients so their global L2 norm is at most `max_norm`,
/// and applies `opt`. Returns the norm before clipping.
pub fn clipped_step(
    opt: &mut AdamW,
    vars: &[Var],
    loss: &Tensor,
    max_norm: f64,
) -> candle_core::Result<f64> {
    let mut grads = loss.backward()?;
    let mut sq = 0f64;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
        }
    }
    let norm = sq.sqrt();
    if norm > max_norm && norm.is_finite() {
        let scale = max_norm / norm;
        for v in vars {
            if let Some(g) = grads.remove(v.as_tensor()) {
                grads.insert(v.as_tensor(), (g * scale)?);
            }
        }
    }
    if norm.is_finite() {
        opt.step(&grads)?;
    }
    Ok(norm)
}

/// The supervised warm start that stands in for pre-training: `steps` AdamW steps of
/// teacher-forced cross-entropy on `batch` problems each (problem stream keyed by `seed`, kept
/// apart from the RL stream). Returns the loss of each step.
pub fn warm_start(
    policy: &Policy,
    task: &ReverseDigits,
    steps: u32,
    batch: usize,
    lr: f64,
    seed: u64,
) -> Result<Vec<f32>, PolicyError> {
    let mut opt = AdamW::new(
        policy.vars(),
        ParamsAdamW {
            lr,
            weight_decay: 0.0,
            ..ParamsAdamW::default()
        },
    )?;
    let vars = policy.vars();
    let mut losses = Vec::new();
    for s in 0..steps {
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = (0..batch)
            .map(|i| {
                let p = task.problem(seed ^ 0x5EED_0000, u64::from(s) * batch as u64 + i as u64);
                (p.prompt_ids(), p.answer_ids())
            })
            .collect();
        let loss = grpo::supervised_loss(policy, &pairs)?;
        clipped_step(&mut opt, &vars, &loss, 1.0)?;
        losses.push(loss.to_scalar::<f32>()?);
    }
    Ok(losses)
}
