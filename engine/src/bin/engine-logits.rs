//! Prints the engine's logits for a token sequence as JSON, for cross-checks against other
//! implementations (`engine/tests/hf_reference.py` compares them with Hugging Face's).
//!
//! `engine-logits <dir with config.json and model.safetensors (BF16)> <token id>...`
//! prints `{"logits": [[...vocab...], ...]}`: one row per position.

use std::path::Path;

use anyhow::{Context, bail};
use starling_engine::{Bf16Tensor, Bf16Tensors, KvCache, Model, ModelConfig};

/// Reads a single-file safetensors checkpoint of BF16 tensors.
fn read_bf16_safetensors(path: &Path) -> anyhow::Result<Bf16Tensors> {
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .context("read header length")?;
    let header_len = usize::try_from(u64::from_le_bytes(len_bytes)).context("header length")?;
    let header = bytes
        .get(8..8 + header_len)
        .context("header beyond end of file")?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header).context("parse header")?;
    let data = &bytes[8 + header_len..];
    let mut out = Bf16Tensors::default();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        if info["dtype"] != "BF16" {
            bail!("tensor {name} is {}, not BF16", info["dtype"]);
        }
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone())
            .with_context(|| format!("shape of {name}"))?;
        let [start, end]: [usize; 2] = serde_json::from_value(info["data_offsets"].clone())
            .with_context(|| format!("offsets of {name}"))?;
        let raw = data
            .get(start..end)
            .with_context(|| format!("data of {name} beyond end of file"))?;
        let bits = raw
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        out.0.insert(name, Bf16Tensor { shape, bits });
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((dir, ids)) = args.split_first() else {
        bail!("usage: engine-logits <model dir> <token id>...");
    };
    let dir = Path::new(dir);
    let config = ModelConfig::from_file(&dir.join("config.json")).context("load config.json")?;
    let tensors = read_bf16_safetensors(&dir.join("model.safetensors"))?;
    let model = Model::from_tensors(config.clone(), &tensors).context("load model")?;
    let tokens: Vec<u32> = ids
        .iter()
        .map(|s| s.parse().with_context(|| format!("parse token id {s}")))
        .collect::<anyhow::Result<_>>()?;
    if tokens.is_empty() || tokens.iter().any(|&t| t as usize >= config.vocab_size) {
        bail!(
            "token ids must be nonempty and below vocab_size {}",
            config.vocab_size
        );
    }
    let mut cache = KvCache::new(&config, tokens.len());
    let items: Vec<(usize, u32)> = tokens.iter().map(|&t| (0, t)).collect();
    let all: Vec<usize> = (0..tokens.len()).collect();
    let logits = model.forward(&mut [&mut cache], &items, &all);
    let rows: Vec<&[f32]> = logits.chunks_exact(config.vocab_size).collect();
    println!("{}", serde_json::json!({ "logits": rows }));
    Ok(())
}
