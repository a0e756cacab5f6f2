//! Launchers for the tensor-core GEMM of prefill, `Y = X · Wᵀ` with the weight dequantised (and X
//! rounded to bf16) on its way into shared memory, dense or grouped by expert: kernels/gemm.cu
//! (mma.sync, every format, sm_80+) and, for 4-bit weights on sm_90, kernels/gemm_wgmma.cu
//! (warpgroup MMA), which compute the same products. [`GemmPath`] chooses between them. The
//! grouped launchers (experts) are gemm_grouped.rs's; this file has the dense ones and what the
//! two share.

use anyhow::{Result, ensure};

use crate::gemm_grouped::{grouped_entry, grouped_shared};
use crate::gemm_wgmma::{self, GemmPath, WGMMA_DENSE, WGMMA_DENSE_X16};
use crate::gpu::{Gpu, Shape, ptr};
use crate::kernel_args::{DenseOut, Gemm, GemmReduce, GemmStack};
use crate::mat::{DeviceMat, MatArg};
use crate::moe_prefill::MoeTile;

/// Expert weight rows (output columns) one block of either grouped GEMM computes (gemm.cu's
/// GEMM_GROUPED_BN, gemm_wgmma.cu's GEMM_WG_BN).
pub const GEMM_GROUPED_BN: usize = 256;
/// K columns a step of gemm.cu advances (GEMM_BK).
const GEMM_BK: usize = 32;
/// Threads of a block of either file: 8 warps (GEMM_THREADS, GEMM_WG_THREADS).
pub(crate) const GEMM_THREADS: u32 = 256;
/// Threads of a `gemm_reduce` block.
const REDUCE_THREADS: u32 = 256;
/// CUDA's limit on a grid's y dimension, which counts row tiles.
pub(crate) const MAX_GRID_Y: usize = 65_535;

/// The X rows of a GEMM: f32, and where their producer also wrote them rounded to bf16 (as
/// every GEMM kernel rounds f32 X on loading it), that copy, which the wgmma kernels read
/// instead: half the bytes, and copied into shared memory as they are, several steps ahead. The
/// products are the same bits either way. A bare address is f32 rows alone; `f32` is 0 where the
/// producer wrote only the bf16 copy, for a weight whose products run on wgmma (`path_of`).
#[derive(Clone, Copy, Debug)]
pub struct GemmX {
    pub f32: u64,
    pub bf16: Option<u64>,
}

impl From<u64> for GemmX {
    fn from(f32: u64) -> Self {
        GemmX { f32, bf16: None }
    }
}

/// A GEMM's output as its consumer reads it: `count` arrays of the output's floats, `stride`
/// floats apart, that the consumer adds in order from 0 as it reads them (what `gemm_reduce`
/// would have written, to the bit). One part where K was not split.
#[derive(Clone, Copy, Debug)]
pub struct Parts {
    pub at: u64,
    pub count: usize,
    pub stride: usize,
}

impl From<u64> for Parts {
    fn from(at: u64) -> Self {
        Parts {
            at,
            count: 1,
            stride: 0,
        }
    }
}

impl Parts {
    /// The count and stride as a kernel's two int parameters.
    pub fn ints(&self) -> Result<(i32, i32)> {
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| anyhow::anyhow!("{v} does not fit a kernel's int"))
        };
        Ok((int(self.count)?, int(self.stride)?))
    }
}

/// The _x16 kernels copy bf16 rows in 16-byte chunks (and trap on any other address): an error
/// here instead of a trap that would end the CUDA context.
pub(crate) fn check_bf16_rows(x: GemmX) -> Result<()> {
    if let Some(x16) = x.bf16 {
        ensure!(
            x16.is_multiple_of(16),
            "bf16 GEMM rows at {x16:#x} are not 16-byte aligned"
        );
    }
    Ok(())
}

/// A dense GEMM kernel's block shape, for its grid and the split-K policy.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DenseTiling {
    /// Rows of X (tokens) a block computes.
    pub bm: usize,
    /// Weight rows (output columns) a block computes.
    pub bn: usize,
    /// K columns a step: a split along K is whole steps.
    pub bk: usize,
    /// Blocks an SM holds (the kernel's `__launch_bounds__`).
    pub blocks_per_sm: usize,
    /// Dynamic shared memory a block launches with; the kernels trap when given less.
    pub shared: u32,
}

