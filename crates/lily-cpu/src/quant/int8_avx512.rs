//! The int8 kernel for AVX-512 VNNI (quant/int8.rs has the definition and the input layout,
//! superblocks.rs how a lane's integer sum runs over several blocks).
//!
//! A weight row and an input row give, for each group `g`, the exact integer `I_g = Σ q·X` over
//! the group's columns in the lanes the network gives it, then `I_g·(s_g·u_g)` plus the bias
//! term in f32 a super-block, then the lanes' sum. Two kinds of pass compute those same integers
//! in the same lanes, so the results are the same bits whichever runs:
//!
//! - packed, where more input rows than a pass takes share the weights (a prefill's projections
//!   and most of its experts): each weight row's codes go through the network once into a
//!   buffer in L1, split into nibbles, and every pass reads them from there;
//! - direct, where one pass takes all the input rows (a decode step): the pass puts the codes
//!   through the network as it reads them.
//!
//! Either way the inner loop is `vpdpbusd` into integer sums, scaled once a super-block (up to
//! 16 blocks) where the first form of this kernel converted, scaled and added every block.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use lily_core::quant::QuantMatrix;

use super::int8::{LOW_PART_SHIFT, Picked, prefetch_codes};
use super::superblocks::{LANES, Superblock, Superblocks, totals};

mod network;
pub(super) use network::pack_inputs;
use network::{mix, superblock_network};

/// Code bytes in a block (one vector).
const BLOCK_BYTES: usize = 64;

/// `out_t[(j - first) · rows + i] = W[j] · x_i` for `out_t.len() / rows` weight rows from
/// `first`, with inputs of `P` parts and codes of `B` bits.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn product_rows<const P: usize, const B: usize>(
    w: &QuantMatrix,
    first: usize,
    x: &Picked,
    out_t: &mut [f32],
) {
    let rows = x.rows();
    let net = Net::of(w, x.superblocks());
    let count = out_t.len() / rows;
    // Weight rows go four at a time: in a packed pass each input vector loaded feeds four of
    // them, and in either kind a pass's scales and its sums' fold are shared by its pairs.
    let quads = count / 4;
    let mut place = Tile { first, j: 0, at: 0 };
    if rows > rows_per_pass::<P>() {
        let per_row = net.blocks * halves::<B>();
        let mut packed = vec![_mm512_setzero_si512(); 4 * per_row];
        for j in (0..4 * quads).step_by(4) {
            for p in 0..4 {
                pack::<B>(w, first + j + p, &net, &mut packed[p * per_row..]);
            }
            place.j = j;
            packed_passes::<4, P, B>(w, &net, x, &packed, place, out_t);
        }
        // Rows left over after the last four go one at a time.
        for j in 4 * quads..count {
            pack::<B>(w, first + j, &net, &mut packed);
            place.j = j;
            packed_passes::<1, P, B>(w, &net, x, &packed, place, out_t);
        }
    } else {
        for j in (0..4 * quads).step_by(4) {
            place.j = j;
            direct_pass_of::<4, P, B>(w, &net, x, place, out_t);
        }
        for j in 4 * quads..count {
            place.j = j;
            direct_pass_of::<1, P, B>(w, &net, x, place, out_t);
        }
    }
}

/// Input rows a pass takes: four with one part, two with two (their sums take twice the
/// registers).
const fn rows_per_pass<const P: usize>() -> usize {
    if P == 1 { 4 } else { 2 }
}

/// [`direct_pass`] for all of `x`'s rows (at most [`rows_per_pass`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn direct_pass_of<const J: usize, const P: usize, const B: usize>(
    w: &QuantMatrix,
    net: &Net,
    x: &Picked,
    place: Tile,
    out_t: &mut [f32],
) {
    match x.rows() {
        1 => direct_pass::<J, 1, P, B>(w, net, x, place, out_t),
        2 => direct_pass::<J, 2, P, B>(w, net, x, place, out_t),
        3 if P == 1 => direct_pass::<J, 3, P, B>(w, net, x, place, out_t),
        _ if P == 1 => direct_pass::<J, 4, P, B>(w, net, x, place, out_t),
        n => unreachable!("{n} rows are more than a pass of two-part inputs"),
    }
}

/// Code vectors a block takes once split: low and high nibbles, or the bytes.
const fn halves<const B: usize>() -> usize {
    if B == 4 { 2 } else { 1 }
}

/// What a product's shape fixes for all its rows, worked out once per call.
struct Net<'a> {
    plan: &'a Superblocks,
    blocks: usize,
    block_cols: usize,
}

impl<'a> Net<'a> {
    fn of(w: &QuantMatrix, plan: &'a Superblocks) -> Self {
        let block_cols = BLOCK_BYTES * 8 / w.bits() as usize;
        Net {
            plan,
            blocks: w.cols() / block_cols,
            block_cols,
        }
    }
}

