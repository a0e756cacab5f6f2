//! The integer tensor-core kernels of the graph decode step (kernels/gemv_imma.cuh): how a
//! launch spreads its units and how much shared memory it stages, and the launches of the dense
//! 4-bit GEMVs (`gemv_q4_*`, through [`crate::gemv::gemv`]) and of the Gated DeltaNet's fused
//! input and output projections (`gemv_q4_gdn_t*`, `gemv_q4_gated_t*`). The MoE's launches are
//! step.rs's.

use anyhow::{Result, ensure};

use crate::gemv::GemvForm;
use crate::gpu::{Gpu, MAX_ROWS, RowPtrs, Shape};
use crate::kernel_args::{GemvQ4Add, GemvQ4Gated, GemvQ4Gdn, GemvQ4Norm};
use crate::mat::{DeviceMat, MatArg};

/// Inputs of a slab (gemv_imma.cuh, IMMA_SLAB): a group's scale covers whole slabs.
pub const IMMA_SLAB: usize = 64;
/// Slabs of a quad (gemv_imma.cuh, IMMA_QUAD): what a lane requests at a time, and the grain of a split.
const IMMA_QUAD: usize = 4;
/// The most warps a q4 GEMV block has (the kernels' `IMMA_WARPS`, a -D constant): eight of at most
/// 128 registers are half an SM's, so the next kernel's block can be resident beside one and
/// request its weights while it runs.
pub const IMMA_WARPS: usize = 8;

/// Tiles of 8 x-part columns the q4 GEMVs take for `rows` rows (four parts a row, two rows a
/// tile): kernels are compiled for 1, 2 and 4.
pub fn imma_tiles(rows: usize) -> usize {
    rows.div_ceil(2).next_power_of_two()
}

/// Dynamic shared memory of `gemv_q4_*_t{tiles}` for `cols` inputs (gemv_imma.cuh): per slab of 64
/// inputs its staged parts (`tiles` × 8 columns × 64 bytes) and each row's two factor-and-sum
/// pairs, then the split's partial sums (two buffers of `IMMA_WARPS` × `tiles` × 32 lanes × 8
/// bytes) and the norm's scratch (a float a row and warp).
pub fn imma_shared_bytes(cols: usize, tiles: usize) -> usize {
    let slabs = cols / IMMA_SLAB;
    slabs * tiles * 512
        + slabs * 2 * tiles * 2 * 8
        + 2 * IMMA_WARPS * tiles * 32 * 8
        + 2 * tiles * IMMA_WARPS * 4
}

/// How a q4 launch spreads its 16-row units: with `split` 1, blocks of `warps` whose warps take
/// whole units in turn; with `split` > 1 (a power of two chosen by the matrices' shape and the
/// GPU, never by the row count, so that a row's sums run in one order in every launch), a block
/// of `split` warps a unit, each a share of its quads. `blocks` of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImmaPlan {
    pub split: usize,
    pub warps: usize,
    pub blocks: usize,
}

/// The plan for `units` units of `cols` inputs on `sms` SMs: K split as far as the units leave
/// warps for it (a warp keeps at least a quad), blocks sized so that every SM gets work, at most
/// one block of [`IMMA_WARPS`] an SM where the next kernel should fit beside it, and two where the
/// launch streams far more units than one wave holds (the lm_head).
pub fn imma_plan(units: usize, cols: usize, sms: usize) -> ImmaPlan {
    let quads = (cols / IMMA_SLAB).div_ceil(IMMA_QUAD);
    let most = sms * IMMA_WARPS;
    let mut split = 1;
    while split * 2 <= IMMA_WARPS && split * 2 <= quads && units * split * 2 <= most {
        split *= 2;
    }
    if split > 1 {
        return ImmaPlan {
            split,
            warps: split,
            blocks: units,
        };
    }
    let warps = units.div_ceil(sms).clamp(1, IMMA_WARPS);
    let per_sm = if units >= 2 * most { 2 } else { 1 };
    ImmaPlan {
        split,
        warps,
        blocks: units.div_ceil(warps).min(per_sm * sms),
    }
}

/// The launch of a plan: its blocks of `warps` warps.
fn plan_shape(plan: ImmaPlan) -> Shape {
    Shape {
        grid: (plan.blocks as u32, 1, 1),
        block: 32 * plan.warps as u32,
    }
}

/// `y[n] (= or +=) [m0 | m1 | ...] · x[n]` for each of `rows` rows on the integer tensor cores
/// (`gemv_q4_{norm,add}_t*`): the matrices' `mats`, `units` 16-row units of `cols` inputs.
pub(crate) fn gemv_q4(
    gpu: &Gpu,
    form: GemvForm,
    (mats, units, cols): ([MatArg; 4], usize, usize),
    rows: usize,
    x: u64,
    y: u64,
) -> Result<()> {
    let plan = imma_plan(units, cols, gpu.sms as usize);
    let tiles = imma_tiles(rows);
    let (nx, split, shared) = (
        rows as i32,
        plan.split as i32,
        imma_shared_bytes(cols, tiles) as u32,
    );
    let shape = plan_shape(plan);
    match form {
        GemvForm::Add => {
            let a = GemvQ4Add {
                mats,
                nx,
                x,
                y,
                split,
            };
            gpu.launch_shared(&format!("gemv_q4_add_t{tiles}"), shape, shared, &a)
        }
        GemvForm::Norm(norm_w, eps) => {
            let a = GemvQ4Norm {
                mats,
                nx,
                hidden: x,
                norm_w,
                eps,
                y,
                split,
            };
            gpu.launch_shared(&format!("gemv_q4_norm_t{tiles}"), shape, shared, &a)
        }
    }
}

