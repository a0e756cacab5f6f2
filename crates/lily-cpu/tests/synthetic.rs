//! Synthetic weights must behave like a trained model's in the ways that matter for benchmarks
//! and server tests: finite through all 40 layers of the real layer pattern, and routing spread
//! over many experts rather than collapsed onto a few.

use lily_core::backend::{Backend, LogitRows};
use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use lily_core::rng::uniform_at;
use lily_core::synthetic::SyntheticSource;
use lily_core::weights::ModelWeights;
use lily_cpu::{CpuBackend, route};
use serde_json::Value;

/// The real config's 40-layer pattern and head structure, with narrower dims.
fn narrow_full_depth() -> ModelConfig {
    let mut root: Value = serde_json::from_str(QWEN36_35B_A3B_CONFIG).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    for (k, v) in [
        ("hidden_size", 128),
        ("vocab_size", 1000),
        ("num_experts", 64),
        ("moe_intermediate_size", 32),
        ("shared_expert_intermediate_size", 32),
        ("head_dim", 32),
        ("linear_key_head_dim", 16),
        ("linear_value_head_dim", 16),
    ] {
        t.insert(k.into(), v.into());
    }
    ModelConfig::from_json(&root.to_string()).unwrap()
}

#[test]
fn forty_layers_stay_finite_and_routing_is_spread() {
    let config = narrow_full_depth();
    assert_eq!(config.num_layers(), 40);
    let weights = ModelWeights::load(&config, Box::new(SyntheticSource::new(7))).unwrap();
    let backend = CpuBackend::new(config.clone(), weights);

    let tokens: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % 1000).collect();
    let mut trace = Vec::new();
    let mut state = backend.new_state(tokens.len()).unwrap();
    let logits = backend
        .forward(&mut state, &tokens, LogitRows::All, Some(&mut trace))
        .unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    for (l, hidden) in trace.iter().enumerate() {
        let rms = (hidden.iter().map(|x| x * x).sum::<f32>() / hidden.len() as f32).sqrt();
        assert!(
            rms.is_finite() && rms > 0.1 && rms < 100.0,
            "layer {l}: hidden rms {rms}"
        );
    }
    // Logits vary across positions: the model is not stuck on one token.
    let vocab = config.vocab_size;
    let argmaxes: std::collections::HashSet<_> = logits
        .chunks(vocab)
        .map(|r| (0..vocab).fold(0, |b, i| if r[i] > r[b] { i } else { b }))
        .collect();
    assert!(
        argmaxes.len() > 10,
        "only {} distinct greedy tokens",
        argmaxes.len()
    );

    // Every layer's router, on unit-RMS inputs: many experts used, no expert dominating a token.
    let h = config.hidden_size;
    for (l, layer) in backend.weights().layers.iter().enumerate() {
        let mut used = vec![false; config.num_experts];
        let mut top_weight = 0.0;
        let samples = 64;
        for s in 0..samples {
            let x: Vec<f32> = (0..h)
                .map(|i| 3f32.sqrt() * uniform_at(s as u64, (l * h + i) as u64))
                .collect();
            let logits = lily_cpu::ops::matmul(&x, 1, &layer.moe.router);
            let r = route(&config, &logits);
            r.experts.iter().for_each(|&e| used[e] = true);
            top_weight += r.weights[0] / samples as f32;
        }
        let used = used.iter().filter(|&&u| u).count();
        assert!(
            used * 4 >= config.num_experts * 3,
            "layer {l}: only {used} experts ever chosen"
        );
        assert!(
            top_weight < 0.6,
            "layer {l}: mean top-1 weight {top_weight}"
        );
    }
}
