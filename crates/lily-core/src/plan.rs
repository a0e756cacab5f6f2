//! Sizes derived from the config alone: an inventory of the model's tensors, parameter counts,
//! weight bytes per storage format and per-sequence state, so a model can be inspected (and a
//! memory plan checked) without allocating it.

use crate::config::ModelConfig;

/// How a group of tensors is stored once quantised, following mlx-lm's choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// Linear and embedding weights: 4-bit affine when the input dim divides into groups of 64.
    Quantised,
    /// The router and the shared-expert gate: 8-bit (routing is sensitive to rounding).
    Quantised8,
    /// Norms, conv taps, A_log, dt_bias: never quantised.
    Plain,
}

/// `count` tensors of `rows × cols`, of which `active` are read per decoded token.
#[derive(Clone, Copy, Debug)]
pub struct TensorGroup {
    pub rows: u64,
    pub cols: u64,
    pub count: u64,
    pub active: u64,
    pub storage: Storage,
}

impl TensorGroup {
    fn params(&self) -> u64 {
        self.rows * self.cols * self.count
    }

    /// Bytes per weight in MLX affine format with `bits` per quantised weight, `group`
    /// inputs per bf16 scale and bias; the router and shared gate keep 8 bits, and what is not
    /// quantised (norms, or rows that do not divide into groups) stays bf16.
    fn quantised_bytes_per_weight(&self, bits: u32, group: u32) -> f64 {
        let bits = match self.storage {
            _ if group == 0 || !self.cols.is_multiple_of(u64::from(group)) => return 2.0,
            Storage::Quantised => f64::from(bits),
            Storage::Quantised8 => 8.0,
            Storage::Plain => return 2.0,
        };
        (bits + 32.0 / f64::from(group)) / 8.0
    }
}

/// How a backend holds the weights in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Bf16,
    /// MLX affine: `bits` per weight, a bf16 scale and bias per `group_size` inputs.
    Mlx {
        bits: u32,
        group_size: u32,
    },
}

impl WeightFormat {
    /// The runtime format of design.md: MLX affine 4-bit, group 64.
    pub const MLX_Q4: WeightFormat = WeightFormat::Mlx {
        bits: 4,
        group_size: 64,
    };

    pub fn label(&self) -> String {
        match self {
            WeightFormat::F32 => "f32".to_string(),
            WeightFormat::Bf16 => "bf16".to_string(),
            WeightFormat::Mlx { bits, group_size } => {
                format!("MLX {bits}-bit (group {group_size})")
            }
        }
    }
}

/// How one backend lays out a model and a sequence in its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLayout {
    pub weights: WeightFormat,
    /// Bytes per KV-cache element.
    pub kv_elem_bytes: usize,
    /// Bytes per causal-conv window element (the recurrent state is always f32).
    pub conv_elem_bytes: usize,
    /// Working memory beyond weights and state (activations, workspaces).
    pub scratch_bytes: u64,
}

/// Memory needed to hold the model and one sequence of `max_seq` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryNeed {
    pub weights: u64,
    pub kv_per_token: u64,
    pub kv: u64,
    /// Recurrent and conv state of the Gated DeltaNet layers.
    pub state: u64,
    pub scratch: u64,
    pub total: u64,
}

/// Memory that `sequences` generations of up to `max_seq` tokens each hold at once beside the
/// weights (the server's `--max-batch` states): each one's KV cache of the whole context, its
/// Gated DeltaNet recurrent state and conv window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNeed {
    pub sequences: usize,
    pub max_seq: usize,
    /// KV cache of one full context.
    pub kv_per_sequence: u64,
    /// Recurrent and conv state of one sequence.
    pub state_per_sequence: u64,
    pub total: u64,
}

impl BatchNeed {
    pub fn per_sequence(&self) -> u64 {
        self.kv_per_sequence + self.state_per_sequence
    }

    /// How many sequences of this context fit in `available` bytes.
    pub fn sequences_fitting(&self, available: u64) -> u64 {
        available / self.per_sequence().max(1)
    }

