//! MLX affine quantisation: the one quantised-matrix type every backend uses.
//!
//! A [`QuantMatrix`] holds a `[rows, cols]` weight exactly as an MLX checkpoint stores it, so the
//! bytes can be uploaded to a device as they are:
//!
//! - `codes`: `[rows, cols·bits/32]` u32 words; element `c` of a row is the `bits`-wide field at
//!   bit `(c mod p)·bits` of word `c / p`, `p = 32 / bits` (lowest bits first).
//! - `scales`, `biases`: `[rows, cols / group_size]` bf16; `w[r, c] = scale·code + bias` for the
//!   group `c / group_size`.
//!
//! [`QuantMatrix::quantize`] is `mx.quantize` (mlx/backend/cpu/quantized.cpp) applied to bf16
//! input, and [`QuantMatrix::dequantize_row`] is `mx.dequantize` with f32 scales: both are held
//! bit-exact to MLX by the fixtures of tools/make_mlx_fixtures.py.

use anyhow::{Result, bail, ensure};
use half::bf16;
use rayon::prelude::*;

/// Bit widths the kernels implement (MLX also has 2, 3, 5 and 6).
pub const SUPPORTED_BITS: [u32; 2] = [4, 8];
/// Group sizes MLX's affine mode allows.
pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];
/// What `lily quantize` and `--quantize q4` write, as mlx-lm's default.
pub const DEFAULT_GROUP_SIZE: usize = 64;

/// Fails unless `bits` and `group_size` are a format the kernels implement.
pub fn check_format(bits: u32, group_size: usize) -> Result<()> {
    ensure!(
        SUPPORTED_BITS.contains(&bits),
        "{bits}-bit quantisation is not supported (supported: 4 and 8 bits)"
    );
    ensure!(
        SUPPORTED_GROUP_SIZES.contains(&group_size),
        "quantisation group size {group_size} is not supported (supported: 32, 64, 128)"
    );
    Ok(())
}

#[derive(Clone, Debug, PartialEq)]
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    bits: u32,
    group_size: usize,
    codes: Vec<u32>,
    scales: Vec<bf16>,
    biases: Vec<bf16>,
}

