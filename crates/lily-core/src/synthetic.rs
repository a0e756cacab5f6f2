//! Synthetic models: the shapes of a named config with deterministic pseudo-random weights,
//! generated in place from a counter-based hash (no file, same values on every machine).
//!
//! They stand in for the real weights, which cannot be downloaded here, in benchmarks and server
//! tests. Magnitudes are set per tensor role so that activations stay O(1) through every layer
//! and the router's softmax is neither uniform nor one-hot.

use anyhow::{Result, bail};
use rayon::prelude::*;

use crate::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use crate::rng::{key_of, uniform_at};
use crate::source::TensorSource;

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
        // Experts are generated one tensor per expert; fused names do not exist.
        !name.ends_with("experts.gate_up_proj") && !name.ends_with("experts.down_proj")
    }

    fn take_f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let key = key_of(name) ^ self.seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
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
