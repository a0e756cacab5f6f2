//! The batched decode step against decoding each sequence alone: sequences of different lengths
//! and contents, joining and leaving the batch at different steps (so the batch size moves
//! through 1 and up to 7 with ragged positions), must get bit-identical logits at every step.
//! Both go through the same products row by row (batch.rs says why the order is the same), so
//! there is no tolerance: any difference is a bug.

mod support;

use lily_core::backend::{Backend, DecodeRow, LogitRows};
use lily_core::choice::Choice;
use lily_core::generate::prefill;
use lily_core::model_ref::ModelRef;
use lily_core::sampling::{Sampler, SamplingParams, argmax};
use lily_core::weights::ModelWeights;
use lily_cpu::{CpuBackend, CpuState};

/// One sequence of the schedule: its prompt, the step at which it joins the batch and how many
/// tokens it decodes there.
struct Entry {
    prompt: Vec<u32>,
    joins: usize,
    steps: usize,
}

fn synthetic_tiny() -> CpuBackend {
    let (config, source) = ModelRef::Synthetic("tiny".into()).open().unwrap();
    CpuBackend::new(config.clone(), ModelWeights::load(&config, source).unwrap())
}

/// Seven sequences over `vocab`: prompt lengths 1 to 37, joining at steps 0 to 9 and decoding
/// 3 to 16 tokens, so that at some steps one runs alone and at others all overlap.
fn schedule(vocab: u32) -> Vec<Entry> {
    [
        (5, 0, 12),
        (1, 0, 16),
        (37, 1, 9),
        (12, 2, 3),
        (20, 4, 10),
        (3, 4, 7),
        (9, 9, 6),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (len, joins, steps))| Entry {
        prompt: (0..len as u32)
            .map(|t| (t * 31 + 7 * i as u32 + 3) % vocab)
            .collect(),
        joins,
        steps,
    })
    .collect()
}

/// A state holding `prompt`, and the greedy token that follows it.
fn prefilled(backend: &CpuBackend, prompt: &[u32], room: usize) -> (CpuState, u32) {
    let mut state = backend.new_state(prompt.len() + room).unwrap();
    let logits = prefill(backend, &mut state, prompt, LogitRows::Last).unwrap();
    (state, argmax(&logits))
}

/// Every step's logits of `entry` decoded alone, and the tokens fed (greedy from them).
fn alone(backend: &CpuBackend, entry: &Entry) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (mut state, mut token) = prefilled(backend, &entry.prompt, entry.steps);
    let (mut fed, mut logits) = (Vec::new(), Vec::new());
    for _ in 0..entry.steps {
        fed.push(token);
        let step = backend.decode(&mut state, token).unwrap();
        token = argmax(&step);
        logits.push(step);
    }
    (fed, logits)
}

/// Runs the schedule in batches and compares every row with the same step alone, bit for bit.
fn batched_equals_alone(backend: &CpuBackend, entries: &[Entry]) {
    let solo: Vec<_> = entries.iter().map(|e| alone(backend, e)).collect();
    let mut states: Vec<CpuState> = entries
        .iter()
        .map(|e| prefilled(backend, &e.prompt, e.steps).0)
        .collect();
    let last = entries.iter().map(|e| e.joins + e.steps).max().unwrap();
    let mut sizes = Vec::new();
    for step in 0..last {
        let active: Vec<usize> = (0..entries.len())
            .filter(|&i| (entries[i].joins..entries[i].joins + entries[i].steps).contains(&step))
            .collect();
        if active.is_empty() {
            continue;
        }
        sizes.push(active.len());
        let mut batch: Vec<&mut CpuState> = states
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| active.contains(i))
            .map(|(_, state)| state)
            .collect();
        let tokens: Vec<u32> = active
            .iter()
            .map(|&i| solo[i].0[step - entries[i].joins])
            .collect();
        let out = backend.decode_rows(&mut batch, &tokens).unwrap();
        let vocab = backend.config().vocab_size;
        for (&i, got) in active.iter().zip(out.chunks(vocab)) {
            let want = &solo[i].1[step - entries[i].joins];
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same && got.len() == want.len(),
                "sequence {i} at step {step} in a batch of {}: max diff {:e}",
                active.len(),
                support::rel_diff(got, want)
            );
        }
    }
    // The schedule did what it claims: batches of one and of many, of every size between.
    assert_eq!(sizes.iter().min(), Some(&1), "{sizes:?}");
    assert!(sizes.iter().max() >= Some(&5), "{sizes:?}");
}

