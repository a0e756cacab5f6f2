//! Dense f32 building blocks. Written for clarity; the matrix products go to products.rs.

use lily_core::weights::{Linear, Matrix};

use crate::products::{Product, Weight, products};
use crate::team;

/// `x · Wᵀ` for `x` of `rows` rows: returns `[rows, w.rows()]`, dense or quantised.
pub fn matmul(x: &[f32], rows: usize, w: &Linear) -> Vec<f32> {
    products(&[Product::new(w, x, rows)])
        .pop()
        .unwrap_or_default()
}

/// `x · Wᵀ` for a dense f32 `W`.
pub fn dense_matmul(x: &[f32], rows: usize, w: &Matrix) -> Vec<f32> {
    products(&[Product::new(Weight::Dense(w), x, rows)])
        .pop()
        .unwrap_or_default()
}

/// Row `i` of a `[rows, width]` matrix, copied.
pub fn row_of(m: &[f32], i: usize, rows: usize) -> Vec<f32> {
    let width = m.len() / rows;
    m[i * width..(i + 1) * width].to_vec()
}

/// A dot product with eight independent partial sums, which the compiler vectorises.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// RMSNorm of each `scale.len()`-wide row of `x`, multiplied by `scale`, in place.
pub fn rms_norm_rows(x: &mut [f32], scale: &[f32], eps: f32) {
    for row in x.chunks_mut(scale.len()) {
        let inv = inv_rms(row, eps);
        row.iter_mut()
            .zip(scale)
            .for_each(|(v, s)| *v = *v * inv * s);
    }
}

/// RMSNorm into a new buffer, rows in parallel (each row's sum in the same order as
/// [`rms_norm_rows`]): a prefill chunk's 256 rows of 2,048 are a chain of dependent adds each,
/// which on one thread took ~1 ms a norm, two a layer, at 16 threads an Amdahl term.
pub fn rms_norm(x: &[f32], scale: &[f32], eps: f32) -> Vec<f32> {
    let task = ROWS_PER_TASK * scale.len();
    let mut out = team::zeros(x.len());
    team::for_chunks(&mut out, task, |i, rows| {
        rows.copy_from_slice(&x[i * task..i * task + rows.len()]);
        rms_norm_rows(rows, scale, eps)
    });
    out
}

/// Rows a task of a row-wise op takes: tens of KB, enough to pay for handing it out.
const ROWS_PER_TASK: usize = 8;

pub fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

/// Scales a vector to unit L2 norm, with eps inside the root (the FLA/HF convention).
pub fn l2_normalize(v: &mut [f32], eps: f32) {
    let inv = 1.0 / (v.iter().map(|x| x * x).sum::<f32>() + eps).sqrt();
    v.iter_mut().for_each(|x| *x *= inv);
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// log(1 + eˣ), switching to x above 20 as torch does.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `dst += src`, in parallel for a chunk's rows (megabytes).
pub fn add_in_place(dst: &mut [f32], src: &[f32]) {
    const TASK: usize = 16 << 10;
    assert_eq!(dst.len(), src.len(), "add_in_place of unequal lengths");
    team::for_chunks(dst, TASK, |i, d| {
        d.iter_mut()
            .zip(&src[i * TASK..])
            .for_each(|(d, s)| *d += s)
    });
}

/// Softmax of a row, in place (max-subtracted).
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    row.iter_mut().for_each(|v| *v /= sum);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_the_definition_at_ragged_shapes() {
        for (rows, n, k) in [(1, 1, 1), (3, 17, 9), (5, 33, 64), (2, 16, 7)] {
            let x: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w = Matrix {
                rows: n,
                cols: k,
                data: (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect(),
            };
            let y = dense_matmul(&x, rows, &w);
            for r in 0..rows {
                for j in 0..n {
                    let want: f32 = (0..k).map(|i| x[r * k + i] * w.data[j * k + i]).sum();
                    assert!(
                        (y[r * n + j] - want).abs() < 1e-4,
                        "{rows}x{n}x{k} at {r},{j}"
                    );
                }
            }
        }
    }
}
