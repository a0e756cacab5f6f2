//! The sampling stage: one generation's walk from token to token. It holds the sampler, the
//! log-probabilities asked for and the constraint (a grammar the output must follow), and at
//! every step hands the backend the whole [`Choice`]: a device backend makes it where the logits
//! are (the mask, the penalties and the top log-probabilities included), the CPU with
//! [`Choice::pick`]. A batched step ([`decode_batch`]) asks each sequence's own stage.

use std::fmt::Debug;

use anyhow::{Result, ensure};

use crate::backend::{Backend, DecodeRow};
pub use crate::choice::{Allowed, Choice, MAX_TOP_LOGPROBS, Pick};
use crate::sampling::Sampler;

/// One generation's walk through a grammar.
pub trait Constraint: Send {
    /// The tokens allowed next. At least one is: once the grammar is complete, only the
    /// end-of-turn token is, so the generation stops.
    fn allowed(&mut self) -> Result<Allowed<'_>>;
    /// `token` was chosen (one the last mask allowed).
    fn advance(&mut self, token: u32) -> Result<()>;
}

/// A grammar a request's output must follow; each choice walks it with a constraint of its own.
pub trait Grammar: Send + Sync + Debug {
    fn start(&self) -> Result<Box<dyn Constraint>>;
}

pub struct SamplingStage {
    sampler: Sampler,
    /// `Some(k)`: report the chosen token's log-probability and the `k` most likely.
    logprobs: Option<usize>,
    constraint: Option<Box<dyn Constraint>>,
}

impl SamplingStage {
    pub fn new(sampler: Sampler, logprobs: Option<usize>) -> Self {
        SamplingStage {
            sampler,
            logprobs: logprobs.map(|k| k.min(MAX_TOP_LOGPROBS)),
            constraint: None,
        }
    }

    /// Every token from now on must be one `constraint` allows.
    pub fn with_constraint(mut self, constraint: Box<dyn Constraint>) -> Self {
        self.constraint = Some(constraint);
        self
    }

    /// This step's choice (the constraint's mask computed now, before the logits exist).
    fn choice(&mut self) -> Result<Choice<'_>> {
        let SamplingStage {
            sampler,
            logprobs,
            constraint,
        } = self;
        let allowed = match constraint {
            Some(c) => Some(c.allowed()?),
            None => None,
        };
        Ok(Choice {
            sampler,
            allowed,
            logprobs: *logprobs,
        })
    }

    fn advance(&mut self, pick: &Pick) -> Result<()> {
        match &mut self.constraint {
            Some(c) => c.advance(pick.token),
            None => Ok(()),
        }
    }

    /// The next token from logits already on the host (those of a prefill).
    pub fn pick(&mut self, logits: &[f32]) -> Result<Pick> {
        let pick = self.choice()?.pick(logits);
        self.advance(&pick)?;
        Ok(pick)
    }

    /// Feeds `tokens` (a prompt's last chunk) to `state` and picks the token that follows them,
    /// where the backend keeps the logits.
    pub fn prefill<B: Backend>(
        &mut self,
        backend: &B,
        state: &mut B::State,
        tokens: &[u32],
    ) -> Result<Pick> {
        let pick = backend.prefill_choose(state, tokens, &mut self.choice()?)?;
        self.advance(&pick)?;
        Ok(pick)
    }

    /// [`SamplingStage::prefill`] that also returns a fork of the state after the first `at`
    /// tokens ([`Backend::prefill_choose_forking`]).
    pub fn prefill_forking<B: Backend>(
        &mut self,
        backend: &B,
        state: &mut B::State,
        tokens: &[u32],
        at: usize,
    ) -> Result<(Pick, B::State)> {
        let (pick, fork) =
            backend.prefill_choose_forking(state, tokens, at, &mut self.choice()?)?;
        self.advance(&pick)?;
        Ok((pick, fork))
    }

    /// Feeds `token` to `state` and picks the one that follows.
    pub fn decode<B: Backend>(
        &mut self,
        backend: &B,
        state: &mut B::State,
        token: u32,
    ) -> Result<Pick> {
        let pick = backend.decode_choose(state, token, &mut self.choice()?)?;
        self.advance(&pick)?;
        Ok(pick)
    }
}

