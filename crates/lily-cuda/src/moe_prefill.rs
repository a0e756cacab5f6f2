//! Launchers for kernels/moe_prefill.cu: the mixture of experts of a prefill chunk around the
//! grouped expert GEMMs. Routing picks TOPK experts per token (pair p = t·TOPK + k), the sort
//! orders the pairs by expert into "slots" and cuts them into tiles of at most `MOE_TILE` rows,
//! and the combine sums each token's weighted expert rows with its gated shared expert.
//! Buffers are raw device addresses; the caller sizes them as each launcher says.

use anyhow::{Context, Result};

use crate::compile::MOE_TILE;
use crate::gpu::Gpu;
use crate::launch;

/// Token rows a `moe_topk_rows` block routes: one warp each.
const TOPK_ROWS_PER_BLOCK: usize = 4;
/// `moe_sort` is one block of this many threads (`SORT_THREADS` in the kernel).
const SORT_THREADS: u32 = 1024;
const ELEMENTWISE_BLOCK: usize = 256;
/// Enough `moe_swiglu` blocks to fill any GPU several times over; larger inputs stride.
const SWIGLU_MAX_BLOCKS: usize = 8192;
const COMBINE_BLOCK: u32 = 256;

/// An upper bound on the tiles `sort` writes for `pairs` pairs over `experts` experts:
/// Σ_e ceil(count_e / MOE_TILE) ≤ Σ_e (floor(count_e / MOE_TILE) + 1) ≤ pairs / MOE_TILE + experts.
/// The tile buffer holds 3 ints per tile.
pub fn max_tiles(pairs: usize, experts: usize) -> usize {
    pairs / MOE_TILE + experts
}

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).with_context(|| format!("{what} ({v}) does not fit a kernel's int"))
}

/// Routes `t` tokens: `logits` f32 [t, NE + 1] (the router's NE logits, then the shared-expert
/// gate logit) → `ids` i32 and `weights` f32, both [t, TOPK].
pub fn topk_rows(gpu: &Gpu, logits: u64, t: usize, ids: u64, weights: u64) -> Result<()> {
    if t == 0 {
        return Ok(());
    }
    let blocks = t.div_ceil(TOPK_ROWS_PER_BLOCK) as u32;
    let block = (TOPK_ROWS_PER_BLOCK * 32) as u32;
    launch!(gpu, "moe_topk_rows", (blocks, 1, 1), block;
        logits, int(t, "tokens")?, ids, weights);
    Ok(())
}

/// Sorts `pairs` (= t·TOPK) routed pairs by expert. `ids` i32 [pairs] → `gather` i32 [pairs]
/// (the token of each slot), `slot_of` i32 [pairs] (the slot of each pair), `tiles` i32
/// [3 · max_tiles(pairs, NE)] ({expert, first slot, rows} per tile) and `num_tiles` (one i32).
pub fn sort(
    gpu: &Gpu,
    ids: u64,
    pairs: usize,
    gather: u64,
    slot_of: u64,
    tiles: u64,
    num_tiles: u64,
) -> Result<()> {
    // Even with no pairs the kernel runs, so that num_tiles says 0.
    launch!(gpu, "moe_sort", (1, 1, 1), SORT_THREADS;
        ids, int(pairs, "routed pairs")?, gather, slot_of, tiles, num_tiles);
    Ok(())
}

/// `act[i] = silu(gate[i]) · up[i]` for i < n (f32 buffers of n elements).
pub fn swiglu(gpu: &Gpu, gate: u64, up: u64, n: usize, act: u64) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let blocks = n.div_ceil(ELEMENTWISE_BLOCK).min(SWIGLU_MAX_BLOCKS) as u32;
    launch!(gpu, "moe_swiglu", (blocks, 1, 1), ELEMENTWISE_BLOCK as u32;
        gate, up, int(n, "elements")?, act);
    Ok(())
}

/// `out[t, :] = Σ_k weights[t, k] · down[slot_of[t, k], :] + σ(logits[t, NE]) · shared[t, :]`
/// for `t` tokens of width `h`: `down` f32 [t·TOPK, h] in slot order, `slot_of` and `weights`
/// [t, TOPK], `logits` [t, NE + 1], `shared` and `out` f32 [t, h]. No residual add.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    gpu: &Gpu,
    down: u64,
    slot_of: u64,
    weights: u64,
    logits: u64,
    shared: u64,
    t: usize,
    h: usize,
    out: u64,
) -> Result<()> {
    if t == 0 {
        return Ok(());
    }
    let blocks = int(t, "tokens")? as u32;
    launch!(gpu, "moe_combine", (blocks, 1, 1), COMBINE_BLOCK;
        down, slot_of, weights, logits, shared, int(h, "hidden width")?, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tiles_bounds_every_split_of_the_pairs() {
        // Worst cases: every expert one row past a whole tile, or all pairs on one expert.
        let experts = 8;
        let counts = [MOE_TILE + 1; 8];
        let pairs: usize = counts.iter().sum();
        let tiles: usize = counts.iter().map(|c| c.div_ceil(MOE_TILE)).sum();
        assert!(tiles <= max_tiles(pairs, experts));
        assert_eq!(tiles, max_tiles(pairs, experts));
        assert!(1000usize.div_ceil(MOE_TILE) <= max_tiles(1000, experts));
    }
}
