//! The model's weights in host memory, in f32, shaped by the config and named as in spec/model.md.
//!
//! Every backend starts from this structure. Norm weights are stored as the multiplier the
//! kernels apply: for the zero-centred "(1+w)" norms that is `1 + w` computed in f32 once here
//! (MLX checkpoints store it already shifted), so no backend can forget or double the offset.

use anyhow::{Context, Result};

use crate::config::{LayerKind, ModelConfig};
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

pub struct ModelWeights {
    pub embed_tokens: Matrix,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm multiplier (1 + w).
    pub final_norm: Vec<f32>,
    pub lm_head: Matrix,
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
    pub q_proj: Matrix,
    pub k_proj: Matrix,
    pub v_proj: Matrix,
    /// `[hidden, heads · head_dim]`.
    pub o_proj: Matrix,
    /// Per-head RMSNorm multipliers (1 + w), shared by all heads.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub struct GdnWeights {
    /// `[2·key_dim + value_dim, hidden]`: q heads, then k heads, then v heads.
    pub in_proj_qkv: Matrix,
    /// `[value_dim, hidden]`: the output gate.
    pub in_proj_z: Matrix,
    /// `[value_heads, hidden]`: β logits.
    pub in_proj_b: Matrix,
    /// `[value_heads, hidden]`: decay-rate logits.
    pub in_proj_a: Matrix,
    /// `[conv_dim, kernel]`; the last tap multiplies the current token.
    pub conv1d: Matrix,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight (plain, no offset), shared by the value heads.
    pub norm: Vec<f32>,
    /// `[hidden, value_dim]`.
    pub out_proj: Matrix,
}

/// One SwiGLU feed-forward: `down(silu(gate·x) ⊙ up·x)`.
pub struct Expert {
    pub gate_proj: Matrix,
    pub up_proj: Matrix,
    pub down_proj: Matrix,
}

pub struct MoeWeights {
    /// `[num_experts, hidden]`.
    pub router: Matrix,
    pub experts: Vec<Expert>,
    pub shared_expert: Expert,
    /// `[hidden]`: the shared expert's scalar sigmoid gate.
    pub shared_expert_gate: Vec<f32>,
}

/// Loads a tensor into a matrix of the given shape.
fn matrix(src: &mut dyn TensorSource, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
    let data = src.take_f32(name, &[rows, cols])?;
    Ok(Matrix { rows, cols, data })
}

/// Loads a zero-centred norm weight as its multiplier `1 + w`.
fn offset_norm(src: &mut dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>> {
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
        let embed_tokens = matrix(s, "embed_tokens.weight", config.vocab_size, h)?;
        let mut layers = Vec::with_capacity(config.num_layers());
        for (i, kind) in config.layer_kinds.iter().enumerate() {
            let layer = load_layer(config, s, i, *kind).with_context(|| format!("layer {i}"))?;
            layers.push(layer);
        }
        let final_norm = offset_norm(s, "norm.weight", h)?;
        let lm_head = if config.tie_word_embeddings && !s.contains("lm_head.weight") {
            embed_tokens.clone()
        } else {
            matrix(s, "lm_head.weight", config.vocab_size, h)?
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
                q_proj: matrix(s, &format!("{a}.q_proj.weight"), nh * hd * 2, h)?,
                k_proj: matrix(s, &format!("{a}.k_proj.weight"), nkv * hd, h)?,
                v_proj: matrix(s, &format!("{a}.v_proj.weight"), nkv * hd, h)?,
                o_proj: matrix(s, &format!("{a}.o_proj.weight"), h, nh * hd)?,
                q_norm: offset_norm(s, &format!("{a}.q_norm.weight"), hd)?,
                k_norm: offset_norm(s, &format!("{a}.k_norm.weight"), hd)?,
            })
        }
        LayerKind::GatedDeltaNet => {
            let g = format!("{p}.linear_attn");
            let nv = c.linear_num_value_heads;
            Mixer::GatedDeltaNet(GdnWeights {
                in_proj_qkv: matrix(s, &format!("{g}.in_proj_qkv.weight"), c.gdn_conv_dim(), h)?,
                in_proj_z: matrix(s, &format!("{g}.in_proj_z.weight"), c.gdn_value_dim(), h)?,
                in_proj_b: matrix(s, &format!("{g}.in_proj_b.weight"), nv, h)?,
                in_proj_a: matrix(s, &format!("{g}.in_proj_a.weight"), nv, h)?,
                conv1d: matrix(
                    s,
                    &format!("{g}.conv1d.weight"),
                    c.gdn_conv_dim(),
                    c.conv_kernel,
                )?,
                a_log: s.take_f32(&format!("{g}.A_log"), &[nv])?,
                dt_bias: s.take_f32(&format!("{g}.dt_bias"), &[nv])?,
                norm: s.take_f32(&format!("{g}.norm.weight"), &[c.linear_value_head_dim])?,
                out_proj: matrix(s, &format!("{g}.out_proj.weight"), h, c.gdn_value_dim())?,
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
    let router = matrix(s, &format!("{m}.gate.weight"), e, h)?;
    let fused = format!("{m}.experts.gate_up_proj");
    let experts = if s.contains(&fused) {
        // The official checkpoint stacks experts: gate_up [E, 2I, H] (gate rows first),
        // down [E, H, I].
        let gate_up = s.take_f32(&fused, &[e, 2 * inter, h])?;
        let down = s.take_f32(&format!("{m}.experts.down_proj"), &[e, h, inter])?;
        let block = inter * h;
        (0..e)
            .map(|x| {
                let gu = &gate_up[x * 2 * block..(x + 1) * 2 * block];
                Expert {
                    gate_proj: Matrix {
                        rows: inter,
                        cols: h,
                        data: gu[..block].to_vec(),
                    },
                    up_proj: Matrix {
                        rows: inter,
                        cols: h,
                        data: gu[block..].to_vec(),
                    },
                    down_proj: Matrix {
                        rows: h,
                        cols: inter,
                        data: down[x * block..(x + 1) * block].to_vec(),
                    },
                }
            })
            .collect()
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
        shared_expert_gate: s.take_f32(&format!("{m}.shared_expert_gate.weight"), &[1, h])?,
    })
}

fn load_expert(s: &mut dyn TensorSource, p: &str, h: usize, inter: usize) -> Result<Expert> {
    Ok(Expert {
        gate_proj: matrix(s, &format!("{p}.gate_proj.weight"), inter, h)?,
        up_proj: matrix(s, &format!("{p}.up_proj.weight"), inter, h)?,
        down_proj: matrix(s, &format!("{p}.down_proj.weight"), h, inter)?,
    })
}
