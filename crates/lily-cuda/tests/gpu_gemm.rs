//! The tensor-core GEMMs (kernels/gemm.cu, and kernels/gemm_wgmma.cu on sm_90) against CPU
//! products, on every GEMM path the GPU runs (`GemmPath`; the timed records are in
//! gpu_gemm_speed.rs). Needs a CUDA GPU: ignored by a plain `cargo test`, run on the H200 with
//! `--include-ignored` (tools/gpu-check.sh).
//!
//! Two references for every product: (a) x and the dequantised weight rounded to bf16 exactly as
//! the kernel rounds them, summed in f64, so only the kernel's f32 summation order differs: held
//! to 1e-5 of max |y|; (b) the exact f32 operands, printed to record what bf16 operands cost.
//! Every output buffer is prefilled with a marked NaN, and the cells the kernel must not write
//! are checked to keep it.

mod support;

use half::bf16;
use lily_core::rng::{mix64, uniform_at};
use lily_core::synthetic::synthetic_config;
use lily_core::weights::Linear;
use lily_cuda::KvPrecision;
use lily_cuda::gemm::{GemmX, gemm, gemm_stack};
use lily_cuda::gemm_grouped::{GateUp, gemm_gate_up, gemm_grouped};
use lily_cuda::gemm_wgmma::{GemmPath, takes};
use lily_cuda::gpu::{Gpu, ptr};
use lily_cuda::mat::DeviceMat;
use lily_cuda::moe_prefill::{MoeTile, TileMap, max_tiles, swiglu};
use support::{NEEDS_GPU, gemm_paths, random_linear_grouped};

/// `x` rounded to bf16 to nearest even (as the norm that writes a GEMM's bf16 X rounds it), on
/// the device: what `GemmX::bf16` points at.
fn upload_bf16(gpu: &Gpu, x: &[f32]) -> cudarc::driver::CudaSlice<u16> {
    let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    gpu.upload(&bits).unwrap()
}

/// Whether the products of `path` on `gpu` read `GemmX::bf16` where one is given: the wgmma
/// kernels, for the weights they take.
fn reads_bf16_x(gpu: &Gpu, path: GemmPath, w: &DeviceMat) -> bool {
    path == GemmPath::Wgmma && takes(&w.arg(gpu), w.bits)
}

/// The products with bf16 X rows (the _x16 kernels) against those with f32 X: the same bits in
/// every cell, written or not.
fn assert_same_bits(f32_x: &[f32], bf16_x: &[f32], what: &str) {
    let differ = f32_x
        .iter()
        .zip(bf16_x)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "bf16 X parts from f32 X: {what}");
}

/// A quiet NaN with a payload no arithmetic produces: a cell holding it was never written.
const SENTINEL: u32 = 0x7fc0_dead;

/// Every cell of `y` (rows of `ldy`) in rows `< m` and `columns` written, every other one still
/// holding the sentinel.
fn assert_written_only(
    y: &[f32],
    m: usize,
    ldy: usize,
    columns: std::ops::Range<usize>,
    what: &str,
) {
    for (i, v) in y.iter().enumerate() {
        let (r, col) = (i / ldy, i % ldy);
        let inside = r < m && columns.contains(&col);
        assert_eq!(
            v.to_bits() == SENTINEL,
            !inside,
            "{what}: cell ({r}, {col}) {}",
            if inside { "not written" } else { "overwritten" }
        );
    }
}

/// The summation-order tolerance of reference (a), as a fraction of max |y|. Products of bf16
/// values are exact in f32, so kernel and reference differ only by the rounding of the f32
/// partial sums, which the tensor cores truncate rather than round: one ulp (2⁻²³) of a partial
/// sum per mma, K/16 of them. An H200 measured at most 3e-6 at K = 2048.
const TOLERANCE: f64 = 1e-5;

fn gpu() -> Gpu {
    let config = synthetic_config("tiny").unwrap();
    Gpu::new(&config, KvPrecision::Bf16).expect(NEEDS_GPU)
}

