//! The CUDA backend against the CPU reference. These need a CUDA GPU: they are ignored by a plain
//! `cargo test` (which says so) and run on the H200 with `--include-ignored`
//! (tools/gpu-check.sh). Every comparison prints its measured error, so a run is a record.

mod support;

use lily_core::backend::{Backend, LogitRows};
use lily_core::config::ModelConfig;
use lily_core::model_ref::ModelRef;
use lily_core::rng::uniform_at;
use lily_core::synthetic::SyntheticSource;
use lily_core::weights::{Linear, ModelWeights};
use lily_cpu::CpuBackend;
use lily_cuda::CudaBackend;
use lily_cuda::KvPrecision;
use lily_cuda::gpu::{Gpu, KArg, ptr};
use lily_cuda::mat::{DeviceMat, MatArg, gemv_shape};
use support::{NEEDS_GPU, dense_of, fixture, greedy, random_linear, rel_diff};

fn both(config: &ModelConfig, weights: ModelWeights, kv: KvPrecision) -> (CudaBackend, CpuBackend) {
    let gpu = CudaBackend::with_kv(config.clone(), &weights, kv).expect("CUDA backend");
    (gpu, CpuBackend::new(config.clone(), weights))
}

/// Tolerances, as max |diff| / max |logit|. With an f32 KV cache the GPU computes what the CPU
/// does up to summation order and fast-math `exp`/`rsqrt` (a few ulp), compounded over layers:
/// 1e-4. With the production bf16 cache (8 significant bits) attention outputs move by a few
/// parts in a thousand, and logits by up to 1e-2.
fn tolerance(kv: KvPrecision) -> f32 {
    match kv {
        KvPrecision::F32 => 1e-4,
        KvPrecision::Bf16 => 1e-2,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_matches_the_cpu_on_the_fixtures() {
    for name in ["tiny-a", "tiny-b", "tiny-a-official", "tiny-mlx-q4"] {
        for kv in [KvPrecision::F32, KvPrecision::Bf16] {
            let dir = fixture(name);
            assert!(dir.exists(), "fixture {name} is missing");
            let (config, source) = ModelRef::Dir(dir).open().unwrap();
            let weights = ModelWeights::load(&config, source).unwrap();
            let (gpu, cpu) = both(&config, weights, kv);
            let vocab = config.vocab_size as u32;
            let tokens: Vec<u32> = (0..100u32).map(|i| (i * 7919 + 11) % vocab).collect();
            let mut gs = gpu.new_state(tokens.len()).unwrap();
            let ours = decode_all(&gpu, &mut gs, &tokens);
            let mut cs = cpu.new_state(tokens.len()).unwrap();
            let reference = cpu.prefill(&mut cs, &tokens, LogitRows::All).unwrap();
            let d = rel_diff(&ours, &reference);
            eprintln!("{name}, {kv:?} KV: 100 positions, logits max rel diff {d:e}");
            assert!(d <= tolerance(kv), "{name} {kv:?}: {d:e}");
            let prompt = &tokens[..8];
            let (g, c) = (greedy(&gpu, prompt, 24), greedy(&cpu, prompt, 24));
            assert_eq!(g, c, "{name} {kv:?}: greedy tokens");
        }
    }
}

/// The real model's head structure (GQA group 8, head dim 256, 64 rotary dims, GDN 16/32 heads of
/// 128, 256 experts top 8) at a small width, so every kernel runs at its production constants.
fn narrow(layers: &[&str], experts: usize, top_k: usize) -> ModelConfig {
    let mut root: serde_json::Value =
        serde_json::from_str(lily_core::config::QWEN36_35B_A3B_CONFIG).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    t.insert("hidden_size".into(), 256.into());
    t.insert("num_hidden_layers".into(), layers.len().into());
    t.insert("layer_types".into(), serde_json::json!(layers));
    t.insert("vocab_size".into(), 4096.into());
    t.insert("num_experts".into(), experts.into());
    t.insert("num_experts_per_tok".into(), top_k.into());
    t.insert("moe_intermediate_size".into(), 64.into());
    t.insert("shared_expert_intermediate_size".into(), 128.into());
    ModelConfig::from_json(&root.to_string()).unwrap()
}

const FOUR_LAYERS: [&str; 4] = [
    "linear_attention",
    "linear_attention",
    "full_attention",
    "linear_attention",
];

/// Last-position logits of both backends after `len` tokens, the GPU's fed one decode step at a
/// time (prefill, with its bf16 tensor-core GEMMs, has its own tests in gpu_prefill.rs).
fn last_logits(gpu: &CudaBackend, cpu: &CpuBackend, len: usize) -> (Vec<f32>, Vec<f32>) {
    last_logits_in(gpu, cpu, len, len)
}

/// As [`last_logits`] in a GPU state sized for `max_seq` tokens (which sets its attention splits).
fn last_logits_in(
    gpu: &CudaBackend,
    cpu: &CpuBackend,
    len: usize,
    max_seq: usize,
) -> (Vec<f32>, Vec<f32>) {
    let tokens: Vec<u32> = (0..len as u32).map(|i| (i * 131 + 7) % 4096).collect();
    let mut gs = gpu.new_state(max_seq).unwrap();
    let mut cs = cpu.new_state(len).unwrap();
    let g = decode_all(gpu, &mut gs, &tokens).split_off((len - 1) * gpu.config().vocab_size);
    let c = cpu.prefill(&mut cs, &tokens, LogitRows::Last).unwrap();
    (g, c)
}

/// The logits after each token, every token through the decode step.
fn decode_all(
    gpu: &CudaBackend,
    state: &mut <CudaBackend as Backend>::State,
    tokens: &[u32],
) -> Vec<f32> {
    tokens
        .iter()
        .flat_map(|&t| gpu.decode(state, t).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn production_shaped_kernels_match_the_cpu_across_split_boundaries() {
    let config = narrow(&FOUR_LAYERS, 256, 8);
    for kv in [KvPrecision::F32, KvPrecision::Bf16] {
        let weights = ModelWeights::load(&config, Box::new(SyntheticSource::new(3))).unwrap();
        let (gpu, cpu) = both(&config, weights, kv);
        for len in [1usize, 2, 63, 64, 65, 129, 700] {
            let (g, c) = last_logits(&gpu, &cpu, len);
            let d = rel_diff(&g, &c);
            eprintln!(
                "production shapes, {kv:?} KV, context {len}: last logits max rel diff {d:e}"
            );
            // With 256 experts, bf16 KV rounding can flip an expert choice, a jump no tolerance
            // describes; the kernels are held to the f32 cache here, the bf16 path by the
            // fixtures (equal greedy tokens).
            if kv == KvPrecision::F32 {
                assert!(d <= tolerance(kv), "{kv:?} context {len}: {d:e}");
            }
        }
        // A state sized for a long context splits attention 274 ways (most splits empty here).
        if kv == KvPrecision::F32 {
            let (g, c) = last_logits_in(&gpu, &cpu, 300, 70_000);
            let d = rel_diff(&g, &c);
            eprintln!("production shapes, 274 attention splits, context 300: {d:e}");
            assert!(d <= tolerance(kv), "274 splits: {d:e}");
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
}

/// Each layer kind alone at production head shapes, with a small and the full expert count:
/// where a mismatch comes from, this says.
#[test]
#[ignore = "needs a CUDA GPU"]
fn each_part_alone_matches_the_cpu() {
    let mut results = Vec::new();
    for layer in ["linear_attention", "full_attention"] {
        for (experts, top_k) in [(16, 4), (256, 8)] {
            let config = narrow(&[layer], experts, top_k);
            let weights = ModelWeights::load(&config, Box::new(SyntheticSource::new(5))).unwrap();
            let (gpu, cpu) = both(&config, weights, KvPrecision::F32);
            for len in [1usize, 65] {
                let (g, c) = last_logits(&gpu, &cpu, len);
                let d = rel_diff(&g, &c);
                eprintln!("{layer} alone, {experts} experts top {top_k}, context {len}: {d:e}");
                results.push((layer, experts, len, d));
            }
        }
    }
    for (layer, experts, len, d) in results {
        assert!(
            d <= tolerance(KvPrecision::F32),
            "{layer}, {experts} experts, context {len}: {d:e}"
        );
    }
}

/// The GEMV at every format, ragged row counts, and several matrices in one launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_matches_dequantise_then_multiply() {
    let config = narrow(&FOUR_LAYERS, 16, 4);
    let gpu = Gpu::new(&config, KvPrecision::Bf16).expect(NEEDS_GPU);
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
            let shape = gemv_shape(&shapes);
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
