//! The engine on `synthetic:tiny` (real vocabulary, random weights) with the real tokenizer and
//! template.

use std::ops::ControlFlow;
use std::sync::{Arc, OnceLock};

use lily_chat::TextModel;
use lily_core::backend::LogitRows;
use lily_core::logprobs::TokenLogprobs;
use lily_core::sampling::SamplingParams;
use serde_json::{Map, Value, json};

use super::*;
use crate::backends::AnyBackend;
use crate::device::{Device, load_with};
use crate::serve::prompt::chat_prompt;

pub(super) fn text_model() -> Arc<TextModel> {
    static TEXT: OnceLock<Arc<TextModel>> = OnceLock::new();
    TEXT.get_or_init(|| Arc::new(TextModel::embedded().unwrap()))
        .clone()
}

pub(super) fn engine(snapshot_budget: usize) -> Engine<AnyBackend> {
    let backend = load_with("synthetic:tiny", Device::Cpu, false).unwrap();
    Engine::new(backend, text_model(), 4096, snapshot_budget).unwrap()
}

pub(super) fn job(
    messages: &[Value],
    max_tokens: usize,
    sampling: SamplingParams,
) -> GenerationJob {
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), false.into());
    let prompt = chat_prompt(&text_model(), messages, &[], &kwargs).unwrap();
    GenerationJob {
        turn_boundary: prompt.turn_boundary,
        ..GenerationJob::plain(prompt.tokens, max_tokens, sampling)
    }
}

/// Runs `job`, returning the outcome and the text it streamed.
fn run(engine: &mut Engine<AnyBackend>, job: &GenerationJob) -> (Outcome, String) {
    let mut text = String::new();
    let outcome = engine
        .run(
            job,
            |event| {
                if let EngineEvent::Text { text: t, .. } = event {
                    text.push_str(&t);
                }
                ControlFlow::Continue(())
            },
            || false,
        )
        .unwrap();
    (outcome, text)
}

pub(super) fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.0,
        seed,
    }
}

#[test]
fn the_same_seed_gives_the_same_output_and_another_seed_differs() {
    let mut engine = engine(0);
    let messages = [json!({"role": "user", "content": "Write a haiku."})];
    let (a, text_a) = run(&mut engine, &job(&messages, 24, sampled(7)));
    let (b, text_b) = run(&mut engine, &job(&messages, 24, sampled(7)));
    let (c, _) = run(&mut engine, &job(&messages, 24, sampled(8)));
    assert_eq!(a.tokens().len(), 24);
    assert_eq!(a.finish(), Finish::Length);
    assert_eq!((&a.tokens(), &text_a), (&b.tokens(), &text_b));
    assert_ne!(a.tokens(), c.tokens());
    // The streamed text is the decoding of the tokens.
    assert_eq!(text_a, text_model().tokenizer.decode(a.tokens()));
    // Undecodable padding ids of the lm_head are never sampled.
    let limit = text_model().tokenizer.decodable_len() as u32;
    assert!(a.tokens().iter().chain(c.tokens()).all(|&t| t < limit));
}