/// The kernel file `path` runs `w` on at tile `height` (dense: 64-row): the wgmma path leaves
/// gemm_wgmma.cu's exceptions to gemm.cu.
fn kernel_file(gpu: &Gpu, path: GemmPath, w: &DeviceMat, height: MoeTile) -> &'static str {
    if path == GemmPath::Wgmma && height == MoeTile::Rows64 && takes(&w.arg(gpu), w.bits) {
        "gemm_wgmma.cu"
    } else {
        "gemm.cu"
    }
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

/// Runs one dense product into `y[r, col0 + j]` of a wider, taller buffer on each of `paths`
/// and returns each path's errors against references (a) and (b).
fn check_dense(
    gpu: &mut Gpu,
    c: &Dense,
    paths: &[GemmPath],
) -> Vec<(GemmPath, &'static str, f64, f64)> {
    let (m, n, k) = (c.m, c.n, c.k);
    let seed = (c.bits as u64) << 40 | (m as u64) << 20 | (n as u64) << 8 | k as u64;
    let l = random_linear_grouped(n, k, c.bits, c.group, seed);
    let w = DeviceMat::upload(gpu, &l).unwrap();
    let x: Vec<f32> = (0..m * k).map(|i| uniform_at(seed + 1, i as u64)).collect();
    let mut xbuf = vec![0f32; c.offset];
    xbuf.extend(&x);
    let dx = gpu.upload(&xbuf).unwrap();
    let dx16 = upload_bf16(gpu, &x);
    let rows = rows_to_check(m);
    let id = |r: usize| r;
    let zero = |_: usize| 0;
    let (wk, xk) = (kernel_weight(&l), bf16_round(&x));
    let want_a = reference(&rows, n, k, &id, &zero, &xk, &wk);
    let want_b = reference(&rows, n, k, &id, &zero, &x, &exact_weight(&l));
    // Three columns before the output, five after, one row below. Offset 1 puts the output's
    // column pairs on 8-byte boundaries (where ldy is even: the wgmma path's paired stores),
    // offset 0 off them.
    let (col0, ldy) = (3, n + 8);
    let ylen = c.offset + (m + 1) * ldy;
    let at = 4 * c.offset as u64;
    let mut results = Vec::new();
    for &path in paths {
        gpu.set_gemm_path(path).unwrap();
        let dy = gpu.upload(&vec![f32::from_bits(SENTINEL); ylen]).unwrap();
        let (xp, yp) = (ptr(&dx, &gpu.stream), ptr(&dy, &gpu.stream));
        gemm(gpu, &w, xp + at, m, yp + at, ldy, col0).unwrap();
        let y = gpu.download(&dy).unwrap();
        if reads_bf16_x(gpu, path, &w) {
            // X as bf16 rows (the _x16 kernels): the same products, to the bit, and the same
            // cells written.
            let dy16 = gpu.upload(&vec![f32::from_bits(SENTINEL); ylen]).unwrap();
            let x = GemmX {
                f32: xp + at,
                bf16: Some(ptr(&dx16, &gpu.stream)),
            };
            gemm(gpu, &w, x, m, ptr(&dy16, &gpu.stream) + at, ldy, col0).unwrap();
            let y16 = gpu.download(&dy16).unwrap();
            let what = format!("{}-bit m {m} n {n} k {k}", c.bits);
            assert_same_bits(&y, &y16, &what);
        }
        let y = &y[c.offset..];
        let what = format!("{path:?} {}-bit m {m} n {n} k {k}", c.bits);
        assert_written_only(y, m, ldy, col0..col0 + n, &what);
        let got: Vec<Vec<f32>> = rows
            .iter()
            .map(|&r| y[r * ldy + col0..r * ldy + col0 + n].to_vec())
            .collect();
        let file = kernel_file(gpu, path, &w, MoeTile::Rows64);
        results.push((path, file, rel_diff(&got, &want_a), rel_diff(&got, &want_b)));
    }
    results
}

