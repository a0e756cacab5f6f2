//! Timed records of the prefill GEMMs at the real model's shapes, every GEMM path the GPU runs
//! side by side (`GemmPath`; their correctness is gpu_gemm.rs). Records, not pass/fail: they
//! assert only finite outputs. Needs a CUDA GPU: run on the H200 with `--include-ignored`.

mod support;

use std::time::Instant;

use cudarc::driver::CudaSlice;
use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use lily_core::rng::{mix64, uniform_at};
use lily_core::synthetic::synthetic_config;
use lily_cuda::KvPrecision;
use lily_cuda::gemm::{GemmX, gemm};
use lily_cuda::gemm_grouped::{GateUp, gemm_gate_up, gemm_grouped};
use lily_cuda::gemm_wgmma::{GemmPath, takes};
use lily_cuda::gpu::{Gpu, ptr};
use lily_cuda::mat::DeviceMat;
use lily_cuda::moe_prefill::{MoeTile, TileMap, max_tiles, sort, sort_counts};
use support::{NEEDS_GPU, gemm_paths, random_linear_grouped, time_ms};

/// The kernel file `path` runs `w` on (the wgmma path leaves what gemm_wgmma.cu does not take to
/// gemm.cu).
fn kernel_file(gpu: &Gpu, path: GemmPath, w: &DeviceMat) -> &'static str {
    if path == GemmPath::Wgmma && takes(&w.arg(gpu), w.bits) {
        "gemm_wgmma.cu"
    } else {
        "gemm.cu"
    }
}

/// `x` rounded to bf16, as bits.
fn bf16_bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// TFLOP/s of `flops` in `ms`.
fn tflops(flops: usize, ms: f64) -> f64 {
    flops as f64 / (ms * 1e-3) / 1e12
}

/// Dense prefill-sized products at the real model's shapes (4,096 tokens, hidden 2,048): the
/// mixer projections, the shared expert's gate (too few output tiles: split along K) and an
/// 8-bit router-like product (gemm.cu on every path).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_speed_at_prefill_shapes() {
    let config = synthetic_config("tiny").unwrap();
    let mut gpu = Gpu::new(&config, KvPrecision::Bf16).expect(NEEDS_GPU);
    let paths = gemm_paths(&gpu);
    let t = 4096usize;
    let started = Instant::now();
    let x: Vec<f32> = (0..t * 4096).map(|i| uniform_at(5, i as u64)).collect();
    let dx = gpu.upload(&x).unwrap();
    let xp = ptr(&dx, &gpu.stream);
    // The same rows as bf16 (`GemmX::bf16`, what prefill's norms write), for the _x16 kernels.
    let dx16 = gpu.upload(&bf16_bits(&x)).unwrap();
    let x16 = GemmX {
        f32: xp,
        bf16: Some(ptr(&dx16, &gpu.stream)),
    };
    for (bits, n, k) in [
        (4u32, 2048usize, 2048usize),
        (4, 8192, 2048),
        (4, 2048, 4096),
        (4, 512, 2048),
        (8, 2048, 2048),
    ] {
        let w = DeviceMat::upload(&gpu, &random_linear_grouped(n, k, bits, 64, 9)).unwrap();
        let dy = gpu.zeros::<f32>(t * n).unwrap();
        let yp = ptr(&dy, &gpu.stream);
        let mut line = format!("dense {bits}-bit {t}x{k} · {n}x{k}:");
        for &path in &paths {
            gpu.set_gemm_path(path).unwrap();
            let ms = time_ms(&gpu, &|| gemm(&gpu, &w, xp, t, yp, n, 0).unwrap());
            let rate = tflops(2 * t * n * k, ms);
            let file = kernel_file(&gpu, path, &w);
            line += &format!(" {path:?} ({file}) {ms:.3} ms ({rate:.0} TFLOP/s);");
            assert!(gpu.download(&dy).unwrap().iter().all(|v| v.is_finite()));
            if file == "gemm_wgmma.cu" {
                let ms = time_ms(&gpu, &|| gemm(&gpu, &w, x16, t, yp, n, 0).unwrap());
                let rate = tflops(2 * t * n * k, ms);
                line += &format!(" {path:?} bf16 X ({file}) {ms:.3} ms ({rate:.0} TFLOP/s);");
            }
        }
        eprintln!("{line}");
    }
    eprintln!("speed test took {:.1} s", started.elapsed().as_secs_f64());
}