    /// The longest context that `self.sequences` sequences fit in `available` bytes.
    pub fn context_fitting(&self, available: u64) -> u64 {
        let n = self.sequences.max(1) as u64;
        let per_token = (self.kv_per_sequence / self.max_seq.max(1) as u64).max(1);
        (available / n).saturating_sub(self.state_per_sequence) / per_token
    }
}

/// Parameter counts of the text model (vision tower and MTP head excluded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamCount {
    pub total: u64,
    /// Weights read per decoded token: the chosen experts, not the others; the lm_head, not the
    /// embedding table.
    pub active: u64,
    pub routed_experts: u64,
}

/// Bytes of all weights in each storage format.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightBytes {
    pub f32: u64,
    pub bf16: u64,
    /// MLX affine 4-bit (8-bit router and shared gate), as `lily quantize` writes.
    pub q4: u64,
    /// Of `q4`, the bytes read per decoded token.
    pub q4_active: u64,
}

impl ModelConfig {
    pub fn tensor_inventory(&self) -> Vec<TensorGroup> {
        let g = |rows: usize, cols: usize, count: usize, active: usize, storage| TensorGroup {
            rows: rows as u64,
            cols: cols as u64,
            count: count as u64,
            active: active as u64,
            storage,
        };
        use Storage::*;
        let (h, v) = (self.hidden_size, self.vocab_size);
        let (n_attn, n_gdn, n) = (
            self.num_attention_layers(),
            self.num_gdn_layers(),
            self.num_layers(),
        );
        let (nh, nkv, hd) = (self.num_attention_heads, self.num_kv_heads, self.head_dim);
        let (conv, vd, nv) = (
            self.gdn_conv_dim(),
            self.gdn_value_dim(),
            self.linear_num_value_heads,
        );
        let (e, k, i, s) = (
            self.num_experts,
            self.experts_per_token,
            self.moe_intermediate_size,
            self.shared_intermediate_size,
        );
        let mut groups = vec![
            g(v, h, 1, 0, Quantised),     // embed_tokens (a row lookup, not a product)
            g(1, h, 1, 1, Plain),         // final norm
            g(1, h, 2 * n, 2 * n, Plain), // input and post-attention norms
            // attention
            g(2 * nh * hd, h, n_attn, n_attn, Quantised),
            g(nkv * hd, h, 2 * n_attn, 2 * n_attn, Quantised),
            g(h, nh * hd, n_attn, n_attn, Quantised),
            g(1, hd, 2 * n_attn, 2 * n_attn, Plain),
            // Gated DeltaNet
            g(conv, h, n_gdn, n_gdn, Quantised),
            g(vd, h, n_gdn, n_gdn, Quantised),
            g(nv, h, 2 * n_gdn, 2 * n_gdn, Quantised),
            g(conv, self.conv_kernel, n_gdn, n_gdn, Plain),
            g(1, nv, 2 * n_gdn, 2 * n_gdn, Plain),
            g(1, self.linear_value_head_dim, n_gdn, n_gdn, Plain),
            g(h, vd, n_gdn, n_gdn, Quantised),
            // MoE
            g(e, h, n, n, Quantised8),
            g(1, h, n, n, Quantised8),
            g(i, h, 2 * e * n, 2 * k * n, Quantised),
            g(h, i, e * n, k * n, Quantised),
            g(s, h, 2 * n, 2 * n, Quantised),
            g(h, s, n, n, Quantised),
        ];
        if !self.tie_word_embeddings {
            groups.push(g(v, h, 1, 1, Quantised)); // lm_head
        } else {
            groups[0].active = 1;
        }
        groups
    }

    pub fn param_count(&self) -> ParamCount {
        let inv = self.tensor_inventory();
        let total = inv.iter().map(TensorGroup::params).sum();
        let active = inv.iter().map(|g| g.rows * g.cols * g.active).sum();
        let routed_experts = 3
            * (self.moe_intermediate_size * self.hidden_size * self.num_experts * self.num_layers())
                as u64;
        ParamCount {
            total,
            active,
            routed_experts,
        }
    }

    pub fn weight_bytes(&self) -> WeightBytes {
        let inv = self.tensor_inventory();
        let total = self.param_count().total;
        let q4 = |g: &TensorGroup, n: u64| {
            (n as f64 * g.quantised_bytes_per_weight(4, 64)).round() as u64
        };
        WeightBytes {
            f32: total * 4,
            bf16: total * 2,
            q4: inv.iter().map(|g| q4(g, g.params())).sum(),
            q4_active: inv.iter().map(|g| q4(g, g.rows * g.cols * g.active)).sum(),
        }
    }

