//! `starling model …`: model files and a look at a model from the command line.
//!
//! - `import` turns a GGUF file into the Hugging Face directory every Starling binary,
//!   transformers and vLLM start from (`starling_import`);
//! - `run` renders, tokenizes and (greedily) generates with a model directory exactly as the
//!   hub and the built-in engine do, one JSON request per line (the cross-checks against
//!   transformers and vLLM in `integrations/vllm/tests/test_model.py` drive it);
//! - `bench` measures the built-in engine's generation speed on a model directory with chat
//!   prompts (`docs/benchmarks.md`);
//! - `score` recomputes completions' log-probabilities with the built-in engine on the weights
//!   of a given version, bit for bit what an actor's engine reported for them: a trainer
//!   outside Rust (the SDK's GRPO trainer) checks builtin-generated samples exactly with it.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use starling_engine::{GenRequest, GenerateOptions, Model, ModelConfig, Sampling};
use starling_text::{Message, ModelText};

#[derive(Subcommand, Debug)]
pub(crate) enum ModelCmd {
    /// Write a Hugging Face model directory from a GGUF file: BF16 model.safetensors (the
    /// GGUF's quantised tensors dequantised as gguf-py does), config.json,
    /// generation_config.json, tokenizer.json and tokenizer_config.json with the chat
    /// template. Llama-family GGUFs with a GPT-2-style BPE vocabulary (SmolLM2, Llama 3).
    Import(ImportArgs),
    /// Read JSON requests from stdin, one per line — {"messages": [{"role", "content"}]},
    /// {"text": "…"} or {"ids": [...]}, optionally with "max_new_tokens": N for a greedy
    /// generation with the built-in engine — and answer each on stdout with the rendered
    /// prompt ("prompt_text"), its ids ("prompt_ids") and, when asked, the generated
    /// "tokens", "logprobs" and decoded "text" (up to the first EOS), or an "error".
    Run(RunArgs),
    /// The built-in engine's generation speed on a model directory: chat prompts, batches of
    /// 16, 32 and 64 sequences, temperature 1, short completions.
    Bench(BenchArgs),
    /// Read JSON requests from stdin, one per line — `{"weights": FILE, "items": [{"prompt":
    /// IDS, "completion": IDS, "temperature": T}, …]}` — and answer each on stdout with
    /// `{"logprobs": [[…], …]}`: every completion token's log-probability under the weights in
    /// FILE (a safetensors checkpoint of the model directory's layout), computed by the
    /// built-in engine exactly as it computes them while generating, or an "error".
    Score(RunArgs),
}

#[derive(Args, Debug)]
pub(crate) struct ImportArgs {
    /// The GGUF file.
    #[arg(long)]
    gguf: PathBuf,
    /// The directory to create (must not exist, or be empty).
    #[arg(short = 'o', long = "out")]
    out: PathBuf,
}

#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The model directory (config.json, model.safetensors, tokenizer files).
    #[arg(long)]
    model: PathBuf,
}

#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// The model directory.
    #[arg(long)]
    model: PathBuf,
    /// Batch sizes (sequences decoded together), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64")]
    batch: Vec<usize>,
    /// New tokens per sequence (every sequence runs to this length: no stop tokens).
    #[arg(long, default_value_t = 32)]
    new: u32,
    /// Threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
}

pub(crate) fn run(cmd: ModelCmd) -> anyhow::Result<()> {
    match cmd {
        ModelCmd::Import(a) => import(&a),
        ModelCmd::Run(a) => run_requests(&a.model),
        ModelCmd::Bench(a) => bench(&a),
        ModelCmd::Score(a) => score_requests(&a.model),
    }
}

fn import(a: &ImportArgs) -> anyhow::Result<()> {
    let r = starling_import::import_gguf(&a.gguf, &a.out)
        .with_context(|| format!("import {}", a.gguf.display()))?;
    let p = &r.params;
    println!(
        "imported {} into {}: LlamaForCausalLM, {:.1} M parameters in {} tensors \
         (hidden {}, {} layers, {} heads / {} KV heads, vocabulary {}, context {}, \
         tied embeddings: {})",
        a.gguf.display(),
        a.out.display(),
        r.parameters as f64 / 1e6,
        r.tensors,
        p.hidden_size,
        p.num_hidden_layers,
        p.num_attention_heads,
        p.num_key_value_heads,
        p.vocab_size,
        p.max_position_embeddings,
        p.tie_word_embeddings
    );
    Ok(())
}

