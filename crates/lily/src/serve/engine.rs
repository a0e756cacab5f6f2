//! One generation from a tokenised prompt to text, on any backend: reuse of snapshotted state,
//! chunked prefill, sampling, stop tokens and stop strings. The server's worker thread, `lily
//! chat` and `lily generate --prompt` all run generations through this.

use std::ops::ControlFlow;
use std::sync::Arc;

use anyhow::{Result, bail};
use lily_chat::TextModel;
use lily_core::backend::{Backend, LogitRows};
use lily_core::sampling::{Sampler, SamplingParams};

use super::snapshots::SnapshotCache;

#[derive(Clone, Debug)]
pub struct GenerationJob {
    pub prompt: Vec<u32>,
    /// Where the conversation before the generation prompt ends: a later turn branches there.
    pub turn_boundary: Option<usize>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-turn token, or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    /// The consumer went away.
    Cancelled,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// The prompt is in the state; `cached_tokens` of it came from a snapshot.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Text(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub finish: Finish,
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

pub struct Engine<B: Backend> {
    backend: B,
    text: Arc<TextModel>,
    snapshots: SnapshotCache<B::State>,
    max_seq: usize,
    stop_ids: Vec<u32>,
    /// `<|im_end|>\n`: what closes an assistant turn when the template renders it back.
    turn_end: Vec<u32>,
}

impl<B: Backend> Engine<B> {
    pub fn new(
        backend: B,
        text: Arc<TextModel>,
        max_seq: usize,
        snapshot_budget_bytes: usize,
    ) -> Result<Self> {
        let vocab = backend.config().vocab_size;
        if text.tokenizer.decodable_len() > vocab {
            bail!(
                "the tokenizer has {} tokens but the model's vocabulary only {vocab}",
                text.tokenizer.decodable_len()
            );
        }
        let stop_ids = backend.config().eos_token_ids.clone();
        let turn_end = text.tokenizer.encode("<|im_end|>\n")?;
        Ok(Engine {
            backend,
            text,
            snapshots: SnapshotCache::new(snapshot_budget_bytes),
            max_seq,
            stop_ids,
            turn_end,
        })
    }

    /// How many snapshots are kept and the bytes they hold.
    pub fn snapshot_usage(&self) -> (usize, usize) {
        (self.snapshots.len(), self.snapshots.used_bytes())
    }

    /// Runs `job`. `emit` receives the events and may cancel by breaking; `cancelled` is polled
    /// between steps where no event is due (prefill chunks, held-back text).
    pub fn run(
        &mut self,
        job: &GenerationJob,
        mut emit: impl FnMut(EngineEvent) -> ControlFlow<()>,
        cancelled: impl Fn() -> bool,
    ) -> Result<Outcome> {
        let prompt = &job.prompt;
        if prompt.is_empty() {
            bail!("the prompt is empty");
        }
        if prompt.len() >= self.max_seq {
            bail!(
                "the prompt has {} tokens but the context holds {} (including at least one \
                 generated token)",
                prompt.len(),
                self.max_seq
            );
        }
        let mut outcome = Outcome {
            finish: Finish::Cancelled,
            tokens: Vec::new(),
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
        };
        let Some((mut state, logits)) = self.prefill_prompt(job, &mut outcome, &cancelled)? else {
            return Ok(outcome);
        };
        let started = EngineEvent::Started {
            prompt_tokens: prompt.len(),
            cached_tokens: outcome.cached_tokens,
        };
        if emit(started).is_break() {
            return Ok(outcome);
        }

        let tokenizer = &self.text.tokenizer;
        let mut text = lily_chat::TextStream::new(tokenizer, &job.stop);
        let mut sampler =
            Sampler::new(job.sampling.clone()).with_vocab_limit(tokenizer.decodable_len());
        let max_tokens = job.max_tokens.min(self.max_seq - prompt.len());
        let mut next = sampler.sample(&logits);
        let mut ended_turn = false;
        outcome.finish = loop {
            if self.stop_ids.contains(&next) {
                ended_turn = true;
                break Finish::Stop;
            }
            outcome.tokens.push(next);
            let step = text.push(next);
            if !step.text.is_empty() && emit(EngineEvent::Text(step.text)).is_break() {
                return Ok(outcome);
            }
            if step.stopped {
                break Finish::Stop;
            }
            if outcome.tokens.len() >= max_tokens {
                break Finish::Length;
            }
            if cancelled() {
                return Ok(outcome);
            }
            next = self.backend.decode_sample(&mut state, next, &mut sampler)?;
        };
        if outcome.finish == Finish::Length || ended_turn {
            let tail = text.finish();
            if !tail.text.is_empty() && emit(EngineEvent::Text(tail.text)).is_break() {
                outcome.finish = Finish::Cancelled;
                return Ok(outcome);
            }
        }
        if ended_turn {
            self.snapshot_end_of_turn(prompt, &outcome.tokens, state)?;
        }
        Ok(outcome)
    }