    /// Bytes of all weights held in `format`.
    pub fn weight_bytes_in(&self, format: WeightFormat) -> u64 {
        match format {
            WeightFormat::F32 => self.param_count().total * 4,
            WeightFormat::Bf16 => self.param_count().total * 2,
            WeightFormat::Mlx { bits, group_size } => self
                .tensor_inventory()
                .iter()
                .map(|g| {
                    (g.params() as f64 * g.quantised_bytes_per_weight(bits, group_size)).round()
                        as u64
                })
                .sum(),
        }
    }

    /// Memory for the weights and one sequence of `max_seq` tokens laid out as `layout`.
    pub fn memory_need(&self, layout: &MemoryLayout, max_seq: usize) -> MemoryNeed {
        let weights = self.weight_bytes_in(layout.weights);
        let kv_per_token = self.kv_bytes_per_token(layout.kv_elem_bytes);
        let kv = kv_per_token * max_seq as u64;
        let state = self.recurrent_state_bytes() + self.conv_state_bytes(layout.conv_elem_bytes);
        MemoryNeed {
            weights,
            kv_per_token,
            kv,
            state,
            scratch: layout.scratch_bytes,
            total: weights + kv + state + layout.scratch_bytes,
        }
    }

    /// What `sequences` generations of `max_seq` tokens hold beside the weights, with KV
    /// elements of `kv_elem_bytes` (the conv window and recurrent state in f32).
    pub fn batch_need(&self, kv_elem_bytes: usize, max_seq: usize, sequences: usize) -> BatchNeed {
        let kv_per_sequence = self.kv_bytes_per_token(kv_elem_bytes) * max_seq as u64;
        let state_per_sequence = self.recurrent_state_bytes() + self.conv_state_bytes(4);
        BatchNeed {
            sequences,
            max_seq,
            kv_per_sequence,
            state_per_sequence,
            total: (kv_per_sequence + state_per_sequence) * sequences as u64,
        }
    }

    /// The longest context whose memory need fits in `available` bytes, at most the model's
    /// `max_position_embeddings`; `None` when not even an empty context fits.
    pub fn longest_context(&self, layout: &MemoryLayout, available: u64) -> Option<usize> {
        let fixed = self.memory_need(layout, 0).total;
        let room = available.checked_sub(fixed)?;
        let per_token = self.kv_bytes_per_token(layout.kv_elem_bytes).max(1);
        let tokens = usize::try_from(room / per_token).unwrap_or(usize::MAX);
        Some(tokens.min(self.max_position_embeddings))
    }

    /// KV-cache bytes per token of context for an element size (2 for bf16, 4 for f32).
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> u64 {
        (self.num_attention_layers() * 2 * self.num_kv_heads * self.head_dim * elem_bytes) as u64
    }

    /// Bytes of the fp32 Gated DeltaNet recurrent state of one sequence.
    pub fn recurrent_state_bytes(&self) -> u64 {
        let per_layer =
            self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4;
        (self.num_gdn_layers() * per_layer) as u64
    }

    /// Bytes of the causal-conv window of one sequence, for an element size.
    pub fn conv_state_bytes(&self, elem_bytes: usize) -> u64 {
        (self.num_gdn_layers() * (self.conv_kernel - 1) * self.gdn_conv_dim() * elem_bytes) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::{MemoryLayout, WeightFormat};
    use crate::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};

