//! The tensor-core GEMM (kernels/gemm.cu) against CPU products. Needs a CUDA GPU: ignored by a
//! plain `cargo test`, run on the H200 with `--include-ignored` (tools/gpu-check.sh).
//!
//! Two references for every product: (a) x and the dequantised weight rounded to bf16 exactly as
//! the kernel rounds them, summed in f64, so only the kernel's f32 summation order differs: held
//! to 1e-5 of max |y|; (b) the exact f32 operands, printed to record what bf16 operands cost.
//! Every output buffer is prefilled with a marked NaN, and the cells the kernel must not write
//! are checked to keep it.

mod support;

use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::bf16;
use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use lily_core::rng::{mix64, uniform_at};
use lily_core::synthetic::synthetic_config;
use lily_core::weights::Linear;
use lily_cuda::KvPrecision;
use lily_cuda::gemm::{gemm, gemm_grouped};
use lily_cuda::gpu::{Gpu, ptr};
use lily_cuda::mat::DeviceMat;
use lily_cuda::moe_prefill::{MoeTile, TileMap, max_tiles, sort};
use support::{NEEDS_GPU, random_linear_grouped, time_ms};

/// A quiet NaN with a payload no arithmetic produces: a cell holding it was never written.
const SENTINEL: u32 = 0x7fc0_dead;

/// The summation-order tolerance of reference (a), as a fraction of max |y|. Products of bf16
/// values are exact in f32, so kernel and reference differ only by the rounding of the f32
/// partial sums, which the tensor cores truncate rather than round: one ulp (2⁻²³) of a partial
/// sum per mma, K/16 of them. An H200 measured at most 3e-6 at K = 2048.
const TOLERANCE: f64 = 1e-5;

fn gpu() -> Gpu {
    let config = synthetic_config("tiny").unwrap();
    Gpu::new(&config, KvPrecision::Bf16).expect(NEEDS_GPU)
}

/// The weight as the kernel sees it: `scale·code + bias` by one fused multiply-add in f32, then
/// rounded to bf16 (dense weights are rounded as they are).
fn kernel_weight(l: &Linear) -> Vec<f32> {
    let round = |v: f32| bf16::from_f32(v).to_f32();
    match l {
        Linear::Dense(m) => m.data.iter().map(|&v| round(v)).collect(),
        Linear::Affine(q) => {
            let (rows, cols, group) = (q.rows(), q.cols(), q.group_size());
            let mut out = Vec::with_capacity(rows * cols);
            for r in 0..rows {
                let (scales, biases) = (q.row_scales(r), q.row_biases(r));
                for c in 0..cols {
                    let (s, b) = (scales[c / group].to_f32(), biases[c / group].to_f32());
                    out.push(round(s.mul_add(q.code(r, c) as f32, b)));
                }
            }
            out
        }
    }
}

