//! What a checkpoint directory holds, read from `config.json` and the safetensors headers
//! only (no tensor data): the stored dtypes, MLX quantisation, files and bytes on disk.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use lily_core::plan::WeightFormat;
use serde_json::Value;

/// A safetensors header larger than this is not a header but a corrupt file.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// MLX affine quantisation as `config.json` declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantisation {
    pub bits: u32,
    pub group_size: u32,
    pub mode: String,
    /// Modules quantised differently from the default, counted by bit width.
    pub overrides: BTreeMap<u32, usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointFormat {
    /// Bytes stored per safetensors dtype (`BF16`, `U32`, ...).
    pub dtype_bytes: BTreeMap<String, u64>,
    pub quantisation: Option<Quantisation>,
    pub files: usize,
    /// The safetensors files, headers included.
    pub bytes_on_disk: u64,
}

impl CheckpointFormat {
    pub fn read(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config: Value = serde_json::from_str(
            &std::fs::read_to_string(&config_path)
                .with_context(|| format!("cannot read {}", config_path.display()))?,
        )
        .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
        let quantisation = quantisation(&config)
            .with_context(|| format!("{}: quantisation", config_path.display()))?;
        let mut format = CheckpointFormat {
            dtype_bytes: BTreeMap::new(),
            quantisation,
            files: 0,
            bytes_on_disk: 0,
        };
        for name in shard_names(dir)? {
            let path = dir.join(&name);
            format.files += 1;
            format.bytes_on_disk += std::fs::metadata(&path)
                .with_context(|| format!("cannot read {}", path.display()))?
                .len();
            for (dtype, bytes) in header_dtype_bytes(&path)? {
                *format.dtype_bytes.entry(dtype).or_default() += bytes;
            }
        }
        Ok(format)
    }

    /// The weights' format as stored when they are MLX-quantised (backends keep it as is).
    pub fn quantised_format(&self) -> Option<WeightFormat> {
        self.quantisation.as_ref().map(|q| WeightFormat::Mlx {
            bits: q.bits,
            group_size: q.group_size,
        })
    }

    /// One line: `MLX affine 4-bit, group 64 (8-bit for 80 modules); safetensors U32 ...`.
    pub fn describe(&self) -> String {
        let dtypes: Vec<String> = self
            .dtype_bytes
            .iter()
            .map(|(dtype, bytes)| format!("{dtype} {}", super::gb(*bytes)))
            .collect();
        let stored = format!("safetensors ({})", dtypes.join(", "));
        match &self.quantisation {
            None => stored,
            Some(q) => {
                let overrides: Vec<String> = q
                    .overrides
                    .iter()
                    .map(|(bits, n)| format!("{bits}-bit for {n} modules"))
                    .collect();
                let overrides = if overrides.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", overrides.join(", "))
                };
                format!(
                    "MLX {} {}-bit, group {}{overrides}; {stored}",
                    q.mode, q.bits, q.group_size
                )
            }
        }
    }
}

/// MLX's `quantization` (or `quantization_config`) block: default `bits` and `group_size`,
/// plus per-module entries that override them. Other schemes (a `quant_method`, as GPTQ or
/// FP8 checkpoints declare) are refused by name rather than misread.
fn quantisation(config: &Value) -> Result<Option<Quantisation>> {
    let Some(block) = config
        .get("quantization")
        .or_else(|| config.get("quantization_config"))
    else {
        return Ok(None);
    };
    if let Some(method) = block.get("quant_method").and_then(Value::as_str) {
        bail!("quant_method {method:?} is not MLX affine quantisation, which is all Lily reads");
    }
    let number = |v: &Value, key: &str| -> Result<u32> {
        v.get(key)
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .with_context(|| format!("no integer {key:?}"))
    };
    let bits = number(block, "bits")?;
    let group_size = number(block, "group_size")?;
    let mode = block
        .get("mode")
        .and_then(Value::as_str)
        .unwrap_or("affine")
        .to_string();
    let mut overrides = BTreeMap::new();
    if let Some(entries) = block.as_object() {
        for (module, entry) in entries {
            if entry.is_object() {
                let module_bits =
                    number(entry, "bits").with_context(|| format!("override {module:?}"))?;
                if module_bits != bits {
                    *overrides.entry(module_bits).or_default() += 1;
                }
            }
        }
    }
    Ok(Some(Quantisation {
        bits,
        group_size,
        mode,
        overrides,
    }))
}