impl DenseTiling {
    /// Blocks one wave holds.
    fn wave(&self, sms: u32) -> usize {
        self.blocks_per_sm * sms as usize
    }

    /// K splits of an `m × n × k` GEMM whose output tiles fill less than one wave: the count
    /// that finishes soonest counting whole waves (`⌈tiles · s / wave⌉ / s` of the unsplit
    /// time), the fewest among equals, each split at least [`SPLIT_MIN_K`] columns and the
    /// partial sums within `partials` floats. 1 when the tiles alone fill the GPU. Enough
    /// splits to fill one wave overshot it: a 4K chunk's shared-expert gate (64 wgmma tiles on
    /// 132 SMs) took 3, two waves of a third of the work each, where 2 fill one wave with half
    /// (H100, ncu: 37.8 µs and a reduction, docs/BENCHMARKS.md).
    fn splits(&self, sms: u32, m: usize, n: usize, k: usize, partials: usize) -> usize {
        let tiles = n.div_ceil(self.bn) * m.div_ceil(self.bm);
        let wave = self.wave(sms);
        if tiles >= wave {
            return 1;
        }
        let most = (k / SPLIT_MIN_K).min(partials / (m * n)).max(1);
        // ⌈tiles · s / wave⌉ / s compared as fractions: a / s < b / t ⇔ a · t < b · s.
        let waves = |s: usize| (tiles * s).div_ceil(wave);
        (1..=most).fold(1, |best, s| {
            if waves(s) * best < waves(best) * s {
                s
            } else {
                best
            }
        })
    }
}

/// Dynamic shared memory of a `bm × bn` block of gemm.cu (`gemm_shared_bytes`): two bf16 X tiles,
/// then two bf16 W tiles.
pub(crate) const fn mma_shared_bytes(bm: usize, bn: usize) -> u32 {
    (2 * (bm + bn) * GEMM_BK * 2) as u32
}

/// gemm.cu's dense blocks: 128 × 128, two an SM, 32 KiB.
const MMA_DENSE: DenseTiling = DenseTiling {
    bm: 128,
    bn: 128,
    bk: GEMM_BK,
    blocks_per_sm: 2,
    shared: mma_shared_bytes(128, 128),
};

/// Fewest K columns a split of a dense GEMM takes: 8 steps of gemm.cu, 4 of gemm_wgmma.cu, so
/// the prologue and the reduction stay small beside the work.
pub(crate) const SPLIT_MIN_K: usize = 256;

const _: () = assert!(SPLIT_MIN_K.is_multiple_of(MMA_DENSE.bk));

/// Floats of `Gpu::gemm_partials`: room for two waves of dense output tiles of either kernel,
/// which bounds what [`DenseTiling::splits`] writes (splits · m · n ≤ (wave / tiles + 1) · tiles
/// · BM · BN).
pub fn partial_floats(sms: u32) -> usize {
    [MMA_DENSE, WGMMA_DENSE]
        .iter()
        .map(|t| 2 * t.wave(sms) * t.bm * t.bn)
        .max()
        .unwrap_or(0)
}

/// The GEMM kernels and the dynamic shared memory each launches with, for `Gpu::new` to declare
/// as their limit (needed once a block takes more than the default 48 KiB: the wgmma entries,
/// compiled when `wgmma`).
pub fn dynamic_shared(wgmma: bool) -> Vec<(String, u32)> {
    let mut entries: Vec<(String, u32)> = [4, 8, 32]
        .into_iter()
        .flat_map(|bits| {
            let grouped = MoeTile::ALL.map(|h| (grouped_entry(h, bits), grouped_shared(h)));
            std::iter::once((format!("gemm_b{bits}"), MMA_DENSE.shared)).chain(grouped)
        })
        .collect();
    if wgmma {
        entries.extend(gemm_wgmma::dynamic_shared());
    }
    entries
}

