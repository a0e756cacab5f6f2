//! The prefill attention kernels (kernels/attention_prefill.cu) against a CPU reference written
//! here in f64: q/k RMSNorm and RoPE, the cache writes, and causal gated attention over a chunk
//! that follows earlier positions already in the cache, with every flash block shape the device
//! fits; and a timed record of the flash kernel at the production shape over growing contexts.
//! Needs a CUDA GPU; every comparison prints its measured error.

mod support;

use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::bf16;
use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use lily_core::rng::uniform_at;
use lily_cpu::ops::rms_norm_rows;
use lily_cuda::KvPrecision;
use lily_cuda::attention_prefill::{AttnBlock, AttnChunk, KEY_TILE, attend_with, prep_rows};
use lily_cuda::gemm::GemmX;
use lily_cuda::gpu::{Gpu, ptr};
use support::{NEEDS_GPU, time_ms};

/// Chunk lengths: one token, ragged query tiles, one full 128-row query tile at group 8 (16),
/// one full key tile (64), a key tile and one position (129: with pos0 0 the last tile holds a
/// single key), and long chunks whose K/V ring wraps many times.
const TOKENS: [usize; 8] = [1, 7, 16, 33, 64, 129, 200, 2048];
/// Positions already in the cache ahead of the chunk: none, a ragged key tile (100), and two
/// whole key tiles (the chunk starts a tile).
const STARTS: [usize; 3] = [0, 100, 2 * KEY_TILE];
/// Cache positions past the chunk, which the kernels must leave alone.
const SPARE: usize = 3;
/// What the spare positions hold; no kernel value is ever exactly this.
const SENTINEL: f32 = 1234.5;

/// The production model with its attention heads replaced.
fn config(nh: usize, nkv: usize, hd: usize) -> ModelConfig {
    let mut c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
    c.num_attention_heads = nh;
    c.num_kv_heads = nkv;
    c.head_dim = hd;
    c.rotary_dim = hd / 4;
    c
}

/// Errors of one case, each max |gpu − reference| / max |reference| per head vector (the worst
/// vector counts, so late queries whose outputs average many values are not hidden by early
/// ones): the prep kernel's, and the attention's with each block shape.
struct Measured {
    q: f64,
    k: f64,
    attention: Vec<AttentionMeasured>,
}

/// One flash block shape's errors and time in one case.
struct AttentionMeasured {
    block: AttnBlock,
    /// Against the f64 reference fed the kernel's own queries and cache contents, rounded to
    /// bf16 as the tensor cores take them.
    own: f64,
    /// Against the f64 reference fed the CPU's queries, keys and values.
    end_to_end: f64,
    /// Whether the output is bit for bit the first shape's: a warp computes its 16 rows the
    /// same way in every shape, so any difference is a race or a misplaced tile.
    same_as_first: bool,
    /// Wall time of a repeated launch (same inputs, same output), launch to sync.
    ms: f64,
}

/// Tolerances, as max |diff| / max |reference| per head vector.
/// - q and k: RoPE angles reach pos · inv_freq ≈ 2,200 rad, where one f32 ulp of the angle is
///   2.4e-4; the GPU's `powf` may differ from the CPU's by an ulp or two in inv_freq, which moves
///   the angle by about that much: 1e-3 (measured 6e-7: the bits agreed on the H200). The bf16
///   cache adds half a bf16 ulp (2⁻⁹ ≈ 2e-3) to k.
/// - Attention from the kernel's own inputs, rounded to bf16 as the tensor cores read them:
///   what remains is the bf16 rounding of the softmax weights P before P·V (each off by up to
///   2⁻⁹ relatively, while their sum is taken in f32), noise of ~1e-3 of a vector's size per
///   element; the worst of up to 10⁵ vectors, in heads of 16 dims whose largest element is
///   close to their typical one, measured 7.7e-3 (3e-3 at head dim 256): 2e-2.
/// - End to end, against unrounded f32 queries, keys and values: Q and K (and V) carry 8
///   significant bits on the tensor cores whatever the cache stores. Scores, which the norm
///   weights here make several units large, move by up to ~1e-2, and the softmax weights by as
///   much relatively; measured up to 3.6e-2 at head dim 16 (2e-2 at 256): 8e-2. The precise
///   checks are the ones above; this one catches a mismatch between them and the CPU's math.
const Q_TOL: f64 = 1e-3;
const OWN_TOL: f64 = 2e-2;
const END_TO_END_TOL: f64 = 8e-2;