/// Every format at ragged and tile-sized shapes; aligned and 4-byte-aligned pointers; on every
/// GEMM path.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_gemm_matches_bf16_products() {
    let mut gpu = gpu();
    let paths = gemm_paths(&gpu);
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
    // 4-bit weights in groups of 32 (two a wgmma step), and ones the wgmma path leaves to
    // gemm.cu: rows that end mid-step (K % 64 = 32; 544 also splits along K, the last split
    // ragged) or hold a number of groups that is not a multiple of 4.
    for (group, k) in [
        (32usize, 256usize),
        (32, 1024),
        (32, 32),
        (32, 96),
        (32, 544),
        (64, 384),
        (128, 640),
    ] {
        for m in [1usize, 65, 130] {
            for n in [72usize, 300] {
                cases.push(Dense {
                    bits: 4,
                    group,
                    m,
                    n,
                    k,
                    offset: m % 2,
                });
            }
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
        for (path, file, a, b) in check_dense(&mut gpu, c, &paths) {
            let what = format!(
                "{path:?} ({file}) {}-bit (group {}) m {} n {} k {} offset {}",
                c.bits, c.group, c.m, c.n, c.k, c.offset
            );
            eprintln!("gemm {what}: vs bf16 operands {a:.2e}, vs exact f32 operands {b:.2e}");
            if a > TOLERANCE {
                failures.push(format!("{what}: {a:e}"));
            }
        }
    }
    assert!(failures.is_empty(), "beyond {TOLERANCE:e}: {failures:#?}");
}