#[test]
fn a_second_turn_reuses_the_first_and_matches_a_cold_run() {
    let mut warm = engine(256 << 20);
    let first = [json!({"role": "user", "content": "Name a colour."})];
    let first_job = job(&first, 6, SamplingParams::greedy());
    let (turn1, reply) = run(&mut warm, &first_job);
    assert_eq!(turn1.cached_tokens, 0);
    // Two snapshots, each an f32 KV cache of its tokens plus the fixed recurrent state, and no
    // logits: a single choice chose its first token with the prompt's last chunk. (A reply cut
    // by max_tokens adds none.)
    let c = warm.backend.config();
    let fixed = c.conv_state_bytes(4) + c.recurrent_state_bytes();
    let boundary = first_job.turn_boundary.unwrap();
    let kv = c.kv_bytes_per_token(4) * (boundary + first_job.prompt.len()) as u64;
    let expected = kv + 2 * fixed;
    assert_eq!(turn1.finish(), Finish::Length);
    assert_eq!(warm.snapshot_usage(), (2, expected as usize));
    let second = [
        first[0].clone(),
        json!({"role": "assistant", "content": reply}),
        json!({"role": "user", "content": "And another?"}),
    ];
    let second_job = job(&second, 8, SamplingParams::greedy());
    let (turn2, text2) = run(&mut warm, &second_job);
    // At least the first user turn (`<|im_start|>user\n…<|im_end|>\n`) came from a snapshot.
    let first_turn = job(&first, 1, SamplingParams::greedy())
        .turn_boundary
        .unwrap();
    assert!(turn2.cached_tokens >= first_turn, "{turn2:?}");
    assert!(turn2.cached_tokens < second_job.prompt.len());

    let mut cold = engine(0);
    let (cold2, cold_text) = run(&mut cold, &second_job);
    assert_eq!(cold2.cached_tokens, 0);
    assert_eq!((turn2.tokens(), &text2), (cold2.tokens(), &cold_text));

    // The same prompt again: the snapshot after it kept no logits to choose from, so it starts
    // at the conversation before its generation prompt, and gives the same tokens.
    let (again, text_again) = run(&mut warm, &second_job);
    assert_eq!(again.cached_tokens, second_job.turn_boundary.unwrap());
    assert_eq!((again.tokens(), &text_again), (cold2.tokens(), &cold_text));

    // Several choices share the prompt's logits on the host, and the snapshot keeps them: the
    // same prompt asked for again then needs no prefill at all.
    let two = GenerationJob {
        n: 2,
        ..second_job.clone()
    };
    run(&mut warm, &two);
    let (whole, _) = run(&mut warm, &second_job);
    assert_eq!(whole.cached_tokens, second_job.prompt.len());
    assert_eq!(whole.tokens(), cold2.tokens());
}

#[test]
fn stop_strings_end_the_output_before_them() {
    let mut engine = engine(0);
    let messages = [json!({"role": "user", "content": "Count."})];
    let plain = job(&messages, 16, SamplingParams::greedy());
    let (full, text) = run(&mut engine, &plain);
    // A stop string made of the last character of one token and the first of the next.
    let tokenizer = &text_model().tokenizer;
    let (k, stop) = (1..full.tokens().len())
        .find_map(|k| {
            let before = tokenizer.decode(&full.tokens()[..k]);
            let after = tokenizer.decode(&full.tokens()[..k + 1]);
            let added = after.strip_prefix(before.as_str())?;
            let stop = format!("{}{}", before.chars().last()?, added.chars().next()?);
            (!stop.contains('\u{FFFD}')).then_some((k, stop))
        })
        .expect("two adjacent tokens that decode on their own");
    let mut with_stop = plain.clone();
    with_stop.stop = vec![stop.clone()];
    let (stopped, stopped_text) = run(&mut engine, &with_stop);
    assert_eq!(stopped.finish(), Finish::Stop);
    let first = text.find(&stop).unwrap();
    assert_eq!(stopped_text, text[..first]);
    assert!(stopped.tokens().len() <= k + 1);
    assert_eq!(stopped.tokens(), &full.tokens()[..stopped.tokens().len()]);
}

#[test]
fn a_consumer_that_goes_away_cancels_the_generation() {
    let mut engine = engine(0);
    let messages = [json!({"role": "user", "content": "Talk."})];
    let mut texts = 0;
    let outcome = engine
        .run(
            &job(&messages, 50, SamplingParams::greedy()),
            |event| match event {
                EngineEvent::Text { .. } => {
                    texts += 1;
                    ControlFlow::Break(())
                }
                EngineEvent::Started { .. } => ControlFlow::Continue(()),
            },
            || false,
        )
        .unwrap();
    assert_eq!(outcome.finish(), Finish::Cancelled);
    assert_eq!(texts, 1);
    assert!(outcome.tokens().len() < 50);
    // Cancelled before the prefill: nothing is generated.
    let outcome = engine
        .run(
            &job(&messages, 50, SamplingParams::greedy()),
            |_| ControlFlow::Continue(()),
            || true,
        )
        .unwrap();
    assert_eq!(outcome.finish(), Finish::Cancelled);
    assert!(outcome.tokens().is_empty());
}

