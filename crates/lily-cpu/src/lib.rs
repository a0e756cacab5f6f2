//! The CPU backend: the whole `qwen3_5_moe` forward pass in f32, written to be read. It is the
//! reference that every other backend is tested against, and a fallback where no GPU exists.
//! [`Numerics::TensorCoreBf16`] makes it round where the CUDA prefill rounds, so that a test can
//! hold the GPU to a reference that differs from it only by summation order.

mod attention;
mod batch;
pub mod delta_rule;
mod gdn;
mod heap;
mod moe;
mod numerics;
pub mod ops;
mod options;
pub mod products;
pub mod profile;
pub mod quant;
mod state;
mod team;

use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use lily_core::backend::{Backend, DecodeRow, LogitRows};
use lily_core::choice::Pick;
use lily_core::config::ModelConfig;
use lily_core::weights::{Mixer, ModelWeights};

pub use gdn::{GDN_CHUNK, GdnForm};
pub use moe::{Route, route};
pub use numerics::{FA_KEYS, KvPrecision, Numerics, bf16};
pub use options::CpuOptions;
pub use quant::InputParts;
pub use state::CpuState;
pub use team::threads;

use crate::ops::{add_in_place, rms_norm};
use crate::profile::{Stage, stage};
use crate::state::LayerState;

pub struct CpuBackend {
    config: ModelConfig,
    /// Shared, so that backends of different numerics can run one copy of a large model.
    weights: Arc<ModelWeights>,
    gdn_prefill: GdnForm,
    numerics: Numerics,
    kv: KvPrecision,
    max_prefill_chunk: usize,
}

impl CpuBackend {
    pub fn new(config: ModelConfig, weights: impl Into<Arc<ModelWeights>>) -> Self {
        heap::keep_freed_memory();
        CpuBackend {
            config,
            weights: weights.into(),
            // Token by token: on a CPU the state (64 KB a head) stays in L2 across a chunk, and
            // two passes over it a token cost less than the WY form's small products (0.70 ms
            // against 1.15 for one head of 256 tokens on one Zen 4 core).
            gdn_prefill: GdnForm::Recurrent,
            numerics: Numerics::F32,
            kv: KvPrecision::F32,
            max_prefill_chunk: 512,
        }
    }

    /// Chooses the delta-rule form used for prefill chunks of more than one token.
    pub fn with_gdn_prefill(mut self, form: GdnForm) -> Self {
        self.gdn_prefill = form;
        self
    }

    /// Chooses where the forward pass rounds (decode steps compute in f32 unless the inputs
    /// are rounded to int8 everywhere).
    pub fn with_numerics(mut self, numerics: Numerics) -> Self {
        self.numerics = numerics;
        self
    }

    /// Applies the environment's settings ([`CpuOptions`]).
    pub fn with_options(self, options: &CpuOptions) -> Self {
        self.with_numerics(options.numerics)
    }

    /// Chooses how the states this backend makes store keys and values.
    pub fn with_kv_precision(mut self, kv: KvPrecision) -> Self {
        self.kv = kv;
        self
    }

    /// Sets the largest chunk a prefill call takes at once (bounds scratch memory).
    pub fn with_max_prefill_chunk(mut self, tokens: usize) -> Self {
        self.max_prefill_chunk = tokens.max(1);
        self
    }

    /// A decode step's numerics: f32 as the CUDA decode step computes, whatever a prefill's
    /// rounding, unless the inputs are rounded to int8 everywhere.
    fn decode_numerics(&self) -> Numerics {
        match self.numerics {
            Numerics::Int8Inputs(parts) => Numerics::Int8Inputs(parts),
            Numerics::F32 | Numerics::TensorCoreBf16 => Numerics::F32,
        }
    }

    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    /// Runs `tokens` through the model as a prefill, optionally recording the hidden state of
    /// every row after the embedding and after each layer (for layer-by-layer comparison with a
    /// reference).
    pub fn forward(
        &self,
        state: &mut CpuState,
        tokens: &[u32],
        rows: LogitRows,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        self.run(state, tokens, rows, trace, self.numerics)
    }

