//! The AVX-512F kernel: the AVX2 kernel at twice the width. Per 16 codes: one zero-extending
//! byte load, a mask or a shift, a conversion, one FMA to dequantise and one FMA per input row.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use lily_core::quant::QuantMatrix;

use super::MAX_ROWS_PER_PASS;

/// `out[i] = W[row] · x_i`; 4-bit inputs in nibble order, 8-bit in natural order.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn dot_rows(w: &QuantMatrix, row: usize, xs: &[f32], out: &mut [f32]) {
    let cols = w.cols();
    for (pass, out) in out.chunks_mut(MAX_ROWS_PER_PASS).enumerate() {
        let xs = &xs[pass * MAX_ROWS_PER_PASS * cols..];
        match out.len() {
            1 => pass_rows::<1>(w, row, xs, out),
            2 => pass_rows::<2>(w, row, xs, out),
            3 => pass_rows::<3>(w, row, xs, out),
            _ => pass_rows::<4>(w, row, xs, out),
        }
    }
}

#[target_feature(enable = "avx512f")]
fn pass_rows<const R: usize>(w: &QuantMatrix, row: usize, xs: &[f32], out: &mut [f32]) {
    let cols = w.cols();
    assert!(xs.len() >= R * cols && out.len() == R);
    let x: [*const f32; R] = std::array::from_fn(|r| xs[r * cols..].as_ptr());
    let codes = w.row_codes(row).as_ptr() as *const u8;
    let (scales, biases) = (w.row_scales(row), w.row_biases(row));
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let group = w.group_size();
    for g in 0..w.groups_per_row() {
        let s = _mm512_set1_ps(scales[g].to_f32());
        let b = _mm512_set1_ps(biases[g].to_f32());
        let start = g * group;
        if w.bits() == 4 {
            for block in (start..start + group).step_by(32) {
                // SAFETY: a 32-column block is 16 code bytes inside the row; `x` rows have
                // `cols` values each (asserted above).
                unsafe {
                    let bytes = _mm_loadu_si128(codes.add(block / 2) as *const __m128i);
                    let v = _mm512_cvtepu8_epi32(bytes);
                    let even = _mm512_and_si512(v, _mm512_set1_epi32(0xf));
                    let odd = _mm512_srli_epi32(v, 4);
                    let even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), s, b);
                    let odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), s, b);
                    for r in 0..R {
                        let xp = x[r].add(block);
                        let [a0, a1] = &mut acc[r];
                        *a0 = _mm512_fmadd_ps(even, _mm512_loadu_ps(xp), *a0);
                        *a1 = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xp.add(16)), *a1);
                    }
                }
            }
        } else {
            for block in (start..start + group).step_by(32) {
                // SAFETY: a 32-column block is 32 code bytes inside the row.
                unsafe {
                    let p = codes.add(block);
                    let lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                    let hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
                    let w_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s, b);
                    let w_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s, b);
                    for r in 0..R {
                        let xp = x[r].add(block);
                        let [a0, a1] = &mut acc[r];
                        *a0 = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xp), *a0);
                        *a1 = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xp.add(16)), *a1);
                    }
                }
            }
        }
    }
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    }
}
