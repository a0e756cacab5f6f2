//! The device's choice of a token (kernels/pick.cu) against the host's rule
//! (`Choice::pick`) on the same logits: greedy and every sampling parameter, masks of both
//! kinds, penalties and logit_bias, log-probabilities, vocabulary limits that cut the last
//! candidate list short, rows peaked, flat, tied and holding NaN and -inf. Needs a CUDA GPU:
//! ignored by a plain `cargo test`, run on the H200 with `--include-ignored`.

mod support;

use lily_core::backend::Backend;
use lily_core::choice::{Allowed, Choice, Pick};
use lily_core::model_ref::SYNTHETIC_SEED;
use lily_core::penalties::Penalties;
use lily_core::rng::{Rng, uniform_at};
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synthetic::synthetic_config;
use lily_cuda::gpu::Gpu;
use lily_cuda::synthetic::SyntheticWeights;
use lily_cuda::{CudaBackend, KvPrecision};
use support::{NEEDS_GPU, options};

/// synthetic:tiny made on the device: the real 248,320-token vocabulary.
fn backend() -> CudaBackend {
    let config = synthetic_config("tiny").unwrap();
    let mut source = SyntheticWeights::new(SYNTHETIC_SEED);
    CudaBackend::from_source(config, &mut source, &options(KvPrecision::F32, 64)).unwrap()
}

/// A row of logits of one kind, different for each seed.
fn row(kind: usize, vocab: usize, seed: u64) -> Vec<f32> {
    let u = |i: usize| uniform_at(seed, i as u64);
    (0..vocab)
        .map(|i| match kind {
            // A language model's shape: a handful of strong tokens over a low floor.
            0 => {
                if (i as u64 * 2_654_435_761 + seed).is_multiple_of(9_973) {
                    14.0 + 3.0 * u(i)
                } else {
                    2.0 * u(i)
                }
            }
            // Flat, as a random model's: the kept tokens reach far past the best 64.
            1 => 0.5 * u(i),
            // Coarse steps, so that ties are everywhere and ids must break them.
            2 => (u(i) * 4.0).round() * 0.5,
            // NaN and -inf scattered over a peaked row.
            _ => match i % 997 {
                3 => f32::NAN,
                5 => f32::NEG_INFINITY,
                _ => 6.0 * u(i),
            },
        })
        .collect()
}

fn params(which: usize, seed: u64) -> SamplingParams {
    let (temperature, top_k, top_p, min_p) = [
        (0.0, 0, 1.0, 0.0),
        (0.7, 20, 0.8, 0.0),
        (1.0, 0, 1.0, 0.0),
        (1.3, 50, 1.0, 0.05),
        (0.5, 0, 0.95, 0.0),
        (1.0, 64, 1.0, 0.0),
        // Past the 64 candidates: the host finishes.
        (1.0, 100, 0.9, 0.0),
        (0.8, 0, 1.0, 0.3),
    ][which];
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
    }
}

fn penalties(which: usize) -> Penalties {
    match which {
        0 => Penalties::default(),
        1 => Penalties {
            presence: 0.5,
            frequency: 0.3,
            ..Penalties::default()
        },
        2 => Penalties {
            repetition: 1.3,
            ..Penalties::default()
        },
        _ => Penalties {
            presence: -0.2,
            repetition: 0.8,
            logit_bias: vec![(17, 100.0), (4_000, -100.0), (17, 1.5), (248_000, 3.0)],
            ..Penalties::default()
        },
    }
}

/// A mask: none, a random sparse one, all but a few ids, or exactly one token below `below`
/// (and not one of the NaN or -inf ids of row kind 3).
fn mask(which: usize, vocab: usize, below: usize, seed: u64) -> Option<Vec<u32>> {
    let words = vocab.div_ceil(32);
    match which {
        0 => None,
        1 => {
            let mut rng = Rng::new(seed);
            let mut bits = vec![0u32; words];
            for _ in 0..vocab / 100 {
                let id = (rng.next_u64() % vocab as u64) as usize;
                bits[id / 32] |= 1 << (id % 32);
            }
            Some(bits)
        }
        2 => None,
        _ => {
            let mut bits = vec![0u32; words];
            let mut id = (seed as usize * 7_919) % below;
            if matches!(id % 997, 3 | 5) {
                id -= 1;
            }
            bits[id / 32] |= 1 << (id % 32);
            Some(bits)
        }
    }
}