/// The safetensors files of a checkpoint: from the index when there is one.
fn shard_names(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Ok(vec!["model.safetensors".to_string()]);
    }
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?,
    )
    .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .with_context(|| format!("{} has no weight_map", index.display()))?;
    let mut names: Vec<String> = Vec::new();
    for file in map.values() {
        let file = file
            .as_str()
            .with_context(|| format!("{}: a weight_map entry is not a name", index.display()))?;
        ensure!(
            !file.contains('/') && !file.contains('\\') && file != ".." && !file.is_empty(),
            "{}: {file:?} is not a plain file name",
            index.display()
        );
        names.push(file.to_string());
    }
    names.sort_unstable();
    names.dedup();
    Ok(names)
}

/// Bytes per dtype in one safetensors file, from its header.
fn header_dtype_bytes(path: &Path) -> Result<BTreeMap<String, u64>> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .with_context(|| format!("{} is too short for a safetensors file", path.display()))?;
    let len = u64::from_le_bytes(len);
    ensure!(
        len <= MAX_HEADER_BYTES,
        "{} declares a {len}-byte header; it is not a safetensors file",
        path.display()
    );
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)
        .with_context(|| format!("{}: the header is cut short", path.display()))?;
    let header: Value = serde_json::from_slice(&header)
        .with_context(|| format!("{}: the header is not JSON", path.display()))?;
    let tensors = header
        .as_object()
        .with_context(|| format!("{}: the header is not an object", path.display()))?;
    let mut bytes = BTreeMap::new();
    for (name, info) in tensors.iter().filter(|(name, _)| *name != "__metadata__") {
        let dtype = info.get("dtype").and_then(Value::as_str);
        let offsets = info.get("data_offsets").and_then(Value::as_array);
        let (Some(dtype), Some([start, end])) = (dtype, offsets.map(Vec::as_slice)) else {
            bail!(
                "{}: tensor {name:?} has no dtype or offsets",
                path.display()
            );
        };
        let (Some(start), Some(end)) = (start.as_u64(), end.as_u64()) else {
            bail!("{}: tensor {name:?} has bad offsets", path.display());
        };
        *bytes.entry(dtype.to_string()).or_default() += end.saturating_sub(start);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn mlx_quantisation_is_read_with_its_overrides() {
        let config = json!({"quantization": {
            "group_size": 64, "bits": 4, "mode": "affine",
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "language_model.model.layers.0.mlp.shared_expert_gate": {"group_size": 64, "bits": 8},
            "language_model.model.layers.1.mlp.switch_mlp.up_proj": {"group_size": 64, "bits": 4},
        }});
        let q = quantisation(&config).unwrap().unwrap();
        assert_eq!((q.bits, q.group_size, q.mode.as_str()), (4, 64, "affine"));
        assert_eq!(q.overrides, BTreeMap::from([(8, 2)]));
        assert_eq!(quantisation(&json!({"hidden_size": 64})).unwrap(), None);
        let gptq = json!({"quantization_config": {"quant_method": "gptq", "bits": 4}});
        let err = quantisation(&gptq).unwrap_err().to_string();
        assert!(err.contains("gptq"), "{err}");
    }

    #[test]
    fn a_checkpoint_directory_is_described_from_its_headers() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a-official");
        let format = CheckpointFormat::read(&fixture).unwrap();
        assert_eq!(format.files, 2);
        assert_eq!(format.quantisation, None);
        assert_eq!(format.quantised_format(), None);
        let on_disk: u64 = [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]
        .iter()
        .map(|f| std::fs::metadata(fixture.join(f)).unwrap().len())
        .sum();
        assert_eq!(format.bytes_on_disk, on_disk);
        // Tensor bytes are the files less their headers.
        let stored: u64 = format.dtype_bytes.values().sum();
        assert!(
            stored > on_disk * 9 / 10 && stored < on_disk,
            "{stored} of {on_disk}"
        );
        assert!(
            format.dtype_bytes.contains_key("BF16"),
            "{:?}",
            format.dtype_bytes
        );
        assert!(
            format.describe().starts_with("safetensors (BF16"),
            "{}",
            format.describe()
        );
    }

    #[test]
    fn a_corrupt_header_is_an_error_not_an_allocation() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        let mut bytes = u64::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        let err = CheckpointFormat::read(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not a safetensors file"), "{err}");
    }
}