    #[test]
    fn full_size_counts_match_the_spec() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        let p = c.param_count();
        assert_eq!(p.total, 34_660_610_688);
        assert_eq!(p.routed_experts, 32_212_254_720);
        // spec/model.md §7's terms (lm_head in, embedding table out); they sum to this, 2,048
        // less than the total the spec prints.
        assert_eq!(p.active, 2_946_429_568);
        assert_eq!(c.kv_bytes_per_token(2), 20_480);
        assert_eq!(c.recurrent_state_bytes(), 62_914_560);
        assert_eq!(c.conv_state_bytes(2), 1_474_560);
        let bytes = c.weight_bytes();
        // spec §5b: about 19.51 GB in MLX 4-bit; §7: 1.67 GB read per token.
        assert!((bytes.q4 as f64 / 1e9 - 19.51).abs() < 0.01, "{}", bytes.q4);
        assert!(
            (bytes.q4_active as f64 - 1_669_563_648.0).abs() < 2e6,
            "{}",
            bytes.q4_active
        );
    }

    /// perf.md's figures: 19.5 GB of 4-bit weights, 20 KiB of bf16 KV per token, 60 MiB of
    /// recurrent state; and its memory target, that 32K of context fits a 24 GB card.
    #[test]
    fn the_gpu_memory_plan_matches_perf_md() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        let gpu = MemoryLayout {
            weights: WeightFormat::MLX_Q4,
            kv_elem_bytes: 2,
            conv_elem_bytes: 4,
            scratch_bytes: 2_000_000_000,
        };
        let need = c.memory_need(&gpu, 32_768);
        assert_eq!(need.weights, c.weight_bytes().q4);
        assert!(
            (need.weights as f64 / 1e9 - 19.5).abs() < 0.05,
            "{}",
            need.weights
        );
        assert_eq!(need.kv_per_token, 20 * 1024);
        assert_eq!(need.kv, 20 * 1024 * 32_768);
        assert_eq!(c.recurrent_state_bytes(), 60 << 20);
        assert_eq!(need.state, (60 << 20) + c.conv_state_bytes(4));
        assert_eq!(
            need.total,
            need.weights + need.kv + need.state + 2_000_000_000
        );
        let card_24gb = 24 << 30;
        assert!(need.total < card_24gb);
        let longest = c.longest_context(&gpu, card_24gb).unwrap();
        assert!(longest >= 32_768, "{longest}");
        // The longest context is the last one that fits.
        assert!(c.memory_need(&gpu, longest).total <= card_24gb);
        assert!(c.memory_need(&gpu, longest + 1).total > card_24gb);
        // Capped by the model's own limit when memory is plentiful; none when weights do not fit.
        assert_eq!(c.longest_context(&gpu, 1 << 40), Some(262_144));
        assert_eq!(c.longest_context(&gpu, 10_000_000_000), None);
    }

    #[test]
    fn weight_formats_size_the_same_parameters() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        let params = c.param_count().total;
        assert_eq!(c.weight_bytes_in(WeightFormat::F32), params * 4);
        assert_eq!(c.weight_bytes_in(WeightFormat::Bf16), params * 2);
        let q8 = c.weight_bytes_in(WeightFormat::Mlx {
            bits: 8,
            group_size: 64,
        });
        // 8.5 bits per quantised weight instead of 4.5: about 1.9x the 4-bit size.
        let q4 = c.weight_bytes_in(WeightFormat::MLX_Q4) as f64;
        assert!((q8 as f64 / q4 - 8.5 / 4.5).abs() < 0.01, "{q8} vs {q4}");
    }

    #[test]
    fn a_batch_of_full_contexts_counts_every_sequence() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        // 10 attention layers × K and V × 2 KV heads × 256 dims × 2 bytes; 30 Gated DeltaNet
        // layers of 32 value heads × 128 × 128 f32, plus their 3-row conv windows of 8192.
        let need = c.batch_need(2, 32768, 8);
        assert_eq!(need.kv_per_sequence, 10 * 2 * 2 * 256 * 2 * 32768);
        assert_eq!(
            need.state_per_sequence,
            30 * 32 * 128 * 128 * 4 + 30 * 3 * 8192 * 4
        );
        assert_eq!(need.total, 8 * need.per_sequence());
        assert_eq!(need.sequences_fitting(3 * need.per_sequence() + 1), 3);
        // Half the memory holds the eight at under half the context: each keeps its whole
        // fixed state (63 MB, 3,086 tokens' worth of KV) and halves only its KV.
        let per_token = need.kv_per_sequence / 32768;
        let half = need.context_fitting(need.total / 2);
        assert_eq!(
            half,
            (need.per_sequence() / 2 - need.state_per_sequence) / per_token
        );
        assert!((14000..16384).contains(&half), "{half}");
    }
}
