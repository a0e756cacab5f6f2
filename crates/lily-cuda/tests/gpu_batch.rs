//! The batched decode step (several sequences a step, each weight read once for all of them)
//! against each sequence decoded alone: every row must give the tokens, and the logits to the
//! bit, that its sequence gives in a step of its own. Prompts of different lengths (so different
//! positions and attention splits in one step), greedy and seeded sampled rows side by side (the
//! sampled ones choosing together in one set of pick launches, each with its own rule),
//! batches of 2, 3, 8 and 9 (a step of 8, then one of 1), on synthetic:tiny (4-bit, the real
//! vocabulary) and the full-size synthetic model. Needs a CUDA GPU: ignored by a plain
//! `cargo test`, run on the H200 with `--include-ignored`.

mod support;

use lily_core::backend::{Backend, DecodeRow};
use lily_core::choice::Choice;
use lily_core::model_ref::SYNTHETIC_SEED;
use lily_core::penalties::Penalties;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synthetic::synthetic_config;
use lily_cuda::synthetic::SyntheticWeights;
use lily_cuda::{CudaBackend, CudaState, KvPrecision};
use support::{argmax, options, tokens};

const STEPS: usize = 12;
/// Prompt lengths of the rows: one position, a split boundary (64, 65), several chunks (300).
const LENGTHS: [usize; 9] = [1, 2, 7, 64, 65, 33, 300, 17, 130];

fn backend(model: &str) -> CudaBackend {
    let config = synthetic_config(model).unwrap();
    let mut source = SyntheticWeights::new(SYNTHETIC_SEED);
    CudaBackend::from_source(config, &mut source, &options(KvPrecision::F32, 128)).unwrap()
}

/// Row i's prompt.
fn prompt(i: usize, vocab: usize) -> Vec<u32> {
    tokens(LENGTHS[i], vocab, 17 + i as u32)
}

/// Row i's sampling: every third row sampled with its own seed and rule (one with penalties
/// and logit_bias, one with min-p and no top-k, which the host may finish), the others greedy;
/// so a step's pick launches hold rows that adjust, that rank raw lists and that do neither.
fn sampler(i: usize, vocab: usize) -> Sampler {
    if i % 3 != 2 {
        return Sampler::new(SamplingParams::greedy());
    }
    let seed = 1000 + i as u64;
    match i / 3 {
        0 => Sampler::new(SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            min_p: 0.0,
            seed,
        }),
        1 => Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 40,
            top_p: 1.0,
            min_p: 0.0,
            seed,
        })
        .with_penalties(
            Penalties {
                presence: 0.5,
                frequency: 0.2,
                repetition: 1.1,
                logit_bias: vec![(7, 2.0), (11, -100.0)],
            },
            &prompt(i, vocab),
        ),
        _ => Sampler::new(SamplingParams {
            temperature: 0.9,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.05,
            seed,
        }),
    }
}

/// Row i's choice: rows 4, 5 and 8 report log-probabilities (row 4 a greedy row that the step's
/// argmax alone cannot answer; row 5's penalties make the raw lists differ).
fn choice(i: usize, sampler: &mut Sampler) -> Choice<'_> {
    Choice {
        logprobs: [(4, 2), (5, 5), (8, 3)]
            .iter()
            .find(|&&(row, _)| row == i)
            .map(|&(_, k)| k),
        ..Choice::of(sampler)
    }
}

/// Row i's prefilled state (different contexts too: a different split count for row 1) and the
/// first token after its prompt.
fn start(b: &CudaBackend, i: usize, sampler: &mut Sampler) -> (CudaState, u32) {
    let prompt = prompt(i, b.config().vocab_size);
    let max_seq = if i == 1 { 40_000 } else { 1024 };
    let mut state = b.new_state(max_seq).unwrap();
    let pick = b
        .prefill_choose(&mut state, &prompt, &mut choice(i, sampler))
        .unwrap();
    (state, pick.token)
}

/// Row i decoded alone: its tokens, and the logits of its last step.
fn alone(b: &CudaBackend, i: usize) -> (Vec<u32>, Vec<f32>) {
    let mut sampler = sampler(i, b.config().vocab_size);
    let (mut state, mut next) = start(b, i, &mut sampler);
    let mut out = vec![next];
    for _ in 1..STEPS {
        next = b
            .decode_choose(&mut state, next, &mut choice(i, &mut sampler))
            .unwrap()
            .token;
        out.push(next);
    }
    let logits = b.decode(&mut state, next).unwrap();
    (out, logits)
}

