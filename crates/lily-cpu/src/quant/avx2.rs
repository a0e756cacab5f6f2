//! The AVX2+FMA kernel. Per 8 codes: one zero-extending byte load, a mask or a shift, a
//! conversion, one FMA to dequantise (`code·scale + bias`) and one FMA per input row.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use lily_core::quant::QuantMatrix;

use super::MAX_ROWS_PER_PASS;

/// `out[i] = W[row] · x_i`; 4-bit inputs in nibble order, 8-bit in natural order.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
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

#[target_feature(enable = "avx2,fma")]
fn pass_rows<const R: usize>(w: &QuantMatrix, row: usize, xs: &[f32], out: &mut [f32]) {
    let cols = w.cols();
    assert!(xs.len() >= R * cols && out.len() == R);
    let x: [*const f32; R] = std::array::from_fn(|r| xs[r * cols..].as_ptr());
    let codes = w.row_codes(row).as_ptr() as *const u8;
    let (scales, biases) = (w.row_scales(row), w.row_biases(row));
    // Two accumulators per input row, so consecutive FMAs do not wait on each other.
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let group = w.group_size();
    for g in 0..w.groups_per_row() {
        let s = _mm256_set1_ps(scales[g].to_f32());
        let b = _mm256_set1_ps(biases[g].to_f32());
        let start = g * group;
        if w.bits() == 4 {
            for block in (start..start + group).step_by(32) {
                // SAFETY: a 32-column block is 16 code bytes inside the row; `x` rows have
                // `cols` values each (asserted above).
                unsafe {
                    let p = codes.add(block / 2);
                    let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                    let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
                    let nibble = _mm256_set1_epi32(0xf);
                    let deq = |v| _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, b);
                    let even_lo = deq(_mm256_and_si256(lo, nibble));
                    let even_hi = deq(_mm256_and_si256(hi, nibble));
                    let odd_lo = deq(_mm256_srli_epi32(lo, 4));
                    let odd_hi = deq(_mm256_srli_epi32(hi, 4));
                    for r in 0..R {
                        let xp = x[r].add(block);
                        let [a0, a1] = &mut acc[r];
                        *a0 = _mm256_fmadd_ps(even_lo, _mm256_loadu_ps(xp), *a0);
                        *a1 = _mm256_fmadd_ps(even_hi, _mm256_loadu_ps(xp.add(8)), *a1);
                        *a0 = _mm256_fmadd_ps(odd_lo, _mm256_loadu_ps(xp.add(16)), *a0);
                        *a1 = _mm256_fmadd_ps(odd_hi, _mm256_loadu_ps(xp.add(24)), *a1);
                    }
                }
            }
        } else {
            for block in (start..start + group).step_by(16) {
                // SAFETY: a 16-column block is 16 code bytes inside the row.
                unsafe {
                    let p = codes.add(block);
                    let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                    let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
                    let w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s, b);
                    let w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s, b);
                    for r in 0..R {
                        let xp = x[r].add(block);
                        let [a0, a1] = &mut acc[r];
                        *a0 = _mm256_fmadd_ps(w_lo, _mm256_loadu_ps(xp), *a0);
                        *a1 = _mm256_fmadd_ps(w_hi, _mm256_loadu_ps(xp.add(8)), *a1);
                    }
                }
            }
        }
    }
    for r in 0..R {
        out[r] = sum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}

#[target_feature(enable = "avx2,fma")]
fn sum(v: __m256) -> f32 {
    let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)))
}
