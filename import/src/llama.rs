//! The Llama family in GGUF: llama.cpp's tensor names and metadata keys mapped to Hugging
//! Face's `LlamaForCausalLM` (tensor names, `config.json`), and the reversal of llama.cpp's
//! rotary row permutation.
//!
//! llama.cpp's converter permutes the rows of `attn_q` and `attn_k` so that its rotary kernel
//! can rotate adjacent pairs; Hugging Face rotates the two halves of each head instead.
//! transformers undoes the permutation when it loads a GGUF (`reverse_permute` in its GGUF
//! loader): within each head of `head_dim` rows, GGUF row `2i + s` is Hugging Face row
//! `s · head_dim/2 + i`. [`unpermute_rows`] does the same. Pure functions.
//!
//! RoPE scaling is carried over only where the metadata states it (`llama.rope.scaling.type`
//! `linear`). llama.cpp stores Llama 3.1/3.2's `llama3` scaling as nothing but a tensor of
//! per-frequency factors, `rope_freqs.weight`; `config.json`'s `rope_scaling` needs `factor`,
//! `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`, which those
//! factors do not determine (only two ratios of them, and only where some frequency falls
//! between the two thresholds). Dropping the tensor would write a model that silently differs
//! from the original at long range, so a file carrying it is refused ([`LlamaError::RopeFreqs`]).

use serde_json::{Value as Json, json};

use crate::gguf::{Header, TensorInfo, Value};

/// Why a GGUF file does not describe a Llama this importer can write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LlamaError {
    #[error("general.architecture is {0:?}; this importer knows \"llama\" (LlamaForCausalLM) only")]
    Architecture(String),
    #[error("metadata key {key}: {problem}")]
    Metadata { key: String, problem: String },
    #[error("tensor {0} is not part of a Llama checkpoint this importer knows")]
    UnknownTensor(String),
    #[error("tensor {name} has shape {found:?}, the config says {expected:?}")]
    Shape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor {0} is missing")]
    Missing(String),
    #[error(
        "this GGUF carries rope_freqs.weight (llama.cpp's form of Llama 3.1-style \"llama3\" RoPE \
         scaling), which the importer cannot express as config.json's rope_scaling (its factor, \
         low/high frequency factors and original context are not recoverable from the tensor); \
         dropping it would change the model at long range. Import from the Hugging Face \
         checkpoint instead"
    )]
    RopeFreqs,
}

/// The hyper-parameters of a Llama, read from GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    pub num_key_value_heads: u64,
    pub head_dim: u64,
    pub max_position_embeddings: u64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `rope_scaling` as transformers states it (`{"rope_type": "linear", "factor": 4.0}`).
    pub rope_scaling: Option<Json>,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    pub pad_token_id: Option<u64>,
}

fn meta_err(key: &str, problem: impl Into<String>) -> LlamaError {
    LlamaError::Metadata {
        key: key.to_owned(),
        problem: problem.into(),
    }
}

fn req_u64(h: &Header, key: &str) -> Result<u64, LlamaError> {
    let v = h
        .get(key)
        .ok_or_else(|| meta_err(key, "missing"))?
        .as_u64()
        .ok_or_else(|| meta_err(key, "not a non-negative integer"))?;
    if v == 0 {
        return Err(meta_err(key, "must be nonzero"));
    }
    Ok(v)
}

fn opt_f64(h: &Header, key: &str) -> Result<Option<f64>, LlamaError> {
    match h.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| meta_err(key, "not a finite number")),
    }
}

impl LlamaParams {
    /// Reads the parameters of a `llama` GGUF.
    pub fn from_header(h: &Header) -> Result<Self, LlamaError> {
        let arch = h
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| meta_err("general.architecture", "missing"))?;
        if arch != "llama" {
            return Err(LlamaError::Architecture(arch.to_owned()));
        }
        let heads = req_u64(h, "llama.attention.head_count")?;
        let hidden = req_u64(h, "llama.embedding_length")?;
        let kv_heads = match h.get("llama.attention.head_count_kv") {
            None => heads,
            Some(_) => req_u64(h, "llama.attention.head_count_kv")?,
        };
        if !heads.is_multiple_of(kv_heads) {
            return Err(meta_err(
                "llama.attention.head_count_kv",
                format!("{kv_heads} does not divide head_count {heads}"),
            ));
        }
        let head_dim = match h.get("llama.attention.key_length") {
            Some(_) => req_u64(h, "llama.attention.key_length")?,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => {
                return Err(meta_err(
                    "llama.attention.head_count",
                    format!("{heads} does not divide embedding_length {hidden}"),
                ));
            }
        };
        let tokens = h
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .map(<[Value]>::len);
        let vocab_size = match (h.get("llama.vocab_size"), tokens) {
            (Some(_), _) => req_u64(h, "llama.vocab_size")?,
            (None, Some(n)) => n as u64,
            (None, None) => {
                return Err(meta_err(
                    "llama.vocab_size",
                    "missing, and the file has no tokenizer.ggml.tokens",
                ));
            }
        };
        if h.tensor("rope_freqs.weight").is_some() {
            return Err(LlamaError::RopeFreqs);
        }
        let rope_theta = opt_f64(h, "llama.rope.freq_base")?.unwrap_or(10_000.0);
        let rope_scaling = match h.get("llama.rope.scaling.type").and_then(Value::as_str) {
            None | Some("none") => None,
            Some("linear") => {
                let factor = opt_f64(h, "llama.rope.scaling.factor")?
                    .ok_or_else(|| meta_err("llama.rope.scaling.factor", "missing"))?;
                Some(json!({"rope_type": "linear", "factor": factor}))
            }
            Some(other) => {
                return Err(meta_err(
                    "llama.rope.scaling.type",
                    format!("{other:?} is not supported (linear is)"),
                ));
            }
        };
        let id = |key: &str| h.get(key).and_then(Value::as_u64);
        Ok(Self {
            vocab_size,
            hidden_size: hidden,
            intermediate_size: req_u64(h, "llama.feed_forward_length")?,
            num_hidden_layers: req_u64(h, "llama.block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: req_u64(h, "llama.context_length")?,
            rms_norm_eps: opt_f64(h, "llama.attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: h.tensor("output.weight").is_none(),
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_id: id("tokenizer.ggml.eos_token_id"),
            pad_token_id: id("tokenizer.ggml.padding_token_id"),
        })
    }

    /// `config.json` for `LlamaForCausalLM` (BF16, no `quantization_config`).
    pub fn config_json(&self) -> Json {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": true,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "bfloat16",
        })
    }

    /// `generation_config.json`: the token ids generation starts, stops and pads with.
    pub fn generation_config_json(&self) -> Json {
        let mut g = serde_json::Map::new();
        for (k, v) in [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
            ("pad_token_id", self.pad_token_id),
        ] {
            if let Some(v) = v {
                g.insert(k.to_owned(), json!(v));
            }
        }
        Json::Object(g)
    }

    /// Every Hugging Face tensor of the model with its shape.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<u64>)> {
        let (h, i, v, hd) = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.head_dim,
        );
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
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
        }
        t.sort();
        t
    }
}

