//! The CUDA backend against the CPU reference. These need a CUDA GPU: they are ignored by a plain
//! `cargo test` (which says so) and run on the H200 with `--include-ignored`
//! (tools/gpu-check.sh). Every comparison prints its measured error, so a run is a record.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use lily_core::backend::{Backend, LogitRows};
use lily_core::config::ModelConfig;
use lily_core::generate::generate;
use lily_core::model_ref::ModelRef;
use lily_core::quant::QuantMatrix;
use lily_core::rng::uniform_at;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synthetic::SyntheticSource;
use lily_core::weights::{Linear, Matrix, ModelWeights};
use lily_cpu::CpuBackend;
use lily_cuda::CudaBackend;
use lily_cuda::gpu::{Gpu, KArg, Shape, ptr};
use lily_cuda::mat::{DeviceMat, MatArg};

const NEEDS_GPU: &str = "needs a CUDA GPU";

/// The fixtures folder: `LILY_FIXTURES` where the binary runs away from its source tree (the GPU
/// machine), else the repository's.
fn fixture(name: &str) -> PathBuf {
    std::env::var_os("LILY_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
        .join(name)
}

/// max |a − b| / max |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0, "reference is all zeros");
    a.iter().zip(b).fold(0f32, |m, (x, y)| {
        if x.is_nan() {
            f32::INFINITY
        } else {
            m.max((x - y).abs())
        }
    }) / scale
}

fn both(config: &ModelConfig, weights: ModelWeights) -> (CudaBackend, CpuBackend) {
    let gpu = CudaBackend::new(config.clone(), &weights).expect("CUDA backend");
    (gpu, CpuBackend::new(config.clone(), weights))
}

fn greedy<B: Backend>(b: &B, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut state = b.new_state(prompt.len() + n).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    generate(b, &mut state, prompt, n, &[], &mut sampler, |_| {
        ControlFlow::Continue(())
    })
    .unwrap()
    .tokens
}

/// KV entries are stored in bf16 (8 significant bits), which moves attention outputs by a few
/// parts in a thousand; everything else is f32. Logits within 1e-2 of their maximum, and equal
/// greedy tokens on fixtures whose top-2 margins are far wider, are what that allows.
const LOGIT_TOL: f32 = 1e-2;

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_matches_the_cpu_on_the_fixtures() {
    for name in ["tiny-a", "tiny-b", "tiny-a-official", "tiny-mlx-q4"] {
        let dir = fixture(name);
        assert!(dir.exists(), "fixture {name} is missing");
        let (config, source) = ModelRef::Dir(dir).open().unwrap();
        let weights = ModelWeights::load(&config, source).unwrap();
        let (gpu, cpu) = both(&config, weights);
        let tokens: Vec<u32> = (0..100u32)
            .map(|i| (i * 7919 + 11) % config.vocab_size as u32)
            .collect();
        let mut gs = gpu.new_state(tokens.len()).unwrap();
        let ours = gpu.prefill(&mut gs, &tokens, LogitRows::All).unwrap();
        let mut cs = cpu.new_state(tokens.len()).unwrap();
        let reference = cpu.prefill(&mut cs, &tokens, LogitRows::All).unwrap();
        let d = rel_diff(&ours, &reference);
        eprintln!("{name}: 100 positions, logits max rel diff {d:e}");
        assert!(d <= LOGIT_TOL, "{name}: {d:e}");
        let prompt = &tokens[..8];
        assert_eq!(
            greedy(&gpu, prompt, 24),
            greedy(&cpu, prompt, 24),
            "{name}: greedy tokens"
        );
    }
}