/// One sequence's part in a batched step: its own stage and state, the token it consumes, and
/// whether it goes on after this step's pick ([`DecodeRow::queue_next`]).
pub struct BatchEntry<'a, S> {
    pub stage: &'a mut SamplingStage,
    pub state: &'a mut S,
    pub token: u32,
    pub queue_next: bool,
}

/// Feeds every entry's token to its state in one batched backend step and picks each one's next
/// token, each stage deciding for its own sequence exactly as [`SamplingStage::decode`] does.
/// On error the batch as a whole has failed (see [`Backend::decode_batch`]).
pub fn decode_batch<B: Backend>(
    backend: &B,
    entries: &mut [BatchEntry<'_, B::State>],
) -> Result<Vec<Pick>> {
    let picks = {
        let mut rows = Vec::with_capacity(entries.len());
        for e in entries.iter_mut() {
            rows.push(DecodeRow {
                state: &mut *e.state,
                token: e.token,
                choice: e.stage.choice()?,
                queue_next: e.queue_next,
            });
        }
        backend.decode_batch(&mut rows)?
    };
    ensure!(
        picks.len() == entries.len(),
        "the backend returned {} results for a batch of {}",
        picks.len(),
        entries.len()
    );
    for (e, pick) in entries.iter_mut().zip(&picks) {
        e.stage.advance(pick)?;
    }
    Ok(picks)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::backend::LogitRows;
    use crate::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
    use crate::logprobs::log_softmax_at;
    use crate::sampling::SamplingParams;

    /// A device-like backend: `decode_choose` makes the choice itself, and records what it was
    /// asked for (log-probabilities, a mask).
    struct Device {
        config: ModelConfig,
        calls: Mutex<Vec<(Option<usize>, bool)>>,
    }

    fn logits_after(token: u32) -> Vec<f32> {
        (0..16)
            .map(|i| ((i * 7 + token as usize) % 16) as f32 * 0.25)
            .collect()
    }

    impl Backend for Device {
        type State = ();

        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn device_name(&self) -> String {
            "device".into()
        }
        fn max_prefill_chunk(&self) -> usize {
            16
        }
        fn new_state(&self, _: usize) -> Result<()> {
            Ok(())
        }
        fn state_len(&self, _: &()) -> usize {
            0
        }
        fn fork(&self, _: &()) -> Result<()> {
            Ok(())
        }
        fn prefill(&self, _: &mut (), tokens: &[u32], _: LogitRows) -> Result<Vec<f32>> {
            Ok(logits_after(*tokens.last().unwrap()))
        }
        fn decode_choose(&self, _: &mut (), token: u32, c: &mut Choice<'_>) -> Result<Pick> {
            let asked = (c.logprobs, c.allowed.is_some());
            self.calls.lock().unwrap().push(asked);
            Ok(c.pick(&logits_after(token)))
        }
    }

    fn device() -> Device {
        Device {
            config: ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap(),
            calls: Mutex::new(Vec::new()),
        }
    }

    #[test]
    fn the_device_is_asked_for_the_whole_choice_log_probabilities_included() {
        let backend = device();
        let mut plain = SamplingStage::new(Sampler::new(SamplingParams::greedy()), None);
        let pick = plain.decode(&backend, &mut (), 3).unwrap();
        assert_eq!(pick.logprobs, None);
        let mut scored = SamplingStage::new(Sampler::new(SamplingParams::greedy()), Some(2));
        let scored_pick = scored.decode(&backend, &mut (), 3).unwrap();
        assert_eq!(
            *backend.calls.lock().unwrap(),
            [(None, false), (Some(2), false)]
        );
        // The same token either way, with the log-probability its logits give.
        assert_eq!(scored_pick.token, pick.token);
        let lp = scored_pick.logprobs.unwrap();
        let expected = log_softmax_at(&logits_after(3), pick.token as usize);
        assert!((lp.logprob as f64 - expected).abs() < 1e-6, "{lp:?}");
        assert_eq!(lp.top[0].0, pick.token);
        assert_eq!(lp.top.len(), 2);
    }

    /// Allows only multiples of `step` below `END` for `len` tokens, then only `END`.
    struct Counting {
        step: u32,
        len: usize,
        seen: Vec<u32>,
        bits: Vec<u32>,
    }

    const END: u32 = 15;

    impl Constraint for Counting {
        fn allowed(&mut self) -> Result<Allowed<'_>> {
            let open = self.seen.len() < self.len;
            self.bits = vec![0];
            for t in 0..16u32 {
                let allowed = if open {
                    t.is_multiple_of(self.step) && t != END
                } else {
                    t == END
                };
                if allowed {
                    self.bits[0] |= 1 << t;
                }
            }
            Ok(Allowed::Bits(&self.bits))
        }
        fn advance(&mut self, token: u32) -> Result<()> {
            self.seen.push(token);
            Ok(())
        }
    }

    #[test]
    fn a_constraint_decides_every_token_whatever_the_logits() {
        let backend = device();
        let mut rng = crate::rng::Rng::new(7);
        for (case, temperature) in [0.0, 1.0, 2.0].into_iter().cycle().take(30).enumerate() {
            let params = SamplingParams {
                temperature,
                seed: case as u64,
                ..SamplingParams::greedy()
            };
            let constraint = Counting {
                step: 3,
                len: 6,
                seen: Vec::new(),
                bits: Vec::new(),
            };
            let mut stage = SamplingStage::new(Sampler::new(params), None)
                .with_constraint(Box::new(constraint));
            let random: Vec<f32> = (0..16).map(|_| rng.next_f32() * 8.0 - 4.0).collect();
            let mut tokens = vec![stage.pick(&random).unwrap().token];
            while *tokens.last().unwrap() != END {
                let last = *tokens.last().unwrap();
                tokens.push(stage.decode(&backend, &mut (), last).unwrap().token);
            }
            assert_eq!(tokens.len(), 7, "{tokens:?}");
            assert!(
                tokens[..6].iter().all(|t| t.is_multiple_of(3)),
                "{tokens:?}"
            );
        }
        // The mask went to the device with every step.
        assert!(backend.calls.lock().unwrap().iter().all(|c| c.1));
    }

    #[test]
    fn a_batch_asks_each_stage_as_it_would_be_asked_alone() {
        let backend = device();
        let mut scored = SamplingStage::new(Sampler::new(SamplingParams::greedy()), Some(1));
        let mut plain = SamplingStage::new(Sampler::new(SamplingParams::greedy()), None);
        let (mut a, mut b) = ((), ());
        let picks = decode_batch(
            &backend,
            &mut [
                BatchEntry {
                    stage: &mut scored,
                    state: &mut a,
                    token: 3,
                    queue_next: false,
                },
                BatchEntry {
                    stage: &mut plain,
                    state: &mut b,
                    token: 5,
                    queue_next: false,
                },
            ],
        )
        .unwrap();
        assert_eq!(
            *backend.calls.lock().unwrap(),
            [(Some(1), false), (None, false)]
        );
        let mut alone = SamplingStage::new(Sampler::new(SamplingParams::greedy()), Some(1));
        assert_eq!(picks[0], alone.decode(&backend, &mut (), 3).unwrap());
        assert!(picks[0].logprobs.is_some());
        let mut alone = SamplingStage::new(Sampler::new(SamplingParams::greedy()), None);
        assert_eq!(picks[1], alone.decode(&backend, &mut (), 5).unwrap());
    }
}
