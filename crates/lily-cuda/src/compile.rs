//! Kernels are CUDA C++ compiled at start with NVRTC, specialised for the loaded model: its
//! dimensions become `-D` constants, so loops over heads and head dims unroll and register arrays
//! have fixed sizes. PTX is cached on disk, keyed by the source, the options and the GPU.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use cudarc::nvrtc::{CompileOptions, Ptx};
use lily_core::config::ModelConfig;

use crate::options::DecodeKernels;

/// A kernel file, paired with the Rust module that launches it, and its entry points.
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    /// Device code the file shares with other files (`kernels/*.cuh`), prepended in order.
    pub headers: &'static [&'static str],
    pub entries: &'static [&'static str],
    /// The architecture-specific target the file is written for ("sm_90a": its instructions exist
    /// on that GPU only), or None: any GPU Lily runs on.
    pub only_for: Option<&'static str>,
    /// The decode kernels whose file this is (compiled only where the options select them), or
    /// None: every GPU compiles it.
    pub decode_kernels: Option<DecodeKernels>,
}

impl KernelFile {
    /// The target to compile the file for on a GPU of `arch` ("sm_90"), or None where it cannot
    /// run: an architecture-specific file compiles for its own GPU, with the `a` suffix.
    pub fn target(&self, arch: &str) -> Option<String> {
        match self.only_for {
            None => Some(arch.to_string()),
            Some(specific) => {
                (specific.strip_suffix('a') == Some(arch)).then(|| specific.to_string())
            }
        }
    }
}

