//! One sequence on the GPU: KV caches, conv windows, recurrent states, the token slot that
//! the step reads and the argmax writes, the position counter, and the step's captured graph.

use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use cudarc::driver::{CudaGraph, CudaSlice};
use lily_core::config::{LayerKind, ModelConfig};

use crate::compile::{KvPrecision, attn_splits};
use crate::gpu::Gpu;
use crate::queued::{Queued, Records};

/// The u16 elements of one layer's K (or V) cache for `max_seq` positions: one per bf16 value,
/// two per f32 one. (It once passed the byte count as the element count: twice the plan.)
fn kv_cache_halves(c: &ModelConfig, max_seq: usize, kv: KvPrecision) -> usize {
    max_seq * c.num_kv_heads * c.head_dim * kv.bytes() / 2
}

pub struct CudaState {
    /// Unique among the states of the process: a captured batched step names its states by it
    /// (an address could be reused by a later state).
    pub(crate) id: u64,
    pub(crate) len: usize,
    pub(crate) max_seq: usize,
    /// KV splits of decode attention, fixed by `max_seq` (the captured graph's grid).
    pub(crate) attn_splits: usize,
    /// The token the next step embeds; written by the host or by the previous step's argmax.
    pub(crate) token: CudaSlice<u32>,
    /// The next position (= len), advanced on the device by every step.
    pub(crate) pos: CudaSlice<i32>,
    /// What the device's token slot holds, when the host knows it.
    pub(crate) device_token: Option<u32>,
    pub(crate) layers: Vec<LayerState>,
    /// The captured step and the number of tokens its argmax ranges over.
    pub(crate) graph: Option<(CudaGraph, usize)>,
    /// The persistent step's table of this state's buffers (decode.rs), made at its first step.
    pub(crate) step_table: Option<CudaSlice<u8>>,
    /// A step queued before the host read the pick it feeds on (queued.rs): `len` and the
    /// device position count it already.
    pub(crate) queued: Option<Queued>,
    /// Where the picks of the steps queued for it come back (queued.rs), made at the first.
    pub(crate) records: Option<Records>,
}

pub(crate) enum LayerState {
    Attention {
        k: CudaSlice<u16>,
        v: CudaSlice<u16>,
    },
    GatedDeltaNet {
        window: CudaSlice<f32>,
        recurrent: CudaSlice<f32>,
    },
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

// SAFETY: the state is only used from the thread that owns the backend's stream at a time; the
// raw CUDA handles inside (the graph) are not tied to a thread.
unsafe impl Send for CudaState {}

impl CudaState {
    /// Tokens consumed.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn new(gpu: &Gpu, c: &ModelConfig, max_seq: usize) -> Result<Self> {
        let layers = c
            .layer_kinds
            .iter()
            .map(|kind| {
                Ok(match kind {
                    LayerKind::Attention => {
                        let n = kv_cache_halves(c, max_seq, gpu.kv);
                        LayerState::Attention {
                            k: gpu.zeros(n)?,
                            v: gpu.zeros(n)?,
                        }
                    }
                    LayerKind::GatedDeltaNet => LayerState::GatedDeltaNet {
                        window: gpu.zeros((c.conv_kernel - 1) * c.gdn_conv_dim())?,
                        recurrent: gpu.zeros(
                            c.linear_num_value_heads
                                * c.linear_key_head_dim
                                * c.linear_value_head_dim,
                        )?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaState {
            id: next_id(),
            len: 0,
            max_seq,
            attn_splits: attn_splits(max_seq),
            token: gpu.zeros(1)?,
            pos: gpu.zeros(1)?,
            device_token: None,
            layers,
            graph: None,
            step_table: None,
            queued: None,
            records: None,
        })
    }

    /// A copy on the device; the copy captures its own graph when first stepped.
    pub(crate) fn fork(&self, gpu: &Gpu) -> Result<Self> {
        let s = &gpu.stream;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Attention { k, v } => LayerState::Attention {
                        k: s.clone_dtod(k)?,
                        v: s.clone_dtod(v)?,
                    },
                    LayerState::GatedDeltaNet { window, recurrent } => LayerState::GatedDeltaNet {
                        window: s.clone_dtod(window)?,
                        recurrent: s.clone_dtod(recurrent)?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaState {
            id: next_id(),
            len: self.len,
            max_seq: self.max_seq,
            attn_splits: self.attn_splits,
            token: s.clone_dtod(&self.token)?,
            pos: s.clone_dtod(&self.pos)?,
            device_token: self.device_token,
            layers,
            graph: None,
            step_table: None,
            queued: None,
            records: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use lily_core::config::QWEN36_35B_A3B_CONFIG;

    use super::*;

    /// What the caches allocate is what the memory plan counts (perf.md: 20 KiB a token of
    /// context in bf16 at the real shapes).
    #[test]
    fn the_kv_cache_allocates_the_bytes_the_plan_counts() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        for (kv, per_token) in [(KvPrecision::Bf16, 20_480), (KvPrecision::F32, 40_960)] {
            let max_seq = 1000;
            let allocated = c.num_attention_layers() * 2 * kv_cache_halves(&c, max_seq, kv) * 2;
            assert_eq!(
                allocated as u64,
                c.kv_bytes_per_token(kv.bytes()) * max_seq as u64
            );
            assert_eq!(allocated, per_token * max_seq, "{kv:?}");
        }
    }
}
