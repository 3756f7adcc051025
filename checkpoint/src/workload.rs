//! A deterministic generator of consecutive BF16 checkpoints that behave like RL
//! post-training.
//!
//! Each element has an FP32 master weight drawn with a magnitude spread typical of its
//! tensor kind (embeddings, attention, MLP, norms; per-row scales log-normal, a
//! heavy tail of outliers). Every step applies a real Adam update (β₁ 0.9, β₂ 0.999,
//! ε 1e-8, bias correction) driven by a gradient with a small persistent mean and a large
//! per-step noise — RL policy gradients are noisy — at the chosen learning rate (optimizer state warm, as after pre-training and SFT), then casts
//! to BF16 with round-to-nearest-even. The fraction of BF16 elements that change per step
//! is *not* imposed: it emerges from update size versus each weight's ULP, as it does in
//! real training (small weights change more often; norms near 1.0 rarely).
//!
//! Everything is a pure function of (seed, tensor, chunk, step), so chunks are generated in
//! parallel and written in place: N+1 checkpoints of any size are produced in one pass
//! with memory bounded by a few chunk buffers per thread.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use starling_proto::delta::bf16::f32_to_bf16;
use starling_rng::{SplitMix64, mix64};

/// What role a tensor plays; sets its initial magnitude. (`Bias` is unused by the Qwen3
/// presets, which have no biases; kept for hand-built specs.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Embedding,
    Attention,
    AttentionOut,
    MlpIn,
    MlpOut,
    Norm,
    Bias,
    LmHead,
}

impl Kind {
    /// Standard deviation of the initial weights (Qwen/Llama-like trained magnitudes).
    fn std(self) -> f32 {
        match self {
            Kind::Embedding => 0.03,
            Kind::Attention => 0.06,
            Kind::AttentionOut => 0.04,
            Kind::MlpIn => 0.05,
            Kind::MlpOut => 0.036,
            Kind::Norm => 0.1,
            Kind::Bias => 0.1,
            Kind::LmHead => 0.04,
        }
    }
}

/// One tensor of a model.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
    pub kind: Kind,
}

impl TensorSpec {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    fn row_len(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1).max(1)
    }
}

/// The sizes of a Qwen3-layout [`ModelSpec`].
#[derive(Debug, Clone, Copy)]
struct Qwen3Arch {
    hidden: u64,
    layers: u64,
    intermediate: u64,
    vocab: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
}

/// A model: tensors sorted by name.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub name: String,
    pub tensors: Vec<TensorSpec>,
}

