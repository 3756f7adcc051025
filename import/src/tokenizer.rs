//! The tokenizer files of a GGUF model: `tokenizer.json` built with the `tokenizers` crate the
//! way transformers' GGUF converter builds it, and `tokenizer_config.json` with the special
//! tokens and the chat template.
//!
//! Only GPT-2-style byte-level BPE (`tokenizer.ggml.model = "gpt2"`, the Llama 3 / SmolLM
//! family) is built. transformers' `GGUFLlamaConverter` makes, for such a vocabulary: a BPE
//! model over `tokenizer.ggml.tokens` (id = position) and `tokenizer.ggml.merges`
//! (`fuse_unk`, `byte_fallback`, no unknown token), every token of type 3 (control) as a
//! special added token, an empty normalizer sequence, a `ByteLevel` pre-tokenizer (no prefix
//! space, offsets untrimmed, GPT-2's split regex) and the decoder sequence `ByteFallback`,
//! `Fuse`, `Replace("▁", " ")`, `ByteLevel`. A beginning-of-sequence token is prepended by a
//! template post-processor only where the file says `tokenizer.ggml.add_bos_token = true`.
//! A SentencePiece vocabulary (`"llama"`) is refused by name.
//!
//! How text is split before BPE differs between models, and GGUF names it in
//! `tokenizer.ggml.pre` (llama.cpp picks its split regexes by that name). transformers'
//! converter ignores the key and always uses GPT-2's regex; that is right for `"gpt2"` only.
//! This importer follows the key, for the names whose splitting it builds exactly
//! ([`PreTokenizer`]): `"gpt2"` (GPT-2's regex) and `"smollm"` (each digit alone, then GPT-2's
//! regex: llama.cpp's `\p{N}` split, and the original SmolLM2 `tokenizer.json`'s `Digits`
//! then `ByteLevel`). Any other name (`"llama-bpe"`, `"qwen2"`, …), or none, is refused: a
//! tokenizer that splits differently from the model's own would encode prompts into ids the
//! model was never trained on.

use serde_json::{Value as Json, json};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NormalizerWrapper, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, Tokenizer};

use crate::gguf::{Header, Value};

/// GGUF's token type of control (special) tokens.
const CONTROL: u64 = 3;

/// Why the tokenizer cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerBuildError {
    #[error(
        "tokenizer.ggml.model is {0:?}; this importer builds GPT-2-style byte-level BPE (\"gpt2\") only"
    )]
    Model(String),
    #[error(
        "tokenizer.ggml.pre is {0:?}: this importer splits text before BPE as {known} only \
         ({0:?} splits differently, and a tokenizer built otherwise would not encode as the \
         model's own); import from the Hugging Face checkpoint instead",
        known = PreTokenizer::KNOWN
    )]
    PreTokenizer(String),
    #[error(
        "tokenizer.ggml.pre is missing, so how the model splits text before BPE is unknown \
         (this importer builds {known}); re-convert the model with a current llama.cpp or \
         import from the Hugging Face checkpoint instead",
        known = PreTokenizer::KNOWN
    )]
    NoPreTokenizer,
    #[error("metadata key {key}: {problem}")]
    Metadata { key: &'static str, problem: String },
    #[error("build the tokenizer: {0}")]
    Build(String),
}

/// The pre-tokenizations (`tokenizer.ggml.pre`) this importer builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `"gpt2"`: GPT-2's split regex (`ByteLevel` with its regex).
    Gpt2,
    /// `"smollm"`: every number character alone (`Digits`, individual), then GPT-2's regex.
    SmolLm,
}

impl PreTokenizer {
    const KNOWN: &'static str = "\"gpt2\" and \"smollm\"";

    /// The pre-tokenization the GGUF names in `tokenizer.ggml.pre`.
    pub fn from_header(h: &Header) -> Result<Self, TokenizerBuildError> {
        let key = "tokenizer.ggml.pre";
        match h.get(key) {
            None => Err(TokenizerBuildError::NoPreTokenizer),
            Some(v) => match v.as_str().ok_or_else(|| meta(key, "not a string"))? {
                "gpt2" => Ok(Self::Gpt2),
                "smollm" => Ok(Self::SmolLm),
                other => Err(TokenizerBuildError::PreTokenizer(other.to_owned())),
            },
        }
    }

    fn build(self) -> PreTokenizerWrapper {
        let byte_level = PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, true));
        match self {
            Self::Gpt2 => byte_level,
            Self::SmolLm => PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level,
            ])),
        }
    }
}

fn meta(key: &'static str, problem: impl Into<String>) -> TokenizerBuildError {
    TokenizerBuildError::Metadata {
        key,
        problem: problem.into(),
    }
}

fn strings<'a>(h: &'a Header, key: &'static str) -> Result<Vec<&'a str>, TokenizerBuildError> {
    h.get(key)
        .ok_or_else(|| meta(key, "missing"))?
        .as_array()
        .ok_or_else(|| meta(key, "not an array"))?
        .iter()
        .map(|v| v.as_str().ok_or_else(|| meta(key, "holds a non-string")))
        .collect()
}

