//! The backend chosen at run time (`--device`), behind the same step-level trait, so every
//! command and the server are written once for any backend.

use anyhow::{Result, bail};
use lily_core::backend::{Backend, DecodeRow, LogitRows};
use lily_core::choice::{Choice, Pick};
use lily_core::config::ModelConfig;
use lily_cpu::{CpuBackend, CpuState};
use lily_cuda::{CudaBackend, CudaState};

pub enum AnyBackend {
    Cpu(Box<CpuBackend>),
    Cuda(Box<CudaBackend>),
}

pub enum AnyState {
    Cpu(CpuState),
    Cuda(Box<CudaState>),
}

impl From<CpuState> for AnyState {
    fn from(state: CpuState) -> Self {
        AnyState::Cpu(state)
    }
}

impl From<CudaState> for AnyState {
    fn from(state: CudaState) -> Self {
        AnyState::Cuda(Box::new(state))
    }
}

fn mismatch() -> anyhow::Error {
    anyhow::anyhow!("a sequence state was used with a backend other than the one that made it")
}

/// Forwards a call to whichever backend this is, with the state of the same kind.
macro_rules! with_state {
    ($self:expr, $state:expr, $b:ident, $s:ident => $body:expr) => {
        match ($self, $state) {
            (AnyBackend::Cpu($b), AnyState::Cpu($s)) => $body,
            (AnyBackend::Cuda($b), AnyState::Cuda($s)) => $body,
            _ => bail!(mismatch()),
        }
    };
}

impl AnyBackend {
    /// How many generations the server runs at once unless told. CUDA: 8, what its batched
    /// decode step is built for. The CPU: one per core (from 2 to 8), since the attention and
    /// the Gated DeltaNet of each sequence run on cores of their own while the batch shares
    /// every weight read.
    pub fn default_max_batch(&self) -> usize {
        match self {
            AnyBackend::Cpu(_) => lily_cpu::threads().clamp(2, 8),
            AnyBackend::Cuda(_) => 8,
        }
    }
}

impl Backend for AnyBackend {
    type State = AnyState;

    fn config(&self) -> &ModelConfig {
        match self {
            AnyBackend::Cpu(b) => b.config(),
            AnyBackend::Cuda(b) => b.config(),
        }
    }

    fn device_name(&self) -> String {
        match self {
            AnyBackend::Cpu(b) => b.device_name(),
            AnyBackend::Cuda(b) => b.device_name(),
        }
    }

    fn max_prefill_chunk(&self) -> usize {
        match self {
            AnyBackend::Cpu(b) => b.max_prefill_chunk(),
            AnyBackend::Cuda(b) => b.max_prefill_chunk(),
        }
    }

    fn new_state(&self, max_seq: usize) -> Result<AnyState> {
        Ok(match self {
            AnyBackend::Cpu(b) => b.new_state(max_seq)?.into(),
            AnyBackend::Cuda(b) => b.new_state(max_seq)?.into(),
        })
    }

    fn state_len(&self, state: &AnyState) -> usize {
        match state {
            AnyState::Cpu(s) => s.len(),
            AnyState::Cuda(s) => s.len(),
        }
    }

    fn state_bytes(&self, state: &AnyState) -> usize {
        match (self, state) {
            (AnyBackend::Cpu(b), AnyState::Cpu(s)) => b.state_bytes(s),
            (AnyBackend::Cuda(b), AnyState::Cuda(s)) => b.state_bytes(s),
            // A mismatched state is refused by every other call; it holds no memory of ours.
            _ => 0,
        }
    }

    fn fork(&self, state: &AnyState) -> Result<AnyState> {
        Ok(match (self, state) {
            (AnyBackend::Cpu(b), AnyState::Cpu(s)) => b.fork(s)?.into(),
            (AnyBackend::Cuda(b), AnyState::Cuda(s)) => b.fork(s)?.into(),
            _ => bail!(mismatch()),
        })
    }

    fn prefill(&self, state: &mut AnyState, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        with_state!(self, state, b, s => b.prefill(s, tokens, rows))
    }

    fn prefill_choose(
        &self,
        state: &mut AnyState,
        tokens: &[u32],
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        with_state!(self, state, b, s => b.prefill_choose(s, tokens, choice))
    }

    fn prefill_forking(
        &self,
        state: &mut AnyState,
        tokens: &[u32],
        at: usize,
        rows: LogitRows,
    ) -> Result<(Vec<f32>, AnyState)> {
        with_state!(self, state, b, s => {
            let (logits, fork) = b.prefill_forking(s, tokens, at, rows)?;
            Ok((logits, fork.into()))
        })
    }

    fn prefill_choose_forking(
        &self,
        state: &mut AnyState,
        tokens: &[u32],
        at: usize,
        choice: &mut Choice<'_>,
    ) -> Result<(Pick, AnyState)> {
        with_state!(self, state, b, s => {
            let (pick, fork) = b.prefill_choose_forking(s, tokens, at, choice)?;
            Ok((pick, fork.into()))
        })
    }

    fn decode(&self, state: &mut AnyState, token: u32) -> Result<Vec<f32>> {
        with_state!(self, state, b, s => b.decode(s, token))
    }

    fn decode_choose(
        &self,
        state: &mut AnyState,
        token: u32,
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        with_state!(self, state, b, s => b.decode_choose(s, token, choice))
    }

    fn decode_batch(&self, rows: &mut [DecodeRow<'_, AnyState>]) -> Result<Vec<Pick>> {
        match self {
            AnyBackend::Cpu(b) => b.decode_batch(&mut narrowed(rows, |s| match s {
                AnyState::Cpu(s) => Some(s),
                AnyState::Cuda(_) => None,
            })?),
            AnyBackend::Cuda(b) => b.decode_batch(&mut narrowed(rows, |s| match s {
                AnyState::Cuda(s) => Some(&mut **s),
                AnyState::Cpu(_) => None,
            })?),
        }
    }
}

/// The rows with their states as the backend's own kind, which `state` picks out.
fn narrowed<'a, S>(
    rows: &'a mut [DecodeRow<'_, AnyState>],
    state: impl Fn(&'a mut AnyState) -> Option<&'a mut S>,
) -> Result<Vec<DecodeRow<'a, S>>> {
    rows.iter_mut()
        .map(|row| {
            Ok(DecodeRow {
                state: state(&mut *row.state).ok_or_else(mismatch)?,
                token: row.token,
                choice: row.choice.reborrow(),
                queue_next: row.queue_next,
            })
        })
        .collect()
}
