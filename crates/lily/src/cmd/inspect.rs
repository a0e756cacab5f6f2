//! `lily inspect`: what a model is (config, format, parameters, bytes on disk) and the memory
//! it needs on each backend at `--max-seq`, checked against each device found.

mod devices;
mod format;

use anyhow::Result;
use lily_core::config::ModelConfig;
use lily_core::model_ref::ModelRef;
use lily_core::plan::{MemoryLayout, MemoryNeed, WeightFormat};
use serde_json::json;

use devices::{BackendKind, DeviceMemory};
use format::CheckpointFormat;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory, synthetic:NAME, or ORG/NAME[@REVISION] from the Hub cache.
    #[arg(long)]
    model: String,
    /// Context length for the per-sequence memory figures.
    #[arg(long, default_value_t = 32_768)]
    max_seq: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// How each backend holds a model: the one place to change when a backend changes what it
/// stores. MLX-quantised checkpoints stay in their format on every backend (design.md).
fn backend_layout(
    config: &ModelConfig,
    backend: BackendKind,
    quantised: Option<WeightFormat>,
) -> MemoryLayout {
    match backend {
        // Dense checkpoints are widened to f32; KV and state are f32.
        // Scratch is left out: it is small next to f32 weights.
        BackendKind::Cpu => MemoryLayout {
            weights: quantised.unwrap_or(WeightFormat::F32),
            kv_elem_bytes: 4,
            conv_elem_bytes: 4,
            scratch_bytes: 0,
        },
        // bf16 checkpoints are quantised to MLX 4-bit at load; bf16 KV; scratch is what the
        // backend allocates for its default prefill chunk and the decode step.
        BackendKind::Cuda => MemoryLayout {
            weights: quantised.unwrap_or(WeightFormat::MLX_Q4),
            kv_elem_bytes: 2,
            conv_elem_bytes: 4,
            scratch_bytes: lily_cuda::activation_bytes(config, &lily_cuda::CudaOptions::default())
                as u64,
        },
    }
}

pub fn run(args: Args) -> Result<()> {
    let model = crate::cmd::pull::resolve_model(&args.model)?;
    // Only the config and (for a directory) the file headers are read: nothing is allocated.
    let config = model.config()?;
    let format = match &model {
        ModelRef::Dir(dir) => Some(CheckpointFormat::read(dir)?),
        ModelRef::Synthetic(_) => None,
    };
    // Synthetic weights are made directly in the runtime format, MLX 4-bit.
    let quantised = match &format {
        Some(f) => f.quantised_format(),
        None => Some(WeightFormat::MLX_Q4),
    };
    let (devices, gpu_note) = devices::detect();
    // A Hub repository is named as given, with the snapshot it resolved to.
    let name = match model.display_name() {
        shown if shown == args.model => shown,
        shown => format!("{} ({shown})", args.model),
    };
    let report = Report {
        name,
        config: &config,
        format,
        quantised,
        max_seq: args.max_seq,
        devices,
        gpu_note,
    };
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

struct Report<'a> {
    name: String,
    config: &'a ModelConfig,
    format: Option<CheckpointFormat>,
    /// The weights' format when it is MLX-quantised (kept as is by every backend).
    quantised: Option<WeightFormat>,
    max_seq: usize,
    devices: Vec<DeviceMemory>,
    gpu_note: Option<String>,
}

/// What one device can do with the model.
struct Fit {
    need: MemoryNeed,
    fits: bool,
    longest_context: Option<usize>,
}

const BACKENDS: [BackendKind; 2] = [BackendKind::Cpu, BackendKind::Cuda];

/// Bytes in decimal units, with three significant figures or more.
fn gb(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        1_000_000_000.. => format!("{:.2} GB", b / 1e9),
        1_000_000.. => format!("{:.1} MB", b / 1e6),
        1_000.. => format!("{:.1} kB", b / 1e3),
        _ => format!("{bytes} B"),
    }
}

fn element(bytes: usize) -> &'static str {
    match bytes {
        2 => "bf16",
        4 => "f32",
        _ => "?",
    }
}

