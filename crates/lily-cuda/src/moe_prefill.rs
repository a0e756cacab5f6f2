//! Launchers for kernels/moe_prefill.cu: the mixture of experts of a prefill chunk around the
//! grouped expert GEMMs. Routing picks TOPK experts per token (pair p = t·TOPK + k), the sort
//! orders the pairs by expert into "slots" and cuts them into tiles of at most one `MoeTile`
//! height, and the combine sums each token's weighted expert rows with its gated shared expert.
//! Buffers are raw device addresses; the caller sizes them as each launcher says.

use anyhow::{Context, Result, ensure};

use crate::gemm::{GemmX, Parts};
use crate::gemm_wgmma::GemmPath;
use crate::gpu::Gpu;
use crate::kernel_args::{
    MoeCombine, MoeDenseTiles, MoeSortCount, MoeSortOffsets, MoeSortScatter, MoeSwiglu, MoeTopkRows,
};
use crate::launch;

/// Token rows a `moe_topk_rows` block routes: one warp each.
const TOPK_ROWS_PER_BLOCK: usize = 4;
/// `moe_sort_offsets` is one block of this many threads (`SORT_THREADS` in the kernel).
const SORT_THREADS: u32 = 1024;
/// Threads of a `moe_sort_count` / `moe_sort_scatter` block, and the pairs it takes
/// (`SORT_GRID_THREADS`, `SORT_GRID_PAIRS`).
const SORT_GRID_THREADS: u32 = 256;
const SORT_GRID_PAIRS: usize = 1024;

/// Ints of the sort's per-block counts for `pairs` pairs over `experts` experts
/// (`[⌈pairs / 1,024⌉, experts]`).
pub fn sort_counts(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(SORT_GRID_PAIRS) * experts
}
const ELEMENTWISE_BLOCK: usize = 256;
/// Enough `moe_swiglu` blocks to fill any GPU several times over; larger inputs stride.
const SWIGLU_MAX_BLOCKS: usize = 8192;
const COMBINE_BLOCK: u32 = 256;

/// The average rows per expert (`tokens · top_k / experts`) from which a chunk's experts are cut
/// into 64-row tiles rather than 16-row ones. Measured on the H200 at the production shapes
/// (`grouped_gemm_speed_by_tokens`, a layer's expert GEMMs, mma.sync, d4f45b1): 16-row tiles win at 4 and 8
/// rows an expert (0.38 against 0.50 ms, 0.39 against 0.51), 64-row ones from 16 on (0.52 against
/// 0.56 ms, and 0.56 against 0.92 at 32), where the 16-row tiles' repeated weight loads and
/// dequantisation cost more than the padding they save.
pub const ROWS64_FROM_ROWS_PER_EXPERT: usize = 16;

/// The height of an expert tile: `sort` cuts each expert's slots into tiles of this many rows at
/// most, and the grouped GEMM (gemm.cu) runs the entry of the same height, one tile per block row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeTile {
    Rows16,
    Rows64,
}

impl MoeTile {
    pub const ALL: [MoeTile; 2] = [MoeTile::Rows16, MoeTile::Rows64];

    pub const fn rows(self) -> usize {
        match self {
            MoeTile::Rows16 => 16,
            MoeTile::Rows64 => 64,
        }
    }

    /// The height for a chunk of `tokens` tokens that each choose `top_k` of `experts` experts,
    /// the 64-row tiles running on `tall_path`. Only the average rows per expert decides: the
    /// counts themselves are known only on the device, after routing, and the host enqueues the
    /// whole chunk before any of it runs. On the wgmma path 64-row tiles win at every length
    /// (H200, `grouped_gemm_speed_by_tokens`: a layer's expert GEMMs 0.372 / 0.380 ms at 4 / 8
    /// rows an expert against 0.384 / 0.394 with 16-row tiles on mma.sync).
    pub fn for_chunk(tokens: usize, top_k: usize, experts: usize, tall_path: GemmPath) -> MoeTile {
        if tall_path == GemmPath::MmaSync && tokens * top_k < ROWS64_FROM_ROWS_PER_EXPERT * experts
        {
            MoeTile::Rows16
        } else {
            MoeTile::Rows64
        }
    }
}

