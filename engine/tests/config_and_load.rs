//! `config.json` parsing and validation, tensor lists, and load errors.

mod common;

use common::{tiny_config, tiny_model};
use starling_engine::{Bf16Tensor, ConfigError, LoadError, Model, ModelConfig, random_bf16};

fn invalid_field(json: serde_json::Value) -> &'static str {
    match ModelConfig::from_value(json) {
        Err(ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected an invalid field, got {other:?}"),
    }
}

fn base() -> serde_json::Value {
    serde_json::from_str(&tiny_config().to_json()).expect("json")
}

#[test]
fn parses_hf_config_with_extra_fields_and_round_trips() {
    let text = r#"{
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936
    }"#;
    let c = ModelConfig::from_json(text).expect("Qwen3-0.6B's config parses");
    assert_eq!(
        (c.head_dim, c.num_key_value_heads, c.group_size()),
        (128, 8, 2)
    );
    assert!(c.tie_word_embeddings);
    assert_eq!(c.eos_token_id.0, vec![151_645]);
    // Qwen3-0.6B has 0.6 B parameters (tied embeddings).
    assert_eq!(c.parameter_count(), 596_049_920);
    let again = ModelConfig::from_json(&c.to_json()).expect("round trip");
    assert_eq!(again, c);
}

#[test]
fn reads_rope_theta_from_transformers_5_rope_parameters() {
    let mut j = base();
    let obj = j.as_object_mut().expect("object");
    obj.remove("rope_theta");
    obj.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_theta": 1e6, "rope_type": "default"}),
    );
    let c = ModelConfig::from_value(j.clone()).expect("transformers 5 config");
    assert_eq!(c.rope_theta, 1e6);
    j["rope_parameters"]["rope_type"] = "yarn".into();
    assert_eq!(invalid_field(j.clone()), "rope_parameters");
    j.as_object_mut().expect("object").remove("rope_parameters");
    assert_eq!(invalid_field(j), "rope_theta");
}

#[test]
fn a_llama_config_parses_with_its_defaults_and_lists_no_qk_norms() {
    // SmolLM2-135M-Instruct's config as `starling model import` writes it, with an EOS list.
    let c = ModelConfig::from_value(serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "rope_scaling": null, "tie_word_embeddings": true, "attention_bias": false,
        "mlp_bias": false, "bos_token_id": 1, "eos_token_id": [2, 0]
    }))
    .expect("llama config");
    assert_eq!(c.family().ok(), Some(starling_engine::Family::Llama));
    assert_eq!((c.head_dim, c.eos_token_id.0.clone()), (64, vec![2, 0]));
    assert_eq!(
        c.parameter_count(),
        134_515_008,
        "SmolLM2-135M's parameter count"
    );
    assert!(
        !c.tensor_shapes()
            .iter()
            .any(|(n, _)| n.contains("_norm") && n.contains("attn")),
        "no q/k norms in a Llama"
    );
    let again = ModelConfig::from_json(&c.to_json()).expect("round trip");
    assert_eq!(again, c);
}

#[test]
fn validation_names_the_field() {
    let set = |k: &str, v: serde_json::Value| {
        let mut j = base();
        j[k] = v;
        j
    };
    assert_eq!(
        invalid_field(set("num_key_value_heads", 3.into())),
        "num_key_value_heads"
    );
    assert_eq!(invalid_field(set("hidden_size", 0.into())), "hidden_size");
    assert_eq!(invalid_field(set("head_dim", 15.into())), "head_dim");
    // An architecture the engine does not run, or one whose model_type contradicts it, is
    // refused with a sentence naming it and the ones the engine knows.
    for (k, v) in [
        ("model_type", serde_json::json!("qwen2")),
        ("architectures", serde_json::json!(["LlamaForCausalLM"])),
        ("architectures", serde_json::json!(["MistralForCausalLM"])),
    ] {
        match ModelConfig::from_value(set(k, v.clone())) {
            Err(e @ ConfigError::Architecture { .. }) => {
                let m = e.to_string();
                assert!(
                    m.contains("Qwen3ForCausalLM") && m.contains("LlamaForCausalLM"),
                    "{m}"
                );
                if k == "architectures" {
                    assert!(m.contains(v[0].as_str().unwrap_or("")), "{m}");
                }
            }
            other => panic!("{k} = {v}: expected an architecture error, got {other:?}"),
        }
    }
    assert_eq!(
        invalid_field(set("hidden_act", "gelu".into())),
        "hidden_act"
    );
    assert_eq!(
        invalid_field(set("attention_bias", true.into())),
        "attention_bias"
    );
    assert_eq!(
        invalid_field(set("rms_norm_eps", 0.0.into())),
        "rms_norm_eps"
    );
    assert_eq!(
        invalid_field(set("eos_token_id", 300.into())),
        "eos_token_id"
    );
    assert_eq!(
        invalid_field(set("rope_scaling", serde_json::json!({"type": "yarn"}))),
        "rope_scaling"
    );
    assert_eq!(
        invalid_field(set(
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 8.0})
        )),
        "rope_scaling",
        "llama3 without its band is refused"
    );
    assert_eq!(invalid_field(set("mlp_bias", true.into())), "mlp_bias");
    let mut missing = base();
    missing
        .as_object_mut()
        .expect("object")
        .remove("vocab_size");
    let err = ModelConfig::from_value(missing).expect_err("missing field");
    assert!(matches!(err, ConfigError::Parse(_)), "{err}");
    // The parser's complaint is the source, printed once after what failed.
    let chain = format!("{:#}", anyhow::Error::new(err));
    assert!(chain.starts_with("parse config.json: "), "{chain}");
    assert_eq!(chain.matches("vocab_size").count(), 1, "{chain}");
    assert!(ModelConfig::from_json("{").is_err());
}