/// Where a pass lies: weight rows `first + j..` (its results at `out_t[j·rows..]`), input rows
/// `at..`.
#[derive(Clone, Copy)]
struct Tile {
    first: usize,
    j: usize,
    at: usize,
}

/// Weight row `row`'s codes through the network, split, into `out` (`blocks · halves` vectors
/// in the packed order).
#[target_feature(enable = "avx512f,avx512bw")]
fn pack<const B: usize>(w: &QuantMatrix, row: usize, net: &Net, out: &mut [__m512i]) {
    let codes = w.row_codes(row);
    assert!(out.len() >= net.blocks * halves::<B>() && codes.len() * 4 == net.blocks * BLOCK_BYTES);
    let (codes, out) = (codes.as_ptr() as *const u8, out.as_mut_ptr());
    let nibbles = _mm512_set1_epi8(0x0f);
    for sb in &net.plan.list {
        let first = sb.first_block;
        let src = codes.wrapping_add(first * BLOCK_BYTES);
        for k in 0..sb.blocks() {
            prefetch_codes(src.wrapping_add(k * BLOCK_BYTES));
        }
        // SAFETY: the super-block's blocks lie inside the row, and their split vectors inside
        // `out` (both asserted above).
        unsafe {
            superblock_network(sb.blocks(), net.plan.first_run, src, BLOCK_BYTES, |k, v| {
                let at = out.add((first + k) * halves::<B>());
                if B == 4 {
                    at.write(_mm512_and_si512(v, nibbles));
                    at.add(1)
                        .write(_mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles));
                } else {
                    at.write(v);
                }
            })
        }
    }
}

