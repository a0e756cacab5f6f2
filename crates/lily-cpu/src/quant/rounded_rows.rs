//! Input rows rounded to int8 parts in the int8 kernels' layout (int8.rs says what the parts
//! are and why). Rounding a prefill's inputs is a large share of a product's time (a chunk's
//! experts round 2,304 rows a layer), so each row is rounded in code built for the kernel's own
//! instruction set: written as plain loops over 16 lanes, which the compiler vectorises there.
//! The results are the same bits in either build.

use lily_core::quant::QuantMatrix;

use std::sync::Arc;

use super::superblocks::{LANES as VECTOR_LANES, Superblocks};
use super::{InputParts, Int8Isa};
use crate::team;

/// The low part's weight against the high part's: `X = 128·h + l`. A power of two so the kernel
/// joins the parts' integer sums with a shift.
const LOW_PART: f32 = 128.0;
pub(super) const LOW_PART_SHIFT: i32 = 7;

impl InputParts {
    pub(super) fn count(self) -> usize {
        match self {
            InputParts::One => 1,
            InputParts::Two => 2,
        }
    }

    /// `d_g` over the step of `X`: what a rounded input's integer is in units of its step.
    fn unit(self) -> f32 {
        match self {
            InputParts::One => 1.0,
            InputParts::Two => LOW_PART,
        }
    }
}

/// Input rows rounded for weights of `bits` and `group`, in the kernel's layout.
pub struct RoundedRows {
    isa: Int8Isa,
    parts: InputParts,
    bits: u32,
    group: usize,
    cols: usize,
    rows: usize,
    /// Values of `r`, `steps` and `sums` a row, for the kernel's per-row lookups.
    parts_per_row: usize,
    steps_per_row: usize,
    sums_per_row: usize,
    /// The AVX-512 kernel's super-blocks (superblocks.rs); `None` for AVX2.
    superblocks: Option<Arc<Superblocks>>,
    /// `[rows, parts, cols]` int8: each row's high parts `h`, then (two parts) its low parts
    /// `l`, each block in the kernel's column order, and with super-blocks each super-block's
    /// lanes in the network's order.
    r: Vec<i8>,
    /// `[rows, steps_per_row]`: the step of `X` (`d_g`, or `d_g / 128` with two parts) of each
    /// lane's group: with super-blocks, 16 lanes each in the network's order; for AVX2, each
    /// lane of each block.
    steps: Vec<f32>,
    /// `[rows, steps_per_row]`: the sum of each group's rounded inputs, times its step: with
    /// super-blocks in the lanes of `steps`, in the first lane of each group (the others zero:
    /// a group may fill several lanes, and its bias term counts once); for AVX2, one a group.
    sums: Vec<f32>,
}

/// What rounding one row needs to know of the layout.
#[derive(Clone, Copy)]
struct Shape<'a> {
    parts: InputParts,
    cols: usize,
    group: usize,
    /// Columns a step of `steps` covers.
    lane_cols: usize,
    /// Columns of a 4-bit block (its input laid out evens then odds), or `None` for 8 bits.
    nibble_block: Option<usize>,
    block_cols: usize,
    superblocks: Option<&'a Superblocks>,
}

impl RoundedRows {
    /// `x`'s rows of `cols` inputs each.
    pub fn new(
        (isa, parts): (Int8Isa, InputParts),
        x: &[f32],
        cols: usize,
        bits: u32,
        group: usize,
    ) -> Self {
        assert!(
            Int8Isa::available().contains(&isa),
            "{isa:?} is not available"
        );
        let rows = x.len() / cols;
        let count = parts.count();
        let block_cols = isa.block_cols(bits);
        assert!(cols.is_multiple_of(block_cols) && cols.is_multiple_of(group) && group >= 32);
        assert!(group.is_multiple_of(LANES));
        let superblocks =
            (isa == Int8Isa::Avx512Vnni).then(|| Superblocks::shared(cols, block_cols, group));
        let shape = Shape {
            parts,
            cols,
            group,
            lane_cols: block_cols / isa.lanes(),
            nibble_block: (bits == 4).then_some(block_cols),
            block_cols,
            superblocks: superblocks.as_deref(),
        };
        let parts_per_row = count * cols;
        let steps_per_row = match &superblocks {
            Some(sb) => sb.list.len() * VECTOR_LANES,
            None => cols / shape.lane_cols,
        };
        let mut r = vec![0i8; rows * parts_per_row];
        let mut steps = vec![0f32; rows * steps_per_row];
        let sums_per_row = match &superblocks {
            Some(_) => steps_per_row,
            None => cols / group,
        };
        let mut sums = vec![0f32; rows * sums_per_row];
        // Rows in parallel: a prefill chunk's input is hundreds of rows, and rounded on one
        // thread it held up the whole stage's region.
        team::for_chunks3(
            (&mut r, parts_per_row),
            (&mut steps, steps_per_row),
            (&mut sums, sums_per_row),
            |i, out, steps, sums| {
                let row = Row {
                    x: &x[i * cols..(i + 1) * cols],
                    out,
                    steps,
                    sums,
                };
                // SAFETY: `isa` is available (asserted above), and each implies what its build
                // enables.
                unsafe {
                    match isa {
                        Int8Isa::Avx2 => round_row_avx2(&shape, row),
                        Int8Isa::Avx512Vnni => round_row_avx512(&shape, row),
                    }
                }
            },
        );
        RoundedRows {
            isa,
            parts,
            bits,
            group,
            cols,
            rows,
            parts_per_row,
            steps_per_row,
            sums_per_row,
            superblocks,
            r,
            steps,
            sums,
        }
    }

