//! Synthetic models: the shapes of a named config with deterministic pseudo-random weights,
//! generated in place from a counter-based hash (no file, same values on every machine).
//!
//! They stand in for the real weights, which cannot be downloaded here, in benchmarks and server
//! tests. Magnitudes are set per tensor role so that activations stay O(1) through every layer
//! and the router's softmax is neither uniform nor one-hot.
//!
//! Linear weights are made directly in the runtime format, MLX affine (group 64; 8 bits for the
//! router and shared-expert gate, 4 for the rest, as mlx-lm chooses), never by quantising f32
//! values, so the 35 B model is made in seconds and a GPU can make the same bytes on the device.
//! With `key(T) = key_of(T) ^ seed·0x2545F4914F6CDD1D` (wrapping) for a tensor name `T`, a
//! quantised module `M` (canonical name, e.g. `layers.0.mlp.switch_mlp.gate_proj`, experts
//! stacked as in MLX files, indices running over the whole stack) is:
//!
//! - code word `j` of `M.weight`: the high 32 bits of `mix64(key(M.weight) ^ mix64(j + φ))`,
//!   `φ = 0x9E3779B97F4A7C15`: every code uniform over `0..2^bits`;
//! - scale of group `g`: `bf16(c · (1 + u/4))` with `u = uniform_at(key(M.scales), g)` and the
//!   f32 constant `c = σ / √((4^bits − 1)/12)` (computed in f64, rounded once), `σ` the role's
//!   weight deviation: 1/√3 for `embed_tokens`, 3/√cols for the router and `lm_head`, 1/√cols
//!   otherwise;
//! - bias of group `g`: `bf16(−scale · (2^bits − 1)/2)` (the rounded scale), so weights centre
//!   on zero.
//!
//! Everything else (norms, conv taps, A_log, dt_bias, and linears whose input dim does not
//! divide into groups of 64) is f32 from [`uniform_at`] as [`init_for`] says.

use anyhow::{Result, bail};
use half::bf16;
use rayon::prelude::*;

use crate::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use crate::mlx::mlx_quant_bits;
use crate::quant::{DEFAULT_GROUP_SIZE, QuantMatrix};
use crate::rng::{key_of, mix64, uniform_at};
use crate::source::TensorSource;
use crate::weights::{Linear, Matrix};

/// A small model with the real vocabulary, so the real tokenizer and template run end to end.
const TINY_CONFIG: &str = r#"{
  "model_type": "qwen3_5_moe_text",
  "hidden_size": 128,
  "num_hidden_layers": 8,
  "full_attention_interval": 4,
  "vocab_size": 248320,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
  "max_position_embeddings": 262144,
  "rms_norm_eps": 1e-6,
  "linear_num_key_heads": 2,
  "linear_num_value_heads": 4,
  "linear_key_head_dim": 32,
  "linear_value_head_dim": 32,
  "linear_conv_kernel_dim": 4,
  "num_experts": 16,
  "num_experts_per_tok": 4,
  "moe_intermediate_size": 64,
  "shared_expert_intermediate_size": 64,
  "eos_token_id": [248046, 248044],
  "tie_word_embeddings": false
}"#;

/// The names `synthetic:NAME` accepts.
pub const SYNTHETIC_NAMES: [&str; 2] = ["tiny", "qwen3.6-35b-a3b"];

/// The config of a named synthetic model.
pub fn synthetic_config(name: &str) -> Result<ModelConfig> {
    match name {
        "tiny" => ModelConfig::from_json(TINY_CONFIG),
        "qwen3.6-35b-a3b" => ModelConfig::from_json(QWEN36_35B_A3B_CONFIG),
        other => bail!(
            "unknown synthetic model {other:?}; known: {}",
            SYNTHETIC_NAMES.map(|n| format!("synthetic:{n}")).join(", ")
        ),
    }
}

/// Generates each requested tensor from `(seed, name, element index)`.
pub struct SyntheticSource {
    seed: u64,
}

impl SyntheticSource {
    pub fn new(seed: u64) -> Self {
        SyntheticSource { seed }
    }