/// Loads the built-in engine from a model directory (BF16, F16 or F32 safetensors; cast to
/// BF16 as PyTorch does).
fn load_model(dir: &Path) -> anyhow::Result<Model> {
    load_weights(dir, dir)
}

/// Loads the built-in engine with the model directory's config and the weights in
/// `weights` (a safetensors file or a directory of them).
fn load_weights(dir: &Path, weights: &Path) -> anyhow::Result<Model> {
    let config = ModelConfig::from_file(&dir.join("config.json"))
        .with_context(|| format!("read {}", dir.join("config.json").display()))?;
    let ckpt = starling_checkpoint::safetensors::Checkpoint::open(weights)
        .with_context(|| format!("open the weights in {}", weights.display()))?;
    let weights: BTreeMap<String, Vec<u16>> = ckpt.read_all().context("read the weights")?;
    let shapes: BTreeMap<String, Vec<usize>> = config.tensor_shapes().into_iter().collect();
    let lookup = |name: &str| -> Option<(&[usize], &[u16])> {
        Some((shapes.get(name)?.as_slice(), weights.get(name)?.as_slice()))
    };
    Model::from_bf16(config.clone(), lookup).context("load the model into the built-in engine")
}

fn answer(
    text: &ModelText,
    model: &mut Option<Model>,
    dir: &Path,
    req: &Value,
) -> anyhow::Result<Value> {
    let (prompt_text, ids) = if let Some(m) = req.get("messages") {
        let messages: Vec<Message> =
            serde_json::from_value(m.clone()).context("messages must be [{role, content}]")?;
        let (t, ids) = text.encode_chat(&messages)?;
        (Some(t), ids)
    } else if let Some(t) = req.get("text").and_then(Value::as_str) {
        (Some(t.to_owned()), text.encode(t)?)
    } else if let Some(ids) = req.get("ids") {
        (
            None,
            serde_json::from_value(ids.clone()).context("ids must be token ids")?,
        )
    } else {
        bail!("a request has messages, text or ids");
    };
    let mut out = json!({"prompt_text": prompt_text, "prompt_ids": ids});
    if let Some(n) = req.get("max_new_tokens").and_then(Value::as_u64) {
        if model.is_none() {
            *model = Some(load_model(dir)?);
        }
        let Some(m) = model.as_ref() else {
            bail!("no model");
        };
        let eos = text.eos_ids().to_vec();
        let r = GenRequest {
            prompt: ids,
            sampling: Sampling {
                stop_token_ids: eos.clone(),
                ..Sampling::greedy(u32::try_from(n).unwrap_or(u32::MAX))
            },
            sample_index: 0,
        };
        let g = m
            .generate(&[r], GenerateOptions::default())?
            .pop()
            .context("no output")?;
        out["text"] = json!(text.decode(&g.tokens, &eos));
        out["tokens"] = json!(g.tokens);
        out["logprobs"] = json!(g.logprobs);
    }
    Ok(out)
}

fn run_requests(dir: &Path) -> anyhow::Result<()> {
    let text =
        ModelText::load(dir).with_context(|| format!("load the tokenizer of {}", dir.display()))?;
    let mut model = None;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("read stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        let out = serde_json::from_str::<Value>(&line)
            .context("a request is not JSON")
            .and_then(|req| answer(&text, &mut model, dir, &req))
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        let mut w = stdout.lock();
        writeln!(w, "{out}").context("write stdout")?;
        w.flush().context("write stdout")?;
    }
    Ok(())
}

/// Sequences `score` runs through the engine together.
const SCORE_CHUNK: usize = 32;

/// One `score` request: a weights file and the completions to score on it.
#[derive(serde::Deserialize)]
struct ScoreRequest {
    weights: PathBuf,
    items: Vec<ScoreItem>,
}

#[derive(serde::Deserialize)]
struct ScoreItem {
    prompt: Vec<u32>,
    completion: Vec<u32>,
    temperature: f32,
}

