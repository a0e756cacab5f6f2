//! Generations from tokenised prompts to text, on any backend, several at once: reuse of
//! snapshotted state, chunked prefill, sampling, stop tokens and stop strings, and `n` choices
//! from one prefill. The engine advances a batch of [`Sequence`]s one [`Engine::step`] at a time:
//! a chunk of the oldest prompt still going in, then one token for every sequence generating,
//! in one batched backend step. The server's worker thread runs a batch of up to `--max-batch`;
//! `lily chat` and `lily generate --prompt` run a batch of one through [`Engine::run`]: one
//! generation loop for all of them.

mod choice;
mod prefill;
mod reuse;

use std::ops::ControlFlow;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use lily_chat::TextModel;
use lily_core::backend::Backend;
/// How a generation ended: the one finish type of the engine and of `lily generate --tokens`.
pub use lily_core::generate::Finish;
use lily_core::logprobs::TokenLogprobs;
use lily_core::penalties::Penalties;
use lily_core::rng::mix64;
use lily_core::sampling::SamplingParams;
use lily_core::sampling_stage::{BatchEntry, Grammar, Pick, SamplingStage, decode_batch};

use self::choice::ChoiceRun;
use self::prefill::{PromptEnd, PromptFill};
use super::snapshots::SnapshotCache;

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

/// Where a generation's events go, and how it learns that its consumer has gone.
pub trait Sink {
    /// Receives an event; breaking cancels the generation.
    fn emit(&mut self, event: EngineEvent) -> ControlFlow<()>;
    /// Polled between steps where no event is due (prefill chunks, held-back text).
    fn cancelled(&self) -> bool;
}

/// A sink of two closures, for a caller that runs one generation ([`Engine::run`]).
struct Callbacks<E, C> {
    emit: E,
    cancelled: C,
}

impl<E: FnMut(EngineEvent) -> ControlFlow<()>, C: Fn() -> bool> Sink for Callbacks<E, C> {
    fn emit(&mut self, event: EngineEvent) -> ControlFlow<()> {
        (self.emit)(event)
    }
    fn cancelled(&self) -> bool {
        (self.cancelled)()
    }
}

/// One generation in the engine's batch, from its prompt's prefill to its last choice. `'t` is
/// the text model its text streams decode with.
pub struct Sequence<'t, S, K> {
    job: GenerationJob,
    sink: K,
    text: &'t TextModel,
    outcome: Outcome,
    phase: Phase<'t, S>,
}

enum Phase<'t, S> {
    /// The prompt going in, a chunk per step.
    Prefill(PromptFill<S>),
    /// A choice generating. `prompt` keeps the prompt's state and logits for the choices after
    /// it (each starts from a fork; the last takes the state itself).
    Decode {
        choice: Box<ChoiceRun<'t, S>>,
        prompt: Option<(S, Vec<f32>)>,
    },
    /// Ended (the outcome is complete) or failed; it leaves the batch at the end of the step.
    Ended(Result<()>),
}

impl<S, K> Sequence<'_, S, K> {
    /// The sequence's sink, for a caller that must end it from outside (a panicked step).
    pub fn into_sink(self) -> K {
        self.sink
    }

    fn is_prefilling(&self) -> bool {
        matches!(&self.phase, Phase::Prefill(fill) if fill.end.is_none())
    }
}

/// A sole choice's start: the prompt's state, the stage that chose the first token with the
/// prompt's last chunk, that token, and whether the snapshot after the prompt is still due.
struct Picked<S> {
    state: S,
    stage: SamplingStage,
    pick: Pick,
    keep_prompt: bool,
}

/// A sequence that has left the batch, with its sink and how it went.
pub struct Finished<K> {
    pub sink: K,
    pub result: Result<Outcome>,
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

    /// The text model sequences decode with; a batch's sequences borrow it.
    pub fn text_model(&self) -> Arc<TextModel> {
        self.text.clone()
    }

    /// Runs `job` alone, start to end: a batch of one through the same steps as the server's.
    /// `emit` receives the events and may cancel by breaking; `cancelled` is polled between
    /// steps where no event is due (prefill chunks, held-back text).
    pub fn run(
        &mut self,
        job: &GenerationJob,
        emit: impl FnMut(EngineEvent) -> ControlFlow<()>,
        cancelled: impl Fn() -> bool,
    ) -> Result<Outcome> {
        let text = self.text_model();
        let sink = Callbacks { emit, cancelled };
        let mut batch = match self.admit(job.clone(), sink, &text) {
            Ok(sequence) => vec![sequence],
            Err(finished) => return finished.result,
        };
        loop {
            if let Some(finished) = self.step(&mut batch).pop() {
                return finished.result;
            }
        }
    }