    fn key(&self, tensor: &str) -> u64 {
        key_of(tensor) ^ self.seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// The stream of the linear module `module` (canonical name, experts stacked) with `cols`
    /// inputs, or `None` where mlx-lm leaves such a module unquantised (then it is f32).
    pub fn quant_stream(&self, module: &str, cols: usize) -> Option<QuantStream> {
        let bits = mlx_quant_bits(module, cols)?;
        let levels = ((1u64 << (2 * bits)) - 1) as f64 / 12.0;
        Some(QuantStream {
            bits,
            code_key: self.key(&format!("{module}.weight")),
            scale_key: self.key(&format!("{module}.scales")),
            scale: (quantised_sigma(module, cols) / levels.sqrt()) as f32,
        })
    }
}

/// What makes one quantised module's bytes (the module docs' formula): a generator on any device
/// needs only these constants to write the same codes, scales and biases.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantStream {
    pub bits: u32,
    pub code_key: u64,
    pub scale_key: u64,
    /// `c`: the role's deviation over the codes' deviation, rounded once to f32.
    pub scale: f32,
}

impl QuantStream {
    /// Scale and bias of group `g`, counted over the whole stack.
    pub fn group(&self, g: u64) -> (bf16, bf16) {
        let middle = ((1u32 << self.bits) - 1) as f32 / 2.0;
        let scale = bf16::from_f32(self.scale * (1.0 + 0.25 * uniform_at(self.scale_key, g)));
        (scale, bf16::from_f32(-scale.to_f32() * middle))
    }

    /// Matrix `index` of a stack of `rows × cols` matrices.
    pub fn matrix(&self, index: usize, rows: usize, cols: usize) -> Result<QuantMatrix> {
        let group = DEFAULT_GROUP_SIZE;
        let (words, groups) = (rows * cols * self.bits as usize / 32, rows * cols / group);
        let (w0, g0) = (index * words, index * groups);
        let codes: Vec<u32> = (0..words)
            .into_par_iter()
            .map(|j| code_word(self.code_key, (w0 + j) as u64))
            .collect();
        let (scales, biases) = (0..groups)
            .into_par_iter()
            .map(|g| self.group((g0 + g) as u64))
            .unzip();
        QuantMatrix::from_parts(rows, cols, self.bits, group, codes, scales, biases)
    }
}

/// Word `index` of a synthetic code stream.
pub fn code_word(key: u64, index: u64) -> u32 {
    (mix64(key ^ mix64(index.wrapping_add(0x9e37_79b9_7f4a_7c15))) >> 32) as u32
}

/// The deviation of a quantised module's weights, by role (as [`init_for`] for f32 weights).
fn quantised_sigma(module: &str, cols: usize) -> f64 {
    if module == "embed_tokens" {
        1.0 / 3f64.sqrt()
    } else if module.ends_with("mlp.gate") || module == "lm_head" {
        3.0 / (cols as f64).sqrt()
    } else {
        1.0 / (cols as f64).sqrt()
    }
}

/// How a tensor's values are drawn, by its role.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// `offset + scale · u`, u uniform in [-1, 1).
    Uniform { offset: f32, scale: f32 },
    /// `ln(1 + 7.5 · (u + 1))`: decay rates A = exp(A_log) spread over [1, 16], as in training.
    ALog,
}

fn init_for(name: &str, shape: &[usize]) -> Init {
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    let uniform = |offset, scale| Init::Uniform { offset, scale };
    // Uniform(-a, a) with a = √(3/fan_in) keeps a unit-variance input at unit variance.
    let unit = (3.0 / fan_in).sqrt();
    if name.ends_with("linear_attn.norm.weight") {
        uniform(1.0, 0.1)
    } else if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
        uniform(0.0, 0.1)
    } else if name.ends_with("A_log") {
        Init::ALog
    } else if name.ends_with("dt_bias") {
        uniform(0.0, 1.0)
    } else if name.ends_with("conv1d.weight") {
        uniform(0.0, 0.5)
    } else if name == "embed_tokens.weight" {
        uniform(0.0, 1.0)
    } else if name.ends_with("mlp.gate.weight") || name == "lm_head.weight" {
        // Spread router logits (non-degenerate top-k) and next-token logits (greedy paths not
        // decided by rounding).
        uniform(0.0, 3.0 * unit)
    } else {
        uniform(0.0, unit)
    }
}

