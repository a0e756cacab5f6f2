//! Where the CPU backend rounds. By default nowhere: the f32 reference. In
//! [`Numerics::TensorCoreBf16`] a prefill rounds exactly where the CUDA prefill hands bf16 operands
//! to its tensor cores, and nowhere else, so that the two part only by summation order. Over a
//! few rounding stages that holds the GPU far tighter than the f32 reference can; over many, a
//! summation difference flips a rounding now and then and the flips cascade, until the two are
//! nearly as far apart as the rounding itself puts them (lily-cuda's gpu_agreement.rs has the
//! measurements).

use std::borrow::Cow;

use lily_core::weights::Linear;

use crate::ops::dot;
use crate::products::{Kernel, Product, Weight, products, products_with, transpose};
use crate::quant::{InputParts, Int8Isa};
use crate::team;

/// The arithmetic of a prefill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numerics {
    /// Every value in f32.
    #[default]
    F32,
    /// As the CUDA prefill computes. Every projection (gemm.cu) takes its input rows rounded to
    /// bf16 and its weight rounded to bf16, a quantised one dequantised as
    /// bf16(fma(scale, code, bias)), and sums in f32; attention (attention_prefill.cu) takes q, K
    /// and V in bf16 and rounds the probabilities of each tile of [`FA_KEYS`] keys to bf16 for
    /// P·V. Norms, the Gated DeltaNet, routing, SwiGLU, the combine and the residual stream stay
    /// f32 there and here. A decode step stays f32, as the CUDA decode does (f32 activations,
    /// f32 dequantisation); only a bf16 KV cache ([`KvPrecision`]) rounds what it reads.
    TensorCoreBf16,
    /// Every quantised product takes its input rows rounded per weight group to int8 parts and
    /// sums integer products (quant/int8.rs), in prefill and decode alike; everything else in
    /// f32. One part is llama.cpp's CPU arithmetic; two are near the f32 reference (the tiny
    /// model's logits ~1e-4 of the largest from mlx-lm's, against ~1e-2 with one; BENCHMARKS.md
    /// has the measurements). Faster where the f32 kernels are compute-bound. Needs AVX2 (4-bit
    /// products only) or AVX-512 VNNI.
    Int8Inputs(InputParts),
}

/// Keys per tile of the CUDA prefill attention (attention_prefill.cu, FA_KEYS). The running
/// maximum that the tile's probabilities are taken against, and so their bf16 rounding, changes
/// at these boundaries, counted from position 0.
pub const FA_KEYS: usize = 64;

/// How the KV cache stores keys and values, as the CUDA backend's `KvPrecision` does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvPrecision {
    #[default]
    F32,
    /// Rounded to bf16 when stored: every later read, decode steps included, sees the rounded
    /// values.
    Bf16,
}

impl Numerics {
    /// `x` as the tensor cores take it in this mode: rounded to bf16 (a copy), or as it is.
    pub fn operand(self, x: &[f32]) -> Cow<'_, [f32]> {
        match self {
            Numerics::F32 | Numerics::Int8Inputs(_) => Cow::Borrowed(x),
            Numerics::TensorCoreBf16 => Cow::Owned(x.iter().map(|&v| bf16(v)).collect()),
        }
    }

    /// `x · Wᵀ` for `x` of `rows` rows, as a projection computes it in this mode.
    pub fn matmul(self, x: &[f32], rows: usize, w: &Linear) -> Vec<f32> {
        let [out] = self.products([Product::new(w, x, rows)]);
        out
    }

    /// A fixed number of products, as [`Numerics::products_of`] computes them.
    pub fn products<const N: usize>(self, list: [Product<'_>; N]) -> [Vec<f32>; N] {
        let out = self.products_of(list);
        out.try_into()
            .unwrap_or_else(|_| unreachable!("one result per product"))
    }

    /// Several products in this mode: in f32 or int8 in one parallel region (products.rs); in
    /// bf16 one after another (a reference, not a fast path).
    pub fn products_of<'a>(self, list: impl IntoIterator<Item = Product<'a>>) -> Vec<Vec<f32>> {
        let list: Vec<Product<'a>> = list.into_iter().collect();
        match self {
            Numerics::F32 => products(&list),
            Numerics::Int8Inputs(parts) => {
                let isa = Int8Isa::detect().expect("int8 inputs on a CPU without an int8 kernel");
                products_with(Kernel::Int8(isa, parts), &list)
            }
            Numerics::TensorCoreBf16 => list
                .iter()
                .map(|p| bf16_matmul(&self.operand(&p.gathered()), p.rows, p.w))
                .collect(),
        }
    }
}