fn score_requests(dir: &Path) -> anyhow::Result<()> {
    // The weights of the last request's file: a trainer sends a version's samples together.
    let mut loaded: Option<(PathBuf, Model)> = None;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("read stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        let out = serde_json::from_str::<ScoreRequest>(&line)
            .context("a request is not {\"weights\": FILE, \"items\": [{prompt, completion, temperature}]}")
            .and_then(|req| {
                if loaded.as_ref().is_none_or(|(p, _)| *p != req.weights) {
                    loaded = None;
                    loaded = Some((req.weights.clone(), load_weights(dir, &req.weights)?));
                }
                let Some((_, model)) = loaded.as_ref() else {
                    bail!("no model");
                };
                // Items at one temperature in one forward pass each, in chunks that bound
                // the logits held (rows × vocabulary).
                let mut scored: Vec<Vec<f32>> = vec![Vec::new(); req.items.len()];
                let mut temps: Vec<f32> = req.items.iter().map(|i| i.temperature).collect();
                temps.sort_by(f32::total_cmp);
                temps.dedup();
                for t in temps {
                    let of_t: Vec<usize> = (0..req.items.len())
                        .filter(|&k| req.items[k].temperature.to_bits() == t.to_bits())
                        .collect();
                    for chunk in of_t.chunks(SCORE_CHUNK) {
                        let seqs: Vec<(&[u32], &[u32])> = chunk
                            .iter()
                            .map(|&k| (req.items[k].prompt.as_slice(), req.items[k].completion.as_slice()))
                            .collect();
                        for (&k, lp) in chunk.iter().zip(model.score_many(&seqs, t)?) {
                            scored[k] = lp;
                        }
                    }
                }
                // Serialized as f32 (the shortest text that reads back as the same f32), as
                // the hub stores the actors' log-probabilities: equal values, equal text.
                Ok(format!(
                    "{{\"logprobs\":{}}}",
                    serde_json::to_string(&scored).context("serialize")?
                ))
            })
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}).to_string());
        let mut w = stdout.lock();
        writeln!(w, "{out}").context("write stdout")?;
        w.flush().context("write stdout")?;
    }
    Ok(())
}

/// User + system CPU time of this process so far (Linux `/proc/self/stat`; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// Chat prompts of a GSM8K-like arithmetic task, as an RL run would send them.
fn bench_prompts(n: usize) -> Vec<Vec<Message>> {
    (0..n)
        .map(|i| {
            let (a, b) = (12 + 7 * i % 89, 30 + 13 * i % 97);
            vec![Message {
                role: "user".into(),
                content: format!(
                    "Tom has {a} apples and buys {b} more. How many apples does he have? \
                     Answer with a number."
                ),
            }]
        })
        .collect()
}

fn bench(a: &BenchArgs) -> anyhow::Result<()> {
    let text = ModelText::load(&a.model)?;
    let mut model = load_model(&a.model)?;
    if let Some(t) = a.threads {
        model.set_threads(t);
    }
    println!(
        "model {}: {:.1} M parameters, {} threads, {} new tokens per sequence, temperature 1",
        a.model.display(),
        model.parameter_count() as f64 / 1e6,
        model.threads(),
        a.new
    );
    for &batch in &a.batch {
        let prompts = bench_prompts(batch);
        let reqs = prompts
            .iter()
            .enumerate()
            .map(|(i, m)| {
                Ok(GenRequest {
                    prompt: text.encode_chat(m)?.1,
                    sampling: Sampling {
                        temperature: 1.0,
                        max_new_tokens: a.new,
                        seed: 1,
                        ..Sampling::default()
                    },
                    sample_index: i as u32,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let prompt_tokens: usize = reqs.iter().map(|r| r.prompt.len()).sum();
        let (start, cpu0) = (Instant::now(), cpu_seconds());
        let out = model.generate(&reqs, GenerateOptions { max_batch: batch })?;
        let wall = start.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        let tokens: usize = out.iter().map(|o| o.tokens.len()).sum();
        // CPU seconds too: on a shared machine the wall time measures the share it got.
        println!(
            "batch {batch:>3}: {tokens:>5} new tokens ({prompt_tokens} prompt tokens) in {wall:.2} s \
             = {:.1} tokens/s; {cpu:.2} CPU-s = {:.1} tokens per CPU-second",
            tokens as f64 / wall,
            tokens as f64 / cpu.max(1e-9)
        );
    }
    Ok(())
}
