//! Input rows rounded to int8 parts in the int8 kernels' layout (int8.rs says what the parts
//! are and why). Rounding a prefill's inputs is a large share of a product's time (a chunk's
//! experts round 2,304 rows a layer), so each row is rounded in code built for the kernel's own
//! instruction set: written as plain loops over 16 lanes, which the compiler vectorises there.
//! The results are the same bits in either build.

use lily_core::quant::QuantMatrix;

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
    /// `cols / lane columns` and `cols / group`, for the kernel's per-row lookups.
    lanes_per_row: usize,
    groups_per_row: usize,
    /// `[rows, parts, cols]` int8: each row's high parts `h`, then (two parts) its low parts
    /// `l`, each block in the kernel's column order.
    r: Vec<i8>,
    /// `[rows, cols / cols_per_lane]`: the step of `X` in each lane's group (`d_g`, or
    /// `d_g / 128` with two parts).
    steps: Vec<f32>,
    /// `[rows, cols / group]`: the sum of each group's rounded inputs.
    sums: Vec<f32>,
}

/// What rounding one row needs to know of the layout.
#[derive(Clone, Copy)]
struct Shape {
    parts: InputParts,
    cols: usize,
    group: usize,
    /// Columns a step of `steps` covers.
    lane_cols: usize,
    /// Columns of a 4-bit block (its input laid out evens then odds), or `None` for 8 bits.
    nibble_block: Option<usize>,
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
        let shape = Shape {
            parts,
            cols,
            group,
            lane_cols: block_cols / isa.lanes(),
            nibble_block: (bits == 4).then_some(block_cols),
        };
        let mut r = vec![0i8; rows * count * cols];
        let mut steps = vec![0f32; rows * cols / shape.lane_cols];
        let mut sums = vec![0f32; rows * cols / group];
        // Rows in parallel: a prefill chunk's input is hundreds of rows, and rounded on one
        // thread it held up the whole stage's region.
        team::for_chunks3(
            (&mut r, count * cols),
            (&mut steps, cols / shape.lane_cols),
            (&mut sums, cols / group),
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
            lanes_per_row: cols / shape.lane_cols,
            groups_per_row: cols / group,
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
        x.r[self.source(i) * x.parts.count() * x.cols..].as_ptr()
    }

    /// Row `i`'s steps, one per lane of each block.
    pub(super) fn steps(&self, i: usize) -> &[f32] {
        let per_row = self.x.lanes_per_row;
        &self.x.steps[self.source(i) * per_row..][..per_row]
    }

    /// Row `i`'s sums of rounded inputs, one per group.
    pub(super) fn sums(&self, i: usize) -> &[f32] {
        let per_row = self.x.groups_per_row;
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
    round_row(shape, row)
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
    for (g, xg) in x.chunks_exact(group).enumerate() {
        let step = largest_magnitude(xg) / 127.0;
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        let at = g * group..(g + 1) * group;
        let total = match s.parts {
            InputParts::One => round_group::<false>(xg, inv, &mut high[at.clone()], &mut low[at]),
            InputParts::Two => round_group::<true>(xg, inv, &mut high[at.clone()], &mut low[at]),
        };
        sums[g] = total as f32 * (step / unit);
        steps[g * group / s.lane_cols..][..group / s.lane_cols].fill(step / unit);
    }
    for (dst, src) in out.chunks_exact_mut(cols).zip([&*high, &*low]) {
        match s.nibble_block {
            Some(64) => evens_then_odds::<32>(src, dst),
            Some(128) => evens_then_odds::<64>(src, dst),
            Some(b) => unreachable!("no int8 kernel has 4-bit blocks of {b} columns"),
            None => dst.copy_from_slice(src),
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
