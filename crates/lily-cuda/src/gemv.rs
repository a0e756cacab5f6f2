//! The decode step's dense GEMVs (kernels/gemv.cu): `y[n] = [m0 | m1 | ...] · x[n]` for each of
//! a step's 1 to [`MAX_ROWS`] rows, one launch for up to four matrices that share their input,
//! with the input norm or the residual add fused in.
//!
//! Two routes, chosen by the matrices' format and width, never by the number of rows, so that a
//! row gets the same bits in any batch as alone:
//! - [`GemvRoute::TensorCores`]: `gemv_q4_*` (gemv_imma.cuh, the integer tensor cores), 4-bit codes
//!   in groups of a multiple of 64 whose staged input fits a block: every matrix of the real model;
//! - [`GemvRoute::Fma`]: f32 FMAs, `gemv_*` for one row and `gemv_rows_*` for several, which give
//!   each row the single-row kernel's bits: other formats, group sizes and widths.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gpu::{Gpu, MAX_ROWS, RowPtrs, Shape};
use crate::kernel_args::{
    GemvAdd, GemvNorm, GemvQ4Add, GemvQ4Gated, GemvQ4Gdn, GemvQ4Norm, GemvRowsAdd, GemvRowsNorm,
    KernelArgs,
};
use crate::mat::{DeviceMat, MatArg, XS_COLS, gemv_shape};

/// What a GEMV launch does with its input and output.
#[derive(Clone, Copy)]
pub enum GemvForm {
    /// `y = W · (RMSNorm(x) · norm)`, x being the residual stream (norm: the device address of
    /// the norm's weights).
    Norm(u64, f32),
    /// `y += W · x`, y being the residual stream.
    Add,
}

/// Which kernels compute a format's GEMVs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvRoute {
    TensorCores,
    Fma,
}

/// Inputs of a slab of the q4 GEMVs (gemv_imma.cuh, IMMA_SLAB): a group's scale covers whole slabs.
const IMMA_SLAB: usize = 64;
/// Slabs of a quad (gemv_imma.cuh, IMMA_QUAD): what a lane requests at a time, and the grain of a split.
const IMMA_QUAD: usize = 4;
/// The most warps a q4 GEMV block has (the kernels' `IMMA_WARPS`, a -D constant): eight of at most
/// 128 registers are half an SM's, so the next kernel's block can be resident beside one and
/// request its weights while it runs.
pub const IMMA_WARPS: usize = 8;

/// The route of matrices of `bits`-bit codes in groups of `group` with `cols` inputs on a device
/// whose blocks can have `shared_optin` bytes of shared memory.
pub fn gemv_route(bits: u32, group: usize, cols: usize, shared_optin: usize) -> GemvRoute {
    if bits == 4
        && group.is_multiple_of(IMMA_SLAB)
        && cols.is_multiple_of(group)
        && imma_shared_bytes(cols, imma_tiles(MAX_ROWS)) <= shared_optin
    {
        GemvRoute::TensorCores
    } else {
        GemvRoute::Fma
    }
}

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

/// The bound on its rows a batched FMA GEMV is compiled for (`gemv_rows_*_x{2,4,8}`).
fn rows_bound(rows: usize) -> usize {
    rows.next_power_of_two().max(2)
}

/// Dynamic shared memory of `gemv_rows_*` for `bound` rows of `cols` inputs (kernels/
/// gemv_rows.cuh): each row's staged x and chunk sums, then its norm scratch and inverse norm.
pub fn rows_shared_bytes(bits: u32, cols: usize, bound: usize) -> usize {
    let per = if bits == 32 { 1 } else { 128 / bits as usize };
    let (xs, xsum) = match bits {
        32 => (cols, 1),
        _ => (cols / per * (per + 4), cols / per),
    };
    4 * bound * (xs + xsum + 32 + 1)
}

/// The widest input a batched GEMV of the model stages: the hidden state, the GDN's gated
/// output or the attention's.
fn widest_input(c: &ModelConfig) -> usize {
    c.hidden_size
        .max(c.gdn_value_dim())
        .max(c.num_attention_heads * c.head_dim)
}

/// The rows a step can take for the model's GEMV formats (bits, group): 8 where every format
/// runs on the tensor cores, else the largest bound whose FMA kernels' shared memory fits a block
/// (1: no batched step).
pub fn step_rows(c: &ModelConfig, formats: &[(u32, usize)], shared_optin: usize) -> usize {
    let widest = widest_input(c);
    [8, 4, 2]
        .into_iter()
        .find(|&n| {
            formats.iter().all(|&(bits, group)| {
                gemv_route(bits, group, widest, shared_optin) == GemvRoute::TensorCores
                    || rows_shared_bytes(bits, widest, n) <= shared_optin
            })
        })
        .unwrap_or(1)
}

