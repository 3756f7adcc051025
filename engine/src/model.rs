//! The Qwen3 decoder: weights widened from BF16, and the forward pass.
//!
//! The forward pass follows Hugging Face's `Qwen3ForCausalLM` in f32: token embedding; per
//! layer `x += o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` over `input_layernorm(x)`,
//! then `x += down(silu(gate(h)) · up(h))` over `h = post_attention_layernorm(x)`; final
//! `norm` and `lm_head` (the embedding matrix when `tie_word_embeddings`).
//!
//! There is one forward function, [`Model::forward`], over a list of tokens that each
//! belong to some sequence's [`KvCache`] and extend it by one position. A prompt's prefill
//! (many tokens of one sequence), a batched decoding step (one token of each of many
//! sequences), a mixture of the two, and [`Model::score`]'s single pass over a whole
//! sequence are all calls of it. Every per-token operation (matmul rows, norms, rotary,
//! residuals) is independent of the other tokens in the call, and attention for a token at
//! position `t` reads exactly the keys and values `0..=t` of its sequence through
//! [`kernels::attend`]; with the fixed reduction orders of [`crate::kernels`], each token's
//! result is bit-identical however tokens are grouped into calls, which other sequences
//! share them, and how many threads run.

use crate::config::{ConfigError, ModelConfig};
use crate::input::InputError;
use crate::kernels::{self, Packed, Rope};
use crate::sampling::{check_temperature, token_logprob};

/// Why weights could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("invalid config")]
    Config(#[from] ConfigError),
    #[error("tensor {name} is missing (expected shape {expected:?})")]
    Missing { name: String, expected: Vec<usize> },
    #[error("tensor {name} has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {name} has {found} elements of data, its shape {shape:?} needs {expected}")]
    DataLength {
        name: String,
        shape: Vec<usize>,
        expected: usize,
        found: usize,
    },
}

/// One decoder layer's weights (f32; projections packed for [`kernels::matmul`]).
#[derive(Debug, Clone)]
struct Layer {
    input_norm: Vec<f32>,
    q: Packed,
    k: Packed,
    v: Packed,
    o: Packed,
    /// Qwen3's per-head RMSNorm weights of q and k (none for Llama).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_norm: Vec<f32>,
    gate: Packed,
    up: Packed,
    down: Packed,
}

/// A loaded model. Immutable once built; shared by reference across generations.
#[derive(Debug, Clone)]
pub struct Model {
    config: ModelConfig,
    threads: usize,
    /// Row-major `[vocab, hidden]`, for lookups.
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `lm_head.weight`, or a packed copy of the embedding when tied.
    lm_head: Packed,
    rope: Rope,
}

