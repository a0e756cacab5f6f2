//! Token-level generation for callers without a tokenizer (`lily generate --tokens`, the
//! backends' tests): chunked prefill, then one token per step until a stop token or the token
//! budget. Text generation (stop strings, several sequences at once) is the server's engine,
//! which ends its generations with the same [`Finish`].

use std::ops::ControlFlow;

use anyhow::{Context, Result, ensure};

use crate::backend::{Backend, DecodeRow, LogitRows};
use crate::choice::{Choice, Pick};
use crate::sampling::Sampler;

/// How a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was produced (it is not part of the output), or a stop string.
    Stop,
    /// `max_tokens` were produced, or the context is full.
    Length,
    /// The consumer went away, or asked to stop.
    Cancelled,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: Finish,
}

/// Feeds `tokens` in chunks the backend accepts; returns the logits of `rows`.
pub fn prefill<B: Backend>(
    backend: &B,
    state: &mut B::State,
    tokens: &[u32],
    rows: LogitRows,
) -> Result<Vec<f32>> {
    ensure!(!tokens.is_empty(), "prefill needs at least one token");
    let chunk = backend.max_prefill_chunk().max(1);
    let mut out = Vec::new();
    let pieces: Vec<&[u32]> = tokens.chunks(chunk).collect();
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        match rows {
            LogitRows::All => out.extend(backend.prefill(state, piece, LogitRows::All)?),
            LogitRows::Last if last => out = backend.prefill(state, piece, LogitRows::Last)?,
            // Earlier chunks of a generation prompt need no logits at all.
            LogitRows::Last | LogitRows::None => {
                backend.prefill(state, piece, LogitRows::None)?;
            }
        }
    }
    Ok(out)
}

/// Feeds `tokens` in chunks the backend accepts and makes the choice that follows them, on the
/// device where the backend can.
pub fn prefill_choose<B: Backend>(
    backend: &B,
    state: &mut B::State,
    tokens: &[u32],
    choice: &mut Choice<'_>,
) -> Result<Pick> {
    ensure!(!tokens.is_empty(), "prefill needs at least one token");
    let chunk = backend.max_prefill_chunk().max(1);
    let split = (tokens.len() - 1) / chunk * chunk;
    if split > 0 {
        prefill(backend, state, &tokens[..split], LogitRows::None)?;
    }
    backend.prefill_choose(state, &tokens[split..], choice)
}