pub const KERNEL_FILES: [KernelFile; 17] = [
    KernelFile {
        name: "gemv",
        headers: &[GEMV_STAGED, GEMV_ROWS, GEMV_MMA],
        source: include_str!("kernels/gemv.cu"),
        entries: &[
            "gemv_b4",
            "gemv_b8",
            "gemv_b32",
            "gemv_norm_b4",
            "gemv_norm_b8",
            "gemv_norm_b32",
            "gemv_add_b4",
            "gemv_add_b8",
            "gemv_add_b32",
            "gemv_rows_norm_b4_x2",
            "gemv_rows_norm_b4_x4",
            "gemv_rows_norm_b4_x8",
            "gemv_rows_norm_b8_x2",
            "gemv_rows_norm_b8_x4",
            "gemv_rows_norm_b8_x8",
            "gemv_rows_norm_b32_x2",
            "gemv_rows_norm_b32_x4",
            "gemv_rows_norm_b32_x8",
            "gemv_rows_add_b4_x2",
            "gemv_rows_add_b4_x4",
            "gemv_rows_add_b4_x8",
            "gemv_rows_add_b8_x2",
            "gemv_rows_add_b8_x4",
            "gemv_rows_add_b8_x8",
            "gemv_rows_add_b32_x2",
            "gemv_rows_add_b32_x4",
            "gemv_rows_add_b32_x8",
            "gemv_mma_norm_b4_t1",
            "gemv_mma_norm_b4_t3",
            "gemv_mma_add_b4_t1",
            "gemv_mma_add_b4_t3",
            "embed_b4",
            "embed_b8",
            "embed_b32",
            "embed_rows_b4",
            "embed_rows_b8",
            "embed_rows_b32",
        ],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "norm",
        headers: &[],
        source: include_str!("kernels/norm.cu"),
        entries: &["add_rms_norm"],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "attention",
        headers: &[HEADS, ATTN_DECODE],
        source: include_str!("kernels/attention.cu"),
        entries: &["attn_prep", "attn_split", "attn_combine"],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "gdn",
        headers: &[GDN_DECODE],
        source: include_str!("kernels/gdn.cu"),
        entries: &["gdn_step", "gdn_decode_step"],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "moe",
        headers: &[GEMV_STAGED, ROUTE, MOE_DECODE],
        source: include_str!("kernels/moe.cu"),
        entries: &[
            "moe_route_gate_up_b4_r4",
            "moe_route_gate_up_b4_r8",
            "moe_route_gate_up_b4_r32",
            "moe_route_gate_up_b8_r4",
            "moe_route_gate_up_b8_r8",
            "moe_route_gate_up_b8_r32",
            "moe_route_gate_up_b32_r4",
            "moe_route_gate_up_b32_r8",
            "moe_route_gate_up_b32_r32",
            "moe_down_b4",
            "moe_down_b8",
            "moe_down_b32",
            "moe_down_b4_r1",
            "moe_down_b8_r1",
        ],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "sample",
        headers: &[],
        source: include_str!("kernels/sample.cu"),
        entries: &["argmax_partial", "argmax_final"],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "pick",
        headers: &[],
        source: include_str!("kernels/pick.cu"),
        entries: &[
            "pick_prepare",
            "pick_adjust",
            "pick_top",
            "pick_top_raw",
            "pick_choose",
        ],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "gemm",
        headers: &[],
        source: include_str!("kernels/gemm.cu"),
        entries: &[
            "gemm_b4",
            "gemm_b8",
            "gemm_b32",
            "gemm_reduce",
            "gemm_grouped16_b4",
            "gemm_grouped16_b8",
            "gemm_grouped16_b32",
            "gemm_grouped64_b4",
            "gemm_grouped64_b8",
            "gemm_grouped64_b32",
        ],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "gemm_wgmma",
        headers: &[WGMMA],
        source: include_str!("kernels/gemm_wgmma.cu"),
        entries: &["gemm_wgmma_b4", "gemm_wgmma_grouped64_b4"],
        only_for: Some("sm_90a"),
        decode_kernels: None,
    },
    KernelFile {
        name: "gemm_wgmma_x16",
        headers: &[WGMMA],
        source: include_str!("kernels/gemm_wgmma_x16.cu"),
        entries: &[
            "gemm_wgmma_b4_x16",
            "gemm_wgmma_grouped64_b4_x16",
            "gemm_wgmma_gate_up64_b4_x16",
        ],
        only_for: Some("sm_90a"),
        decode_kernels: None,
    },
    KernelFile {
        name: "moe_prefill",
        headers: &[ROUTE],
        source: include_str!("kernels/moe_prefill.cu"),
        entries: &[
            "moe_topk_rows",
            "moe_sort_count",
            "moe_sort_offsets",
            "moe_sort_scatter",
            "moe_dense_tiles",
            "moe_swiglu",
            "moe_combine",
        ],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "gdn_prefill",
        headers: &[],
        source: include_str!("kernels/gdn_prefill.cu"),
        entries: &[
            "gdn_conv_rows",
            "gdn_scan_prep",
            "gdn_scan",
            "gdn_gated_norm_rows",
        ],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "gdn_chunked",
        headers: &[],
        source: include_str!("kernels/gdn_chunked.cu"),
        entries: &["gdn_chunk_prep", "gdn_chunk_scan"],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "attention_prefill",
        headers: &[HEADS],
        source: include_str!("kernels/attention_prefill.cu"),
        entries: &[
            "attn_prep_rows",
            "attn_prefill_r128_s4",
            "attn_prefill_r128_s2",
            "attn_prefill_r64_s2",
        ],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "synthetic",
        headers: &[],
        source: include_str!("kernels/synthetic.cu"),
        entries: &["synthetic_quant"],
        only_for: None,
        decode_kernels: None,
    },
    KernelFile {
        name: "gemv_imma",
        headers: &[GEMV_STAGED, GDN_DECODE, GEMV_IMMA],
        source: include_str!("kernels/gemv_imma.cu"),
        entries: &[
            "gemv_q4_norm_t1",
            "gemv_q4_norm_t2",
            "gemv_q4_norm_t4",
            "gemv_q4_add_t1",
            "gemv_q4_add_t2",
            "gemv_q4_add_t4",
            "gemv_q4_gated_t1",
            "gemv_q4_gated_t2",
            "gemv_q4_gated_t4",
            "gemv_q4_gdn_t1",
            "gemv_q4_gdn_t2",
            "gemv_q4_gdn_t4",
        ],
        only_for: None,
        decode_kernels: Some(DecodeKernels::Imma),
    },
    KernelFile {
        name: "moe_imma",
        headers: &[GEMV_STAGED, ROUTE, GDN_DECODE, GEMV_IMMA, MOE_IMMA],
        source: include_str!("kernels/moe_imma.cu"),
        entries: &[
            "moe_route_imma_t1",
            "moe_route_imma_t2",
            "moe_route_imma_t4",
            "moe_gate_up_imma",
            "moe_down_imma",
        ],
        only_for: None,
        decode_kernels: Some(DecodeKernels::Imma),
    },
];