impl ModelSpec {
    /// A Qwen3-style decoder (Hugging Face `Qwen3ForCausalLM` names and shapes): embeddings,
    /// per layer RMSNorms, q/k/v/o projections without biases and with grouped KV heads,
    /// per-head RMSNorms of queries and keys (`q_norm`, `k_norm`), gate/up/down MLP, final
    /// norm and an untied LM head. `head_dim = hidden / heads`.
    pub fn qwen_like(
        name: &str,
        hidden: u64,
        layers: u64,
        intermediate: u64,
        vocab: u64,
        heads: u64,
        kv_heads: u64,
    ) -> Self {
        let hd = hidden / heads;
        let mut t = vec![
            spec(
                "model.embed_tokens.weight",
                &[vocab, hidden],
                Kind::Embedding,
            ),
            spec("model.norm.weight", &[hidden], Kind::Norm),
            spec("lm_head.weight", &[vocab, hidden], Kind::LmHead),
        ];
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            let mut add = |suffix: &str, shape: &[u64], kind: Kind| {
                t.push(spec(&format!("{p}.{suffix}.weight"), shape, kind));
            };
            add("input_layernorm", &[hidden], Kind::Norm);
            add("post_attention_layernorm", &[hidden], Kind::Norm);
            add("self_attn.q_proj", &[heads * hd, hidden], Kind::Attention);
            add(
                "self_attn.k_proj",
                &[kv_heads * hd, hidden],
                Kind::Attention,
            );
            add(
                "self_attn.v_proj",
                &[kv_heads * hd, hidden],
                Kind::Attention,
            );
            add(
                "self_attn.o_proj",
                &[hidden, heads * hd],
                Kind::AttentionOut,
            );
            add("self_attn.q_norm", &[hd], Kind::Norm);
            add("self_attn.k_norm", &[hd], Kind::Norm);
            add("mlp.gate_proj", &[intermediate, hidden], Kind::MlpIn);
            add("mlp.up_proj", &[intermediate, hidden], Kind::MlpIn);
            add("mlp.down_proj", &[hidden, intermediate], Kind::MlpOut);
        }
        t.sort_by(|a, b| a.name.cmp(&b.name));
        Self {
            name: name.to_owned(),
            tensors: t,
        }
    }

    /// The Hugging Face `config.json` of a model built by [`ModelSpec::qwen_like`] (every
    /// preset): `Qwen3ForCausalLM`, BF16, untied embeddings, `rms_norm_eps` 1e-6,
    /// `rope_theta` 1e6, and a context of 2048 positions for the toy presets (`tiny`,
    /// `small`, `100m`) or 32768 for the Qwen-sized ones. The sizes are read back from
    /// the tensor shapes; `None` when the spec is not in that layout.
    pub fn qwen3_config_json(&self) -> Option<serde_json::Value> {
        let a = self.qwen3_arch()?;
        let max_positions = if a.hidden >= 896 { 32_768 } else { 2048 };
        Some(serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": a.vocab,
            "hidden_size": a.hidden,
            "intermediate_size": a.intermediate,
            "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "rope_scaling": null,
            "use_cache": true,
            "use_sliding_window": false,
            "sliding_window": null,
        }))
    }

    /// The sizes of a Qwen3-layout spec, read from its tensor shapes.
    fn qwen3_arch(&self) -> Option<Qwen3Arch> {
        let shape = |name: &str| {
            self.tensors
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.shape.as_slice())
        };
        let (&[vocab, hidden], &[q_rows, _], &[kv_rows, _], &[head_dim], &[intermediate, _]) = (
            shape("model.embed_tokens.weight")?,
            shape("model.layers.0.self_attn.q_proj.weight")?,
            shape("model.layers.0.self_attn.k_proj.weight")?,
            shape("model.layers.0.self_attn.q_norm.weight")?,
            shape("model.layers.0.mlp.gate_proj.weight")?,
        ) else {
            return None;
        };
        let layers = self
            .tensors
            .iter()
            .filter(|t| t.name.ends_with(".input_layernorm.weight"))
            .count() as u64;
        if head_dim == 0 || q_rows % head_dim != 0 || kv_rows % head_dim != 0 {
            return None;
        }
        Some(Qwen3Arch {
            hidden,
            layers,
            intermediate,
            vocab,
            heads: q_rows / head_dim,
            kv_heads: kv_rows / head_dim,
            head_dim,
        })
    }

    /// Named presets, all in the Qwen3 layout: `tiny` (~0.2 M parameters), `small` (~6 M),
    /// `100m` (~0.1 B), `0.5b` (Qwen2.5-0.5B's sizes, ~0.5 B, 1 GB BF16), `1.5b`
    /// (Qwen2.5-1.5B's, 3.1 GB).
    pub fn preset(name: &str) -> Option<Self> {
        Some(match name {
            "tiny" => Self::qwen_like(name, 64, 2, 176, 512, 4, 2),
            "small" => Self::qwen_like(name, 256, 4, 704, 8192, 8, 2),
            "100m" => Self::qwen_like(name, 640, 10, 1728, 32000, 10, 2),
            "0.5b" => Self::qwen_like(name, 896, 24, 4864, 151_936, 14, 2),
            "1.5b" => Self::qwen_like(name, 1536, 28, 8960, 151_936, 12, 2),
            _ => return None,
        })
    }

    pub const PRESETS: [&'static str; 5] = ["tiny", "small", "100m", "0.5b", "1.5b"];

    pub fn numel(&self) -> u64 {
        self.tensors.iter().map(TensorSpec::numel).sum()
    }
}

fn spec(name: &str, shape: &[u64], kind: Kind) -> TensorSpec {
    TensorSpec {
        name: name.to_owned(),
        shape: shape.to_vec(),
        kind,
    }
}

/// How training proceeds.
#[derive(Debug, Clone, Copy)]
pub struct TrainConfig {
    pub seed: u64,
    pub lr: f32,
    /// Persistent gradient mean relative to the per-step noise (RL gradients: small).
    pub signal_to_noise: f32,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            lr: 3e-6,
            signal_to_noise: 0.2,
        }
    }
}