/// The shared memory limits to raise at start: all a block can have (each launch asks for what
/// its rows and width need).
pub fn dynamic_shared(shared_optin: usize) -> Vec<(String, u32)> {
    let limit = shared_optin as u32;
    let mut raised: Vec<(String, u32)> = [1, 2, 4]
        .into_iter()
        .flat_map(|t| {
            [
                "gemv_q4_norm",
                "gemv_q4_add",
                "gemv_q4_gated",
                "moe_route_imma",
            ]
            .map(|k| (format!("{k}_t{t}"), limit))
        })
        .collect();
    raised.extend(["moe_gate_up_imma", "moe_down_imma"].map(|k| (k.to_string(), limit)));
    for bits in [4, 8, 32] {
        for bound in [2, 4, 8] {
            for form in ["norm", "add"] {
                raised.push((format!("gemv_rows_{form}_b{bits}_x{bound}"), limit));
            }
        }
    }
    raised
}

/// `y[n] = [m0 | m1 | ...] · x[n]` for each of `rows` rows (x and y row after row) in one of its
/// forms, one launch for matrices that share their input.
pub fn gemv(
    gpu: &Gpu,
    form: GemvForm,
    mats: &[&DeviceMat],
    rows: usize,
    x: u64,
    y: u64,
) -> Result<()> {
    ensure!(
        !mats.is_empty() && mats.len() <= 4,
        "gemv takes 1 to 4 matrices"
    );
    let (bits, cols, group) = (mats[0].bits, mats[0].cols, mats[0].group);
    ensure!(
        mats.iter()
            .all(|m| m.bits == bits && m.cols == cols && m.group == group),
        "matrices launched together must share a format and their input"
    );
    ensure!(
        cols <= XS_COLS,
        "the CUDA GEMV stages at most {XS_COLS} inputs, not {cols}"
    );
    ensure!(
        (1..=MAX_ROWS).contains(&rows),
        "a GEMV takes 1 to {MAX_ROWS} rows, not {rows}"
    );
    let mut args = [MatArg::default(); 4];
    for (a, m) in args.iter_mut().zip(mats) {
        *a = m.arg(gpu);
    }
    let mat_rows: Vec<usize> = mats.iter().map(|m| m.rows).collect();
    let shape = gemv_shape(&mat_rows);
    // The FMA kernels of several rows: `gemv_rows_{form}{suffix}`.
    let rows_launch = |suffix: &str, blocks: (usize, u32), shared: usize| {
        let (nx, mats) = (rows as i32, args);
        match form {
            GemvForm::Add => {
                let name = format!("gemv_rows_add{suffix}");
                launch_one_wave(gpu, &name, blocks, shared, &GemvRowsAdd { mats, nx, x, y })
            }
            GemvForm::Norm(norm_w, eps) => {
                let name = format!("gemv_rows_norm{suffix}");
                let a = GemvRowsNorm {
                    mats,
                    nx,
                    hidden: x,
                    norm_w,
                    eps,
                    y,
                };
                launch_one_wave(gpu, &name, blocks, shared, &a)
            }
        }
    };
    match gemv_route(bits, group, cols, gpu.shared_optin) {
        GemvRoute::TensorCores => {
            let units: usize = mat_rows.iter().map(|r| r.div_ceil(16)).sum();
            let plan = imma_plan(units, cols, gpu.sms as usize);
            let tiles = imma_tiles(rows);
            let shape = Shape {
                grid: (plan.blocks as u32, 1, 1),
                block: 32 * plan.warps as u32,
            };
            let (nx, split, shared) = (
                rows as i32,
                plan.split as i32,
                imma_shared_bytes(cols, tiles),
            );
            match form {
                GemvForm::Add => {
                    let a = GemvQ4Add {
                        mats: args,
                        nx,
                        x,
                        y,
                        split,
                    };
                    gpu.launch_shared(&format!("gemv_q4_add_t{tiles}"), shape, shared as u32, &a)
                }
                GemvForm::Norm(norm_w, eps) => {
                    let a = GemvQ4Norm {
                        mats: args,
                        nx,
                        hidden: x,
                        norm_w,
                        eps,
                        y,
                        split,
                    };
                    gpu.launch_shared(&format!("gemv_q4_norm_t{tiles}"), shape, shared as u32, &a)
                }
            }
        }
        GemvRoute::Fma if rows == 1 => match form {
            GemvForm::Add => {
                let a = GemvAdd { mats: args, x, y };
                gpu.launch(&format!("gemv_add_b{bits}"), shape, &a)
            }
            GemvForm::Norm(norm_w, eps) => {
                let a = GemvNorm {
                    mats: args,
                    hidden: x,
                    norm_w,
                    eps,
                    y,
                };
                gpu.launch(&format!("gemv_norm_b{bits}"), shape, &a)
            }
        },
        GemvRoute::Fma => {
            let bound = rows_bound(rows);
            let shared = rows_shared_bytes(bits, cols, bound);
            // The single-row kernel's block size: a row's norm is reduced in the same order.
            let blocks = (shape.grid.0 as usize, shape.block);
            rows_launch(&format!("_b{bits}_x{bound}"), blocks, shared)
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

/// Whether the Gated DeltaNet's output projection `m` takes its gated norm fused into its staging
/// (`gemv_q4_gated_t*`): on the integer tensor cores, value heads of whole slabs.
pub fn gated_fits(m: &DeviceMat, value_head_dim: usize, shared_optin: usize) -> bool {
    gemv_route(m.bits, m.group, m.cols, shared_optin) == GemvRoute::TensorCores
        && value_head_dim.is_multiple_of(IMMA_SLAB)
}

/// `y[n] += m · (RMSNorm(o[n]) · w · silu(z[n]))` per value head for each of `rows` rows, one
/// launch (where [`gated_fits`]).
pub fn gemv_gated(gpu: &Gpu, m: &DeviceMat, rows: usize, input: GatedInput, y: u64) -> Result<()> {
    ensure!(
        (1..=MAX_ROWS).contains(&rows),
        "a GEMV takes 1 to {MAX_ROWS} rows, not {rows}"
    );
    let plan = imma_plan(m.rows.div_ceil(16), m.cols, gpu.sms as usize);
    let tiles = imma_tiles(rows);
    let shape = Shape {
        grid: (plan.blocks as u32, 1, 1),
        block: 32 * plan.warps as u32,
    };
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
/// into `out.conv`, the rest into `proj` (one launch, where [`gemv_route`] takes the matrices to
/// the tensor cores).
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
    let shape = Shape {
        grid: (plan.blocks as u32, 1, 1),
        block: 32 * plan.warps as u32,
    };
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

/// Launches `name` on at most `blocks` blocks of `threads` threads, and at most as many as are
/// resident at once: every block stages all the rows' inputs, so a second wave would stage them
/// again for nothing; the blocks stride over the units instead.
fn launch_one_wave(
    gpu: &Gpu,
    name: &str,
    (blocks, threads): (usize, u32),
    shared: usize,
    args: &impl KernelArgs,
) -> Result<()> {
    let per_sm = gpu
        .function(name)?
        .occupancy_max_active_blocks_per_multiprocessor(threads, shared, None)?;
    ensure!(
        per_sm > 0,
        "{name} needs {shared} bytes of shared memory, more than {} gives a block",
        gpu.name
    );
    let wave = Shape {
        grid: ((blocks as u32).min(per_sm * gpu.sms).max(1), 1, 1),
        block: threads,
    };
    gpu.launch_shared(name, wave, shared as u32, args)
}

#[cfg(test)]
mod tests {
    use lily_core::config::QWEN36_35B_A3B_CONFIG;

    use super::*;

    /// The real model's widest batched input is 4,096 (the GDN's and the attention's outputs).
    #[test]
    fn the_rows_a_step_takes_follow_the_route_and_the_shared_memory() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        assert_eq!(rows_shared_bytes(4, 4096, 1), 4 * (4608 + 128 + 33));
        assert_eq!(rows_shared_bytes(32, 4096, 2), 2 * 4 * (4096 + 1 + 33));
        // 64 slabs of 4 tiles' parts (2,048 bytes) and factors (128), the partial sums, the norm's.
        assert_eq!(imma_shared_bytes(4096, 4), 64 * 2176 + 16384 + 256);
        assert_eq!(imma_shared_bytes(4096, 1), 64 * 544 + 4096 + 64);
        assert_eq!([1, 2, 3, 4, 5, 8].map(imma_tiles), [1, 1, 2, 2, 4, 4]);
        // MLX 4-bit, groups of 64: the tensor cores at 227 KiB, so 8 rows.
        assert_eq!(step_rows(&c, &[(4, 64)], 227 * 1024), 8);
        assert_eq!(step_rows(&c, &[(4, 128)], 227 * 1024), 8);
        // Groups of 32 and blocks too small for the staged x: the FMA kernels' bounds.
        assert_eq!(step_rows(&c, &[(4, 32)], 227 * 1024), 8);
        assert_eq!(step_rows(&c, &[(4, 64)], 100 * 1024), 4);
        assert_eq!(step_rows(&c, &[(4, 32)], 48 * 1024), 2);
        assert_eq!(step_rows(&c, &[(4, 64), (32, 4096)], 100 * 1024), 4);
        assert_eq!(step_rows(&c, &[(32, 4096)], 120 * 1024), 4);
        assert_eq!(step_rows(&c, &[(4, 64)], 16 * 1024), 1);
        assert_eq!(rows_bound(3), 4);
        assert_eq!(rows_bound(2), 2);
        assert_eq!(rows_bound(8), 8);
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

    #[test]
    fn only_4_bit_codes_in_whole_slabs_that_fit_go_to_the_tensor_cores() {
        let big = 227 * 1024;
        assert_eq!(gemv_route(4, 64, 2048, big), GemvRoute::TensorCores);
        assert_eq!(gemv_route(4, 128, 4096, big), GemvRoute::TensorCores);
        assert_eq!(gemv_route(4, 32, 2048, big), GemvRoute::Fma);
        assert_eq!(gemv_route(8, 64, 2048, big), GemvRoute::Fma);
        assert_eq!(gemv_route(32, 2048, 2048, big), GemvRoute::Fma);
        // 8,192 inputs stage 392 KiB.
        assert_eq!(gemv_route(4, 64, 8192, big), GemvRoute::Fma);
        assert_eq!(gemv_route(4, 64, 4096, 100 * 1024), GemvRoute::Fma);
    }
}