fn k_tol(kv: KvPrecision) -> f64 {
    match kv {
        KvPrecision::F32 => 1e-3,
        KvPrecision::Bf16 => 5e-3,
    }
}

/// Worst per-vector relative difference over vectors of `n` elements.
fn vector_diff(got: &[f32], want: &[f64], n: usize) -> f64 {
    assert_eq!(got.len(), want.len());
    got.chunks(n)
        .zip(want.chunks(n))
        .map(|(g, w)| {
            let scale = w.iter().fold(0f64, |m, x| m.max(x.abs()));
            assert!(scale > 0.0, "reference vector is all zeros");
            g.iter().zip(w).fold(0f64, |m, (&x, &y)| {
                if x.is_finite() {
                    m.max((x as f64 - y).abs() / scale)
                } else {
                    f64::INFINITY
                }
            })
        })
        .fold(0f64, f64::max)
}

/// The KV cache on the device in the kernels' element type.
enum Cache {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl Cache {
    fn upload(gpu: &Gpu, values: &[f32]) -> Cache {
        match gpu.kv {
            KvPrecision::F32 => Cache::F32(gpu.upload(values).unwrap()),
            KvPrecision::Bf16 => {
                let bits: Vec<u16> = values
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_bits())
                    .collect();
                Cache::Bf16(gpu.upload(&bits).unwrap())
            }
        }
    }

    fn ptr(&self, gpu: &Gpu) -> u64 {
        match self {
            Cache::F32(b) => ptr(b, &gpu.stream),
            Cache::Bf16(b) => ptr(b, &gpu.stream),
        }
    }

    fn download(&self, gpu: &Gpu) -> Vec<f32> {
        match self {
            Cache::F32(b) => gpu.download(b).unwrap(),
            Cache::Bf16(b) => gpu
                .download(b)
                .unwrap()
                .into_iter()
                .map(|v| bf16::from_bits(v).to_f32())
                .collect(),
        }
    }
}

/// What the cache holds for a value `v` written by a kernel.
fn stored(kv: KvPrecision, v: f32) -> f32 {
    match kv {
        KvPrecision::F32 => v,
        KvPrecision::Bf16 => bf16::from_f32(v).to_f32(),
    }
}

/// The values rounded to bf16, as the tensor cores take them.
fn to_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// Rotate-half RoPE on the first `rot` dims, as lily-cpu computes it (f32 angles).
fn rope(head: &mut [f32], rot: usize, theta: f32, pos: usize) {
    let half = rot / 2;
    for i in 0..half {
        let inv_freq = 1.0 / theta.powf((2 * i) as f32 / rot as f32);
        let (sin, cos) = (pos as f32 * inv_freq).sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = b * cos + a * sin;
    }
}