/// The weight exactly: `scale·code + bias` as MLX computes it.
fn exact_weight(l: &Linear) -> Vec<f32> {
    match l {
        Linear::Dense(m) => m.data.clone(),
        Linear::Affine(q) => q.dequantize(),
    }
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// `Σ_k x[k] · w[k]` in f64.
fn dot(x: &[f32], w: &[f32]) -> f64 {
    x.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Reference rows `y[r, 0..n) = x_row(r) · w[w_row0(r) + j]` for the given rows, on every core.
fn reference(
    rows: &[usize],
    n: usize,
    k: usize,
    x_row: &(dyn Fn(usize) -> usize + Sync),
    w_row0: &(dyn Fn(usize) -> usize + Sync),
    x: &[f32],
    w: &[f32],
) -> Vec<Vec<f64>> {
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let per = rows.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .chunks(per)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|&r| {
                            let xr = &x[x_row(r) * k..(x_row(r) + 1) * k];
                            (0..n)
                                .map(|j| {
                                    let wr = (w_row0(r) + j) * k;
                                    dot(xr, &w[wr..wr + k])
                                })
                                .collect::<Vec<f64>>()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// max |got − want| / max |want| over the given rows (NaN in `got` counts as infinite).
fn rel_diff(got: &[Vec<f32>], want: &[Vec<f64>]) -> f64 {
    let scale = want.iter().flatten().fold(0f64, |m, &v| m.max(v.abs()));
    assert!(scale > 0.0, "reference is all zeros");
    let worst = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .fold(0f64, |m, (&g, &w)| {
            if g.is_nan() {
                f64::INFINITY
            } else {
                m.max((g as f64 - w).abs())
            }
        });
    worst / scale
}

/// Which output rows to compare: all of them up to a few hundred, else every 29th plus the first
/// and last two 64-row tiles (the CPU reference of a 4096-row product would dominate the test's
/// time).
fn rows_to_check(m: usize) -> Vec<usize> {
    if m <= 300 {
        return (0..m).collect();
    }
    let edge = 2 * MoeTile::Rows64.rows() + 3;
    (0..m)
        .filter(|&r| r < edge || r + edge >= m || r % 29 == 0)
        .collect()
}

struct Dense {
    bits: u32,
    group: usize,
    m: usize,
    n: usize,
    k: usize,
    /// Floats x and y are offset into their buffers: 1 makes both only 4-byte aligned.
    offset: usize,
}

/// Runs one dense product into `y[r, col0 + j]` of a wider, taller buffer and returns the errors
/// against references (a) and (b).
fn check_dense(gpu: &Gpu, c: &Dense) -> (f64, f64) {
    let (m, n, k) = (c.m, c.n, c.k);
    let seed = (c.bits as u64) << 40 | (m as u64) << 20 | (n as u64) << 8 | k as u64;
    let l = random_linear_grouped(n, k, c.bits, c.group, seed);
    let w = DeviceMat::upload(gpu, &l).unwrap();
    let x: Vec<f32> = (0..m * k).map(|i| uniform_at(seed + 1, i as u64)).collect();
    let mut xbuf = vec![0f32; c.offset];
    xbuf.extend(&x);
    let dx = gpu.upload(&xbuf).unwrap();
    // Three columns before the output, five after, one row below.
    let (col0, ldy) = (3, n + 8);
    let ylen = c.offset + (m + 1) * ldy;
    let dy = gpu.upload(&vec![f32::from_bits(SENTINEL); ylen]).unwrap();
    let (xp, yp) = (ptr(&dx, &gpu.stream), ptr(&dy, &gpu.stream));
    let at = 4 * c.offset as u64;
    gemm(gpu, &w, xp + at, m, yp + at, ldy, col0).unwrap();
    let y = gpu.download(&dy).unwrap();
    let y = &y[c.offset..];
    for (i, v) in y.iter().enumerate() {
        let (r, col) = (i / ldy, i % ldy);
        let inside = r < m && (col0..col0 + n).contains(&col);
        assert_eq!(
            v.to_bits() == SENTINEL,
            !inside,
            "{}-bit m {m} n {n} k {k}: cell ({r}, {col}) {}",
            c.bits,
            if inside { "not written" } else { "overwritten" }
        );
    }
    let rows = rows_to_check(m);
    let got: Vec<Vec<f32>> = rows
        .iter()
        .map(|&r| y[r * ldy + col0..r * ldy + col0 + n].to_vec())
        .collect();
    let id = |r: usize| r;
    let zero = |_: usize| 0;
    let (wk, xk) = (kernel_weight(&l), bf16_round(&x));
    let a = rel_diff(&got, &reference(&rows, n, k, &id, &zero, &xk, &wk));
    let b = rel_diff(
        &got,
        &reference(&rows, n, k, &id, &zero, &x, &exact_weight(&l)),
    );
    (a, b)
}

/// Every format at ragged and tile-sized shapes; aligned and 4-byte-aligned pointers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_gemm_matches_bf16_products() {
    let gpu = gpu();
    let formats = [(4u32, 64usize), (8, 64), (8, 32), (4, 128), (32, 0)];
    let mut cases = Vec::new();
    for (bits, group) in formats {
        for m in [1usize, 7, 16, 33, 200] {
            for (n, k) in [(72usize, 512usize), (257, 2048), (2048 + 64, 512)] {
                cases.push(Dense {
                    bits,
                    group,
                    m,
                    n,
                    k,
                    offset: m % 2,
                });
            }
        }
        // Tall products, checked on sampled rows.
        for m in [2048usize, 4096] {
            cases.push(Dense {
                bits,
                group,
                m,
                n: 257,
                k: 2048,
                offset: 0,
            });
        }
    }
    // Dense weights as narrow as the tiny test models': K not a multiple of the 64-wide step,
    // of 8 or of 4 (the scalar loads); 530 also splits along K, the last split ragged.
    for k in [16usize, 48, 100, 37, 530] {
        for m in [1usize, 65] {
            cases.push(Dense {
                bits: 32,
                group: 0,
                m,
                n: 72,
                k,
                offset: 1,
            });
            cases.push(Dense {
                bits: 32,
                group: 0,
                m,
                n: 130,
                k,
                offset: 0,
            });
        }
    }
    let mut failures = Vec::new();
    for c in &cases {
        let (a, b) = check_dense(&gpu, c);
        let what = format!(
            "{}-bit (group {}) m {} n {} k {} offset {}",
            c.bits, c.group, c.m, c.n, c.k, c.offset
        );
        eprintln!("gemm {what}: vs bf16 operands {a:.2e}, vs exact f32 operands {b:.2e}");
        if a > TOLERANCE {
            failures.push(format!("{what}: {a:e}"));
        }
    }
    assert!(failures.is_empty(), "beyond {TOLERANCE:e}: {failures:#?}");
}

struct Grouped<'a> {
    bits: u32,
    n: usize,
    k: usize,
    /// Rows routed to each expert, in expert order.
    counts: &'a [usize],
    /// Tokens x holds when slots gather their rows; None: slot s reads x row s.
    gather_tokens: Option<usize>,
}

/// The tiles routing cuts `counts` (slots in expert order) into at `height`: `{expert, first
/// slot, rows}` triples.
fn cut_tiles(counts: &[usize], height: MoeTile) -> Vec<i32> {
    let mut tiles = Vec::new();
    let mut slot = 0;
    for (e, &count) in counts.iter().enumerate() {
        for start in (0..count).step_by(height.rows()) {
            tiles.extend([e, slot + start, height.rows().min(count - start)].map(|v| v as i32));
        }
        slot += count;
    }
    tiles
}

/// Runs one grouped product at `height` with tiles cut as routing cuts them, plus decoy tiles
/// past the live count that would overwrite slot 0 if a block read them; checks that exactly the
/// slots' rows were written and returns y.
fn run_grouped(
    gpu: &Gpu,
    c: &Grouped,
    w: &DeviceMat,
    x: u64,
    gather: u64,
    height: MoeTile,
) -> Vec<f32> {
    let (n, experts) = (c.n, c.counts.len());
    let pairs: usize = c.counts.iter().sum();
    let mut tiles = cut_tiles(c.counts, height);
    let live = tiles.len() / 3;
    let grid = max_tiles(pairs, experts, height);
    assert!(
        live <= grid,
        "max_tiles {grid} below the {live} tiles built"
    );
    let first = c.counts.iter().position(|&count| count > 0).unwrap();
    let decoy = [
        ((first + 1) % experts) as i32,
        0,
        height.rows().min(pairs) as i32,
    ];
    while tiles.len() < 3 * grid {
        tiles.extend(decoy);
    }
    let dt = gpu.upload(&tiles).unwrap();
    let dn = gpu.upload(&[live as i32]).unwrap();
    // One spare row after the last slot must keep the sentinel.
    let dy = gpu
        .upload(&vec![f32::from_bits(SENTINEL); (pairs + 1) * n])
        .unwrap();
    let map = TileMap {
        tiles: ptr(&dt, &gpu.stream),
        num_tiles: ptr(&dn, &gpu.stream),
        height,
        max_tiles: grid,
    };
    gemm_grouped(gpu, w, n, x, gather, &map, ptr(&dy, &gpu.stream)).unwrap();
    let y = gpu.download(&dy).unwrap();
    for (i, v) in y.iter().enumerate() {
        assert_eq!(
            v.to_bits() == SENTINEL,
            i >= pairs * n,
            "grouped {height:?} counts {:?}: cell ({}, {}) wrongly {}",
            c.counts,
            i / n,
            i % n,
            if i >= pairs * n {
                "written"
            } else {
                "unwritten"
            }
        );
    }
    y
}

/// Runs one grouped product at every tile height; returns each height's errors against
/// references (a) and (b), which do not depend on the height.
fn check_grouped(gpu: &Gpu, c: &Grouped) -> [(MoeTile, f64, f64); 2] {
    let (n, k, experts) = (c.n, c.k, c.counts.len());
    let pairs: usize = c.counts.iter().sum();
    let seed = (c.bits as u64) << 40 | (pairs as u64) << 16 | n as u64;
    let l = random_linear_grouped(experts * n, k, c.bits, 64, seed);
    let w = DeviceMat::upload(gpu, &l).unwrap();
    let slot_expert: Vec<usize> = (0..experts)
        .flat_map(|e| std::iter::repeat_n(e, c.counts[e]))
        .collect();
    let x_rows = c.gather_tokens.unwrap_or(pairs);
    let gather: Vec<i32> = (0..pairs)
        .map(|s| ((s * 7919 + 13) % x_rows) as i32)
        .collect();
    let x: Vec<f32> = (0..x_rows * k)
        .map(|i| uniform_at(seed + 1, i as u64))
        .collect();
    let (dx, dg) = (gpu.upload(&x).unwrap(), gpu.upload(&gather).unwrap());
    let gather_ptr = if c.gather_tokens.is_some() {
        ptr(&dg, &gpu.stream)
    } else {
        0
    };
    let rows = rows_to_check(pairs);
    let x_row = |s: usize| {
        if c.gather_tokens.is_some() {
            gather[s] as usize
        } else {
            s
        }
    };
    let w_row0 = |s: usize| slot_expert[s] * n;
    let (wk, xk) = (kernel_weight(&l), bf16_round(&x));
    let want_a = reference(&rows, n, k, &x_row, &w_row0, &xk, &wk);
    let want_b = reference(&rows, n, k, &x_row, &w_row0, &x, &exact_weight(&l));
    MoeTile::ALL.map(|height| {
        let y = run_grouped(gpu, c, &w, ptr(&dx, &gpu.stream), gather_ptr, height);
        let got: Vec<Vec<f32>> = rows
            .iter()
            .map(|&s| y[s * n..(s + 1) * n].to_vec())
            .collect();
        (height, rel_diff(&got, &want_a), rel_diff(&got, &want_b))
    })
}

/// `m` rows spread at random over `experts` experts, every third one (from expert 1) left empty.
fn spread(m: usize, experts: usize, seed: u64) -> Vec<usize> {
    let routed: Vec<usize> = (0..experts).filter(|e| e % 3 != 1).collect();
    let mut counts = vec![0; experts];
    for r in 0..m {
        counts[routed[(mix64(seed ^ mix64(r as u64)) % routed.len() as u64) as usize]] += 1;
    }
    counts
}

/// At both tile heights, in every format, with and without a gather list, with fewer live tiles
/// than the grid: m rows spread over experts with empty ones among them, and all on one expert,
/// for the m of the list; then counts at and either side of both heights.
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_gemm_matches_bf16_products() {
    let gpu = gpu();
    let mut routings: Vec<Vec<usize>> = Vec::new();
    for m in [1usize, 7, 16, 33, 200, 2048, 4096] {
        routings.push(spread(m, 12, m as u64));
        routings.push(vec![0, 0, m, 0]);
    }
    routings.push(vec![0, 1, 15, 16, 17, 0, 63, 64, 65, 0, 130, 7]);
    routings.push(vec![31, 0, 33, 48, 129]);
    let mut failures = Vec::new();
    for bits in [4u32, 8, 32] {
        for counts in &routings {
            for (n, k) in [(192usize, 512usize), (64, 2048), (72, 48)] {
                if bits != 32 && k % 64 != 0 {
                    continue;
                }
                for gather_tokens in [None, Some(37)] {
                    let c = Grouped {
                        bits,
                        n,
                        k,
                        counts,
                        gather_tokens,
                    };
                    for (height, a, b) in check_grouped(&gpu, &c) {
                        let what = format!(
                            "{bits}-bit {height:?} n {n} k {k} counts {counts:?} gather {gather_tokens:?}"
                        );
                        eprintln!(
                            "grouped gemm {what}: vs bf16 operands {a:.2e}, vs exact f32 operands {b:.2e}"
                        );
                        if a > TOLERANCE {
                            failures.push(format!("{what}: {a:e}"));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "beyond {TOLERANCE:e}: {failures:#?}");
}

/// Dense prefill-sized products at the real model's shapes (4,096 tokens, hidden 2,048), timed: a
/// record of TFLOP/s, not a pass/fail (beyond finite outputs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_speed_at_prefill_shapes() {
    let gpu = gpu();
    let t = 4096usize;
    let started = Instant::now();
    let x: Vec<f32> = (0..t * 4096).map(|i| uniform_at(5, i as u64)).collect();
    let dx = gpu.upload(&x).unwrap();
    let xp = ptr(&dx, &gpu.stream);
    for (bits, n, k) in [
        (4u32, 2048usize, 2048usize),
        (4, 8192, 2048),
        (4, 2048, 4096),
        (8, 2048, 2048),
    ] {
        let w = DeviceMat::upload(&gpu, &random_linear_grouped(n, k, bits, 64, 9)).unwrap();
        let dy = gpu.zeros::<f32>(t * n).unwrap();
        let yp = ptr(&dy, &gpu.stream);
        let ms = time_ms(&gpu, &|| gemm(&gpu, &w, xp, t, yp, n, 0).unwrap());
        let tflops = 2.0 * (t * n * k) as f64 / (ms * 1e-3) / 1e12;
        eprintln!("dense {bits}-bit {t}x{k} · {n}x{k}: {ms:.3} ms, {tflops:.0} TFLOP/s");
        assert!(gpu.download(&dy).unwrap().iter().all(|v| v.is_finite()));
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
/// at random and sorted by moe_sort, at both tile heights: the record to set
/// ROWS64_FROM_ROWS_PER_EXPERT from. Gate and up are launches of one shape, so gate stands for
/// both; a layer's expert GEMMs take two of it and one down. A record, not a pass/fail (beyond
/// finite outputs). At 4,096 tokens and 64-row tiles it takes over from the evenly routed grouped
/// timing that gemm_speed_at_prefill_shapes made before (docs/BENCHMARKS.md's grouped TFLOP/s).
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_gemm_speed_by_tokens() {
    let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
    // moe_sort is compiled for the model's expert count and top-k.
    let gpu = Gpu::new(&c, KvPrecision::Bf16).expect(NEEDS_GPU);
    let (h, inter) = (c.hidden_size, c.moe_intermediate_size);
    let (experts, top_k) = (c.num_experts, c.experts_per_token);
    let upload = |rows, cols, seed| {
        DeviceMat::upload(&gpu, &random_linear_grouped(rows, cols, 4, 64, seed)).unwrap()
    };
    let (gate, down) = (
        upload(experts * inter, h, 21),
        upload(experts * h, inter, 22),
    );
    let s = &gpu.stream;
    let finite = |b: &CudaSlice<f32>| gpu.download(b).unwrap().iter().all(|v| v.is_finite());
    for t in [128usize, 256, 512, 1024, 2048, 4096] {
        let pairs = t * top_k;
        let x: Vec<f32> = (0..t * h).map(|i| uniform_at(23, i as u64)).collect();
        let dx = gpu.upload(&x).unwrap();
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
        let (xp, gp, ap, op) = (ptr(&dx, s), ptr(&gather, s), ptr(&act, s), ptr(&out, s));
        let chosen = MoeTile::for_chunk(t, top_k, experts);
        for height in MoeTile::ALL {
            let map = TileMap {
                tiles: ptr(&tiles, s),
                num_tiles: ptr(&num_tiles, s),
                height,
                max_tiles: max_tiles(pairs, experts, height),
            };
            sort(&gpu, ptr(&ids, s), pairs, gp, ptr(&slot_of, s), &map).unwrap();
            let live = gpu.download(&num_tiles).unwrap()[0];
            let gate_ms = time_ms(&gpu, &|| {
                gemm_grouped(&gpu, &gate, inter, xp, gp, &map, ap).unwrap()
            });
            let down_ms = time_ms(&gpu, &|| {
                gemm_grouped(&gpu, &down, h, ap, 0, &map, op).unwrap()
            });
            let tflops = |ms: f64| 2.0 * (pairs * inter * h) as f64 / (ms * 1e-3) / 1e12;
            eprintln!(
                "grouped t {t} ({:.1} rows per expert), {height:?}{}: {live} tiles; gate|up \
                 {gate_ms:.3} ms ({:.0} TFLOP/s), down {down_ms:.3} ms ({:.0} TFLOP/s); \
                 a layer's 2 gate|up + down {:.3} ms",
                pairs as f64 / experts as f64,
                if height == chosen { " (chosen)" } else { "" },
                tflops(gate_ms),
                tflops(down_ms),
                2.0 * gate_ms + down_ms
            );
            assert!(
                finite(&act) && finite(&out),
                "t {t} {height:?}: non-finite outputs"
            );
        }
    }
}
