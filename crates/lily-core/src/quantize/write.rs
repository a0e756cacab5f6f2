//! `lily quantize`: writes an MLX 4-bit checkpoint directory that mlx-lm loads, with mlx-lm's
//! tensor names (`language_model.model.…`, experts stacked under `switch_mlp`, conv taps as
//! `[C, K, 1]`), its `quantization` block and its 5 GiB shards.
//!
//! The source is streamed one tensor (or one expert stack) at a time: the file layout is planned
//! from the shapes alone, then each tensor is converted and written, so memory holds one stack,
//! not the model.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use half::bf16;
use safetensors::Dtype;
use serde_json::{Value, json};

use super::{mlx_linear, mlx_plain_values};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::mlx::mlx_quant_bits;
use crate::quant::DEFAULT_GROUP_SIZE;
use crate::source::TensorSource;
use crate::weights::Linear;

/// mlx-lm's shard limit (`MAX_FILE_SIZE_GB = 5`, in GiB).
const MAX_SHARD_BYTES: u64 = 5 << 30;

/// Files written other than the weights are copied, except these (weights in other formats).
const NOT_COPIED: [&str; 6] = [".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack"];

/// What was written.
#[derive(Debug)]
pub struct WriteSummary {
    pub tensors: usize,
    pub shards: usize,
    pub bytes: u64,
}

/// One unit of conversion: what it reads, and the tensors it writes.
struct Job {
    kind: Kind,
    outputs: Vec<Output>,
}

enum Kind {
    /// `count` matrices of `rows × cols` read from the modules `sources` (one stack, or one
    /// module per expert), written as the stacked modules `targets`. Two targets split a fused
    /// gate|up stack (`2·rows` rows each) into its halves.
    Linears {
        sources: Vec<String>,
        targets: Vec<String>,
        count: usize,
        rows: usize,
        cols: usize,
    },
    /// A tensor written unquantised.
    Plain { name: String, shape: Vec<usize> },
}

struct Output {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl Output {
    fn bytes(&self) -> u64 {
        let elems: usize = self.shape.iter().product();
        (elems * self.dtype.bitsize() / 8) as u64
    }
}

/// The stored name mlx-lm gives a canonical tensor name.
fn mlx_name(canonical: &str) -> String {
    if canonical.starts_with("lm_head") {
        format!("language_model.{canonical}")
    } else {
        format!("language_model.model.{canonical}")
    }
}

/// The tensors of linear module `module` as mlx-lm writes them.
fn linear_outputs(module: &str, count: usize, rows: usize, cols: usize) -> Vec<Output> {
    let lead = if count == 1 {
        vec![rows]
    } else {
        vec![count, rows]
    };
    let with = |last: usize| lead.iter().copied().chain([last]).collect::<Vec<_>>();
    let name = |suffix: &str| mlx_name(&format!("{module}.{suffix}"));
    match mlx_quant_bits(module, cols) {
        Some(bits) => vec![
            Output {
                name: name("weight"),
                dtype: Dtype::U32,
                shape: with(cols * bits as usize / 32),
            },
            Output {
                name: name("scales"),
                dtype: Dtype::BF16,
                shape: with(cols / DEFAULT_GROUP_SIZE),
            },
            Output {
                name: name("biases"),
                dtype: Dtype::BF16,
                shape: with(cols / DEFAULT_GROUP_SIZE),
            },
        ],
        None => vec![Output {
            name: name("weight"),
            dtype: Dtype::BF16,
            shape: with(cols),
        }],
    }
}

/// Plans the conversion of every text-model tensor of `ckpt`.
fn plan(ckpt: &Checkpoint, config: &ModelConfig) -> Result<Vec<Job>> {
    let names: Vec<String> = ckpt.remaining().map(str::to_string).collect();
    let mut jobs = Vec::new();
    let linears = |sources: Vec<String>, targets: Vec<String>, count, rows, cols| Job {
        outputs: targets
            .iter()
            .flat_map(|t| linear_outputs(t, count, rows, cols))
            .collect(),
        kind: Kind::Linears {
            sources,
            targets,
            count,
            rows,
            cols,
        },
    };
    for name in &names {
        let shape = ckpt.shape(name).unwrap_or_default().to_vec();
        let (e, inter, h) = (
            config.num_experts,
            config.moe_intermediate_size,
            config.hidden_size,
        );
        if let Some(mlp) = name.strip_suffix(".experts.gate_up_proj") {
            let targets = ["gate_proj", "up_proj"].map(|p| format!("{mlp}.switch_mlp.{p}"));
            jobs.push(linears(vec![name.clone()], targets.to_vec(), e, inter, h));
        } else if let Some(mlp) = name.strip_suffix(".experts.down_proj") {
            let target = vec![format!("{mlp}.switch_mlp.down_proj")];
            jobs.push(linears(vec![name.clone()], target, e, h, inter));
        } else if let Some((mlp, proj)) = per_expert(name) {
            // Planned once, from expert 0; the stack reads experts 0..E in order.
            if name.contains(".experts.0.") {
                let (rows, cols) = if proj == "down_proj" {
                    (h, inter)
                } else {
                    (inter, h)
                };
                let source = (0..e)
                    .map(|x| format!("{mlp}.experts.{x}.{proj}"))
                    .collect();
                let target = vec![format!("{mlp}.switch_mlp.{proj}")];
                jobs.push(linears(source, target, e, rows, cols));
            }
        } else if name.ends_with("conv1d.weight") {
            ensure!(
                shape.len() == 3 && shape[1] == 1,
                "tensor {name} has shape {shape:?}; expected HF's [channels, 1, kernel]"
            );
            jobs.push(Job {
                outputs: vec![Output {
                    name: mlx_name(name),
                    dtype: Dtype::BF16,
                    shape: vec![shape[0], shape[2], 1],
                }],
                kind: Kind::Plain {
                    name: name.clone(),
                    shape,
                },
            });
        } else if let (Some(module), [rows, cols]) = (name.strip_suffix(".weight"), &shape[..])
            && !is_norm(name)
        {
            let module = vec![module.to_string()];
            jobs.push(linears(module.clone(), module, 1, *rows, *cols));
        } else if shape.len() == 1 {
            let dtype = match ckpt.dtype(name) {
                Some(d) if name.ends_with("A_log") => d,
                _ => Dtype::BF16,
            };
            jobs.push(Job {
                outputs: vec![Output {
                    name: mlx_name(name),
                    dtype,
                    shape: shape.clone(),
                }],
                kind: Kind::Plain {
                    name: name.clone(),
                    shape,
                },
            });
        } else {
            bail!("tensor {name} of shape {shape:?} is not part of qwen3_5_moe's text model");
        }
    }
    Ok(jobs)
}

fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight") || name.ends_with("layernorm.weight")
}