/// Checks the weight suits the kernels: their 16-byte code chunks (32 codes at 4 bits, 16 at 8)
/// must not straddle a quantisation group, and rows must hold whole groups.
pub(crate) fn check_weight(w: &DeviceMat) -> Result<()> {
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
/// `[m, w.cols]` f32 (4-byte alignment suffices; its bf16 copy, if any, 16-byte), `y` has a row
/// stride of `ldy` floats. Cells of `y` outside those rows and columns are left as they are. `m == 0` launches nothing. When the
/// output tiles are too few to fill the GPU, K is split and a second launch adds the splits' partial
/// sums in a fixed order (the same result on every run).
pub fn gemm(
    gpu: &Gpu,
    w: &DeviceMat,
    x: impl Into<GemmX>,
    m: usize,
    y: u64,
    ldy: usize,
    col0: usize,
) -> Result<()> {
    gemm_stack(gpu, &[w], x, m, y, ldy, col0)
}

/// [`gemm`] into `y` (`[m, w.rows]`, nothing else in its rows) for a consumer that takes
/// [`Parts`]: where K is split, the partial sums stay in the GPU's partials buffer for the
/// consumer to add as it reads them, which saves `gemm_reduce`'s launch and its pass over the
/// output (~13 µs for a 1K chunk's output projection). The consumer must run before the next
/// GEMM, which reuses that buffer.
pub fn gemm_parts(
    gpu: &Gpu,
    w: &DeviceMat,
    x: impl Into<GemmX>,
    m: usize,
    y: u64,
) -> Result<Parts> {
    check_weight(w)?;
    dense(gpu, &[w], x.into(), m, y, w.rows, 0, Sum::Leave)
}

/// Whether a split-K launch's partial sums are added up by `gemm_reduce` or left to the consumer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sum {
    Reduce,
    Leave,
}

/// Weights the wgmma dense launch takes at once (`gemm_wgmma_b4_x16`'s m0..m3).
const STACK_MAX: usize = 4;

/// [`gemm`] of each of `ws` into the columns after the one before it (`w[0]` from `col0`, `w[1]`
/// from `col0 + w[0].rows`, ...): the input projections of a mixer, which share X. Where they
/// run on wgmma with bf16 X and share K, the group and the format (the model's do), as one
/// launch over the stack of their rows: the narrow ones (the GDN's b and a, 32 rows) then ride
/// in the wide ones' waves instead of taking split-K launches and reductions of their own.
pub fn gemm_stack(
    gpu: &Gpu,
    ws: &[&DeviceMat],
    x: impl Into<GemmX>,
    m: usize,
    y: u64,
    ldy: usize,
    col0: usize,
) -> Result<()> {
    let x = x.into();
    for w in ws {
        check_weight(w)?;
    }
    let stackable = |w: &&DeviceMat| {
        path_of(gpu, w) == GemmPath::Wgmma
            && (w.cols, w.group, w.bits) == (ws[0].cols, ws[0].group, ws[0].bits)
    };
    if x.bf16.is_some() && ws.len() <= STACK_MAX && ws.iter().all(stackable) {
        return dense(gpu, ws, x, m, y, ldy, col0, Sum::Reduce).map(|_| ());
    }
    let mut col = col0;
    for w in ws {
        dense(gpu, &[w], x, m, y, ldy, col, Sum::Reduce)?;
        col += w.rows;
    }
    Ok(())
}

