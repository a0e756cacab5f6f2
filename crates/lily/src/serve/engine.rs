//! One generation from a tokenised prompt to text, on any backend: reuse of snapshotted state,
//! chunked prefill, sampling, stop tokens and stop strings, and `n` choices from one prefill.
//! The server's worker thread, `lily chat` and `lily generate --prompt` all run generations
//! through this.

use std::ops::ControlFlow;
use std::sync::Arc;

use anyhow::{Result, bail};
use lily_chat::TextModel;
use lily_core::backend::{Backend, LogitRows};
use lily_core::logprobs::{TokenLogprobs, token_logprobs};
use lily_core::penalties::Penalties;
use lily_core::rng::mix64;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::sampling_stage::{Grammar, MAX_TOP_LOGPROBS, SamplingStage};

use super::snapshots::SnapshotCache;

/// Rows of logits a prompt scored for its log-probabilities is fed in: each row is a whole
/// vocabulary (1 MB at 248K), so the chunk bounds the memory, not the speed.
const SCORED_CHUNK: usize = 64;

#[derive(Clone, Debug)]
pub struct GenerationJob {
    pub prompt: Vec<u32>,
    /// Where the conversation before the generation prompt ends: a later turn branches there.
    pub turn_boundary: Option<usize>,
    /// 0 only scores the prompt (with `prompt_logprobs`).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub penalties: Penalties,
    pub stop: Vec<String>,
    /// Choices generated from the one prefill, each from its own fork of the state.
    pub n: usize,
    /// `Some(k)`: the log-probability of every generated token and the `k` most likely.
    pub logprobs: Option<usize>,
    /// `Some(k)`: the same for every prompt token after the first (completions' `echo`).
    pub prompt_logprobs: Option<usize>,
    /// What the output must follow (`response_format`, a forced tool call).
    pub grammar: Option<Arc<dyn Grammar>>,
}

impl GenerationJob {
    /// One choice, no penalties, no log-probabilities.
    pub fn plain(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        GenerationJob {
            prompt,
            turn_boundary: None,
            max_tokens,
            sampling,
            penalties: Penalties::default(),
            stop: Vec::new(),
            n: 1,
            logprobs: None,
            prompt_logprobs: None,
            grammar: None,
        }
    }
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
    /// The prompt is in the state; `cached_tokens` of it came from a snapshot. With
    /// `prompt_logprobs`, one entry per prompt token after the first.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
        prompt_logprobs: Vec<TokenLogprobs>,
    },
    /// Output of choice `choice`, with the log-probabilities (when asked for) of the tokens
    /// consumed since its previous event: text held back for a stop string or an unfinished
    /// character arrives later than its tokens.
    Text {
        choice: usize,
        text: String,
        logprobs: Vec<TokenLogprobs>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChoiceOutcome {
    pub finish: Finish,
    pub tokens: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// One per choice generated (fewer than `n` if cancelled).
    pub choices: Vec<ChoiceOutcome>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

impl Outcome {
    /// How the generation ended: cancelled if any choice was, else the first choice's.
    pub fn finish(&self) -> Finish {
        match self.choices.first() {
            None => Finish::Cancelled,
            Some(_) if self.choices.iter().any(|c| c.finish == Finish::Cancelled) => {
                Finish::Cancelled
            }
            Some(first) => first.finish,
        }
    }

    /// Tokens generated over every choice.
    pub fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.tokens.len()).sum()
    }

    /// The first choice's tokens.
    pub fn tokens(&self) -> &[u32] {
        self.choices.first().map_or(&[], |c| &c.tokens)
    }
}

