//! The generation loop shared by every front end: chunked prefill, then one token per step until
//! a stop token or the token budget.

use std::ops::ControlFlow;

use anyhow::{Result, ensure};

use crate::backend::{Backend, LogitRows};
use crate::sampling::Sampler;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced (it is not part of the output).
    Stop,
    /// `max_tokens` were produced.
    Length,
    /// The caller's callback asked to stop (a stop string, a disconnected client).
    Cancelled,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
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
            // Earlier chunks of a generation prompt need no logits at all, but every backend
            // returns at least the last row; it is dropped.
            LogitRows::Last => drop(backend.prefill(state, piece, LogitRows::Last)?),
        }
    }
    Ok(out)
}

/// Prefills `prompt`, then samples up to `max_tokens` tokens. `on_token` sees each token as it is
/// chosen and may stop generation early.
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
            finish: FinishReason::Length,
        });
    }
    let logits = prefill(backend, state, prompt, LogitRows::Last)?;
    let mut next = sampler.sample(&logits);
    loop {
        if stop_ids.contains(&next) {
            return Ok(Generation {
                tokens,
                finish: FinishReason::Stop,
            });
        }
        tokens.push(next);
        if on_token(next).is_break() {
            return Ok(Generation {
                tokens,
                finish: FinishReason::Cancelled,
            });
        }
        if tokens.len() >= max_tokens {
            return Ok(Generation {
                tokens,
                finish: FinishReason::Length,
            });
        }
        next = backend.decode_sample(state, next, sampler)?;
    }
}