/// Causal gated attention in f64: `q` [t, nh·hd] at positions pos0.., caches [positions, nkv·hd]
/// (at least pos0 + t), `gate` [t, nh·hd]. Parallel over tokens.
fn attention_ref(
    c: &ModelConfig,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    gate: &[f32],
    pos0: usize,
) -> Vec<f64> {
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
    let group = nh / nkv;
    let t = q.len() / (nh * hd);
    let mut out = vec![0f64; t * nh * hd];
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let rows_per = t.div_ceil(threads);
    std::thread::scope(|s| {
        for (chunk, o) in out.chunks_mut(rows_per * nh * hd).enumerate() {
            s.spawn(move || {
                for (i, o) in o.chunks_mut(hd).enumerate() {
                    let (row, h) = (chunk * rows_per + i / nh, i % nh);
                    let kvh = h / group;
                    let qh = &q[(row * nh + h) * hd..][..hd];
                    let at = |p: usize| (p * nkv + kvh) * hd;
                    let scores: Vec<f64> = (0..=pos0 + row)
                        .map(|p| {
                            let k = &kc[at(p)..][..hd];
                            qh.iter()
                                .zip(k)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = weights.iter().sum();
                    for (p, w) in weights.iter().enumerate() {
                        let v = &vc[at(p)..][..hd];
                        o.iter_mut()
                            .zip(v)
                            .for_each(|(o, &v)| *o += w / sum * v as f64);
                    }
                    let g = &gate[(row * nh + h) * hd..][..hd];
                    o.iter_mut()
                        .zip(g)
                        .for_each(|(o, &g)| *o /= 1.0 + (-(g as f64)).exp());
                }
            });
        }
    });
    out
}

/// The flash block shapes the device has the shared memory for (`Gpu::new` raised their limit).
fn fitting_blocks(gpu: &Gpu, c: &ModelConfig) -> Vec<AttnBlock> {
    AttnBlock::ALL
        .into_iter()
        .filter(|b| b.shared_bytes(c) <= gpu.shared_optin)
        .collect()
}

/// One chunk of `t` tokens after `pos0` cached positions; `ld` pads the projection rows.
fn run_case(gpu: &Gpu, c: &ModelConfig, t: usize, pos0: usize, pad: usize, seed: u64) -> Measured {
    let (nh, nkv, hd, rot) = (
        c.num_attention_heads,
        c.num_kv_heads,
        c.head_dim,
        c.rotary_dim,
    );
    let (qw, kw) = (nh * hd, nkv * hd);
    let ld = 2 * qw + 2 * kw + pad;
    let random = |key: u64, n: usize, lo: f32, hi: f32| -> Vec<f32> {
        (0..n)
            .map(|i| lo + (hi - lo) * (uniform_at(seed ^ key, i as u64) + 1.0) / 2.0)
            .collect()
    };
    let qkv = random(1, t * ld, -2.0, 2.0);
    // Norm weights well above 1 make scores of several units: a peaked softmax, so the
    // running max matters.
    let q_norm = random(2, hd, 0.5, 2.5);
    let k_norm = random(3, hd, 0.5, 2.5);
    let positions = pos0 + t + SPARE;
    // Earlier positions hold random keys and values of the size normed keys have; the spare
    // ones past the chunk a sentinel.
    let mut k_init = random(4, positions * kw, -2.0, 2.0);
    let mut v_init = random(5, positions * kw, -2.0, 2.0);
    k_init[(pos0 + t) * kw..].fill(SENTINEL);
    v_init[(pos0 + t) * kw..].fill(SENTINEL);

    // The CPU's queries, keys, values and gates of the chunk.
    let (mut q, mut gate, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for row in qkv.chunks(ld) {
        for h in 0..nh {
            q.extend_from_slice(&row[h * 2 * hd..][..hd]);
            gate.extend_from_slice(&row[h * 2 * hd + hd..][..hd]);
        }
        k.extend_from_slice(&row[2 * qw..][..kw]);
        v.extend_from_slice(&row[2 * qw + kw..][..kw]);
    }
    rms_norm_rows(&mut q, &q_norm, c.rms_norm_eps);
    rms_norm_rows(&mut k, &k_norm, c.rms_norm_eps);
    let theta = c.rope_theta as f32;
    for (i, head) in q.chunks_mut(hd).enumerate() {
        rope(head, rot, theta, pos0 + i / nh);
    }
    for (i, head) in k.chunks_mut(hd).enumerate() {
        rope(head, rot, theta, pos0 + i / nkv);
    }

    let d_qkv = gpu.upload(&qkv).unwrap();
    let d_qn = gpu.upload(&q_norm).unwrap();
    let d_kn = gpu.upload(&k_norm).unwrap();
    let d_q = gpu.zeros::<f32>(t * qw).unwrap();
    let kc = Cache::upload(gpu, &k_init);
    let vc = Cache::upload(gpu, &v_init);
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let mut chunk = AttnChunk {
        tokens: t,
        pos0,
        qkv: p(&d_qkv),
        ld,
        q: p(&d_q),
        k_cache: kc.ptr(gpu),
        v_cache: vc.ptr(gpu),
        out: 0.into(),
    };
    prep_rows(gpu, c, &chunk, p(&d_qn), p(&d_kn)).unwrap();
    // Each shape writes into NaNs, so a row it skips reads as an infinite error.
    let mut outs = Vec::new();
    for block in fitting_blocks(gpu, c) {
        let d_out = gpu.upload(&vec![f32::NAN; t * qw]).unwrap();
        let d_out16 = gpu.zeros::<u16>(t * qw).unwrap();
        chunk.out = GemmX {
            f32: p(&d_out),
            bf16: Some(ptr(&d_out16, &gpu.stream)),
        };
        attend_with(gpu, c, &chunk, block).unwrap();
        gpu.sync().unwrap();
        let out = gpu.download(&d_out).unwrap();
        // The bf16 copy (the output projection's X) is the f32 output rounded to nearest even.
        let out16 = gpu.download(&d_out16).unwrap();
        let off = out
            .iter()
            .zip(&out16)
            .filter(|&(&v, &b)| bf16::from_f32(v).to_bits() != b)
            .count();
        assert_eq!(off, 0, "{block:?}: bf16 output not the f32 output rounded");
        let start = Instant::now();
        attend_with(gpu, c, &chunk, block).unwrap();
        gpu.sync().unwrap();
        outs.push((block, out, start.elapsed().as_secs_f64() * 1e3));
    }
    let q_gpu = gpu.download(&d_q).unwrap();
    let k_gpu = kc.download(gpu);
    let v_gpu = vc.download(gpu);

    let kv = gpu.kv;
    let chunk_at = pos0 * kw..(pos0 + t) * kw;
    // Positions before and after the chunk are untouched; values are copied (and rounded)
    // exactly.
    for (name, got, init) in [("k", &k_gpu, &k_init), ("v", &v_gpu, &v_init)] {
        for i in (0..chunk_at.start).chain(chunk_at.end..positions * kw) {
            assert_eq!(
                got[i],
                stored(kv, init[i]),
                "{name} cache element {i} changed"
            );
        }
    }
    for (i, (&got, &want)) in v_gpu[chunk_at.clone()].iter().zip(&v).enumerate() {
        assert_eq!(got, stored(kv, want), "v cache element {i} of the chunk");
    }
    let widen = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let own_ref = attention_ref(
        c,
        &to_bf16(&q_gpu),
        &to_bf16(&k_gpu),
        &to_bf16(&v_gpu),
        &gate,
        pos0,
    );
    let end_to_end_ref = {
        let mut k_all = k_init.clone();
        let mut v_all = v_init.clone();
        k_all[chunk_at.clone()].copy_from_slice(&k);
        v_all[chunk_at.clone()].copy_from_slice(&v);
        // The earlier positions as the cache holds them, so only the chunk's own rounding
        // and RoPE differences remain.
        for x in k_all[..pos0 * kw]
            .iter_mut()
            .chain(v_all[..pos0 * kw].iter_mut())
        {
            *x = stored(kv, *x);
        }
        attention_ref(c, &q, &k_all, &v_all, &gate, pos0)
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let first = bits(&outs[0].1);
    Measured {
        q: vector_diff(&q_gpu, &widen(&q), hd),
        k: vector_diff(&k_gpu[chunk_at], &widen(&k), hd),
        attention: outs
            .iter()
            .map(|(block, out, ms)| AttentionMeasured {
                block: *block,
                own: vector_diff(out, &own_ref, hd),
                end_to_end: vector_diff(out, &end_to_end_ref, hd),
                same_as_first: bits(out) == first,
                ms: *ms,
            })
            .collect(),
    }
}

fn check_shape(nh: usize, nkv: usize, hd: usize, pad: usize) {
    let c = config(nh, nkv, hd);
    for kv in [KvPrecision::F32, KvPrecision::Bf16] {
        let gpu = Gpu::new(&c, kv).expect(NEEDS_GPU);
        assert!(
            !fitting_blocks(&gpu, &c).is_empty(),
            "no flash block shape fits"
        );
        for pos0 in STARTS {
            for t in TOKENS {
                let e = run_case(&gpu, &c, t, pos0, pad, (t * 31 + pos0) as u64);
                eprintln!(
                    "NH {nh} NKV {nkv} HD {hd}, {kv:?} KV, {t} tokens after {pos0}: q {:.1e}, k {:.1e}",
                    e.q, e.k
                );
                let what = format!("NH {nh} NKV {nkv} HD {hd} {kv:?} t {t} pos0 {pos0}");
                assert!(e.q <= Q_TOL, "{what}: q {:e}", e.q);
                assert!(e.k <= k_tol(kv), "{what}: k {:e}", e.k);
                for a in &e.attention {
                    let (rows, slots) = (a.block.rows, a.block.slots);
                    eprintln!(
                        "    {rows} rows, {slots} slots: attention from its own inputs {:.1e}, \
                         end to end {:.1e}, same bits as the first shape: {}; {:.3} ms",
                        a.own, a.end_to_end, a.same_as_first, a.ms
                    );
                    let what = format!("{what}, {rows} rows, {slots} slots");
                    assert!(a.own <= OWN_TOL, "{what}: attention {:e}", a.own);
                    assert!(
                        a.end_to_end <= END_TO_END_TOL,
                        "{what}: end to end {:e}",
                        a.end_to_end
                    );
                    assert!(a.same_as_first, "{what}: differs from the first shape");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_attention_matches_the_cpu_at_production_shapes() {
    // GQA group 8, head dim 256, 64 rotary dims; projection rows packed as prefill.rs does.
    check_shape(16, 2, 256, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_attention_matches_the_cpu_at_small_shapes() {
    // Head dims of tiny models, groups of 3, 1 and 5 (not dividing the query tile), and padded
    // projection rows of an odd stride.
    check_shape(6, 2, 16, 3);
    check_shape(2, 2, 64, 0);
    check_shape(5, 1, 32, 5);
}

/// Causal attention FLOPs of a chunk of `t` tokens after `pos0` cached positions: each query of
/// each head scores and averages the `pos0 + i + 1` positions it sees (2 · HD flops each).
fn causal_flops(c: &ModelConfig, t: usize, pos0: usize) -> f64 {
    let seen = (t * pos0 + t * (t + 1) / 2) as f64;
    4.0 * (c.num_attention_heads * c.head_dim) as f64 * seen
}

/// Timed record (asserts only finite outputs): the flash kernel alone, production heads, a
/// 4,096-token chunk after 0 to 60K cached positions of random bf16 keys and values, every block
/// shape the device fits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_attention_speed_by_context() {
    const T: usize = 4096;
    let c = config(16, 2, 256);
    let gpu = Gpu::new(&c, KvPrecision::Bf16).expect(NEEDS_GPU);
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
    let (qw, kw) = (nh * hd, nkv * hd);
    let ld = 2 * qw + 2 * kw;
    let random = |key: u64, n: usize| -> Vec<f32> {
        (0..n).map(|i| 2.0 * uniform_at(key, i as u64)).collect()
    };
    let q = gpu.upload(&random(1, T * qw)).unwrap();
    let qkv = gpu.upload(&random(2, T * ld)).unwrap();
    let out = gpu.zeros::<f32>(T * qw).unwrap();
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    for pos0 in [0, 4096, 12_288, 28_672, 61_440] {
        let positions = pos0 + T;
        let bits = |key: u64| -> Vec<u16> {
            (0..positions * kw)
                .map(|i| bf16::from_f32(2.0 * uniform_at(key, i as u64)).to_bits())
                .collect()
        };
        let k_cache = gpu.upload(&bits(3)).unwrap();
        let v_cache = gpu.upload(&bits(4)).unwrap();
        let chunk = AttnChunk {
            tokens: T,
            pos0,
            qkv: p(&qkv),
            ld,
            q: p(&q),
            k_cache: ptr(&k_cache, &gpu.stream),
            v_cache: ptr(&v_cache, &gpu.stream),
            out: p(&out).into(),
        };
        let flops = causal_flops(&c, T, pos0);
        for block in fitting_blocks(&gpu, &c) {
            let ms = time_ms(&gpu, &|| attend_with(&gpu, &c, &chunk, block).unwrap());
            let got = gpu.download(&out).unwrap();
            assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
            eprintln!(
                "{T} tokens after {pos0:>6}: {} rows, {} slots: {ms:.3} ms, {:.1} TFLOP/s",
                block.rows,
                block.slots,
                flops / ms / 1e9
            );
        }
    }
}