    /// The rows `pick` names (all of them, in order, for `None`), as a product reads them.
    pub fn picked<'a>(&'a self, pick: Option<&'a [usize]>) -> Picked<'a> {
        let all = self.rows;
        if let Some(p) = pick {
            assert!(
                p.iter().all(|&i| i < all),
                "a picked row is past the input's {all}"
            );
        }
        Picked {
            x: self,
            pick,
            rows: pick.map_or(all, <[usize]>::len),
        }
    }
}

/// Rows of a [`RoundedRows`] in a chosen order: a prefill's routed experts each read a few rows
/// of the one rounded input, instead of rounding a gathered copy of them each.
pub struct Picked<'a> {
    x: &'a RoundedRows,
    pick: Option<&'a [usize]>,
    rows: usize,
}

impl Picked<'_> {
    /// Whether these rows are laid out for `w`.
    pub fn fit(&self, w: &QuantMatrix) -> bool {
        let x = self.x;
        x.isa.fits(w) && (x.bits, x.group, x.cols) == (w.bits(), w.group_size(), w.cols())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub(super) fn isa(&self) -> Int8Isa {
        self.x.isa
    }

    pub(super) fn parts(&self) -> InputParts {
        self.x.parts
    }

    // No divisions here: a short product's tile is a few hundred cycles, and two divisions a
    // row made a 2,048 x 512 product of 8 rows a tenth slower.
    #[inline(always)]
    fn source(&self, i: usize) -> usize {
        self.pick.map_or(i, |p| p[i])
    }

    /// Row `i`'s high parts; its low parts (if any) follow them, `cols` bytes on.
    pub(super) fn row_parts(&self, i: usize) -> *const i8 {
        let x = self.x;
        x.r[self.source(i) * x.parts_per_row..].as_ptr()
    }

    /// The super-blocks of the AVX-512 layout.
    pub(super) fn superblocks(&self) -> &Superblocks {
        self.x
            .superblocks
            .as_ref()
            .expect("only the AVX-512 layout has super-blocks")
    }

    /// Row `i`'s steps (see [`RoundedRows`]'s `steps`).
    pub(super) fn steps(&self, i: usize) -> &[f32] {
        let per_row = self.x.steps_per_row;
        &self.x.steps[self.source(i) * per_row..][..per_row]
    }

    /// Row `i`'s sums of rounded inputs (see [`RoundedRows`]'s `sums`).
    pub(super) fn sums(&self, i: usize) -> &[f32] {
        let per_row = self.x.sums_per_row;
        &self.x.sums[self.source(i) * per_row..][..per_row]
    }
}

/// One input row and where its rounding goes.
struct Row<'a> {
    x: &'a [f32],
    out: &'a mut [i8],
    steps: &'a mut [f32],
    sums: &'a mut [f32],
}

