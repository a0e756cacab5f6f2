//! The decode step's dense GEMVs (kernels/gemv.cu): `y[n] = [m0 | m1 | ...] · x[n]` for each of
//! a step's 1 to [`MAX_ROWS`] rows, one launch for up to four matrices that share their input,
//! with the input norm or the residual add fused in.
//!
//! Three routes, chosen by the matrices' format and width and the options' kernels
//! ([`DecodeKernels`]), never by the number of rows, so that a row gets the same bits in any batch
//! as alone:
//! - [`GemvRoute::Mma`]: `gemv_mma_*` (gemv_mma.cuh, bf16 tensor cores, x in three exact parts),
//!   4-bit codes in groups of a multiple of 64 whose staged input fits a block: every matrix of
//!   the real model, by default;
//! - [`GemvRoute::Imma`]: `gemv_q4_*` (gemv_imma.cuh, gemv_imma.rs: the integer tensor cores, x in
//!   four s8 parts), the same matrices with `DecodeKernels::Imma`;
//! - [`GemvRoute::Fma`]: f32 FMAs, `gemv_*` for one row and `gemv_rows_*` for several, which give
//!   each row the single-row kernel's bits: other formats, group sizes and widths.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gemv_imma::{IMMA_SLAB, gemv_q4, imma_shared_bytes, imma_tiles};
use crate::gpu::{Gpu, MAX_ROWS, Shape};
use crate::kernel_args::{GemvAdd, GemvNorm, GemvRowsAdd, GemvRowsNorm, KernelArgs};
use crate::mat::{DeviceMat, MatArg, XS_COLS, gemv_shape};
use crate::options::DecodeKernels;

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
    Mma,
    Imma,
    Fma,
}

/// Inputs of one slab of the bf16 tensor-core GEMVs (gemv_mma.cuh, MMA_SLAB): the unit of a
/// group's scale, so groups must be whole slabs.
const MMA_SLAB: usize = 64;
/// Slabs a warp takes per pass over a unit (gemv_mma.cuh, MMA_SPW).
const MMA_SPW: usize = 4;
/// Most warps a bf16 tensor-core GEMV block has (gemv_mma.cuh, MMA_MAX_WARPS).
const MMA_MAX_WARPS: usize = 16;

/// Warps a block of the bf16 tensor-core GEMVs splits K over: 8, or 16 where 8 would need more
/// than one pass over a unit. A function of K alone, so that a row's sums run in one order in
/// every launch.
pub fn mma_warps(cols: usize) -> usize {
    if cols / MMA_SLAB > 8 * MMA_SPW {
        MMA_MAX_WARPS
    } else {
        8
    }
}

/// The route of matrix `m` on `gpu` with its options' kernels.
pub fn mat_route(gpu: &Gpu, m: &DeviceMat) -> GemvRoute {
    gemv_route(
        m.bits,
        m.group,
        m.cols,
        gpu.shared_optin,
        gpu.decode_kernels,
    )
}

/// Tiles of 8 x-part columns the bf16 tensor-core GEMVs take for `rows` rows (gemv_mma.cuh): one
/// holds two rows' three parts, three hold a part each of up to eight rows.
pub fn mma_tiles(rows: usize) -> usize {
    if rows <= 2 { 1 } else { 3 }
}

/// Dynamic shared memory of `gemv_mma_*_t{tiles}` for `cols` inputs (gemv_mma.cuh): the warps'
/// partial sums (two buffers of 16 warps × 32 lanes × 16 bytes), then per slab of 64 inputs its
/// staged x (2 words × `tiles` × 32 lanes × 16 bytes) and its sums of x for 8 rows, then the
/// norm's scratch and inverse norms.
pub fn mma_shared_bytes(cols: usize, tiles: usize) -> usize {
    let slabs = cols / MMA_SLAB;
    2 * MMA_MAX_WARPS * 32 * 16
        + slabs * (2 * tiles * 32 * 16 + MAX_ROWS * 4)
        + MAX_ROWS * 32 * 4
        + MAX_ROWS * 4
}