/// `x` rounded to the nearest bf16, ties to even (as `cvt.rn.bf16x2.f32` and the kernels'
/// `f32_to_bf16` round), widened back to f32. NaN stays NaN.
pub fn bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let bits = x.to_bits();
    // Adding just under half of the dropped part's range, plus the kept part's lowest bit,
    // carries into the kept part exactly when rounding to nearest even goes up. Finite values
    // cannot wrap: the largest magnitude carries into the infinity's exponent, as it should.
    f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

/// `x · Wᵀ` for `x` already in bf16, with `W` rounded to bf16 as gemm.cu's tiles hold it and the
/// products summed in f32. Each weight row is rounded once, for every row of `x`.
fn bf16_matmul(x: &[f32], rows: usize, w: Weight<'_>) -> Vec<f32> {
    let k = w.cols();
    assert_eq!(x.len(), rows * k, "input shape");
    by_weight_rows(w.rows(), rows, 16, |j, out| {
        let mut weights = vec![0f32; k];
        bf16_weight_row(w, j, &mut weights);
        for (o, xr) in out.iter_mut().zip(x.chunks_exact(k)) {
            *o = dot(xr, &weights);
        }
    })
}

/// `[rows, n]` products made a weight row at a time: `row(j, out)` writes weight row j's
/// products with every input row into `out` (`rows` values). Each task owns `per_task` weight
/// rows and reads (or dequantises) each once for every input row, so a weight row is pulled from
/// memory once per call rather than once per token.
fn by_weight_rows(
    n: usize,
    rows: usize,
    per_task: usize,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let mut out_t = vec![0f32; n * rows];
    team::for_chunks(&mut out_t, per_task * rows, |task, chunk| {
        for (j, out) in chunk.chunks_mut(rows).enumerate() {
            row(task * per_task + j, out);
        }
    });
    transpose(out_t, n, rows)
}

/// Row `r` of `w` in bf16, as gemm.cu dequantises it into shared memory: a dense value rounded,
/// a code as bf16(fma(scale, code, bias)).
///
/// A bf16 scale times a code of at most 8 bits has at most 16 significant bits, so
/// scale·code + bias is exact in f64 (or, past a 2^37 gap between the terms, the larger term
/// either way), and its f32 rounding is exactly fmaf's, which the 8-bit kernel computes; this
/// spares a CPU built without FMA its slow software fma. The 4-bit kernel instead rounds the exact
/// sum once, straight to bf16 (`fma.rn.bf16x2`): the same value whenever the f32 sum is exact,
/// as it is for MLX's groups (gemm.cu's header says why) and the synthetic ones (a bias of
/// −7.5·scale rounded to bf16 is a multiple of 8 ulps of the scale, so the sum spans 12 bits).
fn bf16_weight_row(w: Weight<'_>, r: usize, out: &mut [f32]) {
    match w {
        Weight::Dense(m) => out
            .iter_mut()
            .zip(m.row(r))
            .for_each(|(o, &v)| *o = bf16(v)),
        Weight::Affine(q) => {
            let (bits, group) = (q.bits(), q.group_size());
            let per_word = 32 / bits as usize;
            let mask = (1u32 << bits) - 1;
            let groups = q.row_scales(r).iter().zip(q.row_biases(r));
            let codes = q.row_codes(r).chunks_exact(group / per_word);
            for ((out, words), (s, b)) in out.chunks_exact_mut(group).zip(codes).zip(groups) {
                let (s, b) = (f64::from(s.to_f32()), f64::from(b.to_f32()));
                for (i, o) in out.iter_mut().enumerate() {
                    let code = (words[i / per_word] >> ((i % per_word) as u32 * bits)) & mask;
                    *o = bf16((s * f64::from(code) + b) as f32);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