    /// Makes `job` a sequence ready to join a batch, from the best snapshot of its prompt; a
    /// job that cannot run comes back finished.
    pub fn admit<'t, K: Sink>(
        &mut self,
        job: GenerationJob,
        sink: K,
        text: &'t TextModel,
    ) -> Result<Sequence<'t, B::State, K>, Finished<K>> {
        let fill = self.check(&job).and_then(|()| self.begin_fill(&job));
        let fill = match fill {
            Ok(fill) => fill,
            Err(e) => {
                return Err(Finished {
                    sink,
                    result: Err(e),
                });
            }
        };
        let outcome = Outcome {
            choices: Vec::new(),
            prompt_tokens: job.prompt.len(),
            cached_tokens: fill.cached,
        };
        Ok(Sequence {
            job,
            sink,
            text,
            outcome,
            phase: Phase::Prefill(fill),
        })
    }

    fn check(&self, job: &GenerationJob) -> Result<()> {
        if job.prompt.is_empty() {
            bail!("the prompt is empty");
        }
        if job.prompt.len() >= self.max_seq {
            bail!(
                "the prompt has {} tokens but the context holds {} (including at least one \
                 generated token)",
                job.prompt.len(),
                self.max_seq
            );
        }
        Ok(())
    }

    /// One step of `batch`: a chunk of the oldest prompt still going in, then one token for
    /// every sequence generating, all in one batched backend step. So a generating sequence
    /// waits at most one prefill chunk and one batched step per token. The sequences that end
    /// leave `batch` (which keeps its order) and come back.
    pub fn step<'t, K: Sink>(
        &mut self,
        batch: &mut Vec<Sequence<'t, B::State, K>>,
    ) -> Vec<Finished<K>> {
        if let Some(sequence) = batch.iter_mut().find(|s| s.is_prefilling()) {
            self.advance_prefill(sequence);
        }
        // A prompt that is all in starts its choices (one whose logits a snapshot kept, at once).
        for sequence in batch.iter_mut() {
            if matches!(&sequence.phase, Phase::Prefill(fill) if fill.end.is_some()) {
                self.start_choices(sequence);
            }
        }
        self.decode_step(batch);
        let mut finished = Vec::new();
        let mut kept = Vec::with_capacity(batch.len());
        for sequence in batch.drain(..) {
            match sequence.phase {
                Phase::Ended(result) => finished.push(Finished {
                    sink: sequence.sink,
                    result: result.map(|()| sequence.outcome),
                }),
                _ => kept.push(sequence),
            }
        }
        *batch = kept;
        finished
    }

    fn advance_prefill<K: Sink>(&mut self, sequence: &mut Sequence<'_, B::State, K>) {
        if sequence.sink.cancelled() {
            sequence.phase = Phase::Ended(Ok(()));
            return;
        }
        let Phase::Prefill(fill) = &mut sequence.phase else {
            return;
        };
        if let Err(e) = self.fill_chunk(&sequence.job, fill) {
            sequence.phase = Phase::Ended(Err(e));
        }
    }

    /// The prompt is in: says so, then starts the first choice, from the token chosen with the
    /// prompt's last chunk or from the prompt's logits.
    fn start_choices<K: Sink>(&mut self, sequence: &mut Sequence<'_, B::State, K>) {
        let Phase::Prefill(fill) = std::mem::replace(&mut sequence.phase, Phase::Ended(Ok(())))
        else {
            return;
        };
        let Some(end) = fill.end else {
            return;
        };
        let started = EngineEvent::Started {
            prompt_tokens: sequence.job.prompt.len(),
            cached_tokens: fill.cached,
            prompt_logprobs: fill.prompt_logprobs,
        };
        if sequence.sink.emit(started).is_break() {
            return;
        }
        let result = match end {
            PromptEnd::Logits(logits) => self.next_choice(sequence, Some((fill.state, logits))),
            PromptEnd::Picked(stage, pick) => {
                let start = Picked {
                    state: fill.state,
                    stage: *stage,
                    pick,
                    keep_prompt: fill.keep_prompt,
                };
                self.start_picked(sequence, start)
            }
        };
        if let Err(e) = result {
            sequence.phase = Phase::Ended(Err(e));
        }
    }

    /// Starts the sole choice from the first token its stage chose with the prompt's last chunk;
    /// then, the token out, keeps the snapshot after the prompt where it is due.
    fn start_picked<K: Sink>(
        &mut self,
        sequence: &mut Sequence<'_, B::State, K>,
        start: Picked<B::State>,
    ) -> Result<()> {
        let room = self.max_seq - sequence.job.prompt.len();
        let job = &sequence.job;
        let mut choice =
            ChoiceRun::with_stage(job, 0, start.state, sequence.text, room, start.stage);
        let finish = choice.accept(start.pick, &self.stop_ids, &mut sequence.sink);
        if start.keep_prompt {
            // No decode step has run: the choice's state is still the prompt's.
            self.keep_snapshot(&sequence.job.prompt, &choice.state, None)?;
        }
        match finish {
            None => {
                sequence.phase = Phase::Decode {
                    choice: Box::new(choice),
                    prompt: None,
                }
            }
            Some(finish) => {
                self.end_choice(sequence, choice, finish)?;
            }
        }
        Ok(())
    }

    /// Starts the choice after those in the outcome from `prompt` (its state and logits), and
    /// runs on through every choice that ends without a decode step (a stop token first, a
    /// budget of one token or none).
    fn next_choice<K: Sink>(
        &mut self,
        sequence: &mut Sequence<'_, B::State, K>,
        mut prompt: Option<(B::State, Vec<f32>)>,
    ) -> Result<()> {
        let n = sequence.job.n.max(1);
        let room = self.max_seq - sequence.job.prompt.len();
        loop {
            let index = sequence.outcome.choices.len();
            let Some((state, logits)) = prompt.take() else {
                bail!("the prompt's state was used up before choice {index}");
            };
            let (state, rest) = if index + 1 == n {
                (state, None)
            } else {
                (self.backend.fork(&state)?, Some((state, logits.clone())))
            };
            let mut choice = ChoiceRun::new(&sequence.job, index, state, sequence.text, room)?;
            let finish = if choice.is_empty_budget() {
                Some(Finish::Length)
            } else {
                let pick = choice.stage.pick(&logits)?;
                choice.accept(pick, &self.stop_ids, &mut sequence.sink)
            };
            let Some(finish) = finish else {
                sequence.phase = Phase::Decode {
                    choice: Box::new(choice),
                    prompt: rest,
                };
                return Ok(());
            };
            if !self.end_choice(sequence, choice, finish)? {
                return Ok(());
            }
            prompt = rest;
        }
    }

    /// Records a choice that has ended; whether another is to start.
    fn end_choice<K: Sink>(
        &mut self,
        sequence: &mut Sequence<'_, B::State, K>,
        choice: ChoiceRun<'_, B::State>,
        finish: Finish,
    ) -> Result<bool> {
        if choice.ended_turn && finish == Finish::Stop {
            let fed = [&sequence.job.prompt[..], &choice.tokens].concat();
            self.snapshot_end_of_turn(fed, choice.next, choice.state)?;
        }
        sequence.outcome.choices.push(ChoiceOutcome {
            finish,
            tokens: choice.tokens,
        });
        let more = finish != Finish::Cancelled && sequence.outcome.choices.len() < sequence.job.n;
        if !more {
            sequence.phase = Phase::Ended(Ok(()));
        }
        Ok(more)
    }

    /// One batched decode step for every sequence generating; each takes its pick.
    fn decode_step<K: Sink>(&mut self, batch: &mut [Sequence<'_, B::State, K>]) {
        let mut entries: Vec<BatchEntry<'_, B::State>> = batch
            .iter_mut()
            .filter_map(|s| match &mut s.phase {
                Phase::Decode { choice, .. } => Some(BatchEntry {
                    queue_next: choice.outlasts_next_pick(),
                    stage: &mut choice.stage,
                    state: &mut choice.state,
                    token: choice.next,
                }),
                _ => None,
            })
            .collect();
        if entries.is_empty() {
            return;
        }
        let picks = decode_batch(&self.backend, &mut entries);
        drop(entries);
        let decoding = batch
            .iter_mut()
            .filter(|s| matches!(s.phase, Phase::Decode { .. }));
        let picks = match picks {
            Ok(picks) => picks,
            Err(e) => {
                // The batch failed as a whole: every sequence in it ends with the error.
                let message = format!("{e:#}");
                for sequence in decoding {
                    sequence.phase = Phase::Ended(Err(anyhow!("{message}")));
                }
                return;
            }
        };
        for (sequence, pick) in decoding.zip(picks) {
            let Phase::Decode { choice, .. } = &mut sequence.phase else {
                continue;
            };
            let Some(finish) = choice.accept(pick, &self.stop_ids, &mut sequence.sink) else {
                continue;
            };
            let Phase::Decode { choice, prompt } =
                std::mem::replace(&mut sequence.phase, Phase::Ended(Ok(())))
            else {
                continue;
            };
            let result = match self.end_choice(sequence, *choice, finish) {
                Ok(true) => self.next_choice(sequence, prompt),
                Ok(false) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                sequence.phase = Phase::Ended(Err(e));
            }
        }
    }
}

#[cfg(test)]
mod batch_tests;
#[cfg(test)]
mod queue_tests;
#[cfg(test)]
mod tests;