/// A mixer's input projections as one launch (`gemm_stack`): each weight's products in its own
/// columns, after the one before it, as [`gemm`] of each alone computes them (held to the same
/// bf16-operand reference), and no cell outside written; at ragged stacks whose parts end
/// mid-block, a one-row part, X rows that split along K and ones that do not, and on a stack whose
/// parts differ in format (which goes part by part).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_stack_of_weights_fills_each_weights_columns() {
    let mut gpu = gpu();
    let paths = gemm_paths(&gpu);
    // (rows of each part, K, bits of each part)
    let stacks: [(&[usize], usize, &[u32]); 5] = [
        (&[300, 72, 32, 32], 2048, &[4, 4, 4, 4]),
        (&[256, 32], 512, &[4, 4]),
        (&[40, 1, 33], 1024, &[4, 4, 4]),
        (&[512, 64, 64, 8], 768, &[4, 4, 4, 4]),
        (&[96, 32], 512, &[4, 8]),
    ];
    let mut failures = Vec::new();
    for (si, &(rows, k, bits)) in stacks.iter().enumerate() {
        let n: usize = rows.iter().sum();
        let parts: Vec<Linear> = rows
            .iter()
            .zip(bits)
            .enumerate()
            .map(|(i, (&r, &b))| {
                random_linear_grouped(r, k, b, 64, mix64(si as u64 * 16 + i as u64))
            })
            .collect();
        let mats: Vec<DeviceMat> = parts
            .iter()
            .map(|l| DeviceMat::upload(&gpu, l).unwrap())
            .collect();
        let wk: Vec<f32> = parts.iter().flat_map(kernel_weight).collect();
        for m in [1usize, 7, 33, 200, 1024] {
            let seed = mix64(si as u64) ^ m as u64;
            let x: Vec<f32> = (0..m * k).map(|i| uniform_at(seed, i as u64)).collect();
            let dx = gpu.upload(&x).unwrap();
            let dx16 = upload_bf16(&gpu, &x);
            let check = rows_to_check(m);
            let want = reference(&check, n, k, &|r| r, &|_| 0, &bf16_round(&x), &wk);
            let (col0, ldy) = (3, n + 8);
            for &path in &paths {
                gpu.set_gemm_path(path).unwrap();
                let dy = gpu
                    .upload(&vec![f32::from_bits(SENTINEL); (m + 1) * ldy])
                    .unwrap();
                let xs = GemmX {
                    f32: ptr(&dx, &gpu.stream),
                    bf16: Some(ptr(&dx16, &gpu.stream)),
                };
                let refs: Vec<&DeviceMat> = mats.iter().collect();
                gemm_stack(&gpu, &refs, xs, m, ptr(&dy, &gpu.stream), ldy, col0).unwrap();
                let y = gpu.download(&dy).unwrap();
                let what = format!("{path:?} stack {rows:?} of {bits:?}-bit, K {k}, m {m}");
                assert_written_only(&y, m, ldy, col0..col0 + n, &what);
                let got: Vec<Vec<f32>> = check
                    .iter()
                    .map(|&r| y[r * ldy + col0..r * ldy + col0 + n].to_vec())
                    .collect();
                let err = rel_diff(&got, &want);
                eprintln!("gemm_stack {what}: vs bf16 operands {err:.2e}");
                if err > TOLERANCE {
                    failures.push(format!("{what}: {err:e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "beyond {TOLERANCE:e}: {failures:#?}");
}

struct Grouped<'a> {
    bits: u32,
    group: usize,
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
    x: impl Into<GemmX>,
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
            "grouped {:?} {height:?} counts {:?}: cell ({}, {}) wrongly {}",
            gpu.gemm_path(),
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

/// Runs one grouped product at every tile height on each of `paths`; returns each path's and
/// height's errors against references (a) and (b), which depend on neither.
fn check_grouped(
    gpu: &mut Gpu,
    c: &Grouped,
    paths: &[GemmPath],
) -> Vec<(GemmPath, &'static str, MoeTile, f64, f64)> {
    let (n, k, experts) = (c.n, c.k, c.counts.len());
    let pairs: usize = c.counts.iter().sum();
    let seed = (c.bits as u64) << 40 | (pairs as u64) << 16 | n as u64;
    let l = random_linear_grouped(experts * n, k, c.bits, c.group, seed);
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
    let dx16 = upload_bf16(gpu, &x);
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
    let mut results = Vec::new();
    for &path in paths {
        gpu.set_gemm_path(path).unwrap();
        for height in MoeTile::ALL {
            let y = run_grouped(gpu, c, &w, ptr(&dx, &gpu.stream), gather_ptr, height);
            if height == MoeTile::Rows64 && reads_bf16_x(gpu, path, &w) {
                let x = GemmX {
                    f32: ptr(&dx, &gpu.stream),
                    bf16: Some(ptr(&dx16, &gpu.stream)),
                };
                check_gate_up_fused(gpu, c, &w, &dx16, gather_ptr);
                let y16 = run_grouped(gpu, c, &w, x, gather_ptr, height);
                let what = format!(
                    "{}-bit n {n} k {k} counts {:?} gather {:?}",
                    c.bits, c.counts, c.gather_tokens
                );
                assert_same_bits(&y, &y16, &what);
            }
            let got: Vec<Vec<f32>> = rows
                .iter()
                .map(|&s| y[s * n..(s + 1) * n].to_vec())
                .collect();
            results.push((
                path,
                kernel_file(gpu, path, &w, height),
                height,
                rel_diff(&got, &want_a),
                rel_diff(&got, &want_b),
            ));
        }
    }
    results
}

/// The fused gate, up and SwiGLU launch (`gemm_gate_up`) against the grouped GEMM of each and
/// `moe_swiglu`, on 64-row tiles of `c` with `gate` and a second weight of its shape as up: the
/// same act to the bit, in f32 and in bf16, and no slot past the tiles' written.
fn check_gate_up_fused(
    gpu: &Gpu,
    c: &Grouped,
    gate: &DeviceMat,
    x16: &cudarc::driver::CudaSlice<u16>,
    gather: u64,
) {
    let (n, k) = (c.n, c.k);
    let experts = c.counts.len();
    let pairs: usize = c.counts.iter().sum();
    let up = DeviceMat::upload(
        gpu,
        &random_linear_grouped(experts * n, k, c.bits, c.group, 0x5eed ^ (pairs * n) as u64),
    )
    .unwrap();
    assert!(GateUp { gate, up: &up, n }.fusable(gpu, MoeTile::Rows64));
    let x16p = ptr(x16, &gpu.stream);
    let x = GemmX {
        f32: 0,
        bf16: Some(x16p),
    };
    let g = run_grouped(gpu, c, gate, x, gather, MoeTile::Rows64);
    let u = run_grouped(gpu, c, &up, x, gather, MoeTile::Rows64);
    let (dg, du) = (gpu.upload(&g).unwrap(), gpu.upload(&u).unwrap());
    let want = gpu.zeros::<f32>(g.len()).unwrap();
    let want16 = gpu.zeros::<u16>(g.len()).unwrap();
    let s = &gpu.stream;
    let out = GemmX {
        f32: ptr(&want, s),
        bf16: Some(ptr(&want16, s)),
    };
    swiglu(gpu, ptr(&dg, s), ptr(&du, s), pairs * n, out).unwrap();
    let tiles = cut_tiles(c.counts, MoeTile::Rows64);
    let grid = max_tiles(pairs, experts, MoeTile::Rows64);
    let mut padded = tiles.clone();
    padded.resize(3 * grid, 0);
    let (dt, dn) = (
        gpu.upload(&padded).unwrap(),
        gpu.upload(&[(tiles.len() / 3) as i32]).unwrap(),
    );
    let map = TileMap {
        tiles: ptr(&dt, s),
        num_tiles: ptr(&dn, s),
        height: MoeTile::Rows64,
        max_tiles: grid,
    };
    let sentinel = vec![f32::from_bits(SENTINEL); (pairs + 1) * n];
    let act = gpu.upload(&sentinel).unwrap();
    let act16 = gpu.upload(&vec![0xdeadu16; (pairs + 1) * n]).unwrap();
    let w = GateUp { gate, up: &up, n };
    gemm_gate_up(gpu, w, x16p, gather, &map, ptr(&act, s), ptr(&act16, s)).unwrap();
    let (got, got16) = (gpu.download(&act).unwrap(), gpu.download(&act16).unwrap());
    let (want, want16) = (gpu.download(&want).unwrap(), gpu.download(&want16).unwrap());
    let what = format!(
        "fused gate/up n {n} k {k} counts {:?} gather {:?}",
        c.counts, c.gather_tokens
    );
    for i in 0..pairs * n {
        assert_eq!(got[i].to_bits(), want[i].to_bits(), "{what}: act[{i}]");
        assert_eq!(got16[i], want16[i], "{what}: act16[{i}]");
    }
    for i in pairs * n..(pairs + 1) * n {
        assert_eq!(
            got[i].to_bits(),
            SENTINEL,
            "{what}: act[{i}] past the slots"
        );
        assert_eq!(got16[i], 0xdead, "{what}: act16[{i}] past the slots");
    }
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
/// for the m of the list; then counts at and either side of both heights. On every GEMM
/// path.
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_gemm_matches_bf16_products() {
    let mut gpu = gpu();
    let paths = gemm_paths(&gpu);
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
            // Groups of 64, and of 32: 8 a row (for 4 bits, two a wgmma step) and 3 (K ending
            // mid-step, which the wgmma path leaves to gemm.cu).
            for (n, k, group) in [
                (192usize, 512usize, 64usize),
                (64, 2048, 64),
                (72, 48, 64),
                (300, 256, 32),
                (300, 96, 32),
            ] {
                if bits != 32 && k % group != 0 {
                    continue;
                }
                for gather_tokens in [None, Some(37)] {
                    let c = Grouped {
                        bits,
                        group,
                        n,
                        k,
                        counts,
                        gather_tokens,
                    };
                    for (path, file, height, a, b) in check_grouped(&mut gpu, &c, &paths) {
                        let what = format!(
                            "{path:?} ({file}) {bits}-bit {height:?} n {n} k {k} group {group} counts {counts:?} gather {gather_tokens:?}"
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
