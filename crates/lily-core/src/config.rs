//! The text model's configuration: parsed from `config.json` (the multimodal wrapper with a
//! `text_config`, or a text-only `qwen3_5_moe_text` file), validated once, then trusted.
//!
//! Every dimension comes from the file; nothing here assumes the 35B-A3B shapes. Validation
//! errors name the offending field, because a user staring at a 2,000-line config needs to know
//! which line to fix.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};

/// What the token mixer of one decoder layer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`): conv + recurrent delta rule, constant-size state.
    GatedDeltaNet,
    /// Gated full attention (`full_attention`): GQA with a KV cache.
    Attention,
}

/// The validated text-model configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub layer_kinds: Vec<LayerKind>,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,

    // Gated attention.
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that are rotated (rotate-half pairing within them).
    pub rotary_dim: usize,
    pub rope_theta: f64,

    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub conv_kernel: usize,

    // Mixture of experts.
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate_size: usize,
    pub shared_intermediate_size: usize,
    pub norm_topk_prob: bool,

    /// Token ids that end generation (from the config; generation_config may add more).
    pub eos_token_ids: Vec<u32>,
}

/// The full-size model's config, as shipped by Qwen (copied from shared/data/qwen3.6).
pub const QWEN36_35B_A3B_CONFIG: &str = include_str!("../../../assets/qwen3.6/config.json");

