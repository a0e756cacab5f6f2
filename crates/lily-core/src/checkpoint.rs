//! Safetensors checkpoints: one file or shards listed in `model.safetensors.index.json`,
//! memory-mapped, with tensor names reduced to one canonical form.
//!
//! Canonical names drop the wrapper prefixes the different writers use
//! (`model.language_model.`, `model.`, MLX's `language_model.model.`), so the weight loader
//! asks for `layers.3.self_attn.q_proj.weight` whatever wrote the file. Tensors that belong to
//! parts we do not run (vision tower, MTP head) are set aside; every other tensor must be taken
//! by the loader, and [`Checkpoint::finish`] fails naming any that were not.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::source::TensorSource;

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
        let bytes = &self.shards[entry.shard][entry.start..entry.end];
        decode_f32(entry.dtype, bytes).with_context(|| format!("tensor {}", self.describe(&entry)))
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
        false
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
