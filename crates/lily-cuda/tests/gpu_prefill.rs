//! Chunked CUDA prefill end to end: chunking, the device's greedy choices, and the production head
//! shapes against the CPU reference (the whole-model agreement with both CPU numerics, on the
//! fixtures and at full width, is gpu_agreement.rs). Needs a CUDA GPU: ignored by a plain
//! `cargo test` (which says so) and run on the H200 with `--include-ignored` (tools/gpu-check.sh).
//! Every comparison prints its measured error.

mod support;

use lily_core::backend::{Backend, LogitRows};
use lily_core::choice::Choice;
use lily_core::config::ModelConfig;
use lily_core::model_ref::ModelRef;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synthetic::SyntheticSource;
use lily_core::weights::ModelWeights;
use lily_cpu::CpuBackend;
use lily_cuda::moe_prefill::ROWS64_FROM_ROWS_PER_EXPERT;
use lily_cuda::{CudaBackend, KvPrecision};
use support::{BF16_PREFILL, argmax, fixture, options, rel_diff, tokens};

/// The first token after a prefill and the tokens of the decode steps after it, chosen on the
/// device (`prefill_choose`, `decode_choose`), are what the host sampler picks from the same
/// backend's logits: with the whole vocabulary, and with the choice limited to ids below the
/// unlimited winner (so the limit must change the answer), below 1 and below the vocabulary.
/// The prompt crosses a chunk boundary (chunks of 48).
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_choices_on_the_device_equal_the_hosts() {
    for name in ["tiny-a", "tiny-mlx-q4"] {
        let (config, source) = ModelRef::Dir(fixture(name)).open().unwrap();
        let weights = ModelWeights::load(&config, source).unwrap();
        let gpu =
            CudaBackend::with_options(config.clone(), &weights, &options(KvPrecision::Bf16, 48))
                .unwrap();
        let vocab = config.vocab_size;
        for len in [1, 60] {
            let prompt = tokens(len, vocab, 7);
            let mut probe = gpu.new_state(len + 4).unwrap();
            let logits = gpu.prefill(&mut probe, &prompt, LogitRows::Last).unwrap();
            let winner = argmax(&logits);
            let limits = [None, Some(winner.max(1)), Some(1), Some(vocab)];
            for limit in limits {
                let sampler = || {
                    let greedy = Sampler::new(SamplingParams::greedy());
                    match limit {
                        Some(l) => greedy.with_vocab_limit(l),
                        None => greedy,
                    }
                };
                let mut state = gpu.new_state(len + 4).unwrap();
                let mut chosen = vec![
                    gpu.prefill_choose(&mut state, &prompt, &mut Choice::of(&mut sampler()))
                        .unwrap()
                        .token,
                ];
                let mut expected = vec![sampler().sample(&logits)];
                for _ in 0..3 {
                    let last = *chosen.last().unwrap();
                    let mut fork = gpu.fork(&state).unwrap();
                    expected.push(sampler().sample(&gpu.decode(&mut fork, last).unwrap()));
                    let mut s = sampler();
                    let pick = gpu.decode_choose(&mut state, last, &mut Choice::of(&mut s));
                    chosen.push(pick.unwrap().token);
                }
                eprintln!(
                    "{name}, prompt {len}, limit {limit:?}: device {chosen:?}, host {expected:?}"
                );
                assert_eq!(chosen, expected, "{name}, prompt {len}, limit {limit:?}");
                assert_eq!(gpu.state_len(&state), len + 3);
                if let Some(l) = limit {
                    assert!(
                        chosen.iter().all(|&t| (t as usize) < l),
                        "{chosen:?} not below {l}"
                    );
                }
            }
        }
    }
}

/// Chunks compute rows independently and carry every state exactly: a prompt cut into ragged
/// chunks leaves the same state as one chunk, to the last bit but for summation order.
#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_prefill_equals_one_chunk() {
    for name in ["tiny-a", "tiny-mlx-q4"] {
        let (config, source) = ModelRef::Dir(fixture(name)).open().unwrap();
        let weights = ModelWeights::load(&config, source).unwrap();
        let f32kv = KvPrecision::F32;
        let one =
            CudaBackend::with_options(config.clone(), &weights, &options(f32kv, 512)).unwrap();
        let prompt = tokens(150, config.vocab_size, 2);
        let probe = tokens(6, config.vocab_size, 3);
        let run = |b: &CudaBackend| {
            let mut s = b.new_state(prompt.len() + probe.len()).unwrap();
            let mut out = b.prefill(&mut s, &prompt, LogitRows::Last).unwrap();
            for &t in &probe {
                out.extend(b.decode(&mut s, t).unwrap());
            }
            out
        };
        let reference = run(&one);
        for chunk in [1, 7, 16, 33, 149] {
            let cut = CudaBackend::with_options(config.clone(), &weights, &options(f32kv, chunk))
                .unwrap();
            let d = rel_diff(&run(&cut), &reference);
            eprintln!("{name}: chunks of {chunk} against one chunk, max rel diff {d:e}");
            assert!(d <= 1e-5, "{name}, chunk {chunk}: {d:e}");
        }
    }
}

