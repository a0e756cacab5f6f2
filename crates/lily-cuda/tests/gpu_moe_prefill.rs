//! The prefill MoE kernels (routing, sort by expert, SwiGLU, combine) against CPU references.
//! These need a CUDA GPU: ignored by a plain `cargo test`, run on the H200 with
//! `--include-ignored`. Every comparison prints its measured error.

use cudarc::driver::CudaSlice;
use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use lily_core::rng::{Rng, mix64, uniform_at};
use lily_cuda::KvPrecision;
use lily_cuda::gemm::{GemmX, Parts};
use lily_cuda::gpu::{Gpu, ptr};
use lily_cuda::moe_prefill::{
    MoeTile, TileMap, combine, max_tiles, sort, sort_counts, swiglu, topk_rows,
};

const NEEDS_GPU: &str = "needs a CUDA GPU";

/// The production expert count (256, top 8, renormalised) and a small one (16, top 4, not
/// renormalised, so both NORM_TOPK branches run).
const ROUTINGS: [(usize, usize, bool); 2] = [(256, 8, true), (16, 4, false)];

/// Chunk lengths (tokens) the routing and sorting tests run: the list, from one token to
/// a whole default chunk.
const TOKENS: [usize; 7] = [1, 7, 16, 33, 200, 2048, 4096];

fn config(experts: usize, top_k: usize, norm: bool) -> ModelConfig {
    let mut c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
    c.num_experts = experts;
    c.experts_per_token = top_k;
    c.norm_topk_prob = norm;
    c
}

/// max |a − b| / max |b|, the reference in f64.
fn rel_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    assert!(scale > 0.0, "reference is all zeros");
    a.iter().zip(b).fold(0f64, |m, (&x, y)| {
        if x.is_nan() {
            f64::INFINITY
        } else {
            m.max((x as f64 - y).abs())
        }
    }) / scale
}

