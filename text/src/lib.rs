//! `starling-text`: the text side of a model directory, shared by the hub, the tools and the
//! tests.
//!
//! [`ModelText::load`] reads what a Hugging Face model directory says about text:
//!
//! - `tokenizer.json` through the `tokenizers` crate (its pure-Rust regex backend,
//!   `fancy-regex`: no C toolchain needed), encoding as `tokenizer(text)` does (the special
//!   tokens around a text as [below](#special-tokens-around-a-text)) and decoding with special
//!   tokens skipped;
//! - the chat template (`chat_template` of `tokenizer_config.json`, else
//!   `chat_template.jinja`), rendered as transformers renders it ([`template`]) and tokenized
//!   without adding special tokens again: the ids equal transformers'
//!   `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`;
//! - the end-of-sequence ids: `eos_token_id` (a number or a list) of
//!   `generation_config.json` ∪ `config.json`.
//!
//! A directory without `tokenizer.json` (the generated checkpoints of the demo, tests and
//! benchmarks) gets the byte tokenizer (`starling_engine::ByteTokenizer`: eos 2, no chat
//! template). Every refusal is a [`TextError`] whose sentence names what is wrong.
//!
//! # Special tokens around a text
//!
//! [`ModelText::encode`] adds what transformers' `tokenizer(text)` adds, as measured on the
//! transformers that `integrations/vllm` pins (5.19.0; 5.16.1 and 5.24.0 measured the same;
//! `tests/fixtures/special-tokens/` holds the cases and the ids transformers gave):
//!
//! - `add_bos_token` and `add_eos_token` of `tokenizer_config.json` are **not read**:
//!   transformers 5 (`_from_pretrained`) drops both whenever `tokenizer.json` exists, for
//!   every tokenizer class, and the file's post-processor decides (none: nothing is added).
//!   A Llama-2 directory whose file prepends `<s>` keeps it under `add_bos_token: false`;
//!   `add_eos_token: true` appends nothing. (transformers 4.57 differed: its
//!   `LlamaTokenizerFast`, `CodeLlamaTokenizerFast` and `GPTNeoXTokenizerFast` rebuilt the
//!   post-processor from these flags, the two Llama ones defaulting to BOS on; its
//!   `PreTrainedTokenizerFast`, `GPT2TokenizerFast` and `Qwen2TokenizerFast` ignored them.)
//! - Two classes replace the file's post-processor whatever it says, and are followed here by
//!   `tokenizer_class` (with or without `Fast`): `CodeLlamaTokenizer` prepends its BOS and
//!   appends nothing (the BOS is `bos_token` of `special_tokens_map.json`, else of
//!   `tokenizer_config.json`, else `<s>`; `bos_token: null` adds nothing); `GPTNeoXTokenizer`
//!   adds nothing. A BOS that `tokenizer.json` does not have is refused
//!   ([`TextError::UnknownBos`]); transformers would add it as a new id the model has no
//!   embedding for.
//!
//! Not followed: a class chosen from `config.json`'s `model_type` when `tokenizer_class` is
//! absent (the `llama` and `qwen3` directories the engine runs choose neither class this
//! way), and the classes' rebuilding of the rest of the pipeline (transformers 5 rebuilds
//! the normalizer, pre-tokenizer and decoder of `LlamaTokenizer`, `GPT2Tokenizer`, … from the
//! class and keeps only the vocabulary and merges of the file; for the files those classes
//! saved, that is the same pipeline). The chat path ([`ModelText::encode_chat`]) adds no
//! special tokens, as `apply_chat_template` does not.

pub mod pyjson;
pub mod template;

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use starling_engine::ByteTokenizer;
use tokenizers::Tokenizer;
use tokenizers::processors::template::TemplateProcessing;

pub use template::{ChatTemplate, Message, TemplateError};

/// Why a model's text side cannot be loaded or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error("{path} does not load as a tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("{path} is not valid JSON: {reason}")]
    Json { path: PathBuf, reason: String },
    #[error("{0}")]
    Template(#[from] TemplateError),
    #[error("the chat template in {path} does not compile: {reason}")]
    TemplateCompile { path: PathBuf, reason: String },
    #[error("this model has no chat template: give the prompt as text or token ids")]
    NoTemplate,
    #[error("message {index} has role {role:?}; this model's template takes {known}")]
    UnknownRole {
        index: usize,
        role: String,
        known: String,
    },
    #[error("the tokenizer failed on the text: {0}")]
    Encode(String),
    #[error(
        "{path}: tokenizer_class {class} puts the BOS token {token:?} before every text, but \
         tokenizer.json has no such token"
    )]
    UnknownBos {
        path: PathBuf,
        class: String,
        token: String,
    },
}

