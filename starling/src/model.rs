//! `starling model …`: model files. `import` turns a GGUF file into the Hugging Face
//! directory every Starling binary, transformers and vLLM start from (`starling_import`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub(crate) enum ModelCmd {
    /// Write a Hugging Face model directory from a GGUF file: BF16 model.safetensors (the
    /// GGUF's quantised tensors dequantised as gguf-py does), config.json,
    /// generation_config.json, tokenizer.json and tokenizer_config.json with the chat
    /// template. Llama-family GGUFs with a GPT-2-style BPE vocabulary (SmolLM2, Llama 3).
    Import(ImportArgs),
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

pub(crate) fn run(cmd: ModelCmd) -> anyhow::Result<()> {
    match cmd {
        ModelCmd::Import(a) => {
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
    }
}