/// Prefills `prompt`, then samples up to `max_tokens` tokens. `on_token` sees each token as it is
/// chosen and may stop generation early. Each step lets the backend queue the next one before
/// the host sees its token ([`DecodeRow::queue_next`]), so a state that ends on a stop token or
/// a cancel may have fed that token too.
pub fn generate<B: Backend>(
    backend: &B,
    state: &mut B::State,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation> {
    let mut tokens = Vec::new();
    if max_tokens == 0 {
        return Ok(Generation {
            tokens,
            finish: Finish::Length,
        });
    }
    let mut choice = Choice::of(sampler);
    let mut next = prefill_choose(backend, state, prompt, &mut choice)?.token;
    loop {
        if stop_ids.contains(&next) {
            return Ok(Generation {
                tokens,
                finish: Finish::Stop,
            });
        }
        tokens.push(next);
        if on_token(next).is_break() {
            return Ok(Generation {
                tokens,
                finish: Finish::Cancelled,
            });
        }
        if tokens.len() >= max_tokens {
            return Ok(Generation {
                tokens,
                finish: Finish::Length,
            });
        }
        let mut row = [DecodeRow {
            state: &mut *state,
            token: next,
            choice: choice.reborrow(),
            queue_next: tokens.len() + 1 < max_tokens,
        }];
        let picks = backend.decode_batch(&mut row)?;
        next = picks.first().context("the backend returned no pick")?.token;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
    use crate::sampling::SamplingParams;

    /// Records the calls a front end makes; the logits favour the token after the last one fed.
    struct Recorder {
        config: ModelConfig,
        chunk: usize,
        calls: Mutex<Vec<(&'static str, usize)>>,
    }

    impl Backend for Recorder {
        type State = Vec<u32>;

        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn device_name(&self) -> String {
            "recorder".into()
        }
        fn max_prefill_chunk(&self) -> usize {
            self.chunk
        }
        fn new_state(&self, _: usize) -> Result<Vec<u32>> {
            Ok(Vec::new())
        }
        fn state_len(&self, state: &Vec<u32>) -> usize {
            state.len()
        }
        fn fork(&self, state: &Vec<u32>) -> Result<Vec<u32>> {
            Ok(state.clone())
        }
        fn prefill(&self, state: &mut Vec<u32>, tokens: &[u32], _: LogitRows) -> Result<Vec<f32>> {
            Ok(self.feed("prefill", state, tokens))
        }
        fn prefill_choose(
            &self,
            state: &mut Vec<u32>,
            tokens: &[u32],
            choice: &mut Choice<'_>,
        ) -> Result<Pick> {
            Ok(choice.pick(&self.feed("prefill_choose", state, tokens)))
        }
    }

    impl Recorder {
        fn feed(&self, call: &'static str, state: &mut Vec<u32>, tokens: &[u32]) -> Vec<f32> {
            self.calls.lock().unwrap().push((call, tokens.len()));
            state.extend(tokens);
            let mut logits = vec![0.0; 16];
            logits[(*state.last().unwrap() as usize + 1) % 16] = 1.0;
            logits
        }
    }

    #[test]
    fn prefill_choose_feeds_whole_chunks_then_samples_the_last() {
        for (len, chunk, calls) in [
            (
                10,
                4,
                vec![("prefill", 4), ("prefill", 4), ("prefill_choose", 2)],
            ),
            (8, 4, vec![("prefill", 4), ("prefill_choose", 4)]),
            (3, 4, vec![("prefill_choose", 3)]),
            (1, 1, vec![("prefill_choose", 1)]),
        ] {
            let backend = Recorder {
                config: ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap(),
                chunk,
                calls: Mutex::new(Vec::new()),
            };
            let tokens: Vec<u32> = (0..len as u32).collect();
            let mut state = Vec::new();
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let next = prefill_choose(&backend, &mut state, &tokens, &mut Choice::of(&mut sampler))
                .unwrap()
                .token;
            assert_eq!(next, len as u32 % 16, "{len} in chunks of {chunk}");
            assert_eq!(state, tokens);
            assert_eq!(
                *backend.calls.lock().unwrap(),
                calls,
                "{len} in chunks of {chunk}"
            );
        }
        let backend = Recorder {
            config: ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap(),
            chunk: 4,
            calls: Mutex::new(Vec::new()),
        };
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let mut choice = Choice::of(&mut sampler);
        assert!(prefill_choose(&backend, &mut Vec::new(), &[], &mut choice).is_err());
    }

    /// The trait's forks inside a prefill: two prefills around a fork, the second choosing where
    /// asked; the fork holds the tokens before `at`, the state all of them; a fork at either end
    /// is refused before anything runs.
    #[test]
    fn a_default_fork_inside_a_prefill_is_two_prefills_around_a_fork() {
        let backend = Recorder {
            config: ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap(),
            chunk: 64,
            calls: Mutex::new(Vec::new()),
        };
        let tokens: Vec<u32> = (0..10).collect();
        let mut state = Vec::new();
        let (_, fork) = backend
            .prefill_forking(&mut state, &tokens, 3, LogitRows::Last)
            .unwrap();
        assert_eq!(
            (fork.as_slice(), state.as_slice()),
            (&tokens[..3], &tokens[..])
        );
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let mut state = Vec::new();
        let (pick, fork) = backend
            .prefill_choose_forking(&mut state, &tokens, 9, &mut Choice::of(&mut sampler))
            .unwrap();
        assert_eq!(
            (fork.as_slice(), state.as_slice()),
            (&tokens[..9], &tokens[..])
        );
        assert_eq!(pick.token, 10);
        let calls = vec![
            ("prefill", 3),
            ("prefill", 7),
            ("prefill", 9),
            ("prefill_choose", 1),
        ];
        assert_eq!(*backend.calls.lock().unwrap(), calls);
        let mut state = Vec::new();
        for at in [0, 10, 11] {
            let refused = backend.prefill_forking(&mut state, &tokens, at, LogitRows::None);
            assert!(refused.is_err(), "a fork at {at} of 10");
        }
        assert!(state.is_empty());
        assert_eq!(backend.calls.lock().unwrap().len(), 4);
    }
}
