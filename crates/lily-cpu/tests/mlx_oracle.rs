//! The CPU backend on a checkpoint converted by mlx-lm (tests/fixtures/tiny-mlx-q4, made by
//! tools/make_mlx_fixtures.py) against mlx-lm's own f32 logits and greedy tokens on it.

use lily_core::backend::{Backend, LogitRows};
use lily_core::generate::prefill;
use lily_core::model_ref::ModelRef;
use lily_core::npy;
use lily_core::weights::Linear;
use lily_cpu::{CpuBackend, InputParts, Numerics};

mod support;
use support::*;

#[test]
fn the_mlx_checkpoint_loads_quantised_as_mlx_lm_stores_it() {
    let backend = load("tiny-mlx-q4");
    let w = backend.weights();
    let bits = |l: &Linear| match l {
        Linear::Affine(q) => (q.bits(), q.group_size()),
        Linear::Dense(_) => panic!("a dense weight in an MLX 4-bit checkpoint"),
    };
    assert_eq!(bits(&w.embed_tokens), (4, 64));
    assert_eq!(bits(&w.lm_head), (4, 64));
    for layer in &w.layers {
        assert_eq!(bits(&layer.moe.router), (8, 64));
        assert_eq!(bits(&layer.moe.shared_expert_gate), (8, 64));
        assert_eq!(bits(&layer.moe.experts[3].down_proj), (4, 64));
        // mlx-lm stores bf16(1 + w): multipliers near one, not near zero.
        let mean = layer.input_norm.iter().sum::<f32>() / layer.input_norm.len() as f32;
        assert!((mean - 1.0).abs() < 0.1, "input norm mean {mean}");
    }
}

#[test]
fn logits_match_mlx_lm() {
    let c = cases("tiny-mlx-q4");
    for chunk in [512, 37] {
        let backend = load("tiny-mlx-q4").with_max_prefill_chunk(chunk);
        for seq in c["sequences"].as_array().unwrap() {
            let tokens = ids(&seq["tokens"]);
            let file = fixture_dir("tiny-mlx-q4").join(seq["logits"].as_str().unwrap());
            let (shape, reference) = npy::read_f32(&file).unwrap();
            assert_eq!(shape, [tokens.len(), backend.config().vocab_size]);
            let mut state = backend.new_state(tokens.len()).unwrap();
            let logits = prefill(&backend, &mut state, &tokens, LogitRows::All).unwrap();
            let d = rel_diff(&logits, &reference);
            // The bar is 1e-3; an f32 engine on the same codes lands near 1e-6.
            assert!(
                d <= 1e-5,
                "{} chunk {chunk}: relative diff {d:e}",
                seq["name"]
            );
        }
    }
}

#[test]
fn greedy_tokens_match_mlx_lm() {
    let backend = load("tiny-mlx-q4");
    for case in cases("tiny-mlx-q4")["greedy"].as_array().unwrap() {
        let (prompt, expected) = (ids(&case["prompt"]), ids(&case["generated"]));
        assert_eq!(greedy(&backend, &prompt, expected.len()), expected);
    }
}

/// `--quantize q4` on the bf16 source gives the weights mlx-lm converted: the same logits, bit
/// for bit, as loading the converted directory.
#[test]
fn quantising_at_load_equals_loading_mlx_lms_conversion() {
    let dir = ModelRef::Dir(fixture_dir("tiny-mlx-hf"));
    let (config, weights) = lily_core::load::load_weights(&dir, true, |s, _| s).unwrap();
    let at_load = CpuBackend::new(config, weights);
    let converted = load("tiny-mlx-q4");
    let tokens = ids(&cases("tiny-mlx-q4")["sequences"][1]["tokens"]);
    let run = |b: &CpuBackend| {
        let mut state = b.new_state(tokens.len()).unwrap();
        prefill(b, &mut state, &tokens, LogitRows::All).unwrap()
    };
    let (a, b) = (run(&at_load), run(&converted));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(b.iter().any(|v| *v != 0.0));
}

/// What rounding every quantised product's input to int8 parts costs (`LILY_CPU_NUMERICS=int8`
/// and `int8x2`), teacher-forced on mlx-lm's sequences: the logits' distance from mlx-lm's beside
/// the f32 path's, and how often each picks the f32 path's top token. The figures go to
/// BENCHMARKS.md.
#[test]
fn int8_inputs_stay_near_mlx_lm_teacher_forced() {
    if !lily_cpu::quant::int8_available() {
        eprintln!("NOT RUN: this CPU has neither AVX2 nor AVX-512 VNNI: no int8 kernel runs here");
        return;
    }
    let f32_path = load("tiny-mlx-q4");
    let vocab = f32_path.config().vocab_size;
    let argmax =
        |row: &[f32]| (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best });
    // Measured on 2026-12-05, "short" (9 positions) and "long" (100): one part 2.1e-1 and 9.3e-2
    // (median positions 2.5e-2 and 8.6e-3), 9/9 and 98/100 top tokens; two parts 1.4e-4 and
    // 1.2e-4 (8.6e-5, 6.7e-5), 9/9 and 100/100. With the exact sum in the bias term instead of
    // the rounded inputs' (int8.rs says why), one part gave 6.0e-2 and 1.7e-1 (3.7e-2, 2.7e-2),
    // 7/9 and 94/100; two parts 4.4e-4 and 4.0e-4. A broken kernel gives noise.
    for (parts, at_most, same_top_at_least) in
        [(InputParts::One, 0.3, 0.9), (InputParts::Two, 1e-3, 1.0)]
    {
        let rounded_path = load("tiny-mlx-q4").with_numerics(Numerics::Int8Inputs(parts));
        for seq in cases("tiny-mlx-q4")["sequences"].as_array().unwrap() {
            let tokens = ids(&seq["tokens"]);
            let file = fixture_dir("tiny-mlx-q4").join(seq["logits"].as_str().unwrap());
            let (_, reference) = npy::read_f32(&file).unwrap();
            let run = |b: &CpuBackend| {
                let mut state = b.new_state(tokens.len()).unwrap();
                prefill(b, &mut state, &tokens, LogitRows::All).unwrap()
            };
            let (exact, rounded) = (run(&f32_path), run(&rounded_path));
            let same_top = exact
                .chunks(vocab)
                .zip(rounded.chunks(vocab))
                .filter(|(a, b)| argmax(a) == argmax(b))
                .count();
            let (d_exact, d_rounded) =
                (rel_diff(&exact, &reference), rel_diff(&rounded, &reference));
            // The median position too: one position whose router flips sets the largest.
            let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
            let mut at: Vec<f32> = rounded
                .chunks(vocab)
                .zip(reference.chunks(vocab))
                .map(|(a, b)| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale)
                .collect();
            at.sort_by(f32::total_cmp);
            eprintln!(
                "{parts:?} {}: {} positions; from mlx-lm f32 {d_exact:.1e}, int8 {d_rounded:.1e} \
                 (median position {:.1e}); same top token {same_top}/{}",
                seq["name"],
                tokens.len(),
                at[at.len() / 2],
                tokens.len()
            );
            assert!(d_rounded > 10.0 * d_exact, "the int8 path did not round");
            assert!(d_rounded < at_most, "{parts:?}: {d_rounded:e}");
            assert!(
                same_top as f64 >= same_top_at_least * tokens.len() as f64,
                "{parts:?}: {same_top}/{}",
                tokens.len()
            );
        }
    }
}
