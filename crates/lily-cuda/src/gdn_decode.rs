//! A Gated DeltaNet layer's decode token between its two projections (kernels/gdn.cu,
//! `gdn_decode_step`): for every row of the step, the causal conv of q|k|v, the L2 norms and
//! gates, the delta rule on the fp32 state and the gated norm, a value head's columns over
//! [`column_blocks`] blocks.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gpu::{Gpu, MAX_ROWS};
use crate::kernel_args::GdnDecodeStep;
use crate::launch;

/// State columns a block holds (GDN_COLS), each over 4 row groups of threads.
fn block_columns(c: &ModelConfig) -> usize {
    c.linear_value_head_dim.min(32)
}

/// Blocks a value head's columns take (GDN_CG).
pub fn column_blocks(c: &ModelConfig) -> usize {
    c.linear_value_head_dim.div_ceil(block_columns(c))
}

/// Words of `arrivals` a step of `rows` rows needs: one a (row, key head), then one a (row,
/// value head); zero before the launch and left zero after it.
pub fn arrival_words(c: &ModelConfig, rows: usize) -> usize {
    rows * (c.linear_num_key_heads + c.linear_num_value_heads)
}

/// Floats of `sumsq` a step of `rows` rows needs: a partial sum of squares a column block.
pub fn sumsq_floats(c: &ModelConfig, rows: usize) -> usize {
    rows * c.linear_num_value_heads * column_blocks(c)
}

/// `args` for the first `rows` rows: proj, o and y row after row, windows and states by row.
pub fn gdn_decode_step(gpu: &Gpu, c: &ModelConfig, rows: usize, args: GdnDecodeStep) -> Result<()> {
    ensure!(
        (1..=MAX_ROWS).contains(&rows),
        "a GDN decode step takes 1 to {MAX_ROWS} rows, not {rows}"
    );
    let threads = (block_columns(c) * 4).div_ceil(32) * 32;
    let grid = (
        c.linear_num_value_heads as u32,
        column_blocks(c) as u32,
        rows as u32,
    );
    launch!(gpu, "gdn_decode_step", grid, threads as u32, args);
    Ok(())
}