/// The packed weight rows `j..j + J` (in `packed`, one after another) against every input row,
/// [`rows_per_pass`] at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn packed_passes<const J: usize, const P: usize, const B: usize>(
    w: &QuantMatrix,
    net: &Net,
    x: &Picked,
    packed: &[__m512i],
    mut place: Tile,
    out_t: &mut [f32],
) {
    let (rows, step) = (x.rows(), rows_per_pass::<P>());
    for at in (0..rows).step_by(step) {
        place.at = at;
        match (rows - at).min(step) {
            1 => packed_pass::<J, 1, P, B>(w, net, x, packed, place, out_t),
            2 => packed_pass::<J, 2, P, B>(w, net, x, packed, place, out_t),
            3 => packed_pass::<J, 3, P, B>(w, net, x, packed, place, out_t),
            _ => packed_pass::<J, 4, P, B>(w, net, x, packed, place, out_t),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn packed_pass<const J: usize, const R: usize, const P: usize, const B: usize>(
    w: &QuantMatrix,
    net: &Net,
    x: &Picked,
    packed: &[__m512i],
    place: Tile,
    out_t: &mut [f32],
) {
    let (cols, h) = (w.cols(), halves::<B>());
    assert!(place.at + R <= x.rows() && packed.len() >= J * net.blocks * h);
    let r: [*const i8; R] = std::array::from_fn(|i| x.row_parts(place.at + i));
    let mut acc = [[_mm512_setzero_ps(); R]; J];
    for (s, sb) in net.plan.list.iter().enumerate() {
        // SAFETY: this function's build has AVX-512 F, BW and VL.
        let scales = unsafe { LaneScales::<J, R>::of(w, x, (s, sb), place) };
        let mut high = [[_mm512_setzero_si512(); R]; J];
        let mut low = [[_mm512_setzero_si512(); R]; J];
        for b in sb.first_block..sb.first_block + sb.blocks() {
            let wv: [[__m512i; 2]; J] = std::array::from_fn(|p| {
                let at = (p * net.blocks + b) * h;
                [packed[at], if B == 4 { packed[at + 1] } else { packed[at] }]
            });
            for i in 0..R {
                // SAFETY: the block's inputs of each part lie inside the input row.
                let load = |part: usize, half: usize| unsafe {
                    let at = r[i].add(part * cols + b * net.block_cols + half * BLOCK_BYTES);
                    _mm512_loadu_si512(at as *const _)
                };
                let xh = [load(0, 0), if B == 4 { load(0, 1) } else { load(0, 0) }];
                for p in 0..J {
                    high[p][i] = _mm512_dpbusd_epi32(high[p][i], wv[p][0], xh[0]);
                    if B == 4 {
                        high[p][i] = _mm512_dpbusd_epi32(high[p][i], wv[p][1], xh[1]);
                    }
                }
                if P == 2 {
                    let xl = [load(1, 0), if B == 4 { load(1, 1) } else { load(1, 0) }];
                    for p in 0..J {
                        low[p][i] = _mm512_dpbusd_epi32(low[p][i], wv[p][0], xl[0]);
                        if B == 4 {
                            low[p][i] = _mm512_dpbusd_epi32(low[p][i], wv[p][1], xl[1]);
                        }
                    }
                }
            }
        }
        for p in 0..J {
            for i in 0..R {
                let sum = match P {
                    2 => _mm512_add_epi32(
                        _mm512_slli_epi32(high[p][i], LOW_PART_SHIFT as u32),
                        low[p][i],
                    ),
                    _ => high[p][i],
                };
                // SAFETY: as above.
                acc[p][i] = unsafe { scales.add(p, i, sum, acc[p][i]) };
            }
        }
    }
    finish::<J, R>(net, x, place, &acc, out_t);
}

/// Weight rows `first + j..first + j + J` against input rows `at..at + R`, their codes put
/// through the network as they are read (one pass reads them: nothing to keep).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn direct_pass<const J: usize, const R: usize, const P: usize, const B: usize>(
    w: &QuantMatrix,
    net: &Net,
    x: &Picked,
    place: Tile,
    out_t: &mut [f32],
) {
    let cols = w.cols();
    assert!(place.at + R <= x.rows());
    let codes: [*const u8; J] = std::array::from_fn(|p| {
        let row = w.row_codes(place.first + place.j + p);
        assert_eq!(row.len() * 4, net.blocks * BLOCK_BYTES);
        row.as_ptr() as *const u8
    });
    let r: [*const i8; R] = std::array::from_fn(|i| x.row_parts(place.at + i));
    let nibbles = _mm512_set1_epi8(0x0f);
    let mut acc = [[_mm512_setzero_ps(); R]; J];
    // A row at a time, all its super-blocks: the codes are read in order. (Super-block by
    // super-block, four rows' codes were read in runs of 512 bytes a kilobyte apart, which the
    // prefetchers followed at two thirds of the rate.)
    for p in 0..J {
        for (s, sb) in net.plan.list.iter().enumerate() {
            let first = sb.first_block;
            let row = Tile {
                j: place.j + p,
                ..place
            };
            // SAFETY: this function's build has AVX-512 F, BW and VL.
            let scales = unsafe { LaneScales::<1, R>::of(w, x, (s, sb), row) };
            let src = codes[p].wrapping_add(first * BLOCK_BYTES);
            for k in 0..sb.blocks() {
                prefetch_codes(src.wrapping_add(k * BLOCK_BYTES));
            }
            // A chain of sums per nibble: one chain of a super-block's sixteen `vpdpbusd` would
            // wait on each one's latency, with one input row a pass. (Chains chosen by block
            // index are indexed at run time, so they live in memory.)
            let mut chains = [[[_mm512_setzero_si512(); R]; 2]; 4];
            // SAFETY: the super-block's blocks lie inside the row (asserted above), and each
            // block's inputs of each part inside the input row.
            unsafe {
                superblock_network(sb.blocks(), net.plan.first_run, src, BLOCK_BYTES, |k, v| {
                    let wv = match B {
                        4 => [
                            _mm512_and_si512(v, nibbles),
                            _mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles),
                        ],
                        _ => [v, v],
                    };
                    let b = first + k;
                    for i in 0..R {
                        let load = |part: usize, half: usize| {
                            let at =
                                r[i].add(part * cols + b * net.block_cols + half * BLOCK_BYTES);
                            _mm512_loadu_si512(at as *const _)
                        };
                        for half in 0..halves::<B>() {
                            let chain = &mut chains[2 * (k % 2) + half];
                            for (part, sums) in chain.iter_mut().enumerate().take(P) {
                                let c = &mut sums[i];
                                *c = _mm512_dpbusd_epi32(*c, wv[half], load(part, half));
                            }
                        }
                    }
                })
            }
            let mut sums = [_mm512_setzero_si512(); R];
            for (i, sum) in sums.iter_mut().enumerate() {
                let chain = |part: usize, n: usize| chains[n][part][i];
                let four = |part| {
                    let (a, b) = (
                        _mm512_add_epi32(chain(part, 0), chain(part, 1)),
                        _mm512_add_epi32(chain(part, 2), chain(part, 3)),
                    );
                    _mm512_add_epi32(a, b)
                };
                let high = four(0);
                *sum = match P {
                    2 => {
                        let low = four(1);
                        _mm512_add_epi32(_mm512_slli_epi32(high, LOW_PART_SHIFT as u32), low)
                    }
                    _ => high,
                };
            }
            for i in 0..R {
                // SAFETY: as above.
                acc[p][i] = unsafe { scales.add(0, i, sums[i], acc[p][i]) };
            }
        }
    }
    finish::<J, R>(net, x, place, &acc, out_t);
}

/// What super-block `s` scales its integer sums with, in its lanes, for weight rows
/// `first + j..` and input rows `at..`: each lane's `s_g·u_g` a pair, and the bias term's
/// factors (`b_g` a weight row, `u_g·Σ X` an input row). Made before the super-block's sums, so
/// that loading the scales (a stream of their own, from memory in a decode step) overlaps the
/// arithmetic rather than waiting at its end.
struct LaneScales<const J: usize, const R: usize> {
    scale_step: [[__m512; R]; J],
    bias: [__m512; J],
    sum: [__m512; R],
}

impl<const J: usize, const R: usize> LaneScales<J, R> {
    /// # Safety
    /// The CPU must support AVX-512 F, BW and VL. Not a `target_feature` function, so that it
    /// inlines into the passes (which are), per weight row and super-block in a direct pass.
    #[inline(always)]
    unsafe fn of(w: &QuantMatrix, x: &Picked, (s, sb): (usize, &Superblock), place: Tile) -> Self {
        // SAFETY: the caller's promise; each load is of 16 values inside its slice.
        unsafe {
            let lane_group = _mm512_loadu_si512(sb.lane_group.as_ptr() as *const _);
            let mut out = LaneScales {
                scale_step: [[_mm512_setzero_ps(); R]; J],
                bias: [_mm512_setzero_ps(); J],
                sum: [_mm512_setzero_ps(); R],
            };
            let mut steps = [_mm512_setzero_ps(); R];
            for (i, (step, sum)) in steps.iter_mut().zip(&mut out.sum).enumerate() {
                let lanes = s * LANES..(s + 1) * LANES;
                *step = _mm512_loadu_ps(x.steps(place.at + i)[lanes.clone()].as_ptr());
                *sum = _mm512_loadu_ps(x.sums(place.at + i)[lanes].as_ptr());
            }
            for p in 0..J {
                let row = place.first + place.j + p;
                let groups = sb.first_group..sb.first_group + sb.groups;
                let scales = widen_bf16(&w.row_scales(row)[groups.clone()]);
                let scale = _mm512_permutexvar_ps(lane_group, scales);
                out.bias[p] =
                    _mm512_permutexvar_ps(lane_group, widen_bf16(&w.row_biases(row)[groups]));
                for (scale_step, step) in out.scale_step[p].iter_mut().zip(&steps) {
                    *scale_step = _mm512_mul_ps(scale, *step);
                }
            }
            out
        }
    }

    /// Pair (p, i)'s integer sums over the super-block and its bias term, into `acc`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F (inlined as [`Self::of`] is).
    #[inline(always)]
    unsafe fn add(&self, p: usize, i: usize, sum: __m512i, acc: __m512) -> __m512 {
        // SAFETY: the caller's promise.
        unsafe {
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), self.scale_step[p][i], acc);
            _mm512_fmadd_ps(self.bias[p], self.sum[i], acc)
        }
    }
}

