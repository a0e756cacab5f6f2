//! Launchers for kernels/gemm.cu: the tensor-core GEMM of prefill, `Y = X · Wᵀ` with the weight
//! dequantised (and X rounded to bf16) on its way into shared memory, dense or grouped by expert.

use anyhow::{Result, ensure};

use crate::gpu::{Gpu, KArg, Shape, ptr};
use crate::mat::DeviceMat;
use crate::moe_prefill::{MoeTile, TileMap};

/// Rows of X (tokens) one block of the dense GEMM computes (kernels/gemm.cu, GEMM_DENSE_BM).
pub const GEMM_DENSE_BM: usize = 128;
/// Weight rows (output columns) one block of the dense GEMM computes (GEMM_DENSE_BN).
pub const GEMM_DENSE_BN: usize = 128;
/// Expert weight rows (output columns) one block of the grouped GEMM computes (GEMM_GROUPED_BN).
pub const GEMM_GROUPED_BN: usize = 256;
/// K columns a step of the GEMM advances (GEMM_BK).
const GEMM_BK: usize = 32;
/// Threads of a block: 8 warps (GEMM_THREADS).
const GEMM_THREADS: u32 = 256;
/// Threads of a `gemm_reduce` block.
const REDUCE_THREADS: u32 = 256;
/// CUDA's limit on a grid's y dimension, which counts row tiles.
const MAX_GRID_Y: usize = 65_535;

/// Dynamic shared memory of a `bm × bn` block, as kernels/gemm.cu lays it out
/// (`gemm_shared_bytes`): two bf16 X tiles, then two bf16 W tiles. The kernel traps when given
/// less.
const fn shared_bytes(bm: usize, bn: usize) -> u32 {
    (2 * (bm + bn) * GEMM_BK * 2) as u32
}

/// Fewest K columns a split of a dense GEMM takes: 8 steps, so the prologue and the reduction
/// stay small beside the work.
const SPLIT_MIN_K: usize = 256;

/// Dense blocks one wave holds: the kernel's `__launch_bounds__` asks for two per SM.
fn dense_wave(sms: u32) -> usize {
    2 * sms as usize
}

/// Floats of `Gpu::gemm_partials`: room for two waves of dense output tiles, which bounds what
/// [`dense_splits`] writes (splits · m · n ≤ (wave / tiles + 1) · tiles · BM · BN).
pub fn partial_floats(sms: u32) -> usize {
    2 * dense_wave(sms) * GEMM_DENSE_BM * GEMM_DENSE_BN
}

/// K splits of an `m × n × k` dense GEMM: enough for its output tiles to fill one wave, each
/// split at least [`SPLIT_MIN_K`] columns, the partial sums within `partials` floats. 1 when
/// the tiles alone fill the GPU.
fn dense_splits(sms: u32, m: usize, n: usize, k: usize, partials: usize) -> usize {
    let tiles = n.div_ceil(GEMM_DENSE_BN) * m.div_ceil(GEMM_DENSE_BM);
    let wave = dense_wave(sms);
    if tiles >= wave {
        return 1;
    }
    wave.div_ceil(tiles)
        .min(k / SPLIT_MIN_K)
        .min(partials / (m * n))
        .max(1)
}

/// Dense blocks: 32 KiB.
const DENSE_SHARED: u32 = shared_bytes(GEMM_DENSE_BM, GEMM_DENSE_BN);

/// Grouped blocks, one tile high: 34 KiB at 16 rows, 40 KiB at 64.
const fn grouped_shared(height: MoeTile) -> u32 {
    shared_bytes(height.rows(), GEMM_GROUPED_BN)
}

/// The grouped entry for tiles of `height` and `bits`-bit weights (gemm.cu's GEMM_GROUPED).
fn grouped_entry(height: MoeTile, bits: u32) -> String {
    format!("gemm_grouped{}_b{bits}", height.rows())
}

