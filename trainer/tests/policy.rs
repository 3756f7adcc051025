//! The differentiable policy against the engine the actors run, and its gradients.

use candle_core::{Device, Tensor};
use starling_engine::{Model, random_bf16};
use starling_trainer::grpo::{self, Sample};
use starling_trainer::optim::warm_start;
use starling_trainer::{Policy, ReverseDigits, demo_model_config};

fn setup(seed: u64) -> (Policy, Model) {
    let config = demo_model_config();
    let w = random_bf16(&config, seed);
    let policy = Policy::from_bf16(config.clone(), &w).expect("policy");
    let model = Model::from_tensors(config, &w).expect("engine");
    (policy, model)
}

#[test]
fn logits_match_the_engine_on_the_same_bf16_weights() {
    let (policy, model) = setup(3);
    let rows: Vec<Vec<u32>> = vec![vec![1, 52, 53, 54, 65], vec![1, 60, 61, 62, 63, 64, 70, 71]];
    let len = rows.iter().map(Vec::len).max().expect("rows");
    let mut flat = vec![0u32; rows.len() * len];
    for (i, r) in rows.iter().enumerate() {
        flat[i * len..i * len + r.len()].copy_from_slice(r);
    }
    let input = Tensor::from_vec(flat, (rows.len(), len), &Device::Cpu).expect("tensor");
    let logits = policy.logits(&input).expect("forward");
    let vocab = policy.config().vocab_size;
    let mut worst = 0f32;
    for (i, r) in rows.iter().enumerate() {
        for t in 1..=r.len() {
            let engine = model.logits(&r[..t]).expect("engine logits");
            let ours = logits
                .get(i)
                .and_then(|x| x.get(t - 1))
                .and_then(|x| x.to_vec1::<f32>())
                .expect("row");
            assert_eq!(ours.len(), vocab);
            for (a, b) in ours.iter().zip(&engine) {
                worst = worst.max((a - b).abs());
            }
        }
    }
    // Same math in f32 with different summation orders: agreement to float rounding.
    assert!(worst < 1e-3, "max |logit difference| = {worst}");
}

#[test]
fn bf16_round_trip_is_bit_exact() {
    let config = demo_model_config();
    let w = random_bf16(&config, 9);
    let policy = Policy::from_bf16(config, &w).expect("policy");
    let back = policy.to_bf16().expect("cast");
    for (name, t) in &w.0 {
        assert_eq!(back.0[name], *t, "{name}");
    }
}

#[test]
fn every_weight_gets_a_gradient_from_the_grpo_loss() {
    let (policy, _) = setup(5);
    let task = ReverseDigits::default();
    let samples: Vec<Sample> = (0..6)
        .map(|i| {
            let p = task.problem(1, i);
            let tokens = p.answer_ids();
            Sample {
                prompt_ids: p.prompt_ids(),
                logprobs: vec![-3.0; tokens.len()],
                tokens,
                advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
            }
        })
        .collect();
    let (loss, stats) = grpo::loss(&policy, &samples, 1.0, 0.2).expect("loss");
    assert!(stats.tokens > 0);
    let grads = loss.backward().expect("backward");
    for (name, _) in policy.config().tensor_shapes() {
        let var = policy.var(&name).expect("var");
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let norm = g
            .sqr()
            .and_then(|x| x.sum_all())
            .and_then(|x| x.to_scalar::<f32>())
            .expect("norm");
        assert!(norm > 0.0 && norm.is_finite(), "{name}: |grad|² = {norm}");
    }
}

#[test]
fn the_supervised_warm_start_lowers_the_loss() {
    let (policy, _) = setup(11);
    let losses = warm_start(&policy, &ReverseDigits::default(), 40, 16, 3e-3, 1).expect("sft");
    let first = losses[..5].iter().sum::<f32>() / 5.0;
    let last = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(last < 0.7 * first, "loss {first} -> {last}");
}
