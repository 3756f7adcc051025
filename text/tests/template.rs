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

/// A tiny byte-level BPE tokenizer.json with <|im_start|>/<|im_end|> as special tokens in
/// a new directory.
fn tokenizer_dir() -> tempfile::TempDir {
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
    d
}

#[test]
fn a_model_directory_renders_tokenizes_and_refuses_unknown_roles() {
    let d = tokenizer_dir();
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

/// transformers' own test template for `return_assistant_tokens_mask`
/// (`test_chat_template_return_assistant_tokens_mask`), written as a model ships it.
const WITH_GENERATION: &str = "{% for message in messages %}\
{% if (message['role'] != 'assistant') %}\
{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}\
{% elif (message['role'] == 'assistant')%}\
{{'<|im_start|>' + message['role'] + '\\n'}}\
{% generation %}\
{{message['content'] + '<|im_end|>'}}\
{% endgeneration %}\
{{'\\n'}}\
{% endif %}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

#[test]
fn generation_blocks_render_as_if_the_tags_were_absent() {
    let chat = [
        msg("system", "Be brief."),
        msg("user", "Hi!"),
        msg("assistant", "Hello."),
        msg("user", "2+2?"),
        msg("assistant", "4"),
    ];
    let with = ChatTemplate::new(WITH_GENERATION, vec![]).expect("compiles");
    let without = WITH_GENERATION
        .replace("{% generation %}", "")
        .replace("{% endgeneration %}", "");
    let without = ChatTemplate::new(&without, vec![]).expect("compiles");
    for prompt in [false, true] {
        assert_eq!(
            with.render(&chat, prompt).expect("renders"),
            without.render(&chat, prompt).expect("renders")
        );
    }
    assert_eq!(
        with.render(&chat[..3], false).expect("renders"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n"
    );
    assert_eq!(
        with.source(),
        WITH_GENERATION,
        "the source is kept as given"
    );
}

#[test]
fn generation_tags_keep_jinja2_whitespace_control_and_leave_strings_and_raw_alone() {
    let m = [msg("assistant", "x")];
    let render = |src: &str| {
        ChatTemplate::new(src, vec![])
            .expect("compiles")
            .render(&m, false)
            .expect("renders")
    };
    // Jinja2: `-` strips the whitespace beside the tag; trim_blocks drops the newline after a
    // block tag; lstrip_blocks the indentation before one.
    assert_eq!(
        render("A  {%- generation -%}  B{{ messages[0].content }}  {%- endgeneration %}\nC"),
        "ABxC"
    );
    assert_eq!(
        render("A\n    {% generation %}\nB\n    {% endgeneration %}\nC"),
        "A\nB\nC"
    );
    assert_eq!(render("{%+ generation +%}B{%endgeneration%}"), "B");
    // A scope of its own, as Jinja2's call block has: a `set` inside does not leak.
    assert_eq!(
        render("{% set v = 1 %}{% generation %}{% set v = 2 %}{{ v }}{% endgeneration %}{{ v }}"),
        "21"
    );
    // In a string literal, a comment or a raw block the tag is text.
    assert_eq!(
        render("{{ '{% generation %}' ~ \"{%- endgeneration %}\" }}{# {% generation %} #}"),
        "{% generation %}{%- endgeneration %}"
    );
    assert_eq!(
        render(
            "{% raw %}{% generation %}'{% endgeneration %}{% endraw %}{% generation %}!{% endgeneration %}"
        ),
        "{% generation %}'{% endgeneration %}!"
    );
}

#[test]
fn a_template_that_does_not_compile_is_refused_naming_its_file_and_why() {
    let d = tokenizer_dir();
    let tc = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": WITH_GENERATION});
    std::fs::write(d.path().join("tokenizer_config.json"), tc.to_string()).expect("write");
    let t = ModelText::load(d.path()).expect("a template with generation blocks loads");
    assert!(t.has_chat_template());

    let tc = serde_json::json!({"eos_token": "<|im_end|>",
                                "chat_template": "{% for m in messages %}{% frobnicate %}{% endfor %}"});
    std::fs::write(d.path().join("tokenizer_config.json"), tc.to_string()).expect("write");
    let e = ModelText::load(d.path()).expect_err("unknown tag");
    assert!(
        matches!(&e, TextError::TemplateCompile { path, reason }
            if path.ends_with("tokenizer_config.json") && reason.contains("unknown statement frobnicate")),
        "{e}"
    );
    let said = e.to_string();
    assert!(
        said.starts_with("the chat template in ") && said.contains("does not compile"),
        "{said}"
    );

    std::fs::write(d.path().join("tokenizer_config.json"), "{}").expect("write");
    std::fs::write(d.path().join("chat_template.jinja"), "{% if %}").expect("write");
    let e = ModelText::load(d.path()).expect_err("syntax error");
    assert!(
        matches!(&e, TextError::TemplateCompile { path, .. } if path.ends_with("chat_template.jinja")),
        "{e}"
    );
}
