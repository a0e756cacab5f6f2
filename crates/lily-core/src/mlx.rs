//! What mlx-lm decides about a `qwen3_5_moe` checkpoint, in one place: which modules it quantises
//! and at how many bits, how the `quantization` block of config.json records that, and which
//! norm weights it stores shifted by one.
//!
//! Read from mlx-lm 0.32.2 (`models/qwen3_5.py`: `quant_predicate`, `sanitize`; `utils.py`:
//! `quantize_model`): every Linear, Embedding and stacked SwitchLinear whose input dim divides by
//! the group size is quantised; the router `mlp.gate` and `mlp.shared_expert_gate` at 8 bits,
//! the rest at the default 4. Norms, conv taps, A_log and dt_bias stay unquantised.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::checkpoint::canonical_name;
use crate::quant::{DEFAULT_GROUP_SIZE, check_format};

/// Bits mlx-lm gives the linear module `module` (canonical name, no `.weight`) with `cols`
/// inputs, or `None` where it leaves the weight unquantised.
pub fn mlx_quant_bits(module: &str, cols: usize) -> Option<u32> {
    if !cols.is_multiple_of(DEFAULT_GROUP_SIZE) {
        return None;
    }
    if module.ends_with("mlp.gate") || module.ends_with("shared_expert_gate") {
        Some(8)
    } else {
        Some(4)
    }
}

/// Whether a canonical tensor name is a zero-centred "(1 + w)" RMSNorm weight, which mlx-lm
/// stores as bf16(1 + w). The gated norm of the GDN layers (`linear_attn.norm`) is a plain gain.
pub fn is_zero_centred_norm(name: &str) -> bool {
    name == "norm.weight"
        || [
            ".input_layernorm.weight",
            ".post_attention_layernorm.weight",
            ".q_norm.weight",
            ".k_norm.weight",
        ]
        .iter()
        .any(|s| name.ends_with(s))
}

/// Bits and group size of one quantised module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantFormat {
    pub bits: u32,
    pub group_size: usize,
}

/// The `quantization` block of an MLX config.json: a default and per-module overrides.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantizationConfig {
    default: Option<QuantFormat>,
    /// Canonical module name → its format, or `None` where the module is left unquantised.
    overrides: BTreeMap<String, Option<QuantFormat>>,
}

impl QuantizationConfig {
    /// Reads the block from `dir/config.json`; an absent file or block means no quantisation.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(Self::default());
        };
        let root: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_config(&root).with_context(|| format!("invalid {}", path.display()))
    }

    pub fn from_config(root: &Value) -> Result<Self> {
        let block = match root.get("quantization").or(root.get("quantization_config")) {
            None | Some(Value::Null) => return Ok(Self::default()),
            Some(Value::Object(b)) => b,
            Some(_) => bail!("field `quantization` must be an object"),
        };
        let mode = block
            .get("mode")
            .and_then(Value::as_str)
            .unwrap_or("affine");
        if mode != "affine" {
            bail!("quantization mode {mode:?} is not supported (only MLX \"affine\")");
        }
        let mut config = QuantizationConfig {
            default: Some(format_of(block, "quantization")?),
            overrides: BTreeMap::new(),
        };
        for (key, value) in block {
            let format = match value {
                Value::Object(o) => Some(format_of(o, &format!("quantization.{key}"))?),
                Value::Bool(false) => None,
                _ => continue,
            };
            let module = canonical_name(key).unwrap_or_else(|| key.clone());
            config.overrides.insert(module, format);
        }
        Ok(config)
    }

    pub fn is_quantised(&self) -> bool {
        self.default.is_some()
    }

    /// The format config.json gives a module (canonical name), if any.
    pub fn for_module(&self, module: &str) -> Option<QuantFormat> {
        match self.overrides.get(module) {
            Some(format) => *format,
            None => self.default,
        }
    }
}

fn format_of(map: &serde_json::Map<String, Value>, what: &str) -> Result<QuantFormat> {
    let int = |field: &str| match map.get(field).and_then(Value::as_u64) {
        Some(v) => Ok(v),
        None => bail!("field `{what}.{field}` must be a positive integer"),
    };
    let format = QuantFormat {
        bits: int("bits")? as u32,
        group_size: int("group_size")? as usize,
    };
    check_format(format.bits, format.group_size).with_context(|| format!("field `{what}`"))?;
    Ok(format)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_predicate_is_mlx_lms() {
        assert_eq!(mlx_quant_bits("layers.0.mlp.gate", 2048), Some(8));
        assert_eq!(
            mlx_quant_bits("layers.9.mlp.shared_expert_gate", 2048),
            Some(8)
        );
        assert_eq!(mlx_quant_bits("layers.0.mlp.gate_proj", 2048), Some(4));
        assert_eq!(
            mlx_quant_bits("layers.0.mlp.switch_mlp.down_proj", 512),
            Some(4)
        );
        assert_eq!(mlx_quant_bits("embed_tokens", 2048), Some(4));
        assert_eq!(mlx_quant_bits("layers.0.self_attn.o_proj", 96), None);
        assert!(is_zero_centred_norm("layers.3.self_attn.q_norm.weight"));
        assert!(is_zero_centred_norm("norm.weight"));
        assert!(!is_zero_centred_norm("layers.0.linear_attn.norm.weight"));
    }

    #[test]
    fn overrides_are_found_by_canonical_name() {
        let root: Value = serde_json::json!({"quantization": {
            "group_size": 64, "bits": 4, "mode": "affine",
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "language_model.model.layers.1.mlp.gate": false,
        }});
        let q = QuantizationConfig::from_config(&root).unwrap();
        assert!(q.is_quantised());
        let f = |bits, group_size| Some(QuantFormat { bits, group_size });
        assert_eq!(q.for_module("layers.0.mlp.gate"), f(8, 64));
        assert_eq!(q.for_module("layers.1.mlp.gate"), None);
        assert_eq!(q.for_module("layers.0.mlp.switch_mlp.up_proj"), f(4, 64));
        assert!(
            !QuantizationConfig::from_config(&serde_json::json!({}))
                .unwrap()
                .is_quantised()
        );
    }

    #[test]
    fn unsupported_blocks_are_errors() {
        let err = |v: Value| format!("{:#}", QuantizationConfig::from_config(&v).unwrap_err());
        let e = err(serde_json::json!({"quantization": {"group_size": 64, "bits": 3}}));
        assert!(e.contains("3-bit"), "{e}");
        let e = err(serde_json::json!({"quantization": {"group_size": 16, "bits": 4}}));
        assert!(e.contains("group size 16"), "{e}");
        let e = err(
            serde_json::json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}),
        );
        assert!(e.contains("mxfp4"), "{e}");
        let e = err(
            serde_json::json!({"quantization": {"group_size": 64, "bits": 4,
            "language_model.model.layers.0.mlp.gate": {"bits": 8}}}),
        );
        assert!(e.contains("layers.0.mlp.gate.group_size"), "{e}");
    }
}