/// Equal to 1e-5, or both NaN (a row holding NaN has no log-normaliser on either side).
fn close(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || (a - b).abs() < 1e-5
}

fn assert_same_pick(device: &Pick, host: &Pick, case: &str) {
    assert_eq!(device.token, host.token, "{case}: the token");
    match (&device.logprobs, &host.logprobs) {
        (None, None) => {}
        (Some(d), Some(h)) => {
            assert!(close(d.logprob, h.logprob), "{case}: {d:?} {h:?}");
            let ids = |l: &lily_core::logprobs::TokenLogprobs| -> Vec<u32> {
                l.top.iter().map(|t| t.0).collect()
            };
            assert_eq!(ids(d), ids(h), "{case}: the top ids");
            for (a, b) in d.top.iter().zip(&h.top) {
                assert!(close(a.1, b.1), "{case}: {a:?} {b:?}");
            }
        }
        _ => panic!("{case}: log-probabilities on one side only"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_devices_choice_is_the_hosts_for_every_kind_of_request() {
    eprintln!("{NEEDS_GPU}: running");
    let gpu = backend();
    let vocab = gpu.config().vocab_size;
    let except = [248_046u32, 248_044, 17, 3];
    let limits = [None, Some(248_077), Some(3_000), Some(1)];
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 811) % vocab as u32).collect();
    for case in 0..240usize {
        let seed = case as u64;
        let (kind, which, mask_kind) = (case % 4, case % 8, case % 5 % 4);
        let penalty = penalties((case / 3) % 4);
        let limit = limits[(case / 2) % 4];
        let logprobs = [None, Some(0), Some(5), Some(20)][(case / 5) % 4];
        let logits = row(kind, vocab, seed);
        let below = limit.unwrap_or(vocab);
        let bits = mask(mask_kind, vocab, below, seed);
        // A single choosable id and a mask would leave nothing to choose: no mask there.
        let allowed = match (&bits, case % 5) {
            _ if below == 1 => None,
            (Some(bits), _) => Some(Allowed::Bits(bits)),
            (None, 2) => Some(Allowed::Except(&except)),
            (None, _) => None,
        };
        let mut sampler = Sampler::new(params(which, seed)).with_penalties(penalty, &prompt);
        if let Some(l) = limit {
            sampler = sampler.with_vocab_limit(l);
        }
        // Tokens generated before, so that presence, frequency and repetition have counts.
        for t in [17u32, 17, 900, 5, 248_000] {
            sampler.record(t);
        }
        let label = format!(
            "case {case}: row {kind}, params {which}, mask {mask_kind}/{}, limit {limit:?}, \
             logprobs {logprobs:?}",
            case % 5
        );
        let (mut on_device, mut on_host) = (sampler.clone(), sampler);
        for step in 0..2 {
            let device = gpu
                .choose_from(
                    &logits,
                    &mut Choice {
                        sampler: &mut on_device,
                        allowed,
                        logprobs,
                    },
                )
                .unwrap();
            let host = Choice {
                sampler: &mut on_host,
                allowed,
                logprobs,
            }
            .pick(&logits);
            let label = format!("{label}, step {step}");
            assert_same_pick(&device, &host, &label);
            if let Some(a) = &allowed {
                assert!(a.allows(device.token), "{label}: a masked token");
            }
            if let Some(l) = limit {
                assert!((device.token as usize) < l, "{label}: past the limit");
            }
            // Both samplers drew once and counted the token.
            assert_eq!(on_device.adjustments(), on_host.adjustments(), "{label}");
        }
        assert_eq!(
            on_device.draw(),
            on_host.draw(),
            "{label}: the streams parted"
        );
    }
    let counts = gpu.pick_counts().unwrap();
    eprintln!("choices on the device {counts:?}");
    // Both routes ran: the device alone, and the host finishing a choice the device could not.
    assert!(counts.on_device > 300, "{counts:?}");
    assert!(counts.finished_on_host > 10, "{counts:?}");
}

/// Decode steps whose choices the device makes (sampled, penalised, masked, with
/// log-probabilities) give what the host makes from the same step's logits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_steps_make_the_hosts_choice_on_the_device() {
    let gpu = backend();
    let vocab = gpu.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7_919 + 11) % vocab).collect();
    let forbidden = [248_046u32, 248_044];
    for (which, logprobs) in [(0, Some(3)), (1, None), (3, Some(20)), (4, Some(1))] {
        let penalty = penalties(which % 4);
        let mut sampler = Sampler::new(params(which, 5)).with_penalties(penalty, &prompt);
        let mut host_sampler = sampler.clone();
        let mut state = gpu.new_state(prompt.len() + 12).unwrap();
        let allowed = Some(Allowed::Except(&forbidden));
        let mut choice = Choice {
            sampler: &mut sampler,
            allowed,
            logprobs,
        };
        let mut probe = gpu.new_state(prompt.len() + 12).unwrap();
        let logits = gpu
            .prefill(&mut probe, &prompt, lily_core::backend::LogitRows::Last)
            .unwrap();
        let mut host = Choice {
            sampler: &mut host_sampler,
            allowed,
            logprobs,
        };
        let first = gpu
            .prefill_choose(&mut state, &prompt, &mut choice)
            .unwrap();
        assert_same_pick(&first, &host.pick(&logits), "the first token");
        let mut last = first.token;
        for step in 0..10 {
            let mut fork = gpu.fork(&state).unwrap();
            let expected = host.pick(&gpu.decode(&mut fork, last).unwrap());
            let got = gpu.decode_choose(&mut state, last, &mut choice).unwrap();
            assert_same_pick(&got, &expected, &format!("params {which}, step {step}"));
            assert!(!forbidden.contains(&got.token));
            last = got.token;
        }
        assert_eq!(gpu.state_len(&state), prompt.len() + 10);
    }
}