/// What to do with a GGUF tensor's values on the way to Hugging Face's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    AsStored,
    /// Undo llama.cpp's rotary permutation over this many heads.
    Unpermute {
        heads: u64,
    },
}

/// The Hugging Face name of a GGUF tensor and how its rows are ordered. `rope_freqs.weight`
/// (llama3 RoPE factors, which `config.json` cannot be given from it) is refused, as
/// [`LlamaParams::from_header`] refuses it.
pub fn hf_name(gguf: &str, p: &LlamaParams) -> Result<(String, RowOrder), LlamaError> {
    let unknown = || LlamaError::UnknownTensor(gguf.to_owned());
    let plain = |s: &str| Ok((s.to_owned(), RowOrder::AsStored));
    match gguf {
        "token_embd.weight" => return plain("model.embed_tokens.weight"),
        "output_norm.weight" => return plain("model.norm.weight"),
        "output.weight" => return plain("lm_head.weight"),
        "rope_freqs.weight" => return Err(LlamaError::RopeFreqs),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.").ok_or_else(unknown)?;
    let (layer, part) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: u64 = layer.parse().map_err(|_| unknown())?;
    if layer >= p.num_hidden_layers {
        return Err(unknown());
    }
    let (hf, order) = match part {
        "attn_norm.weight" => ("input_layernorm", RowOrder::AsStored),
        "attn_q.weight" => (
            "self_attn.q_proj",
            RowOrder::Unpermute {
                heads: p.num_attention_heads,
            },
        ),
        "attn_k.weight" => (
            "self_attn.k_proj",
            RowOrder::Unpermute {
                heads: p.num_key_value_heads,
            },
        ),
        "attn_v.weight" => ("self_attn.v_proj", RowOrder::AsStored),
        "attn_output.weight" => ("self_attn.o_proj", RowOrder::AsStored),
        "ffn_norm.weight" => ("post_attention_layernorm", RowOrder::AsStored),
        "ffn_gate.weight" => ("mlp.gate_proj", RowOrder::AsStored),
        "ffn_up.weight" => ("mlp.up_proj", RowOrder::AsStored),
        "ffn_down.weight" => ("mlp.down_proj", RowOrder::AsStored),
        _ => return Err(unknown()),
    };
    Ok((format!("model.layers.{layer}.{hf}.weight"), order))
}

/// Reverses llama.cpp's rotary permutation of the rows of `w` (`rows × cols`, row-major,
/// `rows = heads · head_dim`): within each head, row `2i + s` moves to `s · head_dim/2 + i`.
pub fn unpermute_rows<T: Copy>(w: &[T], heads: usize, cols: usize) -> Vec<T> {
    let rows = w.len() / cols.max(1);
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = w.to_vec();
    for h in 0..heads {
        for i in 0..half {
            for s in 0..2 {
                let from = h * head_dim + 2 * i + s;
                let to = h * head_dim + s * half + i;
                out[to * cols..(to + 1) * cols].copy_from_slice(&w[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// Checks a tensor's shape against the config.
pub fn check_shape(
    t: &TensorInfo,
    hf: &str,
    shapes: &[(String, Vec<u64>)],
) -> Result<(), LlamaError> {
    let expected = shapes
        .iter()
        .find(|(n, _)| n == hf)
        .map(|(_, s)| s.clone())
        .ok_or_else(|| LlamaError::UnknownTensor(t.name.clone()))?;
    let found = t.torch_shape();
    if found != expected {
        return Err(LlamaError::Shape {
            name: t.name.clone(),
            expected,
            found,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_is_transformers_reverse_permute() {
        // 2 heads of head_dim 4, one column: GGUF rows per head are [x0, x2, x1, x3] of HF's
        // [x0, x1, x2, x3] (llama.cpp interleaves the two halves).
        let gguf = [0, 2, 1, 3, 10, 12, 11, 13];
        assert_eq!(
            unpermute_rows(&gguf, 2, 1),
            vec![0, 1, 2, 3, 10, 11, 12, 13]
        );
        // Whole rows move together.
        let gguf2 = [0, 0, 2, 2, 1, 1, 3, 3];
        assert_eq!(unpermute_rows(&gguf2, 1, 2), vec![0, 0, 1, 1, 2, 2, 3, 3]);
    }
}