    /// Brings the prompt into a state, from the best snapshot; `None` if cancelled meanwhile.
    fn prefill_prompt(
        &mut self,
        job: &GenerationJob,
        outcome: &mut Outcome,
        cancelled: &impl Fn() -> bool,
    ) -> Result<Option<(B::State, Vec<f32>)>> {
        let prompt = &job.prompt;
        let (mut state, mut logits) = match self.snapshots.longest_prefix(prompt) {
            Some(hit) => {
                outcome.cached_tokens = hit.tokens.len();
                let logits = if hit.tokens.len() == prompt.len() {
                    hit.logits.clone()
                } else {
                    None
                };
                (self.backend.fork(&hit.state)?, logits)
            }
            None => (self.backend.new_state(self.max_seq)?, None),
        };
        if let Some(logits) = logits.take() {
            return Ok(Some((state, logits)));
        }
        let mut done = outcome.cached_tokens;
        if let Some(boundary) = job.turn_boundary
            && boundary > done
            && boundary < prompt.len()
        {
            if self
                .prefill(&mut state, &prompt[done..boundary], cancelled)?
                .is_none()
            {
                return Ok(None);
            }
            self.keep_snapshot(&prompt[..boundary], &state, None)?;
            done = boundary;
        }
        let Some(logits) = self.prefill(&mut state, &prompt[done..], cancelled)? else {
            return Ok(None);
        };
        self.keep_snapshot(prompt, &state, Some(&logits))?;
        Ok(Some((state, logits)))
    }

    /// Feeds `tokens` in chunks, checking for cancellation between them; the last row's logits.
    fn prefill(
        &self,
        state: &mut B::State,
        tokens: &[u32],
        cancelled: &impl Fn() -> bool,
    ) -> Result<Option<Vec<f32>>> {
        let mut logits = None;
        for chunk in tokens.chunks(self.backend.max_prefill_chunk().max(1)) {
            if cancelled() {
                return Ok(None);
            }
            logits = Some(self.backend.prefill(state, chunk, LogitRows::Last)?);
        }
        Ok(logits)
    }

    /// After a reply that ended its turn, the state plus `<|im_end|>\n` is where the next turn
    /// continues when the template renders the reply back as it was generated.
    fn snapshot_end_of_turn(
        &mut self,
        prompt: &[u32],
        reply: &[u32],
        mut state: B::State,
    ) -> Result<()> {
        let len = prompt.len() + reply.len() + self.turn_end.len();
        if len > self.max_seq || !self.snapshots.fits(self.backend.state_bytes(&state), 0) {
            return Ok(());
        }
        self.backend
            .prefill(&mut state, &self.turn_end, LogitRows::Last)?;
        let bytes = self.backend.state_bytes(&state);
        let tokens = [prompt, reply, &self.turn_end].concat();
        self.snapshots.insert(tokens, state, None, bytes);
        Ok(())
    }

    fn keep_snapshot(
        &mut self,
        tokens: &[u32],
        state: &B::State,
        logits: Option<&Vec<f32>>,
    ) -> Result<()> {
        let bytes = self.backend.state_bytes(state);
        let logit_count = logits.map_or(0, Vec::len);
        if !self.snapshots.fits(bytes, logit_count)
            || self.snapshots.contains(tokens, logits.is_some())
        {
            return Ok(());
        }
        let snapshot = self.backend.fork(state)?;
        self.snapshots
            .insert(tokens.to_vec(), snapshot, logits.cloned(), bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