/// Elements generated per work item.
const CHUNK: u64 = 1 << 20;

/// The workload's draws: SplitMix64 (`starling-rng`, whose stream never changes) keyed by a
/// tuple of parts hashed with its finalizer, with the float conversions the generator uses.
#[derive(Debug, Clone)]
struct Rng(SplitMix64);

impl Rng {
    fn new(parts: &[u64]) -> Self {
        let mut s = 0x5851_F42D_4C95_7F2Du64;
        for &p in parts {
            s = mix64(s ^ p);
        }
        Self(SplitMix64::new(s))
    }
    #[inline]
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    #[inline]
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f32 {
        let u = self.uniform();
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    /// Approximately normal, cheap (Irwin–Hall of four 16-bit uniforms; tails at ±3.5σ).
    #[inline]
    fn fast_normal(&mut self) -> f32 {
        let r = self.next();
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        (s as f32 / 65536.0 - 2.0) * 1.732_050_8
    }
}

/// Generates the BF16 bits of elements `[start, start + len)` of tensor `ti` at every step
/// `0..=steps`, calling `emit(step, bits)` for each step in order.
pub fn generate_chunk(
    model: &ModelSpec,
    ti: usize,
    start: u64,
    len: usize,
    steps: u32,
    cfg: &TrainConfig,
    emit: &mut dyn FnMut(u32, &[u16]),
) {
    let t = &model.tensors[ti];
    let row_len = t.row_len();
    let mut init = Rng::new(&[cfg.seed, ti as u64, start, 0]);
    let mut w = vec![0f32; len];
    let mut mu = vec![0f32; len];
    for (i, (wi, mi)) in w.iter_mut().zip(mu.iter_mut()).enumerate() {
        let row = (start + i as u64) / row_len;
        let mut row_rng = Rng::new(&[cfg.seed, ti as u64, row, 1]);
        let row_scale = (0.25 * row_rng.normal()).exp();
        let z = init.normal();
        let tail = if init.uniform() < 0.01 { 4.0 } else { 1.0 };
        *wi = match t.kind {
            Kind::Norm => 1.0 + t.kind.std() * z * row_scale,
            k => k.std() * row_scale * z * tail,
        };
        *mi = cfg.signal_to_noise * init.normal();
    }
    // Post-training starts from a warmed-up optimizer: m and v at their steady state for
    // this gradient (mean g·μ, noise g), bias correction long since ≈ 1. A cold start
    // would make the first steps move every weight by exactly ±lr.
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    // Gradient scale: irrelevant to Adam's step size except against ε; typical magnitude.
    let g_scale = 1e-3f32;
    let mut warm = Rng::new(&[cfg.seed, ti as u64, start, 3]);
    let m_noise = ((1.0 - b1) / (1.0 + b1)).sqrt();
    let mut m: Vec<f32> = mu
        .iter()
        .map(|&u| g_scale * (u + m_noise * warm.normal()))
        .collect();
    let mut v: Vec<f32> = mu
        .iter()
        .map(|&u| g_scale * g_scale * (1.0 + u * u))
        .collect();
    let mut out: Vec<u16> = w.iter().map(|&x| f32_to_bf16(x)).collect();
    emit(0, &out);
    for step in 1..=steps {
        let mut noise = Rng::new(&[cfg.seed, ti as u64, start, 4 + u64::from(step)]);
        for i in 0..len {
            let g = g_scale * (mu[i] + noise.fast_normal());
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            w[i] -= cfg.lr * m[i] / (v[i].sqrt() + eps);
            out[i] = f32_to_bf16(w[i]);
        }
        emit(step, &out);
    }
}

/// Generates every step of a model in memory (small models: tests, benches).
pub fn generate_in_memory(
    model: &ModelSpec,
    steps: u32,
    cfg: &TrainConfig,
) -> Vec<BTreeMap<String, Vec<u16>>> {
    let mut out: Vec<BTreeMap<String, Vec<u16>>> = (0..=steps)
        .map(|_| {
            model
                .tensors
                .iter()
                .map(|t| (t.name.clone(), vec![0u16; t.numel() as usize]))
                .collect()
        })
        .collect();
    let work = chunks(model);
    let results: Vec<(usize, u64, Vec<Vec<u16>>)> = work
        .par_iter()
        .map(|&(ti, start, len)| {
            let mut per_step = Vec::with_capacity(steps as usize + 1);
            generate_chunk(model, ti, start, len, steps, cfg, &mut |_, bits| {
                per_step.push(bits.to_vec())
            });
            (ti, start, per_step)
        })
        .collect();
    for (ti, start, per_step) in results {
        let name = &model.tensors[ti].name;
        for (s, bits) in per_step.into_iter().enumerate() {
            if let Some(t) = out[s].get_mut(name) {
                t[start as usize..start as usize + bits.len()].copy_from_slice(&bits);
            }
        }
    }
    out
}

fn chunks(model: &ModelSpec) -> Vec<(usize, u64, usize)> {
    let mut v = Vec::new();
    for (ti, t) in model.tensors.iter().enumerate() {
        let mut s = 0;
        while s < t.numel() {
            let n = (t.numel() - s).min(CHUNK);
            v.push((ti, s, n as usize));
            s += n;
        }
    }
    v
}

/// File name of step `s` in a generated directory.
pub fn step_file(dir: &Path, step: u32) -> PathBuf {
    dir.join(format!("step-{step:04}.safetensors"))
}

/// Writes `steps + 1` consecutive checkpoints (`step-0000.safetensors` …) into `dir`,
/// in one pass with bounded memory. `progress` is told the elements done.
pub fn generate_to_dir(
    model: &ModelSpec,
    steps: u32,
    cfg: &TrainConfig,
    dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let layout: Vec<(String, Vec<u64>)> = model
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    // Each file's data starts after its own header: the version in the metadata makes the
    // headers' lengths differ between steps.
    let mut data_starts = Vec::new();
    let mut files = Vec::new();
    let mut paths = Vec::new();
    for s in 0..=steps {
        let path = step_file(dir, s);
        // The header as the safetensors writer lays it out (name order); the data is
        // filled in place below: create each file with its header at its final length.
        let (header, data_len) = crate::writer::header_bytes(&layout, Some(u64::from(s)));
        std::fs::write(&path, &header)?;
        let f = OpenOptions::new().write(true).open(&path)?;
        f.set_len(header.len() as u64 + data_len)?;
        data_starts.push(header.len() as u64);
        files.push(f);
        paths.push(path);
    }
    let mut offsets = Vec::with_capacity(model.tensors.len());
    let mut off = 0u64;
    for t in &model.tensors {
        offsets.push(off);
        off += 2 * t.numel();
    }
    let done = std::sync::atomic::AtomicU64::new(0);
    chunks(model)
        .par_iter()
        .try_for_each(|&(ti, start, len)| -> std::io::Result<()> {
            let mut result = Ok(());
            generate_chunk(model, ti, start, len, steps, cfg, &mut |s, bits| {
                if result.is_ok() {
                    let at = data_starts[s as usize] + offsets[ti] + 2 * start;
                    result = files[s as usize].write_all_at(bytemuck::cast_slice(bits), at);
                }
            });
            let d = done.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed) + len as u64;
            progress(d);
            result
        })?;
    for f in &files {
        f.sync_all()?;
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_deterministic_and_density_emerges_in_the_rl_range() {
        let model = ModelSpec::preset("small").expect("preset");
        let cfg = TrainConfig {
            seed: 3,
            ..TrainConfig::default()
        };
        let a = generate_in_memory(&model, 3, &cfg);
        let b = generate_in_memory(&model, 3, &cfg);
        assert_eq!(a, b, "same seed, same bits");
        let total: usize = a[0].values().map(Vec::len).sum();
        let changed: usize = a[2]
            .iter()
            .map(|(n, v)| v.iter().zip(&a[3][n]).filter(|(x, y)| x != y).count())
            .sum();
        let density = changed as f64 / total as f64;
        assert!((0.001..0.05).contains(&density), "density {density}");
        // Norm weights (near 1.0, coarse ULP) change far less often than matrices.
        let norm = &a[2]["model.norm.weight"];
        let norm_changed = norm
            .iter()
            .zip(&a[3]["model.norm.weight"])
            .filter(|(x, y)| x != y)
            .count();
        assert!((norm_changed as f64 / norm.len() as f64) < density);
        let other = generate_in_memory(&model, 1, &TrainConfig { seed: 4, ..cfg });
        assert_ne!(other[0], a[0], "another seed, other weights");
    }

    #[test]
    fn files_hold_exactly_what_generation_computes_whatever_their_header_length() {
        // The version is in each file's metadata, so version 10's header can be 8 bytes
        // longer than version 9's: each file's tensors must still start right after its own.
        // A tensor name is lengthened until that happens at 9 → 10.
        let layout = |m: &ModelSpec| -> Vec<(String, Vec<u64>)> {
            m.tensors
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect()
        };
        let header_len =
            |m: &ModelSpec, v: u64| crate::writer::header_bytes(&layout(m), Some(v)).0.len();
        let mut model = ModelSpec::preset("tiny").expect("preset");
        while header_len(&model, 9) == header_len(&model, 10) {
            model.tensors[0].name.push('x');
        }
        let steps = 10;
        let cfg = TrainConfig::default();
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = generate_to_dir(&model, steps, &cfg, dir.path(), &|_| {}).expect("generate");
        let expected = generate_in_memory(&model, steps, &cfg);
        for (step, path) in paths.iter().enumerate() {
            let c = crate::safetensors::Checkpoint::open(path).expect("open");
            c.check_lengths().expect("no bytes beyond the last tensor");
            assert_eq!(c.version(), Some(step as u64));
            assert_eq!(c.read_all().expect("read"), expected[step], "step {step}");
        }
    }

    #[test]
    fn the_workload_is_pinned() {
        // Reference output: benchmark figures and golden deltas compare across versions only
        // while the workload's bits stay the same. FNV-1a over every step's tensors.
        let model = ModelSpec::preset("tiny").expect("preset");
        let steps = generate_in_memory(&model, 2, &TrainConfig::default());
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for step in &steps {
            for (name, bits) in step {
                for b in name
                    .bytes()
                    .chain(bits.iter().flat_map(|b| b.to_le_bytes()))
                {
                    h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
        assert_eq!(h, 6_911_197_646_947_865_773);
    }

    #[test]
    fn presets_have_the_qwen3_layout_and_a_matching_config() {
        let tiny = ModelSpec::preset("tiny").expect("preset");
        let names: Vec<&str> = tiny.tensors.iter().map(|t| t.name.as_str()).collect();
        assert!(!names.iter().any(|n| n.ends_with(".bias")), "no biases");
        let q_norm = tiny
            .tensors
            .iter()
            .find(|t| t.name == "model.layers.1.self_attn.k_norm.weight")
            .expect("k_norm");
        assert_eq!(
            (q_norm.shape.as_slice(), q_norm.kind),
            (&[16u64][..], Kind::Norm)
        );
        // 3 global tensors + 11 per layer.
        assert_eq!(tiny.tensors.len(), 3 + 2 * 11);
        for name in ModelSpec::PRESETS {
            let spec = ModelSpec::preset(name).expect("preset");
            let c = spec.qwen3_config_json().expect("config");
            let hidden = c["hidden_size"].as_u64().expect("hidden");
            let heads = c["num_attention_heads"].as_u64().expect("heads");
            assert_eq!(c["head_dim"].as_u64(), Some(hidden / heads), "{name}");
            assert_eq!(c["tie_word_embeddings"], serde_json::json!(false));
            assert_eq!(c["model_type"], "qwen3");
        }
        let c = ModelSpec::preset("small")
            .and_then(|s| s.qwen3_config_json())
            .expect("config");
        assert_eq!(c["max_position_embeddings"].as_u64(), Some(2048));
        assert_eq!(c["num_hidden_layers"].as_u64(), Some(4));
        assert_eq!(c["num_key_value_heads"].as_u64(), Some(2));
        assert_eq!(c["intermediate_size"].as_u64(), Some(704));
        assert_eq!(c["vocab_size"].as_u64(), Some(8192));
        // Norm-kind q/k norms start near 1.0 like the other norms.
        let w = generate_in_memory(&tiny, 0, &TrainConfig::default());
        let qn = &w[0]["model.layers.0.self_attn.q_norm.weight"];
        assert!(
            qn.iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .all(|x| (0.5..1.5).contains(&x))
        );
    }
}