/// One dense launch of the stack `ws` (several weights only on the wgmma path with bf16 X:
/// [`gemm_stack`] checks), and with `Sum::Reduce` the reduction of its split-K parts; where the
/// output is, as parts.
#[allow(clippy::too_many_arguments)]
fn dense(
    gpu: &Gpu,
    ws: &[&DeviceMat],
    x: GemmX,
    m: usize,
    y: u64,
    ldy: usize,
    col0: usize,
    sum: Sum,
) -> Result<Parts> {
    if m == 0 || ws.is_empty() {
        return Ok(Parts::from(y));
    }
    let n: usize = ws.iter().map(|w| w.rows).sum();
    ensure!(
        col0 + n <= ldy && ldy <= i32::MAX as usize && n <= i32::MAX as usize,
        "output columns {col0}..{} do not fit rows of {ldy}",
        col0 + n
    );
    let w = ws[0];
    let wgmma = path_of(gpu, w) == GemmPath::Wgmma;
    check_bf16_rows(x)?;
    let (name, tiling, xp) = match (wgmma, x.bf16) {
        (true, Some(x16)) => (
            gemm_wgmma::DENSE_X16_ENTRY.to_string(),
            WGMMA_DENSE_X16,
            x16,
        ),
        (true, None) => (gemm_wgmma::DENSE_ENTRY.to_string(), WGMMA_DENSE, x.f32),
        (false, _) => (format!("gemm_b{}", w.bits), MMA_DENSE, x.f32),
    };
    ensure!(
        ws.len() == 1 || name == gemm_wgmma::DENSE_X16_ENTRY,
        "only the wgmma launch with bf16 X takes a stack of weights"
    );
    ensure!(xp != 0, "a GEMM on f32 rows was given only their bf16 copy");
    let row_tiles = m.div_ceil(tiling.bm);
    ensure!(
        row_tiles <= MAX_GRID_Y,
        "{m} rows are too many for one GEMM launch"
    );
    let k = w.cols;
    let partials = gpu.gemm_partials.len();
    let splits = tiling.splits(gpu.sms, m, n, k, partials);
    // Whole steps per split; rounding up can leave fewer splits than asked.
    let k_split = k.div_ceil(splits).next_multiple_of(tiling.bk);
    let splits = k.div_ceil(k_split);
    let (out, ld_out, col_out) = if splits == 1 {
        (y, ldy, col0)
    } else {
        (ptr(&gpu.gemm_partials, &gpu.stream), n, 0)
    };
    let shape = Shape {
        grid: (
            n.div_ceil(tiling.bn) as u32,
            row_tiles as u32,
            splits as u32,
        ),
        block: GEMM_THREADS,
    };
    let dense_out = DenseOut {
        x: xp,
        m: m as i32,
        y: out,
        ldy: ld_out as i32,
        col0: col_out as i32,
        k_split: k_split as i32,
    };
    if name == gemm_wgmma::DENSE_X16_ENTRY {
        let mut mats = [MatArg::default(); STACK_MAX];
        for (slot, w) in mats.iter_mut().zip(ws) {
            *slot = w.arg(gpu);
        }
        let args = GemmStack {
            mats,
            out: dense_out,
        };
        gpu.launch_shared(&name, shape, tiling.shared, &args)?;
    } else {
        let args = Gemm {
            w: w.arg(gpu),
            out: dense_out,
        };
        gpu.launch_shared(&name, shape, tiling.shared, &args)?;
    }
    if splits > 1 && sum == Sum::Leave {
        return Ok(Parts {
            at: out,
            count: splits,
            stride: m * n,
        });
    }
    if splits > 1 {
        let outputs = m * n;
        let args = GemmReduce {
            part: out,
            splits: splits as i32,
            m: m as i32,
            n: n as i32,
            y,
            ldy: ldy as i32,
            col0: col0 as i32,
        };
        let shape = Shape {
            grid: (outputs.div_ceil(REDUCE_THREADS as usize) as u32, 1, 1),
            block: REDUCE_THREADS,
        };
        gpu.launch("gemm_reduce", shape, &args)?;
    }
    Ok(Parts::from(y))
}