/// The GEMM kernels and the dynamic shared memory each launches with, for `Gpu::new` to declare
/// as their limit (needed once a block takes more than the default 48 KiB; 32 to 40 KiB now).
pub fn dynamic_shared() -> Vec<(String, u32)> {
    [4, 8, 32]
        .into_iter()
        .flat_map(|bits| {
            let grouped = MoeTile::ALL.map(|h| (grouped_entry(h, bits), grouped_shared(h)));
            std::iter::once((format!("gemm_b{bits}"), DENSE_SHARED)).chain(grouped)
        })
        .collect()
}

/// Checks the weight suits the kernels: their 16-byte code chunks (32 codes at 4 bits, 16 at 8)
/// must not straddle a quantisation group, and rows must hold whole groups.
fn check_weight(w: &DeviceMat) -> Result<()> {
    ensure!(
        w.rows > 0 && w.cols > 0,
        "empty {}x{} weight",
        w.rows,
        w.cols
    );
    ensure!(
        w.rows <= i32::MAX as usize && w.cols <= i32::MAX as usize,
        "a {}x{} weight is too large for the GEMM's 32-bit shapes",
        w.rows,
        w.cols
    );
    if w.bits != 32 {
        ensure!(
            (w.bits == 4 || w.bits == 8)
                && w.group.is_multiple_of(128 / w.bits as usize)
                && w.cols.is_multiple_of(w.group),
            "the GEMM cannot read {}-bit weights with group {} and {} columns",
            w.bits,
            w.group,
            w.cols
        );
    }
    Ok(())
}

/// `y[r, col0 + n] = Σ_k x[r, k] · w[n, k]` for `r < m`, `n < w.rows`: `x` is row-major
/// `[m, w.cols]` f32 (4-byte alignment suffices), `y` has a row stride of `ldy` floats. Cells of
/// `y` outside those rows and columns are left as they are. `m == 0` launches nothing. When the
/// output tiles are too few to fill the GPU, K is split and a second launch adds the splits' partial
/// sums in a fixed order (the same result on every run).
pub fn gemm(
    gpu: &Gpu,
    w: &DeviceMat,
    x: u64,
    m: usize,
    y: u64,
    ldy: usize,
    col0: usize,
) -> Result<()> {
    check_weight(w)?;
    if m == 0 {
        return Ok(());
    }
    ensure!(
        col0 + w.rows <= ldy && ldy <= i32::MAX as usize,
        "output columns {col0}..{} do not fit rows of {ldy}",
        col0 + w.rows
    );
    let row_tiles = m.div_ceil(GEMM_DENSE_BM);
    ensure!(
        row_tiles <= MAX_GRID_Y,
        "{m} rows are too many for one GEMM launch"
    );
    let name = format!("gemm_b{}", w.bits);
    let (n, k) = (w.rows, w.cols);
    let partials = gpu.gemm_partials.len();
    let splits = dense_splits(gpu.sms, m, n, k, partials);
    // Whole steps per split; rounding up can leave fewer splits than asked.
    let k_split = k.div_ceil(splits).next_multiple_of(GEMM_BK);
    let splits = k.div_ceil(k_split);
    let (out, ld_out, col_out) = if splits == 1 {
        (y, ldy, col0)
    } else {
        (ptr(&gpu.gemm_partials, &gpu.stream), n, 0)
    };
    let grid = (
        n.div_ceil(GEMM_DENSE_BN) as u32,
        row_tiles as u32,
        splits as u32,
    );
    let args: [KArg; 7] = [
        w.arg(gpu).into(),
        x.into(),
        (m as i32).into(),
        out.into(),
        (ld_out as i32).into(),
        (col_out as i32).into(),
        (k_split as i32).into(),
    ];
    let shape = Shape {
        grid,
        block: GEMM_THREADS,
    };
    gpu.launch_shared(&name, shape, DENSE_SHARED, &args)?;
    if splits > 1 {
        let outputs = m * n;
        let args: [KArg; 7] = [
            out.into(),
            (splits as i32).into(),
            (m as i32).into(),
            (n as i32).into(),
            y.into(),
            (ldy as i32).into(),
            (col0 as i32).into(),
        ];
        let shape = Shape {
            grid: (outputs.div_ceil(REDUCE_THREADS as usize) as u32, 1, 1),
            block: REDUCE_THREADS,
        };
        gpu.launch("gemm_reduce", shape, &args)?;
    }
    Ok(())
}

