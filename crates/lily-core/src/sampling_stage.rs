//! The sampling stage: the one place a generation asks for its next token. It decides where the
//! choice is made: a backend may choose on its device without sending the logits to the host
//! (`decode_sample`), unless the request needs the logits themselves (log-probabilities), in
//! which case they come back (`decode`) and both the choice and the log-probabilities are made
//! from them, exactly. Penalties need the logits too; the backend sees that through
//! `Sampler::is_raw_greedy`. A device-side sampler (mask, penalties, top log-probabilities on
//! the device) replaces the body of this module, not its callers.

use anyhow::Result;

use crate::backend::Backend;
use crate::logprobs::{TokenLogprobs, token_logprobs};
use crate::sampling::Sampler;

/// The most alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

pub struct SamplingStage {
    sampler: Sampler,
    /// `Some(k)`: report the chosen token's log-probability and the `k` most likely.
    logprobs: Option<usize>,
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
        }
    }

    /// The next token from logits already on the host (those of a prefill).
    pub fn pick(&mut self, logits: &[f32]) -> Pick {
        let token = self.sampler.sample(logits);
        let choosable = self.sampler.vocab_limit().unwrap_or(logits.len());
        Pick {
            token,
            logprobs: self
                .logprobs
                .map(|k| token_logprobs(logits, token, k, choosable)),
        }
    }

    /// Feeds `token` to `state` and picks the one that follows.
    pub fn decode<B: Backend>(
        &mut self,
        backend: &B,
        state: &mut B::State,
        token: u32,
    ) -> Result<Pick> {
        if self.logprobs.is_none() {
            let token = backend.decode_sample(state, token, &mut self.sampler)?;
            return Ok(Pick {
                token,
                logprobs: None,
            });
        }
        let logits = backend.decode(state, token)?;
        Ok(self.pick(&logits))
    }
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
}