/// A fork taken inside a prefill's pass (`prefill_forking`, `prefill_choose_forking`: the
/// server's snapshot at a turn boundary) is the state a prefill of the tokens before it leaves,
/// and the pass goes on as if none were taken. Forks at the first tokens (inside the conv window),
/// at ragged points, at a chunk's edge and inside a later chunk (chunks of 48); each fork's next
/// two steps against a prefix's own prefill, the whole state's logits and next step against an
/// unforked prefill's. Then the production heads, where one side of the cut takes the chunked
/// delta rule and the other the scan.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_fork_inside_a_prefill_equals_a_prefill_of_its_prefix() {
    for name in ["tiny-a", "tiny-mlx-q4"] {
        let (config, source) = ModelRef::Dir(fixture(name)).open().unwrap();
        let weights = ModelWeights::load(&config, source).unwrap();
        let gpu =
            CudaBackend::with_options(config.clone(), &weights, &options(KvPrecision::F32, 48))
                .unwrap();
        let cases = [
            (40, vec![1, 2, 3, 4, 17, 39]),
            (130, vec![47, 48, 49, 100, 129]),
        ];
        for (len, forks) in cases {
            let prompt = tokens(len, config.vocab_size, len as u32);
            check_forks(&gpu, &prompt, &forks, [1e-5, 1e-5], name);
        }
    }
    let config = production_shaped(4096);
    let weights = ModelWeights::load(&config, Box::new(SyntheticSource::new(9))).unwrap();
    let gpu = CudaBackend::with_options(config.clone(), &weights, &options(KvPrecision::F32, 512))
        .unwrap();
    // The fork's delta rule runs as the prefix's own does (exact); the whole prompt's is cut in
    // two, one side by the scan and the other by the chunked form (~1e-6 apart), and the random
    // model carries a bf16 rounding that moves by that to its logits as a bf16 step (4e-3 seen).
    let prompt = tokens(420, config.vocab_size, 5);
    let tol = [1e-5, BF16_PREFILL];
    check_forks(&gpu, &prompt, &[100, 300], tol, "production heads");
}

/// [`a_fork_inside_a_prefill_equals_a_prefill_of_its_prefix`] for one prompt: every fork point
/// in `forks`, by both calls, against the prefix alone within `fork_tol` and the unforked prompt
/// within `whole_tol`.
fn check_forks(
    gpu: &CudaBackend,
    prompt: &[u32],
    forks: &[usize],
    [fork_tol, whole_tol]: [f32; 2],
    name: &str,
) {
    let len = prompt.len();
    let probe = [3, 5].map(|t| t % gpu.config().vocab_size as u32);
    // Logits after `state`'s own and then after each probe token, on a copy of it.
    let steps = |state: &lily_cuda::CudaState, first: Vec<f32>| {
        let mut copy = gpu.fork(state).unwrap();
        let mut out = first;
        for &t in &probe {
            out.extend(gpu.decode(&mut copy, t).unwrap());
        }
        out
    };
    let mut whole = gpu.new_state(len + 4).unwrap();
    let whole_logits = gpu.prefill(&mut whole, prompt, LogitRows::Last).unwrap();
    let unforked = steps(&whole, whole_logits);
    for &at in forks {
        let mut prefix = gpu.new_state(len + 4).unwrap();
        let prefix_logits = gpu
            .prefill(&mut prefix, &prompt[..at], LogitRows::Last)
            .unwrap();
        let prefix_steps = steps(&prefix, prefix_logits.clone());

        let mut state = gpu.new_state(len + 4).unwrap();
        let (logits, fork) = gpu
            .prefill_forking(&mut state, prompt, at, LogitRows::Last)
            .unwrap();
        assert_eq!((gpu.state_len(&state), gpu.state_len(&fork)), (len, at));
        // The choice made in the same pass is the greedy one of its logits.
        let greedy = argmax(&logits) as u32;
        let (dw, df) = (
            rel_diff(&steps(&state, logits), &unforked),
            rel_diff(&steps(&fork, prefix_logits.clone()), &prefix_steps),
        );

        let mut chosen = gpu.new_state(len + 4).unwrap();
        let mut greedy_sampler = Sampler::new(SamplingParams::greedy());
        let (pick, chosen_fork) = gpu
            .prefill_choose_forking(
                &mut chosen,
                prompt,
                at,
                &mut Choice::of(&mut greedy_sampler),
            )
            .unwrap();
        let dc = rel_diff(&steps(&chosen_fork, prefix_logits), &prefix_steps);
        eprintln!(
            "{name}, prompt {len}, fork at {at}: whole {dw:e}, fork {df:e}, chosen's fork {dc:e}"
        );
        assert!(
            dw <= whole_tol && df <= fork_tol && dc <= fork_tol,
            "{name}, {len} at {at}"
        );
        assert_eq!(pick.token, greedy, "{name}, {len} at {at}");
        assert_eq!(gpu.state_len(&chosen_fork), at);
    }
    // A fork must fall inside the tokens.
    let mut state = gpu.new_state(len + 4).unwrap();
    for at in [0, len] {
        assert!(
            gpu.prefill_forking(&mut state, prompt, at, LogitRows::None)
                .is_err()
        );
    }
    assert_eq!(gpu.state_len(&state), 0);
}