/// `(mlp, projection)` of HF's per-expert names `{mlp}.experts.{e}.{projection}.weight`.
fn per_expert(name: &str) -> Option<(&str, &str)> {
    let (mlp, rest) = name.split_once(".experts.")?;
    let (index, rest) = rest.split_once('.')?;
    index.parse::<usize>().ok()?;
    Some((mlp, rest.strip_suffix(".weight")?))
}

/// Converts one job's tensors: the bytes of each output, in order.
fn run(job: &Job, ckpt: &mut Checkpoint) -> Result<Vec<Vec<u8>>> {
    let shifted = ckpt.norms_are_shifted();
    match &job.kind {
        Kind::Plain { name, shape } => {
            let squeezed: Vec<usize> = shape.iter().copied().filter(|&d| d != 1).collect();
            let values = mlx_plain_values(name, ckpt.take_f32(name, &squeezed)?, shifted);
            Ok(vec![encode(&values, job.outputs[0].dtype)?])
        }
        Kind::Linears {
            sources,
            targets,
            count,
            rows,
            cols,
        } => {
            let (n, full_rows) = (*count / sources.len(), rows * targets.len());
            let mut parts = Vec::with_capacity(*count);
            for module in sources {
                parts.extend(ckpt.take_linears(module, n, full_rows, *cols)?);
            }
            let mut outputs = vec![Vec::new(); job.outputs.len()];
            // Each target's outputs follow the previous target's.
            let per_target = job.outputs.len() / targets.len();
            for part in parts {
                let halves = if targets.len() == 2 {
                    let (gate, up) = part.split_rows(*rows)?;
                    vec![gate, up]
                } else {
                    vec![part]
                };
                for (t, (target, half)) in targets.iter().zip(halves).enumerate() {
                    let out = &mut outputs[t * per_target..(t + 1) * per_target];
                    match mlx_linear(target, half)? {
                        Linear::Affine(q) => {
                            out[0].extend(q.codes().iter().flat_map(|w| w.to_le_bytes()));
                            out[1].extend(q.scales().iter().flat_map(|v| v.to_le_bytes()));
                            out[2].extend(q.biases().iter().flat_map(|v| v.to_le_bytes()));
                        }
                        Linear::Dense(m) => out[0].extend(encode(&m.data, Dtype::BF16)?),
                    }
                }
            }
            Ok(outputs)
        }
    }
}

/// Little-endian bytes of f32 values stored as `dtype`.
fn encode(values: &[f32], dtype: Dtype) -> Result<Vec<u8>> {
    Ok(match dtype {
        Dtype::BF16 => values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        other => bail!("cannot write dtype {other:?}"),
    })
}