    /// The forward pass in the numerics `nx`.
    fn run(
        &self,
        state: &mut CpuState,
        tokens: &[u32],
        rows: LogitRows,
        trace: Option<&mut Vec<Vec<f32>>>,
        nx: Numerics,
    ) -> Result<Vec<f32>> {
        team::step(|| self.run_here(state, tokens, rows, trace, nx))
    }

    fn run_here(
        &self,
        state: &mut CpuState,
        tokens: &[u32],
        rows: LogitRows,
        mut trace: Option<&mut Vec<Vec<f32>>>,
        nx: Numerics,
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
        let mut hidden = stage(Stage::Norms, || self.embed(tokens));
        if let Some(tr) = trace.as_deref_mut() {
            tr.push(hidden.clone());
        }
        let form = if n == 1 {
            GdnForm::Recurrent
        } else {
            self.gdn_prefill
        };
        for (layer, layer_state) in self.weights.layers.iter().zip(state.layers.iter_mut()) {
            let x = stage(Stage::Norms, || {
                rms_norm(&hidden, &layer.input_norm, c.rms_norm_eps)
            });
            let mixed = match (&layer.mixer, layer_state) {
                (Mixer::Attention(w), LayerState::Attention(kv)) => {
                    attention::attention(c, w, &x, n, state.len, kv, nx)
                }
                (Mixer::GatedDeltaNet(w), LayerState::GatedDeltaNet(s)) => {
                    gdn::gated_delta_net(c, w, &x, n, s, form, nx)
                }
                _ => unreachable!("states are built from the same config as the weights"),
            };
            let x = stage(Stage::Norms, || {
                add_in_place(&mut hidden, &mixed);
                rms_norm(&hidden, &layer.post_attention_norm, c.rms_norm_eps)
            });
            let experts = moe::moe(c, &layer.moe, &x, n, nx);
            stage(Stage::Norms, || add_in_place(&mut hidden, &experts));
            if let Some(tr) = trace.as_deref_mut() {
                tr.push(hidden.clone());
            }
        }
        state.len += n;
        let (first, count) = match rows {
            LogitRows::All => (0, n),
            LogitRows::Last => (n - 1, 1),
            LogitRows::None => return Ok(Vec::new()),
        };
        let last = &hidden[first * h..(first + count) * h];
        Ok(stage(Stage::LmHead, || self.lm_head(last, count, nx)))
    }

    /// The embedding rows of `tokens`.
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.config.hidden_size;
        let mut hidden = vec![0f32; tokens.len() * h];
        for (row, &t) in hidden.chunks_mut(h).zip(tokens) {
            self.weights.embed_tokens.row_into(t as usize, row);
        }
        hidden
    }

    /// The logits of `rows` final hidden rows.
    fn lm_head(&self, hidden: &[f32], rows: usize, nx: Numerics) -> Vec<f32> {
        let normed = rms_norm(hidden, &self.weights.final_norm, self.config.rms_norm_eps);
        nx.matmul(&normed, rows, &self.weights.lm_head)
    }
}

impl Backend for CpuBackend {
    type State = CpuState;

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device_name(&self) -> String {
        format!("cpu ({} threads)", threads())
    }

    fn max_prefill_chunk(&self) -> usize {
        self.max_prefill_chunk
    }

    fn new_state(&self, max_seq: usize) -> Result<CpuState> {
        ensure!(max_seq > 0, "the context must hold at least one token");
        Ok(CpuState::new(&self.config, max_seq, self.kv))
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

    /// A prefill of one token in the decode numerics.
    fn decode(&self, state: &mut CpuState, token: u32) -> Result<Vec<f32>> {
        self.run(
            state,
            &[token],
            LogitRows::Last,
            None,
            self.decode_numerics(),
        )
    }

    /// One step for every row, each weight read once for all of them (batch.rs).
    fn decode_batch(&self, rows: &mut [DecodeRow<'_, CpuState>]) -> Result<Vec<Pick>> {
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let mut states: Vec<&mut CpuState> = rows.iter_mut().map(|r| &mut *r.state).collect();
        let logits = self.decode_rows(&mut states, &tokens)?;
        let vocab = self.config.vocab_size;
        Ok(rows
            .iter_mut()
            .zip(logits.chunks(vocab))
            .map(|(row, logits)| row.choice.pick(logits))
            .collect())
    }
}
