//! A prompt going into its state, one chunk per engine step, so that the sequences already
//! generating wait at most one chunk for each of their tokens. It starts from the longest
//! snapshot the prompt extends, keeps a snapshot where the conversation before the generation
//! prompt ends (a fork taken inside the chunk's pass) and one after the whole prompt, and with
//! `prompt_logprobs` scores every prompt token from an empty state instead.
//!
//! A generation of one choice chooses its first token with the prompt's last chunk, where the
//! logits are (`Backend::prefill_choose`: on a GPU only the pick comes back, as in `lily
//! generate`); several choices share the prompt's logits on the host, each picking its own.

use anyhow::Result;
use lily_core::backend::{Backend, LogitRows};
use lily_core::logprobs::{TokenLogprobs, token_logprobs};
use lily_core::sampling_stage::{MAX_TOP_LOGPROBS, Pick, SamplingStage};

use super::choice::ChoiceRun;
use super::{Engine, GenerationJob};

/// Rows of logits a prompt scored for its log-probabilities is fed in: each row is a whole
/// vocabulary (1 MB at 248K), so the chunk bounds the memory, not the speed.
const SCORED_CHUNK: usize = 64;

pub(super) struct PromptFill<S> {
    pub state: S,
    /// Prompt tokens in the state.
    pub done: usize,
    /// Of those, the ones that came from a snapshot.
    pub cached: usize,
    /// The sole choice's stage, which chooses its first token with the last chunk; `None` where
    /// the prompt's logits come to the host anyway (several choices, a scored prompt, a snapshot
    /// that kept them) or no token is to be generated.
    stage: Option<Box<SamplingStage>>,
    /// What the prompt leaves its choices, once it is all in.
    pub end: Option<PromptEnd>,
    /// The snapshot after the whole prompt is still to be kept: for a first token chosen with
    /// the last chunk it is taken once that token has gone out (`Engine::start_picked`), off the
    /// path to the first text.
    pub keep_prompt: bool,
    /// `Some(k)`: every prompt token after the first is scored with its `k` most likely.
    scored: Option<usize>,
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// How a prompt's choices begin.
pub(super) enum PromptEnd {
    /// The logits after the prompt, on the host: each choice picks its first token from them.
    Logits(Vec<f32>),
    /// The sole choice's stage and the first token it chose with the prompt's last chunk.
    Picked(Box<SamplingStage>, Pick),
}

impl<B: Backend> Engine<B> {
    /// Where `job`'s prompt starts: the best snapshot, or an empty state.
    pub(super) fn begin_fill(&mut self, job: &GenerationJob) -> Result<PromptFill<B::State>> {
        let prompt = &job.prompt;
        let scored = job.prompt_logprobs.map(|k| k.min(MAX_TOP_LOGPROBS));
        let hit = match scored {
            Some(_) => None,
            None => self.snapshots.longest_prefix(prompt),
        };
        let (state, cached, end) = match hit {
            Some(hit) => {
                let whole = hit.tokens.len() == prompt.len();
                let logits = if whole { hit.logits.clone() } else { None };
                let end = logits.map(PromptEnd::Logits);
                (self.backend.fork(&hit.state)?, hit.tokens.len(), end)
            }
            None => (self.backend.new_state(self.max_seq)?, 0, None),
        };
        // `check` keeps the prompt shorter than the context.
        let room = self.max_seq.saturating_sub(prompt.len());
        let sole = job.n <= 1 && scored.is_none() && end.is_none();
        let stage = if sole && job.max_tokens.min(room) > 0 {
            Some(Box::new(ChoiceRun::<B::State>::stage(job, 0, &self.text)?))
        } else {
            None
        };
        let fill = PromptFill {
            state,
            done: cached,
            cached,
            stage,
            end,
            keep_prompt: false,
            scored,
            prompt_logprobs: Vec::new(),
        };
        Ok(fill)
    }

