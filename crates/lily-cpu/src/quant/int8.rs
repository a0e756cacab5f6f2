//! Products with the input rounded per weight group to one int8 part, as llama.cpp's CPU path
//! computes, or to two: integer dot products of codes and rounded inputs (AVX-512 VNNI
//! `vpdpbusd`, 64 byte products per instruction), scaled per group afterwards. Opt-in
//! ([`crate::Numerics::Int8Inputs`]); docs/BENCHMARKS.md has what the rounding costs.
//!
//! For an input row `x` and a weight row of groups `g` (`w = s_g·q + b_g`), with
//! `d_g = max|x_c| / 127` over the group, one part is `h_c = round(x_c / d_g)` (ties to even),
//! `X_c = h_c`, to 1/254 of the group's largest. Two add `l_c = round(128·(x_c / d_g − h_c))`
//! (|l_c| ≤ 64): `X_c = 128·h_c + l_c`, `x_c ≈ (d_g/128)·X_c`, to 1/32,512 of it. One part moved
//! the tiny model's logits by 2-20 % of the largest, two by ~1e-4 (BENCHMARKS.md). Then, with
//! `u` the step of `X` (`d_g`, or `d_g/128` with two parts),
//! `W·x ≈ Σ_g u·(s_g·Σ_{c∈g} q_c·X_c + b_g·Σ_{c∈g} X_c)`, where with two parts the integer sum
//! is `128·Σ q·h + Σ q·l`: four `vpdpbusd` and a shift a block, exact in i32 (at most
//! 4·255·(128·127 + 64) for a lane of four 8-bit codes). The bias term takes the sum of the
//! rounded inputs (one per group and row, made once per product), as llama.cpp's q8_1 blocks
//! carry it, not the exact sum: so the rounding error meets the whole weight `s·q + b`, centred
//! on zero, rather than `s·q` alone, whose codes average 7.5. Measured on the tiny model's
//! fixtures: 1.1-1.3e-4 of the largest logit from mlx-lm, against 4.0-4.4e-4 with the exact sum.
//!
//! A block is one vector of code bytes: with AVX-512, 64 bytes, 128 columns of 4 bits or 64 of
//! 8; with AVX2, 32 bytes, 64 columns of 4 bits (int8_avx2.rs). Each int32 lane of a product
//! sums four bytes, so lane `l` covers columns `8l..8l+8` (4 bits: the low nibbles are the even
//! columns, the high nibbles the odd ones, and the input's block is laid out evens then odds) or
//! `4l..4l+4` (8 bits). A lane never straddles a group (groups are 32 columns or more), so one
//! scale per lane applies.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::InputParts;
use super::Int8Isa;
pub(super) use super::rounded_rows::LOW_PART_SHIFT;
pub use super::rounded_rows::{Picked, RoundedRows};
use lily_core::quant::QuantMatrix;

/// Bytes ahead of the codes the AVX-512 int8 kernel is reading that it asks into L2
/// (`prefetcht1`), in the same stream. A decode step reads each weight once, from DRAM, and the
/// hardware prefetchers alone let that kernel stream its codes at a third of what a core can:
/// an lm_head-sized 4-bit product (254 MB, one input row) on the development machine's Zen 4
/// read 7.2 GB/s on one thread and 13.6 on two, against a plain read's 30 and 34; asking 32 KB
/// ahead into L2, 21 and 33. Into L1 (`prefetcht0`) it gained a fifth only; 16 to 64 KB ahead
/// measured alike. The other kernels do not ask: at one input row they compute at 7-10 GB/s a
/// core, below what the hardware prefetchers deliver (the AVX2 int8 kernel measured the same
/// with and without; the f32 tiles were a tenth slower with).
const PREFETCH_AHEAD: usize = 32 << 10;

/// Asks for the line [`PREFETCH_AHEAD`] bytes past `codes` into L2, once per line the kernel
/// reads.
#[inline(always)]
fn prefetch_codes(codes: *const u8) {
    // SAFETY: a prefetch is a hint: it reads nothing and never faults, whatever the address
    // (`wrapping_add`: past the end of the codes is allowed and ignored).
    unsafe { _mm_prefetch::<_MM_HINT_T1>(codes.wrapping_add(PREFETCH_AHEAD) as *const i8) }
}

/// Input rows per pass over a weight row.
pub(super) const ROWS_PER_PASS: usize = 4;

