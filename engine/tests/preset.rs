//! The workload generator's presets are Qwen3 checkpoints this engine loads and runs.

use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_in_memory};
use starling_engine::{GenRequest, GenerateOptions, Model, ModelConfig, Sampling};

#[test]
fn every_preset_config_parses_and_lists_exactly_the_preset_tensors() {
    for name in ModelSpec::PRESETS {
        let spec = ModelSpec::preset(name).expect("preset");
        let cfg = ModelConfig::from_value(spec.qwen3_config_json().expect("config json"))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<(String, Vec<usize>)> = spec
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.shape.iter().map(|&d| d as usize).collect(),
                )
            })
            .collect();
        assert_eq!(cfg.tensor_shapes(), want, "{name}");
        assert_eq!(cfg.parameter_count(), spec.numel(), "{name}");
    }
}

#[test]
fn tiny_preset_weights_generate_finite_logprobs() {
    let spec = ModelSpec::preset("tiny").expect("preset");
    let cfg = ModelConfig::from_value(spec.qwen3_config_json().expect("json")).expect("config");
    let steps = generate_in_memory(&spec, 0, &TrainConfig::default());
    let shapes: std::collections::HashMap<String, Vec<usize>> =
        cfg.tensor_shapes().into_iter().collect();
    let model = Model::from_bf16(cfg, |name| {
        Some((shapes.get(name)?.as_slice(), steps[0].get(name)?.as_slice()))
    })
    .expect("the generator's checkpoint loads");
    let reqs: Vec<GenRequest> = (0..4)
        .map(|i| GenRequest {
            prompt: vec![1, 10 + i, 20 + i, 30],
            sampling: Sampling {
                temperature: if i == 0 { 0.0 } else { 1.0 },
                max_new_tokens: 16,
                seed: u64::from(i),
                ..Sampling::default()
            },
            sample_index: i,
        })
        .collect();
    let out = model
        .generate(&reqs, GenerateOptions::default())
        .expect("generate");
    for o in &out {
        assert_eq!(o.tokens.len(), 16);
        assert!(
            o.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0),
            "{:?}",
            o.logprobs
        );
    }
    let logits = model.logits(&[1, 2, 3]).expect("logits");
    assert!(logits.iter().all(|l| l.is_finite()));
}