/// Runs `job`, returning the outcome, the text of each choice and its log-probabilities.
fn run_choices(
    engine: &mut Engine<AnyBackend>,
    job: &GenerationJob,
) -> (Outcome, Vec<String>, Vec<Vec<TokenLogprobs>>) {
    let mut texts = vec![String::new(); job.n];
    let mut logprobs = vec![Vec::new(); job.n];
    let outcome = engine
        .run(
            job,
            |event| {
                if let EngineEvent::Text {
                    choice,
                    text,
                    logprobs: lp,
                } = event
                {
                    texts[choice].push_str(&text);
                    logprobs[choice].extend(lp);
                }
                ControlFlow::Continue(())
            },
            || false,
        )
        .unwrap();
    (outcome, texts, logprobs)
}

/// Teacher-forced log p(tokens[t]) for t ≥ `from`, as `lily score` computes them.
fn scored(engine: &Engine<AnyBackend>, tokens: &[u32], from: usize) -> Vec<f64> {
    let backend = &engine.backend;
    let vocab = backend.config().vocab_size;
    let mut state = backend.new_state(tokens.len()).unwrap();
    let logits = lily_core::generate::prefill(backend, &mut state, tokens, LogitRows::All).unwrap();
    (from..tokens.len())
        .map(|t| {
            lily_core::logprobs::log_softmax_at(
                &logits[(t - 1) * vocab..t * vocab],
                tokens[t] as usize,
            )
        })
        .collect()
}

#[test]
fn logprobs_of_generated_tokens_are_what_teacher_forced_scoring_gives() {
    let mut engine = engine(0);
    let messages = [json!({"role": "user", "content": "Name three rivers."})];
    for sampling in [SamplingParams::greedy(), sampled(3)] {
        let mut with_logprobs = job(&messages, 12, sampling.clone());
        with_logprobs.logprobs = Some(5);
        let (outcome, _, logprobs) = run_choices(&mut engine, &with_logprobs);
        let tokens = outcome.tokens();
        assert_eq!(tokens.len(), 12);
        // The same tokens as without log-probabilities (the device path, where there is one).
        let (plain, _) = run(&mut engine, &job(&messages, 12, sampling.clone()));
        assert_eq!(plain.tokens(), tokens);
        let lp = &logprobs[0];
        assert_eq!(lp.iter().map(|l| l.token).collect::<Vec<_>>(), tokens);
        let sequence = [with_logprobs.prompt.as_slice(), tokens].concat();
        let expected = scored(&engine, &sequence, with_logprobs.prompt.len());
        for (i, (got, want)) in lp.iter().zip(&expected).enumerate() {
            assert!(
                (got.logprob as f64 - want).abs() < 1e-4,
                "token {i}: {got:?} vs {want}"
            );
            assert_eq!(got.top.len(), 5);
            assert!(got.top.windows(2).all(|w| w[0].1 >= w[1].1), "{got:?}");
            // The chosen token is among the alternatives at its own log-probability, or below.
            assert!(got.logprob <= got.top[0].1 + 1e-6);
        }
        if sampling.is_greedy() {
            assert!(lp.iter().all(|l| l.top[0].0 == l.token), "{lp:?}");
        }
    }
}

#[test]
fn prompt_logprobs_score_every_prompt_token_after_the_first() {
    let mut engine = engine(0);
    let mut scored_job = job(
        &[json!({"role": "user", "content": "Hi there."})],
        0,
        SamplingParams::greedy(),
    );
    scored_job.prompt_logprobs = Some(2);
    let mut prompt_logprobs = Vec::new();
    let outcome = engine
        .run(
            &scored_job,
            |event| {
                if let EngineEvent::Started {
                    prompt_logprobs: p, ..
                } = event
                {
                    prompt_logprobs = p;
                }
                ControlFlow::Continue(())
            },
            || false,
        )
        .unwrap();
    assert_eq!(outcome.completion_tokens(), 0);
    assert_eq!(outcome.finish(), Finish::Length);
    let prompt = &scored_job.prompt;
    assert_eq!(prompt_logprobs.len(), prompt.len() - 1);
    let expected = scored(&engine, prompt, 1);
    for ((got, want), &token) in prompt_logprobs.iter().zip(&expected).zip(&prompt[1..]) {
        assert_eq!(got.token, token);
        assert!(
            (got.logprob as f64 - want).abs() < 1e-4,
            "{got:?} vs {want}"
        );
    }
}

