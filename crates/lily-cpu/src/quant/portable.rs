//! The portable kernel: the definition the SIMD kernels are tested against. Each group of the
//! weight row is dequantised (`scale·code + bias`, f32) into a small buffer, then dotted with
//! every input row.

use lily_core::quant::QuantMatrix;

use crate::ops::dot;

/// `out[i] = W[row] · x_i` for the rows `x_i` of `xs` (natural column order).
pub(super) fn dot_rows(w: &QuantMatrix, row: usize, xs: &[f32], out: &mut [f32]) {
    let (cols, group) = (w.cols(), w.group_size());
    let (scales, biases) = (w.row_scales(row), w.row_biases(row));
    let (bits, per_word) = (w.bits(), 32 / w.bits() as usize);
    let mask = (1u32 << bits) - 1;
    let mut weights = vec![0f32; group];
    out.fill(0.0);
    for (g, words) in w.row_codes(row).chunks_exact(group / per_word).enumerate() {
        let (s, b) = (scales[g].to_f32(), biases[g].to_f32());
        for (k, &word) in words.iter().enumerate() {
            for i in 0..per_word {
                let code = (word >> (i as u32 * bits)) & mask;
                weights[k * per_word + i] = s * code as f32 + b;
            }
        }
        for (o, x) in out.iter_mut().zip(xs.chunks_exact(cols)) {
            *o += dot(&weights, &x[g * group..(g + 1) * group]);
        }
    }
}
