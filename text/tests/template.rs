//! Chat templates rendered as transformers' Jinja2 renders them (expected strings written
//! from Jinja2's semantics: `trim_blocks` drops the newline after a block tag but not after
//! an expression, `lstrip_blocks` the whitespace before a block tag), and refusals that name
//! the problem.

use starling_text::{ChatTemplate, Message, ModelText, TemplateError, TextError};

fn msg(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
    }
}

const CHATML: &str = "{% for message in messages %}\n    {% if loop.first and messages[0]['role'] != 'system' %}\n{{ '<|im_start|>system\\nDefault<|im_end|>\\n' }}\n    {% endif %}\n{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}\n{% endfor %}\n{% if add_generation_prompt %}\n{{ '<|im_start|>assistant\\n' }}\n{% endif %}\n";

#[test]
fn whitespace_control_and_loop_variables_match_jinja2() {
    let t = ChatTemplate::new(CHATML, vec![]).expect("compiles");
    let out = t
        .render(&[msg("user", "  hi  "), msg("assistant", "yo")], true)
        .expect("renders");
    assert_eq!(
        out,
        "<|im_start|>system\nDefault<|im_end|>\n\n<|im_start|>user\nhi<|im_end|>\n\n\
         <|im_start|>assistant\nyo<|im_end|>\n\n<|im_start|>assistant\n\n"
    );
    let with_system = t
        .render(&[msg("system", "S"), msg("user", "")], false)
        .expect("renders");
    assert_eq!(
        with_system,
        "<|im_start|>system\nS<|im_end|>\n\n<|im_start|>user\n<|im_end|>\n\n"
    );
}

#[test]
fn python_methods_specials_tojson_and_raise_exception() {
    let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
               {{ raise_exception('Conversation roles must be user/assistant, got ' + m.role) }}\
               {% endif %}{{ m.content.upper().strip() }}|{{ m | tojson }}{% endfor %}";
    let t = ChatTemplate::new(src, vec![("bos_token".into(), "<s>".into())]).expect("compiles");
    assert_eq!(
        t.render(&[msg("user", " a\"b ")], false).expect("renders"),
        "<s>A\"B|{\"content\": \" a\\\"b \", \"role\": \"user\"}"
    );
    let err = t.render(&[msg("system", "x")], false).expect_err("raises");
    assert_eq!(
        err,
        TemplateError::Render("Conversation roles must be user/assistant, got system".into())
    );
    assert!(matches!(
        ChatTemplate::new("{% for %}", vec![]),
        Err(TemplateError::Compile(_))
    ));
}

#[test]
fn a_model_directory_renders_tokenizes_and_refuses_unknown_roles() {
    // A tiny byte-level BPE tokenizer.json with <|im_start|>/<|im_end|> as special tokens.
    let d = tempfile::tempdir().expect("tempdir");
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<|im_start|>", "<|im_end|>"].iter().enumerate() {
        vocab.insert((*t).to_owned(), i.into());
    }
    // The 256 byte-level symbols GPT-2 uses for bytes (printable ASCII map to themselves).
    for (next, b) in (2u64..).zip(0u32..256) {
        let c = match b {
            33..=126 | 161..=172 | 174..=255 => char::from_u32(b),
            _ => None,
        };
        let c = c.unwrap_or_else(|| {
            let k = [0..33u32, 127..161, 173..174]
                .into_iter()
                .flatten()
                .position(|x| x == b)
                .unwrap_or(0) as u32;
            char::from_u32(256 + k).unwrap_or('?')
        });
        vocab.insert(c.to_string(), next.into());
    }
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(d.path().join("tokenizer.json"), tok.to_string()).expect("write");
    let tc = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": CHATML});
    std::fs::write(d.path().join("tokenizer_config.json"), tc.to_string()).expect("write");
    std::fs::write(
        d.path().join("generation_config.json"),
        r#"{"eos_token_id": [1, 7]}"#,
    )
    .expect("write");
    std::fs::write(d.path().join("config.json"), r#"{"eos_token_id": 1}"#).expect("write");
    let t = ModelText::load(d.path()).expect("loads");
    assert!(!t.is_byte() && t.has_chat_template());
    assert_eq!(
        t.eos_ids(),
        &[1, 7],
        "generation_config ∪ config, deduplicated"
    );
    let (text, ids) = t.encode_chat(&[msg("user", "hi")]).expect("encodes");
    assert!(text.ends_with("<|im_start|>assistant\n\n"), "{text:?}");
    assert_eq!(ids[0], 0, "the special token is one id, not its characters");
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 2, "two <|im_end|>");
    // Decoding skips special tokens and stops at the first stop id.
    assert_eq!(
        t.decode(&ids, &[]),
        text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    );
    let hi = t.encode("hi").expect("encodes");
    let mut completion = hi.clone();
    completion.extend([1, 2 + u32::from(b'x')]);
    assert_eq!(t.decode(&completion, &[1]), "hi");
    assert_eq!(
        t.encode_chat(&[msg("robot", "beep")])
            .expect_err("unknown role"),
        TextError::UnknownRole {
            index: 0,
            role: "robot".into(),
            known: "system, user, assistant".into()
        }
    );
}
