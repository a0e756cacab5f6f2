//! The batched decode step (several sequences a step, each weight read once for all of them)
//! against each sequence decoded alone: every row must give the tokens, and the logits to the
//! bit, that its sequence gives in a step of its own. Prompts of different lengths (so different
//! positions and attention splits in one step), greedy and seeded sampled rows side by side (the
//! sampled ones choosing together in one set of pick launches, each with its own rule),
//! batches of 2, 3, 8, 9 (a step of 8, then one of 1) and 17 (two steps of 8, whose graphs
//! alternate, then one of 1), on synthetic:tiny (4-bit, the real
//! vocabulary) and the full-size synthetic model. The same with each next step queued before
//! the host reads the picks (`DecodeRow::queue_next`), rows joining the batch at different steps.
//! Needs a CUDA GPU: ignored by a plain `cargo test`, run on the H200 with `--include-ignored`.

mod support;

use lily_core::backend::{Backend, DecodeRow, LogitRows};
use lily_core::choice::Choice;
use lily_core::model_ref::SYNTHETIC_SEED;
use lily_core::penalties::Penalties;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synthetic::synthetic_config;
use lily_cuda::synthetic::SyntheticWeights;
use lily_cuda::{CudaBackend, CudaOptions, CudaState, KvPrecision};
use support::{argmax, options, tokens};

const STEPS: usize = 12;
/// Prompt lengths of the rows: one position, a split boundary (64, 65), several chunks (300).
const LENGTHS: [usize; 17] = [
    1, 2, 7, 64, 65, 33, 300, 17, 130, 5, 66, 129, 3, 250, 40, 63, 12,
];

fn backend(model: &str) -> CudaBackend {
    let config = synthetic_config(model).unwrap();
    let mut source = SyntheticWeights::new(SYNTHETIC_SEED);
    // Steps are queued only where a call asks (`queue_next`): the plain calls stay plain.
    let options = CudaOptions {
        queue_steps: true,
        ..options(KvPrecision::F32, 128)
    };
    CudaBackend::from_source(config, &mut source, &options).unwrap()
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

/// Rows 0..n decoded together, every step one `decode_batch`: each row's tokens. `queued`:
/// each step queues the row's next one where the row goes on after it, and row i joins the
/// batch at step i % 3 (its prompt prefilled while the others' steps are queued), so calls mix
/// rows whose pick a queued step made with rows stepped in the call.
fn together(b: &CudaBackend, n: usize, queued: bool) -> Vec<Vec<u32>> {
    let vocab = b.config().vocab_size;
    let mut samplers: Vec<Sampler> = (0..n).map(|i| sampler(i, vocab)).collect();
    let mut states: Vec<Option<CudaState>> = (0..n).map(|_| None).collect();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
    for step in 0.. {
        for (i, s) in samplers.iter_mut().enumerate() {
            if step == if queued { i % 3 } else { 0 } {
                let (state, first) = start(b, i, s);
                states[i] = Some(state);
                out[i].push(first);
            }
        }
        let (ids, mut rows): (Vec<usize>, Vec<DecodeRow<'_, CudaState>>) = states
            .iter_mut()
            .zip(samplers.iter_mut())
            .zip(&out)
            .enumerate()
            .filter_map(|(i, ((state, sampler), toks))| {
                let state = state.as_mut().filter(|_| toks.len() < STEPS)?;
                let row = DecodeRow {
                    state,
                    token: *toks.last().unwrap(),
                    choice: choice(i, sampler),
                    queue_next: queued && toks.len() + 1 < STEPS,
                };
                Some((i, row))
            })
            .unzip();
        if rows.is_empty() && step >= 2 {
            break;
        }
        if rows.is_empty() {
            continue;
        }
        let picks = b.decode_batch(&mut rows).unwrap();
        drop(rows);
        for (i, pick) in ids.into_iter().zip(picks) {
            out[i].push(pick.token);
        }
    }
    out
}

/// A prompt's state after 4 greedy steps, the last queued (it fed its pick on the device), then a
/// prefill: the logits equal those of a state whose step fed the pick in the plain way.
fn prefill_after_a_queued_step(b: &CudaBackend) {
    let vocab = b.config().vocab_size;
    let mut greedy = Sampler::new(SamplingParams::greedy());
    let (mut plain, mut next) = start(b, 3, &mut greedy);
    for _ in 0..4 {
        next = b
            .decode_choose(&mut plain, next, &mut Choice::of(&mut greedy))
            .unwrap()
            .token;
    }
    b.decode(&mut plain, next).unwrap();
    let (mut queued, mut token) = start(b, 3, &mut greedy);
    for step in 0..4 {
        let mut row = [DecodeRow {
            state: &mut queued,
            token,
            choice: Choice::of(&mut greedy),
            queue_next: true,
        }];
        token = b.decode_batch(&mut row).unwrap()[0].token;
        assert_eq!(
            queued.len(),
            LENGTHS[3] + step + 2,
            "the queued step counts"
        );
    }
    assert_eq!(token, next);
    let x = [(next as usize * 7 % vocab) as u32];
    let want = b.prefill(&mut plain, &x, LogitRows::Last).unwrap();
    let got = b.prefill(&mut queued, &x, LogitRows::Last).unwrap();
    let same = got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same,
        "a prefill after a queued step differs from one after a plain step"
    );
    // A plain step after the prefill on each: nothing queued is left to take.
    let t = argmax(&want) as u32;
    let plain_next = b.decode_choose(&mut plain, t, &mut Choice::of(&mut greedy));
    let queued_next = b.decode_choose(&mut queued, t, &mut Choice::of(&mut greedy));
    assert_eq!(queued_next.unwrap(), plain_next.unwrap());
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
        for queued in [false, true] {
            let got = together(&b, n, queued);
            for (i, toks) in got.iter().enumerate() {
                assert_eq!(
                    toks, &want[i].0,
                    "{model}, a batch of {n} (queued: {queued}): row {i} (prompt of {}) decoded \
                     other tokens than alone",
                    LENGTHS[i]
                );
            }
            eprintln!(
                "{model}, a batch of {n} (queued: {queued}): every row's {STEPS} tokens as alone"
            );
        }
    }
    prefill_after_a_queued_step(&b);
    eprintln!("{model}: a prefill after a queued step as after a plain one");
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
            queue_next: false,
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
    check_batches("tiny", &[2, 3, 8, 9, 17]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_steps_give_each_sequence_what_it_gives_alone_full_size() {
    check_batches("qwen3.6-35b-a3b", &[8]);
}
