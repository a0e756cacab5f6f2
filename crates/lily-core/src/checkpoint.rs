//! Safetensors checkpoints: one file or shards listed in `model.safetensors.index.json`,
//! memory-mapped, with tensor names reduced to one canonical form.
//!
//! Canonical names drop the wrapper prefixes the different writers use
//! (`model.language_model.`, `model.`, MLX's `language_model.model.`), so the weight loader
//! asks for `layers.3.self_attn.q_proj.weight` whatever wrote the file. Tensors that belong to
//! parts we do not run (vision tower, MTP head) are set aside; every other tensor must be taken
//! by the loader, and [`Checkpoint::finish`] fails naming any that were not.
//!
//! MLX checkpoints are read as mlx-lm writes them: quantised linears as `weight` (u32 codes),
//! `scales` and `biases` (bf16), in the format config.json's `quantization` block gives each
//! module; zero-centred norms already shifted by one (detected as mlx-lm does, from the layout of
//! the conv taps).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::mlx::QuantizationConfig;
use crate::quant::QuantMatrix;
use crate::source::TensorSource;
use crate::weights::{Linear, Matrix};

/// One tensor's location inside a mapped shard.
#[derive(Clone, Debug)]
struct Entry {
    /// The name as written in the file, for error messages.
    file_name: String,
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range inside the shard.
    start: usize,
    end: usize,
}

pub struct Checkpoint {
    dir: PathBuf,
    shard_paths: Vec<PathBuf>,
    shards: Vec<Mmap>,
    entries: BTreeMap<String, Entry>,
    skipped: usize,
    quantization: QuantizationConfig,
    norms_shifted: bool,
}

/// Prefixes of tensors that the text model does not use.
const SKIPPED_PREFIXES: [&str; 4] = ["model.visual.", "vision_tower.", "mtp.", "model.mtp."];

/// Reduces a stored tensor name to the canonical text-model name, or `None` for a skipped one.
pub fn canonical_name(name: &str) -> Option<String> {
    if SKIPPED_PREFIXES.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    for prefix in ["model.language_model.", "language_model.model.", "model."] {
        if let Some(rest) = name.strip_prefix(prefix) {
            return Some(rest.to_string());
        }
    }
    Some(
        name.strip_prefix("language_model.")
            .unwrap_or(name)
            .to_string(),
    )
}

