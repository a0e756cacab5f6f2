//! Launchers for kernels/gdn_prefill.cu: the Gated DeltaNet over a prefill chunk of `t` tokens.
//! Every buffer is a raw device address of f32 values; `proj` is `[t, ld]`, each row the fused
//! projection `[qkv (conv_dim) | z (NV·DV) | b (NV) | a (NV)]`. The conv window and the
//! recurrent state are the decode layouts (`LayerState::GatedDeltaNet`), and after a chunk they
//! hold exactly what `t` decode steps would have left, so chunks and decode steps interleave.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gdn_chunked;
use crate::gemm::GemmX;
use crate::gpu::Gpu;
use crate::kernel_args::{GdnConvRows, GdnGatedNormRows, GdnScan, GdnScanPrep};
use crate::launch;

/// Tokens per conv thread (CONV_TT in the kernel file).
const CONV_TOKENS: usize = 16;
/// Threads per conv block.
const CONV_THREADS: usize = 256;
/// Threads per prep block: one warp per q or k head at a time.
const PREP_THREADS: u32 = 256;
/// Warps per scan block (SCAN_WARPS in the kernel file).
const SCAN_WARPS: usize = 4;
/// The CUDA limit on a grid's y dimension, which counts token tiles in the conv; chunks are held
/// below it as a whole.
const MAX_GRID_Y: usize = 65_535;
/// Warps per gated-norm block, one per (token, value head) (GATED_NORM_WARPS in the kernel file).
const GATED_NORM_WARPS: usize = 8;

/// Lanes that share one state column in the scan (SCAN_LPC in the kernel file): 16, or the
/// largest power of two not above a smaller key head dim.
fn scan_lanes_per_column(dk: usize) -> usize {
    [16, 8, 4, 2].into_iter().find(|&l| dk >= l).unwrap_or(1)
}

/// Which kernels run the delta rule over a prefill chunk; both read the same conv rows and
/// `gdn_scan_prep` output and leave the same `o` and state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnPrefillRoute {
    /// `gdn_scan`: token by token, the state in registers (one launch, `t` dependent steps).
    Scan,
    /// `gdn_chunk_prep` + `gdn_chunk_scan`: the chunked (WY) form over 64-token chunks on tensor
    /// cores (3xTF32, about f32 accuracy), `t / 64` dependent steps. Needs DK a multiple of 16,
    /// DV of 8, and 101 KiB of shared memory per block at DK = DV = 128 (the prep's).
    Chunked,
}

/// Chunks shorter than this take the scan even where the chunked route fits. On the H200
/// (`delta_rule_speed_by_length`, production heads; docs/BENCHMARKS.md) the chunked delta rule
/// took 0.053 / 0.061 / 0.077 / 0.235 / 0.912 ms at 64 / 128 / 256 / 1,024 / 4,096 tokens and the
/// scan 0.036 / 0.063 / 0.115 / 0.484 / 1.933: level at 128, the chunked form ahead from 256.
const CHUNKED_FROM_TOKENS: usize = 256;

/// The route for a chunk of `t` tokens on `gpu`: what `LILY_GDN_PREFILL` forces, else the
/// chunked form where the heads and the device's shared memory allow it and the chunk is long
/// enough to gain from it, else the scan.
pub fn route_for(gpu: &Gpu, c: &ModelConfig, t: usize) -> GdnPrefillRoute {
    if let Some(forced) = gpu.gdn_prefill_route {
        return forced;
    }
    if t >= CHUNKED_FROM_TOKENS && gdn_chunked::fits(c, gpu.shared_optin).is_ok() {
        GdnPrefillRoute::Chunked
    } else {
        GdnPrefillRoute::Scan
    }
}

/// Floats of `gdn_scan_prep`'s output for `t` tokens: per token the normalised q and k of every
/// key head, and α, β of every value head, `t·(2·NK·DK + 2·NV)`.
fn prep_floats(c: &ModelConfig, t: usize) -> usize {
    t * (2 * c.gdn_key_dim() + 2 * c.linear_num_value_heads)
}