/// `out_t[(j - first) · rows + i] = W[j] · x_i` for the weight rows `first..first + count`,
/// with the kernel `x` was laid out for.
///
/// # Safety
/// The CPU must support that kernel (`Int8Isa::available`).
pub unsafe fn product_rows(w: &QuantMatrix, first: usize, x: &Picked, out_t: &mut [f32]) {
    assert!(x.fit(w));
    // SAFETY: the caller's promise.
    unsafe {
        match x.isa() {
            Int8Isa::Avx2 => super::int8_avx2::product_rows(w, first, x, out_t),
            // The part count and code width as constants: the block loop's choices are made
            // at compile time rather than branched on in every pair's arithmetic.
            Int8Isa::Avx512Vnni => match (x.parts(), w.bits()) {
                (InputParts::One, 4) => product_rows_avx512::<1, 4>(w, first, x, out_t),
                (InputParts::One, _) => product_rows_avx512::<1, 8>(w, first, x, out_t),
                (InputParts::Two, 4) => product_rows_avx512::<2, 4>(w, first, x, out_t),
                (InputParts::Two, _) => product_rows_avx512::<2, 8>(w, first, x, out_t),
            },
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn product_rows_avx512<const P: usize, const B: usize>(
    w: &QuantMatrix,
    first: usize,
    x: &Picked,
    out_t: &mut [f32],
) {
    let (rows, shape) = (x.rows(), Geometry::of(w));
    let count = out_t.len() / rows;
    // Weight rows go four at a time, whatever the input rows: each input block loaded feeds four
    // of them, and their sums are four independent chains. One weight row's chain (multiply-add,
    // convert, accumulate) is latency-bound: at one input row, four at a time is 1.3-1.5x
    // faster (BENCHMARKS.md). The rows left over go one at a time. Results are the same to the
    // bit either way.
    let quads = count / 4;
    let mut place = Tile { first, j: 0, at: 0 };
    for j in (0..4 * quads).step_by(4) {
        for i in (0..rows).step_by(3) {
            (place.j, place.at) = (j, i);
            match rows - i {
                1 => tile::<4, 1, P, B>(w, &shape, x, place, out_t),
                2 => tile::<4, 2, P, B>(w, &shape, x, place, out_t),
                _ => tile::<4, 3, P, B>(w, &shape, x, place, out_t),
            }
        }
    }
    for j in 4 * quads..count {
        for i in (0..rows).step_by(ROWS_PER_PASS) {
            (place.j, place.at) = (j, i);
            match rows - i {
                1 => tile::<1, 1, P, B>(w, &shape, x, place, out_t),
                2 => tile::<1, 2, P, B>(w, &shape, x, place, out_t),
                3 => tile::<1, 3, P, B>(w, &shape, x, place, out_t),
                _ => tile::<1, 4, P, B>(w, &shape, x, place, out_t),
            }
        }
    }
}

/// Where a tile lies: weight rows `first + j..` (its results at `out_t[j·rows..]`), input rows
/// `at..`.
#[derive(Clone, Copy)]
struct Tile {
    first: usize,
    j: usize,
    at: usize,
}

/// What a matrix's shape fixes for all its rows, worked out once per call: a division by a
/// run-time group size costs tens of cycles, and a short row's whole pass is a few hundred.
#[derive(Clone, Copy)]
struct Geometry {
    block_cols: usize,
    blocks: usize,
    groups: usize,
    group_shift: u32,
    /// The group of each lane within a window of 16 groups, before the block's offset.
    lane_group: __m512i,
}

impl Geometry {
    #[target_feature(enable = "avx512f")]
    fn of(w: &QuantMatrix) -> Self {
        let (cols, group) = (w.cols(), w.group_size());
        let block_cols = Int8Isa::Avx512Vnni.block_cols(w.bits());
        let lane_cols = block_cols / 16;
        let lane_group: [i32; 16] = std::array::from_fn(|l| (l * lane_cols / group) as i32);
        Geometry {
            block_cols,
            blocks: cols / block_cols,
            groups: cols / group,
            group_shift: group.trailing_zeros(),
            // SAFETY: 16 i32 values.
            lane_group: unsafe { _mm512_loadu_si512(lane_group.as_ptr() as *const _) },
        }
    }
}

/// Weight rows `first + j..first + j + J` against the input rows `at..at + R`, into `out_t`
/// (`[weight row][input row]`). Each pair's sums run in the same order whatever the tile's
/// shape, so a tile of four weight rows gives what four tiles of one give.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn tile<const J: usize, const R: usize, const P: usize, const B: usize>(
    w: &QuantMatrix,
    shape: &Geometry,
    x: &Picked,
    Tile { first, j, at }: Tile,
    out_t: &mut [f32],
) {
    let Geometry {
        block_cols,
        blocks,
        groups,
        group_shift,
        lane_group,
    } = *shape;
    let (cols, rows) = (w.cols(), x.rows());
    assert!(at + R <= rows && out_t.len() >= (j + J) * rows);
    let codes: [*const u8; J] =
        std::array::from_fn(|p| w.row_codes(first + j + p).as_ptr() as *const u8);
    let scales: [&[half::bf16]; J] = std::array::from_fn(|p| w.row_scales(first + j + p));
    let r: [*const i8; R] = std::array::from_fn(|i| x.row_parts(at + i));
    let steps: [&[f32]; R] = std::array::from_fn(|i| x.steps(at + i));
    let nibbles = _mm512_set1_epi8(0x0f);
    let mut acc = [[_mm512_setzero_ps(); R]; J];
    let mut window = [_mm512_setzero_ps(); J];
    // `blocks` is precomputed: `step_by` with a run-time step divides to count its steps.
    for b in 0..blocks {
        let block = b * block_cols;
        let first_group = block >> group_shift;
        let lanes_at = _mm512_add_epi32(lane_group, _mm512_set1_epi32((first_group % 16) as i32));
        let mut s = [_mm512_setzero_ps(); J];
        let mut lo = [_mm512_setzero_si512(); J];
        let mut hi = [_mm512_setzero_si512(); J];
        for p in 0..J {
            if first_group.is_multiple_of(16) {
                window[p] = widen_bf16(&scales[p][first_group..]);
            }
            s[p] = _mm512_permutexvar_ps(lanes_at, window[p]);
            // SAFETY: a block is 64 code bytes inside the row.
            let at = block * B / 8;
            let v = unsafe { _mm512_loadu_si512(codes[p].add(at) as *const _) };
            prefetch_codes(codes[p].wrapping_add(at));
            (lo[p], hi[p]) = match B {
                4 => (
                    _mm512_and_si512(v, nibbles),
                    _mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles),
                ),
                _ => (v, v),
            };
        }
        for i in 0..R {
            // SAFETY: `block_cols` inputs of each part lie inside each input row; `steps`
            // holds 16 lanes per block.
            let ([high_first, high_second], [low_first, low_second], step) = unsafe {
                let halves = |part: *const i8| {
                    [
                        _mm512_loadu_si512(part as *const _),
                        match B {
                            4 => _mm512_loadu_si512(part.add(64) as *const _),
                            _ => _mm512_setzero_si512(),
                        },
                    ]
                };
                let rb = r[i].add(block);
                (
                    halves(rb),
                    match P {
                        2 => halves(rb.add(cols)),
                        _ => [_mm512_setzero_si512(); 2],
                    },
                    _mm512_loadu_ps(steps[i][b * 16..].as_ptr()),
                )
            };
            for p in 0..J {
                // The high parts' sum, then (two parts) shifted into place and the low parts'
                // added to it.
                let part = |d, (first, second)| {
                    let d = _mm512_dpbusd_epi32(d, lo[p], first);
                    match B {
                        4 => _mm512_dpbusd_epi32(d, hi[p], second),
                        _ => d,
                    }
                };
                let dot = part(_mm512_setzero_si512(), (high_first, high_second));
                let dot = match P {
                    2 => part(
                        _mm512_slli_epi32(dot, LOW_PART_SHIFT as u32),
                        (low_first, low_second),
                    ),
                    _ => dot,
                };
                let scale = _mm512_mul_ps(s[p], step);
                acc[p][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[p][i]);
            }
        }
    }
    for p in 0..J {
        let biases = w.row_biases(first + j + p);
        for i in 0..R {
            let sums = x.sums(at + i);
            // The bias term, 16 groups at a time: Σ_g b_g·(sum of the input's group g), into
            // the same lanes (one reduction a pair: a short row's pass is a few hundred cycles).
            let mut sum = acc[p][i];
            for g in (0..groups).step_by(16) {
                sum = _mm512_fmadd_ps(widen_bf16(&biases[g..]), widen_f32(&sums[g..]), sum);
            }
            out_t[(j + p) * rows + at + i] = _mm512_reduce_add_ps(sum);
        }
    }
}

/// Up to 16 bf16 values as f32 lanes (missing ones zero).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn widen_bf16(v: &[half::bf16]) -> __m512 {
    let n = v.len().min(16);
    // SAFETY: the mask loads only the first `n` u16 values, all inside `v`.
    let h = unsafe { _mm256_maskz_loadu_epi16(mask(n) as __mmask16, v.as_ptr() as *const _) };
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
}

/// Up to 16 f32 values (missing ones zero).
#[target_feature(enable = "avx512f")]
fn widen_f32(v: &[f32]) -> __m512 {
    // SAFETY: the mask loads only the first `min(16, len)` values, all inside `v`.
    unsafe { _mm512_maskz_loadu_ps(mask(v.len().min(16)), v.as_ptr()) }
}

fn mask(n: usize) -> u16 {
    if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
}