/// The keys and values one sequence has produced so far, per layer (rows of width
/// `kv_heads · head_dim`, one per position).
#[derive(Debug, Clone)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// An empty cache with room for `positions` positions.
    pub fn new(config: &ModelConfig, positions: usize) -> Self {
        let row = config.num_key_value_heads * config.head_dim;
        let mk = || {
            (0..config.num_hidden_layers)
                .map(|_| Vec::with_capacity(positions * row))
                .collect()
        };
        Self {
            keys: mk(),
            values: mk(),
            len: 0,
        }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// BF16 bits to f32: exact (the BF16 bits are the f32's upper half).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

impl Model {
    /// Builds a model from BF16 tensors found by name (`lookup` returns the shape and the
    /// raw BF16 bits as stored in safetensors). Every tensor of
    /// [`ModelConfig::tensor_shapes`] must be present with exactly that shape.
    pub fn from_bf16<'a, F>(config: ModelConfig, lookup: F) -> Result<Self, LoadError>
    where
        F: Fn(&str) -> Option<(&'a [usize], &'a [u16])>,
    {
        config.validate()?;
        let expected: std::collections::HashMap<String, Vec<usize>> =
            config.tensor_shapes().into_iter().collect();
        let raw = |name: &str| -> Result<&'a [u16], LoadError> {
            let want = expected.get(name).cloned().unwrap_or_default();
            let (shape, bits) = lookup(name).ok_or_else(|| LoadError::Missing {
                name: name.to_owned(),
                expected: want.clone(),
            })?;
            if shape != want.as_slice() {
                return Err(LoadError::Shape {
                    name: name.to_owned(),
                    expected: want,
                    found: shape.to_vec(),
                });
            }
            let n: usize = want.iter().product();
            if bits.len() != n {
                return Err(LoadError::DataLength {
                    name: name.to_owned(),
                    shape: want,
                    expected: n,
                    found: bits.len(),
                });
            }
            Ok(bits)
        };
        let get = |name: &str| -> Result<Vec<f32>, LoadError> {
            Ok(raw(name)?.iter().map(|&b| bf16_to_f32(b)).collect())
        };
        let packed = |name: &str| -> Result<Packed, LoadError> {
            let bits = raw(name)?;
            let (rows, cols) = match expected.get(name).map(Vec::as_slice) {
                Some(&[r, c]) => (r, c),
                _ => (0, 0),
            };
            Ok(Packed::new(bits, rows, cols))
        };
        let qk_norm = config.family()?.has_qk_norm();
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let n = |s: &str| format!("{p}.{s}.weight");
            layers.push(Layer {
                input_norm: get(&n("input_layernorm"))?,
                q: packed(&n("self_attn.q_proj"))?,
                k: packed(&n("self_attn.k_proj"))?,
                v: packed(&n("self_attn.v_proj"))?,
                o: packed(&n("self_attn.o_proj"))?,
                q_norm: qk_norm.then(|| get(&n("self_attn.q_norm"))).transpose()?,
                k_norm: qk_norm.then(|| get(&n("self_attn.k_norm"))).transpose()?,
                post_norm: get(&n("post_attention_layernorm"))?,
                gate: packed(&n("mlp.gate_proj"))?,
                up: packed(&n("mlp.up_proj"))?,
                down: packed(&n("mlp.down_proj"))?,
            });
        }
        let embed = get("model.embed_tokens.weight")?;
        let norm = get("model.norm.weight")?;
        let lm_head = if config.tie_word_embeddings {
            packed("model.embed_tokens.weight")?
        } else {
            packed("lm_head.weight")?
        };
        let rope = Rope::scaled(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling()?,
            config.max_position_embeddings,
        );
        let threads = std::thread::available_parallelism().map_or(1, usize::from);
        Ok(Self {
            config,
            threads,
            embed,
            layers,
            norm,
            lm_head,
            rope,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Number of parameters (elements of all tensors of the checkpoint).
    pub fn parameter_count(&self) -> u64 {
        self.config.parameter_count()
    }

    /// Threads used by matrix products and attention. Results never depend on it.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Sets the thread count (at least 1).
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// The same model with another thread count.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.set_threads(threads);
        self
    }

    /// Checks token ids against the vocabulary and the total length against the context.
    pub(crate) fn check_tokens(
        &self,
        prompt: &[u32],
        rest: &[u32],
        new: usize,
    ) -> Result<(), InputError> {
        if prompt.is_empty() {
            return Err(InputError::EmptyPrompt);
        }
        let vocab = self.config.vocab_size;
        if let Some((position, &token)) = prompt
            .iter()
            .chain(rest)
            .enumerate()
            .find(|&(_, &t)| t as usize >= vocab)
        {
            return Err(InputError::TokenOutOfRange {
                position,
                token,
                vocab,
            });
        }
        let tokens = prompt.len() + rest.len() + new;
        if tokens > self.config.max_position_embeddings {
            return Err(InputError::TooLong {
                prompt: prompt.len(),
                new: rest.len() + new,
                tokens,
                max: self.config.max_position_embeddings,
            });
        }
        Ok(())
    }

    /// The logits after the last of `tokens` (one full forward, no cache reuse).
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<f32>, InputError> {
        self.check_tokens(tokens, &[], 0)?;
        let mut cache = KvCache::new(&self.config, tokens.len());
        let items: Vec<(usize, u32)> = tokens.iter().map(|&t| (0, t)).collect();
        Ok(self.forward(&mut [&mut cache], &items, &[tokens.len() - 1]))
    }

    /// Log-probabilities of each `completion` token after `prompt` (and the completion
    /// tokens before it), under `log_softmax(logits / temperature)` over the full
    /// vocabulary (temperature 0 counts as 1): the quantity [`Model::generate`] reports, bit
    /// for bit. One forward pass over the whole sequence.
    pub fn score(
        &self,
        prompt: &[u32],
        completion: &[u32],
        temperature: f32,
    ) -> Result<Vec<f32>, InputError> {
        check_temperature(temperature)?;
        self.check_tokens(prompt, completion, 0)?;
        if completion.is_empty() {
            return Ok(Vec::new());
        }
        // The last completion token's own logits are never needed.
        let seq: Vec<(usize, u32)> = prompt
            .iter()
            .chain(&completion[..completion.len() - 1])
            .map(|&t| (0, t))
            .collect();
        let want: Vec<usize> = (prompt.len() - 1..seq.len()).collect();
        let mut cache = KvCache::new(&self.config, seq.len());
        let logits = self.forward(&mut [&mut cache], &seq, &want);
        let v = self.config.vocab_size;
        Ok(completion
            .iter()
            .enumerate()
            .map(|(i, &tok)| token_logprob(&logits[i * v..(i + 1) * v], temperature, tok))
            .collect())
    }

    /// [`Model::score`] of several `(prompt, completion)` pairs at one temperature, with the
    /// work shared: each distinct prompt runs once (a GRPO group's samples share theirs), and
    /// the completions run together, each from a copy of its prompt's cache, in one matrix
    /// product per weight. Each row's arithmetic does not depend on the other rows, and a
    /// copied cache holds the very values the prompt produced, so the result equals
    /// [`Model::score`] of each pair, bit for bit.
    pub fn score_many(
        &self,
        seqs: &[(&[u32], &[u32])],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, InputError> {
        check_temperature(temperature)?;
        for (prompt, completion) in seqs {
            self.check_tokens(prompt, completion, 0)?;
        }
        let live: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].1.is_empty()).collect();
        // Pass 1: every distinct prompt once; the logits after its last token score the
        // first completion token of each of its sequences.
        let mut prompts: Vec<&[u32]> = Vec::new();
        let mut prompt_of: Vec<usize> = Vec::with_capacity(live.len());
        for &i in &live {
            let p = seqs[i].0;
            let at = prompts.iter().position(|q| *q == p).unwrap_or_else(|| {
                prompts.push(p);
                prompts.len() - 1
            });
            prompt_of.push(at);
        }
        let mut prompt_caches: Vec<KvCache> = prompts
            .iter()
            .map(|p| KvCache::new(&self.config, p.len()))
            .collect();
        let mut items: Vec<(usize, u32)> = Vec::new();
        let mut want: Vec<usize> = Vec::new();
        for (ci, p) in prompts.iter().enumerate() {
            items.extend(p.iter().map(|&t| (ci, t)));
            want.push(items.len() - 1);
        }
        let mut refs: Vec<&mut KvCache> = prompt_caches.iter_mut().collect();
        let first = self.forward(&mut refs, &items, &want);
        // Pass 2: every completion but its last token, from a copy of its prompt's cache.
        let mut caches: Vec<KvCache> = Vec::with_capacity(live.len());
        items.clear();
        want.clear();
        for (ci, (&i, &pi)) in live.iter().zip(&prompt_of).enumerate() {
            let completion = seqs[i].1;
            caches.push(prompt_caches[pi].clone());
            let start = items.len();
            items.extend(completion[..completion.len() - 1].iter().map(|&t| (ci, t)));
            want.extend(start..items.len());
        }
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let rest = if items.is_empty() {
            Vec::new()
        } else {
            self.forward(&mut refs, &items, &want)
        };
        let v = self.config.vocab_size;
        let mut out = vec![Vec::new(); seqs.len()];
        let mut row = 0;
        for (&i, &pi) in live.iter().zip(&prompt_of) {
            let completion = seqs[i].1;
            let mut lps = Vec::with_capacity(completion.len());
            lps.push(token_logprob(
                &first[pi * v..(pi + 1) * v],
                temperature,
                completion[0],
            ));
            for &tok in &completion[1..] {
                lps.push(token_logprob(
                    &rest[row * v..(row + 1) * v],
                    temperature,
                    tok,
                ));
                row += 1;
            }
            out[i] = lps;
        }
        Ok(out)
    }

    /// Runs the decoder over `items`: each `(cache, token)` appends `token` to
    /// `caches[cache]` at its next position (several items may extend one cache, in
    /// order). Returns the logits (`want.len() × vocab`) after the items listed in `want`
    /// (indices into `items`). Token ids must already be checked against the vocabulary
    /// and the caches must have room within `max_position_embeddings`.
    pub fn forward(
        &self,
        caches: &mut [&mut KvCache],
        items: &[(usize, u32)],
        want: &[usize],
    ) -> Vec<f32> {
        let c = &self.config;
        let (h, hd, nh, nkv) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let (qd, kvd, inter) = (nh * hd, nkv * hd, c.intermediate_size);
        let eps = c.rms_norm_eps as f32;
        let n = items.len();
        let th = self.threads;

        // Positions: each cache grows from its current length, in item order.
        let mut next: Vec<usize> = caches.iter().map(|k| k.len).collect();
        let pos: Vec<usize> = items
            .iter()
            .map(|&(ci, _)| {
                let p = next[ci];
                next[ci] += 1;
                p
            })
            .collect();

        let mut x = vec![0f32; n * h];
        for (row, &(_, tok)) in x.chunks_exact_mut(h).zip(items) {
            let t = tok as usize;
            row.copy_from_slice(&self.embed[t * h..(t + 1) * h]);
        }
        let mut xn = vec![0f32; n * h];
        let mut q = vec![0f32; n * qd];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        let mut att = vec![0f32; n * qd];
        let mut proj = vec![0f32; n * h];
        let mut gate = vec![0f32; n * inter];
        let mut up = vec![0f32; n * inter];

        for (li, layer) in self.layers.iter().enumerate() {
            xn.copy_from_slice(&x);
            kernels::rms_norm(&mut xn, &layer.input_norm, eps);
            kernels::matmul(&xn, n, &layer.q, &mut q, th);
            kernels::matmul(&xn, n, &layer.k, &mut k, th);
            kernels::matmul(&xn, n, &layer.v, &mut v, th);
            // Qwen3: per-head RMSNorm of q and k, before the rotary embedding.
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                kernels::rms_norm(&mut q, qn, eps);
                kernels::rms_norm(&mut k, kn, eps);
            }
            for (i, &p) in pos.iter().enumerate() {
                self.rope.apply(&mut q[i * qd..(i + 1) * qd], p);
                self.rope.apply(&mut k[i * kvd..(i + 1) * kvd], p);
            }
            for (i, &(ci, _)) in items.iter().enumerate() {
                caches[ci].keys[li].extend_from_slice(&k[i * kvd..(i + 1) * kvd]);
                caches[ci].values[li].extend_from_slice(&v[i * kvd..(i + 1) * kvd]);
            }
            self.attention(caches, items, &pos, li, &q, &mut att);
            kernels::matmul(&att, n, &layer.o, &mut proj, th);
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += *b;
            }

            xn.copy_from_slice(&x);
            kernels::rms_norm(&mut xn, &layer.post_norm, eps);
            kernels::matmul(&xn, n, &layer.gate, &mut gate, th);
            kernels::matmul(&xn, n, &layer.up, &mut up, th);
            kernels::silu_mul(&mut gate, &up);
            kernels::matmul(&gate, n, &layer.down, &mut proj, th);
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += *b;
            }
        }
        for (cache, len) in caches.iter_mut().zip(next) {
            cache.len = len;
        }

        let mut last = Vec::with_capacity(want.len() * h);
        for &i in want {
            last.extend_from_slice(&x[i * h..(i + 1) * h]);
        }
        kernels::rms_norm(&mut last, &self.norm, eps);
        let mut logits = vec![0f32; want.len() * c.vocab_size];
        kernels::matmul(&last, want.len(), &self.lm_head, &mut logits, th);
        logits
    }

    /// Attention for every item over its own cache, split across threads by items.
    fn attention(
        &self,
        caches: &[&mut KvCache],
        items: &[(usize, u32)],
        pos: &[usize],
        layer: usize,
        q: &[f32],
        att: &mut [f32],
    ) {
        let c = &self.config;
        let (hd, nh, nkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let qd = nh * hd;
        let run = |range: std::ops::Range<usize>, out: &mut [f32]| {
            let mut scores = Vec::new();
            for (o, i) in out.chunks_exact_mut(qd).zip(range) {
                let cache = &caches[items[i].0];
                kernels::attend(
                    &q[i * qd..(i + 1) * qd],
                    &cache.keys[layer],
                    &cache.values[layer],
                    pos[i] + 1,
                    nh,
                    nkv,
                    hd,
                    &mut scores,
                    o,
                );
            }
        };
        let work: usize = pos.iter().map(|p| (p + 1) * qd * 2).sum();
        let n = items.len();
        let threads = self.threads.min(n).max(1);
        if threads == 1 || work < 1 << 17 {
            run(0..n, att);
            return;
        }
        let per = n.div_ceil(threads);
        std::thread::scope(|s| {
            for (ti, out) in att.chunks_mut(per * qd).enumerate() {
                let start = ti * per;
                let end = start + out.len() / qd;
                let run = &run;
                s.spawn(move || run(start..end, out));
            }
        });
    }
}