/// The Gated DeltaNet's output before its projection: `o` (value heads end to end), the proj rows
/// holding z, the gated norm's weights.
#[derive(Clone, Copy)]
pub struct GatedInput {
    pub o: u64,
    pub proj: u64,
    pub norm_w: u64,
    pub eps: f32,
}

/// `y[n] += m · (RMSNorm(o[n]) · w · silu(z[n]))` per value head for each of `rows` rows, one
/// launch (where the graph step's route is [`crate::gemv::GemvRoute::Imma`] and value heads are
/// whole slabs).
pub fn gemv_gated(gpu: &Gpu, m: &DeviceMat, rows: usize, input: GatedInput, y: u64) -> Result<()> {
    ensure!(
        (1..=MAX_ROWS).contains(&rows),
        "a GEMV takes 1 to {MAX_ROWS} rows, not {rows}"
    );
    let plan = imma_plan(m.rows.div_ceil(16), m.cols, gpu.sms as usize);
    let tiles = imma_tiles(rows);
    let shape = plan_shape(plan);
    let a = GemvQ4Gated {
        m: m.arg(gpu),
        nx: rows as i32,
        o: input.o,
        proj: input.proj,
        norm_w: input.norm_w,
        eps: input.eps,
        y,
        split: plan.split as i32,
    };
    let shared = imma_shared_bytes(m.cols, tiles) as u32;
    gpu.launch_shared(&format!("gemv_q4_gated_t{tiles}"), shape, shared, &a)
}

/// The Gated DeltaNet's causal conv as the input projection's outputs leave it: each sequence's
/// conv window, the conv's weights, and where the q|k|v channels go after the conv and SiLU.
#[derive(Clone, Copy)]
pub struct ConvOutput {
    pub conv_w: u64,
    pub window: RowPtrs,
    pub conv: u64,
}

/// The Gated DeltaNet's input projection `[m0 | m1 | ...] · RMSNorm(hidden[n]) · norm_w` for each
/// of `rows` rows with the causal conv fused into its stores: q|k|v channels through the conv
/// into `out.conv`, the rest into `proj` (one launch, where the graph step's route is
/// [`crate::gemv::GemvRoute::Imma`]).
pub fn gemv_gdn_in(
    gpu: &Gpu,
    mats: &[&DeviceMat; 4],
    rows: usize,
    (hidden, norm_w, eps): (u64, u64, f32),
    proj: u64,
    out: ConvOutput,
) -> Result<()> {
    ensure!(
        (1..=MAX_ROWS).contains(&rows),
        "a GEMV takes 1 to {MAX_ROWS} rows, not {rows}"
    );
    let m = mats[0];
    let units: usize = mats.iter().map(|m| m.rows.div_ceil(16)).sum();
    let plan = imma_plan(units, m.cols, gpu.sms as usize);
    let tiles = imma_tiles(rows);
    let shape = plan_shape(plan);
    let a = GemvQ4Gdn {
        mats: mats.map(|m| m.arg(gpu)),
        nx: rows as i32,
        hidden,
        norm_w,
        eps,
        proj,
        conv_w: out.conv_w,
        window: out.window,
        conv: out.conv,
        split: plan.split as i32,
    };
    let shared = imma_shared_bytes(m.cols, tiles) as u32;
    gpu.launch_shared(&format!("gemv_q4_gdn_t{tiles}"), shape, shared, &a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_staged_input_and_the_partial_sums_take_what_the_kernels_lay_out() {
        // 64 slabs of 4 tiles' parts (2,048 bytes) and factors (128), the partial sums, the norm's.
        assert_eq!(imma_shared_bytes(4096, 4), 64 * 2176 + 16384 + 256);
        assert_eq!(imma_shared_bytes(4096, 1), 64 * 544 + 4096 + 64);
        assert_eq!([1, 2, 3, 4, 5, 8].map(imma_tiles), [1, 1, 2, 2, 4, 4]);
    }

    /// The real model's launches on an H200's 132 SMs.
    #[test]
    fn q4_launches_split_k_only_where_units_leave_warps_idle() {
        let plan = |units, cols| {
            let p = imma_plan(units, cols, 132);
            (p.split, p.warps, p.blocks)
        };
        // The GDN input projection: 772 units, a warp each, six a block on 129 SMs.
        assert_eq!(plan(772, 2048), (1, 6, 129));
        // The attention input: 576 units, five warps a block.
        assert_eq!(plan(576, 2048), (1, 5, 116));
        // The output projections (K = 4,096): 128 units of eight warps, two quads a warp.
        assert_eq!(plan(128, 4096), (8, 8, 128));
        // The lm_head: two blocks of eight warps an SM striding over 15,520 units.
        assert_eq!(plan(15_520, 2048), (1, 8, 264));
        // A split never leaves a warp without a quad of its row.
        assert_eq!(plan(17, 2048), (8, 8, 17));
        assert_eq!(plan(3, 256), (1, 1, 3));
        assert_eq!(plan(3, 512), (2, 2, 3));
        assert_eq!(plan(1, 64), (1, 1, 1));
        // Blocks of a split are a unit each, the split as deep as eight warps an SM allow.
        assert_eq!(plan(133, 2048), (4, 4, 133));
        // A warp a unit or more: every SM has a block, two past two waves of units.
        assert_eq!(plan(1056, 2048), (1, 8, 132));
        assert_eq!(plan(2111, 2048), (1, 8, 132));
        assert_eq!(plan(2112, 2048), (1, 8, 264));
    }
}
