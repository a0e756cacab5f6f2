//! One choice of a generation, token by token: the sampling stage that picks its tokens, the
//! text stream that turns them into text and watches for stop strings, and the tokens so far.
//! The engine feeds it one [`Pick`] per step (the first chosen with the prompt's last chunk, or
//! from the prompt's logits on the host; the others from batched decode steps) and learns from
//! [`ChoiceRun::accept`] when it has ended.

use std::ops::ControlFlow;

use anyhow::Result;
use lily_chat::{TextModel, TextStream};
use lily_core::logprobs::TokenLogprobs;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::sampling_stage::{Pick, SamplingStage};

use super::{EngineEvent, Finish, GenerationJob, Sink, choice_seed};

pub(super) struct ChoiceRun<'t, S> {
    pub index: usize,
    /// The sequence's state: the prompt and every token of this choice fed so far.
    pub state: S,
    pub stage: SamplingStage,
    text: TextStream<'t>,
    /// Log-probabilities of tokens whose text is still held back.
    pending: Vec<TokenLogprobs>,
    pub tokens: Vec<u32>,
    /// The most tokens this choice may add (the request's, or what the context has left).
    max_tokens: usize,
    /// The token chosen last: the one the next decode step feeds, or the one that ended the
    /// choice.
    pub next: u32,
    /// It ended with an end-of-turn token, so that the state can seed the next turn.
    pub ended_turn: bool,
}

impl<'t, S> ChoiceRun<'t, S> {
    /// Choice `index` of `job` from `state`, which holds the prompt; `room` tokens are left in
    /// the context. With a grammar, the choice walks it from its start.
    pub fn new(
        job: &GenerationJob,
        index: usize,
        state: S,
        text: &'t TextModel,
        room: usize,
    ) -> Result<Self> {
        let stage = Self::stage(job, index, text)?;
        Ok(Self::with_stage(job, index, state, text, room, stage))
    }

    /// Choice `index`'s sampling stage: its seed, the vocabulary limit, the penalties over the
    /// prompt, the grammar from its start. Made before the choice itself where the prompt's last
    /// chunk chooses the first token.
    pub fn stage(job: &GenerationJob, index: usize, text: &TextModel) -> Result<SamplingStage> {
        let sampling = SamplingParams {
            seed: choice_seed(job.sampling.seed, index),
            ..job.sampling.clone()
        };
        let sampler = Sampler::new(sampling)
            .with_vocab_limit(text.tokenizer.decodable_len())
            .with_penalties(job.penalties.clone(), &job.prompt);
        let mut stage = SamplingStage::new(sampler, job.logprobs);
        if let Some(grammar) = &job.grammar {
            stage = stage.with_constraint(grammar.start()?);
        }
        Ok(stage)
    }

    /// Choice `index` of `job` with `stage` (from [`ChoiceRun::stage`]).
    pub fn with_stage(
        job: &GenerationJob,
        index: usize,
        state: S,
        text: &'t TextModel,
        room: usize,
        stage: SamplingStage,
    ) -> Self {
        ChoiceRun {
            index,
            state,
            stage,
            text: TextStream::new(&text.tokenizer, &job.stop),
            pending: Vec::new(),
            tokens: Vec::new(),
            max_tokens: job.max_tokens.min(room),
            next: 0,
            ended_turn: false,
        }
    }

    /// Whether the choice may not produce a single token (`max_tokens` 0 scores the prompt).
    pub fn is_empty_budget(&self) -> bool {
        self.max_tokens == 0
    }

    /// Takes the next chosen token: emits what text it completes and says whether the choice
    /// has ended, and how. `None`: it goes on, and `next` is the token to feed.
    pub fn accept(&mut self, pick: Pick, stop_ids: &[u32], sink: &mut impl Sink) -> Option<Finish> {
        self.next = pick.token;
        if stop_ids.contains(&pick.token) {
            self.ended_turn = true;
            return Some(self.close(Finish::Stop, sink));
        }
        self.tokens.push(pick.token);
        self.pending.extend(pick.logprobs);
        let step = self.text.push(pick.token);
        if !step.text.is_empty() && self.send(step.text, sink).is_break() {
            return Some(Finish::Cancelled);
        }
        if step.stopped {
            return Some(self.close(Finish::Stop, sink));
        }
        if self.tokens.len() >= self.max_tokens {
            return Some(self.close(Finish::Length, sink));
        }
        if sink.cancelled() {
            return Some(Finish::Cancelled);
        }
        None
    }

    /// Whether the budget lets the choice go on after the pick of the step that feeds `next`:
    /// then that pick will be fed in turn, and a backend may queue its step early
    /// ([`lily_core::backend::DecodeRow::queue_next`]).
    pub fn outlasts_next_pick(&self) -> bool {
        self.tokens.len() + 1 < self.max_tokens
    }

    /// Sends the text still held back where the output ends whole (its length, or a turn's end;
    /// a stop string drops it), and the log-probabilities not yet sent.
    pub fn close(&mut self, finish: Finish, sink: &mut impl Sink) -> Finish {
        let tail = if finish == Finish::Length || self.ended_turn {
            self.text.finish().text
        } else {
            String::new()
        };
        match self.send(tail, sink) {
            ControlFlow::Break(()) => Finish::Cancelled,
            ControlFlow::Continue(()) => finish,
        }
    }

    fn send(&mut self, text: String, sink: &mut impl Sink) -> ControlFlow<()> {
        if text.is_empty() && self.pending.is_empty() {
            return ControlFlow::Continue(());
        }
        sink.emit(EngineEvent::Text {
            choice: self.index,
            text,
            logprobs: std::mem::take(&mut self.pending),
        })
    }
}
