//! The CPU's numerics in the whole model: f32 by default, and the bf16 mode rounding in prefill
//! only, with decode steps in f32 as the CUDA decode computes them.

mod support;

use lily_core::backend::{Backend, LogitRows};
use lily_cpu::{KvPrecision, Numerics};
use support::{load, rel_diff};

fn prompt(n: u32, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| (i * 7919 + 11) % vocab as u32).collect()
}

/// Asking for f32 numerics and an f32 cache is asking for what `new` gives, to the bit.
#[test]
fn f32_numerics_and_cache_are_the_default() {
    for name in ["tiny-a", "tiny-mlx-q4"] {
        let default = load(name);
        let explicit = load(name)
            .with_numerics(Numerics::F32)
            .with_kv_precision(KvPrecision::F32);
        let tokens = prompt(40, default.config().vocab_size);
        let run = |b: &lily_cpu::CpuBackend| {
            let mut s = b.new_state(tokens.len() + 1).unwrap();
            let mut out = b.prefill(&mut s, &tokens, LogitRows::All).unwrap();
            out.extend(b.decode(&mut s, 3).unwrap());
            out
        };
        assert_eq!(run(&default), run(&explicit), "{name}");
    }
}

/// The bf16 mode changes a prefill by about what bf16 operands do (the fixtures' random weights
/// are sensitive: up to a few parts in a hundred), and a decode step not at all: from the same
/// state, a bf16-mode backend's decode equals the f32 backend's to the bit, while a one-token
/// prefill, which the GPU computes on tensor cores, rounds.
#[test]
fn bf16_numerics_round_prefill_and_leave_decode_in_f32() {
    for name in ["tiny-a", "tiny-mlx-q4"] {
        let f32 = load(name);
        let bf16 = load(name).with_numerics(Numerics::TensorCoreBf16);
        let tokens = prompt(40, f32.config().vocab_size);
        let mut s = bf16.new_state(tokens.len() + 1).unwrap();
        let rounded = bf16.prefill(&mut s, &tokens, LogitRows::Last).unwrap();
        let mut f32_state = f32.new_state(tokens.len()).unwrap();
        let exact = f32
            .prefill(&mut f32_state, &tokens, LogitRows::Last)
            .unwrap();
        let d = rel_diff(&rounded, &exact);
        eprintln!("{name}: bf16 prefill against f32: {d:e}");
        assert!(d > 1e-4 && d < 5e-2, "{name}: {d:e}");

        let (mut a, mut b, mut c) = (s.clone(), s.clone(), s);
        let decoded = bf16.decode(&mut a, 5).unwrap();
        assert_eq!(decoded, f32.decode(&mut b, 5).unwrap(), "{name}");
        let prefilled = bf16.prefill(&mut c, &[5], LogitRows::Last).unwrap();
        assert!(
            prefilled != decoded,
            "{name}: a one-token prefill rounded nothing"
        );
    }
}

/// A bf16 cache rounds what later steps read: decode after the same f32 prefill moves by a
/// cache rounding's effect, small but not zero.
#[test]
fn a_bf16_cache_changes_what_decode_reads() {
    let exact = load("tiny-a");
    let rounded = load("tiny-a").with_kv_precision(KvPrecision::Bf16);
    let tokens = prompt(40, exact.config().vocab_size);
    let run = |b: &lily_cpu::CpuBackend| {
        let mut s = b.new_state(tokens.len() + 1).unwrap();
        b.prefill(&mut s, &tokens, LogitRows::Last).unwrap();
        b.decode(&mut s, 5).unwrap()
    };
    let d = rel_diff(&run(&rounded), &run(&exact));
    eprintln!("tiny-a: decode over a bf16 cache against an f32 one: {d:e}");
    assert!(d > 1e-6 && d < 2e-2, "{d:e}");
}