/// Converts the bf16/f32 checkpoint in `src` into an MLX 4-bit directory `out`, calling
/// `progress(done, total)` with bytes written.
pub fn write_mlx_checkpoint(
    src: &Path,
    out: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<WriteSummary> {
    let config = ModelConfig::from_dir(src)?;
    let mut ckpt = Checkpoint::open(src)?;
    ensure!(
        !ckpt.is_quantised(),
        "{} is already MLX-quantised; `lily quantize` reads bf16 or f32 checkpoints",
        src.display()
    );
    if out.exists() {
        let empty = std::fs::read_dir(out)
            .with_context(|| format!("cannot read {}", out.display()))?
            .next()
            .is_none();
        ensure!(empty, "{} exists and is not empty", out.display());
    }
    let jobs = plan(&ckpt, &config)?;

    // Shards in job order, each at most MAX_SHARD_BYTES unless one tensor is larger.
    let mut shard_of_job = Vec::with_capacity(jobs.len());
    let (mut shards, mut size) = (0usize, 0u64);
    for job in &jobs {
        let bytes: u64 = job.outputs.iter().map(Output::bytes).sum();
        if shards == 0 || size + bytes > MAX_SHARD_BYTES {
            shards += 1;
            size = 0;
        }
        size += bytes;
        shard_of_job.push(shards - 1);
    }
    let file_name = |i: usize| {
        if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
        }
    };
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let total: u64 = jobs
        .iter()
        .flat_map(|j| &j.outputs)
        .map(Output::bytes)
        .sum();
    let (mut done, mut job_index, mut weight_map) = (0u64, 0usize, BTreeMap::new());
    for shard in 0..shards {
        let first = job_index;
        while job_index < jobs.len() && shard_of_job[job_index] == shard {
            job_index += 1;
        }
        let shard_jobs = &jobs[first..job_index];
        let path = out.join(file_name(shard));
        let mut file = BufWriter::new(
            File::create(&path).with_context(|| format!("cannot create {}", path.display()))?,
        );
        write_header(&mut file, shard_jobs)?;
        for job in shard_jobs {
            for (output, bytes) in job.outputs.iter().zip(run(job, &mut ckpt)?) {
                ensure!(
                    bytes.len() as u64 == output.bytes(),
                    "internal error: {} came out as {} bytes, planned {}",
                    output.name,
                    bytes.len(),
                    output.bytes()
                );
                file.write_all(&bytes)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                done += bytes.len() as u64;
                weight_map.insert(output.name.clone(), file_name(shard));
            }
            progress(done, total);
        }
        file.flush()
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Box::new(ckpt).finish()?;

    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_json(&out.join("model.safetensors.index.json"), &index)?;
    write_json(&out.join("config.json"), &mlx_config(src, &jobs)?)?;
    copy_other_files(src, out)?;
    Ok(WriteSummary {
        tensors: weight_map.len(),
        shards,
        bytes: total,
    })
}

/// The header of one shard: every tensor of its jobs, in the order they are written.
fn write_header(file: &mut impl Write, jobs: &[Job]) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut offset = 0u64;
    for output in jobs.iter().flat_map(|j| &j.outputs) {
        let end = offset + output.bytes();
        let dtype = match output.dtype {
            Dtype::U32 => "U32",
            Dtype::BF16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            other => bail!("cannot write dtype {other:?}"),
        };
        header.insert(
            output.name.clone(),
            json!({"dtype": dtype, "shape": output.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut text = Value::Object(header).to_string();
    text.push_str(&" ".repeat((8 - text.len() % 8) % 8));
    file.write_all(&(text.len() as u64).to_le_bytes())?;
    file.write_all(text.as_bytes())?;
    Ok(())
}

/// The source config in mlx-lm's form: the multimodal wrapper (mlx-lm reads no text-only
/// qwen3_5_moe config), no vision config, and the `quantization` block with the 8-bit modules.
fn mlx_config(src: &Path, jobs: &[Job]) -> Result<Value> {
    let path = src.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut root: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    if root.get("text_config").is_none() {
        let tie = root
            .get("tie_word_embeddings")
            .cloned()
            .unwrap_or(json!(false));
        root = json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": root,
            "tie_word_embeddings": tie,
        });
    }
    let map = root
        .as_object_mut()
        .context("config.json must be a JSON object")?;
    map.remove("vision_config");
    let mut quantization = json!({"group_size": DEFAULT_GROUP_SIZE, "bits": 4, "mode": "affine"});
    for job in jobs {
        let Kind::Linears { targets, cols, .. } = &job.kind else {
            continue;
        };
        for target in targets {
            if let Some(bits) = mlx_quant_bits(target, *cols).filter(|&b| b != 4) {
                quantization[mlx_name(target)] =
                    json!({"group_size": DEFAULT_GROUP_SIZE, "bits": bits});
            }
        }
    }
    map.insert("quantization".into(), quantization.clone());
    map.insert("quantization_config".into(), quantization);
    Ok(root)
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}

/// Tokenizer, chat template, generation config and the like travel with the weights.
fn copy_other_files(src: &Path, out: &Path) -> Result<()> {
    for entry in std::fs::read_dir(src).with_context(|| format!("cannot read {}", src.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        let skip = name == "config.json"
            || name == "model.safetensors.index.json"
            || NOT_COPIED.iter().any(|s| name.ends_with(s));
        if !skip && entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), out.join(&name))
                .with_context(|| format!("cannot copy {name} to {}", out.display()))?;
        }
    }
    Ok(())
}
