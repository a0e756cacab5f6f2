//! The int8 kernel for AVX2 (quant/int8.rs has the definition and the input layout), 4-bit
//! codes only. Per 64 columns: the low and high nibbles of 32 code bytes times the rounded
//! inputs in `vpmaddubsw` (u8 × i8 pairs summed to i16: at most 2·15·127 per pair, and the two
//! halves added stay under 2¹⁵), then `vpmaddwd` by ones to eight i32 lanes of 8 columns each.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use lily_core::quant::QuantMatrix;

use super::InputParts;
use super::Int8Isa;
use super::int8::{LOW_PART_SHIFT, Picked, ROWS_PER_PASS};

/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn product_rows(w: &QuantMatrix, first: usize, x: &Picked, out_t: &mut [f32]) {
    assert!(w.bits() == 4 && x.fit(w));
    match x.parts() {
        InputParts::One => rows_with::<1>(w, first, x, out_t),
        InputParts::Two => rows_with::<2>(w, first, x, out_t),
    }
}

/// The product with inputs of `P` parts.
#[target_feature(enable = "avx2,fma")]
fn rows_with<const P: usize>(w: &QuantMatrix, first: usize, x: &Picked, out_t: &mut [f32]) {
    let rows = x.rows();
    for (j, out) in out_t.chunks_mut(rows).enumerate() {
        for (pass, out) in out.chunks_mut(ROWS_PER_PASS).enumerate() {
            let at = pass * ROWS_PER_PASS;
            match out.len() {
                1 => pass_rows::<1, P>(w, first + j, x, at, out),
                2 => pass_rows::<2, P>(w, first + j, x, at, out),
                3 => pass_rows::<3, P>(w, first + j, x, at, out),
                _ => pass_rows::<4, P>(w, first + j, x, at, out),
            }
        }
    }
}

#[target_feature(enable = "avx2,fma")]
fn pass_rows<const R: usize, const P: usize>(
    w: &QuantMatrix,
    row: usize,
    x: &Picked,
    at: usize,
    out: &mut [f32],
) {
    const BLOCK: usize = 64;
    let (cols, group) = (w.cols(), w.group_size());
    let (groups, blocks) = (w.groups_per_row(), cols / BLOCK);
    debug_assert_eq!(BLOCK, Int8Isa::Avx2.block_cols(4));
    let group_shift = group.trailing_zeros();
    let codes = w.row_codes(row).as_ptr() as *const u8;
    let (scales, biases) = (w.row_scales(row), w.row_biases(row));
    assert!(out.len() == R && at + R <= x.rows() && scales.len() == groups);
    let r: [*const i8; R] = std::array::from_fn(|i| x.row_parts(at + i));
    // Eight lanes of eight columns per block.
    let steps: [&[f32]; R] = std::array::from_fn(|i| x.steps(at + i));
    let sums: [&[f32]; R] = std::array::from_fn(|i| x.sums(at + i));
    let (nibbles, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let block = b * BLOCK;
        // A block is one group of 64, half of one of 128, or two of 32 (lanes 0-3 and 4-7).
        let g = block >> group_shift;
        let s = if group >= BLOCK {
            _mm256_set1_ps(scales[g].to_f32())
        } else {
            _mm256_set_m128(
                _mm_set1_ps(scales[g + 1].to_f32()),
                _mm_set1_ps(scales[g].to_f32()),
            )
        };
        // SAFETY: a block is 32 code bytes inside the row and 64 inputs inside each input row;
        // `steps` holds 8 lanes per block.
        unsafe {
            let v = _mm256_loadu_si256(codes.add(block / 2) as *const _);
            let lo = _mm256_and_si256(v, nibbles);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);
            let part_dot = |part: *const i8| {
                let even = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(part as *const _));
                let odd = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(part.add(32) as *const _));
                _mm256_madd_epi16(_mm256_add_epi16(even, odd), ones)
            };
            for i in 0..R {
                let rb = r[i].add(block);
                let dot = match P {
                    2 => _mm256_add_epi32(
                        _mm256_slli_epi32(part_dot(rb), LOW_PART_SHIFT),
                        part_dot(rb.add(cols)),
                    ),
                    _ => part_dot(rb),
                };
                let step = _mm256_loadu_ps(steps[i][b * 8..].as_ptr());
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, step), acc[i]);
            }
        }
    }
    let mut bias = [0f32; R];
    for (g, b) in biases.iter().enumerate() {
        let b = b.to_f32();
        for i in 0..R {
            bias[i] += b * sums[i][g];
        }
    }
    for i in 0..R {
        out[i] = horizontal_sum(acc[i]) + bias[i];
    }
}

#[target_feature(enable = "avx2")]
fn horizontal_sum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}
