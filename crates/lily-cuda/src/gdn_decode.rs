//! A Gated DeltaNet layer's decode token between its two projections (kernels/gdn.cu,
//! `gdn_decode_step`): for every row of the step, the causal conv of q|k|v, the L2 norms and
//! gates, the delta rule on the fp32 state and the gated norm, one block a value head.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gpu::{Gpu, MAX_ROWS};
use crate::kernel_args::GdnDecodeStep;
use crate::launch;

/// Row groups of the kernel's block (GDN_GROUPS): each of a value head's `dv` columns held by
/// that many threads, each with a slice of the state's rows, in at most 1,024 threads (lib.rs
/// refuses `dv` above that).
pub fn gdn_row_groups(dv: usize) -> usize {
    (1024 / dv.max(1)).clamp(1, 4)
}

/// Words of `arrivals` a step of `rows` rows needs: one a (row, key head), zero before the
/// launch and left zero after it.
pub fn arrival_words(c: &ModelConfig, rows: usize) -> usize {
    rows * c.linear_num_key_heads
}

/// `args` for the first `rows` rows: proj and y row after row, windows and states by row.
pub fn gdn_decode_step(gpu: &Gpu, c: &ModelConfig, rows: usize, args: GdnDecodeStep) -> Result<()> {
    ensure!(
        (1..=MAX_ROWS).contains(&rows),
        "a GDN decode step takes 1 to {MAX_ROWS} rows, not {rows}"
    );
    let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
    let threads = (dv * gdn_row_groups(dv)).div_ceil(32) * 32;
    launch!(
        gpu,
        "gdn_decode_step",
        (nv as u32, rows as u32, 1),
        threads as u32,
        args
    );
    Ok(())
}