impl Checkpoint {
    /// Opens every shard of the checkpoint in `dir` and indexes its tensors.
    pub fn open(dir: &Path) -> Result<Self> {
        let shard_names = shard_files(dir)?;
        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            shard_paths: Vec::new(),
            shards: Vec::new(),
            entries: BTreeMap::new(),
            skipped: 0,
            quantization: QuantizationConfig::from_dir(dir)?,
            norms_shifted: false,
        };
        for name in shard_names {
            let path = dir.join(&name);
            let file =
                File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the map is read-only; the checkpoint files are not expected to change while
            // Lily runs (a file truncated underneath a mapping is a known hazard of mmap).
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot map {}", path.display()))?;
            ckpt.index_shard(&path, &map)?;
            ckpt.shard_paths.push(path);
            ckpt.shards.push(map);
        }
        ensure!(
            !ckpt.entries.is_empty(),
            "{} holds no text-model tensors",
            dir.display()
        );
        // mlx-lm's own test (qwen3_5.py `sanitize`): HF stores the conv taps as [C, 1, K] and
        // zero-centred norms as w; after mlx-lm has moved the taps to [C, K, 1] it has also
        // stored the norms as 1 + w.
        let mut convs = ckpt
            .entries
            .iter()
            .filter(|(n, _)| n.ends_with("conv1d.weight"))
            .peekable();
        ckpt.norms_shifted =
            convs.peek().is_some() && convs.all(|(_, e)| e.shape.last() == Some(&1));
        Ok(ckpt)
    }

    fn index_shard(&mut self, path: &Path, map: &[u8]) -> Result<()> {
        let (header_len, metadata) = SafeTensors::read_metadata(map).map_err(|e| {
            anyhow::anyhow!(
                "{} is not a valid safetensors file ({e:?}); is it truncated or corrupt?",
                path.display()
            )
        })?;
        let data_start = 8 + header_len;
        let shard = self.shards.len();
        for (file_name, info) in metadata.tensors() {
            let Some(name) = canonical_name(&file_name) else {
                self.skipped += 1;
                continue;
            };
            let entry = Entry {
                file_name: file_name.clone(),
                shard,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + info.data_offsets.0,
                end: data_start + info.data_offsets.1,
            };
            if let Some(other) = self.entries.insert(name.clone(), entry) {
                bail!(
                    "tensors {:?} and {file_name:?} both map to {name:?}; the checkpoint mixes \
                     naming schemes",
                    other.file_name
                );
            }
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of tensors set aside because they belong to the vision tower or MTP head.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Total bytes of the shard files.
    pub fn bytes_on_disk(&self) -> u64 {
        self.shards.iter().map(|m| m.len() as u64).sum()
    }

    /// Every canonical tensor name not yet taken.
    pub fn remaining(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The stored shape of a tensor not yet taken.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// The stored dtype of a tensor not yet taken.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.entries.get(name).map(|e| e.dtype)
    }

    /// Whether the checkpoint is MLX-quantised (by its config or by its tensors).
    pub fn is_quantised(&self) -> bool {
        self.quantization.is_quantised() || self.entries.keys().any(|n| n.ends_with(".scales"))
    }

    /// The bytes of a tensor.
    fn bytes(&self, e: &Entry) -> &[u8] {
        &self.shards[e.shard][e.start..e.end]
    }

    /// Takes an MLX-quantised module: u32 codes `[count?, rows, cols·bits/32]` and bf16 scales
    /// and biases `[count?, rows, cols/group]`, checked against config.json's format for it.
    fn take_quantised(
        &mut self,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Linear>> {
        let mut take = |suffix: &str| {
            let name = format!("{module}.{suffix}");
            self.entries.remove(&name).with_context(|| {
                format!(
                    "checkpoint {} has {module}.scales but no {name}",
                    self.dir.display()
                )
            })
        };
        let (w, s, b) = (take("weight")?, take("scales")?, take("biases")?);
        let lead: Vec<usize> = if count == 1 {
            vec![rows]
        } else {
            vec![count, rows]
        };
        for (e, dtype) in [(&w, Dtype::U32), (&s, Dtype::BF16), (&b, Dtype::BF16)] {
            ensure!(
                e.dtype == dtype,
                "tensor {} is {:?}; MLX quantised weights need {dtype:?} here",
                self.describe(e),
                e.dtype
            );
            ensure!(
                e.shape.len() == lead.len() + 1 && e.shape[..lead.len()] == lead[..],
                "tensor {} has shape {:?}, but the config implies {lead:?} rows of {cols} inputs",
                self.describe(e),
                e.shape
            );
        }
        ensure!(
            s.shape == b.shape,
            "tensors {} and {} differ in shape",
            self.describe(&s),
            self.describe(&b)
        );
        let (words, groups) = (w.shape[lead.len()], s.shape[lead.len()]);
        let bits = words * 32 / cols;
        ensure!(
            groups > 0 && bits * cols == words * 32 && cols.is_multiple_of(groups),
            "tensor {} holds {words} code words and {groups} groups per row, which fit no \
             quantisation of {cols} inputs",
            self.describe(&w)
        );
        let group_size = cols / groups;
        match self.quantization.for_module(module) {
            Some(f) if f.bits as usize == bits && f.group_size == group_size => {}
            Some(f) => bail!(
                "tensor {} is stored as {bits}-bit codes in groups of {group_size}, but \
                 config.json's `quantization` says {}-bit in groups of {}",
                self.describe(&w),
                f.bits,
                f.group_size
            ),
            None => bail!(
                "tensor {} is quantised, but config.json's `quantization` does not quantise \
                 {module}",
                self.describe(&w)
            ),
        }
        let codes: Vec<u32> = self
            .bytes(&w)
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let halves = |e: &Entry| -> Vec<half::bf16> {
            self.bytes(e)
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let (scales, biases) = (halves(&s), halves(&b));
        let (per_w, per_g) = (rows * words, rows * groups);
        (0..count)
            .map(|i| {
                let q = QuantMatrix::from_parts(
                    rows,
                    cols,
                    bits as u32,
                    group_size,
                    codes[i * per_w..(i + 1) * per_w].to_vec(),
                    scales[i * per_g..(i + 1) * per_g].to_vec(),
                    biases[i * per_g..(i + 1) * per_g].to_vec(),
                )
                .with_context(|| format!("tensor {}", self.describe(&w)))?;
                Ok(Linear::Affine(q))
            })
            .collect()
    }

    fn describe(&self, e: &Entry) -> String {
        format!(
            "{:?} in {}",
            e.file_name,
            self.shard_paths[e.shard].display()
        )
    }
}

impl TensorSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn take_f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let Some(entry) = self.entries.remove(name) else {
            bail!("checkpoint {} has no tensor {name:?}", self.dir.display());
        };
        // Size-1 dims are layout noise between writers ([C,1,K] vs [C,K]); compare without them.
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(&entry.shape) != squeeze(shape) {
            bail!(
                "tensor {} has shape {:?}, but the config implies {:?}",
                self.describe(&entry),
                entry.shape,
                shape
            );
        }
        decode_f32(entry.dtype, self.bytes(&entry))
            .with_context(|| format!("tensor {}", self.describe(&entry)))
    }

    fn take_linears(
        &mut self,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Linear>> {
        if self.entries.contains_key(&format!("{module}.scales")) {
            return self.take_quantised(module, count, rows, cols);
        }
        let weight = format!("{module}.weight");
        let name = if self.entries.contains_key(&weight) || !self.entries.contains_key(module) {
            weight
        } else {
            module.to_string()
        };
        let shape = if count == 1 {
            vec![rows, cols]
        } else {
            vec![count, rows, cols]
        };
        let data = self.take_f32(&name, &shape)?;
        let matrix = |data| Linear::Dense(Matrix { rows, cols, data });
        if count == 1 {
            return Ok(vec![matrix(data)]);
        }
        Ok(data
            .chunks_exact(rows * cols)
            .map(|d| matrix(d.to_vec()))
            .collect())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        if let Some((name, entry)) = self.entries.iter().next() {
            let more = self.entries.len() - 1;
            bail!(
                "checkpoint tensor {} ({name}) was not used by the model{}; refusing to run a \
                 checkpoint that does not match the config",
                self.describe(entry),
                if more > 0 {
                    format!(" (and {more} more)")
                } else {
                    String::new()
                }
            );
        }
        Ok(())
    }

    fn norms_are_shifted(&self) -> bool {
        self.norms_shifted
    }
}

/// The shard files of a checkpoint: from the index if there is one, else `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{} has no `weight_map` object", index.display()))?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let file = file.as_str().with_context(|| {
                format!(
                    "{}: weight_map[{tensor:?}] is not a file name",
                    index.display()
                )
            })?;
            ensure!(
                !file.contains('/') && !file.contains('\\') && file != ".." && !file.is_empty(),
                "{}: weight_map[{tensor:?}] = {file:?} is not a plain file name",
                index.display()
            );
            files.insert(file.to_string());
        }
        ensure!(!files.is_empty(), "{} lists no shards", index.display());
        return Ok(files.into_iter().collect());
    }
    let single = dir.join("model.safetensors");
    ensure!(
        single.exists(),
        "{} has neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    );
    Ok(vec!["model.safetensors".to_string()])
}

/// Widens stored little-endian values to f32.
pub fn decode_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let out = match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => bail!("dtype {other:?} is not supported here (expected F32, BF16 or F16)"),
    };
    Ok(out)
}

#[cfg(test)]
mod tests;