impl QuantMatrix {
    /// Wraps MLX-layout buffers, checking that their lengths match the shape.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
        codes: Vec<u32>,
        scales: Vec<bf16>,
        biases: Vec<bf16>,
    ) -> Result<Self> {
        check_format(bits, group_size)?;
        ensure!(
            cols.is_multiple_of(group_size),
            "{cols} columns do not divide into quantisation groups of {group_size}"
        );
        let m = QuantMatrix {
            rows,
            cols,
            bits,
            group_size,
            codes,
            scales,
            biases,
        };
        let (words, groups) = (rows * m.words_per_row(), rows * m.groups_per_row());
        ensure!(
            m.codes.len() == words && m.scales.len() == groups && m.biases.len() == groups,
            "a {rows}x{cols} {bits}-bit matrix needs {words} code words and {groups} scales and \
             biases, got {}, {} and {}",
            m.codes.len(),
            m.scales.len(),
            m.biases.len()
        );
        Ok(m)
    }

    /// Quantises row-major `values` as `mx.quantize` does after mlx-lm has cast the weights to
    /// bf16: each value is rounded to bf16 first, then each group is fitted in f32.
    pub fn quantize(
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
        values: &[f32],
    ) -> Result<Self> {
        check_format(bits, group_size)?;
        ensure!(
            values.len() == rows * cols,
            "{} values for a {rows}x{cols} matrix",
            values.len()
        );
        ensure!(
            cols.is_multiple_of(group_size),
            "{cols} columns do not divide into quantisation groups of {group_size}"
        );
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            bail!(
                "value {} at row {}, column {} is not finite; refusing to quantise it",
                values[i],
                i / cols,
                i % cols
            );
        }
        let per_word = (32 / bits) as usize;
        let groups = rows * cols / group_size;
        let mut codes = vec![0u32; rows * cols / per_word];
        let mut scales = vec![bf16::ZERO; groups];
        let mut biases = vec![bf16::ZERO; groups];
        let words_per_group = group_size / per_word;
        codes
            .par_chunks_mut(words_per_group)
            .zip(scales.par_iter_mut().zip(biases.par_iter_mut()))
            .enumerate()
            .for_each(|(g, (words, (scale, bias)))| {
                let group = &values[g * group_size..(g + 1) * group_size];
                let (s, b) = quantize_group(group, bits, words);
                *scale = bf16::from_f32(s);
                *bias = bf16::from_f32(b);
            });
        Self::from_parts(rows, cols, bits, group_size, codes, scales, biases)
    }

    // The accessors are `#[inline]`: the CPU kernels (another crate, no LTO) call them for
    // every weight row, and as calls they were ~6 % of a decode-sized product.
    #[inline]
    pub fn rows(&self) -> usize {
        self.rows
    }

    #[inline]
    pub fn cols(&self) -> usize {
        self.cols
    }

    #[inline]
    pub fn bits(&self) -> u32 {
        self.bits
    }

    #[inline]
    pub fn group_size(&self) -> usize {
        self.group_size
    }

    #[inline]
    pub fn words_per_row(&self) -> usize {
        self.cols * self.bits as usize / 32
    }

    #[inline]
    pub fn groups_per_row(&self) -> usize {
        // Group sizes are powers of two (check_format): a shift, where kernels ask once per row
        // and a division would cost as much as a short row's arithmetic.
        self.cols >> self.group_size.trailing_zeros()
    }

    /// All code words, row-major `[rows, words_per_row]`.
    pub fn codes(&self) -> &[u32] {
        &self.codes
    }

    pub fn scales(&self) -> &[bf16] {
        &self.scales
    }

    pub fn biases(&self) -> &[bf16] {
        &self.biases
    }

    #[inline]
    pub fn row_codes(&self, r: usize) -> &[u32] {
        let w = self.words_per_row();
        &self.codes[r * w..(r + 1) * w]
    }

    #[inline]
    pub fn row_scales(&self, r: usize) -> &[bf16] {
        let g = self.groups_per_row();
        &self.scales[r * g..(r + 1) * g]
    }

    #[inline]
    pub fn row_biases(&self, r: usize) -> &[bf16] {
        let g = self.groups_per_row();
        &self.biases[r * g..(r + 1) * g]
    }

    /// The code of element `(r, c)`.
    pub fn code(&self, r: usize, c: usize) -> u32 {
        let per_word = 32 / self.bits as usize;
        let word = self.row_codes(r)[c / per_word];
        (word >> ((c % per_word) as u32 * self.bits)) & ((1 << self.bits) - 1)
    }

    /// Bytes of codes, scales and biases together (what a matrix-vector product reads).
    pub fn byte_size(&self) -> usize {
        self.codes.len() * 4 + (self.scales.len() + self.biases.len()) * 2
    }

    /// Row `r` as f32: `scale·code + bias` with the bf16 scale and bias widened to f32, which is
    /// exactly `mx.dequantize` with f32 scales (one product, one sum, both rounded in f32).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.cols);
        let (scales, biases) = (self.row_scales(r), self.row_biases(r));
        for (c, o) in out.iter_mut().enumerate() {
            let g = c / self.group_size;
            *o = scales[g].to_f32() * self.code(r, c) as f32 + biases[g].to_f32();
        }
    }

    /// The whole matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols)
            .enumerate()
            .for_each(|(r, row)| self.dequantize_row(r, row));
        out
    }

    /// Splits after row `at` (a fused gate|up expert stack into its two halves).
    pub fn split_rows(mut self, at: usize) -> Result<(QuantMatrix, QuantMatrix)> {
        ensure!(at <= self.rows, "cannot split {} rows at {at}", self.rows);
        let codes = self.codes.split_off(at * self.words_per_row());
        let scales = self.scales.split_off(at * self.groups_per_row());
        let biases = self.biases.split_off(at * self.groups_per_row());
        let (rows, cols, bits, group) = (self.rows, self.cols, self.bits, self.group_size);
        self.rows = at;
        let rest = QuantMatrix::from_parts(rows - at, cols, bits, group, codes, scales, biases)?;
        Ok((self, rest))
    }
}

/// Fits one group as MLX's CPU quantiser does and packs its codes into `words`; returns the
/// scale and bias in f32 (before their rounding to bf16). The codes use the unrounded f32 scale
/// and bias, as MLX's do.
fn quantize_group(group: &[f32], bits: u32, words: &mut [u32]) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let as_bf16 = |v: f32| bf16::from_f32(v).to_f32();
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in group {
        let v = as_bf16(v);
        lo = lo.min(v);
        hi = hi.max(v);
    }
    // The extreme of larger magnitude maps exactly onto a code (0 or 2^bits − 1), which is why
    // the scale can be negative.
    let low_edge = lo.abs() > hi.abs();
    let mut scale = ((hi - lo) / n_bins).max(1e-7);
    if !low_edge {
        scale = -scale;
    }
    let edge = if low_edge { lo } else { hi };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    let per_word = (32 / bits) as usize;
    for (word, chunk) in words.iter_mut().zip(group.chunks(per_word)) {
        *word = chunk.iter().enumerate().fold(0u32, |acc, (k, &v)| {
            let q = ((as_bf16(v) - bias) / scale)
                .round_ties_even()
                .clamp(0.0, n_bins);
            acc | (q as u32) << (k as u32 * bits)
        });
    }
    (scale, bias)
}

#[cfg(test)]
mod tests;
