//! The step-level backend boundary (design.md, principle 2).
//!
//! A backend runs whole steps — prefill a chunk, decode a token, copy a sequence state — not single
//! ops, so each backend is free to fuse and schedule as it likes. The CPU backend is the reference
//! every other backend is tested against.

use anyhow::{Result, ensure};

use crate::choice::{Choice, Pick};
use crate::config::ModelConfig;

/// Which rows of logits a prefill returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// None: a prompt's chunks before its last, whose state is all that is wanted; skips the
    /// lm_head and the copy of a vocabulary-wide row.
    None,
    /// Only the last position (what generation needs; skips the lm_head elsewhere).
    Last,
    /// Every position (teacher-forced scoring).
    All,
}

/// One sequence's part in a batched decode step: the token it consumes, how the token after it
/// is to be chosen, and whether the step after this one may start before that token reaches the
/// host.
pub struct DecodeRow<'a, S> {
    pub state: &'a mut S,
    pub token: u32,
    pub choice: Choice<'a>,
    /// The caller will feed this step's pick back to the same state with a choice made as this
    /// one (the same sampler, no mask), so a device backend may queue that step now, before the
    /// pick comes back, and run it while the host handles the picks (see
    /// [`Backend::decode_batch`]). False where the sequence may end with this pick.
    pub queue_next: bool,
}

pub trait Backend: Send + Sync {
    /// Everything one sequence carries between steps: KV cache, conv and recurrent state, length.
    type State: Send;

    fn config(&self) -> &ModelConfig;

    /// A human-readable name of the device, for logs and benchmark records.
    fn device_name(&self) -> String;

    /// The largest chunk `prefill` accepts at once; callers split longer prompts.
    fn max_prefill_chunk(&self) -> usize;

    /// An empty sequence that can grow to `max_seq` tokens.
    fn new_state(&self, max_seq: usize) -> Result<Self::State>;

    /// Tokens already consumed by a state.
    fn state_len(&self, state: &Self::State) -> usize;

    /// An independent copy of a state (a snapshot to branch from later).
    fn fork(&self, state: &Self::State) -> Result<Self::State>;

    /// The memory a state holds, so that a cache of snapshots can keep to a budget. The default
    /// counts what the CPU backend keeps: an f32 KV cache of the tokens consumed, the conv window
    /// and the recurrent state. A backend that preallocates its context or stores bf16 overrides it.
    fn state_bytes(&self, state: &Self::State) -> usize {
        let c = self.config();
        let kv = c.kv_bytes_per_token(4) * self.state_len(state) as u64;
        (kv + c.conv_state_bytes(4) + c.recurrent_state_bytes()) as usize
    }

    /// Appends `tokens` to the sequence and returns logits, row-major `[rows, vocab]` (empty
    /// for [`LogitRows::None`]). On error the state is unchanged.
    fn prefill(&self, state: &mut Self::State, tokens: &[u32], rows: LogitRows)
    -> Result<Vec<f32>>;

    /// Appends `tokens` as [`Backend::prefill`] does and makes the choice that follows them.
    /// Device backends override this to choose on the device, sending back only the pick.
    fn prefill_choose(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        let logits = self.prefill(state, tokens, LogitRows::Last)?;
        Ok(choice.pick(&logits))
    }

    /// Appends `tokens` as [`Backend::prefill`] does and also returns a fork of the state as it
    /// stood after the first `at` of them (0 < `at` < `tokens.len()`): the snapshot where a
    /// conversation branches, inside the chunk that goes on to the generation prompt. This default
    /// runs the two parts as two prefills with a fork between; a device backend takes the fork
    /// inside one pass. On error the state may hold the first part; callers drop it.
    fn prefill_forking(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        at: usize,
        rows: LogitRows,
    ) -> Result<(Vec<f32>, Self::State)> {
        check_fork(tokens, at)?;
        let first_rows = match rows {
            LogitRows::All => LogitRows::All,
            LogitRows::Last | LogitRows::None => LogitRows::None,
        };
        let mut logits = self.prefill(state, &tokens[..at], first_rows)?;
        let fork = self.fork(state)?;
        logits.extend(self.prefill(state, &tokens[at..], rows)?);
        Ok((logits, fork))
    }

    /// [`Backend::prefill_forking`] that makes the choice after the tokens as
    /// [`Backend::prefill_choose`] does.
    fn prefill_choose_forking(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        at: usize,
        choice: &mut Choice<'_>,
    ) -> Result<(Pick, Self::State)> {
        check_fork(tokens, at)?;
        self.prefill(state, &tokens[..at], LogitRows::None)?;
        let fork = self.fork(state)?;
        let pick = self.prefill_choose(state, &tokens[at..], choice)?;
        Ok((pick, fork))
    }

    /// Appends one token and returns the logits that follow it.
    fn decode(&self, state: &mut Self::State, token: u32) -> Result<Vec<f32>> {
        self.prefill(state, &[token], LogitRows::Last)
    }

    /// Appends one token and makes the choice of the next. Device backends override this to
    /// choose without returning the logits to the host.
    fn decode_choose(
        &self,
        state: &mut Self::State,
        token: u32,
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        let logits = self.decode(state, token)?;
        Ok(choice.pick(&logits))
    }

    /// Advances every row's state by its token, in one step where the backend can (each weight
    /// read once for all rows), and makes each row's choice; one [`Pick`] per row, in order.
    /// Every row must give what the same row decoded alone gives. This default runs the rows one
    /// at a time; if it fails, rows before the failing one have advanced, so a caller ends the
    /// whole batch.
    ///
    /// A device backend may honour [`DecodeRow::queue_next`]: the step after this one, fed by
    /// this step's pick where the device left it, is queued before the picks come back, so the
    /// device never waits for the host between steps. The state has then consumed the pick too
    /// ([`Backend::state_len`] counts it), the next call for it must feed that pick, and that
    /// call returns what the queued step chose. A caller whose sequence ends at a pick finds
    /// its state one token further on where the step was queued; this default queues nothing.
    fn decode_batch(&self, rows: &mut [DecodeRow<'_, Self::State>]) -> Result<Vec<Pick>> {
        rows.iter_mut()
            .map(|row| self.decode_choose(row.state, row.token, &mut row.choice))
            .collect()
    }
}

/// A fork inside a prefill falls strictly between its first and last token.
pub fn check_fork(tokens: &[u32], at: usize) -> Result<()> {
    ensure!(
        at > 0 && at < tokens.len(),
        "a fork inside a prefill must leave tokens on both sides: {at} of {}",
        tokens.len()
    );
    Ok(())
}
