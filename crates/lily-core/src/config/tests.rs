use super::*;

fn real() -> ModelConfig {
    ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).expect("the shipped config parses")
}

/// Edits the real config's `text_config` and returns the parse error text.
fn error_after(edit: impl FnOnce(&mut Map<String, Value>)) -> String {
    let mut root: Value = serde_json::from_str(QWEN36_35B_A3B_CONFIG).unwrap();
    edit(root["text_config"].as_object_mut().unwrap());
    format!(
        "{:#}",
        ModelConfig::from_json(&root.to_string()).unwrap_err()
    )
}

#[test]
fn real_config_has_the_published_shapes() {
    let c = real();
    assert_eq!(c.hidden_size, 2048);
    assert_eq!(c.num_layers(), 40);
    assert_eq!(c.num_attention_layers(), 10);
    for (i, kind) in c.layer_kinds.iter().enumerate() {
        let expected = if i % 4 == 3 {
            LayerKind::Attention
        } else {
            LayerKind::GatedDeltaNet
        };
        assert_eq!(*kind, expected, "layer {i}");
    }
    assert_eq!(
        (c.num_attention_heads, c.num_kv_heads, c.head_dim),
        (16, 2, 256)
    );
    assert_eq!(c.rotary_dim, 64);
    assert_eq!(c.rope_theta, 1e7);
    assert_eq!(c.gdn_conv_dim(), 8192);
    assert_eq!((c.num_experts, c.experts_per_token), (256, 8));
    assert!(c.norm_topk_prob);
    assert_eq!(c.vocab_size, 248_320);
}

#[test]
fn text_only_config_parses_like_the_wrapper() {
    let root: Value = serde_json::from_str(QWEN36_35B_A3B_CONFIG).unwrap();
    let text = root["text_config"].to_string();
    let mut expected = real();
    // The wrapper has no top-level eos; both read text_config's.
    expected.eos_token_ids = vec![248_044];
    assert_eq!(ModelConfig::from_json(&text).unwrap(), expected);
}

#[test]
fn mlx_style_rope_fields_are_accepted() {
    let mut root: Value = serde_json::from_str(QWEN36_35B_A3B_CONFIG).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    t.remove("rope_parameters");
    t.insert("rope_theta".into(), 1e6.into());
    t.insert(
        "rope_scaling".into(),
        serde_json::json!({"type": "default"}),
    );
    let c = ModelConfig::from_json(&root.to_string()).unwrap();
    assert_eq!((c.rope_theta, c.rotary_dim), (1e6, 64));
}

#[test]
fn layer_types_fall_back_to_the_interval() {
    let mut root: Value = serde_json::from_str(QWEN36_35B_A3B_CONFIG).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    t.remove("layer_types");
    t.insert("full_attention_interval".into(), 2.into());
    let c = ModelConfig::from_json(&root.to_string()).unwrap();
    assert_eq!(c.num_attention_layers(), 20);
    assert_eq!(c.layer_kinds[1], LayerKind::Attention);
}

#[test]
fn errors_name_the_field() {
    type Edit = Box<dyn FnOnce(&mut Map<String, Value>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|t| {
                t.insert("num_key_value_heads".into(), 3.into());
            }),
            "num_key_value_heads",
        ),
        (
            Box::new(|t| {
                t.insert("linear_num_key_heads".into(), 5.into());
            }),
            "linear_num_key_heads",
        ),
        (
            Box::new(|t| {
                t.insert("num_hidden_layers".into(), 41.into());
            }),
            "layer_types",
        ),
        (
            Box::new(|t| {
                t["layer_types"][2] = "sliding_attention".into();
            }),
            "layer_types[2]",
        ),
        (
            Box::new(|t| {
                t.remove("hidden_size");
            }),
            "text_config.hidden_size",
        ),
        (
            Box::new(|t| {
                t.insert("num_experts_per_tok".into(), 300.into());
            }),
            "num_experts_per_tok",
        ),
        (
            Box::new(|t| {
                t.insert("num_experts".into(), (-1).into());
            }),
            "num_experts",
        ),
        (
            Box::new(|t| {
                t.insert("head_dim".into(), "big".into());
            }),
            "head_dim",
        ),
        (
            Box::new(|t| {
                t["rope_parameters"]["rope_type"] = "yarn".into();
            }),
            "rope_type",
        ),
        (
            Box::new(|t| {
                t["rope_parameters"]["partial_rotary_factor"] = 0.3.into();
            }),
            "partial_rotary_factor",
        ),
        (
            Box::new(|t| {
                t.insert("model_type".into(), "llama".into());
            }),
            "model_type",
        ),
    ];
    for (edit, field) in cases {
        let err = error_after(edit);
        assert!(err.contains(field), "error {err:?} does not name {field}");
    }
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for text in ["", "[]", "{", "null", "{\"text_config\": 3}"] {
        assert!(ModelConfig::from_json(text).is_err(), "{text:?}");
    }
}