/// Each pair's lanes summed into `out_t`: all of a pass's pairs in one fold ([`totals`]: ~3
/// instructions a pair at sixteen, where summing each vector alone took ~10), which sums each
/// pair's lanes in the same tree whatever the pass's shape.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn finish<const J: usize, const R: usize>(
    net: &Net,
    x: &Picked,
    Tile { j, at, .. }: Tile,
    acc: &[[__m512; R]; J],
    out_t: &mut [f32],
) {
    const { assert!(J * R <= LANES) };
    let rows = x.rows();
    assert!(out_t.len() >= (j + J) * rows);
    let mut slots = [_mm512_setzero_ps(); LANES];
    for p in 0..J {
        slots[p * R..(p + 1) * R].copy_from_slice(&acc[p]);
    }
    let count = (J * R).next_power_of_two();
    totals(count, |c, a, b, run| {
        let (a, b) = (_mm512_castps_si512(slots[a]), _mm512_castps_si512(slots[b]));
        // SAFETY: this function's build has AVX-512 F.
        let (first, second) = unsafe { (mix(a, b, run, false), mix(a, b, run, true)) };
        slots[c] = _mm512_add_ps(_mm512_castsi512_ps(first), _mm512_castsi512_ps(second));
    });
    let mut lanes = [0f32; LANES];
    // SAFETY: 16 f32 values.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), slots[0]) };
    let total_lane = &net.plan.total_lanes[count.trailing_zeros() as usize];
    for p in 0..J {
        for i in 0..R {
            out_t[(j + p) * rows + at + i] = lanes[total_lane[p * R + i] as usize];
        }
    }
}

/// Up to 16 bf16 values as f32 lanes (missing ones zero).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn widen_bf16(v: &[half::bf16]) -> __m512 {
    let n = v.len().min(LANES);
    // SAFETY: the mask loads only the first `n` u16 values, all inside `v`.
    let h = unsafe { _mm256_maskz_loadu_epi16(mask(n) as __mmask16, v.as_ptr() as *const _) };
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
}

fn mask(n: usize) -> u16 {
    if n >= LANES {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}
