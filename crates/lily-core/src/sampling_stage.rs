//! The sampling stage: the one place a generation asks for its next token. It decides where the
//! choice is made: a backend may choose on its device without sending the logits to the host
//! (`decode_sample`), unless the request needs the logits themselves (log-probabilities), in
//! which case they come back (`decode`) and both the choice and the log-probabilities are made
//! from them, exactly. Penalties need the logits too; the backend sees that through
//! `Sampler::is_raw_greedy`. A device-side sampler (mask, penalties, top log-probabilities on
//! the device) replaces the body of this module, not its callers. A batched step
//! ([`decode_batch`]) asks each sequence's own stage the same question.
//!
//! A constraint (constrained decoding: a grammar the output must follow) also takes the logits
//! path: the tokens it forbids get a logit of -inf before the choice, and it is told the token
//! chosen. On CUDA its mask is still applied on the host, after the logits came back.

use std::fmt::Debug;

use anyhow::{Result, ensure};

use crate::backend::{Backend, DecodeRow, Decoded};
use crate::logprobs::{TokenLogprobs, token_logprobs};
use crate::sampling::Sampler;

/// The most alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generation's walk through a grammar.
pub trait Constraint: Send {
    /// Sets the logit of every token not allowed next to -inf. At least one token stays allowed:
    /// once the grammar is complete, only the end-of-turn token is, so the generation stops.
    fn mask(&mut self, logits: &mut [f32]) -> Result<()>;
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

#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
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

    /// The next token from logits already on the host (those of a prefill). Log-probabilities
    /// are the model's own, before any constraint's mask.
    pub fn pick(&mut self, logits: &[f32]) -> Result<Pick> {
        let token = match &mut self.constraint {
            None => self.sampler.sample(logits),
            Some(constraint) => {
                let mut masked = logits.to_vec();
                constraint.mask(&mut masked)?;
                let token = self.sampler.sample(&masked);
                constraint.advance(token)?;
                token
            }
        };
        let choosable = self.sampler.vocab_limit().unwrap_or(logits.len());
        Ok(Pick {
            token,
            logprobs: self
                .logprobs
                .map(|k| token_logprobs(logits, token, k, choosable)),
        })
    }

    /// Feeds `token` to `state` and picks the one that follows.
    pub fn decode<B: Backend>(
        &mut self,
        backend: &B,
        state: &mut B::State,
        token: u32,
    ) -> Result<Pick> {
        if let Some(sampler) = self.device_sampler() {
            let token = backend.decode_sample(state, token, sampler)?;
            return Ok(Pick {
                token,
                logprobs: None,
            });
        }
        let logits = backend.decode(state, token)?;
        self.pick(&logits)
    }

    /// The sampler, when the backend may choose with it on its device; `None` when the logits
    /// must come back (log-probabilities are made from them; a constraint masks them).
    fn device_sampler(&mut self) -> Option<&mut Sampler> {
        (self.logprobs.is_none() && self.constraint.is_none()).then_some(&mut self.sampler)
    }
}

/// One sequence's part in a batched step: its own stage and state, and the token it consumes.
pub struct BatchEntry<'a, S> {
    pub stage: &'a mut SamplingStage,
    pub state: &'a mut S,
    pub token: u32,
}

/// Feeds every entry's token to its state in one batched backend step and picks each one's next
/// token, each stage deciding for its own sequence exactly as [`SamplingStage::decode`] does.
/// On error the batch as a whole has failed (see [`Backend::decode_batch`]).
pub fn decode_batch<B: Backend>(
    backend: &B,
    entries: &mut [BatchEntry<'_, B::State>],
) -> Result<Vec<Pick>> {
    let mut rows: Vec<DecodeRow<'_, B::State>> = entries
        .iter_mut()
        .map(|e| DecodeRow {
            state: &mut *e.state,
            token: e.token,
            sampler: e.stage.device_sampler(),
        })
        .collect();
    let decoded = backend.decode_batch(&mut rows)?;
    drop(rows);
    ensure!(
        decoded.len() == entries.len(),
        "the backend returned {} results for a batch of {}",
        decoded.len(),
        entries.len()
    );
    entries
        .iter_mut()
        .zip(decoded)
        .map(|(e, d)| match d {
            Decoded::Token(token) => Ok(Pick {
                token,
                logprobs: None,
            }),
            Decoded::Logits(logits) => e.stage.pick(&logits),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::backend::LogitRows;
    use crate::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
    use crate::logprobs::log_softmax_at;
    use crate::sampling::SamplingParams;

    /// A device-like backend: `decode_sample` chooses without handing logits back, and says so.
    struct Device {
        config: ModelConfig,
        calls: Mutex<Vec<&'static str>>,
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
            self.calls.lock().unwrap().push("logits");
            Ok(logits_after(*tokens.last().unwrap()))
        }
        fn decode_sample(&self, _: &mut (), token: u32, s: &mut Sampler) -> Result<u32> {
            self.calls.lock().unwrap().push("device");
            Ok(s.sample(&logits_after(token)))
        }
    }

    #[test]
    fn log_probabilities_take_the_logits_path_and_plain_requests_the_device() {
        let backend = Device {
            config: ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap(),
            calls: Mutex::new(Vec::new()),
        };
        let mut plain = SamplingStage::new(Sampler::new(SamplingParams::greedy()), None);
        let pick = plain.decode(&backend, &mut (), 3).unwrap();
        assert_eq!(pick.logprobs, None);
        let mut scored = SamplingStage::new(Sampler::new(SamplingParams::greedy()), Some(2));
        let scored_pick = scored.decode(&backend, &mut (), 3).unwrap();
        assert_eq!(*backend.calls.lock().unwrap(), ["device", "logits"]);
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
    }

    const END: u32 = 15;

    impl Constraint for Counting {
        fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
            for (t, logit) in logits.iter_mut().enumerate() {
                let t = t as u32;
                let allowed = if self.seen.len() < self.len {
                    t.is_multiple_of(self.step) && t != END
                } else {
                    t == END
                };
                if !allowed {
                    *logit = f32::NEG_INFINITY;
                }
            }
            Ok(())
        }
        fn advance(&mut self, token: u32) -> Result<()> {
            self.seen.push(token);
            Ok(())
        }
    }

    #[test]
    fn a_constraint_decides_every_token_whatever_the_logits() {
        let backend = Device {
            config: ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap(),
            calls: Mutex::new(Vec::new()),
        };
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
        // Constrained decoding takes the logits path: the mask is applied on the host.
        assert!(backend.calls.lock().unwrap().iter().all(|c| *c == "logits"));
    }

    #[test]
    fn a_batch_asks_each_stage_as_it_would_be_asked_alone() {
        let backend = Device {
            config: ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap(),
            calls: Mutex::new(Vec::new()),
        };
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
                },
                BatchEntry {
                    stage: &mut plain,
                    state: &mut b,
                    token: 5,
                },
            ],
        )
        .unwrap();
        assert_eq!(*backend.calls.lock().unwrap(), ["logits", "device"]);
        let mut alone = SamplingStage::new(Sampler::new(SamplingParams::greedy()), Some(1));
        assert_eq!(picks[0], alone.decode(&backend, &mut (), 3).unwrap());
        assert!(picks[0].logprobs.is_some());
        let mut alone = SamplingStage::new(Sampler::new(SamplingParams::greedy()), None);
        assert_eq!(picks[1], alone.decode(&backend, &mut (), 5).unwrap());
    }
}