/// An upper bound on the tiles `sort` writes for `pairs` pairs over `experts` experts at
/// `height` (h rows): Σ_e ceil(count_e / h) ≤ Σ_e (floor(count_e / h) + 1) ≤ pairs / h + experts,
/// and no more tiles than pairs (each holds at least one), which bounds short chunks: the grouped
/// grid has a block row per possible tile. The shorter the tiles, the more of them. The tile
/// buffer holds 3 ints per tile.
pub fn max_tiles(pairs: usize, experts: usize, height: MoeTile) -> usize {
    (pairs / height.rows() + experts).min(pairs)
}

/// The expert tiles of a chunk on the device, as `sort` writes them and the grouped GEMMs
/// (`gemm_grouped::gemm_grouped`) read them: `tiles` i32 [3 · max_tiles] holds `{expert, first slot,
/// rows (1..=height)}` per tile and `num_tiles` (one i32) how many are live. Sorting and the
/// GEMMs take the same map, so they cannot disagree on the height.
#[derive(Clone, Copy, Debug)]
pub struct TileMap {
    pub tiles: u64,
    pub num_tiles: u64,
    pub height: MoeTile,
    /// The tiles `tiles` has room for, and the rows of the grouped GEMMs' grid: at least
    /// `max_tiles(pairs, experts, height)`.
    pub max_tiles: usize,
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
    let args = MoeTopkRows {
        logits,
        t: int(t, "tokens")?,
        ids,
        weights,
    };
    launch!(gpu, "moe_topk_rows", (blocks, 1, 1), block, args);
    Ok(())
}

/// Sorts `pairs` (= t·TOPK) routed pairs by expert. `ids` i32 [pairs] → `gather` i32 [pairs]
/// (the token of each slot), `slot_of` i32 [pairs] (the slot of each pair) and the tiles of
/// `map`, cut at its height (its `max_tiles` at least `max_tiles(pairs, NE, map.height)`), over
/// a block per 1,024 pairs; `counts` holds [`sort_counts`] ints.
pub fn sort(
    gpu: &Gpu,
    ids: u64,
    pairs: usize,
    gather: u64,
    slot_of: u64,
    counts: u64,
    map: &TileMap,
) -> Result<()> {
    let tile_rows = int(map.height.rows(), "tile rows")?;
    let pairs_arg = int(pairs, "routed pairs")?;
    let blocks = pairs.div_ceil(SORT_GRID_PAIRS);
    if blocks > 0 {
        let args = MoeSortCount {
            ids,
            pairs: pairs_arg,
            counts,
        };
        launch!(
            gpu,
            "moe_sort_count",
            (blocks as u32, 1, 1),
            SORT_GRID_THREADS,
            args
        );
    }
    // Even with no pairs the offsets run, so that num_tiles says 0.
    let args = MoeSortOffsets {
        counts,
        blocks: int(blocks, "sort blocks")?,
        tile_rows,
        tiles: map.tiles,
        num_tiles: map.num_tiles,
    };
    launch!(gpu, "moe_sort_offsets", (1, 1, 1), SORT_THREADS, args);
    if blocks > 0 {
        let args = MoeSortScatter {
            ids,
            pairs: pairs_arg,
            offsets: counts,
            gather,
            slot_of,
        };
        launch!(
            gpu,
            "moe_sort_scatter",
            (blocks as u32, 1, 1),
            SORT_GRID_THREADS,
            args
        );
    }
    Ok(())
}

/// The tiles of `t` rows that are not routed (all rows, in order, as one expert 0 with no
/// gather) into `map`, for the grouped GEMMs: how the shared expert runs through the fused
/// gate/up launch.
pub fn dense_tiles(gpu: &Gpu, t: usize, map: &TileMap) -> Result<()> {
    let rows = map.height.rows();
    ensure!(
        t.div_ceil(rows) <= map.max_tiles,
        "{t} rows need more than the map's {} tiles of {rows}",
        map.max_tiles
    );
    let args = MoeDenseTiles {
        t: int(t, "rows")?,
        tile_rows: int(rows, "tile rows")?,
        tiles: map.tiles,
        num_tiles: map.num_tiles,
    };
    let blocks = t.div_ceil(rows).div_ceil(ELEMENTWISE_BLOCK).max(1) as u32;
    launch!(
        gpu,
        "moe_dense_tiles",
        (blocks, 1, 1),
        ELEMENTWISE_BLOCK as u32,
        args
    );
    Ok(())
}