/// The seed of choice `index`: the request's own for the first, so that `n` = 1 and the first of
/// `n` agree; a mix of it for the others, so that they differ and repeat with the seed.
fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        mix64(seed ^ mix64(index as u64))
    }
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
            choices: Vec::new(),
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
        };
        let mut prompt_logprobs = Vec::new();
        let prefilled = self.prefill_prompt(job, &mut outcome, &mut prompt_logprobs, &cancelled)?;
        let Some((state, logits)) = prefilled else {
            return Ok(outcome);
        };
        let started = EngineEvent::Started {
            prompt_tokens: prompt.len(),
            cached_tokens: outcome.cached_tokens,
            prompt_logprobs,
        };
        if emit(started).is_break() {
            return Ok(outcome);
        }
        // Every choice but the last starts from a fork; the last takes the state itself.
        let n = job.n.max(1);
        let mut state = Some(state);
        for index in 0..n {
            let choice_state = if index + 1 == n {
                state.take()
            } else {
                state.as_ref().map(|s| self.backend.fork(s)).transpose()?
            };
            let Some(choice_state) = choice_state else {
                bail!("the prompt's state was used up before choice {index}");
            };
            let choice =
                self.run_choice(job, index, choice_state, &logits, &mut emit, &cancelled)?;
            let stop = choice.finish == Finish::Cancelled;
            outcome.choices.push(choice);
            if stop {
                break;
            }
        }
        Ok(outcome)
    }

    /// Generates choice `index` from `state`, which holds the prompt, and `logits`, the prompt's
    /// last row.
    fn run_choice(
        &mut self,
        job: &GenerationJob,
        index: usize,
        mut state: B::State,
        logits: &[f32],
        emit: &mut impl FnMut(EngineEvent) -> ControlFlow<()>,
        cancelled: &impl Fn() -> bool,
    ) -> Result<ChoiceOutcome> {
        let prompt = &job.prompt;
        let mut choice = ChoiceOutcome {
            finish: Finish::Cancelled,
            tokens: Vec::new(),
        };
        let max_tokens = job.max_tokens.min(self.max_seq - prompt.len());
        if max_tokens == 0 {
            choice.finish = Finish::Length;
            return Ok(choice);
        }
        let text_model = self.text.clone();
        let tokenizer = &text_model.tokenizer;
        let mut text = lily_chat::TextStream::new(tokenizer, &job.stop);
        let sampling = SamplingParams {
            seed: choice_seed(job.sampling.seed, index),
            ..job.sampling.clone()
        };
        let sampler = Sampler::new(sampling)
            .with_vocab_limit(tokenizer.decodable_len())
            .with_penalties(job.penalties.clone(), prompt);
        let mut stage = SamplingStage::new(sampler, job.logprobs);
        if let Some(grammar) = &job.grammar {
            stage = stage.with_constraint(grammar.start()?);
        }
        let mut pick = stage.pick(logits)?;
        let mut pending = Vec::new();
        let mut send = |text: String, pending: &mut Vec<TokenLogprobs>| {
            if text.is_empty() && pending.is_empty() {
                return ControlFlow::Continue(());
            }
            emit(EngineEvent::Text {
                choice: index,
                text,
                logprobs: std::mem::take(pending),
            })
        };
        let mut ended_turn = false;
        choice.finish = loop {
            if self.stop_ids.contains(&pick.token) {
                ended_turn = true;
                break Finish::Stop;
            }
            let next = pick.token;
            choice.tokens.push(next);
            pending.extend(pick.logprobs.take());
            let step = text.push(next);
            if !step.text.is_empty() && send(step.text, &mut pending).is_break() {
                return Ok(choice);
            }
            if step.stopped {
                break Finish::Stop;
            }
            if choice.tokens.len() >= max_tokens {
                break Finish::Length;
            }
            if cancelled() {
                return Ok(choice);
            }
            pick = stage.decode(&self.backend, &mut state, next)?;
        };
        let tail = if choice.finish == Finish::Length || ended_turn {
            text.finish().text
        } else {
            String::new()
        };
        if send(tail, &mut pending).is_break() {
            choice.finish = Finish::Cancelled;
            return Ok(choice);
        }
        if ended_turn {
            self.snapshot_end_of_turn(prompt, &choice.tokens, state)?;
        }
        Ok(choice)
    }

    /// Brings the prompt into a state, from the best snapshot; `None` if cancelled meanwhile.
    fn prefill_prompt(
        &mut self,
        job: &GenerationJob,
        outcome: &mut Outcome,
        prompt_logprobs: &mut Vec<TokenLogprobs>,
        cancelled: &impl Fn() -> bool,
    ) -> Result<Option<(B::State, Vec<f32>)>> {
        let prompt = &job.prompt;
        if let Some(top) = job.prompt_logprobs {
            return self.prefill_scored(prompt, top, prompt_logprobs, cancelled);
        }
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

    /// Feeds the whole prompt from an empty state with every row's logits (a snapshot has none
    /// to give), keeping the log-probability of each prompt token after the first.
    fn prefill_scored(
        &mut self,
        prompt: &[u32],
        top: usize,
        logprobs: &mut Vec<TokenLogprobs>,
        cancelled: &impl Fn() -> bool,
    ) -> Result<Option<(B::State, Vec<f32>)>> {
        let vocab = self.backend.config().vocab_size;
        let choosable = self.text.tokenizer.decodable_len();
        let chunk = self.backend.max_prefill_chunk().clamp(1, SCORED_CHUNK);
        let top = top.min(MAX_TOP_LOGPROBS);
        let mut state = self.backend.new_state(self.max_seq)?;
        let mut last = Vec::new();
        for (c, tokens) in prompt.chunks(chunk).enumerate() {
            if cancelled() {
                return Ok(None);
            }
            let rows = self.backend.prefill(&mut state, tokens, LogitRows::All)?;
            for (r, row) in rows.chunks(vocab).enumerate() {
                // Row r of chunk c predicts the token after position c·chunk + r.
                if let Some(&next) = prompt.get(c * chunk + r + 1) {
                    logprobs.push(token_logprobs(row, next, top, choosable));
                }
            }
            last = rows[rows.len().saturating_sub(vocab)..].to_vec();
        }
        self.keep_snapshot(prompt, &state, Some(&last))?;
        Ok(Some((state, last)))
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