const COMMON: &str = include_str!("kernels/common.cuh");
const ROUTE: &str = include_str!("kernels/route.cuh");
const HEADS: &str = include_str!("kernels/heads.cuh");
const GDN_DECODE: &str = include_str!("kernels/gdn_decode.cuh");
const ATTN_DECODE: &str = include_str!("kernels/attn_decode.cuh");
const MOE_DECODE: &str = include_str!("kernels/moe_decode.cuh");
const GEMV_STAGED: &str = include_str!("kernels/gemv_staged.cuh");
const GEMV_ROWS: &str = include_str!("kernels/gemv_rows.cuh");
const GEMV_MMA: &str = include_str!("kernels/gemv_mma.cuh");
const GEMV_IMMA: &str = include_str!("kernels/gemv_imma.cuh");
const MOE_IMMA: &str = include_str!("kernels/moe_imma.cuh");
const GEMV_STREAM: &str = include_str!("kernels/gemv_stream.cuh");
pub(crate) const WGMMA: &str = include_str!("kernels/wgmma.cuh");

/// The persistent decode step. Compiled apart from [`KERNEL_FILES`], once the weights are laid out:
/// their formats are constants of it too (`crate::step_constants`).
pub const DECODE_FILE: KernelFile = KernelFile {
    name: "decode",
    headers: &[
        GEMV_STAGED,
        GEMV_STREAM,
        GDN_DECODE,
        HEADS,
        ATTN_DECODE,
        ROUTE,
        MOE_DECODE,
    ],
    source: include_str!("kernels/decode.cu"),
    entries: &["decode_step", "decode_layout"],
    only_for: None,
    decode_kernels: None,
};

/// The most KV splits decode attention uses (its partial results are sized for this many).
pub const MAX_ATTN_SPLITS: usize = 1024;

/// `attn_combine`'s block: a thread for each of the MAX_ATTN_SPLITS splits' (max, sum) and
/// COMBINE_WARPS (kernels/attention.cu) warps summing their outputs. Any other size leaves
/// splits out.
pub const ATTN_COMBINE_THREADS: u32 = MAX_ATTN_SPLITS as u32;

/// KV splits of decode attention for a sequence that can grow to `max_seq`: about 256 positions
/// a split at the longest context, so a 128K context runs 512 splits per KV head (enough blocks
/// to fill the GPU, each warp walking 64 positions), and never fewer than 64.
pub fn attn_splits(max_seq: usize) -> usize {
    max_seq.div_ceil(256).clamp(64, MAX_ATTN_SPLITS)
}

/// How the KV cache stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPrecision {
    /// 2 bytes an element: the production format (perf.md counts 20 KiB per token).
    Bf16,
    /// 4 bytes: exact against the f32 CPU reference, for tests.
    F32,
}

impl KvPrecision {
    pub fn bytes(self) -> usize {
        match self {
            KvPrecision::Bf16 => 2,
            KvPrecision::F32 => 4,
        }
    }
}

/// The `-D` constants for a model.
pub fn model_defines(c: &ModelConfig, kv: KvPrecision) -> Vec<(String, String)> {
    let d = |k: &str, v: String| (k.to_string(), v);
    vec![
        d("NH", c.num_attention_heads.to_string()),
        d("NKV", c.num_kv_heads.to_string()),
        d("HD", c.head_dim.to_string()),
        d("ROT", c.rotary_dim.to_string()),
        d("ROPE_THETA", format!("{:.1}f", c.rope_theta)),
        d("NK", c.linear_num_key_heads.to_string()),
        d("NV", c.linear_num_value_heads.to_string()),
        d("DK", c.linear_key_head_dim.to_string()),
        d("DV", c.linear_value_head_dim.to_string()),
        d("CONV_K", c.conv_kernel.to_string()),
        d(
            "GDN_GROUPS",
            crate::gdn_decode::gdn_row_groups(c.linear_value_head_dim).to_string(),
        ),
        d("HIDDEN", c.hidden_size.to_string()),
        d("MOE_INTER", c.moe_intermediate_size.to_string()),
        d("SHARED_INTER", c.shared_intermediate_size.to_string()),
        d("NE", c.num_experts.to_string()),
        d("TOPK", c.experts_per_token.to_string()),
        d("NORM_TOPK", (c.norm_topk_prob as u8).to_string()),
        d("KV_F32", ((kv == KvPrecision::F32) as u8).to_string()),
        d("MAX_ATTN_SPLITS", MAX_ATTN_SPLITS.to_string()),
        d("COMBINE_WARPS", (ATTN_COMBINE_THREADS / 32).to_string()),
        d("IMMA_WARPS", crate::gemv_imma::IMMA_WARPS.to_string()),
    ]
}

