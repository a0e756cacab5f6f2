//! Launchers for prefill's grouped GEMMs over the experts stacked in one weight, one block row
//! per tile of a [`TileMap`] (kernels/gemm.cu, or gemm_wgmma.cu for 64-row tiles of 4-bit
//! weights on sm_90), and for the routed experts' gate and up projections with the SwiGLU in
//! one launch where the wgmma path takes both. The checks and tilings they share with the dense
//! launchers are gemm.rs's.

use anyhow::{Result, ensure};

use crate::gemm::{
    GEMM_GROUPED_BN, GEMM_THREADS, GemmX, MAX_GRID_Y, check_bf16_rows, check_weight,
    mma_shared_bytes, path_of,
};
use crate::gemm_wgmma::{self, GemmPath, WGMMA_GROUPED_SHARED, WGMMA_GROUPED_X16_SHARED};
use crate::gpu::{Gpu, Shape};
use crate::kernel_args::{GemmGateUp, GemmGrouped};
use crate::mat::DeviceMat;
use crate::moe_prefill::{MoeTile, TileMap};

/// gemm.cu's grouped blocks, one tile high: 34 KiB at 16 rows, 40 KiB at 64.
pub(crate) const fn grouped_shared(height: MoeTile) -> u32 {
    mma_shared_bytes(height.rows(), GEMM_GROUPED_BN)
}

/// gemm.cu's grouped entry for tiles of `height` and `bits`-bit weights (GEMM_GROUPED).
pub(crate) fn grouped_entry(height: MoeTile, bits: u32) -> String {
    format!("gemm_grouped{}_b{bits}", height.rows())
}

/// The grouped GEMM over experts stacked in `w` (`n` rows each), one block row per tile of
/// `map`, by the entry of the map's height (gemm_wgmma.cu's for 64-row tiles on the wgmma path,
/// where it takes `w`); the grid covers `map.max_tiles` tiles, and blocks past the live count
/// return. Sorted slot `s` reads x row `gather[s]` (or `s` when `gather` is
/// 0) of `w.cols` values and writes `y[s, 0..n)`.
pub fn gemm_grouped(
    gpu: &Gpu,
    w: &DeviceMat,
    n: usize,
    x: impl Into<GemmX>,
    gather: u64,
    map: &TileMap,
    y: u64,
) -> Result<()> {
    check_weight(w)?;
    ensure!(
        n > 0 && w.rows.is_multiple_of(n),
        "{} stacked rows do not divide into experts of {n} rows",
        w.rows
    );
    let max_tiles = map.max_tiles;
    if max_tiles == 0 {
        return Ok(());
    }
    ensure!(
        max_tiles <= MAX_GRID_Y,
        "{max_tiles} expert tiles are too many for one GEMM launch"
    );
    let (warg, x) = (w.arg(gpu), x.into());
    check_bf16_rows(x)?;
    let wgmma = map.height == MoeTile::Rows64 && path_of(gpu, w) == GemmPath::Wgmma;
    let (name, shared, x) = match (wgmma, x.bf16) {
        (true, Some(x16)) => (
            gemm_wgmma::GROUPED_X16_ENTRY.to_string(),
            WGMMA_GROUPED_X16_SHARED,
            x16,
        ),
        (true, None) => (
            gemm_wgmma::GROUPED_ENTRY.to_string(),
            WGMMA_GROUPED_SHARED,
            x.f32,
        ),
        (false, _) => (
            grouped_entry(map.height, w.bits),
            grouped_shared(map.height),
            x.f32,
        ),
    };
    ensure!(x != 0, "a GEMM on f32 rows was given only their bf16 copy");
    let grid = (n.div_ceil(GEMM_GROUPED_BN) as u32, max_tiles as u32, 1);
    let args = GemmGrouped {
        w: warg,
        n: n as i32,
        x,
        gather,
        tiles: map.tiles,
        num_tiles: map.num_tiles,
        y,
    };
    let shape = Shape {
        grid,
        block: GEMM_THREADS,
    };
    gpu.launch_shared(&name, shape, shared, &args)?;
    Ok(())
}

/// How prefill runs the routed experts' gate and up projections where [`GateUp::fusable`]
/// allows the choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateUpRoute {
    /// Two grouped GEMMs and `moe_swiglu`: the fused launch's reference, and the route where
    /// the fused one does not apply.
    Split,
    /// One [`gemm_gate_up`] launch, the SwiGLU in its epilogue, act in bf16 only. The default:
    /// a 4K chunk's expert GEMMs 39.6 → 35.2 ms on an H100 (docs/BENCHMARKS.md).
    Fused,
}

/// The routed experts' gate and up projections: two stacks of experts of `n` rows each.
#[derive(Clone, Copy)]
pub struct GateUp<'a> {
    pub gate: &'a DeviceMat,
    pub up: &'a DeviceMat,
    pub n: usize,
}

impl GateUp<'_> {
    /// Whether [`gemm_gate_up`] runs them over tiles of `height`: the wgmma kernels take both,
    /// at 64-row tiles, and they are one shape.
    pub fn fusable(&self, gpu: &Gpu, height: MoeTile) -> bool {
        let (g, u) = (self.gate, self.up);
        height == MoeTile::Rows64
            && path_of(gpu, g) == GemmPath::Wgmma
            && path_of(gpu, u) == GemmPath::Wgmma
            && (g.rows, g.cols, g.group) == (u.rows, u.cols, u.group)
    }
}

/// The experts' gate and up projections and the SwiGLU between them in one launch, where
/// [`GateUp::fusable`] holds: `act[s, j] = silu(x_s · gate_e[j]) · (x_s · up_e[j])` for every
/// slot s of `map` (expert e, x row `gather[s]` of the bf16 rows `x16`) and j < n, rounded to
/// bf16 into `act16` and, unless `act` is 0, in f32 into `act`. The same bits as `gemm_grouped`
/// of gate and of up followed by `moe_prefill::swiglu`.
pub fn gemm_gate_up(
    gpu: &Gpu,
    w: GateUp,
    x16: u64,
    gather: u64,
    map: &TileMap,
    act: u64,
    act16: u64,
) -> Result<()> {
    let GateUp { gate, up, n } = w;
    check_weight(gate)?;
    ensure!(
        w.fusable(gpu, map.height),
        "the fused gate and up projections need the wgmma path, 64-row tiles and weights of one shape"
    );
    ensure!(
        n > 0 && gate.rows.is_multiple_of(n),
        "{} stacked rows do not divide into experts of {n} rows",
        gate.rows
    );
    check_bf16_rows(GemmX {
        f32: 0,
        bf16: Some(x16),
    })?;
    if map.max_tiles == 0 {
        return Ok(());
    }
    ensure!(
        map.max_tiles <= MAX_GRID_Y,
        "{} expert tiles are too many for one GEMM launch",
        map.max_tiles
    );
    let args = GemmGateUp {
        gate: gate.arg(gpu),
        up: up.arg(gpu),
        n: n as i32,
        x: x16,
        gather,
        tiles: map.tiles,
        num_tiles: map.num_tiles,
        act,
        act16,
    };
    // A block takes 128 gate rows and the same 128 up rows.
    let shape = Shape {
        grid: (
            n.div_ceil(GEMM_GROUPED_BN / 2) as u32,
            map.max_tiles as u32,
            1,
        ),
        block: GEMM_THREADS,
    };
    gpu.launch_shared(
        gemm_wgmma::GATE_UP_X16_ENTRY,
        shape,
        WGMMA_GROUPED_X16_SHARED,
        &args,
    )?;
    Ok(())
}
