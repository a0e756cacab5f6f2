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
//! is `128·Σ q·h + Σ q·l`, exact in i32: a group's is at most 128·255·(128·127 + 64) < 2³¹ (128
//! columns of 8-bit codes, the widest group), and no lane sums more than one group's. The bias
//! term takes the sum of the rounded inputs (one per group and row, made once per product), as
//! llama.cpp's q8_1 blocks carry it, not the exact sum: so the rounding error meets the whole
//! weight `s·q + b`, centred on zero, rather than `s·q` alone, whose codes average 7.5. Measured on the tiny model's
//! fixtures: 1.1-1.3e-4 of the largest logit from mlx-lm, against 4.0-4.4e-4 with the exact sum.
//!
//! A block is one vector of code bytes: with AVX-512, 64 bytes, 128 columns of 4 bits or 64 of
//! 8; with AVX2, 32 bytes, 64 columns of 4 bits (int8_avx2.rs). Each int32 lane of a product
//! sums four bytes, so lane `l` covers columns `8l..8l+8` (4 bits: the low nibbles are the even
//! columns, the high nibbles the odd ones, and the input's block is laid out evens then odds) or
//! `4l..4l+4` (8 bits). A lane never straddles a group (groups are 32 columns or more), so one
//! scale per lane applies. The AVX-512 kernel (int8_avx512.rs) keeps a lane in one group over
//! several blocks (superblocks.rs) and scales its integer sum once for all of them.
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
pub(super) fn prefetch_codes(codes: *const u8) {
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
                (InputParts::One, 4) => {
                    super::int8_avx512::product_rows::<1, 4>(w, first, x, out_t)
                }
                (InputParts::One, _) => {
                    super::int8_avx512::product_rows::<1, 8>(w, first, x, out_t)
                }
                (InputParts::Two, 4) => {
                    super::int8_avx512::product_rows::<2, 4>(w, first, x, out_t)
                }
                (InputParts::Two, _) => {
                    super::int8_avx512::product_rows::<2, 8>(w, first, x, out_t)
                }
            },
        }
    }
}
