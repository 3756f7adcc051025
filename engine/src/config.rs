//! The model's hyper-parameters, read from (and written as) a Hugging Face `config.json` for
//! one of the architectures the engine runs ([`Family`]): `Qwen3ForCausalLM` and
//! `LlamaForCausalLM`.
//!
//! The family is chosen from `architectures` and `model_type`; any other architecture is
//! refused with a sentence naming it and the ones the engine knows. Parsing is followed by
//! validation ([`ModelConfig::validate`]): a config that parses but could not describe a
//! working model (zero sizes, query heads not a multiple of the KV heads, an activation other
//! than SiLU, q/k/v or MLP biases, a rotary scaling the engine does not implement) is refused
//! with the field named, so a [`crate::Model`] never exists for an impossible shape.
//!
//! The two families differ only where the engine branches: Qwen3 normalises each head of q
//! and k (RMSNorm, `q_norm`/`k_norm`) before the rotary embedding, Llama does not; Llama's
//! `head_dim` defaults to `hidden_size / num_attention_heads`; Llama configs may scale the
//! rotary frequencies (`rope_scaling` or transformers 5's `rope_parameters`: `linear` and
//! `llama3` are implemented, as transformers computes them; other kinds are refused by name). [`ModelConfig::tensor_shapes`] lists
//! every tensor such a model has, in the checkpoint's own names, so a caller can check a
//! checkpoint against the config before loading it.

use serde::{Deserialize, Serialize};

/// A `config.json` of a family the engine runs (the fields it uses; unknown fields are
/// ignored).
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
    /// Width of one attention head. Optional in Llama configs (then `hidden_size /
    /// num_attention_heads`, filled in by parsing).
    #[serde(default)]
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
    /// One id or a list (Llama 3 stops on several).
    #[serde(default, skip_serializing_if = "TokenIds::is_empty")]
    pub eos_token_id: TokenIds,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    /// Must be false (Llama's optional MLP biases are not implemented).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mlp_bias: bool,
    /// The rotary scaling as older configs state it (`{"rope_type": "llama3", …}`); absent or
    /// null for none.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Must be false: sliding-window attention is not implemented.
    #[serde(default)]
    pub use_sliding_window: bool,
}

/// Token ids a config states as one number or a list (`eos_token_id`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenIds(pub Vec<u32>);

impl TokenIds {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for TokenIds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_u32(*one),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(u32),
            Many(Vec<u32>),
        }
        Ok(match Option::<OneOrMany>::deserialize(d)? {
            None => TokenIds::default(),
            Some(OneOrMany::One(id)) => TokenIds(vec![id]),
            Some(OneOrMany::Many(ids)) => TokenIds(ids),
        })
    }
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

/// The architectures the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `Qwen3ForCausalLM` (`model_type` `qwen3`): per-head q/k RMSNorm.
    Qwen3,
    /// `LlamaForCausalLM` (`model_type` `llama`): SmolLM, Llama 2/3.
    Llama,
}

impl Family {
    /// `(architecture, model_type)` of every family, for error messages.
    pub const KNOWN: [(&'static str, &'static str); 2] =
        [("Qwen3ForCausalLM", "qwen3"), ("LlamaForCausalLM", "llama")];

    pub fn architecture(self) -> &'static str {
        match self {
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Llama => "LlamaForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3 => "qwen3",
            Family::Llama => "llama",
        }
    }

    /// Whether q and k are RMS-normalised per head before the rotary embedding.
    pub fn has_qk_norm(self) -> bool {
        self == Family::Qwen3
    }
}