impl ModelConfig {
    /// Reads and validates `config.json` in a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_json(&text).with_context(|| format!("invalid {}", path.display()))
    }

    /// Parses either the multimodal wrapper (`text_config` inside) or a text-only config.
    pub fn from_json(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).context("config is not valid JSON")?;
        let root = root.as_object().context("config must be a JSON object")?;
        let (text_cfg, prefix) = match root.get("text_config") {
            Some(Value::Object(t)) => (t, "text_config."),
            Some(_) => bail!("field `text_config` must be an object"),
            None => (root, ""),
        };
        let f = Fields {
            map: text_cfg,
            prefix,
        };
        let model_type = f.str_or("model_type", "")?;
        if !matches!(model_type.as_str(), "qwen3_5_moe_text" | "qwen3_5_moe") {
            bail!(
                "field `{prefix}model_type` is {model_type:?}; Lily runs qwen3_5_moe models \
                 (qwen3_5_moe or qwen3_5_moe_text)"
            );
        }

        let num_layers = f.usize("num_hidden_layers")?;
        let layer_kinds = match text_cfg.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("linear_attention") => Ok(LayerKind::GatedDeltaNet),
                    Some("full_attention") => Ok(LayerKind::Attention),
                    other => bail!(
                        "field `{prefix}layer_types[{i}]` is {other:?}; expected \
                         \"linear_attention\" or \"full_attention\""
                    ),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(_) => bail!("field `{prefix}layer_types` must be a list"),
            None => {
                let interval = f.usize_or("full_attention_interval", 4)?;
                if interval == 0 {
                    bail!("field `{prefix}full_attention_interval` must be at least 1");
                }
                (0..num_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::Attention
                        } else {
                            LayerKind::GatedDeltaNet
                        }
                    })
                    .collect()
            }
        };
        if layer_kinds.len() != num_layers {
            bail!(
                "field `{prefix}layer_types` lists {} layers but `{prefix}num_hidden_layers` is \
                 {num_layers}",
                layer_kinds.len()
            );
        }

        // Defaults are transformers' class defaults for qwen3_5_moe_text.
        // transformers 5 keeps rope settings in `rope_parameters`; older files and mlx-lm put
        // them at the top level (mlx-lm also writes `type` for `rope_type`).
        let rope = match text_cfg
            .get("rope_parameters")
            .or(text_cfg.get("rope_scaling"))
        {
            Some(Value::Object(r)) => Some(r),
            Some(Value::Null) | None => None,
            Some(_) => bail!("field `{prefix}rope_parameters` must be an object"),
        };
        let rope_fields = rope.map(|map| Fields {
            map,
            prefix: "rope_parameters.",
        });
        let rope_type = match &rope_fields {
            Some(r) => match r.map.get("rope_type").or(r.map.get("type")) {
                Some(Value::String(s)) => s.clone(),
                Some(_) => bail!("field `{prefix}rope_parameters.rope_type` must be a string"),
                None => "default".to_string(),
            },
            None => "default".to_string(),
        };
        if rope_type != "default" {
            bail!(
                "field `{prefix}rope_parameters.rope_type` is {rope_type:?}; only \"default\" \
                 RoPE is supported (YaRN context extension is not implemented)"
            );
        }
        let rope_theta = match rope_fields.as_ref().and_then(|r| r.map.get("rope_theta")) {
            Some(_) => rope_fields
                .as_ref()
                .map(|r| r.f64("rope_theta"))
                .transpose()?,
            None => None,
        };
        let rope_theta = match rope_theta {
            Some(t) => t,
            None => f.f64_or("rope_theta", 10_000.0)?,
        };
        let partial = match rope_fields
            .as_ref()
            .and_then(|r| r.map.get("partial_rotary_factor"))
        {
            Some(_) => rope_fields
                .as_ref()
                .map(|r| r.f64("partial_rotary_factor"))
                .transpose()?,
            None => None,
        };
        let partial_rotary_factor = match partial {
            Some(p) => p,
            None => f.f64_or("partial_rotary_factor", 0.25)?,
        };

        let num_attention_heads = f.usize("num_attention_heads")?;
        let head_dim = f.usize_or(
            "head_dim",
            f.usize("hidden_size")? / num_attention_heads.max(1),
        )?;
        let rotary = head_dim as f64 * partial_rotary_factor;
        let rotary_dim = rotary.round() as usize;

        let eos_token_ids = match root.get("eos_token_id").or(text_cfg.get("eos_token_id")) {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(ids)) => ids
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect(),
            _ => Vec::new(),
        };

        let config = ModelConfig {
            hidden_size: f.usize("hidden_size")?,
            vocab_size: f.usize("vocab_size")?,
            layer_kinds,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            max_position_embeddings: f.usize_or("max_position_embeddings", 32_768)?,
            tie_word_embeddings: f.bool_or(
                "tie_word_embeddings",
                root.get("tie_word_embeddings")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            )?,
            num_attention_heads,
            num_kv_heads: f.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            linear_num_key_heads: f.usize("linear_num_key_heads")?,
            linear_num_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            conv_kernel: f.usize_or("linear_conv_kernel_dim", 4)?,
            num_experts: f.usize("num_experts")?,
            experts_per_token: f.usize("num_experts_per_tok")?,
            moe_intermediate_size: f.usize("moe_intermediate_size")?,
            shared_intermediate_size: f.usize("shared_expert_intermediate_size")?,
            // Qwen3.5-MoE always renormalises the top-k weights; the field is absent from the
            // official config, and an explicit `false` is honoured.
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            eos_token_ids,
        };
        if (rotary - rotary_dim as f64).abs() > 1e-9 {
            bail!(
                "field `partial_rotary_factor` ({partial_rotary_factor}) times `{prefix}head_dim` \
                 ({head_dim}) is not a whole number of rotary dims"
            );
        }
        if !f.bool_or("attn_output_gate", true)? {
            bail!(
                "field `{prefix}attn_output_gate` is false; Lily implements the gated attention of qwen3_5_moe only"
            );
        }
        if f.bool_or("attention_bias", false)? {
            bail!("field `{prefix}attention_bias` is true; qwen3_5_moe has no attention biases");
        }
        let act = f.str_or("hidden_act", "silu")?;
        if act != "silu" {
            bail!("field `{prefix}hidden_act` is {act:?}; only \"silu\" is supported");
        }
        config.validate(prefix)?;
        Ok(config)
    }

    fn validate(&self, prefix: &str) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", self.layer_kinds.len()),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.experts_per_token),
            ("moe_intermediate_size", self.moe_intermediate_size),
            (
                "shared_expert_intermediate_size",
                self.shared_intermediate_size,
            ),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, value) in positive {
            if value == 0 {
                bail!("field `{prefix}{name}` must be positive");
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads) {
            bail!(
                "field `{prefix}num_key_value_heads` ({}) must divide `num_attention_heads` ({})",
                self.num_kv_heads,
                self.num_attention_heads
            );
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            bail!(
                "field `{prefix}linear_num_key_heads` ({}) must divide `linear_num_value_heads` ({})",
                self.linear_num_key_heads,
                self.linear_num_value_heads
            );
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            bail!(
                "rotary dims ({}, from `partial_rotary_factor` × `{prefix}head_dim`) must be even \
                 and at most head_dim ({})",
                self.rotary_dim,
                self.head_dim
            );
        }
        if self.experts_per_token > self.num_experts {
            bail!(
                "field `{prefix}num_experts_per_tok` ({}) exceeds `num_experts` ({})",
                self.experts_per_token,
                self.num_experts
            );
        }
        if self.conv_kernel < 2 {
            bail!("field `{prefix}linear_conv_kernel_dim` must be at least 2");
        }
        if self.vocab_size > u32::MAX as usize {
            bail!("field `{prefix}vocab_size` does not fit a u32 token id");
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 || self.rms_norm_eps.is_infinite()
        {
            bail!("field `{prefix}rms_norm_eps` must be a positive number");
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 || self.rope_theta.is_infinite() {
            bail!("field `rope_theta` must be a positive number");
        }
        Ok(())
    }

    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }

    pub fn num_attention_layers(&self) -> usize {
        self.layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }

    pub fn num_gdn_layers(&self) -> usize {
        self.num_layers() - self.num_attention_layers()
    }

    /// Width of the GDN q|k|v projection (and of its causal conv).
    pub fn gdn_conv_dim(&self) -> usize {
        2 * self.gdn_key_dim() + self.gdn_value_dim()
    }

    pub fn gdn_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    pub fn gdn_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
}