/// The grouped GEMM over experts stacked in `w` (`n` rows each), one block row per tile of
/// `map`, by the entry of the map's height; the grid covers `map.max_tiles` tiles, and blocks
/// past the live count return. Sorted slot `s` reads x row `gather[s]` (or `s` when `gather` is
/// 0) of `w.cols` values and writes `y[s, 0..n)`.
pub fn gemm_grouped(
    gpu: &Gpu,
    w: &DeviceMat,
    n: usize,
    x: u64,
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
    let name = grouped_entry(map.height, w.bits);
    let grid = (n.div_ceil(GEMM_GROUPED_BN) as u32, max_tiles as u32, 1);
    let args: [KArg; 7] = [
        w.arg(gpu).into(),
        (n as i32).into(),
        x.into(),
        gather.into(),
        map.tiles.into(),
        map.num_tiles.into(),
        y.into(),
    ];
    let shape = Shape {
        grid,
        block: GEMM_THREADS,
    };
    gpu.launch_shared(&name, shape, grouped_shared(map.height), &args)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::KERNEL_FILES;

    /// The launchers name, at every tile height and weight format, exactly the entries gemm.cu
    /// instantiates and compile.rs loads (the split-K reduction besides).
    #[test]
    fn every_launched_entry_is_compiled() {
        let gemm = KERNEL_FILES.iter().find(|f| f.name == "gemm").unwrap();
        let mut launched: Vec<String> = dynamic_shared().into_iter().map(|(e, _)| e).collect();
        launched.push("gemm_reduce".to_string());
        let mut loaded: Vec<String> = gemm.entries.iter().map(|e| e.to_string()).collect();
        launched.sort();
        loaded.sort();
        assert_eq!(launched, loaded);
        for bits in [4, 8, 32] {
            let mut made = vec![format!("GEMM_DENSE({bits})")];
            made.extend(MoeTile::ALL.map(|h| format!("GEMM_GROUPED({}, {bits})", h.rows())));
            for m in made {
                assert!(gemm.source.contains(&m), "gemm.cu does not instantiate {m}");
            }
        }
    }

    #[test]
    fn dense_splits_fill_a_wave_within_the_partials() {
        let sms = 132;
        let partials = partial_floats(sms);
        // The router of a 256-token chunk: 3 × 2 tiles, K 2,048 allows 8 splits of 256.
        assert_eq!(dense_splits(sms, 256, 257, 2048, partials), 8);
        // A shared-expert down projection: K 512 allows 2.
        assert_eq!(dense_splits(sms, 256, 2048, 512, partials), 2);
        // Enough tiles already (a 4,096-token chunk's GDN input projection).
        assert_eq!(dense_splits(sms, 4096, 12_288, 2048, partials), 1);
        // K below one split's minimum.
        assert_eq!(dense_splits(sms, 1, 32, 200, partials), 1);
        for m in [1, 7, 16, 33, 200, 2048, 4096] {
            for n in [1, 32, 257, 512, 1024, 2048, 4096] {
                for k in [64, 512, 2048, 4096, 8192] {
                    let splits = dense_splits(sms, m, n, k, partials);
                    assert!(splits >= 1 && splits <= (k / SPLIT_MIN_K).max(1));
                    assert!(splits == 1 || splits * m * n <= partials, "{m}x{n}x{k}");
                }
            }
        }
    }
}
