//! The CPU backend: the whole `qwen3_5_moe` forward pass in f32, written to be read. It is the
//! reference that every other backend is tested against, and a fallback where no GPU exists.

mod attention;
pub mod delta_rule;
mod gdn;
mod moe;
pub mod ops;
pub mod quant;
mod state;

use anyhow::{Result, bail, ensure};
use lily_core::backend::{Backend, LogitRows};
use lily_core::config::ModelConfig;
use lily_core::weights::{Mixer, ModelWeights};

pub use gdn::{GDN_CHUNK, GdnForm};
pub use moe::{Route, route};
pub use state::CpuState;

use crate::ops::{add_in_place, matmul, rms_norm};
use crate::state::LayerState;

pub struct CpuBackend {
    config: ModelConfig,
    weights: ModelWeights,
    gdn_prefill: GdnForm,
    max_prefill_chunk: usize,
}

impl CpuBackend {
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Self {
        CpuBackend {
            config,
            weights,
            gdn_prefill: GdnForm::Chunked,
            max_prefill_chunk: 512,
        }
    }

    /// Chooses the delta-rule form used for prefill chunks of more than one token.
    pub fn with_gdn_prefill(mut self, form: GdnForm) -> Self {
        self.gdn_prefill = form;
        self
    }

    /// Sets the largest chunk a prefill call takes at once (bounds scratch memory).
    pub fn with_max_prefill_chunk(mut self, tokens: usize) -> Self {
        self.max_prefill_chunk = tokens.max(1);
        self
    }

    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    /// Runs `tokens` through the model, optionally recording the hidden state of every row
    /// after the embedding and after each layer (for layer-by-layer comparison with a reference).
    pub fn forward(
        &self,
        state: &mut CpuState,
        tokens: &[u32],
        rows: LogitRows,
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        ensure!(!tokens.is_empty(), "no tokens to run");
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            bail!(
                "token id {bad} is out of range (vocabulary size {})",
                c.vocab_size
            );
        }
        if state.len + tokens.len() > state.max_seq {
            bail!(
                "sequence of {} tokens exceeds the context of {} tokens",
                state.len + tokens.len(),
                state.max_seq
            );
        }
        let (h, n) = (c.hidden_size, tokens.len());
        let mut hidden = vec![0f32; n * h];
        for (row, &t) in hidden.chunks_mut(h).zip(tokens) {
            self.weights.embed_tokens.row_into(t as usize, row);
        }
        if let Some(tr) = trace.as_deref_mut() {
            tr.push(hidden.clone());
        }
        let form = if n == 1 {
            GdnForm::Recurrent
        } else {
            self.gdn_prefill
        };
        for (layer, layer_state) in self.weights.layers.iter().zip(state.layers.iter_mut()) {
            let x = rms_norm(&hidden, &layer.input_norm, c.rms_norm_eps);
            let mixed = match (&layer.mixer, layer_state) {
                (Mixer::Attention(w), LayerState::Attention(kv)) => {
                    attention::attention(c, w, &x, n, state.len, kv)
                }
                (Mixer::GatedDeltaNet(w), LayerState::GatedDeltaNet(s)) => {
                    gdn::gated_delta_net(c, w, &x, n, s, form)
                }
                _ => unreachable!("states are built from the same config as the weights"),
            };
            add_in_place(&mut hidden, &mixed);
            let x = rms_norm(&hidden, &layer.post_attention_norm, c.rms_norm_eps);
            add_in_place(&mut hidden, &moe::moe(c, &layer.moe, &x, n));
            if let Some(tr) = trace.as_deref_mut() {
                tr.push(hidden.clone());
            }
        }
        state.len += n;
        let (first, count) = match rows {
            LogitRows::All => (0, n),
            LogitRows::Last => (n - 1, 1),
        };
        let normed = rms_norm(
            &hidden[first * h..(first + count) * h],
            &self.weights.final_norm,
            c.rms_norm_eps,
        );
        Ok(matmul(&normed, count, &self.weights.lm_head))
    }
}

impl Backend for CpuBackend {
    type State = CpuState;

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device_name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn max_prefill_chunk(&self) -> usize {
        self.max_prefill_chunk
    }

    fn new_state(&self, max_seq: usize) -> Result<CpuState> {
        ensure!(max_seq > 0, "the context must hold at least one token");
        Ok(CpuState::new(&self.config, max_seq))
    }

    fn state_len(&self, state: &CpuState) -> usize {
        state.len
    }

    fn fork(&self, state: &CpuState) -> Result<CpuState> {
        Ok(state.clone())
    }

    fn prefill(&self, state: &mut CpuState, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        self.forward(state, tokens, rows, None)
    }
}
