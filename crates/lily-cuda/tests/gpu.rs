//! The CUDA backend against the CPU reference. These need a CUDA GPU: they are ignored by a plain
//! `cargo test` (which says so) and run on the H200 with `--include-ignored`
//! (tools/gpu-check.sh). Every comparison prints its measured error, so a run is a record.

mod support;

use lily_core::backend::{Backend, LogitRows};
use lily_core::choice::Choice;
use lily_core::config::ModelConfig;
use lily_core::model_ref::ModelRef;
use lily_core::rng::uniform_at;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synthetic::SyntheticSource;
use lily_core::weights::{Linear, ModelWeights};
use lily_cpu::CpuBackend;
use lily_cuda::CudaBackend;
use lily_cuda::KvPrecision;
use lily_cuda::compile::{ATTN_COMBINE_THREADS, MAX_ATTN_SPLITS, attn_splits};
use lily_cuda::gpu::{Gpu, RowInts, RowPtrs, Shape, ptr};
use lily_cuda::kernel_args::{AttnCombine, AttnSplit, GemvAdd};
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
/// 128, 256 experts top 8) at a small width, so every kernel runs at its production constants;
/// expert widths of whole quads of 256 inputs, so that the MoE takes the integer tensor cores as
/// the real model's does (step.rs, moe_imma_fits).
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
    t.insert("moe_intermediate_size".into(), 256.into());
    t.insert("shared_expert_intermediate_size".into(), 256.into());
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

/// The full-size synthetic model (issue 6's agreement check): the prompt and 32 greedy tokens all
/// through the decode step on the GPU (f32 KV, so the kernels are compared without the cache's
/// rounding), against the CPU's greedy tokens. The decode path's error at production shapes is
/// ~5e-6 of the largest logit, so a divergence is accepted only where the CPU's own top two are
/// closer than 1e-4 (a near-tie). Needs about 40 GB of host memory (the weights, then the CPU's).
#[test]
#[ignore = "needs a CUDA GPU"]
fn full_size_decode_gives_the_cpus_32_greedy_tokens() {
    const PROMPT: [u32; 8] = [9419, 11, 1814, 13, 576, 374, 264, 1296];
    const N: usize = 32;
    let (config, source) = ModelRef::parse("synthetic:qwen3.6-35b-a3b")
        .unwrap()
        .open()
        .unwrap();
    let weights = ModelWeights::load(&config, source).unwrap();
    let (gpu, cpu) = both(&config, weights, KvPrecision::F32);
    let mut gs = gpu.new_state(PROMPT.len() + N).unwrap();
    decode_all(&gpu, &mut gs, &PROMPT[..PROMPT.len() - 1]);
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let mut next = PROMPT[PROMPT.len() - 1];
    let ours: Vec<u32> = (0..N)
        .map(|_| {
            let pick = gpu.decode_choose(&mut gs, next, &mut Choice::of(&mut sampler));
            next = pick.unwrap().token;
            next
        })
        .collect();
    let reference = greedy(&cpu, &PROMPT, N);
    let parted = ours.iter().zip(&reference).position(|(a, b)| a != b);
    eprintln!("full-size decode, 32 greedy tokens: GPU {ours:?}, CPU {reference:?}");
    if let Some(i) = parted {
        let context: Vec<u32> = PROMPT.iter().chain(&reference[..i]).copied().collect();
        let mut cs = cpu.new_state(context.len()).unwrap();
        let logits = cpu.prefill(&mut cs, &context, LogitRows::Last).unwrap();
        let scale = logits.iter().fold(0f32, |m, x| m.max(x.abs()));
        let gap = (logits[reference[i] as usize] - logits[ours[i] as usize]) / scale;
        eprintln!("parted at token {i}: the CPU's gap between the two is {gap:e} of the largest");
        assert!(
            gap < 1e-4,
            "token {i}: GPU {} against CPU {}, gap {gap:e}",
            ours[i],
            reference[i]
        );
    }
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

/// Decode attention alone (attn_split, then attn_combine) at production head shapes against a
/// direct softmax over the same cache: fewer live splits than the grid has (short contexts),
/// ragged splits, and splits long enough that every warp streams many batches. The bf16 cache
/// holds bf16-rounded values, so both precisions compare against exactly the keys and values the
/// kernel reads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_attention_matches_a_direct_softmax() {
    let config = narrow(&FOUR_LAYERS, 16, 4);
    let (nh, nkv, hd) = (
        config.num_attention_heads,
        config.num_kv_heads,
        config.head_dim,
    );
    let group = nh / nkv;
    let bf16 = |x: f32| {
        let b = x.to_bits();
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    };
    for kv in [KvPrecision::F32, KvPrecision::Bf16] {
        let gpu = Gpu::new(&config, kv).expect(NEEDS_GPU);
        for (len, splits) in [
            (1usize, 64usize),
            // Around a live split's 64 positions (attn_live_splits): 1, 1, 2 and 3 live splits.
            (63, 64),
            (64, 64),
            (65, 64),
            (129, 64),
            (300, 274),
            (700, 3),
            (20_000, 80),
            // A 128K context as a 128K state splits it (512 splits, all live), and as many live
            // splits as the partial buffers hold (attn_combine's block has a thread for each).
            (131_072, attn_splits(131_072)),
            (70_000, MAX_ATTN_SPLITS),
        ] {
            let n = len * nkv * hd;
            let seed = len as u64 * 7 + splits as u64;
            // Values centred off zero, so a long context's output (near their mean) stays large.
            let mut k: Vec<f32> = (0..n).map(|i| 4.0 * uniform_at(seed, i as u64)).collect();
            let mut v: Vec<f32> = (0..n)
                .map(|i| 0.25 + uniform_at(seed + 1, i as u64))
                .collect();
            if kv == KvPrecision::Bf16 {
                for x in k.iter_mut().chain(v.iter_mut()) {
                    *x = f32::from_bits((bf16(*x) as u32) << 16);
                }
            }
            let q: Vec<f32> = (0..nh * hd)
                .map(|i| uniform_at(seed + 2, i as u64))
                .collect();
            // qkv as attn_combine reads it: per head [q | gate]; only the gates matter here.
            let qkv: Vec<f32> = (0..nh * 2 * hd)
                .map(|i| uniform_at(seed + 3, i as u64))
                .collect();
            let k16: Vec<u16> = k.iter().map(|&x| bf16(x)).collect();
            let v16: Vec<u16> = v.iter().map(|&x| bf16(x)).collect();
            let (kf, vf) = (gpu.upload(&k).unwrap(), gpu.upload(&v).unwrap());
            let (kb, vb) = (gpu.upload(&k16).unwrap(), gpu.upload(&v16).unwrap());
            let (pk, pv) = match kv {
                KvPrecision::F32 => (ptr(&kf, &gpu.stream), ptr(&vf, &gpu.stream)),
                KvPrecision::Bf16 => (ptr(&kb, &gpu.stream), ptr(&vb, &gpu.stream)),
            };
            let shape = (nh, nkv, hd);
            let out = run_attention(&gpu, shape, &q, pk, pv, &qkv, len, splits);
            check_attention(&out, &q, &k, &v, &qkv, len, group, hd, kv, splits);
        }
    }
}