#[test]
fn n_greedy_choices_equal_one_choice_and_seeded_choices_differ_but_repeat() {
    let mut engine = engine(0);
    let messages = [json!({"role": "user", "content": "Write a haiku."})];
    let (one, one_text) = run(&mut engine, &job(&messages, 10, SamplingParams::greedy()));
    let mut three = job(&messages, 10, SamplingParams::greedy());
    three.n = 3;
    let (outcome, texts, _) = run_choices(&mut engine, &three);
    assert_eq!(outcome.choices.len(), 3);
    for (choice, text) in outcome.choices.iter().zip(&texts) {
        assert_eq!((&choice.tokens[..], text), (one.tokens(), &one_text));
    }
    assert_eq!(outcome.completion_tokens(), 3 * one.tokens().len());

    let mut sampled_three = job(&messages, 16, sampled(21));
    sampled_three.n = 3;
    let (a, a_texts, _) = run_choices(&mut engine, &sampled_three);
    let (b, b_texts, _) = run_choices(&mut engine, &sampled_three);
    assert_eq!((&a, &a_texts), (&b, &b_texts));
    let tokens: Vec<&Vec<u32>> = a.choices.iter().map(|c| &c.tokens).collect();
    assert!(tokens[0] != tokens[1] && tokens[1] != tokens[2] && tokens[0] != tokens[2]);
    // The first choice is what n = 1 gives with the same seed.
    let (single, _) = run(&mut engine, &job(&messages, 16, sampled(21)));
    assert_eq!(single.tokens(), &tokens[0][..]);
}

#[test]
fn logit_bias_reaches_the_sampler_on_the_greedy_path() {
    let mut engine = engine(0);
    let messages = [json!({"role": "user", "content": "Say something."})];
    let mut forced = job(&messages, 6, SamplingParams::greedy());
    forced.penalties.logit_bias = vec![(9419, 100.0)];
    let (outcome, text) = run(&mut engine, &forced);
    assert_eq!(outcome.tokens(), [9419; 6]);
    assert_eq!(text, "Hello".repeat(6));
}

/// The engine's backend, counting the chunks chosen where the logits are (`prefill_choose`),
/// those whose logits were sent to the host (`prefill` of any rows but none), and the chunks
/// that took a fork inside their pass (`prefill_forking`, `prefill_choose_forking`).
struct Counting {
    inner: AnyBackend,
    chosen: std::sync::atomic::AtomicUsize,
    logits: std::sync::atomic::AtomicUsize,
    forks: std::sync::atomic::AtomicUsize,
    /// "fork" for every `fork` (a snapshot's copy), in order with what a test's sink adds.
    log: std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>,
}

impl Backend for Counting {
    type State = <AnyBackend as Backend>::State;