/// Rows 0..n decoded together, every step one `decode_batch`: each row's tokens.
fn together(b: &CudaBackend, n: usize) -> Vec<Vec<u32>> {
    let vocab = b.config().vocab_size;
    let mut samplers: Vec<Sampler> = (0..n).map(|i| sampler(i, vocab)).collect();
    let mut states = Vec::new();
    let mut out: Vec<Vec<u32>> = Vec::new();
    for (i, s) in samplers.iter_mut().enumerate() {
        let (state, first) = start(b, i, s);
        states.push(state);
        out.push(vec![first]);
    }
    for _ in 1..STEPS {
        let mut rows: Vec<DecodeRow<'_, CudaState>> = states
            .iter_mut()
            .zip(samplers.iter_mut())
            .zip(&out)
            .enumerate()
            .map(|(i, ((state, sampler), toks))| DecodeRow {
                state,
                token: *toks.last().unwrap(),
                choice: choice(i, sampler),
            })
            .collect();
        let picks = b.decode_batch(&mut rows).unwrap();
        drop(rows);
        for (toks, pick) in out.iter_mut().zip(picks) {
            toks.push(pick.token);
        }
    }
    out
}

fn check_batches(model: &str, sizes: &[usize]) {
    let b = backend(model);
    eprintln!(
        "{model}: {} rows a step, {}",
        b.step_rows(),
        b.device_name()
    );
    assert!(b.step_rows() >= 2, "{model}: no batched step on this GPU");
    let max = *sizes.iter().max().unwrap();
    let want: Vec<(Vec<u32>, Vec<f32>)> = (0..max).map(|i| alone(&b, i)).collect();
    for &n in sizes {
        let got = together(&b, n);
        for (i, toks) in got.iter().enumerate() {
            assert_eq!(
                toks, &want[i].0,
                "{model}, a batch of {n}: row {i} (prompt of {}) decoded other tokens than alone",
                LENGTHS[i]
            );
        }
        eprintln!("{model}, a batch of {n}: every row's {STEPS} tokens as alone");
    }
    // The logits of a batched greedy step, row by row, to the bit, from states at the point of
    // alone's last step.
    let n = sizes
        .iter()
        .copied()
        .filter(|&n| n <= b.step_rows())
        .max()
        .unwrap();
    let vocab = b.config().vocab_size;
    let mut samplers: Vec<Sampler> = (0..n).map(|i| sampler(i, vocab)).collect();
    let mut states: Vec<CudaState> = Vec::new();
    let mut lasts = Vec::new();
    for (i, s) in samplers.iter_mut().enumerate() {
        let (mut state, mut next) = start(&b, i, s);
        for _ in 1..STEPS {
            next = b
                .decode_choose(&mut state, next, &mut choice(i, s))
                .unwrap()
                .token;
        }
        states.push(state);
        lasts.push(next);
    }
    let mut greedy: Vec<Sampler> = (0..n)
        .map(|_| Sampler::new(SamplingParams::greedy()))
        .collect();
    let mut rows: Vec<DecodeRow<'_, CudaState>> = states
        .iter_mut()
        .zip(greedy.iter_mut())
        .zip(&lasts)
        .map(|((state, sampler), &token)| DecodeRow {
            state,
            token,
            choice: Choice::of(sampler),
        })
        .collect();
    let picks = b.decode_batch(&mut rows).unwrap();
    drop(rows);
    let logits = b.batch_logits(n).unwrap();
    for (i, pick) in picks.iter().enumerate() {
        let row = &logits[i * vocab..(i + 1) * vocab];
        let alone = &want[i].1;
        let same = row
            .iter()
            .zip(alone)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{model}: row {i}'s logits in a batch of {n} differ from alone"
        );
        assert_eq!(pick.token as usize, argmax(alone), "{model}: row {i}");
    }
    eprintln!("{model}: a batch of {n}: every row's logits equal alone's to the bit");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_steps_give_each_sequence_what_it_gives_alone_tiny() {
    check_batches("tiny", &[2, 3, 8, 9]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_steps_give_each_sequence_what_it_gives_alone_full_size() {
    check_batches("qwen3.6-35b-a3b", &[8]);
}