/// attn_split over `splits` splits then attn_combine, for a cache of `len` positions.
#[allow(clippy::too_many_arguments)]
fn run_attention(
    gpu: &Gpu,
    (nh, nkv, hd): (usize, usize, usize),
    q: &[f32],
    k: u64,
    v: u64,
    qkv: &[f32],
    len: usize,
    splits: usize,
) -> Vec<f32> {
    let dq = gpu.upload(q).unwrap();
    let dqkv = gpu.upload(qkv).unwrap();
    let pos = gpu.upload(&[len as i32 - 1]).unwrap();
    let part_ml = gpu.zeros::<f32>(nkv * splits * (nh / nkv) * 2).unwrap();
    let part_acc = gpu.zeros::<f32>(nkv * splits * (nh / nkv) * hd).unwrap();
    let out = gpu.zeros::<f32>(nh * hd).unwrap();
    let p = |b: &cudarc::driver::CudaSlice<f32>| ptr(b, &gpu.stream);
    let split_shape = Shape {
        grid: (nkv as u32, splits as u32, 1),
        block: 128,
    };
    // One row of a step: the sequence's cache, position and split count.
    let nsplit = RowInts::of([splits as i32]);
    let args = AttnSplit {
        q: p(&dq),
        k_cache: RowPtrs::of([k]),
        v_cache: RowPtrs::of([v]),
        pos: RowPtrs::of([ptr(&pos, &gpu.stream)]),
        nsplit,
        part_ml: p(&part_ml),
        part_acc: p(&part_acc),
    };
    gpu.launch("attn_split", split_shape, &args).unwrap();
    let combine_shape = Shape {
        grid: (nh as u32, 1, 1),
        block: ATTN_COMBINE_THREADS,
    };
    let args = AttnCombine {
        part_ml: p(&part_ml),
        part_acc: p(&part_acc),
        pos: RowPtrs::of([ptr(&pos, &gpu.stream)]),
        nsplit,
        qkv: p(&dqkv),
        out: p(&out),
    };
    gpu.launch("attn_combine", combine_shape, &args).unwrap();
    gpu.download(&out).unwrap()
}

/// Compares with softmax(q·K/√hd)·V · sigmoid(gate) per head, in f64.
#[allow(clippy::too_many_arguments)]
fn check_attention(
    out: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    qkv: &[f32],
    len: usize,
    group: usize,
    hd: usize,
    kv: KvPrecision,
    splits: usize,
) {
    let nkv = k.len() / (len * hd);
    let mut want = vec![0f32; out.len()];
    for h in 0..out.len() / hd {
        let kh = h / group;
        let row = |c: &[f32], p: usize| c[(p * nkv + kh) * hd..][..hd].to_vec();
        let qh = &q[h * hd..][..hd];
        let scores: Vec<f64> = (0..len)
            .map(|p| {
                let kr = row(k, p);
                qh.iter()
                    .zip(&kr)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
        let sum: f64 = w.iter().sum();
        // Position by position, so a 128K context's values are read in order.
        let mut a = vec![0f64; hd];
        for (p, wp) in w.iter().enumerate() {
            for (ad, vd) in a.iter_mut().zip(&v[(p * nkv + kh) * hd..][..hd]) {
                *ad += wp * *vd as f64;
            }
        }
        for (d, ad) in a.iter().enumerate() {
            let gate = qkv[h * 2 * hd + hd + d] as f64;
            want[h * hd + d] = (ad / sum / (1.0 + (-gate).exp())) as f32;
        }
    }
    let d = rel_diff(out, &want);
    eprintln!("attention alone, {kv:?} KV, context {len}, {splits} splits: max rel diff {d:e}");
    assert!(
        d <= tolerance(KvPrecision::F32),
        "{kv:?} context {len}, {splits} splits: {d:e}"
    );
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
            let mut mats_arg = [MatArg::default(); 4];
            for (a, m) in mats_arg.iter_mut().zip(&dev) {
                *a = m.arg(&gpu);
            }
            let args = GemvAdd {
                mats: mats_arg,
                x: ptr(&dx, &gpu.stream),
                y: ptr(&dy, &gpu.stream),
            };
            gpu.launch(&format!("gemv_b{bits}"), gemv_shape(&shapes), &args)
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
