//! The CPU backend against transformers: logits, hidden states and greedy tokens of the committed
//! fixtures (tools/make_fixtures.py), plus the internal agreements that must hold between
//! prefill and decode, and between the two forms of the delta rule.

use lily_core::backend::{Backend, LogitRows};
use lily_core::npy;
use lily_cpu::{CpuBackend, GdnForm};

mod support;
use support::*;

const FIXTURES: [&str; 3] = ["tiny-a", "tiny-b", "tiny-a-official"];

/// Every position of every sequence, at prefill chunk sizes that split sequences unevenly.
#[test]
fn teacher_forced_logits_match_transformers() {
    for name in FIXTURES {
        let c = cases(name);
        for chunk in [512, 37] {
            let backend = load(name).with_max_prefill_chunk(chunk);
            for seq in c["sequences"].as_array().unwrap() {
                let tokens = ids(&seq["tokens"]);
                let (shape, reference) =
                    npy::read_f32(&fixture_dir(name).join(seq["logits"].as_str().unwrap()))
                        .unwrap();
                assert_eq!(shape, [tokens.len(), backend.config().vocab_size]);
                let mut state = backend.new_state(tokens.len()).unwrap();
                let logits =
                    lily_core::generate::prefill(&backend, &mut state, &tokens, LogitRows::All)
                        .unwrap();
                let d = rel_diff(&logits, &reference);
                let seq_name = seq["name"].as_str().unwrap();
                assert!(
                    d <= 1e-4,
                    "{name}/{seq_name} chunk {chunk}: relative diff {d:e}"
                );
            }
        }
    }
}

/// Layer-by-layer hidden states: where a mismatch starts, this test says which layer.
#[test]
fn hidden_states_match_transformers_layer_by_layer() {
    for name in FIXTURES {
        let c = cases(name);
        let backend = load(name);
        let seq = c["sequences"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == c["hidden"]["sequence"])
            .unwrap();
        let tokens = ids(&seq["tokens"]);
        let (shape, reference) =
            npy::read_f32(&fixture_dir(name).join("hidden_short.npy")).unwrap();
        let (_, last_prenorm) =
            npy::read_f32(&fixture_dir(name).join("hidden_short_last_prenorm.npy")).unwrap();
        let layers = backend.config().num_layers();
        assert_eq!(shape[0], layers + 1);
        let per = shape[1] * shape[2];
        let mut trace = Vec::new();
        let mut state = backend.new_state(tokens.len()).unwrap();
        backend
            .forward(&mut state, &tokens, LogitRows::Last, Some(&mut trace))
            .unwrap();
        // transformers' last entry is after the final norm; the pre-norm output is saved apart.
        for (l, ours) in trace.iter().enumerate() {
            let theirs = if l == layers {
                &last_prenorm[..]
            } else {
                &reference[l * per..(l + 1) * per]
            };
            let d = rel_diff(ours, theirs);
            assert!(
                d <= 1e-5,
                "{name}: hidden state after layer {l} differs by {d:e}"
            );
        }
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    for name in FIXTURES {
        let c = cases(name);
        let backend = load(name);
        for case in c["greedy"].as_array().unwrap() {
            let prompt = ids(&case["prompt"]);
            let expected = ids(&case["generated"]);
            assert_eq!(
                greedy(&backend, &prompt, expected.len()),
                expected,
                "{name}"
            );
        }
    }
}

/// Prefill of the whole sequence against a short prefill then one decode step per token.
#[test]
fn prefill_then_decode_equals_prefill_all() {
    for name in ["tiny-a", "tiny-b"] {
        let c = cases(name);
        let backend = load(name);
        let seq = &c["sequences"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == "long")
            .unwrap()["tokens"];
        let tokens = ids(seq);
        let vocab = backend.config().vocab_size;
        let mut all_state = backend.new_state(tokens.len()).unwrap();
        let all = backend
            .prefill(&mut all_state, &tokens, LogitRows::All)
            .unwrap();

        let head = 5;
        let mut state = backend.new_state(tokens.len()).unwrap();
        let mut stepped = backend
            .prefill(&mut state, &tokens[..head], LogitRows::All)
            .unwrap();
        for &t in &tokens[head..] {
            stepped.extend(backend.decode(&mut state, t).unwrap());
        }
        assert_eq!(backend.state_len(&state), tokens.len());
        let d = rel_diff(&stepped, &all);
        assert!(
            d <= 1e-5,
            "{name}: decode-by-decode differs from prefill by {d:e}"
        );
        assert_eq!(stepped.len(), tokens.len() * vocab);
    }
}

/// The whole model with the chunked and the recurrent delta rule, at lengths around the chunk.
#[test]
fn chunked_and_recurrent_gdn_agree_in_the_model() {
    let chunked = load("tiny-b").with_gdn_prefill(GdnForm::Chunked);
    let recurrent = load("tiny-b").with_gdn_prefill(GdnForm::Recurrent);
    let vocab = chunked.config().vocab_size as u32;
    for len in [1usize, 63, 64, 65, 200] {
        let tokens: Vec<u32> = (0..len as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let run = |b: &CpuBackend| {
            let mut s = b.new_state(len).unwrap();
            b.prefill(&mut s, &tokens, LogitRows::All).unwrap()
        };
        let d = rel_diff(&run(&chunked), &run(&recurrent));
        assert!(
            d <= 1e-5,
            "length {len}: chunked and recurrent differ by {d:e}"
        );
    }
}

#[test]
fn forked_states_continue_identically() {
    let backend = load("tiny-a");
    let mut a = backend.new_state(32).unwrap();
    backend
        .prefill(&mut a, &[1, 2, 3, 4, 5], LogitRows::Last)
        .unwrap();
    let mut b = backend.fork(&a).unwrap();
    let la = backend.decode(&mut a, 9).unwrap();
    let lb = backend.decode(&mut b, 9).unwrap();
    assert_eq!(la, lb);
    // The fork is independent: advancing one does not move the other.
    backend.decode(&mut a, 10).unwrap();
    assert_eq!(backend.state_len(&a), 7);
    assert_eq!(backend.state_len(&b), 6);
}

#[test]
fn bad_tokens_and_overlong_sequences_are_errors_that_keep_the_state() {
    let backend = load("tiny-a");
    let vocab = backend.config().vocab_size as u32;
    let mut state = backend.new_state(4).unwrap();
    let err = backend
        .prefill(&mut state, &[1, vocab], LogitRows::Last)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&vocab.to_string()) && err.contains("out of range"),
        "{err}"
    );
    assert_eq!(backend.state_len(&state), 0);
    backend
        .prefill(&mut state, &[1, 2, 3], LogitRows::Last)
        .unwrap();
    let err = backend
        .prefill(&mut state, &[1, 2], LogitRows::Last)
        .unwrap_err()
        .to_string();
    assert!(err.contains("exceeds the context of 4"), "{err}");
    assert_eq!(backend.state_len(&state), 3);
}