impl Report<'_> {
    fn layout(&self, backend: BackendKind) -> MemoryLayout {
        backend_layout(self.config, backend, self.quantised)
    }

    fn need(&self, backend: BackendKind) -> MemoryNeed {
        self.config.memory_need(&self.layout(backend), self.max_seq)
    }

    fn fit(&self, device: &DeviceMemory) -> Fit {
        let layout = self.layout(device.backend);
        let need = self.config.memory_need(&layout, self.max_seq);
        Fit {
            need,
            fits: need.total <= device.available,
            longest_context: self.config.longest_context(&layout, device.available),
        }
    }

    fn format_line(&self) -> String {
        match &self.format {
            Some(f) => format!(
                "{} in {} file{}",
                f.describe(),
                f.files,
                if f.files == 1 { "" } else { "s" }
            ),
            None => "synthetic: MLX 4-bit weights made in place, nothing on disk".to_string(),
        }
    }

    fn text(&self) -> String {
        let c = self.config;
        let params = c.param_count();
        let bytes = c.weight_bytes();
        let mut s = String::new();
        s += &format!("model            {}\n", self.name);
        s += &format!("format           {}\n", self.format_line());
        s += &format!(
            "layers           {} ({} Gated DeltaNet, {} attention), hidden {}, vocab {}\n",
            c.num_layers(),
            c.num_gdn_layers(),
            c.num_attention_layers(),
            c.hidden_size,
            c.vocab_size
        );
        s += &format!(
            "attention        {} heads, {} KV heads, head dim {}, rotary dims {}, theta {}\n",
            c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta
        );
        s += &format!(
            "gated deltanet   {} key heads x {}, {} value heads x {}, conv {}\n",
            c.linear_num_key_heads,
            c.linear_key_head_dim,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
            c.conv_kernel
        );
        s += &format!(
            "moe              {} experts, top {}, intermediate {}, shared {}\n",
            c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.shared_intermediate_size
        );
        s += &format!(
            "parameters       {:.2} B total, {:.2} B active per token, {:.2} B in routed experts\n",
            params.total as f64 / 1e9,
            params.active as f64 / 1e9,
            params.routed_experts as f64 / 1e9
        );
        if let Some(f) = &self.format {
            s += &format!("on disk          {}\n", gb(f.bytes_on_disk));
        }
        s += &format!(
            "weights          {} f32, {} bf16, {} MLX 4-bit ({} read per token)\n",
            gb(bytes.f32),
            gb(bytes.bf16),
            gb(bytes.q4),
            gb(bytes.q4_active)
        );
        s += &format!(
            "per sequence     KV {} B/token in bf16, recurrent state {:.1} MiB (f32), conv \
             state {:.1} MiB (f32)\n",
            c.kv_bytes_per_token(2),
            c.recurrent_state_bytes() as f64 / f64::from(1 << 20),
            c.conv_state_bytes(4) as f64 / f64::from(1 << 20),
        );
        s += &format!("memory needed at --max-seq {}\n", self.max_seq);
        for backend in BACKENDS {
            let layout = self.layout(backend);
            let n = self.need(backend);
            let scratch = if n.scratch > 0 {
                format!(" + {} scratch", gb(n.scratch))
            } else {
                String::new()
            };
            s += &format!(
                "  {:<5} backend  {} {} weights + {} {} KV ({} B/token) + {} state{scratch} \
                 = {}\n",
                backend.name(),
                gb(n.weights),
                layout.weights.label(),
                gb(n.kv),
                element(layout.kv_elem_bytes),
                n.kv_per_token,
                gb(n.state),
                gb(n.total)
            );
        }
        s += "devices\n";
        for d in &self.devices {
            s += &format!("  {}\n", self.device_line(d));
        }
        if let Some(note) = &self.gpu_note {
            s += &format!("  ({note})\n");
        }
        s
    }

    fn device_line(&self, d: &DeviceMemory) -> String {
        let fit = self.fit(d);
        let memory = match d.total {
            Some(total) => format!("{} free of {}", gb(d.available), gb(total)),
            None => format!("{} available", gb(d.available)),
        };
        let verdict = if fit.fits {
            format!("fits ({} needed)", gb(fit.need.total))
        } else {
            format!(
                "does not fit ({} needed, {} short)",
                gb(fit.need.total),
                gb(fit.need.total - d.available)
            )
        };
        let longest = match fit.longest_context {
            Some(n) if n == self.config.max_position_embeddings => {
                format!("longest context {n} tokens (the model's limit)")
            }
            Some(n) => format!("longest context {n} tokens"),
            None => "no context fits: the weights alone do not".to_string(),
        };
        format!(
            "{} {} ({memory}, {} backend): {verdict}; {longest}",
            d.id,
            d.name,
            d.backend.name()
        )
    }

    fn json(&self) -> serde_json::Value {
        let c = self.config;
        let params = c.param_count();
        let bytes = c.weight_bytes();
        let need_json = |n: &MemoryNeed, layout: &MemoryLayout| {
            json!({
                "weights_format": layout.weights.label(),
                "weight_bytes": n.weights,
                "kv_bytes_per_token": n.kv_per_token,
                "kv_bytes": n.kv,
                "state_bytes": n.state,
                "scratch_bytes": n.scratch,
                "total_bytes": n.total,
            })
        };
        let backends: serde_json::Map<String, serde_json::Value> = BACKENDS
            .iter()
            .map(|&b| {
                let value = need_json(&self.need(b), &self.layout(b));
                (b.name().to_string(), value)
            })
            .collect();
        let devices: Vec<serde_json::Value> = self
            .devices
            .iter()
            .map(|d| {
                let fit = self.fit(d);
                json!({
                    "id": d.id,
                    "name": d.name,
                    "backend": d.backend.name(),
                    "available_bytes": d.available,
                    "total_bytes": d.total,
                    "needed_bytes": fit.need.total,
                    "fits": fit.fits,
                    "longest_context": fit.longest_context,
                })
            })
            .collect();
        let format = self.format.as_ref().map(|f| {
            json!({
                "description": f.describe(),
                "files": f.files,
                "dtype_bytes": f.dtype_bytes,
                "quantization": f.quantisation.as_ref().map(|q| json!({
                    "bits": q.bits, "group_size": q.group_size, "mode": q.mode,
                    "overrides_by_bits": q.overrides,
                })),
            })
        });
        json!({
            "model": self.name,
            "format": format,
            "layers": c.num_layers(),
            "gdn_layers": c.num_gdn_layers(),
            "attention_layers": c.num_attention_layers(),
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "num_experts": c.num_experts,
            "experts_per_token": c.experts_per_token,
            "max_position_embeddings": c.max_position_embeddings,
            "parameters": params.total,
            "active_parameters": params.active,
            "bytes_on_disk": self.format.as_ref().map(|f| f.bytes_on_disk),
            "weight_bytes": {"f32": bytes.f32, "bf16": bytes.bf16, "q4": bytes.q4, "q4_per_token": bytes.q4_active},
            "kv_bytes_per_token": {"bf16": c.kv_bytes_per_token(2), "f32": c.kv_bytes_per_token(4)},
            "recurrent_state_bytes": c.recurrent_state_bytes(),
            "state_bytes": c.recurrent_state_bytes() + c.conv_state_bytes(4),
            "max_seq": self.max_seq,
            "backends": backends,
            "devices": devices,
            "gpu_note": self.gpu_note,
        })
    }
}

