//! What the GPU test files share: fixtures, the error measure, random matrices, greedy runs,
//! timing.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use lily_core::backend::Backend;
use lily_core::generate::generate;
use lily_core::quant::QuantMatrix;
use lily_core::rng::uniform_at;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::weights::{Linear, Matrix};
use lily_cuda::gemm_wgmma::GemmPath;

pub const NEEDS_GPU: &str = "needs a CUDA GPU";

/// The fixtures folder: `LILY_FIXTURES` where the binary runs away from its source tree (the GPU
/// machine), else the repository's.
pub fn fixture(name: &str) -> PathBuf {
    std::env::var_os("LILY_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
        .join(name)
}

/// max |a − b| / max |b|; a NaN in `a` is an infinite error.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
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

/// How far a prefill's logits may be from the f32 CPU's, relative to the largest, where the
/// model is not chaotic: prefill runs every projection on tensor cores in bf16 (inputs and
/// dequantised weights rounded to 8 significant bits, f32 accumulation), so each GEMM output moves
/// by a few parts in a thousand of its scale, compounded over the layers. The kernels themselves
/// are held much tighter against bf16-rounded references in their own test files (gpu_gemm.rs and
/// the others).
pub const BF16_PREFILL: f32 = 5e-2;

/// A prompt of `n` ids below `vocab`, different for each seed.
pub fn tokens(n: usize, vocab: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919).wrapping_add(seed * 104_729 + 11)) % vocab as u32)
        .collect()
}

/// The index of the largest value (the first of equals).
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
            if x > best.1 { (i, x) } else { best }
        })
        .0
}

/// `n` greedy tokens after `prompt`, through `generate` as the CLI runs it.
pub fn greedy<B: Backend>(b: &B, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut state = b.new_state(prompt.len() + n).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    generate(b, &mut state, prompt, n, &[], &mut sampler, |_| {
        ControlFlow::Continue(())
    })
    .unwrap()
    .tokens
}

/// A `rows × cols` matrix of uniform values, dense (`bits` 32) or MLX-quantised with group 64.
pub fn random_linear(rows: usize, cols: usize, bits: u32, seed: u64) -> Linear {
    random_linear_grouped(rows, cols, bits, 64, seed)
}

/// As [`random_linear`] with quantisation groups of `group` inputs.
pub fn random_linear_grouped(
    rows: usize,
    cols: usize,
    bits: u32,
    group: usize,
    seed: u64,
) -> Linear {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| uniform_at(seed, i as u64))
        .collect();
    match bits {
        32 => Linear::Dense(Matrix {
            rows,
            cols,
            data: values,
        }),
        b => Linear::Affine(QuantMatrix::quantize(rows, cols, b, group, &values).unwrap()),
    }
}

/// The values a matrix stands for, dequantised.
pub fn dense_of(l: &Linear) -> Vec<f32> {
    match l {
        Linear::Dense(m) => m.data.clone(),
        Linear::Affine(q) => q.dequantize(),
    }
}

/// The GEMM paths this GPU runs, each announced, and each it cannot run announced as not run.
pub fn gemm_paths(gpu: &lily_cuda::gpu::Gpu) -> Vec<GemmPath> {
    let supported = GemmPath::supported(&gpu.arch);
    for path in GemmPath::ALL {
        if supported.contains(&path) {
            eprintln!("GEMM path {path:?}: runs on {}", gpu.arch);
        } else {
            eprintln!("GEMM path {path:?}: not available on {}, not run", gpu.arch);
        }
    }
    supported
}

/// Milliseconds per call of `f`, the mean of 20 after 3 warm-ups, on the GPU's clock (for the
/// timed records, which assert nothing about speed).
pub fn time_ms(gpu: &lily_cuda::gpu::Gpu, f: &dyn Fn()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (
        gpu.ctx.new_event(timing).unwrap(),
        gpu.ctx.new_event(timing).unwrap(),
    );
    start.record(&gpu.stream).unwrap();
    for _ in 0..20 {
        f();
    }
    end.record(&gpu.stream).unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / 20.0
}

/// The environment's CUDA options (LILY_DECODE picks the decode path a GPU run tests) with the
/// KV cache and the prefill chunk a test needs.
pub fn options(kv: lily_cuda::KvPrecision, prefill_chunk: usize) -> lily_cuda::CudaOptions {
    lily_cuda::CudaOptions {
        prefill_chunk,
        ..lily_cuda::CudaOptions::from_env()
            .expect("the LILY_* variables")
            .with_kv(kv)
    }
}
