//! Measures the built-in engine's generation speed on a random model shaped like the
//! workload generator's `small` preset (~6 M parameters: hidden 256, 4 layers, vocab 8192).
//!
//! `cargo run --release -p starling-engine --bin engine-bench [-- --threads N --new N]`

use std::time::Instant;

use starling_engine::{GenRequest, GenerateOptions, Model, ModelConfig, Sampling, random_bf16};

fn arg(args: &[String], name: &str) -> Option<usize> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1)?.parse().ok()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cfg = ModelConfig::from_value(serde_json::json!({
        "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 704,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 2048, "tie_word_embeddings": false
    }));
    let cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("failed to build the config: {:#}", anyhow::Error::from(e));
            std::process::exit(1);
        }
    };
    let weights = random_bf16(&cfg, 1);
    let mut model = match Model::from_tensors(cfg, &weights) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("failed to load the model: {:#}", anyhow::Error::from(e));
            std::process::exit(1);
        }
    };
    if let Some(t) = arg(&args, "--threads") {
        model.set_threads(t);
    }
    let new = arg(&args, "--new").unwrap_or(64) as u32;
    let prompt_len = arg(&args, "--prompt").unwrap_or(16);
    println!(
        "model: {:.1} M parameters, {} threads, prompt {prompt_len}, {new} new tokens, T = 1",
        model.parameter_count() as f64 / 1e6,
        model.threads()
    );
    for batch in [1usize, 8, 32] {
        let reqs: Vec<GenRequest> = (0..batch)
            .map(|i| GenRequest {
                prompt: (0..prompt_len)
                    .map(|j| ((i * 131 + j * 7) % 8192) as u32)
                    .collect(),
                sampling: Sampling {
                    temperature: 1.0,
                    max_new_tokens: new,
                    seed: 1,
                    ..Sampling::default()
                },
                sample_index: i as u32,
            })
            .collect();
        let start = Instant::now();
        let out = match model.generate(&reqs, GenerateOptions { max_batch: batch }) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("failed to generate: {e}");
                std::process::exit(1);
            }
        };
        let wall = start.elapsed().as_secs_f64();
        let tokens: usize = out.iter().map(|o| o.tokens.len()).sum();
        let decode = out
            .iter()
            .map(|o| o.decode_time.as_secs_f64())
            .fold(0f64, f64::max);
        let prefill = out
            .iter()
            .map(|o| o.prefill_time.as_secs_f64())
            .fold(0f64, f64::max);
        println!(
            "batch {batch:>2}: {tokens:>5} tokens in {wall:.3} s = {:>7.0} tokens/s \
             (prefill {:.1} ms, decode {:.0} tokens/s)",
            tokens as f64 / wall,
            prefill * 1e3,
            (tokens - batch) as f64 / decode.max(1e-9),
        );
    }
}
