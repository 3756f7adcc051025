//! `starling-import`: a pretrained model from a GGUF file into a Hugging Face directory.
//!
//! [`import_gguf`] reads a GGUF file (llama.cpp's format; how SmolLM2-135M-Instruct reaches
//! these machines, `docs/models.md`) and writes the directory every Starling binary, transformers
//! and vLLM start from:
//!
//! - `model.safetensors`: every tensor in BF16 under Hugging Face's names, dequantised in
//!   `f32` as gguf-py does ([`dequant`]) and rounded to BF16 as PyTorch does
//!   (`starling_proto::delta::bf16`), with llama.cpp's rotary row permutation undone ([`llama`]);
//!   tied embeddings stay tied (no `lm_head.weight`);
//! - `config.json` (`LlamaForCausalLM`, no `quantization_config`) and
//!   `generation_config.json`;
//! - `tokenizer.json` and `tokenizer_config.json` with the chat template ([`tokenizer`]).
//!
//! The result equals transformers' own GGUF load cast to BF16 bit for bit, and its tokenizer
//! encodes as transformers' GGUF tokenizer does (`integrations/vllm/tests/test_model.py`),
//! except that it splits text as `tokenizer.ggml.pre` says, which transformers ignores.
//!
//! What the importer cannot write faithfully it refuses, naming it, rather than write a model
//! that differs from the original: an unknown `tokenizer.ggml.pre` ([`tokenizer`]) and
//! llama.cpp's `rope_freqs.weight` (Llama 3.1-style RoPE scaling, [`llama`]).
//!
//! Memory is bounded by the largest tensor: the header is parsed from a buffered reader, and
//! tensors are read, converted and streamed into the safetensors writer one at a time. The
//! directory appears whole or not at all: everything is written into a temporary sibling that
//! is renamed into place last.

pub mod dequant;
pub mod gguf;
pub mod llama;
pub mod tokenizer;

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use starling_checkpoint::writer::SafetensorsWriter;

pub use gguf::{GgufError, Header};
pub use llama::{LlamaError, LlamaParams};

