//! The special tokens `tokenizer(text)` puts around a text, against the ids transformers gave
//! (`fixtures/special-tokens/cases.json`, written by `make.py` there with the transformers
//! that integrations/vllm pins): `add_bos_token`/`add_eos_token` of `tokenizer_config.json`
//! change nothing, the file's post-processor decides, except for `CodeLlamaTokenizer` (its
//! BOS, nothing after) and `GPTNeoXTokenizer` (nothing). The chat path adds nothing.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use starling_text::{Message, ModelText, TextError};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/special-tokens")
}

fn read(path: &Path) -> Json {
    let text = std::fs::read_to_string(path).expect("read a fixture");
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn ids(v: &Json) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("a list of ids")
}

/// The case's model directory, as make.py wrote it for transformers.
fn model_dir(case: &Json, template: &Json) -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tempdir");
    let base = case["tokenizer"].as_str().expect("tokenizer");
    let mut tok = read(&fixtures().join(base));
    tok["post_processor"] = case["post_processor"].clone();
    let mut tc = case["tokenizer_config"].clone();
    tc["chat_template"] = template.clone();
    let mut files = vec![
        ("tokenizer.json", tok),
        ("tokenizer_config.json", tc),
        ("config.json", case["config"].clone()),
    ];
    if !case["special_tokens_map"].is_null() {
        files.push((
            "special_tokens_map.json",
            case["special_tokens_map"].clone(),
        ));
    }
    for (name, v) in files {
        std::fs::write(d.path().join(name), v.to_string()).expect("write");
    }
    d
}

fn cases() -> (Json, Vec<Json>) {
    let doc = read(&fixtures().join("cases.json"));
    let cases = doc["cases"].as_array().expect("cases").clone();
    assert!(cases.len() >= 18, "{} cases", cases.len());
    (doc, cases)
}

/// Loads the case's directory and compares `encode` of every text and `encode_chat` of the
/// chat with transformers' ids; `Err` names the first difference.
fn check(doc: &Json, case: &Json) -> Result<(), String> {
    let name = case["name"].as_str().expect("name");
    let d = model_dir(case, &doc["chat_template"]);
    let t = ModelText::load(d.path()).map_err(|e| format!("{name}: {e}"))?;
    let texts = doc["texts"].as_array().expect("texts");
    for (text, want) in texts.iter().zip(case["ids"].as_array().expect("ids")) {
        let text = text.as_str().expect("text");
        let got = t.encode(text).expect("encode");
        if got != ids(want) {
            return Err(format!(
                "{name}: tokenizer({text:?}) {got:?}, transformers {want}"
            ));
        }
    }
    let chat: Vec<Message> = serde_json::from_value(doc["chat"].clone()).expect("chat");
    let (_, got) = t.encode_chat(&chat).expect("encode_chat");
    if got != ids(&case["chat_ids"]) {
        return Err(format!(
            "{name}: apply_chat_template {got:?}, transformers {}",
            case["chat_ids"]
        ));
    }
    Ok(())
}

/// The cases whose class transformers reports is (or is not) one of `classes`.
fn checked(classes: &[&str], of_these: bool) -> usize {
    let (doc, cases) = cases();
    let mut n = 0;
    for case in cases.iter().filter(|c| c["refused"].is_null()) {
        let class = case["transformers_class"].as_str().expect("class");
        if classes.contains(&class) == of_these {
            if let Err(e) = check(&doc, case) {
                panic!("{e}");
            }
            n += 1;
        }
    }
    n
}

const REPLACING: [&str; 2] = ["CodeLlamaTokenizer", "GPTNeoXTokenizer"];

#[test]
fn add_bos_and_add_eos_token_change_nothing_the_files_post_processor_decides() {
    // LlamaTokenizer, GPT2Tokenizer, Qwen2Tokenizer, PreTrainedTokenizerFast, none given.
    assert!(checked(&REPLACING, false) >= 10);
}

#[test]
fn code_llama_prepends_its_bos_and_gpt_neox_adds_nothing_whatever_the_file_says() {
    assert!(checked(&REPLACING, true) >= 7);
}

#[test]
fn a_code_llama_bos_the_tokenizer_does_not_have_is_refused() {
    let (doc, cases) = cases();
    let case = cases
        .iter()
        .find(|c| c["refused"].as_bool() == Some(true))
        .expect("the refused case");
    // transformers gives it a new id, one past the vocabulary of tokenizer.json.
    let base = read(&fixtures().join(case["tokenizer"].as_str().expect("tokenizer")));
    let vocab = base["model"]["vocab"].as_object().expect("vocab").len();
    assert_eq!(
        ids(&case["ids"][0]).first().map(|&i| i as usize),
        Some(vocab)
    );
    let d = model_dir(case, &doc["chat_template"]);
    let Err(e) = ModelText::load(d.path()) else {
        panic!("loaded: a BOS tokenizer.json does not have must be refused");
    };
    assert!(
        matches!(&e, TextError::UnknownBos { token, class, .. }
            if token == "<zzz>" && class == "CodeLlamaTokenizer"),
        "{e}"
    );
    assert!(
        e.to_string().contains("tokenizer.json has no such token"),
        "{e}"
    );
}