/// The real model's head structure (GQA group 8, head dim 256, 64 rotary dims, GDN 16/32 heads of
/// 128, 256 experts top 8) at a small width, so every kernel runs at its production constants,
/// over contexts that cross the attention splits.
fn real_heads_narrow() -> ModelConfig {
    let mut root: serde_json::Value =
        serde_json::from_str(lily_core::config::QWEN36_35B_A3B_CONFIG).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    t.insert("hidden_size".into(), 256.into());
    t.insert("num_hidden_layers".into(), 4.into());
    t.insert(
        "layer_types".into(),
        serde_json::json!([
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention"
        ]),
    );
    t.insert("vocab_size".into(), 4096.into());
    t.insert("moe_intermediate_size".into(), 64.into());
    t.insert("shared_expert_intermediate_size".into(), 128.into());
    ModelConfig::from_json(&root.to_string()).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn production_shaped_kernels_match_the_cpu_across_split_boundaries() {
    let config = real_heads_narrow();
    let weights = ModelWeights::load(&config, Box::new(SyntheticSource::new(3))).unwrap();
    let (gpu, cpu) = both(&config, weights);
    for len in [1usize, 2, 63, 64, 65, 129, 700] {
        let tokens: Vec<u32> = (0..len as u32).map(|i| (i * 131 + 7) % 4096).collect();
        let mut gs = gpu.new_state(len).unwrap();
        let mut cs = cpu.new_state(len).unwrap();
        let g = gpu.prefill(&mut gs, &tokens, LogitRows::Last).unwrap();
        let c = cpu.prefill(&mut cs, &tokens, LogitRows::Last).unwrap();
        let d = rel_diff(&g, &c);
        eprintln!("production shapes, context {len}: last logits max rel diff {d:e}");
        assert!(d <= LOGIT_TOL, "context {len}: {d:e}");
    }
    // Forked sequences continue identically.
    let prompt: Vec<u32> = (0..20).collect();
    let mut a = gpu.new_state(64).unwrap();
    gpu.prefill(&mut a, &prompt, LogitRows::Last).unwrap();
    let mut b = gpu.fork(&a).unwrap();
    assert_eq!(
        gpu.decode(&mut a, 5).unwrap(),
        gpu.decode(&mut b, 5).unwrap()
    );
}

fn random_linear(rows: usize, cols: usize, bits: u32, seed: u64) -> Linear {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| uniform_at(seed, i as u64))
        .collect();
    match bits {
        32 => Linear::Dense(Matrix {
            rows,
            cols,
            data: values,
        }),
        b => Linear::Affine(QuantMatrix::quantize(rows, cols, b, 64, &values).unwrap()),
    }
}

fn dense_of(l: &Linear) -> Vec<f32> {
    match l {
        Linear::Dense(m) => m.data.clone(),
        Linear::Affine(q) => q.dequantize(),
    }
}

/// The GEMV at every format, ragged row counts, and several matrices in one launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_matches_dequantise_then_multiply() {
    let config = real_heads_narrow();
    let gpu = Gpu::new(&config).expect(NEEDS_GPU);
    for bits in [4u32, 8, 32] {
        for cols in [64usize, 192, 2048] {
            let shapes = [1usize, 7, 33, 259];
            let mats: Vec<Linear> = shapes
                .iter()
                .enumerate()
                .map(|(i, &r)| random_linear(r, cols, bits, i as u64 + cols as u64))
                .collect();
            let x: Vec<f32> = (0..cols).map(|i| uniform_at(99, i as u64)).collect();
            let dev: Vec<DeviceMat> = mats
                .iter()
                .map(|m| DeviceMat::upload(&gpu, m).unwrap())
                .collect();
            let dx = gpu.upload(&x).unwrap();
            let total: usize = shapes.iter().sum();
            let dy = gpu.zeros::<f32>(total).unwrap();
            let args: Vec<MatArg> = dev.iter().map(|m| m.arg(&gpu)).collect();
            let shape = Shape {
                grid: (total.div_ceil(8) as u32, 1, 1),
                block: 256,
            };
            gpu.launch(
                &format!("gemv_b{bits}"),
                shape,
                &[
                    KArg::Mat(args[0]),
                    KArg::Mat(args[1]),
                    KArg::Mat(args[2]),
                    KArg::Mat(args[3]),
                    KArg::Ptr(ptr(&dx, &gpu.stream)),
                    KArg::Ptr(ptr(&dy, &gpu.stream)),
                ],
            )
            .unwrap();
            let y = gpu.download(&dy).unwrap();
            let mut want = Vec::new();
            for m in &mats {
                let w = dense_of(m);
                want.extend(
                    w.chunks(cols)
                        .map(|row| row.iter().zip(&x).map(|(a, b)| a * b).sum::<f32>()),
                );
            }
            let d = rel_diff(&y, &want);
            eprintln!("gemv {bits}-bit, {cols} cols, rows {shapes:?}: max rel diff {d:e}");
            assert!(d <= 1e-5, "{bits}-bit {cols} cols: {d:e}");
        }
    }
}
