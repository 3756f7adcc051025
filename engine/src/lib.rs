//! `starling-engine`: Starling's built-in inference engine.
//!
//! A decoder-only transformer of the Qwen3 or the Llama family with Hugging Face tensor
//! names (`Qwen3ForCausalLM`, `LlamaForCausalLM`; [`config::Family`]), run on the CPU in f32
//! from BF16 weights. Rollout actors generate
//! with it; tests and trainers recompute log-probabilities with it. It is a pure library:
//! no async runtime and no I/O beyond [`ModelConfig::from_file`].
//!
//! - [`config`]: the `config.json` (parse, validate, the expected tensor list);
//! - [`kernels`]: dot products, matmul, norms, rotary, attention, with fixed reduction orders;
//! - [`input`]: [`InputError`], why a request's input cannot be run (shared by `model` and
//!   `sampling`);
//! - [`model`]: loading BF16 weights, the forward pass, [`Model::score`], [`Model::logits`];
//! - [`sampling`]: greedy / temperature / top-k / top-p with a counter-based generator, and the
//!   log-probability definition;
//! - [`generate`]: batched decoding with a KV cache, [`Model::generate`];
//! - [`tokenizer`]: a byte tokenizer;
//! - [`weights`]: in-memory BF16 tensors and random weights for tests and benchmarks.
//!
//! **Invariant: determinism.** Every output bit is a function of the weights and the request
//! alone: not of the batch it runs in, of whether it is computed incrementally with the KV
//! cache or in one pass over the whole sequence, nor of the thread count. Hence
//! [`Model::score`] returns exactly the log-probabilities [`Model::generate`] reported. See
//! [`kernels`] and [`model`] for how.

pub mod config;
pub mod generate;
pub mod input;
pub mod kernels;
pub mod model;
pub mod sampling;
pub mod tokenizer;
pub mod weights;

pub use config::{ConfigError, Family, ModelConfig, RopeScaling, TokenIds};
pub use generate::{FinishReason, GenOutput, GenRequest, GenerateError, GenerateOptions};
pub use input::InputError;
pub use model::{KvCache, LoadError, Model};
pub use sampling::Sampling;
pub use tokenizer::{ByteTokenizer, TokenizerError};
pub use weights::{Bf16Tensor, Bf16Tensors, random_bf16};
