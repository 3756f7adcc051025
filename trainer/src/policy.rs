//! The policy the built-in trainer optimizes: Qwen3's architecture with Hugging Face tensor
//! names, written with candle's *differentiable* ops so every weight receives a gradient.
//!
//! Why not candle-transformers' Qwen3: its fast kernels (`rms_norm`, `rope`, `softmax_last_dim`)
//! have no backward pass, and backpropagating through them silently gives a gradient to
//! `lm_head` alone (see `../shared/notes/dependencies.md`). Here RMSNorm, rotary embedding,
//! softmax and attention are composed from elementary ops, which all have backward passes.
//!
//! The forward pass is the same computation as `starling-engine`'s (pre-norm residual blocks,
//! per-head q/k RMSNorm before "rotate-half" rotary, grouped KV heads, SwiGLU), in f32 on FP32
//! master weights; the engine runs on the BF16 cast of those weights. The two agree to float
//! rounding (tested below), which is all GRPO needs: its importance ratio uses the actors'
//! behaviour log-probabilities, not this pass's.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{D, DType, Device, Tensor, Var};
use starling_engine::{Bf16Tensor, Bf16Tensors, ModelConfig};

/// Errors of the policy.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("tensor computation")]
    Candle(#[from] candle_core::Error),
    #[error("checkpoint lacks tensor `{0}`")]
    Missing(String),
    #[error("tensor `{name}` has shape {got:?}, the config says {want:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("write checkpoint {path}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("serialize checkpoint")]
    Serialize(#[from] safetensors::SafeTensorError),
}

/// A Qwen3 policy with FP32 master weights held as candle [`Var`]s, by checkpoint name.
#[derive(Debug)]
pub struct Policy {
    config: ModelConfig,
    vars: BTreeMap<String, Var>,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

impl Policy {
    /// A policy whose master weights are exactly the given BF16 values (widened to f32).
    pub fn from_bf16(config: ModelConfig, tensors: &Bf16Tensors) -> Result<Self, PolicyError> {
        let device = Device::Cpu;
        let mut vars = BTreeMap::new();
        for (name, shape) in config.tensor_shapes() {
            let (got, bits) = tensors
                .lookup(&name)
                .ok_or_else(|| PolicyError::Missing(name.clone()))?;
            if got != shape.as_slice() {
                return Err(PolicyError::Shape {
                    name,
                    got: got.to_vec(),
                    want: shape,
                });
            }
            let values: Vec<f32> = bits
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect();
            let t = Tensor::from_vec(values, shape.as_slice(), &device)?;
            vars.insert(name, Var::from_tensor(&t)?);
        }
        let (cos, sin) = rotary_tables(&config, &device)?;
        Ok(Self {
            config,
            vars,
            cos,
            sin,
            device,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Every trainable variable (for the optimizer).
    pub fn vars(&self) -> Vec<Var> {
        self.vars.values().cloned().collect()
    }

    /// The variable holding the tensor `name`.
    pub fn var(&self, name: &str) -> Option<&Var> {
        self.vars.get(name)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn w(&self, name: &str) -> Result<&Tensor, PolicyError> {
        self.vars
            .get(name)
            .map(|v| v.as_tensor())
            .ok_or_else(|| PolicyError::Missing(name.to_owned()))
    }

    /// Logits `(batch, len, vocab)` for right-padded token rows `(batch, len)` (u32). Causal:
    /// position `t` sees positions `0..=t` only, so padding after a sequence changes nothing in it.
    pub fn logits(&self, tokens: &Tensor) -> Result<Tensor, PolicyError> {
        let c = &self.config;
        let (b, len) = tokens.dims2()?;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let eps = c.rms_norm_eps as f32;
        let flat = tokens.flatten_all()?;
        let mut x = self
            .w("model.embed_tokens.weight")?
            .index_select(&flat, 0)?
            .reshape((b, len, c.hidden_size))?;
        let mask = causal_mask(len, &self.device)?;
        let cos = self.cos.narrow(0, 0, len)?;
        let sin = self.sin.narrow(0, 0, len)?;
        let scale = 1.0 / (hd as f64).sqrt();
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let xn = candle_nn::ops::rms_norm_slow(&x, self.w(&p("input_layernorm.weight"))?, eps)?;
            let q =
                linear(&xn, self.w(&p("self_attn.q_proj.weight"))?)?.reshape((b, len, nh, hd))?;
            let k =
                linear(&xn, self.w(&p("self_attn.k_proj.weight"))?)?.reshape((b, len, nkv, hd))?;
            let v =
                linear(&xn, self.w(&p("self_attn.v_proj.weight"))?)?.reshape((b, len, nkv, hd))?;
            let q = candle_nn::ops::rms_norm_slow(&q, self.w(&p("self_attn.q_norm.weight"))?, eps)?
                .transpose(1, 2)?
                .contiguous()?;
            let k = candle_nn::ops::rms_norm_slow(&k, self.w(&p("self_attn.k_norm.weight"))?, eps)?
                .transpose(1, 2)?
                .contiguous()?;
            let q = candle_nn::rotary_emb::rope_slow(&q, &cos, &sin)?;
            let k = repeat_kv(&candle_nn::rotary_emb::rope_slow(&k, &cos, &sin)?, nh / nkv)?;
            let v = repeat_kv(&v.transpose(1, 2)?.contiguous()?, nh / nkv)?;
            let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
            let att =
                probs
                    .matmul(&v)?
                    .transpose(1, 2)?
                    .contiguous()?
                    .reshape((b, len, nh * hd))?;
            x = (x + linear(&att, self.w(&p("self_attn.o_proj.weight"))?)?)?;
            let xn = candle_nn::ops::rms_norm_slow(
                &x,
                self.w(&p("post_attention_layernorm.weight"))?,
                eps,
            )?;
            let gate = linear(&xn, self.w(&p("mlp.gate_proj.weight"))?)?.silu()?;
            let up = linear(&xn, self.w(&p("mlp.up_proj.weight"))?)?;
            x = (x + linear(&(gate * up)?, self.w(&p("mlp.down_proj.weight"))?)?)?;
        }
        let x = candle_nn::ops::rms_norm_slow(&x, self.w("model.norm.weight")?, eps)?;
        let head = if c.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        Ok(linear(&x, self.w(head)?)?)
    }

    /// The master weights cast to BF16 (round to nearest even, as `tensor.to(torch.bfloat16)`).
    pub fn to_bf16(&self) -> Result<Bf16Tensors, PolicyError> {
        let mut out = BTreeMap::new();
        for (name, var) in &self.vars {
            let t = var.as_tensor();
            let values = t.flatten_all()?.to_vec1::<f32>()?;
            let bits = values
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            out.insert(
                name.clone(),
                Bf16Tensor {
                    shape: t.dims().to_vec(),
                    bits,
                },
            );
        }
        Ok(Bf16Tensors(out))
    }

    /// Writes the BF16 cast as a safetensors file, atomically (a temporary file renamed into
    /// place), so the hub never reads a half-written checkpoint.
    pub fn save_bf16(&self, path: &Path) -> Result<(), PolicyError> {
        write_bf16(&self.to_bf16()?, path)
    }
}

/// Writes BF16 tensors as a safetensors file, atomically.
pub fn write_bf16(tensors: &Bf16Tensors, path: &Path) -> Result<(), PolicyError> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .0
        .iter()
        .map(|(n, t)| {
            let b = t.bits.iter().flat_map(|v| v.to_le_bytes()).collect();
            (n.clone(), b, t.shape.clone())
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, b, s)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)
                .map(|v| (n.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tmp = path.with_extension("safetensors.tmp");
    let werr = |source| PolicyError::Write {
        path: path.display().to_string(),
        source,
    };
    safetensors::tensor::serialize_to_file(views, None, &tmp)?;
    std::fs::rename(&tmp, path).map_err(werr)?;
    Ok(())
}

/// `x · wᵀ` for `x` of shape `(…, in)` and `w` of shape `(out, in)`.
fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.broadcast_matmul(&w.t()?)
}

/// `(b, kv_heads, len, hd)` → `(b, kv_heads · rep, len, hd)`, each KV head serving `rep`
/// consecutive query heads (Hugging Face's `repeat_kv`).
fn repeat_kv(x: &Tensor, rep: usize) -> candle_core::Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, len, hd) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv, rep, len, hd))?
        .contiguous()?
        .reshape((b, kv * rep, len, hd))
}

/// 0 on and below the diagonal, a large negative number above (not −∞, which turns a fully
/// masked row's softmax gradient into NaN).
fn causal_mask(len: usize, device: &Device) -> candle_core::Result<Tensor> {
    let m: Vec<f32> = (0..len)
        .flat_map(|i| (0..len).map(move |j| if j > i { -1e9 } else { 0.0 }))
        .collect();
    Tensor::from_vec(m, (len, len), device)
}

/// Rotary tables `(max_positions, head_dim / 2)`, computed in f64 and rounded once to f32,
/// exactly as the engine computes them.
fn rotary_tables(config: &ModelConfig, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let half = config.head_dim / 2;
    let n = config.max_position_embeddings;
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in 0..n {
        for i in 0..half {
            let f = 1.0
                / config
                    .rope_theta
                    .powf((2 * i) as f64 / config.head_dim as f64);
            let a = p as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, half), device)?,
        Tensor::from_vec(sin, (n, half), device)?,
    ))
}

/// Per-token log-probabilities `log_softmax(logits / T)[token]` (the hub's definition, with
/// `T = 1` for greedy) of `targets` `(batch, len)` under `logits` `(batch, len, vocab)`.
pub fn token_logprobs(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f32,
) -> Result<Tensor, PolicyError> {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let lp = candle_nn::ops::log_softmax(&(logits / f64::from(t))?, D::Minus1)?;
    Ok(lp
        .gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?
        .squeeze(D::Minus1)?)
}

/// `DType` of the master weights.
pub const MASTER_DTYPE: DType = DType::F32;