#[cfg(test)]
mod tests {
    use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};

    use super::*;

    fn device(id: &str, backend: BackendKind, available: u64) -> DeviceMemory {
        DeviceMemory {
            id: id.to_string(),
            name: id.to_string(),
            backend,
            available,
            total: Some(available),
        }
    }

    /// The plan for the full-size model at 32K agrees with perf.md: 19.5 GB of 4-bit weights,
    /// 20 KiB of KV per token, 60 MiB of recurrent state, and a fit on a 24 GB card.
    #[test]
    fn the_full_size_plan_agrees_with_perf_md() {
        let config = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        let report = Report {
            name: "synthetic:qwen3.6-35b-a3b".to_string(),
            config: &config,
            format: None,
            quantised: Some(WeightFormat::MLX_Q4),
            max_seq: 32_768,
            devices: vec![
                device("cuda:0", BackendKind::Cuda, 143_156 << 20),
                device("cuda:1", BackendKind::Cuda, 24 << 30),
                device("cpu", BackendKind::Cpu, 16 << 30),
            ],
            gpu_note: None,
        };
        let json = report.json();
        let gpu = &json["backends"]["cuda"];
        let weights = gpu["weight_bytes"].as_u64().unwrap();
        assert!((weights as f64 / 1e9 - 19.5).abs() < 0.05, "{weights}");
        assert_eq!(gpu["kv_bytes_per_token"], 20_480);
        assert_eq!(gpu["kv_bytes"], 20_480 * 32_768);
        assert_eq!(json["recurrent_state_bytes"], 60 << 20);
        assert_eq!(
            gpu["total_bytes"].as_u64().unwrap(),
            weights
                + 20_480 * 32_768
                + gpu["state_bytes"].as_u64().unwrap()
                + gpu["scratch_bytes"].as_u64().unwrap()
        );
        let devices = json["devices"].as_array().unwrap();
        // The H200 holds the model's whole context; a 24 GB card holds 32K and more; 16 GB of
        // host memory does not hold the 4-bit weights at all.
        assert_eq!(devices[0]["fits"], true);
        assert_eq!(devices[0]["longest_context"], 262_144);
        assert_eq!(devices[1]["fits"], true);
        let longest = devices[1]["longest_context"].as_u64().unwrap();
        assert!((32_768..262_144).contains(&longest), "{longest}");
        assert_eq!(devices[2]["fits"], false);
        assert!(devices[2]["longest_context"].is_null());

        let text = report.text();
        for needle in [
            "19.51 GB MLX 4-bit (group 64) weights + 671.1 MB bf16 KV (20480 B/token)",
            "recurrent state 60.0 MiB",
            "cuda:0 cuda:0 (150.11 GB free of 150.11 GB, cuda backend): fits",
            "the model's limit",
            "cpu cpu (17.18 GB free of 17.18 GB, cpu backend): does not fit",
        ] {
            assert!(text.contains(needle), "{needle:?} not in:\n{text}");
        }
    }

    #[test]
    fn quantised_checkpoints_keep_their_format_and_dense_ones_follow_the_backend() {
        let c = ModelConfig::from_json(lily_core::config::QWEN36_35B_A3B_CONFIG).unwrap();
        let q8 = WeightFormat::Mlx {
            bits: 8,
            group_size: 32,
        };
        assert_eq!(backend_layout(&c, BackendKind::Cpu, Some(q8)).weights, q8);
        assert_eq!(backend_layout(&c, BackendKind::Cuda, Some(q8)).weights, q8);
        assert_eq!(
            backend_layout(&c, BackendKind::Cpu, None).weights,
            WeightFormat::F32
        );
        assert_eq!(
            backend_layout(&c, BackendKind::Cuda, None).weights,
            WeightFormat::MLX_Q4
        );
    }

    /// The CUDA plan counts what the backend allocates: a 4,096-token prefill chunk's activations
    /// of the real model (about 1.3 GB) and the decode reserve.
    #[test]
    fn the_cuda_plan_counts_the_prefill_chunk() {
        let c = ModelConfig::from_json(lily_core::config::QWEN36_35B_A3B_CONFIG).unwrap();
        let scratch = backend_layout(&c, BackendKind::Cuda, None).scratch_bytes;
        assert!((1.3e9..1.8e9).contains(&(scratch as f64)), "{scratch}");
        assert_eq!(backend_layout(&c, BackendKind::Cpu, None).scratch_bytes, 0);
    }
}