/// The real model's heads at a small width (see `prefill_at_production_shapes_matches_the_cpu`).
fn production_shaped(vocab: usize) -> ModelConfig {
    let mut root: serde_json::Value =
        serde_json::from_str(lily_core::config::QWEN36_35B_A3B_CONFIG).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    let layers = [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ];
    t.insert("hidden_size".into(), 256.into());
    t.insert("num_hidden_layers".into(), layers.len().into());
    t.insert("layer_types".into(), serde_json::json!(layers));
    t.insert("vocab_size".into(), vocab.into());
    t.insert("moe_intermediate_size".into(), 64.into());
    t.insert("shared_expert_intermediate_size".into(), 128.into());
    ModelConfig::from_json(&root.to_string()).unwrap()
}

/// The real model's head structure (GQA group 8, head dim 256, 64 rotary dims, GDN 16/32 heads of
/// 128, 256 experts top 8) at a small width, so every prefill kernel runs at its production
/// constants, with prompts that cross chunk boundaries at ragged lengths. The expert tile height
/// follows the chunk's length and the GEMM path: on mma.sync the last prompt's first chunk is the
/// shortest with 64-row tiles and its second takes 16-row ones; on the wgmma path (sm_90's
/// default) every chunk takes 64-row tiles, so run it with `LILY_GEMM=mma` too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_at_production_shapes_matches_the_cpu() {
    let config = production_shaped(4096);
    let weights = ModelWeights::load(&config, Box::new(SyntheticSource::new(7))).unwrap();
    let first_tall = ROWS64_FROM_ROWS_PER_EXPERT * config.num_experts / config.experts_per_token;
    let backend = |chunk| {
        CudaBackend::with_options(config.clone(), &weights, &options(KvPrecision::F32, chunk))
            .unwrap()
    };
    let (short, tall) = (backend(200), backend(first_tall));
    let cpu = CpuBackend::new(config.clone(), weights);
    let runs = [
        (&short, vec![1, 7, 16, 33, 200, 301]),
        (&tall, vec![first_tall + 37]),
    ];
    for (gpu, len) in runs
        .iter()
        .flat_map(|(g, lens)| lens.iter().map(move |&l| (*g, l)))
    {
        let prompt = tokens(len, config.vocab_size, len as u32);
        let mut gs = gpu.new_state(len + 4).unwrap();
        let mut cs = cpu.new_state(len + 4).unwrap();
        let ours = gpu.prefill(&mut gs, &prompt, LogitRows::Last).unwrap();
        let reference = cpu.prefill(&mut cs, &prompt, LogitRows::Last).unwrap();
        let d = rel_diff(&ours, &reference);
        // Then decode on the state the prefill left: the carried KV, conv and recurrent state.
        let next = gpu.decode(&mut gs, 5).unwrap();
        let next_ref = cpu.decode(&mut cs, 5).unwrap();
        let dn = rel_diff(&next, &next_ref);
        eprintln!("production shapes, prompt {len}: last logits {d:e}, next step {dn:e}");
        assert!(
            d <= BF16_PREFILL && dn <= BF16_PREFILL,
            "prompt {len}: {d:e} / {dn:e}"
        );
    }
}
