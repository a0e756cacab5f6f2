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