#[test]
fn a_batch_gives_each_sequence_its_logits_alone_on_synthetic_tiny() {
    let backend = synthetic_tiny();
    batched_equals_alone(&backend, &schedule(backend.config().vocab_size as u32));
}

#[test]
fn a_batch_gives_each_sequence_its_logits_alone_on_the_fixtures() {
    for name in ["tiny-a", "tiny-b", "tiny-mlx-q4"] {
        let backend = support::load(name);
        batched_equals_alone(&backend, &schedule(backend.config().vocab_size as u32));
    }
}

#[test]
fn each_row_gets_the_choice_its_own_request_makes_from_its_logits() {
    let backend = synthetic_tiny();
    let prompts = [vec![1u32, 2, 3], vec![900, 17]];
    let mut states: Vec<CpuState> = prompts
        .iter()
        .map(|p| prefilled(&backend, p, 1).0)
        .collect();
    let mut copies: Vec<CpuState> = states.clone();
    let mut greedy = Sampler::new(SamplingParams::greedy());
    let sampling = SamplingParams {
        temperature: 1.0,
        seed: 9,
        ..SamplingParams::greedy()
    };
    let mut sampled = Sampler::new(sampling.clone());
    let mut choices = [Choice::of(&mut greedy), Choice::of(&mut sampled)];
    choices[1].logprobs = Some(3);
    let mut rows: Vec<DecodeRow<'_, CpuState>> = states
        .iter_mut()
        .zip([5u32, 6])
        .zip(&mut choices)
        .map(|((state, token), choice)| DecodeRow {
            state,
            token,
            choice: choice.reborrow(),
            queue_next: false,
        })
        .collect();
    let out = backend.decode_batch(&mut rows).unwrap();
    let want = backend.decode(&mut copies[0], 5).unwrap();
    assert_eq!(out[0].token, argmax(&want));
    assert_eq!(out[0].logprobs, None);
    let logits = backend.decode(&mut copies[1], 6).unwrap();
    let mut alone = Sampler::new(sampling);
    let expected = Choice {
        logprobs: Some(3),
        ..Choice::of(&mut alone)
    }
    .pick(&logits);
    assert_eq!(out[1], expected);
    assert_eq!(expected.logprobs.map(|l| l.top.len()), Some(3));
}

#[test]
fn a_batch_with_a_full_sequence_is_refused_and_changes_no_state() {
    let backend = synthetic_tiny();
    let (mut roomy, _) = prefilled(&backend, &[1, 2], 4);
    let (mut full, _) = prefilled(&backend, &[3, 4], 0);
    let before = (roomy.len(), full.len());
    let (mut s1, mut s2) = (
        Sampler::new(SamplingParams::greedy()),
        Sampler::new(SamplingParams::greedy()),
    );
    let mut rows = vec![
        DecodeRow {
            state: &mut roomy,
            token: 7,
            choice: Choice::of(&mut s1),
            queue_next: false,
        },
        DecodeRow {
            state: &mut full,
            token: 8,
            choice: Choice::of(&mut s2),
            queue_next: false,
        },
    ];
    let err = backend.decode_batch(&mut rows).unwrap_err();
    assert!(err.to_string().contains("exceeds the context"), "{err}");
    assert_eq!((roomy.len(), full.len()), before);
    // The roomy one still decodes exactly as if the refused batch never happened.
    let (mut fresh, _) = prefilled(&backend, &[1, 2], 4);
    assert_eq!(
        backend.decode(&mut roomy, 7).unwrap(),
        backend.decode(&mut fresh, 7).unwrap()
    );
}

/// A chunk that asks for no logits leaves the state where one asking for the last row does: the
/// next chunk gets the same logits, to the bit.
#[test]
fn a_chunk_without_logits_leaves_the_same_state() {
    let backend = synthetic_tiny();
    let vocab = backend.config().vocab_size;
    let prompt: Vec<u32> = (0..23).map(|t| (t * 37 + 5) % vocab as u32).collect();
    let (head, tail) = prompt.split_at(17);
    let (mut quiet, mut loud) = (
        backend.new_state(64).unwrap(),
        backend.new_state(64).unwrap(),
    );
    let none = backend.prefill(&mut quiet, head, LogitRows::None).unwrap();
    assert!(none.is_empty());
    assert_eq!(backend.state_len(&quiet), head.len());
    let last = backend.prefill(&mut loud, head, LogitRows::Last).unwrap();
    assert_eq!(last.len(), vocab);
    let after_quiet = backend.prefill(&mut quiet, tail, LogitRows::Last).unwrap();
    let after_loud = backend.prefill(&mut loud, tail, LogitRows::Last).unwrap();
    assert_eq!(after_quiet, after_loud);
}
