//! The model's weights in host memory, shaped by the config and named as in spec/model.md.
//!
//! Every backend starts from this structure. Each linear weight is a [`Linear`]: dense f32 (from a
//! bf16 or f32 checkpoint: the reference path) or MLX affine-quantised (the runtime format, kept in
//! MLX's bytes); backends dispatch their matrix products on the variant. Norm weights are stored as the multiplier the
//! kernels apply: for the zero-centred "(1+w)" norms that is `1 + w` computed in f32 once here
//! (MLX checkpoints store it already shifted), so no backend can forget or double the offset.

use anyhow::{Context, Result, ensure};

use crate::config::{LayerKind, ModelConfig};
use crate::quant::QuantMatrix;
use crate::source::TensorSource;

/// A dense row-major matrix `[rows, cols]`, applied as `y = x · Wᵀ` (rows = outputs).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// The weight of a linear layer (or the embedding table), `[rows, cols]`, applied as `y = x · Wᵀ`.
#[derive(Clone, Debug, PartialEq)]
pub enum Linear {
    Dense(Matrix),
    /// MLX affine 4- or 8-bit.
    Affine(QuantMatrix),
}

impl Linear {
    pub fn rows(&self) -> usize {
        match self {
            Linear::Dense(m) => m.rows,
            Linear::Affine(q) => q.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Linear::Dense(m) => m.cols,
            Linear::Affine(q) => q.cols(),
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        match self {
            Linear::Dense(m) => out.copy_from_slice(m.row(r)),
            Linear::Affine(q) => q.dequantize_row(r, out),
        }
    }

    /// Bytes held in memory.
    pub fn byte_size(&self) -> usize {
        match self {
            Linear::Dense(m) => m.data.len() * 4,
            Linear::Affine(q) => q.byte_size(),
        }
    }

    /// Splits after row `at` (HF's and MLX's fused gate|up stacks).
    pub fn split_rows(self, at: usize) -> Result<(Linear, Linear)> {
        ensure!(
            at <= self.rows(),
            "cannot split {} rows at {at}",
            self.rows()
        );
        Ok(match self {
            Linear::Dense(mut m) => {
                let rest = m.data.split_off(at * m.cols);
                let tail = Matrix {
                    rows: m.rows - at,
                    cols: m.cols,
                    data: rest,
                };
                m.rows = at;
                (Linear::Dense(m), Linear::Dense(tail))
            }
            Linear::Affine(q) => {
                let (a, b) = q.split_rows(at)?;
                (Linear::Affine(a), Linear::Affine(b))
            }
        })
    }
}

pub struct ModelWeights {
    pub embed_tokens: Linear,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm multiplier (1 + w).
    pub final_norm: Vec<f32>,
    pub lm_head: Linear,
}

pub struct LayerWeights {
    /// Pre-mixer RMSNorm multiplier (1 + w).
    pub input_norm: Vec<f32>,
    /// Pre-MoE RMSNorm multiplier (1 + w).
    pub post_attention_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

pub enum Mixer {
    GatedDeltaNet(GdnWeights),
    Attention(AttentionWeights),
}

pub struct AttentionWeights {
    /// `[heads · 2 · head_dim, hidden]`, per head `[q | gate]`.
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// `[hidden, heads · head_dim]`.
    pub o_proj: Linear,
    /// Per-head RMSNorm multipliers (1 + w), shared by all heads.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub struct GdnWeights {
    /// `[2·key_dim + value_dim, hidden]`: q heads, then k heads, then v heads.
    pub in_proj_qkv: Linear,
    /// `[value_dim, hidden]`: the output gate.
    pub in_proj_z: Linear,
    /// `[value_heads, hidden]`: β logits.
    pub in_proj_b: Linear,
    /// `[value_heads, hidden]`: decay-rate logits.
    pub in_proj_a: Linear,
    /// `[conv_dim, kernel]`; the last tap multiplies the current token.
    pub conv1d: Matrix,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight (plain, no offset), shared by the value heads.
    pub norm: Vec<f32>,
    /// `[hidden, value_dim]`.
    pub out_proj: Linear,
}

/// One SwiGLU feed-forward: `down(silu(gate·x) ⊙ up·x)`.
pub struct Expert {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

pub struct MoeWeights {
    /// `[num_experts, hidden]`.
    pub router: Linear,
    pub experts: Vec<Expert>,
    pub shared_expert: Expert,
    /// `[1, hidden]`: the shared expert's scalar sigmoid gate.
    pub shared_expert_gate: Linear,
}

/// Loads one linear weight.
fn linear(src: &mut dyn TensorSource, module: &str, rows: usize, cols: usize) -> Result<Linear> {
    let mut one = src.take_linears(module, 1, rows, cols)?;
    Ok(one.remove(0))
}

/// Loads a dense matrix (the conv taps, never quantised).
fn matrix(src: &mut dyn TensorSource, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
    let data = src.take_f32(name, &[rows, cols])?;
    Ok(Matrix { rows, cols, data })
}

/// Loads a zero-centred norm weight as its multiplier `1 + w` (also for the CUDA backend's
/// synthetic weights, which take their small tensors from a source directly).
pub fn offset_norm(src: &mut dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let shifted = src.norms_are_shifted();
    let w = src.take_f32(name, &[len])?;
    Ok(if shifted {
        w
    } else {
        w.into_iter().map(|w| 1.0 + w).collect()
    })
}

impl ModelWeights {
    /// Takes every tensor the config implies from `src`, then checks that nothing was left.
    pub fn load(config: &ModelConfig, mut src: Box<dyn TensorSource>) -> Result<Self> {
        let h = config.hidden_size;
        let s = src.as_mut();
        let embed_tokens = linear(s, "embed_tokens", config.vocab_size, h)?;
        let mut layers = Vec::with_capacity(config.num_layers());
        for (i, kind) in config.layer_kinds.iter().enumerate() {
            let layer = load_layer(config, s, i, *kind).with_context(|| format!("layer {i}"))?;
            layers.push(layer);
        }
        let final_norm = offset_norm(s, "norm.weight", h)?;
        let lm_head = if config.tie_word_embeddings && !s.contains("lm_head.weight") {
            embed_tokens.clone()
        } else {
            linear(s, "lm_head", config.vocab_size, h)?
        };
        src.finish()?;
        Ok(ModelWeights {
            embed_tokens,
            layers,
            final_norm,
            lm_head,
        })
    }
}

fn load_layer(
    c: &ModelConfig,
    s: &mut dyn TensorSource,
    i: usize,
    kind: LayerKind,
) -> Result<LayerWeights> {
    let h = c.hidden_size;
    let p = format!("layers.{i}");
    let input_norm = offset_norm(s, &format!("{p}.input_layernorm.weight"), h)?;
    let post_attention_norm = offset_norm(s, &format!("{p}.post_attention_layernorm.weight"), h)?;
    let mixer = match kind {
        LayerKind::Attention => {
            let a = format!("{p}.self_attn");
            let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
            Mixer::Attention(AttentionWeights {
                q_proj: linear(s, &format!("{a}.q_proj"), nh * hd * 2, h)?,
                k_proj: linear(s, &format!("{a}.k_proj"), nkv * hd, h)?,
                v_proj: linear(s, &format!("{a}.v_proj"), nkv * hd, h)?,
                o_proj: linear(s, &format!("{a}.o_proj"), h, nh * hd)?,
                q_norm: offset_norm(s, &format!("{a}.q_norm.weight"), hd)?,
                k_norm: offset_norm(s, &format!("{a}.k_norm.weight"), hd)?,
            })
        }
        LayerKind::GatedDeltaNet => {
            let g = format!("{p}.linear_attn");
            let nv = c.linear_num_value_heads;
            Mixer::GatedDeltaNet(GdnWeights {
                in_proj_qkv: linear(s, &format!("{g}.in_proj_qkv"), c.gdn_conv_dim(), h)?,
                in_proj_z: linear(s, &format!("{g}.in_proj_z"), c.gdn_value_dim(), h)?,
                in_proj_b: linear(s, &format!("{g}.in_proj_b"), nv, h)?,
                in_proj_a: linear(s, &format!("{g}.in_proj_a"), nv, h)?,
                conv1d: matrix(
                    s,
                    &format!("{g}.conv1d.weight"),
                    c.gdn_conv_dim(),
                    c.conv_kernel,
                )?,
                a_log: s.take_f32(&format!("{g}.A_log"), &[nv])?,
                dt_bias: s.take_f32(&format!("{g}.dt_bias"), &[nv])?,
                norm: s.take_f32(&format!("{g}.norm.weight"), &[c.linear_value_head_dim])?,
                out_proj: linear(s, &format!("{g}.out_proj"), h, c.gdn_value_dim())?,
            })
        }
    };
    let moe = load_moe(c, s, &format!("{p}.mlp"))?;
    Ok(LayerWeights {
        input_norm,
        post_attention_norm,
        mixer,
        moe,
    })
}

fn load_moe(c: &ModelConfig, s: &mut dyn TensorSource, m: &str) -> Result<MoeWeights> {
    let (h, e, inter) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
    let router = linear(s, &format!("{m}.gate"), e, h)?;
    let experts = if s.contains(&format!("{m}.switch_mlp.gate_proj.weight")) {
        // MLX stacks each projection over the experts: gate, up [E, I, H], down [E, H, I].
        let gate = s.take_linears(&format!("{m}.switch_mlp.gate_proj"), e, inter, h)?;
        let up = s.take_linears(&format!("{m}.switch_mlp.up_proj"), e, inter, h)?;
        let down = s.take_linears(&format!("{m}.switch_mlp.down_proj"), e, h, inter)?;
        experts_of(gate, up, down)
    } else if s.contains(&format!("{m}.experts.gate_up_proj")) {
        // The official checkpoint fuses gate and up: gate_up [E, 2I, H] (gate rows first),
        // down [E, H, I].
        let gate_up = s.take_linears(&format!("{m}.experts.gate_up_proj"), e, 2 * inter, h)?;
        let down = s.take_linears(&format!("{m}.experts.down_proj"), e, h, inter)?;
        let (gate, up): (Vec<_>, Vec<_>) = gate_up
            .into_iter()
            .map(|gu| gu.split_rows(inter))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        experts_of(gate, up, down)
    } else {
        (0..e)
            .map(|x| load_expert(s, &format!("{m}.experts.{x}"), h, inter))
            .collect::<Result<Vec<_>>>()?
    };
    Ok(MoeWeights {
        router,
        experts,
        shared_expert: load_expert(
            s,
            &format!("{m}.shared_expert"),
            h,
            c.shared_intermediate_size,
        )?,
        shared_expert_gate: linear(s, &format!("{m}.shared_expert_gate"), 1, h)?,
    })
}

fn experts_of(gate: Vec<Linear>, up: Vec<Linear>, down: Vec<Linear>) -> Vec<Expert> {
    gate.into_iter()
        .zip(up)
        .zip(down)
        .map(|((gate_proj, up_proj), down_proj)| Expert {
            gate_proj,
            up_proj,
            down_proj,
        })
        .collect()
}

fn load_expert(s: &mut dyn TensorSource, p: &str, h: usize, inter: usize) -> Result<Expert> {
    Ok(Expert {
        gate_proj: linear(s, &format!("{p}.gate_proj"), inter, h)?,
        up_proj: linear(s, &format!("{p}.up_proj"), inter, h)?,
        down_proj: linear(s, &format!("{p}.down_proj"), h, inter)?,
    })
}