/// The path `w`'s dense products and its grouped 64-row tiles run on: wgmma where the GPU runs
/// it and gemm_wgmma.cu takes the weight, else mma.sync (16-row tiles always run on mma.sync).
/// On wgmma they read X's bf16 rows only.
pub fn path_of(gpu: &Gpu, w: &DeviceMat) -> GemmPath {
    if gpu.gemm_path() == GemmPath::Wgmma && gemm_wgmma::takes(&w.arg(gpu), w.bits) {
        GemmPath::Wgmma
    } else {
        GemmPath::MmaSync
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::gemm_wgmma::tests::{define, file};

    /// The launchers name, at every tile height and weight format, exactly the entries gemm.cu,
    /// gemm_wgmma.cu and gemm_wgmma_x16.cu instantiate and compile.rs loads (the split-K
    /// reduction besides).
    #[test]
    fn every_launched_entry_is_compiled() {
        let gemm = file("gemm");
        let wgmma = [file("gemm_wgmma"), file("gemm_wgmma_x16")];
        let mut launched: Vec<String> = dynamic_shared(true).into_iter().map(|(e, _)| e).collect();
        launched.push("gemm_reduce".to_string());
        let mut loaded: Vec<String> = gemm
            .entries
            .iter()
            .chain(wgmma.iter().flat_map(|f| f.entries))
            .map(|e| e.to_string())
            .collect();
        launched.sort();
        loaded.sort();
        assert_eq!(launched, loaded);
        assert_eq!(dynamic_shared(false).len(), dynamic_shared(true).len() - 5);
        for bits in [4, 8, 32] {
            let mut made = vec![format!("GEMM_DENSE({bits})")];
            made.extend(MoeTile::ALL.map(|h| format!("GEMM_GROUPED({}, {bits})", h.rows())));
            for m in made {
                assert!(gemm.source.contains(&m), "gemm.cu does not instantiate {m}");
            }
        }
        for f in wgmma {
            for entry in f.entries {
                assert!(f.source.contains(&format!("{entry}(")), "no {entry}");
            }
        }
    }

    /// The host's block shapes are gemm.cu's own.
    #[test]
    fn mma_tiling_matches_the_kernel() {
        let gemm = file("gemm").source;
        assert_eq!(MMA_DENSE.bm, define(gemm, "GEMM_DENSE_BM"));
        assert_eq!(MMA_DENSE.bn, define(gemm, "GEMM_DENSE_BN"));
        assert_eq!(MMA_DENSE.bk, define(gemm, "GEMM_BK"));
        assert_eq!(GEMM_GROUPED_BN, define(gemm, "GEMM_GROUPED_BN"));
        assert_eq!(GEMM_THREADS as usize, define(gemm, "GEMM_THREADS"));
    }

    #[test]
    fn dense_splits_fill_a_wave_within_the_partials() {
        let sms = 132;
        let partials = partial_floats(sms);
        // The router of a 256-token chunk: 3 × 2 tiles, K 2,048 allows 8 splits of 256, which
        // fill 48 of a wave's 264 blocks.
        assert_eq!(MMA_DENSE.splits(sms, 256, 257, 2048, partials), 8);
        // A shared-expert down projection: K 512 allows 2.
        assert_eq!(MMA_DENSE.splits(sms, 256, 2048, 512, partials), 2);
        // The router of a 4,096-token chunk (2 × 32 tiles, 264 a wave): 4 splits fill one wave
        // (5 made two waves of a fifth of the work).
        assert_eq!(MMA_DENSE.splits(sms, 4096, 256, 2048, partials), 4);
        // Enough tiles already (a 4,096-token chunk's GDN input projection).
        assert_eq!(MMA_DENSE.splits(sms, 4096, 12_288, 2048, partials), 1);
        // K below one split's minimum.
        assert_eq!(MMA_DENSE.splits(sms, 1, 32, 200, partials), 1);
        // wgmma, a 4,096-token chunk: the shared-expert gate (2 × 32 tiles) takes 2 splits (3
        // made two waves), a GDN b or a projection (1 × 32) 4 (5 made two), and the GDN input
        // projection (48 × 32) fills the GPU alone; 128 tiles stay whole (2 splits would take
        // two waves of halves: no sooner, and a reduction more).
        assert_eq!(WGMMA_DENSE.splits(sms, 4096, 512, 2048, partials), 2);
        assert_eq!(WGMMA_DENSE.splits(sms, 4096, 32, 2048, partials), 4);
        assert_eq!(WGMMA_DENSE.splits(sms, 4096, 12_288, 2048, partials), 1);
        assert_eq!(WGMMA_DENSE.splits(sms, 4096, 1024, 2048, partials), 1);
        for tiling in [MMA_DENSE, WGMMA_DENSE] {
            for m in [1, 7, 16, 33, 200, 2048, 4096] {
                for n in [1, 32, 257, 512, 1024, 2048, 4096] {
                    for k in [64, 512, 2048, 4096, 8192] {
                        let splits = tiling.splits(sms, m, n, k, partials);
                        assert!(splits >= 1 && splits <= (k / SPLIT_MIN_K).max(1));
                        assert!(splits == 1 || splits * m * n <= partials, "{m}x{n}x{k}");
                    }
                }
            }
        }
    }
}
