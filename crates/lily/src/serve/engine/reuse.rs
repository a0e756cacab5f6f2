//! What the engine keeps for later requests: snapshots of sequence states in the cache, where
//! it has room and holds none as good (after a prompt, at a conversation's turn boundary, and at
//! the end of a turn the reply closed).

use anyhow::Result;
use lily_core::backend::{Backend, LogitRows};

use super::Engine;

impl<B: Backend> Engine<B> {
    /// After a reply that ended its turn with `stop`, the state plus `<|im_end|>\n` is where
    /// the next turn continues when the template renders the reply back as it was generated.
    /// `fed` is the prompt and the reply's tokens before `stop`; a step queued before the host
    /// saw `stop` has fed it too, which serves where it is the turn end's first token.
    pub(super) fn snapshot_end_of_turn(
        &mut self,
        fed: Vec<u32>,
        stop: u32,
        mut state: B::State,
    ) -> Result<()> {
        let len = fed.len() + self.turn_end.len();
        if len > self.max_seq || !self.snapshots.fits(self.backend.state_bytes(&state), 0) {
            return Ok(());
        }
        let rest = match self.backend.state_len(&state).checked_sub(fed.len()) {
            Some(0) => &self.turn_end[..],
            Some(1) if self.turn_end.first() == Some(&stop) => &self.turn_end[1..],
            _ => return Ok(()),
        };
        if !rest.is_empty() {
            self.backend.prefill(&mut state, rest, LogitRows::None)?;
        }
        let bytes = self.backend.state_bytes(&state);
        let tokens = [fed, self.turn_end.clone()].concat();
        self.snapshots.insert(tokens, state, None, bytes);
        Ok(())
    }

    /// Whether the cache would keep a snapshot of `state` after `tokens` (with `logits`): it has
    /// room and holds none as good.
    pub(super) fn wants_snapshot(
        &self,
        tokens: &[u32],
        state: &B::State,
        logits: Option<&Vec<f32>>,
    ) -> bool {
        let (bytes, logit_count) = (self.backend.state_bytes(state), logits.map_or(0, Vec::len));
        self.snapshots.fits(bytes, logit_count)
            && !self.snapshots.contains(tokens, logits.is_some())
    }

    /// Keeps a fork of `state` after `tokens`, where the cache wants it.
    pub(super) fn keep_snapshot(
        &mut self,
        tokens: &[u32],
        state: &B::State,
        logits: Option<&Vec<f32>>,
    ) -> Result<()> {
        if self.wants_snapshot(tokens, state, logits) {
            let snapshot = self.backend.fork(state)?;
            self.insert_snapshot(tokens, snapshot, logits.cloned());
        }
        Ok(())
    }

    pub(super) fn insert_snapshot(
        &mut self,
        tokens: &[u32],
        state: B::State,
        logits: Option<Vec<f32>>,
    ) {
        let bytes = self.backend.state_bytes(&state);
        self.snapshots.insert(tokens.to_vec(), state, logits, bytes);
    }
}