    fn config(&self) -> &lily_core::config::ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn max_prefill_chunk(&self) -> usize {
        self.inner.max_prefill_chunk()
    }
    fn new_state(&self, max_seq: usize) -> Result<Self::State> {
        self.inner.new_state(max_seq)
    }
    fn state_len(&self, state: &Self::State) -> usize {
        self.inner.state_len(state)
    }
    fn fork(&self, state: &Self::State) -> Result<Self::State> {
        self.log.lock().unwrap().push("fork");
        self.inner.fork(state)
    }
    fn state_bytes(&self, state: &Self::State) -> usize {
        self.inner.state_bytes(state)
    }
    fn prefill(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        rows: LogitRows,
    ) -> Result<Vec<f32>> {
        if rows != LogitRows::None {
            self.logits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.inner.prefill(state, tokens, rows)
    }
    fn prefill_choose(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        choice: &mut lily_core::choice::Choice<'_>,
    ) -> Result<lily_core::choice::Pick> {
        self.chosen
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.prefill_choose(state, tokens, choice)
    }
    fn prefill_forking(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        at: usize,
        rows: LogitRows,
    ) -> Result<(Vec<f32>, Self::State)> {
        self.forks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.prefill_forking(state, tokens, at, rows)
    }
    fn prefill_choose_forking(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        at: usize,
        choice: &mut lily_core::choice::Choice<'_>,
    ) -> Result<(lily_core::choice::Pick, Self::State)> {
        self.forks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.prefill_choose_forking(state, tokens, at, choice)
    }
    fn decode_batch(
        &self,
        rows: &mut [lily_core::backend::DecodeRow<'_, Self::State>],
    ) -> Result<Vec<lily_core::choice::Pick>> {
        self.inner.decode_batch(rows)
    }
}

#[test]
fn one_choice_is_chosen_with_the_prompts_last_chunk_and_several_share_host_logits() {
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let counting = || Counting {
        inner: load_with("synthetic:tiny", Device::Cpu, false).unwrap(),
        chosen: 0.into(),
        logits: 0.into(),
        forks: 0.into(),
        log: log.clone(),
    };
    let counts = |e: &Engine<Counting>| {
        let load =
            |a: &std::sync::atomic::AtomicUsize| a.load(std::sync::atomic::Ordering::Relaxed);
        (
            load(&e.backend.chosen),
            load(&e.backend.logits),
            load(&e.backend.forks),
        )
    };
    let messages = [json!({"role": "user", "content": "Name a colour."})];
    let one = job(&messages, 5, sampled(3));
    let quiet = |_: EngineEvent| ControlFlow::Continue(());
    // With room for snapshots, the one keeping the conversation before the generation prompt is
    // a fork taken inside the prompt's one pass, which chooses the first token too.
    let mut kept = Engine::new(counting(), text_model(), 4096, 256 << 20).unwrap();
    let texts = |event: EngineEvent| {
        if let EngineEvent::Text { .. } = event {
            log.lock().unwrap().push("text");
        }
        ControlFlow::Continue(())
    };
    let forked = kept.run(&one, texts, || false).unwrap();
    assert_eq!(counts(&kept), (0, 0, 1));
    // The snapshot after the prompt is copied once the first token's text has gone out.
    let order = log.lock().unwrap().clone();
    assert_eq!(order[..2], ["text", "fork"], "{order:?}");
    // Asked again, the prompt starts from the snapshot at its boundary: no fork to take.
    let again = kept.run(&one, quiet, || false).unwrap();
    assert_eq!(again.cached_tokens, one.turn_boundary.unwrap());
    assert_eq!(counts(&kept), (1, 0, 1));

    // No snapshots: every prompt goes in whole, in one chunk, and nothing is forked.
    let mut engine = Engine::new(counting(), text_model(), 4096, 0).unwrap();
    let sole = engine.run(&one, quiet, || false).unwrap();
    assert_eq!(counts(&engine), (1, 0, 0));
    assert_eq!(sole.tokens(), forked.tokens());
    assert_eq!(sole.tokens(), again.tokens());

    // Two choices: one prefill whose logits both pick from on the host, none made with the chunk.
    // The first choice has the sole one's seed, so it takes the same tokens by the other route.
    let two = GenerationJob {
        n: 2,
        ..one.clone()
    };
    let both = engine.run(&two, quiet, || false).unwrap();
    assert_eq!(counts(&engine), (1, 1, 0));
    assert_eq!(sole.tokens().len(), 5);
    assert_eq!(both.tokens(), sole.tokens());
    // A scored prompt brings its logits back too; no token to generate needs no choice.
    let scored = GenerationJob {
        prompt_logprobs: Some(2),
        ..one.clone()
    };
    engine.run(&scored, quiet, || false).unwrap();
    let none = GenerationJob {
        max_tokens: 0,
        ..one
    };
    engine.run(&none, quiet, || false).unwrap();
    assert_eq!(counts(&engine), (1, 3, 0));
}