/// Expert ids for `t` tokens that each choose `top_k` distinct experts uniformly at random, laid
/// out as routing lays them out (pair p = token · top_k + k).
fn random_routing(t: usize, top_k: usize, experts: usize, seed: u64) -> Vec<i32> {
    let mut ids = Vec::with_capacity(t * top_k);
    for token in 0..t {
        let mut chosen: Vec<i32> = Vec::with_capacity(top_k);
        for draw in 0u64.. {
            if chosen.len() == top_k {
                break;
            }
            let e = (mix64(seed ^ mix64((token as u64) << 32 | draw)) % experts as u64) as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
    }
    ids
}

/// The grouped expert GEMMs of one MoE layer at the production shapes (hidden 2,048, 256 experts
/// of 512 rows, top 8, 4-bit weights in groups of 64), for chunks of 128 to 4,096 tokens routed
/// at random and sorted by the expert sort, at both tile heights and on every GEMM path (16-row tiles
/// take gemm.cu on every path): the record to set ROWS64_FROM_ROWS_PER_EXPERT from. Gate and up
/// are launches of one shape, so gate stands for both; a layer's expert GEMMs take two of it and
/// one down. At 4,096 tokens and 64-row tiles it gives docs/BENCHMARKS.md's grouped TFLOP/s.
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_gemm_speed_by_tokens() {
    let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
    // The sort is compiled for the model's expert count and top-k.
    let mut gpu = Gpu::new(&c, KvPrecision::Bf16).expect(NEEDS_GPU);
    let paths = gemm_paths(&gpu);
    let (h, inter) = (c.hidden_size, c.moe_intermediate_size);
    let (experts, top_k) = (c.num_experts, c.experts_per_token);
    let upload = |gpu: &Gpu, rows, cols, seed| {
        DeviceMat::upload(gpu, &random_linear_grouped(rows, cols, 4, 64, seed)).unwrap()
    };
    let (gate, down) = (
        upload(&gpu, experts * inter, h, 21),
        upload(&gpu, experts * h, inter, 22),
    );
    let finite =
        |gpu: &Gpu, b: &CudaSlice<f32>| gpu.download(b).unwrap().iter().all(|v| v.is_finite());
    for t in [128usize, 256, 512, 1024, 2048, 4096] {
        let pairs = t * top_k;
        let x: Vec<f32> = (0..t * h).map(|i| uniform_at(23, i as u64)).collect();
        let dx = gpu.upload(&x).unwrap();
        let dx16 = gpu.upload(&bf16_bits(&x)).unwrap();
        let act16 = gpu.zeros::<u16>(pairs * inter).unwrap();
        let ids = gpu
            .upload(&random_routing(t, top_k, experts, t as u64))
            .unwrap();
        let gather = gpu.zeros::<i32>(pairs).unwrap();
        let slot_of = gpu.zeros::<i32>(pairs).unwrap();
        let tiles = gpu
            .zeros::<i32>(3 * max_tiles(pairs, experts, MoeTile::Rows16))
            .unwrap();
        let num_tiles = gpu.zeros::<i32>(1).unwrap();
        let act = gpu.zeros::<f32>(pairs * inter).unwrap();
        let out = gpu.zeros::<f32>(pairs * h).unwrap();
        let s = &gpu.stream;
        let (xp, gp, ap, op) = (ptr(&dx, s), ptr(&gather, s), ptr(&act, s), ptr(&out, s));
        let (ids_p, slot_p) = (ptr(&ids, s), ptr(&slot_of, s));
        let counts = gpu.zeros::<i32>(sort_counts(pairs, experts)).unwrap();
        let counts_p = ptr(&counts, s);
        let (tiles_p, num_p) = (ptr(&tiles, s), ptr(&num_tiles, s));
        for height in MoeTile::ALL {
            let map = TileMap {
                tiles: tiles_p,
                num_tiles: num_p,
                height,
                max_tiles: max_tiles(pairs, experts, height),
            };
            sort(&gpu, ids_p, pairs, gp, slot_p, counts_p, &map).unwrap();
            let live = gpu.download(&num_tiles).unwrap()[0];
            // These weights run their 64-row tiles on whichever path is set (gemm_wgmma.cu takes
            // them), so each path chooses the height for itself.
            let choosers: Vec<String> = paths
                .iter()
                .filter(|&&path| MoeTile::for_chunk(t, top_k, experts, path) == height)
                .map(|path| format!("{path:?}"))
                .collect();
            let mark = match choosers.is_empty() {
                true => String::new(),
                false => format!(" (chosen on {})", choosers.join(", ")),
            };
            let mut line = format!(
                "grouped t {t} ({:.1} rows per expert), {height:?}{mark}: {live} tiles;",
                pairs as f64 / experts as f64,
            );
            let flops = 2 * pairs * inter * h;
            for &path in &paths {
                gpu.set_gemm_path(path).unwrap();
                let gate_ms = time_ms(&gpu, &|| {
                    gemm_grouped(&gpu, &gate, inter, xp, gp, &map, ap).unwrap()
                });
                let down_ms = time_ms(&gpu, &|| {
                    gemm_grouped(&gpu, &down, h, ap, 0, &map, op).unwrap()
                });
                let file = match height {
                    MoeTile::Rows64 => kernel_file(&gpu, path, &gate),
                    MoeTile::Rows16 => "gemm.cu",
                };
                line += &format!(
                    " {path:?} ({file}): gate|up {gate_ms:.3} ms ({:.0} TFLOP/s), down {down_ms:.3} ms \
                     ({:.0} TFLOP/s), a layer's 2 gate|up + down {:.3} ms;",
                    tflops(flops, gate_ms),
                    tflops(flops, down_ms),
                    2.0 * gate_ms + down_ms
                );
                if file == "gemm_wgmma.cu" {
                    let x16 = GemmX {
                        f32: xp,
                        bf16: Some(ptr(&dx16, &gpu.stream)),
                    };
                    let ms = time_ms(&gpu, &|| {
                        gemm_grouped(&gpu, &gate, inter, x16, gp, &map, ap).unwrap()
                    });
                    line += &format!(
                        " {path:?} bf16 X: gate|up {ms:.3} ms ({:.0} TFLOP/s);",
                        tflops(flops, ms)
                    );
                    // Gate and up and the SwiGLU in one launch (two products' FLOPs), act in
                    // bf16 only, as prefill runs it when the down projection reads bf16.
                    let fused_ms = time_ms(&gpu, &|| {
                        let x16 = ptr(&dx16, &gpu.stream);
                        let a16 = ptr(&act16, &gpu.stream);
                        let w = GateUp {
                            gate: &gate,
                            up: &gate,
                            n: inter,
                        };
                        gemm_gate_up(&gpu, w, x16, gp, &map, 0, a16).unwrap()
                    });
                    line += &format!(
                        " {path:?} bf16 X, gate + up + SwiGLU fused: {fused_ms:.3} ms ({:.0} TFLOP/s);",
                        tflops(2 * flops, fused_ms)
                    );
                }
                assert!(
                    finite(&gpu, &act) && finite(&gpu, &out),
                    "t {t} {height:?} {path:?}: non-finite outputs"
                );
            }
            eprintln!("{line}");
        }
    }
}