/// The route of matrices of `bits`-bit codes in groups of `group` with `cols` inputs on a device
/// whose blocks can have `shared_optin` bytes of shared memory, with the options' `kernels`.
pub fn gemv_route(
    bits: u32,
    group: usize,
    cols: usize,
    shared_optin: usize,
    kernels: DecodeKernels,
) -> GemvRoute {
    let tensor = bits == 4 && group.is_multiple_of(IMMA_SLAB) && cols.is_multiple_of(group);
    match kernels {
        DecodeKernels::Mma
            if tensor && mma_shared_bytes(cols, mma_tiles(MAX_ROWS)) <= shared_optin =>
        {
            GemvRoute::Mma
        }
        DecodeKernels::Imma
            if tensor && imma_shared_bytes(cols, imma_tiles(MAX_ROWS)) <= shared_optin =>
        {
            GemvRoute::Imma
        }
        _ => GemvRoute::Fma,
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
pub fn step_rows(
    c: &ModelConfig,
    formats: &[(u32, usize)],
    shared_optin: usize,
    kernels: DecodeKernels,
) -> usize {
    let widest = widest_input(c);
    [8, 4, 2]
        .into_iter()
        .find(|&n| {
            formats.iter().all(|&(bits, group)| {
                gemv_route(bits, group, widest, shared_optin, kernels) != GemvRoute::Fma
                    || rows_shared_bytes(bits, widest, n) <= shared_optin
            })
        })
        .unwrap_or(1)
}

/// The shared memory limits to raise at start: all a block can have (each launch asks for what
/// its rows and width need); the integer tensor-core kernels' where the options select them.
pub fn dynamic_shared(shared_optin: usize, kernels: DecodeKernels) -> Vec<(String, u32)> {
    let limit = shared_optin as u32;
    let mut raised: Vec<(String, u32)> = [1, 3]
        .into_iter()
        .flat_map(|t| ["norm", "add"].map(|form| (format!("gemv_mma_{form}_b4_t{t}"), limit)))
        .collect();
    if kernels == DecodeKernels::Imma {
        for t in [1, 2, 4] {
            for k in [
                "gemv_q4_norm",
                "gemv_q4_add",
                "gemv_q4_gated",
                "gemv_q4_gdn",
                "moe_route_imma",
            ] {
                raised.push((format!("{k}_t{t}"), limit));
            }
        }
        raised.extend(["moe_gate_up_imma", "moe_down_imma"].map(|k| (k.to_string(), limit)));
    }
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
    // The kernels of several rows (the bf16 tensor cores' for any number):
    // `{prefix}_{form}{suffix}`.
    let rows_launch = |prefix: &str, suffix: &str, blocks: (usize, u32), shared: usize| {
        let (nx, mats) = (rows as i32, args);
        match form {
            GemvForm::Add => {
                let name = format!("{prefix}_add{suffix}");
                launch_one_wave(gpu, &name, blocks, shared, &GemvRowsAdd { mats, nx, x, y })
            }
            GemvForm::Norm(norm_w, eps) => {
                let name = format!("{prefix}_norm{suffix}");
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
    match mat_route(gpu, mats[0]) {
        GemvRoute::Mma => {
            let units: usize = mat_rows.iter().map(|r| r.div_ceil(16)).sum();
            let tiles = mma_tiles(rows);
            let suffix = format!("_b4_t{tiles}");
            rows_launch(
                "gemv_mma",
                &suffix,
                (units, 32 * mma_warps(cols) as u32),
                mma_shared_bytes(cols, tiles),
            )
        }
        GemvRoute::Imma => {
            let units: usize = mat_rows.iter().map(|r| r.div_ceil(16)).sum();
            gemv_q4(gpu, form, (args, units, cols), rows, x, y)
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
            rows_launch("gemv_rows", &format!("_b{bits}_x{bound}"), blocks, shared)
        }
    }
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

    const KERNELS: [DecodeKernels; 2] = [DecodeKernels::Mma, DecodeKernels::Imma];

    /// The real model's widest batched input is 4,096 (the GDN's and the attention's outputs).
    #[test]
    fn the_rows_a_step_takes_follow_the_route_and_the_shared_memory() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        assert_eq!(rows_shared_bytes(4, 4096, 1), 4 * (4608 + 128 + 33));
        assert_eq!(rows_shared_bytes(32, 4096, 2), 2 * 4 * (4096 + 1 + 33));
        // 64 slabs of 3,104 bytes, the two 8 KiB sum buffers, 1,056 bytes of norm scratch.
        assert_eq!(mma_shared_bytes(4096, 3), 16384 + 64 * 3104 + 1056);
        assert_eq!(mma_shared_bytes(4096, 1), 16384 + 64 * 1056 + 1056);
        // One pass a unit: 8 warps up to 2,048 inputs, 16 to 4,096 (and passes beyond).
        assert_eq!(
            [64, 2048, 2112, 4096, 8192].map(mma_warps),
            [8, 8, 16, 16, 16]
        );
        assert_eq!([1, 2, 3, 5, 8].map(mma_tiles), [1, 1, 3, 3, 3]);
        for k in KERNELS {
            let rows = |formats: &[(u32, usize)], kib: usize| step_rows(&c, formats, kib * 1024, k);
            // MLX 4-bit, groups of 64: the tensor cores at 227 KiB, so 8 rows.
            assert_eq!(rows(&[(4, 64)], 227), 8, "{k:?}");
            assert_eq!(rows(&[(4, 128)], 227), 8, "{k:?}");
            // Groups of 32 and blocks too small for the staged x: the FMA kernels' bounds.
            assert_eq!(rows(&[(4, 32)], 227), 8, "{k:?}");
            assert_eq!(rows(&[(4, 64)], 100), 4, "{k:?}");
            assert_eq!(rows(&[(4, 32)], 48), 2, "{k:?}");
            assert_eq!(rows(&[(4, 64), (32, 4096)], 100), 4, "{k:?}");
            assert_eq!(rows(&[(32, 4096)], 120), 4, "{k:?}");
            assert_eq!(rows(&[(4, 64)], 16), 1, "{k:?}");
        }
        assert_eq!(rows_bound(3), 4);
        assert_eq!(rows_bound(2), 2);
        assert_eq!(rows_bound(8), 8);
    }

    #[test]
    fn only_4_bit_codes_in_whole_slabs_that_fit_go_to_the_tensor_cores() {
        let big = 227 * 1024;
        for (k, tensor) in KERNELS.into_iter().zip([GemvRoute::Mma, GemvRoute::Imma]) {
            assert_eq!(gemv_route(4, 64, 2048, big, k), tensor);
            assert_eq!(gemv_route(4, 128, 4096, big, k), tensor);
            assert_eq!(gemv_route(4, 32, 2048, big, k), GemvRoute::Fma);
            assert_eq!(gemv_route(8, 64, 2048, big, k), GemvRoute::Fma);
            assert_eq!(gemv_route(32, 2048, 2048, big, k), GemvRoute::Fma);
            // 8,192 inputs stage 392 KiB (bf16 parts) or 262 KiB (s8 parts).
            assert_eq!(gemv_route(4, 64, 8192, big, k), GemvRoute::Fma);
            assert_eq!(gemv_route(4, 64, 4096, 100 * 1024, k), GemvRoute::Fma);
        }
        // 4,096 inputs at 160 KiB: the s8 parts fit, the bf16 parts do not.
        assert_eq!(
            gemv_route(4, 64, 4096, 160 * 1024, DecodeKernels::Imma),
            GemvRoute::Imma
        );
        assert_eq!(
            gemv_route(4, 64, 4096, 160 * 1024, DecodeKernels::Mma),
            GemvRoute::Fma
        );
    }
}