#[derive(Debug)]
enum Kind {
    Hf(Box<Tokenizer>),
    Byte,
}

/// A model's tokenizer, chat template and end-of-sequence ids.
#[derive(Debug)]
pub struct ModelText {
    kind: Kind,
    template: Option<ChatTemplate>,
    eos: Vec<u32>,
    roles: Vec<&'static str>,
}

fn read_json(path: &Path) -> Result<Option<Json>, TextError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(TextError::Json {
                path: path.to_owned(),
                reason: e.to_string(),
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TextError::Json {
            path: path.to_owned(),
            reason: e.to_string(),
        })
}

/// `eos_token_id` as a number or a list of numbers.
fn ids_of(v: Option<&Json>) -> Vec<u32> {
    match v {
        Some(Json::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Some(Json::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

/// A special token as `tokenizer_config.json` writes it: a string or `{"content": …}`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// What `tokenizer(text)` puts around a text, by `tokenizer_class` (see the crate doc).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Around {
    /// The post-processor of `tokenizer.json`: every class but the two below.
    File,
    /// `CodeLlamaTokenizer`: this BOS before the text, nothing after.
    Bos(String),
    /// `GPTNeoXTokenizer`, and `CodeLlamaTokenizer` with `bos_token: null`: nothing.
    Nothing,
}

impl Around {
    /// `stm` is `special_tokens_map.json` (read only for `CodeLlamaTokenizer`).
    fn of(
        class: &str,
        tc: &Json,
        stm: impl FnOnce() -> Result<Json, TextError>,
    ) -> Result<Self, TextError> {
        Ok(match class.strip_suffix("Fast").unwrap_or(class) {
            "CodeLlamaTokenizer" => {
                let stm = stm()?;
                match stm.get("bos_token").or_else(|| tc.get("bos_token")) {
                    None => Self::Bos("<s>".to_owned()),
                    Some(v) => token_text(v).map_or(Self::Nothing, Self::Bos),
                }
            }
            "GPTNeoXTokenizer" => Self::Nothing,
            _ => Self::File,
        })
    }

    /// The post-processor transformers' `update_post_processor` builds, where this replaces
    /// the file's.
    fn post_processor(
        &self,
        tokenizer: &Tokenizer,
        path: &Path,
        class: &str,
    ) -> Result<Option<TemplateProcessing>, TextError> {
        let (single, pair, specials) = match self {
            Self::File => return Ok(None),
            Self::Nothing => ("$A:0".to_owned(), "$A:0 $B:1".to_owned(), Vec::new()),
            Self::Bos(bos) => {
                let id = tokenizer
                    .token_to_id(bos)
                    .ok_or_else(|| TextError::UnknownBos {
                        path: path.to_owned(),
                        class: class.to_owned(),
                        token: bos.clone(),
                    })?;
                (
                    format!("{bos}:0 $A:0"),
                    format!("{bos}:0 $A:0 {bos}:1 $B:1"),
                    vec![(bos.clone(), id)],
                )
            }
        };
        let invalid = |reason: String| TextError::Tokenizer {
            path: path.to_owned(),
            reason: format!("the {class} post-processor ({single:?}) does not build: {reason}"),
        };
        TemplateProcessing::builder()
            .try_single(single.as_str())
            .and_then(|b| b.try_pair(pair.as_str()))
            .map_err(invalid)?
            .special_tokens(specials)
            .build()
            .map(Some)
            .map_err(|e| invalid(e.to_string()))
    }
}

impl ModelText {
    /// The byte tokenizer: no template, eos 2.
    pub fn byte() -> Self {
        Self {
            kind: Kind::Byte,
            template: None,
            eos: vec![ByteTokenizer::EOS],
            roles: Vec::new(),
        }
    }

    /// Loads the text side of the model directory `dir` (see the crate doc).
    pub fn load(dir: &Path) -> Result<Self, TextError> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Ok(Self::byte());
        }
        let mut tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| TextError::Tokenizer {
            path: tok_path.clone(),
            reason: e.to_string(),
        })?;
        let tc_path = dir.join("tokenizer_config.json");
        let tc = read_json(&tc_path)?.unwrap_or(Json::Null);
        let class = tc
            .get("tokenizer_class")
            .and_then(Json::as_str)
            .unwrap_or_default();
        let around = Around::of(class, &tc, || {
            Ok(read_json(&dir.join("special_tokens_map.json"))?.unwrap_or(Json::Null))
        })?;
        if let Some(pp) = around.post_processor(&tokenizer, &tc_path, class)? {
            tokenizer.with_post_processor(Some(pp));
        }
        let source = match tc.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            // The list form (named templates): the "default" one.
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_owned),
            _ => None,
        };
        let source = match source {
            Some(s) => Some((s, tc_path)),
            None => {
                let p = dir.join("chat_template.jinja");
                match std::fs::read_to_string(&p) {
                    Ok(s) => Some((s, p)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => {
                        return Err(TextError::Json {
                            path: p,
                            reason: e.to_string(),
                        });
                    }
                }
            }
        };
        let specials: Vec<(String, String)> = [
            "bos_token",
            "eos_token",
            "pad_token",
            "unk_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ]
        .iter()
        .filter_map(|k| Some(((*k).to_owned(), token_text(tc.get(*k)?)?)))
        .collect();
        let template = source
            .map(|(s, path)| {
                ChatTemplate::new(&s, specials.clone()).map_err(|e| match e {
                    TemplateError::Compile(reason) => TextError::TemplateCompile { path, reason },
                    other => TextError::Template(other),
                })
            })
            .transpose()?;
        let mut eos = Vec::new();
        for file in ["generation_config.json", "config.json"] {
            let v = read_json(&dir.join(file))?;
            for id in ids_of(v.as_ref().and_then(|v| v.get("eos_token_id"))) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        if eos.is_empty()
            && let Some(id) = specials
                .iter()
                .find(|(k, _)| k == "eos_token")
                .and_then(|(_, t)| tokenizer.token_to_id(t))
        {
            eos.push(id);
        }
        let mut roles = vec!["system", "user", "assistant"];
        if template
            .as_ref()
            .is_some_and(|t| t.source().contains("tool"))
        {
            roles.push("tool");
        }
        Ok(Self {
            kind: Kind::Hf(Box::new(tokenizer)),
            template,
            eos,
            roles,
        })
    }

    /// Whether this is the byte tokenizer (a model directory without `tokenizer.json`).
    pub fn is_byte(&self) -> bool {
        matches!(self.kind, Kind::Byte)
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The end-of-sequence ids (`[2]` for the byte tokenizer).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// `text` as `tokenizer(text)` encodes it (special tokens added as the crate doc says;
    /// none for the byte tokenizer).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.encode_with(text, true)
    }

    fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TextError> {
        match &self.kind {
            Kind::Byte => Ok(ByteTokenizer.encode(text)),
            Kind::Hf(t) => t
                .encode_fast(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TextError::Encode(e.to_string())),
        }
    }

    /// The chat rendered with the template and `add_generation_prompt=True`.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String, TextError> {
        let template = self.template.as_ref().ok_or(TextError::NoTemplate)?;
        if let Some((index, m)) = messages
            .iter()
            .enumerate()
            .find(|(_, m)| !self.roles.contains(&m.role.as_str()))
        {
            return Err(TextError::UnknownRole {
                index,
                role: m.role.clone(),
                known: self.roles.join(", "),
            });
        }
        Ok(template.render(messages, true)?)
    }

    /// The rendered chat and its ids: `apply_chat_template(messages,
    /// add_generation_prompt=True)` (the rendered text tokenized without adding special
    /// tokens).
    pub fn encode_chat(&self, messages: &[Message]) -> Result<(String, Vec<u32>), TextError> {
        let text = self.render_chat(messages)?;
        let ids = self.encode_with(&text, false)?;
        Ok((text, ids))
    }

    /// The text of a completion: up to (without) the first of `stop`, special tokens
    /// skipped. Ids the tokenizer does not know are skipped too.
    pub fn decode(&self, ids: &[u32], stop: &[u32]) -> String {
        let end = ids
            .iter()
            .position(|t| stop.contains(t))
            .unwrap_or(ids.len());
        let ids = &ids[..end];
        match &self.kind {
            Kind::Byte => ByteTokenizer.decode(ids),
            Kind::Hf(t) => {
                let known: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|&i| t.id_to_token(i).is_some())
                    .collect();
                t.decode(&known, true).unwrap_or_default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_without_tokenizer_json_gets_the_byte_tokenizer() {
        let d = tempfile::tempdir().expect("tempdir");
        let t = ModelText::load(d.path()).expect("load");
        assert!(t.is_byte());
        assert_eq!(t.eos_ids(), &[2]);
        assert_eq!(t.encode("ab").expect("encode"), vec![100, 101]);
        assert_eq!(t.decode(&[100, 101, 2, 102], &[2]), "ab");
        let m = [Message {
            role: "user".into(),
            content: "hi".into(),
        }];
        assert_eq!(t.encode_chat(&m), Err(TextError::NoTemplate));
    }

    #[test]
    fn a_broken_tokenizer_json_is_refused_naming_the_file() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("tokenizer.json"), "{\"model\": 1}").expect("write");
        let e = ModelText::load(d.path()).expect_err("broken");
        assert!(
            matches!(&e, TextError::Tokenizer { path, .. } if path.ends_with("tokenizer.json")),
            "{e}"
        );
    }
}