/// `act[i] = silu(gate[i]) · up[i]` for i < n (f32 buffers of n elements), into `act.f32` and,
/// rounded to bf16, into `act.bf16` where given: the down projection's X (`GemmX`).
pub fn swiglu(gpu: &Gpu, gate: u64, up: u64, n: usize, act: impl Into<GemmX>) -> Result<()> {
    let act = act.into();
    if n == 0 {
        return Ok(());
    }
    let blocks = n.div_ceil(ELEMENTWISE_BLOCK).min(SWIGLU_MAX_BLOCKS) as u32;
    let args = MoeSwiglu {
        gate,
        up,
        n: int(n, "elements")?,
        act: act.f32,
        act16: act.bf16.unwrap_or(0),
    };
    launch!(
        gpu,
        "moe_swiglu",
        (blocks, 1, 1),
        ELEMENTWISE_BLOCK as u32,
        args
    );
    Ok(())
}

/// `out[t, :] = Σ_k weights[t, k] · down[slot_of[t, k], :] + σ(logits[t, NE]) · shared[t, :]`
/// for `t` tokens of width `h`: `down` f32 [t·TOPK, h] in slot order, `slot_of` and `weights`
/// [t, TOPK], `logits` [t, NE + 1], `shared` (its down projection's parts) and `out` f32 [t, h].
/// No residual add.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    gpu: &Gpu,
    down: u64,
    slot_of: u64,
    weights: u64,
    logits: u64,
    shared: impl Into<Parts>,
    t: usize,
    h: usize,
    out: u64,
) -> Result<()> {
    if t == 0 {
        return Ok(());
    }
    let shared = shared.into();
    let (shared_parts, shared_stride) = shared.ints()?;
    let blocks = int(t, "tokens")? as u32;
    let args = MoeCombine {
        down,
        slot_of,
        weights,
        logits,
        shared: shared.at,
        shared_parts,
        shared_stride,
        h: int(h, "hidden width")?,
        out,
    };
    launch!(gpu, "moe_combine", (blocks, 1, 1), COMBINE_BLOCK, args);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles of each expert's count at `height`, as `sort` cuts them.
    fn tiles(counts: &[usize], height: MoeTile) -> usize {
        counts.iter().map(|c| c.div_ceil(height.rows())).sum()
    }

    #[test]
    fn max_tiles_bounds_every_split_of_the_pairs() {
        let experts = 8;
        for height in MoeTile::ALL {
            let h = height.rows();
            // Worst case: every expert one row past a whole tile, where the bound is reached.
            let past = [h + 1; 8];
            let pairs: usize = past.iter().sum();
            assert_eq!(tiles(&past, height), max_tiles(pairs, experts, height));
            // Single rows on distinct experts: a tile each, the bound is the pair count.
            let singles = [1, 1, 1, 0, 0, 0, 0, 0];
            assert_eq!(tiles(&singles, height), max_tiles(3, experts, height));
            // Empty experts, every pair on one expert, whole tiles, ragged counts.
            let splits: [&[usize]; 5] = [
                &[0, 0, 0, 0, 0, 0, 0, 1],
                &[1000, 0, 0, 0, 0, 0, 0, 0],
                &[h, 2 * h, 0, 3 * h, 0, 0, h, 0],
                &[h - 1, h, h + 1, 1, 0, 7, 2 * h + 3, 33],
                &[0; 8],
            ];
            for counts in splits {
                let pairs: usize = counts.iter().sum();
                assert!(
                    tiles(counts, height) <= max_tiles(pairs, experts, height),
                    "{height:?}: {counts:?}"
                );
            }
        }
    }

    #[test]
    fn the_height_follows_the_average_rows_per_expert() {
        for (top_k, experts) in [(8, 256), (4, 16)] {
            // The fewest tokens whose pairs average the threshold's rows per expert.
            let first_tall = ROWS64_FROM_ROWS_PER_EXPERT * experts / top_k;
            let height = |tokens| MoeTile::for_chunk(tokens, top_k, experts, GemmPath::MmaSync);
            assert_eq!(height(1), MoeTile::Rows16);
            assert_eq!(
                height(first_tall - 1),
                MoeTile::Rows16,
                "{top_k} of {experts}"
            );
            assert_eq!(height(first_tall), MoeTile::Rows64, "{top_k} of {experts}");
            assert_eq!(height(4096), MoeTile::Rows64);
            for tokens in [1, first_tall - 1, first_tall, 4096] {
                let on_wgmma = MoeTile::for_chunk(tokens, top_k, experts, GemmPath::Wgmma);
                assert_eq!(on_wgmma, MoeTile::Rows64, "{tokens} tokens");
            }
        }
    }
}