/// Compiles one kernel file for `arch` (e.g. "sm_90"), using the on-disk cache when it can.
pub fn compile(file: &KernelFile, defines: &[(String, String)], arch: &str) -> Result<Ptx> {
    let name = file.name;
    let mut options: Vec<String> = defines.iter().map(|(k, v)| format!("-D{k}={v}")).collect();
    options.push(format!("--gpu-architecture={arch}"));
    options.push("--std=c++17".to_string());
    let mut full_source = format!("{COMMON}\n");
    for header in file.headers {
        full_source.push_str(header);
        full_source.push('\n');
    }
    full_source.push_str(file.source);
    let cache = cache_path(name, &full_source, &options);
    if let Some(path) = &cache
        && let Ok(text) = std::fs::read_to_string(path)
    {
        return Ok(Ptx::from_src(text));
    }
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!("NVRTC (libnvrtc.so.13) was not found; put CUDA's lib directory on LD_LIBRARY_PATH");
    }
    let opts = CompileOptions {
        options: options.clone(),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&full_source, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow::anyhow!(
                "kernel {name}.cu does not compile:\n{}",
                log.to_string_lossy()
            )
        }
        other => anyhow::anyhow!("kernel {name}.cu: {other}"),
    })?;
    if let Some(path) = cache {
        // A cache that cannot be written costs a recompile next time, nothing else.
        let _ = path.parent().map(std::fs::create_dir_all);
        let _ = std::fs::write(&path, ptx.to_src());
    }
    Ok(ptx)
}

fn cache_path(name: &str, source: &str, options: &[String]) -> Option<PathBuf> {
    let base = std::env::var_os("LILY_KERNEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("lily/kernels"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/lily/kernels"))
        })?;
    let mut h = DefaultHasher::new();
    source.hash(&mut h);
    options.hash(&mut h);
    Some(base.join(format!("{name}-{:016x}.ptx", h.finish())))
}

/// The model's defines, and LILY_STAMPS where the kernels are to stamp their waits (stamps.rs).
pub fn kernel_defines(c: &ModelConfig, kv: KvPrecision, stamps: bool) -> Vec<(String, String)> {
    let mut defines = model_defines(c, kv);
    if stamps {
        defines.push(("LILY_STAMPS".into(), "1".into()));
    }
    defines
}

/// Compiles every kernel file a GPU of `arch` runs, each for its target (`KernelFile::target`):
/// the file, the target and the PTX. Used by the CI check that needs no GPU.
pub fn compile_all(
    c: &ModelConfig,
    kv: KvPrecision,
    arch: &str,
    stamps: bool,
) -> Result<Vec<(&'static KernelFile, String, Ptx)>> {
    let defines = kernel_defines(c, kv, stamps);
    KERNEL_FILES
        .iter()
        .filter_map(|file| file.target(arch).map(|target| (file, target)))
        .map(|(file, target)| {
            compile(file, &defines, &target)
                .map(|p| (file, target.clone(), p))
                .with_context(|| format!("for {target}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::KERNEL_FILES;

    /// Kernels are launched allowed to start before their predecessor ends (gpu.rs), so every
    /// entry point must reach `pdl_wait()` before it touches another kernel's output: directly, or
    /// through one of the shared bodies that call it after requesting only weights, or handing it
    /// to a body that first reads only the kernel's own state (`gdn_step_cols`, `gdn_decode_head`).
    #[test]
    fn every_kernel_waits_for_its_predecessor() {
        const WAITING_BODIES: [&str; 12] = [
            "gemv_staged<",
            "gemv_rows<",
            "gemv_mma<",
            "gemv_imma<",
            "gemv_imma_gated<",
            "gemv_imma_gdn_in<",
            "route_imma<",
            "gate_up_imma(",
            "down_imma(",
            "route_gate_up<",
            "down_combine<",
            "down_row<",
        ];
        for file in &KERNEL_FILES {
            let pieces: Vec<&str> = file.source.split("__global__").skip(1).collect();
            assert!(!pieces.is_empty(), "{}.cu has no kernels", file.name);
            for piece in pieces {
                let body = &piece[piece.find('{').expect("a kernel body")..];
                // The first statement after the block's shared-memory declarations.
                let first = body
                    .split(';')
                    .find(|s| {
                        !s.trim_start_matches(['{', ' ', '\n', '\\'])
                            .starts_with("__shared__")
                    })
                    .unwrap_or_default();
                let waits = first.contains("pdl_wait()")
                    || WAITING_BODIES.iter().any(|b| first.contains(b));
                let name: String = piece.chars().take(80).collect();
                assert!(
                    waits,
                    "{}.cu: kernel does not begin with pdl_wait(): {name}",
                    file.name
                );
            }
        }
    }
}
