//! Launchers for kernels/gdn_prefill.cu: the Gated DeltaNet over a prefill chunk of `t` tokens.
//! Every buffer is a raw device address of f32 values; `proj` is `[t, ld]`, each row the fused
//! projection `[qkv (conv_dim) | z (NV·DV) | b (NV) | a (NV)]`. The conv window and the
//! recurrent state are the decode layouts (`LayerState::GatedDeltaNet`), and after a chunk they
//! hold exactly what `t` decode steps would have left, so chunks and decode steps interleave.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gpu::Gpu;
use crate::launch;

/// Tokens per conv thread (CONV_TT in the kernel file).
const CONV_TOKENS: usize = 16;
/// Threads per conv block.
const CONV_THREADS: usize = 256;
/// Threads per prep block: one warp per q or k head at a time.
const PREP_THREADS: u32 = 256;
/// Warps per scan block (SCAN_WARPS in the kernel file).
const SCAN_WARPS: usize = 4;
/// The CUDA limit on a grid's y dimension, which counts tokens in the gated norm.
const MAX_GRID_Y: usize = 65_535;

/// Lanes that share one state column in the scan (SCAN_LPC in the kernel file): 16, or the
/// largest power of two not above a smaller key head dim.
fn scan_lanes_per_column(dk: usize) -> usize {
    [16, 8, 4, 2].into_iter().find(|&l| dk >= l).unwrap_or(1)
}

/// Floats of the scratch [`scan`] needs for a chunk of `t` tokens: per token the normalised q and
/// k of every key head, and α, β of every value head, `t·(2·NK·DK + 2·NV)`.
pub fn scan_scratch_floats(c: &ModelConfig, t: usize) -> usize {
    t * (2 * c.gdn_key_dim() + 2 * c.linear_num_value_heads)
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

/// Causal depthwise conv + SiLU of the qkv columns of `proj` into `out` (`[t, conv_dim]`),
/// continuing from `window` (`[(conv_kernel − 1), conv_dim]`, oldest row first), which then holds
/// the chunk's last `conv_kernel − 1` pre-conv rows. `t == 0` launches nothing.
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
) -> Result<()> {
    check_chunk(t, ld, c)?;
    if t == 0 {
        return Ok(());
    }
    let grid = (
        c.gdn_conv_dim().div_ceil(CONV_THREADS) as u32,
        t.div_ceil(CONV_TOKENS) as u32,
        1,
    );
    launch!(gpu, "gdn_conv_rows", grid, CONV_THREADS as u32;
        proj, ld as i32, t as i32, conv_w, window, out);
    Ok(())
}

/// The delta rule over the chunk: `out` (`[t, NV·DV]`) gets each token's read-out before the
/// gated norm, and `state` (`[NV, DK, DV]`) ends as after the chunk. `conv` is [`conv_rows`]'
/// output; `prep` is scratch of [`scan_scratch_floats`] floats, 16-byte aligned (any allocation
/// start is), overwritten. Two launches: q/k norms and gates per token, then the scan itself.
/// `t == 0` launches nothing.
#[allow(clippy::too_many_arguments)]
pub fn scan(
    gpu: &Gpu,
    c: &ModelConfig,
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
    launch!(gpu, "gdn_scan_prep", (t as u32, 1, 1), PREP_THREADS;
        conv, proj, ld as i32, t as i32, a_log, dt_bias, prep);
    let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
    let columns_per_block = SCAN_WARPS * 32 / scan_lanes_per_column(c.linear_key_head_dim);
    let grid = (dv.div_ceil(columns_per_block) as u32, nv as u32, 1);
    launch!(gpu, "gdn_scan", grid, (SCAN_WARPS * 32) as u32;
        conv, prep, t as i32, state, out);
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
    y: u64,
    eps: f32,
) -> Result<()> {
    check_chunk(t, ld, c)?;
    if t == 0 {
        return Ok(());
    }
    let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
    let block = (dv.div_ceil(32) * 32).min(1024) as u32;
    launch!(gpu, "gdn_gated_norm_rows", (nv as u32, t as u32, 1), block;
        o, proj, ld as i32, norm, y, eps);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
