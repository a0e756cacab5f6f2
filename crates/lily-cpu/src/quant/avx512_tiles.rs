//! The AVX-512F product for many input rows (a prefill's projections and experts): a GEMM whose
//! every output equals the row kernel's ([`super::avx512`]) to the bit.
//!
//! The row kernel dequantises a weight row once for at most four input rows, so with hundreds of
//! rows each weight is decoded again for every four, and every input row streams from the outer
//! caches once per weight row. Here a few weight rows are dequantised once into an f32 panel (in
//! the kernel's column order), and a tile of [`TILE_ROWS`] input rows × [`TILE_WEIGHTS`] panel
//! rows runs over them from registers: per 32 columns, 14 loads feed 24 FMAs, against the row
//! kernel's 9 uops of decoding per 2 FMAs. Input rows are taken a block at a time small enough to
//! stay in L2 while every panel of the task passes over them.
//!
//! Bit-exactness: a panel value is the row kernel's `fma(code, scale, bias)`, and each (input
//! row, weight row) pair keeps the row kernel's two accumulators (the first and second 16
//! columns of every 32-column block), updated in the same column order and summed the same way.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use lily_core::quant::QuantMatrix;

/// Input rows per register tile.
const TILE_ROWS: usize = 3;
/// Weight rows per panel (and register tile).
const TILE_WEIGHTS: usize = 4;
/// Bytes of input rows a block holds (L2-resident beside the panel).
const BLOCK_BYTES: usize = 256 << 10;

/// `out_t[(j - first) · rows + r] = W[j] · x_r` for the weight rows `first..first + count` and
/// every input row of `xs` (kernel order, `rows · cols` values).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn product_rows(
    w: &QuantMatrix,
    first: usize,
    count: usize,
    xs: &[f32],
    rows: usize,
    out_t: &mut [f32],
) {
    let cols = w.cols();
    assert!(xs.len() == rows * cols && out_t.len() == count * rows && cols.is_multiple_of(32));
    let block = (BLOCK_BYTES / (cols * 4)).max(1).div_ceil(TILE_ROWS) * TILE_ROWS;
    // Rows past the end of a partial panel stay zero: their tiles compute and drop them.
    let mut panel = vec![0f32; TILE_WEIGHTS * cols];
    for r0 in (0..rows).step_by(block) {
        let r_end = (r0 + block).min(rows);
        for j0 in (0..count).step_by(TILE_WEIGHTS) {
            let weights = TILE_WEIGHTS.min(count - j0);
            for (p, row) in panel.chunks_exact_mut(cols).take(weights).enumerate() {
                dequantise_row(w, first + j0 + p, row);
            }
            for r in (r0..r_end).step_by(TILE_ROWS) {
                let tile_rows = TILE_ROWS.min(r_end - r);
                // A partial tile repeats its last input row; the repeats are not stored.
                let x: [&[f32]; TILE_ROWS] = std::array::from_fn(|i| {
                    let row = r + i.min(tile_rows - 1);
                    &xs[row * cols..(row + 1) * cols]
                });
                let sums = tile(&panel, x, cols);
                for (p, sums) in sums.iter().enumerate().take(weights) {
                    let out = &mut out_t[(j0 + p) * rows + r..];
                    out[..tile_rows].copy_from_slice(&sums[..tile_rows]);
                }
            }
        }
    }
}

/// Weight row `row` in the row kernel's column order and rounding: per 32 columns, the 16 even
/// then the 16 odd columns for 4 bits (nibble order), the columns as they are for 8.
#[target_feature(enable = "avx512f")]
fn dequantise_row(w: &QuantMatrix, row: usize, out: &mut [f32]) {
    let codes = w.row_codes(row).as_ptr() as *const u8;
    let (scales, biases) = (w.row_scales(row), w.row_biases(row));
    let group = w.group_size();
    assert_eq!(out.len(), w.cols());
    let o = out.as_mut_ptr();
    for g in 0..w.groups_per_row() {
        let s = _mm512_set1_ps(scales[g].to_f32());
        let b = _mm512_set1_ps(biases[g].to_f32());
        for block in (g * group..(g + 1) * group).step_by(32) {
            // SAFETY: a 32-column block is 16 (4-bit) or 32 (8-bit) code bytes inside the row,
            // and 32 values inside `out` (its length is the row's).
            unsafe {
                let (first, second) = if w.bits() == 4 {
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.add(block / 2) as _));
                    (
                        _mm512_and_si512(v, _mm512_set1_epi32(0xf)),
                        _mm512_srli_epi32(v, 4),
                    )
                } else {
                    let p = codes.add(block);
                    (
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(p as _)),
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(16) as _)),
                    )
                };
                _mm512_storeu_ps(
                    o.add(block),
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), s, b),
                );
                let second = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), s, b);
                _mm512_storeu_ps(o.add(block + 16), second);
            }
        }
    }
}

/// The dot products of `TILE_WEIGHTS` panel rows with `TILE_ROWS` input rows, `[weight][row]`.
#[target_feature(enable = "avx512f")]
fn tile(panel: &[f32], x: [&[f32]; TILE_ROWS], cols: usize) -> [[f32; TILE_ROWS]; TILE_WEIGHTS] {
    assert!(panel.len() >= TILE_WEIGHTS * cols && x.iter().all(|x| x.len() >= cols));
    let p: [*const f32; TILE_WEIGHTS] = std::array::from_fn(|j| panel[j * cols..].as_ptr());
    let x: [*const f32; TILE_ROWS] = std::array::from_fn(|r| x[r].as_ptr());
    // acc[half][j][r]: the first and second 16 columns of every 32-column block.
    let mut acc = [[[_mm512_setzero_ps(); TILE_ROWS]; TILE_WEIGHTS]; 2];
    for block in (0..cols).step_by(32) {
        for (half, acc) in acc.iter_mut().enumerate() {
            let at = block + 16 * half;
            // SAFETY: `at + 16 <= cols`, and every panel and input row holds `cols` values.
            unsafe {
                let wv: [__m512; TILE_WEIGHTS] =
                    std::array::from_fn(|j| _mm512_loadu_ps(p[j].add(at)));
                for (r, x) in x.iter().enumerate() {
                    let xv = _mm512_loadu_ps(x.add(at));
                    for (acc, wv) in acc.iter_mut().zip(wv) {
                        acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
                    }
                }
            }
        }
    }
    std::array::from_fn(|j| {
        std::array::from_fn(|r| _mm512_reduce_add_ps(_mm512_add_ps(acc[0][j][r], acc[1][j][r])))
    })
}
