//! The batched decode step: one token for each of several sequences in one pass over the
//! weights. Every projection, the router, the experts and the lm_head multiply the `[B, width]`
//! rows at once, so each weight row is read (and dequantised) once per step rather than once per
//! sequence; the MoE groups the rows by the experts they chose, so an expert's weights are read
//! once for every row that picked it. The attention and the Gated DeltaNet core run per
//! sequence, on each one's own cache and recurrent state.
//!
//! Each row's result is bit-identical to decoding it alone: every product computes a row's dot
//! products in the same order whatever the other rows are (the quantised kernels keep one
//! accumulator set per input row), norms and routing are per row, and the MoE combines a row's
//! experts in expert order either way.

use anyhow::{Result, bail, ensure};
use lily_core::weights::Mixer;

use crate::ops::{add_in_place, rms_norm};
use crate::profile::{Stage, stage};
use crate::state::{CpuState, LayerState};
use crate::{CpuBackend, attention, gdn, moe};

impl CpuBackend {
    /// Feeds `tokens[i]` to `states[i]` for every i and returns the logits, `[B, vocab]`.
    /// Checked before anything runs, so on error no state has changed.
    pub fn decode_rows(&self, states: &mut [&mut CpuState], tokens: &[u32]) -> Result<Vec<f32>> {
        crate::team::step(|| self.decode_rows_here(states, tokens))
    }

    fn decode_rows_here(&self, states: &mut [&mut CpuState], tokens: &[u32]) -> Result<Vec<f32>> {
        let c = &self.config;
        ensure!(
            states.len() == tokens.len() && !tokens.is_empty(),
            "a batch needs one token per sequence ({} states, {} tokens)",
            states.len(),
            tokens.len()
        );
        for (state, &token) in states.iter().zip(tokens) {
            if token as usize >= c.vocab_size {
                bail!(
                    "token id {token} is out of range (vocabulary size {})",
                    c.vocab_size
                );
            }
            if state.len + 1 > state.max_seq {
                bail!(
                    "sequence of {} tokens exceeds the context of {} tokens",
                    state.len + 1,
                    state.max_seq
                );
            }
        }
        let mut hidden = stage(Stage::Norms, || self.embed(tokens));
        let starts: Vec<usize> = states.iter().map(|s| s.len).collect();
        let nx = self.decode_numerics();
        for (l, layer) in self.weights().layers.iter().enumerate() {
            let x = stage(Stage::Norms, || {
                rms_norm(&hidden, &layer.input_norm, c.rms_norm_eps)
            });
            let mut layer_states: Vec<&mut LayerState> =
                states.iter_mut().map(|s| &mut s.layers[l]).collect();
            let mixed = match &layer.mixer {
                Mixer::Attention(w) => {
                    let mut caches: Vec<_> = layer_states.iter_mut().map(|s| s.kv()).collect();
                    attention::attention_batch(c, w, &x, &starts, &mut caches, nx)
                }
                Mixer::GatedDeltaNet(w) => {
                    let mut gdn: Vec<_> = layer_states.iter_mut().map(|s| s.gdn()).collect();
                    gdn::gated_delta_net_batch(c, w, &x, &mut gdn, nx)
                }
            };
            let x = stage(Stage::Norms, || {
                add_in_place(&mut hidden, &mixed);
                rms_norm(&hidden, &layer.post_attention_norm, c.rms_norm_eps)
            });
            let experts = moe::moe(c, &layer.moe, &x, tokens.len(), nx);
            stage(Stage::Norms, || add_in_place(&mut hidden, &experts));
        }
        for state in states.iter_mut() {
            state.len += 1;
        }
        Ok(stage(Stage::LmHead, || {
            self.lm_head(&hidden, tokens.len(), nx)
        }))
    }
}
