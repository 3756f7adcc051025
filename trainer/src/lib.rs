//! `starling-trainer`: Starling's built-in GRPO trainer, for the demo and the tests.
//!
//! It trains a small Qwen3 (the same architecture and tensor names the actors' built-in engine
//! runs) on a synthetic verifiable task, through the hub's trainer HTTP API, the way any
//! external trainer would: FP32 master weights, AdamW, a BF16 cast after each step written as
//! safetensors and published by path.
//!
//! - [`policy`]: the differentiable model (candle ops with backward passes for every weight);
//! - [`behaviour`]: every consumed rollout's log-probs recomputed, bit for bit, on the BF16
//!   weights of the version it is tagged with;
//! - [`grpo`]: group-normalised advantages, the clipped token-level loss, the supervised loss;
//! - [`optim`]: a clipped AdamW step and the supervised warm start;
//! - [`task`]: digit reversal, the task;
//! - [`hub`]: the trainer API client;
//! - [`run`]: the loop, with the one-step lag between rollouts and training.

pub mod behaviour;
pub mod grpo;
pub mod hub;
pub mod optim;
pub mod policy;
pub mod run;
pub mod task;

pub use hub::HubClient;
pub use policy::Policy;
pub use run::{StepReport, TrainConfig, Trainer};
pub use task::ReverseDigits;

use starling_engine::ModelConfig;

/// The demo's model: Qwen3's layout at toy size (2 layers, width 64, 4 query and 2 KV heads
/// of 16, SwiGLU 192, the byte tokenizer's 259 ids; ~0.13 M parameters), small enough to train
/// in seconds per step on two cores.
pub fn demo_model_config() -> ModelConfig {
    let v = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": starling_engine::ByteTokenizer::VOCAB, "hidden_size": 64,
        "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    });
    // A literal that the engine's own validation accepts (tested below).
    ModelConfig::from_value(v).expect("the demo config is valid")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_demo_config_is_valid() {
        let c = super::demo_model_config();
        assert!(c.validate().is_ok());
        assert!(c.parameter_count() < 200_000);
    }
}
