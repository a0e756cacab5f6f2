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

    /// Bytes per weight in MLX affine format with group 64 and bf16 scale and bias.
    fn quantised_bytes_per_weight(&self) -> f64 {
        let bits = match self.storage {
            _ if !self.cols.is_multiple_of(64) => return 2.0,
            Storage::Quantised => 4.0,
            Storage::Quantised8 => 8.0,
            Storage::Plain => return 2.0,
        };
        (bits + 32.0 / 64.0) / 8.0
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
        let q4 =
            |g: &TensorGroup, n: u64| (n as f64 * g.quantised_bytes_per_weight()).round() as u64;
        WeightBytes {
            f32: total * 4,
            bf16: total * 2,
            q4: inv.iter().map(|g| q4(g, g.params())).sum(),
            q4_active: inv.iter().map(|g| q4(g, g.rows * g.cols * g.active)).sum(),
        }
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
}