/// How the rotary frequencies are scaled (transformers' `rope_type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `default`: `θ^(-2i/d)`.
    None,
    /// `linear`: every frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between
    /// (transformers' `_compute_llama3_parameters`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Why a config cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("parse config.json")]
    Parse(#[from] serde_json::Error),
    #[error("read config.json")]
    Io(#[from] std::io::Error),
    #[error(
        "architecture {architectures:?} (model_type {model_type:?}) is not supported: this engine runs {known}"
    )]
    Architecture {
        architectures: Vec<String>,
        model_type: String,
        known: String,
    },
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

    /// Takes `rope_theta` from `rope_parameters` when only that is given, fills in a
    /// Llama's default `head_dim`, then validates.
    fn resolved(mut self) -> Result<Self, ConfigError> {
        if let Some(p) = &self.rope_parameters
            && self.rope_theta.is_nan()
            && let Some(theta) = p.get("rope_theta").and_then(serde_json::Value::as_f64)
        {
            self.rope_theta = theta;
        }
        if self.rope_theta.is_nan() {
            return Err(invalid("rope_theta", "missing"));
        }
        if self.head_dim == 0
            && self.num_attention_heads > 0
            && self.family()? == Family::Llama
            && self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            self.head_dim = self.hidden_size / self.num_attention_heads;
        }
        self.validate()?;
        Ok(self)
    }

    /// The architecture, from `architectures` and `model_type` (both must agree).
    pub fn family(&self) -> Result<Family, ConfigError> {
        let found = [Family::Qwen3, Family::Llama].into_iter().find(|f| {
            self.model_type == f.model_type()
                && self.architectures.iter().any(|a| a == f.architecture())
        });
        found.ok_or_else(|| ConfigError::Architecture {
            architectures: self.architectures.clone(),
            model_type: self.model_type.clone(),
            known: Family::KNOWN
                .iter()
                .map(|(a, m)| format!("{a} (model_type {m:?})"))
                .collect::<Vec<_>>()
                .join(" and "),
        })
    }

    /// The rotary scaling the config states (`rope_scaling`, else `rope_parameters`).
    pub fn rope_scaling(&self) -> Result<RopeScaling, ConfigError> {
        let (field, spec) = match (&self.rope_scaling, &self.rope_parameters) {
            (Some(s), _) if !s.is_null() => ("rope_scaling", s),
            (_, Some(p)) if !p.is_null() => ("rope_parameters", p),
            _ => return Ok(RopeScaling::None),
        };
        let kind = spec
            .get("rope_type")
            .or_else(|| spec.get("type"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("default");
        let num = |key: &str| -> Result<f64, ConfigError> {
            spec.get(key)
                .and_then(serde_json::Value::as_f64)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| {
                    invalid(
                        field,
                        format!("{kind} scaling needs a positive number `{key}`"),
                    )
                })
        };
        match kind {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear {
                factor: num("factor")?,
            }),
            "llama3" => {
                let s = RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                };
                if let RopeScaling::Llama3 {
                    low_freq_factor: lo,
                    high_freq_factor: hi,
                    ..
                } = s
                    && hi <= lo
                {
                    return Err(invalid(
                        field,
                        format!("high_freq_factor {hi} must exceed low_freq_factor {lo}"),
                    ));
                }
                Ok(s)
            }
            other => Err(invalid(
                field,
                format!("rope_type {other:?} is not implemented (default, linear and llama3 are)"),
            )),
        }
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

    /// Checks that the config describes a model this engine can run.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let family = self.family()?;
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
                format!(
                    "true is unsupported (the engine's {} has no q/k/v/o biases)",
                    family.architecture()
                ),
            ));
        }
        if self.mlp_bias {
            return Err(invalid("mlp_bias", "true is unsupported"));
        }
        self.rope_scaling()?;
        if self.use_sliding_window {
            return Err(invalid(
                "use_sliding_window",
                "sliding-window attention is unsupported",
            ));
        }
        let ids = self.bos_token_id.iter().map(|&i| ("bos_token_id", i));
        for (field, id) in ids.chain(self.eos_token_id.0.iter().map(|&i| ("eos_token_id", i))) {
            if id as usize >= self.vocab_size {
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
        let qk_norm = self.family().is_ok_and(Family::has_qk_norm);
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
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
            if qk_norm {
                t.extend([
                    (format!("{p}.self_attn.q_norm.weight"), vec![hd]),
                    (format!("{p}.self_attn.k_norm.weight"), vec![hd]),
                ]);
            }
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
