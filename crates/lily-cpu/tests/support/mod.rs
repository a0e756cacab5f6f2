//! What the fixture-driven tests share: finding and loading a fixture, its cases, and the
//! relative difference every comparison reports.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use lily_core::backend::Backend;
use lily_core::generate::generate;
use lily_core::model_ref::ModelRef;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::weights::ModelWeights;
use lily_cpu::CpuBackend;
use serde_json::Value;

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub fn load(name: &str) -> CpuBackend {
    let (config, source) = ModelRef::Dir(fixture_dir(name))
        .open()
        .expect("fixture opens");
    let weights = ModelWeights::load(&config, source).expect("fixture loads");
    CpuBackend::new(config, weights)
}

/// The fixture's cases.json.
pub fn cases(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture_dir(name).join("cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// max |a − b| / max |b|.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0, "reference is all zeros");
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// `n` greedy tokens after `prompt`, from a fresh state.
pub fn greedy(backend: &CpuBackend, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut state = backend.new_state(prompt.len() + n).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    generate(backend, &mut state, prompt, n, &[], &mut sampler, |_| {
        ControlFlow::Continue(())
    })
    .unwrap()
    .tokens
}
