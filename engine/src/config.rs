//! The model's hyper-parameters, read from (and written as) a Hugging Face `config.json` for
//! `Qwen3ForCausalLM`.
//!
//! Parsing is followed by validation ([`ModelConfig::validate`]): a config that parses but
//! could not describe a working Qwen3 (zero sizes, query heads not a multiple of the KV heads,
//! an activation other than SiLU, q/k/v biases) is refused with the field named, so a
//! [`crate::Model`] never exists for an impossible shape. [`ModelConfig::tensor_shapes`] lists
//! every tensor such a model has, in the checkpoint's own names, so a caller can check a
//! checkpoint against the config before loading it.

use serde::{Deserialize, Serialize};

/// A Qwen3 `config.json` (the fields this engine uses; unknown fields are ignored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(default = "default_architectures")]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    /// Rotary base. Older configs state it here; transformers 5 writes it inside
    /// `rope_parameters` instead, from where parsing copies it.
    #[serde(default = "f64_nan")]
    pub rope_theta: f64,
    /// transformers 5's rotary settings (`{"rope_theta": …, "rope_type": "default"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_dtype")]
    pub torch_dtype: String,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    /// Must be absent or null: scaled rotary variants are not implemented.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Must be false: sliding-window attention is not implemented.
    #[serde(default)]
    pub use_sliding_window: bool,
}

fn f64_nan() -> f64 {
    f64::NAN
}

fn default_architectures() -> Vec<String> {
    vec!["Qwen3ForCausalLM".to_owned()]
}
fn default_model_type() -> String {
    "qwen3".to_owned()
}
fn default_dtype() -> String {
    "bfloat16".to_owned()
}
fn default_act() -> String {
    "silu".to_owned()
}

/// Why a config cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("parse config.json")]
    Parse(#[from] serde_json::Error),
    #[error("read config.json")]
    Io(#[from] std::io::Error),
    #[error("config field `{field}`: {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
}

fn invalid(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        problem: problem.into(),
    }
}

impl ModelConfig {
    /// Parses and validates a `config.json` document.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        serde_json::from_str::<Self>(text)?.resolved()
    }

    /// Parses and validates a `config.json` value (e.g. one built by the workload generator).
    pub fn from_value(v: serde_json::Value) -> Result<Self, ConfigError> {
        serde_json::from_value::<Self>(v)?.resolved()
    }

    /// Takes `rope_theta` from `rope_parameters` when only that is given, then validates.
    fn resolved(mut self) -> Result<Self, ConfigError> {
        if let Some(p) = &self.rope_parameters {
            let kind = p
                .get("rope_type")
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            if kind != "default" {
                return Err(invalid(
                    "rope_parameters",
                    format!("rope_type {kind:?} is unsupported (only \"default\")"),
                ));
            }
            if self.rope_theta.is_nan()
                && let Some(theta) = p.get("rope_theta").and_then(serde_json::Value::as_f64)
            {
                self.rope_theta = theta;
            }
        }
        if self.rope_theta.is_nan() {
            return Err(invalid("rope_theta", "missing"));
        }
        self.validate()?;
        Ok(self)
    }

    /// Reads, parses and validates a `config.json` file (the crate's only I/O).
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        Self::from_json(&std::fs::read_to_string(path)?)
    }

    /// The config as pretty-printed JSON, in the layout Hugging Face writes.
    pub fn to_json(&self) -> String {
        // Serializing plain fields of known types cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Checks that the config describes a Qwen3 this engine can run.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.model_type != "qwen3" {
            return Err(invalid(
                "model_type",
                format!("{:?}, expected \"qwen3\"", self.model_type),
            ));
        }
        if !self.architectures.iter().any(|a| a == "Qwen3ForCausalLM") {
            return Err(invalid(
                "architectures",
                format!("{:?} lacks \"Qwen3ForCausalLM\"", self.architectures),
            ));
        }
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be nonzero"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!("{} is odd; rotary embedding needs pairs", self.head_dim),
            ));
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(invalid("vocab_size", "exceeds u32 token ids"));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid(
                "rms_norm_eps",
                format!("{} must be positive", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(invalid(
                "rope_theta",
                format!("{} must be finite and > 1", self.rope_theta),
            ));
        }
        if self.hidden_act != "silu" {
            return Err(invalid(
                "hidden_act",
                format!("{:?} unsupported (only \"silu\")", self.hidden_act),
            ));
        }
        if self.attention_bias {
            return Err(invalid(
                "attention_bias",
                "true is unsupported (Qwen3 has no q/k/v biases)",
            ));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(invalid(
                "rope_scaling",
                "scaled rotary embeddings are unsupported",
            ));
        }
        if self.use_sliding_window {
            return Err(invalid(
                "use_sliding_window",
                "sliding-window attention is unsupported",
            ));
        }
        for (field, id) in [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
        ] {
            if let Some(id) = id
                && id as usize >= self.vocab_size
            {
                return Err(invalid(
                    field,
                    format!("{id} is outside the vocabulary ({})", self.vocab_size),
                ));
            }
        }
        Ok(())
    }

    /// Query heads sharing one KV head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Every tensor of the model with its shape, in checkpoint names, sorted by name (the
    /// order safetensors files list them in).
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v, hd) = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.head_dim,
        );
        let q = self.num_attention_heads * hd;
        let kv = self.num_key_value_heads * hd;
        let mut t = vec![
            ("model.embed_tokens.weight".to_owned(), vec![v, h]),
            ("model.norm.weight".to_owned(), vec![h]),
        ];
        if !self.tie_word_embeddings {
            t.push(("lm_head.weight".to_owned(), vec![v, h]));
        }
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            t.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
                (format!("{p}.self_attn.q_norm.weight"), vec![hd]),
                (format!("{p}.self_attn.k_norm.weight"), vec![hd]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t
    }

    /// Number of parameters (elements over all tensors).
    pub fn parameter_count(&self) -> u64 {
        self.tensor_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }
}