/// The two tokenizer files of a GGUF model.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    /// `tokenizer.json`.
    pub tokenizer_json: String,
    /// `tokenizer_config.json`.
    pub tokenizer_config: Json,
}

/// Builds `tokenizer.json` and `tokenizer_config.json` from the GGUF's tokenizer metadata.
/// `context` is the model's context length (`model_max_length`).
pub fn build(h: &Header, context: u64) -> Result<TokenizerFiles, TokenizerBuildError> {
    let model = h
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or_else(|| meta("tokenizer.ggml.model", "missing"))?;
    if model != "gpt2" {
        return Err(TokenizerBuildError::Model(model.to_owned()));
    }
    let pre = PreTokenizer::from_header(h)?;
    let tokens = strings(h, "tokenizer.ggml.tokens")?;
    let merges = strings(h, "tokenizer.ggml.merges")?;
    let types: Vec<u64> = match h.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => v
            .as_array()
            .ok_or_else(|| meta("tokenizer.ggml.token_type", "not an array"))?
            .iter()
            .map(|t| t.as_u64().unwrap_or(0))
            .collect(),
    };
    if types.len() != tokens.len() {
        return Err(meta(
            "tokenizer.ggml.token_type",
            format!("{} types for {} tokens", types.len(), tokens.len()),
        ));
    }
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_owned(), i as u32))
        .collect();
    if vocab.len() != tokens.len() {
        return Err(meta("tokenizer.ggml.tokens", "a token appears twice"));
    }
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| meta("tokenizer.ggml.merges", format!("{m:?} is not two tokens")))
        })
        .collect::<Result<_, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| TokenizerBuildError::Build(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_normalizer(Some(NormalizerWrapper::Sequence(NormalizerSequence::new(
        vec![],
    ))))
    .map_err(|e| TokenizerBuildError::Build(e.to_string()))?;
    tok.with_pre_tokenizer(Some(pre.build()));
    let replace = tokenizers::decoders::DecoderWrapper::Replace(
        tokenizers::normalizers::replace::Replace::new("▁", " ")
            .map_err(|e| TokenizerBuildError::Build(e.to_string()))?,
    );
    tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
        replace,
        DecoderWrapper::ByteLevel(ByteLevel::new(false, false, true)),
    ]))));
    let id = |key: &'static str| -> Result<Option<(u64, &str)>, TokenizerBuildError> {
        match h.get(key) {
            None => Ok(None),
            Some(v) => {
                let i = v.as_u64().ok_or_else(|| meta(key, "not a token id"))?;
                let t = tokens
                    .get(i as usize)
                    .ok_or_else(|| meta(key, format!("{i} is outside the vocabulary")))?;
                Ok(Some((i, *t)))
            }
        }
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let pad = id("tokenizer.ggml.padding_token_id")?;
    let unk = id("tokenizer.ggml.unknown_token_id")?;
    let flag = |key| h.get(key).and_then(Value::as_bool).unwrap_or(false);
    let add_bos = flag("tokenizer.ggml.add_bos_token");
    let add_eos = flag("tokenizer.ggml.add_eos_token");
    if add_bos || add_eos {
        let mut single = Vec::new();
        let mut special = serde_json::Map::new();
        let mut piece = |t: (u64, &str)| {
            special.insert(
                t.1.to_owned(),
                json!({"id": t.1, "ids": [t.0], "tokens": [t.1]}),
            );
            json!({"SpecialToken": {"id": t.1, "type_id": 0}})
        };
        if let (true, Some(b)) = (add_bos, bos) {
            single.push(piece(b));
        }
        single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
        if let (true, Some(e)) = (add_eos, eos) {
            single.push(piece(e));
        }
        let mut pair = single.clone();
        pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
        let pp: PostProcessorWrapper = serde_json::from_value(json!({
            "type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": special,
        }))
        .map_err(|e| TokenizerBuildError::Build(e.to_string()))?;
        tok.with_post_processor(Some(pp));
    }
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, t)| **t == CONTROL)
        .map(|(s, _)| AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(specials.clone())
        .map_err(|e| TokenizerBuildError::Build(e.to_string()))?;
    let tokenizer_json = tok
        .to_string(true)
        .map_err(|e| TokenizerBuildError::Build(e.to_string()))?;

    let mut decoder = serde_json::Map::new();
    for s in &specials {
        if let Some(i) = tokens.iter().position(|t| *t == s.content) {
            decoder.insert(
                i.to_string(),
                json!({"content": s.content, "lstrip": false, "normalized": false,
                       "rstrip": false, "single_word": false, "special": true}),
            );
        }
    }
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": false,
        "model_max_length": context,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    for (key, t) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("pad_token", pad),
        ("unk_token", unk),
    ] {
        if let Some((_, s)) = t {
            config[key] = json!(s);
        }
    }
    if let Some(t) = h.get("tokenizer.chat_template").and_then(Value::as_str) {
        config["chat_template"] = json!(t);
    }
    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config: config,
    })
}