/// A view of one JSON object that reports missing or mistyped fields by their full path.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn usize(&self, name: &str) -> Result<usize> {
        match self.map.get(name) {
            Some(v) => self.as_usize(name, v),
            None => bail!("missing field `{}{name}`", self.prefix),
        }
    }

    fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        match self.map.get(name) {
            Some(Value::Null) | None => Ok(default),
            Some(v) => self.as_usize(name, v),
        }
    }

    fn as_usize(&self, name: &str, v: &Value) -> Result<usize> {
        match v.as_u64() {
            Some(n) if n <= u32::MAX as u64 => Ok(n as usize),
            _ => bail!(
                "field `{}{name}` must be a non-negative integer, got {v}",
                self.prefix
            ),
        }
    }

    fn f64(&self, name: &str) -> Result<f64> {
        match self.map.get(name).and_then(Value::as_f64) {
            Some(x) => Ok(x),
            None => bail!("field `{}{name}` must be a number", self.prefix),
        }
    }

    fn f64_or(&self, name: &str, default: f64) -> Result<f64> {
        match self.map.get(name) {
            Some(Value::Null) | None => Ok(default),
            Some(_) => self.f64(name),
        }
    }

    fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.map.get(name) {
            Some(Value::Null) | None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => bail!(
                "field `{}{name}` must be true or false, got {v}",
                self.prefix
            ),
        }
    }

    fn str_or(&self, name: &str, default: &str) -> Result<String> {
        match self.map.get(name) {
            Some(Value::Null) | None => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => bail!("field `{}{name}` must be a string, got {v}", self.prefix),
        }
    }
}

#[cfg(test)]
mod tests;