/// Floats of the scratch a `route` needs for a chunk of `t` tokens: the prep output, and for
/// [`GdnPrefillRoute::Chunked`] after it (from a 16-byte boundary) `gdn_chunk_prep`'s
/// `[NV, ⌈t/64⌉, 64·DK + 2·64² + 2·64]` (32 MiB per 1,024 tokens at the production heads).
pub fn scratch_floats(c: &ModelConfig, t: usize, route: GdnPrefillRoute) -> usize {
    match route {
        GdnPrefillRoute::Scan => prep_floats(c, t),
        GdnPrefillRoute::Chunked => {
            prep_floats(c, t).next_multiple_of(4) + gdn_chunked::scratch_floats(c, t)
        }
    }
}

/// Floats of the scratch [`scan`] needs for a chunk of `t` tokens on any device: the chunked
/// route's (128 MiB at a 4,096-token chunk) wherever [`route_for`] may take it (the memory plan
/// is made before a device is opened), else the scan's.
pub fn scan_scratch_floats(c: &ModelConfig, t: usize, forced: Option<GdnPrefillRoute>) -> usize {
    let chunked = match forced {
        Some(route) => route == GdnPrefillRoute::Chunked,
        None => t >= CHUNKED_FROM_TOKENS && gdn_chunked::fits(c, usize::MAX).is_ok(),
    };
    let route = if chunked {
        GdnPrefillRoute::Chunked
    } else {
        GdnPrefillRoute::Scan
    };
    scratch_floats(c, t, route)
}

fn check_chunk(t: usize, ld: usize, c: &ModelConfig) -> Result<()> {
    let width = c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads;
    ensure!(
        ld >= width && ld <= i32::MAX as usize,
        "GDN projection rows of {ld} floats cannot hold the {width} of [qkv | z | b | a]"
    );
    ensure!(
        t <= MAX_GRID_Y,
        "a GDN chunk of {t} tokens is too large for one launch (at most {MAX_GRID_Y})"
    );
    Ok(())
}

/// A second conv window to leave as it stands after the chunk's first `at` rows (0 < `at` <
/// `t`): a fork of the state inside the chunk.
#[derive(Clone, Copy, Debug)]
pub struct WindowAt {
    pub at: usize,
    pub window: u64,
}

/// Causal depthwise conv + SiLU of the qkv columns of `proj` into `out` (`[t, conv_dim]`),
/// continuing from `window` (`[(conv_kernel − 1), conv_dim]`, oldest row first), which then holds
/// the chunk's last `conv_kernel − 1` pre-conv rows; `fork`'s window gets those before its row.
/// `t == 0` launches nothing.
#[allow(clippy::too_many_arguments)]
pub fn conv_rows(
    gpu: &Gpu,
    c: &ModelConfig,
    proj: u64,
    ld: usize,
    t: usize,
    conv_w: u64,
    window: u64,
    out: u64,
    fork: Option<WindowAt>,
) -> Result<()> {
    check_chunk(t, ld, c)?;
    if let Some(f) = fork {
        ensure!(
            f.at > 0 && f.at < t && f.window != 0,
            "a conv window fork must fall inside the chunk of {t} rows, not after {}",
            f.at
        );
    }
    if t == 0 {
        return Ok(());
    }
    let grid = (
        c.gdn_conv_dim().div_ceil(CONV_THREADS) as u32,
        t.div_ceil(CONV_TOKENS) as u32,
        1,
    );
    let args = GdnConvRows {
        proj,
        ld: ld as i32,
        t: t as i32,
        conv_w,
        window,
        out,
        fork_window: fork.map_or(0, |f| f.window),
        fork_at: fork.map_or(0, |f| f.at as i32),
    };
    launch!(gpu, "gdn_conv_rows", grid, CONV_THREADS as u32, args);
    Ok(())
}