    /// Feeds the next chunk of the prompt (which must not be all in yet): up to the backend's
    /// largest chunk of tokens. Where the turn boundary falls inside the chunk, its snapshot is
    /// a fork taken within the chunk's pass (`Backend::prefill_forking`), not a second pass.
    pub(super) fn fill_chunk(
        &mut self,
        job: &GenerationJob,
        fill: &mut PromptFill<B::State>,
    ) -> Result<()> {
        if let Some(top) = fill.scored {
            return self.fill_scored_chunk(&job.prompt, top, fill);
        }
        let prompt = &job.prompt;
        let start = fill.done;
        let end = (start + self.backend.max_prefill_chunk().max(1)).min(prompt.len());
        let last = end == prompt.len();
        // The conversation before the generation prompt is where a later turn branches: kept
        // where the cache has room for it and does not hold it already.
        let boundary = job
            .turn_boundary
            .filter(|&b| start < b && b <= end && b < prompt.len())
            .filter(|&b| self.wants_snapshot(&prompt[..b], &fill.state, None));
        let fork_at = boundary.filter(|&b| b < end).map(|b| b - start);
        let fork = self.feed(fill, &prompt[start..end], last, fork_at)?;
        fill.done = end;
        match (boundary, fork) {
            (Some(b), Some(fork)) => self.insert_snapshot(&prompt[..b], fork, None),
            (Some(b), None) => self.keep_snapshot(&prompt[..b], &fill.state, None)?,
            (None, _) => {}
        }
        if last {
            // A snapshot keeps the logits where the host has them; without them it waits for
            // the first token to go out.
            match &fill.end {
                Some(PromptEnd::Logits(logits)) => {
                    self.keep_snapshot(prompt, &fill.state, Some(logits))?
                }
                _ => fill.keep_prompt = true,
            }
        }
        Ok(())
    }

    /// Appends `chunk` to the fill's state and, for the prompt's `last` chunk, leaves how its
    /// choices begin: the sole choice's first token chosen with the chunk, or the logits. With
    /// `fork_at`, returns a fork of the state after that many of the chunk's tokens.
    fn feed(
        &self,
        fill: &mut PromptFill<B::State>,
        chunk: &[u32],
        last: bool,
        fork_at: Option<usize>,
    ) -> Result<Option<B::State>> {
        let (backend, state) = (&self.backend, &mut fill.state);
        if last && let Some(mut stage) = fill.stage.take() {
            let (pick, fork) = match fork_at {
                Some(at) => {
                    let (pick, fork) = stage.prefill_forking(backend, state, chunk, at)?;
                    (pick, Some(fork))
                }
                None => (stage.prefill(backend, state, chunk)?, None),
            };
            fill.end = Some(PromptEnd::Picked(stage, pick));
            return Ok(fork);
        }
        let rows = if last {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        let (logits, fork) = match fork_at {
            Some(at) => {
                let (logits, fork) = backend.prefill_forking(state, chunk, at, rows)?;
                (logits, Some(fork))
            }
            None => (backend.prefill(state, chunk, rows)?, None),
        };
        if last {
            fill.end = Some(PromptEnd::Logits(logits));
        }
        Ok(fork)
    }

    /// A chunk of a prompt scored from an empty state with every row's logits (a snapshot has
    /// none to give), keeping the log-probability of each prompt token after the first.
    fn fill_scored_chunk(
        &mut self,
        prompt: &[u32],
        top: usize,
        fill: &mut PromptFill<B::State>,
    ) -> Result<()> {
        let vocab = self.backend.config().vocab_size;
        let choosable = self.text.tokenizer.decodable_len();
        let chunk = self.backend.max_prefill_chunk().clamp(1, SCORED_CHUNK);
        let start = fill.done;
        let end = (start + chunk).min(prompt.len());
        let rows = self
            .backend
            .prefill(&mut fill.state, &prompt[start..end], LogitRows::All)?;
        for (r, row) in rows.chunks(vocab).enumerate() {
            // Row r predicts the token after position start + r.
            if let Some(&next) = prompt.get(start + r + 1) {
                fill.prompt_logprobs
                    .push(token_logprobs(row, next, top, choosable));
            }
        }
        fill.done = end;
        if end == prompt.len() {
            let last = rows[rows.len().saturating_sub(vocab)..].to_vec();
            self.keep_snapshot(prompt, &fill.state, Some(&last))?;
            fill.end = Some(PromptEnd::Logits(last));
        }
        Ok(())
    }
}