impl TensorSource for SyntheticSource {
    fn contains(&self, name: &str) -> bool {
        // Experts are stacked as in MLX files (`switch_mlp`); HF's expert names do not exist.
        !name.contains(".experts.")
    }

    fn take_linears(
        &mut self,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Linear>> {
        if let Some(stream) = self.quant_stream(module, cols) {
            return (0..count)
                .map(|i| Ok(Linear::Affine(stream.matrix(i, rows, cols)?)))
                .collect();
        }
        let data = self.take_f32(&format!("{module}.weight"), &[count, rows, cols])?;
        Ok(data
            .chunks_exact(rows * cols)
            .map(|d| {
                Linear::Dense(Matrix {
                    rows,
                    cols,
                    data: d.to_vec(),
                })
            })
            .collect())
    }

    fn take_f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let key = self.key(name);
        let len: usize = shape.iter().product();
        let init = init_for(name, shape);
        let mut out = vec![0f32; len];
        out.par_chunks_mut(1 << 16)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (j, v) in chunk.iter_mut().enumerate() {
                    let u = uniform_at(key, (c * (1 << 16) + j) as u64);
                    *v = match init {
                        Init::Uniform { offset, scale } => offset + scale * u,
                        Init::ALog => (1.0 + 7.5 * (u + 1.0)).ln(),
                    };
                }
            });
        Ok(out)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        Ok(())
    }

    fn norms_are_shifted(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantised_weights_follow_the_documented_formula() {
        let src = SyntheticSource::new(11);
        let (rows, cols) = (8, 128);
        let stream = src
            .quant_stream("layers.0.mlp.switch_mlp.up_proj", cols)
            .unwrap();
        assert_eq!(stream.bits, 4);
        let m = stream.matrix(2, rows, cols).unwrap();
        // Matrix 2 of the stack starts at word 2·rows·cols/8 and group 2·rows·cols/64.
        let key = |t: &str| key_of(t) ^ 11u64.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let word0 = 2 * rows * cols / 8;
        let expect = (mix64(
            key("layers.0.mlp.switch_mlp.up_proj.weight")
                ^ mix64((word0 as u64).wrapping_add(0x9e37_79b9_7f4a_7c15)),
        ) >> 32) as u32;
        assert_eq!(m.codes()[0], expect);
        let u = uniform_at(key("layers.0.mlp.switch_mlp.up_proj.scales"), 2 * 16);
        let c = ((1.0 / (cols as f64).sqrt()) / (255.0f64 / 12.0).sqrt()) as f32;
        assert_eq!(m.scales()[0], bf16::from_f32(c * (1.0 + 0.25 * u)));
        assert_eq!(m.biases()[0], bf16::from_f32(-m.scales()[0].to_f32() * 7.5));
    }

    #[test]
    fn quantised_weights_have_the_roles_deviation_and_no_offset() {
        let src = SyntheticSource::new(3);
        for (module, bits, sigma) in [
            ("layers.1.self_attn.q_proj", 4, 1.0 / 512f64.sqrt()),
            ("layers.1.mlp.gate", 8, 3.0 / 512f64.sqrt()),
            ("embed_tokens", 4, 1.0 / 3f64.sqrt()),
        ] {
            let stream = src.quant_stream(module, 512).unwrap();
            assert_eq!(stream.bits, bits, "{module}");
            let w = stream.matrix(0, 256, 512).unwrap().dequantize();
            let n = w.len() as f64;
            let mean = w.iter().map(|&v| v as f64).sum::<f64>() / n;
            let std = (w.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            assert!(mean.abs() < 0.02 * sigma, "{module}: mean {mean}");
            assert!(
                (std / sigma - 1.0).abs() < 0.05,
                "{module}: std {std} vs {sigma}"
            );
        }
    }
}