/// Why an import failed (nothing was left at the output path).
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{path}")]
    Gguf {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    #[error("{0}")]
    Model(#[from] LlamaError),
    #[error("{0}")]
    Tokenizer(#[from] tokenizer::TokenizerBuildError),
    #[error("tensor {name}: {source}")]
    Tensor {
        name: String,
        #[source]
        source: dequant::DequantError,
    },
    #[error("tensor {name}: its data lies beyond the end of the file")]
    Truncated { name: String },
    #[error("{0} exists and is not empty; import into a new directory")]
    OutputExists(PathBuf),
    #[error("{action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ImportError + 'a {
    move |source| ImportError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// What an import wrote.
#[derive(Debug, Clone)]
pub struct ImportReport {
    pub params: LlamaParams,
    /// Tensors written to `model.safetensors`.
    pub tensors: usize,
    /// Elements over all of them.
    pub parameters: u64,
}

/// Reads the header of a GGUF file.
pub fn read_header(path: &Path) -> Result<Header, ImportError> {
    let f = File::open(path).map_err(io("open", path))?;
    Header::read(BufReader::new(f)).map_err(|source| ImportError::Gguf {
        path: path.to_owned(),
        source,
    })
}

/// Imports the GGUF file `gguf` into the new directory `out` (see the crate doc).
pub fn import_gguf(gguf: &Path, out: &Path) -> Result<ImportReport, ImportError> {
    if out.exists()
        && std::fs::read_dir(out)
            .map_err(io("read", out))?
            .next()
            .is_some()
    {
        return Err(ImportError::OutputExists(out.to_owned()));
    }
    let header = read_header(gguf)?;
    let params = LlamaParams::from_header(&header)?;
    let tok = tokenizer::build(&header, params.max_position_embeddings)?;
    let shapes = params.tensor_shapes();

    // Plan: every GGUF tensor to its HF name, checked against the config, none missing.
    let mut plan = Vec::new();
    for t in &header.tensors {
        let (hf, order) = llama::hf_name(&t.name, &params)?;
        llama::check_shape(t, &hf, &shapes)?;
        plan.push((hf, order, t));
    }
    plan.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, _) in &shapes {
        if !plan.iter().any(|(n, _, _)| n == name) {
            return Err(LlamaError::Missing(name.clone()).into());
        }
    }

    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io("create", parent))?;
    let tmp = parent.join(format!(
        ".{}.import-{}",
        out.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(io("create", &tmp))?;
    let written = write_dir(gguf, &header, &params, &tok, &plan, &shapes, &tmp);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if out.exists() {
        std::fs::remove_dir(out).map_err(io("replace", out))?;
    }
    std::fs::rename(&tmp, out).map_err(io("rename into", out))?;
    Ok(ImportReport {
        params,
        tensors: plan.len(),
        parameters: shapes.iter().map(|(_, s)| s.iter().product::<u64>()).sum(),
    })
}

type Plan<'a> = [(String, llama::RowOrder, &'a gguf::TensorInfo)];

fn write_dir(
    gguf: &Path,
    header: &Header,
    params: &LlamaParams,
    tok: &tokenizer::TokenizerFiles,
    plan: &Plan<'_>,
    shapes: &[(String, Vec<u64>)],
    dir: &Path,
) -> Result<(), ImportError> {
    let st = dir.join("model.safetensors");
    let mut writer = SafetensorsWriter::create(&st, shapes, None).map_err(io("create", &st))?;
    let mut file = File::open(gguf).map_err(io("open", gguf))?;
    let len = file.metadata().map_err(io("stat", gguf))?.len();
    for (_, order, t) in plan {
        let bytes = t.data_bytes().ok_or_else(|| ImportError::Tensor {
            name: t.name.clone(),
            source: dequant::DequantError::Unsupported(t.kind.name()),
        })?;
        let start = header.data_start.checked_add(t.offset);
        if start
            .and_then(|s| s.checked_add(bytes))
            .is_none_or(|end| end > len)
        {
            return Err(ImportError::Truncated {
                name: t.name.clone(),
            });
        }
        let mut data = vec![0u8; bytes as usize];
        file.seek(SeekFrom::Start(start.unwrap_or(0)))
            .and_then(|_| file.read_exact(&mut data))
            .map_err(io("read", gguf))?;
        let values = dequant::dequantize(t.kind, &data, t.numel()).map_err(|source| {
            ImportError::Tensor {
                name: t.name.clone(),
                source,
            }
        })?;
        let values = match *order {
            llama::RowOrder::AsStored => values,
            llama::RowOrder::Unpermute { heads } => {
                let cols = t.dims.first().copied().unwrap_or(1) as usize;
                llama::unpermute_rows(&values, heads as usize, cols)
            }
        };
        let bits: Vec<u16> = values
            .iter()
            .map(|&x| starling_proto::delta::bf16::f32_to_bf16(x))
            .collect();
        writer.write(&bits).map_err(io("write", &st))?;
    }
    writer.finish().map_err(io("write", &st))?;
    let json = |name: &str, v: &serde_json::Value| -> Result<(), ImportError> {
        let p = dir.join(name);
        let text = serde_json::to_string_pretty(v).unwrap_or_default();
        std::fs::write(&p, text + "\n").map_err(io("write", &p))
    };
    json("config.json", &params.config_json())?;
    json("generation_config.json", &params.generation_config_json())?;
    json("tokenizer_config.json", &tok.tokenizer_config)?;
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, &tok.tokenizer_json).map_err(io("write", &p))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::Value;

    /// A one-layer Llama (hidden 4, 2 query heads over 1 KV head, 4 tokens) as a GGUF file
    /// with F32 tensors, plus `extra` tensors, splitting text as `pre` says.
    fn tiny_llama(dir: &Path, pre: Option<&str>, extra: &[(&str, Vec<u64>)]) -> PathBuf {
        let s = |x: &str| Value::String(x.to_owned());
        let mut meta = vec![
            ("general.architecture", s("llama")),
            ("llama.block_count", Value::U64(1)),
            ("llama.context_length", Value::U64(16)),
            ("llama.embedding_length", Value::U64(4)),
            ("llama.feed_forward_length", Value::U64(8)),
            ("llama.attention.head_count", Value::U64(2)),
            ("llama.attention.head_count_kv", Value::U64(1)),
            ("tokenizer.ggml.model", s("gpt2")),
            (
                "tokenizer.ggml.tokens",
                Value::Array(["a", "Ġ", "ĠĠ", "1"].map(s).to_vec()),
            ),
            ("tokenizer.ggml.merges", Value::Array(vec![s("Ġ Ġ")])),
        ];
        if let Some(p) = pre {
            meta.push(("tokenizer.ggml.pre", s(p)));
        }
        let mut tensors = vec![
            ("token_embd.weight", vec![4, 4]),
            ("output_norm.weight", vec![4]),
            ("blk.0.attn_norm.weight", vec![4]),
            ("blk.0.attn_q.weight", vec![4, 4]),
            ("blk.0.attn_k.weight", vec![4, 2]),
            ("blk.0.attn_v.weight", vec![4, 2]),
            ("blk.0.attn_output.weight", vec![4, 4]),
            ("blk.0.ffn_norm.weight", vec![4]),
            ("blk.0.ffn_gate.weight", vec![4, 8]),
            ("blk.0.ffn_up.weight", vec![4, 8]),
            ("blk.0.ffn_down.weight", vec![8, 4]),
        ];
        tensors.extend(extra.iter().cloned());
        let p = dir.join("tiny.gguf");
        std::fs::write(&p, gguf::write_test_file(&meta, &tensors)).expect("write");
        p
    }

    fn encode(dir: &Path, text: &str) -> Vec<u32> {
        let t = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("loads");
        t.encode(text, false).expect("encodes").get_ids().to_vec()
    }

    #[test]
    fn a_tiny_llama_imports_and_its_tokenizer_splits_as_tokenizer_ggml_pre_says() {
        let d = tempfile::tempdir().expect("tempdir");
        let smollm = d.path().join("smollm");
        let r = import_gguf(&tiny_llama(d.path(), Some("smollm"), &[]), &smollm).expect("imports");
        assert_eq!((r.tensors, r.params.rope_scaling), (11, None));
        // "smollm" isolates every digit first: "a  1" splits as "a", "  ", "1", and the two
        // spaces merge; GPT-2's regex alone splits "a", " ", " 1" and they cannot.
        assert_eq!(encode(&smollm, "a  1"), vec![0, 2, 3]);
        assert_eq!(encode(&smollm, "a 1"), vec![0, 1, 3]);
        let gpt2 = d.path().join("gpt2");
        import_gguf(&tiny_llama(d.path(), Some("gpt2"), &[]), &gpt2).expect("imports");
        assert_eq!(encode(&gpt2, "a  1"), vec![0, 1, 1, 3]);
        assert_eq!(encode(&gpt2, "a 1"), vec![0, 1, 3]);
    }

    #[test]
    fn rope_freqs_and_unknown_pre_tokenizations_are_refused_and_nothing_is_written() {
        let d = tempfile::tempdir().expect("tempdir");
        let out = d.path().join("out");
        let refused = |gguf: PathBuf| {
            let e = import_gguf(&gguf, &out).expect_err("refused");
            assert!(!out.exists(), "nothing is written");
            e
        };
        let e = refused(tiny_llama(
            d.path(),
            Some("smollm"),
            &[("rope_freqs.weight", vec![1])],
        ));
        assert!(
            matches!(e, ImportError::Model(LlamaError::RopeFreqs)),
            "{e}"
        );
        let said = e.to_string();
        assert!(
            said.contains("rope_freqs") && said.contains("Hugging Face checkpoint"),
            "{said}"
        );

        let e = refused(tiny_llama(d.path(), Some("llama-bpe"), &[]));
        assert!(
            matches!(&e, ImportError::Tokenizer(tokenizer::TokenizerBuildError::PreTokenizer(p)) if p == "llama-bpe"),
            "{e}"
        );
        let said = e.to_string();
        assert!(
            said.contains("\"llama-bpe\"") && said.contains("\"gpt2\" and \"smollm\""),
            "{said}"
        );

        let e = refused(tiny_llama(d.path(), None, &[]));
        assert!(
            matches!(
                e,
                ImportError::Tokenizer(tokenizer::TokenizerBuildError::NoPreTokenizer)
            ),
            "{e}"
        );
    }
}