#[target_feature(enable = "avx2,fma")]
fn round_row_avx2(shape: &Shape, row: Row) {
    round_row(shape, row)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn round_row_avx512(shape: &Shape, row: Row) {
    let Some(plan) = shape.superblocks else {
        return round_row(shape, row);
    };
    // Rounded in the blocks' order, then each super-block's lanes moved as its codes' are.
    let Row {
        x,
        out: packed,
        steps,
        sums,
    } = row;
    let mut natural = vec![0i8; packed.len()];
    let out = &mut natural;
    round_row(
        shape,
        Row {
            x,
            out,
            steps,
            sums,
        },
    );
    // SAFETY: this function's build has AVX-512 F.
    unsafe { super::int8_avx512::pack_inputs(plan, shape.block_cols, &natural, packed) };
}

/// Lanes of the loops written for the compiler to vectorise (a group is a multiple of them).
const LANES: usize = 16;

#[inline(always)]
fn round_row(s: &Shape, row: Row) {
    let Row {
        x,
        out,
        steps,
        sums,
    } = row;
    let (cols, group) = (s.cols, s.group);
    let unit = s.parts.unit();
    let mut rounded = vec![0i8; 2 * cols];
    let (high, low) = rounded.split_at_mut(cols);
    let per_group = if s.superblocks.is_some() {
        cols / group
    } else {
        0
    };
    let (mut group_steps, mut group_sums) = (vec![0f32; per_group], vec![0f32; per_group]);
    for (g, xg) in x.chunks_exact(group).enumerate() {
        let step = largest_magnitude(xg) / 127.0;
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        let at = g * group..(g + 1) * group;
        let total = match s.parts {
            InputParts::One => round_group::<false>(xg, inv, &mut high[at.clone()], &mut low[at]),
            InputParts::Two => round_group::<true>(xg, inv, &mut high[at.clone()], &mut low[at]),
        };
        let sum = total as f32 * (step / unit);
        match s.superblocks {
            // Gathered into the super-blocks' lanes below.
            Some(_) => (group_steps[g], group_sums[g]) = (step / unit, sum),
            None => {
                sums[g] = sum;
                steps[g * group / s.lane_cols..][..group / s.lane_cols].fill(step / unit);
            }
        }
    }
    for (dst, src) in out.chunks_exact_mut(cols).zip([&*high, &*low]) {
        match s.nibble_block {
            Some(64) => evens_then_odds::<32>(src, dst),
            Some(128) => evens_then_odds::<64>(src, dst),
            Some(b) => unreachable!("no int8 kernel has 4-bit blocks of {b} columns"),
            None => dst.copy_from_slice(src),
        }
    }
    let Some(plan) = s.superblocks else { return };
    let lanes = steps
        .chunks_exact_mut(VECTOR_LANES)
        .zip(sums.chunks_exact_mut(VECTOR_LANES));
    for (sb, (steps, sums)) in plan.list.iter().zip(lanes) {
        for (l, &g) in sb.lane_group.iter().enumerate() {
            let g = sb.first_group + g as usize;
            steps[l] = group_steps[g];
            let first = sb.lane_group.iter().position(|&h| h == sb.lane_group[l]) == Some(l);
            sums[l] = if first { group_sums[g] } else { 0.0 };
        }
    }
}

/// `max |x|`, 16 lanes at a time. Exact whatever the order (a maximum rounds nothing). A NaN
/// wins, so the group's step is NaN and the product's output too, as the f32 path gives.
#[inline(always)]
fn largest_magnitude(xg: &[f32]) -> f32 {
    let larger = |m: f32, a: f32| if a > m || a.is_nan() { a } else { m };
    let mut m = [0f32; LANES];
    for c in xg.chunks_exact(LANES) {
        for (m, v) in m.iter_mut().zip(c) {
            *m = larger(*m, v.abs());
        }
    }
    m.iter().fold(0f32, |a, &b| larger(a, b))
}

/// A group's parts of `y = x · inv`: `h = round(y)` (ties to even), and with two parts
/// `l = round(128·(y − h))`; returns the group's `Σ X` in units of its step.
#[inline(always)]
fn round_group<const TWO: bool>(xg: &[f32], inv: f32, high: &mut [i8], low: &mut [i8]) -> i32 {
    let mut total = [0i32; LANES];
    let rows = high.chunks_exact_mut(LANES).zip(xg.chunks_exact(LANES));
    if TWO {
        for ((h, x), l) in rows.zip(low.chunks_exact_mut(LANES)) {
            for i in 0..LANES {
                let y = x[i] * inv;
                let hi = nearest(y).clamp(-127, 127);
                let li = nearest((y - hi as f32) * LOW_PART).clamp(-127, 127);
                (h[i], l[i]) = (hi as i8, li as i8);
                total[i] += (hi << LOW_PART_SHIFT) + li;
            }
        }
    } else {
        for (h, x) in rows {
            for i in 0..LANES {
                let hi = nearest(x[i] * inv).clamp(-127, 127);
                h[i] = hi as i8;
                total[i] += hi;
            }
        }
    }
    total.iter().sum()
}

/// `y` (|y| < 2²²) to the nearest integer, ties to even: adding 1.5·2²³ leaves the integer in
/// the sum's low mantissa bits (its ulp is 1), read back as an integer difference. Plain f32 and
/// i32 operations that vectorise, where `f32::round` is a libm call per value on baseline x86-64
/// and a saturating cast to i8 takes extra compares.
#[inline(always)]
fn nearest(y: f32) -> i32 {
    const SHIFT: f32 = 12_582_912.0;
    (y + SHIFT).to_bits() as i32 - SHIFT.to_bits() as i32
}

/// A 4-bit block's inputs as its codes' bytes hold them: the even columns (low nibbles), then the
/// odd ones (high nibbles), `HALF` each.
#[inline(always)]
fn evens_then_odds<const HALF: usize>(src: &[i8], dst: &mut [i8]) {
    for (o, b) in dst
        .chunks_exact_mut(2 * HALF)
        .zip(src.chunks_exact(2 * HALF))
    {
        let (evens, odds) = o.split_at_mut(HALF);
        for ((e, d), pair) in evens.iter_mut().zip(odds).zip(b.chunks_exact(2)) {
            (*e, *d) = (pair[0], pair[1]);
        }
    }
}
