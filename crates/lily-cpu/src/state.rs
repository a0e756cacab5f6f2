//! Per-sequence state on the CPU: a KV cache per attention layer, a conv window and a recurrent
//! matrix per Gated DeltaNet layer, and the number of tokens consumed.

use lily_core::config::{LayerKind, ModelConfig};

use crate::numerics::{KvPrecision, bf16};

#[derive(Clone, Debug)]
pub struct CpuState {
    pub(crate) len: usize,
    pub(crate) max_seq: usize,
    pub(crate) layers: Vec<LayerState>,
}

#[derive(Clone, Debug)]
pub(crate) enum LayerState {
    Attention(KvCache),
    GatedDeltaNet(GdnState),
}

impl LayerState {
    /// The attention layer's cache (states are built from the same config as the weights, so
    /// the layer kinds always match).
    pub fn kv(&mut self) -> &mut KvCache {
        match self {
            LayerState::Attention(kv) => kv,
            LayerState::GatedDeltaNet(_) => unreachable!("an attention layer's state"),
        }
    }

    /// The Gated DeltaNet layer's state.
    pub fn gdn(&mut self) -> &mut GdnState {
        match self {
            LayerState::GatedDeltaNet(g) => g,
            LayerState::Attention(_) => unreachable!("a Gated DeltaNet layer's state"),
        }
    }
}

/// Keys (after q/k norm and RoPE) and values, `[position, kv_head, head_dim]`, as stored in
/// the cache's precision.
#[derive(Clone, Debug)]
pub(crate) struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    precision: KvPrecision,
}

impl KvCache {
    /// Appends the keys and values of new positions.
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        for (cache, new) in [(&mut self.k, k), (&mut self.v, v)] {
            match self.precision {
                KvPrecision::F32 => cache.extend_from_slice(new),
                KvPrecision::Bf16 => cache.extend(new.iter().map(|&x| bf16(x))),
            }
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct GdnState {
    /// The last `kernel - 1` pre-conv q|k|v rows, oldest first: `[kernel - 1, conv_dim]`.
    pub conv: Vec<f32>,
    /// Per value head, `S[key_dim][value_dim]`, fp32.
    pub recurrent: Vec<f32>,
}

impl CpuState {
    pub(crate) fn new(c: &ModelConfig, max_seq: usize, kv: KvPrecision) -> Self {
        let layers = c
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                LayerKind::Attention => LayerState::Attention(KvCache {
                    k: Vec::new(),
                    v: Vec::new(),
                    precision: kv,
                }),
                LayerKind::GatedDeltaNet => LayerState::GatedDeltaNet(GdnState {
                    conv: vec![0.0; (c.conv_kernel - 1) * c.gdn_conv_dim()],
                    recurrent: vec![
                        0.0;
                        c.linear_num_value_heads
                            * c.linear_key_head_dim
                            * c.linear_value_head_dim
                    ],
                }),
            })
            .collect();
        CpuState {
            len: 0,
            max_seq,
            layers,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bf16_cache_stores_every_value_rounded() {
        let values = [1.0f32 + 1.0 / 512.0, -3.3, 0.1, 7e-5];
        for (precision, want) in [
            (KvPrecision::F32, values.to_vec()),
            (KvPrecision::Bf16, values.iter().map(|&v| bf16(v)).collect()),
        ] {
            let mut cache = KvCache {
                k: vec![2.0],
                v: Vec::new(),
                precision,
            };
            cache.append(&values, &values[..2]);
            assert_eq!(cache.k[1..], want[..], "{precision:?}");
            assert_eq!(cache.v, want[..2], "{precision:?}");
        }
        assert_ne!(bf16(values[1]), values[1]);
    }
}
