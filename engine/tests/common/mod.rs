//! Shared helpers: tiny configs, deterministic random models, and a plain reference forward.

#![allow(dead_code, unreachable_pub)]

use starling_engine::{Bf16Tensors, Model, ModelConfig, random_bf16};

/// A tiny Qwen3: vocab 300 (fits the byte tokenizer), hidden 64, 2 layers, 4 query heads
/// over 2 KV heads, head_dim 16.
pub fn tiny_config() -> ModelConfig {
    ModelConfig::from_value(serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": false
    }))
    .expect("valid tiny config")
}

pub fn tiny_model(seed: u64) -> (Model, Bf16Tensors) {
    let cfg = tiny_config();
    let w = random_bf16(&cfg, seed);
    (Model::from_tensors(cfg, &w).expect("load"), w)
}

fn bf(bits: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(bits) << 16))
}

/// A tiny Llama: the same shapes as [`tiny_config`], no q/k norms, `head_dim` left to its
/// default (hidden / heads = 16).
pub fn tiny_llama_config() -> ModelConfig {
    ModelConfig::from_value(serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": false,
        "hidden_act": "silu"
    }))
    .expect("valid tiny llama config")
}

/// The rotary frequency of pair `i`, scaled as the config says: transformers'
/// `_compute_linear_scaling_rope_parameters` and `_compute_llama3_parameters`, written out
/// from their definitions.
fn inv_freq(cfg: &ModelConfig, i: usize) -> f64 {
    let hd = cfg.head_dim as f64;
    let base = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd);
    let Some(s) = cfg.rope_scaling.as_ref().filter(|s| !s.is_null()) else {
        return base;
    };
    let num = |k: &str| s[k].as_f64().expect("scaling field");
    match s["rope_type"].as_str() {
        Some("linear") => base / num("factor"),
        Some("llama3") => {
            let (factor, lo, hi, old) = (
                num("factor"),
                num("low_freq_factor"),
                num("high_freq_factor"),
                num("original_max_position_embeddings"),
            );
            let wavelen = 2.0 * std::f64::consts::PI / base;
            let scaled = if wavelen > old / lo {
                base / factor
            } else {
                base
            };
            let smooth = (old / wavelen - lo) / (hi - lo);
            // Neither side of the band (no NaN here): the blend.
            let medium = wavelen >= old / hi && wavelen <= old / lo;
            if medium {
                (1.0 - smooth) * scaled / factor + smooth * scaled
            } else {
                scaled
            }
        }
        other => panic!("no reference for rope_type {other:?}"),
    }
}

/// A plain, obviously-correct Qwen3 / Llama forward in f64 (straight loops, no caching), for the
/// logits after the last token. Written from the Hugging Face modeling code, independently
/// of the engine's kernels.
pub fn reference_logits(cfg: &ModelConfig, w: &Bf16Tensors, tokens: &[u32]) -> Vec<f64> {
    let t = |name: &str| -> Vec<f64> { w.0[name].bits.iter().map(|&b| bf(b)).collect() };
    let (h, hd, nh, nkv, inter) = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    );
    let eps = cfg.rms_norm_eps;
    let rms = |x: &[f64], g: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(g).map(|(v, g)| v * r * g).collect()
    };
    // y = W x for W [out, in].
    let lin = |wm: &[f64], x: &[f64]| -> Vec<f64> {
        let inn = x.len();
        (0..wm.len() / inn)
            .map(|o| (0..inn).map(|i| wm[o * inn + i] * x[i]).sum())
            .collect()
    };
    let rope = |x: &mut [f64], pos: usize| {
        for head in x.chunks_mut(hd) {
            let half = hd / 2;
            let orig = head.to_vec();
            for i in 0..hd {
                let a = pos as f64 * inv_freq(cfg, i % half);
                // rotate_half(x) = cat(-x2, x1)
                let rot = if i < half {
                    -orig[i + half]
                } else {
                    orig[i - half]
                };
                head[i] = orig[i] * a.cos() + rot * a.sin();
            }
        }
    };
    let embed = t("model.embed_tokens.weight");
    let n = tokens.len();
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&tk| embed[tk as usize * h..(tk as usize + 1) * h].to_vec())
        .collect();
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| t(&format!("model.layers.{l}.{s}.weight"));
        let (wq, wk, wv, wo) = (
            p("self_attn.q_proj"),
            p("self_attn.k_proj"),
            p("self_attn.v_proj"),
            p("self_attn.o_proj"),
        );
        let qk_norm = cfg.model_type == "qwen3";
        let (qn, kn) = if qk_norm {
            (p("self_attn.q_norm"), p("self_attn.k_norm"))
        } else {
            (vec![1.0; hd], vec![1.0; hd])
        };
        // Llama has no q/k norm: the identity instead of RMSNorm.
        let qk = |x: Vec<f64>, g: &[f64]| -> Vec<f64> {
            if qk_norm {
                x.chunks(hd).flat_map(|c| rms(c, g)).collect()
            } else {
                x
            }
        };
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, xt) in x.iter().enumerate() {
            let hn = rms(xt, &p("input_layernorm"));
            let mut q = qk(lin(&wq, &hn), &qn);
            let mut k = qk(lin(&wk, &hn), &kn);
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(lin(&wv, &hn));
        }
        for tq in 0..n {
            let mut att = vec![0f64; nh * hd];
            for head in 0..nh {
                let g = head / (nh / nkv);
                let q = &qs[tq][head * hd..(head + 1) * hd];
                let s: Vec<f64> = (0..=tq)
                    .map(|j| {
                        let k = &ks[j][g * hd..(g + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for d in 0..hd {
                        att[head * hd + d] += ej / z * vs[j][g * hd + d];
                    }
                }
            }
            let o = lin(&wo, &att);
            for (a, b) in x[tq].iter_mut().zip(o) {
                *a += b;
            }
            let hn = rms(&x[tq], &p("post_attention_layernorm"));
            let gate = lin(&p("mlp.gate_proj"), &hn);
            let up = lin(&p("mlp.up_proj"), &hn);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            assert_eq!(act.len(), inter);
            let d = lin(&p("mlp.down_proj"), &act);
            for (a, b) in x[tq].iter_mut().zip(d) {
                *a += b;
            }
        }
    }
    let last = rms(&x[n - 1], &t("model.norm.weight"));
    let head = if cfg.tie_word_embeddings {
        embed
    } else {
        t("lm_head.weight")
    };
    lin(&head, &last)
}
