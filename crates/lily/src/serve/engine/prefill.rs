//! A prompt going into its state, one chunk per engine step, so that the sequences already
//! generating wait at most one chunk for each of their tokens. It starts from the longest
//! snapshot the prompt extends, keeps a snapshot where the conversation before the generation
//! prompt ends and one after the whole prompt, and with `prompt_logprobs` scores every prompt
//! token from an empty state instead.

use anyhow::Result;
use lily_core::backend::{Backend, LogitRows};
use lily_core::logprobs::{TokenLogprobs, token_logprobs};
use lily_core::sampling_stage::MAX_TOP_LOGPROBS;

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
    /// The logits after the whole prompt, once it is in.
    pub logits: Option<Vec<f32>>,
    /// `Some(k)`: every prompt token after the first is scored with its `k` most likely.
    scored: Option<usize>,
    pub prompt_logprobs: Vec<TokenLogprobs>,
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
        let (state, cached, logits) = match hit {
            Some(hit) => {
                let whole = hit.tokens.len() == prompt.len();
                let logits = if whole { hit.logits.clone() } else { None };
                (self.backend.fork(&hit.state)?, hit.tokens.len(), logits)
            }
            None => (self.backend.new_state(self.max_seq)?, 0, None),
        };
        let fill = PromptFill {
            state,
            done: cached,
            cached,
            logits,
            scored,
            prompt_logprobs: Vec::new(),
        };
        Ok(fill)
    }

    /// Feeds the next chunk of the prompt (which must not be all in yet): up to the backend's
    /// largest chunk of tokens, in two calls where the turn boundary falls inside it.
    pub(super) fn fill_chunk(
        &mut self,
        job: &GenerationJob,
        fill: &mut PromptFill<B::State>,
    ) -> Result<()> {
        if let Some(top) = fill.scored {
            return self.fill_scored_chunk(&job.prompt, top, fill);
        }
        let prompt = &job.prompt;
        let mut budget = self.backend.max_prefill_chunk().max(1);
        while budget > 0 && fill.done < prompt.len() {
            let start = fill.done;
            let mut end = (start + budget).min(prompt.len());
            // The conversation before the generation prompt is where a later turn branches.
            let boundary = job
                .turn_boundary
                .filter(|&b| start < b && b < prompt.len() && b <= end);
            if let Some(b) = boundary {
                end = b;
            }
            let logits =
                self.backend
                    .prefill(&mut fill.state, &prompt[start..end], LogitRows::Last)?;
            (fill.done, budget) = (end, budget - (end - start));
            if boundary.is_some() {
                self.keep_snapshot(&prompt[..end], &fill.state, None)?;
            }
            if end == prompt.len() {
                self.keep_snapshot(prompt, &fill.state, Some(&logits))?;
                fill.logits = Some(logits);
            }
        }
        Ok(())
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
            fill.logits = Some(last);
        }
        Ok(())
    }
}