fn dev<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, data: &[T]) -> CudaSlice<T> {
    gpu.upload(data).unwrap()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Router logits [t, NE + 1] on a grid of 1/8 in [-4, 4]: 65 values over NE experts, so many
/// rows tie at the top-k boundary and the lowest-id rule decides, while distinct logits differ
/// by e^(1/8) in probability, far beyond `__expf`'s error, so the CPU and GPU must choose the
/// same ids exactly. Every fifth row is scaled by 4 (the max subtraction at larger logits) and
/// every seventh is one value throughout (a tie of all experts).
fn grid_logits(t: usize, ne: usize, seed: u64) -> Vec<f32> {
    let width = ne + 1;
    let mut logits: Vec<f32> = (0..t * width)
        .map(|i| (uniform_at(seed, i as u64) * 32.0).round() / 8.0)
        .collect();
    for (r, row) in logits.chunks_mut(width).enumerate() {
        if r % 5 == 3 {
            row.iter_mut().for_each(|v| *v *= 4.0);
        }
        if r % 7 == 5 {
            row[..ne].iter_mut().for_each(|v| *v = 0.5);
        }
    }
    logits
}

/// Runs moe_topk_rows; returns (ids, weights) as the host sees them.
fn gpu_route(gpu: &Gpu, logits: &[f32], t: usize, top_k: usize) -> (Vec<i32>, Vec<f32>) {
    let dl = dev(gpu, logits);
    let ids = gpu.zeros::<i32>(t * top_k).unwrap();
    let weights = gpu.zeros::<f32>(t * top_k).unwrap();
    let s = &gpu.stream;
    topk_rows(gpu, ptr(&dl, s), t, ptr(&ids, s), ptr(&weights, s)).unwrap();
    (gpu.download(&ids).unwrap(), gpu.download(&weights).unwrap())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn topk_rows_match_the_cpu_router_with_ties() {
    for (ne, top_k, norm) in ROUTINGS {
        let c = config(ne, top_k, norm);
        let gpu = Gpu::new(&c, KvPrecision::Bf16).expect(NEEDS_GPU);
        for t in TOKENS {
            let logits = grid_logits(t, ne, t as u64 + ne as u64);
            let (ids, weights) = gpu_route(&gpu, &logits, t, top_k);
            let (ids, weights) = (&ids[..t * top_k], &weights[..t * top_k]);
            let mut max_err = 0f32;
            let mut boundary_ties = 0;
            for (r, row) in logits.chunks(ne + 1).enumerate() {
                let want = lily_cpu::route(&c, &row[..ne]);
                let got: Vec<usize> = ids[r * top_k..(r + 1) * top_k]
                    .iter()
                    .map(|&i| i as usize)
                    .collect();
                assert_eq!(got, want.experts, "{ne} experts, t {t}, row {r}: ids");
                for (g, w) in weights[r * top_k..(r + 1) * top_k]
                    .iter()
                    .zip(&want.weights)
                {
                    max_err = max_err.max((g - w).abs());
                }
                // Rows where an unchosen expert ties with the last chosen one: the tie rule
                // decided the choice, so the test exercises it.
                let last = row[want.experts[top_k - 1]];
                if (0..ne).any(|e| row[e] == last && !want.experts.contains(&e)) {
                    boundary_ties += 1;
                }
            }
            eprintln!(
                "topk {ne} experts top {top_k}, t {t}: ids equal, weights max abs diff {max_err:e}, \
                 {boundary_ties} rows tie at the boundary"
            );
            if t >= 33 {
                assert!(boundary_ties > 0, "the test data has no boundary ties");
            }
            // Weights lie in [0, 1]. __expf is ex2.approx of x·log2(e): a few 1e-7 relative
            // error, plus the argument's rounding, |x|·2^-24 ≈ 1e-6 at |x| = 16; each weight is
            // a ratio of such values, so 1e-5 leaves room while still catching a wrong sum or
            // a missed renormalisation (those move weights by 1e-2 or more).
            assert!(max_err <= 1e-5, "{ne} experts, t {t}: weights {max_err:e}");
        }
    }
}

/// What `sort` produced, as the host sees it.
struct Sorted {
    gather: Vec<i32>,
    slot_of: Vec<i32>,
    tiles: Vec<i32>,
    num_tiles: i32,
}

/// Runs the sort of `gpu`'s route on `ids` at `height`; every output starts as a sentinel so
/// unwritten entries show.
fn gpu_sort(gpu: &Gpu, ids: &[i32], ne: usize, height: MoeTile) -> Sorted {
    let pairs = ids.len();
    let s = &gpu.stream;
    let counts = dev(gpu, &vec![-1i32; sort_counts(pairs, ne) + 1]);
    let d_ids = dev(gpu, &ids.iter().copied().chain([0]).collect::<Vec<_>>());
    let gather = dev(gpu, &vec![-1i32; pairs + 1]);
    let slot_of = dev(gpu, &vec![-1i32; pairs + 1]);
    let max = max_tiles(pairs, ne, height);
    let tile_ints = 3 * max;
    let tiles = dev(gpu, &vec![-1i32; tile_ints + 1]);
    let num_tiles = dev(gpu, &[-7i32]);
    let map = TileMap {
        tiles: ptr(&tiles, s),
        num_tiles: ptr(&num_tiles, s),
        height,
        max_tiles: max,
    };
    sort(
        gpu,
        ptr(&d_ids, s),
        pairs,
        ptr(&gather, s),
        ptr(&slot_of, s),
        ptr(&counts, s),
        &map,
    )
    .unwrap();
    let mut tiles = gpu.download(&tiles).unwrap();
    assert_eq!(tiles[tile_ints], -1, "wrote past the tile bound");
    tiles.truncate(tile_ints);
    Sorted {
        gather: gpu.download(&gather).unwrap()[..pairs].to_vec(),
        slot_of: gpu.download(&slot_of).unwrap()[..pairs].to_vec(),
        tiles,
        num_tiles: gpu.download(&num_tiles).unwrap()[0],
    }
}

/// Panics unless `out` is a sort of `ids` by expert with a valid tile map at `height`.
fn check_sort(ids: &[i32], ne: usize, top_k: usize, height: MoeTile, out: &Sorted, case: &str) {
    let h = height.rows();
    let pairs = ids.len();
    // slot_of is a permutation, and gather agrees with it.
    let mut pair_of = vec![usize::MAX; pairs];
    for (p, &s) in out.slot_of.iter().enumerate() {
        assert!(
            (0..pairs as i32).contains(&s),
            "{case}: pair {p} has slot {s}"
        );
        assert_eq!(
            pair_of[s as usize],
            usize::MAX,
            "{case}: slot {s} taken twice"
        );
        pair_of[s as usize] = p;
        assert_eq!(
            out.gather[s as usize],
            (p / top_k) as i32,
            "{case}: gather[{s}]"
        );
    }
    // Slots are in expert order.
    let expert_of: Vec<i32> = pair_of.iter().map(|&p| ids[p]).collect();
    assert!(
        expert_of.windows(2).all(|w| w[0] <= w[1]),
        "{case}: slots not sorted by expert"
    );
    // Tiles cover the slots in order, each within one expert, as many as ceil(count / h) per
    // expert (so only an expert's last tile is short).
    let mut counts = vec![0usize; ne];
    ids.iter().for_each(|&e| counts[e as usize] += 1);
    let want_tiles: usize = counts.iter().map(|c| c.div_ceil(h)).sum();
    assert_eq!(out.num_tiles as usize, want_tiles, "{case}: num_tiles");
    assert!(
        want_tiles <= max_tiles(pairs, ne, height),
        "{case}: max_tiles bound"
    );
    let mut tiles_of = vec![0usize; ne];
    let mut next = 0i32;
    for (i, tile) in out.tiles.chunks(3).take(want_tiles).enumerate() {
        let (e, first, rows) = (tile[0], tile[1], tile[2]);
        assert!((0..ne as i32).contains(&e), "{case}: tile {i} expert {e}");
        assert_eq!(
            first, next,
            "{case}: tile {i} does not start where the last ended"
        );
        assert!(
            rows >= 1 && rows as usize <= h,
            "{case}: tile {i} rows {rows}"
        );
        let slots = first as usize..(first + rows) as usize;
        assert!(
            expert_of[slots].iter().all(|&x| x == e),
            "{case}: tile {i} mixes experts"
        );
        tiles_of[e as usize] += 1;
        next = first + rows;
    }
    assert_eq!(
        next as usize, pairs,
        "{case}: tiles do not reach the last slot"
    );
    for (e, (&tiles, &count)) in tiles_of.iter().zip(&counts).enumerate() {
        assert_eq!(tiles, count.div_ceil(h), "{case}: expert {e} tiles");
    }
}

/// Expert ids for `pairs` pairs, uniform over the experts `pick` allows.
fn random_ids(pairs: usize, ne: usize, seed: u64, pick: impl Fn(u64) -> usize) -> Vec<i32> {
    (0..pairs)
        .map(|p| (pick(mix64(seed ^ mix64(p as u64))) % ne) as i32)
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sort_orders_pairs_by_expert_in_tiles() {
    for (ne, top_k, norm) in ROUTINGS {
        let gpu = Gpu::new(&config(ne, top_k, norm), KvPrecision::Bf16).expect(NEEDS_GPU);
        let mut cases: Vec<(String, Vec<i32>)> = Vec::new();
        for t in TOKENS {
            cases.push((
                format!("random t {t}"),
                random_ids(t * top_k, ne, t as u64, |x| x as usize),
            ));
        }
        // Every other expert empty, and a skew that leaves a few experts most of the pairs.
        cases.push((
            "even experts only".into(),
            random_ids(200 * top_k, ne, 1, |x| 2 * x as usize),
        ));
        cases.push((
            "skewed".into(),
            random_ids(1000 * top_k, ne, 2, |x| (x % 1000) as usize / 997 * 3),
        ));
        // Every pair on one expert: the kernel's largest chunk, a whole number of tiles and one
        // short of it.
        cases.push((
            "all on the last expert".into(),
            vec![ne as i32 - 1; 4096 * top_k],
        ));
        cases.push(("all on expert 0".into(), vec![0; 4095 * top_k]));
        // Counts at both tile heights and either side of them, shuffled.
        let counts = [
            (1, 63),
            (3, 64),
            (5, 65),
            (9, 1),
            (10, 15),
            (12, 16),
            (13, 17),
        ];
        let mut edges: Vec<i32> = counts
            .iter()
            .flat_map(|&(e, n)| std::iter::repeat_n(e, n))
            .collect();
        let mut rng = Rng::new(3);
        for i in (1..edges.len()).rev() {
            edges.swap(i, rng.next_u64() as usize % (i + 1));
        }
        cases.push(("tile edges".into(), edges));
        cases.push(("no pairs".into(), Vec::new()));
        for (case, ids) in cases {
            for height in MoeTile::ALL {
                let out = gpu_sort(&gpu, &ids, ne, height);
                let case = format!("{ne} experts, {height:?}, {case} ({} pairs)", ids.len());
                check_sort(&ids, ne, top_k, height, &out, &case);
                eprintln!("sort {case}: valid, {} tiles", out.num_tiles);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_matches_the_cpu() {
    let gpu = Gpu::new(&config(16, 4, true), KvPrecision::Bf16).expect(NEEDS_GPU);
    // 4,000,001 exceeds the launcher's 8,192 blocks of 256, so the grid stride runs too.
    for n in [1usize, 1000, 4_000_001] {
        let gate: Vec<f32> = (0..n).map(|i| 8.0 * uniform_at(11, i as u64)).collect();
        let up: Vec<f32> = (0..n).map(|i| 2.0 * uniform_at(12, i as u64)).collect();
        let act = gpu.zeros::<f32>(n).unwrap();
        let act16 = gpu.zeros::<u16>(n).unwrap();
        let (dg, du) = (dev(&gpu, &gate), dev(&gpu, &up));
        let s = &gpu.stream;
        let out = GemmX {
            f32: ptr(&act, s),
            bf16: Some(ptr(&act16, s)),
        };
        swiglu(&gpu, ptr(&dg, s), ptr(&du, s), n, out).unwrap();
        let got = gpu.download(&act).unwrap();
        // The bf16 copy is the f32 result rounded to nearest even, as the GEMMs round f32 X.
        let got16 = gpu.download(&act16).unwrap();
        let off = got
            .iter()
            .zip(&got16)
            .filter(|&(&v, &b)| half::bf16::from_f32(v).to_bits() != b)
            .count();
        assert_eq!(off, 0, "swiglu n {n}: bf16 copy not the f32 result rounded");
        let want: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| g as f64 * sigmoid(g as f64) * u as f64)
            .collect();
        let d = rel_diff(&got[..n], &want);
        eprintln!("swiglu n {n}: max rel diff {d:e}");
        // silu uses __expf (a few 1e-7 relative) and two f32 roundings; relative to the
        // largest output, 1e-6.
        assert!(d <= 1e-6, "swiglu n {n}: {d:e}");
    }
}

/// out[t, i] = Σ_k w[t, k] · down[slot[t, k], i] + σ(logits[t, NE]) · shared[t, i], in f64.
#[allow(clippy::too_many_arguments)]
fn combine_reference(
    down: &[f32],
    slot_of: &[i32],
    weights: &[f32],
    logits: &[f32],
    shared: &[f32],
    ne: usize,
    top_k: usize,
    h: usize,
) -> Vec<f64> {
    let t = shared.len() / h;
    let mut out = vec![0f64; t * h];
    for (r, row) in out.chunks_mut(h).enumerate() {
        let gate = sigmoid(logits[r * (ne + 1) + ne] as f64);
        for (i, o) in row.iter_mut().enumerate() {
            let routed: f64 = (0..top_k)
                .map(|k| {
                    let p = r * top_k + k;
                    weights[p] as f64 * down[slot_of[p] as usize * h + i] as f64
                })
                .sum();
            *o = routed + gate * shared[r * h + i] as f64;
        }
    }
    out
}

/// Runs moe_combine with the shared expert's rows in `shared.len() / (t·h)` parts one after
/// another (a split-K output, `Parts`); returns out [t, h].
#[allow(clippy::too_many_arguments)]
fn gpu_combine(
    gpu: &Gpu,
    down: &[f32],
    slot_of: &[i32],
    weights: &[f32],
    logits: &[f32],
    shared: &[f32],
    t: usize,
    h: usize,
) -> Vec<f32> {
    let s = &gpu.stream;
    let (dd, ds, dw) = (dev(gpu, down), dev(gpu, slot_of), dev(gpu, weights));
    let (dl, dsh) = (dev(gpu, logits), dev(gpu, shared));
    let out = gpu.zeros::<f32>(t * h).unwrap();
    combine(
        gpu,
        ptr(&dd, s),
        ptr(&ds, s),
        ptr(&dw, s),
        ptr(&dl, s),
        Parts {
            at: ptr(&dsh, s),
            count: shared.len() / (t * h),
            stride: t * h,
        },
        t,
        h,
        ptr(&out, s),
    )
    .unwrap();
    gpu.download(&out).unwrap()[..t * h].to_vec()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn combine_matches_the_cpu() {
    for (ne, top_k, norm) in ROUTINGS {
        let gpu = Gpu::new(&config(ne, top_k, norm), KvPrecision::Bf16).expect(NEEDS_GPU);
        for t in [1usize, 7, 200] {
            for h in [100usize, 2048] {
                let pairs = t * top_k;
                let seed = (t * 10_000 + h) as u64;
                // A random permutation of the slots, so every row of down is read once.
                let mut slot_of: Vec<i32> = (0..pairs as i32).collect();
                let mut rng = Rng::new(seed);
                for i in (1..pairs).rev() {
                    slot_of.swap(i, rng.next_u64() as usize % (i + 1));
                }
                let random = |key: u64, n: usize, scale: f32| -> Vec<f32> {
                    (0..n)
                        .map(|i| scale * uniform_at(seed ^ key, i as u64))
                        .collect()
                };
                let down = random(1, pairs * h, 1.0);
                let weights: Vec<f32> = random(2, pairs, 0.5).iter().map(|w| w + 0.5).collect();
                let logits = random(3, t * (ne + 1), 4.0);
                // The shared rows whole, and as three split-K parts the combine adds in order.
                for parts in [1usize, 3] {
                    let split: Vec<f32> = (0..parts as u64)
                        .flat_map(|k| random(4 + k, t * h, 1.0))
                        .collect();
                    let shared: Vec<f32> = (0..t * h)
                        .map(|i| (0..parts).fold(0f32, |a, k| a + split[k * t * h + i]))
                        .collect();
                    let got = gpu_combine(&gpu, &down, &slot_of, &weights, &logits, &split, t, h);
                    let want = combine_reference(
                        &down, &slot_of, &weights, &logits, &shared, ne, top_k, h,
                    );
                    let d = rel_diff(&got, &want);
                    eprintln!(
                        "combine {ne} experts top {top_k}, t {t}, h {h}, {parts} parts: max rel diff {d:e}"
                    );
                    // TOPK + 1 products summed in f32 (a few ulp) and the gate's __expf (a few
                    // 1e-7 relative): 1e-6 of the largest output.
                    assert!(
                        d <= 1e-6,
                        "combine {ne} experts, t {t}, h {h}, {parts} parts: {d:e}"
                    );
                }
            }
        }
    }
}

/// A stand-in for expert e's output row for token `tok`: any function of both will do, as long
/// as a slot holding the wrong expert or token shows.
fn expert_row(e: usize, tok: usize, h: usize) -> impl Iterator<Item = f32> {
    let key = mix64(((e as u64) << 32) | tok as u64);
    (0..h).map(move |i| uniform_at(key, i as u64))
}

/// Routing, sort and combine chained as prefill chains them, against the CPU router applied to
/// the same logits: the launchers' buffers agree on layout, at both tile heights.
#[test]
#[ignore = "needs a CUDA GPU"]
fn route_sort_combine_chain_matches_the_cpu_router() {
    let (ne, top_k, norm) = ROUTINGS[0];
    let c = config(ne, top_k, norm);
    let gpu = Gpu::new(&c, KvPrecision::Bf16).expect(NEEDS_GPU);
    let h = 256;
    for (t, height) in TOKENS
        .into_iter()
        .flat_map(|t| MoeTile::ALL.map(|height| (t, height)))
    {
        let logits = grid_logits(t, ne, 77 + t as u64);
        let (ids, weights) = gpu_route(&gpu, &logits, t, top_k);
        let (ids, weights) = (&ids[..t * top_k], &weights[..t * top_k]);
        let sorted = gpu_sort(&gpu, ids, ne, height);
        let case = format!("chain t {t} {height:?}");
        check_sort(ids, ne, top_k, height, &sorted, &case);
        // down in slot order, each slot's row computed from the expert its tile names and the
        // token gather names.
        let mut down = vec![0f32; t * top_k * h];
        for tile in sorted.tiles.chunks(3).take(sorted.num_tiles as usize) {
            let (e, first, rows) = (tile[0] as usize, tile[1] as usize, tile[2] as usize);
            for s in first..first + rows {
                let tok = sorted.gather[s] as usize;
                down[s * h..(s + 1) * h]
                    .iter_mut()
                    .zip(expert_row(e, tok, h))
                    .for_each(|(d, v)| *d = v);
            }
        }
        let shared: Vec<f32> = (0..t * h).map(|i| uniform_at(5, i as u64)).collect();
        let got = gpu_combine(
            &gpu,
            &down,
            &sorted.slot_of,
            weights,
            &logits,
            &shared,
            t,
            h,
        );
        let mut want = vec![0f64; t * h];
        for (tok, out) in want.chunks_mut(h).enumerate() {
            let row = &logits[tok * (ne + 1)..(tok + 1) * (ne + 1)];
            let route = lily_cpu::route(&c, &row[..ne]);
            let gate = sigmoid(row[ne] as f64);
            for (o, s) in out.iter_mut().zip(&shared[tok * h..]) {
                *o = gate * *s as f64;
            }
            for (&e, &w) in route.experts.iter().zip(&route.weights) {
                for (o, v) in out.iter_mut().zip(expert_row(e, tok, h)) {
                    *o += w as f64 * v as f64;
                }
            }
        }
        let d = rel_diff(&got, &want);
        eprintln!("route → sort → combine, {case}: max rel diff {d:e}");
        // The routing weights carry __expf's error (a few 1e-7, see the top-k test) into sums
        // of 8 rows of magnitude ≤ 1 and the sum's f32 rounding: 1e-5 of the largest output.
        assert!(d <= 1e-5, "{case}: {d:e}");
    }
}