/// The delta rule over the chunk: `out` (`[t, NV·DV]`) gets each token's read-out before the
/// gated norm, and `state` (`[NV, DK, DV]`) ends as after the chunk. `conv` is [`conv_rows`]'
/// output; `prep` is scratch of [`scratch_floats`] of `route` floats, 16-byte aligned (any
/// allocation start is), overwritten. Launches q/k norms and gates per token, then the scan
/// itself (one kernel, or the chunked route's two). `t == 0` launches nothing.
#[allow(clippy::too_many_arguments)]
pub fn scan(
    gpu: &Gpu,
    c: &ModelConfig,
    route: GdnPrefillRoute,
    conv: u64,
    proj: u64,
    ld: usize,
    t: usize,
    a_log: u64,
    dt_bias: u64,
    prep: u64,
    state: u64,
    out: u64,
) -> Result<()> {
    check_chunk(t, ld, c)?;
    ensure!(
        prep.is_multiple_of(16),
        "the GDN scan scratch must be 16-byte aligned"
    );
    if t == 0 {
        return Ok(());
    }
    if route == GdnPrefillRoute::Chunked {
        gdn_chunked::fits(c, gpu.shared_optin)?;
    }
    let args = GdnScanPrep {
        conv,
        proj,
        ld: ld as i32,
        t: t as i32,
        a_log,
        dt_bias,
        prep,
    };
    launch!(gpu, "gdn_scan_prep", (t as u32, 1, 1), PREP_THREADS, args);
    if route == GdnPrefillRoute::Chunked {
        let scratch = prep + 4 * prep_floats(c, t).next_multiple_of(4) as u64;
        return gdn_chunked::delta_rule(gpu, c, conv, prep, scratch, t, state, out);
    }
    let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
    let columns_per_block = SCAN_WARPS * 32 / scan_lanes_per_column(c.linear_key_head_dim);
    let grid = (dv.div_ceil(columns_per_block) as u32, nv as u32, 1);
    let args = GdnScan {
        conv,
        prep,
        t: t as i32,
        state,
        out,
    };
    launch!(gpu, "gdn_scan", grid, (SCAN_WARPS * 32) as u32, args);
    Ok(())
}

/// Gated RMSNorm per (token, value head): `y = rms_norm(o)·norm ⊙ silu(z)`, `o` and `y`
/// `[t, NV·DV]`, z from `proj`. `t == 0` launches nothing.
#[allow(clippy::too_many_arguments)]
pub fn gated_norm_rows(
    gpu: &Gpu,
    c: &ModelConfig,
    o: u64,
    proj: u64,
    ld: usize,
    t: usize,
    norm: u64,
    y: impl Into<GemmX>,
    eps: f32,
) -> Result<()> {
    let y = y.into();
    check_chunk(t, ld, c)?;
    if t == 0 {
        return Ok(());
    }
    let heads = t * c.linear_num_value_heads;
    let args = GdnGatedNormRows {
        o,
        proj,
        ld: ld as i32,
        t: t as i32,
        w: norm,
        y: y.f32,
        y16: y.bf16.unwrap_or(0),
        eps,
    };
    let blocks = heads.div_ceil(GATED_NORM_WARPS) as u32;
    launch!(
        gpu,
        "gdn_gated_norm_rows",
        (blocks, 1, 1),
        (GATED_NORM_WARPS * 32) as u32,
        args
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::config::QWEN36_35B_A3B_CONFIG;

    #[test]
    fn the_chunked_scratch_follows_the_prep_floats() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        // The chunk scratch starts 16-byte aligned after the prep floats and holds
        // ⌈t/64⌉·NV blocks of GDNC_FLOATS.
        for t in [1, 63, 64, 65, 4096] {
            let prep = prep_floats(&c, t);
            let chunks = t.div_ceil(64) * 32;
            assert_eq!(
                scratch_floats(&c, t, GdnPrefillRoute::Chunked),
                prep.next_multiple_of(4) + chunks * (64 * 128 + 2 * 64 * 64 + 2 * 64)
            );
            assert_eq!(scratch_floats(&c, t, GdnPrefillRoute::Scan), prep);
        }
    }

    #[test]
    fn scan_lanes_match_the_kernel_rule() {
        // SCAN_LPC: 16 from DK 16 up, else the largest power of two not above DK.
        for (dk, lanes) in [
            (128, 16),
            (64, 16),
            (24, 16),
            (16, 16),
            (12, 8),
            (8, 8),
            (5, 4),
            (2, 2),
            (1, 1),
        ] {
            assert_eq!(scan_lanes_per_column(dk), lanes, "dk {dk}");
        }
    }

    #[test]
    fn gated_norm_warps_match_the_kernel() {
        let source = crate::gemm_wgmma::tests::file("gdn_prefill").source;
        let warps = crate::gemm_wgmma::tests::define(source, "GATED_NORM_WARPS");
        assert_eq!(GATED_NORM_WARPS, warps);
    }
}