#[test]
fn tensor_list_follows_the_qwen3_layout() {
    let c = tiny_config();
    let shapes = c.tensor_shapes();
    assert_eq!(shapes.len(), 3 + 11 * 2);
    let get = |n: &str| {
        shapes
            .iter()
            .find(|(name, _)| name == n)
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| panic!("{n} missing"))
    };
    assert_eq!(get("model.layers.1.self_attn.q_proj.weight"), [64, 64]);
    assert_eq!(get("model.layers.1.self_attn.k_proj.weight"), [32, 64]);
    assert_eq!(get("model.layers.1.self_attn.o_proj.weight"), [64, 64]);
    assert_eq!(get("model.layers.0.self_attn.q_norm.weight"), [16]);
    assert_eq!(get("model.layers.0.mlp.down_proj.weight"), [64, 96]);
    assert_eq!(get("lm_head.weight"), [300, 64]);
    assert!(shapes.windows(2).all(|w| w[0].0 < w[1].0), "sorted");
    let tied = ModelConfig {
        tie_word_embeddings: true,
        ..c
    };
    assert!(
        !tied
            .tensor_shapes()
            .iter()
            .any(|(n, _)| n == "lm_head.weight")
    );
}

#[test]
fn load_errors_name_the_tensor_and_shapes() {
    let cfg = tiny_config();
    let (model, w) = tiny_model(1);
    assert_eq!(
        model.parameter_count(),
        w.0.values().map(|t| t.bits.len() as u64).sum::<u64>()
    );

    let mut missing = w.clone();
    missing.0.remove("model.layers.1.self_attn.k_norm.weight");
    match Model::from_tensors(cfg.clone(), &missing) {
        Err(LoadError::Missing { name, expected }) => {
            assert_eq!(name, "model.layers.1.self_attn.k_norm.weight");
            assert_eq!(expected, [16]);
        }
        other => panic!("expected Missing, got {other:?}"),
    }

    let mut wrong = w.clone();
    wrong.0.insert(
        "model.layers.0.mlp.up_proj.weight".into(),
        Bf16Tensor {
            shape: vec![64, 96],
            bits: vec![0; 64 * 96],
        },
    );
    let err = Model::from_tensors(cfg.clone(), &wrong).expect_err("transposed");
    assert!(matches!(
        &err,
        LoadError::Shape { name, expected, found }
            if name == "model.layers.0.mlp.up_proj.weight" && expected == &[96, 64] && found == &[64, 96]
    ));
    assert!(err.to_string().contains("[64, 96]") && err.to_string().contains("[96, 64]"));

    let mut short = w.clone();
    if let Some(t) = short.0.get_mut("model.norm.weight") {
        t.bits.pop();
    }
    assert!(matches!(
        Model::from_tensors(cfg.clone(), &short),
        Err(LoadError::DataLength { name, expected: 64, found: 63, .. }) if name == "model.norm.weight"
    ));

    // A tied config needs no lm_head and ignores one that is there.
    let tied = ModelConfig {
        tie_word_embeddings: true,
        ..cfg.clone()
    };
    let tw = random_bf16(&tied, 1);
    assert!(!tw.0.contains_key("lm_head.weight"));
    Model::from_tensors(tied, &tw).expect("tied loads");
    // An invalid config is refused before any tensor is read.
    let bad = ModelConfig {
        num_key_value_heads: 3,
        ..cfg
    };
    assert!(matches!(
        Model::from_tensors(bad, &w),
        Err(LoadError::Config(ConfigError::Invalid {
            field: "num_key_value_heads",
            ..
        }))
    ));
}