/// What a choice on the device costs a token, host time included (uploads, five launches, the
/// read-back): printed for docs/BENCHMARKS.md, asserted on nothing but its answers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_cost_of_a_choice_on_the_device() {
    let gpu = backend();
    let vocab = gpu.config().vocab_size;
    let logits = row(0, vocab, 3);
    let bits = mask(1, vocab, vocab, 3).unwrap();
    let prompt: Vec<u32> = (0..2_000u32).map(|i| (i * 811) % vocab as u32).collect();
    let repetition = Penalties {
        repetition: 1.1,
        presence: 0.5,
        ..Penalties::default()
    };
    let qwen = params(1, 1);
    let cases: [(&str, Sampler, bool, Option<usize>); 5] = [
        (
            "greedy, 20 log-probabilities",
            Sampler::new(params(0, 1)),
            false,
            Some(20),
        ),
        (
            "temperature 0.7, top-k 20, top-p 0.8",
            Sampler::new(qwen.clone()),
            false,
            None,
        ),
        (
            "the same, grammar mask (bits)",
            Sampler::new(qwen.clone()),
            true,
            None,
        ),
        (
            "the same, penalties over a 2,000-token prompt",
            Sampler::new(qwen.clone()).with_penalties(repetition, &prompt),
            false,
            None,
        ),
        (
            "the same, all of it and 5 log-probabilities",
            Sampler::new(qwen),
            true,
            Some(5),
        ),
    ];
    // choose_from uploads the row before each pick, which a step does not: that upload is
    // timed alone and taken off.
    let n = 50;
    let plain = Gpu::new(gpu.config(), KvPrecision::F32).unwrap();
    let upload = per_call(n, || drop(plain.upload(&logits).unwrap()));
    eprintln!("the row's upload alone: {:.0} µs", upload * 1e6);
    eprintln!("| choice on the device (H200) | µs a token |\n|---|---:|");
    for (name, mut sampler, masked, logprobs) in cases {
        let allowed = masked.then_some(Allowed::Bits(&bits));
        let mut pick = || {
            let mut choice = Choice {
                sampler: &mut sampler,
                allowed,
                logprobs,
            };
            drop(gpu.choose_from(&logits, &mut choice).unwrap());
        };
        (0..5).for_each(|_| pick());
        let each = per_call(n, pick);
        eprintln!("| {name} | {:.0} |", (each - upload) * 1e6);
    }
}

/// Seconds a call of `f`, the mean of `n`.
fn per_call(n: usize, mut f: impl FnMut()) -> f64 {
    let start = std::time::Instant::now();
    (0..n).for_each(|_| f());
    start.elapsed().as_secs_f64() / n as f64
}
