//! Batched generation with a KV cache.
//!
//! Requests are validated up front (nothing is generated if any is invalid). Up to
//! [`GenerateOptions::max_batch`] sequences are active at once; each step runs one
//! [`Model::forward`] over every active sequence's newest token plus the whole prompt of
//! any sequence admitted this step, samples one token per sequence, and retires the
//! sequences that finished (a stop token, kept as the last token, or `max_new_tokens`);
//! waiting requests take their places. Because the forward pass is batch-invariant and
//! sampling is counter-based (see [`crate::sampling`]), each output is the same bits
//! whichever requests it shares batches with, and its log-probabilities equal
//! [`Model::score`]'s for the same tokens.

use std::time::{Duration, Instant};

use crate::input::InputError;
use crate::model::{KvCache, Model};
use crate::sampling::{self, Sampling};

/// One sequence to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub sampling: Sampling,
    /// Distinguishes samples of one prompt under one seed (keys the sampler's counter).
    pub sample_index: u32,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated (it is the last token).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
}

/// One finished sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct GenOutput {
    /// The generated tokens (not the prompt).
    pub tokens: Vec<u32>,
    /// `log_softmax(logits / T)[token]` per generated token (see [`crate::sampling`]).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    /// Duration of the step that processed this prompt (shared with the sequences batched
    /// in that step).
    pub prefill_time: Duration,
    /// From the end of that step until the sequence finished.
    pub decode_time: Duration,
}

/// Batch-level settings (they never change the outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerateOptions {
    /// Most sequences decoded together.
    pub max_batch: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_batch: 64 }
    }
}

/// Why generation did not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GenerateError {
    #[error("request {index}: {problem}")]
    Request { index: usize, problem: InputError },
}

/// A sequence being decoded.
#[derive(Debug)]
struct Active {
    index: usize,
    cache: KvCache,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    /// Whether the prompt is still to be run.
    fresh: bool,
    prefill_time: Duration,
    decode_start: Instant,
}

impl Model {
    /// Generates a completion for every request, in request order.
    pub fn generate(
        &self,
        requests: &[GenRequest],
        opts: GenerateOptions,
    ) -> Result<Vec<GenOutput>, GenerateError> {
        self.generate_observed(requests, opts, &mut |_| {})
    }

    /// [`Model::generate`], calling `on_step` after each decoding step with the indices of
    /// the requests that got a token in it (for progress reports; it never changes the
    /// outputs).
    pub fn generate_observed(
        &self,
        requests: &[GenRequest],
        opts: GenerateOptions,
        on_step: &mut dyn FnMut(&[usize]),
    ) -> Result<Vec<GenOutput>, GenerateError> {
        for (index, r) in requests.iter().enumerate() {
            r.sampling
                .validate()
                .and_then(|()| {
                    self.check_tokens(&r.prompt, &[], r.sampling.max_new_tokens as usize)
                })
                .map_err(|problem| GenerateError::Request { index, problem })?;
        }
        let vocab = self.config().vocab_size;
        let max_batch = opts.max_batch.max(1);
        let mut outputs: Vec<Option<GenOutput>> = vec![None; requests.len()];
        let mut waiting = 0..requests.len();
        let mut active: Vec<Active> = Vec::new();
        let mut scratch = sampling::Scratch::default();
        loop {
            while active.len() < max_batch {
                let Some(index) = waiting.next() else { break };
                let r = &requests[index];
                if r.sampling.max_new_tokens == 0 {
                    outputs[index] = Some(GenOutput {
                        tokens: Vec::new(),
                        logprobs: Vec::new(),
                        finish: FinishReason::Length,
                        prefill_time: Duration::ZERO,
                        decode_time: Duration::ZERO,
                    });
                    continue;
                }
                let positions = r.prompt.len() + r.sampling.max_new_tokens as usize;
                active.push(Active {
                    index,
                    cache: KvCache::new(self.config(), positions),
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    fresh: true,
                    prefill_time: Duration::ZERO,
                    decode_start: Instant::now(),
                });
            }
            if active.is_empty() {
                break;
            }
            // One forward over every active sequence: a prompt for new ones, the last
            // sampled token for the others.
            let mut items = Vec::new();
            let mut want = Vec::with_capacity(active.len());
            for (ci, a) in active.iter().enumerate() {
                if a.fresh {
                    items.extend(requests[a.index].prompt.iter().map(|&t| (ci, t)));
                } else if let Some(&t) = a.tokens.last() {
                    items.push((ci, t));
                }
                want.push(items.len() - 1);
            }
            let start = Instant::now();
            let logits = {
                let mut caches: Vec<&mut KvCache> =
                    active.iter_mut().map(|a| &mut a.cache).collect();
                self.forward(&mut caches, &items, &want)
            };
            let now = Instant::now();
            let mut finished = Vec::new();
            let mut sampled = Vec::with_capacity(active.len());
            for (ci, a) in active.iter_mut().enumerate() {
                if a.fresh {
                    a.fresh = false;
                    a.prefill_time = now - start;
                    a.decode_start = now;
                }
                let r = &requests[a.index];
                let l = &logits[ci * vocab..(ci + 1) * vocab];
                let position = (r.prompt.len() + a.tokens.len()) as u64;
                let tok = sampling::sample(l, &r.sampling, r.sample_index, position, &mut scratch);
                a.tokens.push(tok);
                sampled.push(a.index);
                a.logprobs
                    .push(sampling::token_logprob(l, r.sampling.temperature, tok));
                if r.sampling.stop_token_ids.contains(&tok) {
                    finished.push((ci, FinishReason::Stop));
                } else if a.tokens.len() >= r.sampling.max_new_tokens as usize {
                    finished.push((ci, FinishReason::Length));
                }
            }
            on_step(&sampled);
            for &(ci, finish) in finished.iter().rev() {
                let a = active.remove(ci);
                outputs[a.index] = Some(GenOutput {
                    tokens: a.tokens,
                    logprobs: a.logprobs,
                    finish,
                    prefill_time: a.prefill_time,
                    decode_time: a.decode_start.elapsed(),
                });
            }
        }
        Ok(outputs.into_iter().flatten().collect())
    }
}
