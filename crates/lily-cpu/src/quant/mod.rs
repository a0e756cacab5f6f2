//! Products with MLX affine-quantised weights: `x · Wᵀ` for a few rows of `x` (decode, and the
//! experts' share of a prefill), dequantising inside the dot product so each weight byte is read
//! once per call and no f32 copy of `W` is ever made.
//!
//! Three kernels compute the same thing: a portable one (the readable definition), AVX2+FMA and
//! AVX-512F, chosen once at run time from what the CPU reports. The SIMD kernels widen codes with
//! `vpmovzxbd`, which puts the two nibbles of a byte in one 32-bit lane; to keep the input rows
//! contiguous for the loads, 4-bit products first permute each 32-column block of `x` into
//! "nibble order" (the 16 even columns, then the 16 odd ones). Each weight row's dot products
//! with up to four input rows share one pass over its codes.

mod avx2;
mod avx512;
mod avx512_tiles;
pub(crate) mod int8;
mod int8_avx2;
mod int8_avx512;
mod portable;
mod rounded_rows;
mod superblocks;

use std::sync::OnceLock;

use half::bf16;
use lily_core::quant::QuantMatrix;

use crate::products::{Kernel, Product, Weight, products_with};
use crate::team;

/// The instruction sets a kernel can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512,
}

impl Isa {
    /// The best kernel this CPU runs, checked once against the portable kernel, so a SIMD
    /// kernel that the test machines could not run is still verified where it is used.
    pub fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let best = Isa::available().into_iter().last().unwrap_or(Isa::Portable);
            if let Err(e) = self_check(best) {
                panic!("the {best:?} matrix kernel is wrong on this CPU ({e}); please report it");
            }
            best
        })
    }

    /// Every kernel this CPU can run, portable first.
    pub fn available() -> Vec<Isa> {
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
        }
        isas
    }

    /// Whether the kernel reads 4-bit inputs in nibble order.
    fn nibble_order(self, bits: u32) -> bool {
        bits == 4 && self != Isa::Portable
    }
}

/// Input rows handled per pass over a weight row.
pub(crate) const MAX_ROWS_PER_PASS: usize = 4;

/// `x · Wᵀ` for `x` of `rows` rows: returns `[rows, w.rows()]`, with the best kernel.
pub fn quant_matmul(x: &[f32], rows: usize, w: &QuantMatrix) -> Vec<f32> {
    quant_matmul_with(Isa::detect(), x, rows, w)
}

/// `x · Wᵀ` with a chosen kernel; panics if this CPU cannot run it.
pub fn quant_matmul_with(isa: Isa, x: &[f32], rows: usize, w: &QuantMatrix) -> Vec<f32> {
    let mut out = products_with(
        Kernel::F32(isa),
        &[Product::new(Weight::Affine(w), x, rows)],
    );
    out.pop().unwrap_or_default()
}

/// How many int8 parts the int8 kernels round each input value to (quant/int8.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputParts {
    /// One, as llama.cpp's q8 activations: to 1/254 of the group's largest value.
    One,
    /// A high and a low part: to 1/32,512 of it, for about 1.5× one part's arithmetic.
    Two,
}

/// Whether this CPU runs an int8 kernel (AVX2, or AVX-512 VNNI).
pub fn int8_available() -> bool {
    Int8Isa::detect().is_some()
}

/// The int8 kernels: AVX-512 VNNI (`vpdpbusd`, 4 and 8 bits), or AVX2 (`vpmaddubsw` then
/// `vpmaddwd`, 4 bits only: a pair of 8-bit codes times inputs can overflow its i16 sums).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Isa {
    Avx2,
    Avx512Vnni,
}

impl Int8Isa {
    /// Every int8 kernel this CPU runs, narrowest first.
    pub fn available() -> Vec<Int8Isa> {
        #[allow(unused_mut)]
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                isas.push(Int8Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                isas.push(Int8Isa::Avx512Vnni);
            }
        }
        isas
    }

    /// The widest int8 kernel this CPU runs.
    pub fn detect() -> Option<Int8Isa> {
        Int8Isa::available().pop()
    }

    /// i32 lanes per block (one vector).
    pub(crate) fn lanes(self) -> usize {
        match self {
            Int8Isa::Avx2 => 8,
            Int8Isa::Avx512Vnni => 16,
        }
    }

    /// Columns per block: a vector of code bytes.
    pub(crate) fn block_cols(self, bits: u32) -> usize {
        self.lanes() * 4 * 8 / bits as usize
    }

    /// Whether the kernel takes `w`: rows of whole blocks (a narrower product, such as a tiny
    /// model's 64-column down projection, keeps the f32 kernel) in a width it implements.
    pub fn fits(self, w: &QuantMatrix) -> bool {
        let bits_ok = w.bits() == 4 || self == Int8Isa::Avx512Vnni;
        bits_ok && w.cols().is_multiple_of(self.block_cols(w.bits())) && w.group_size() >= 32
    }
}

/// Whether `isa`'s kernel for `w` reads its input in nibble order.
pub(crate) fn nibble_order(isa: Isa, w: Weight<'_>) -> bool {
    matches!(w, Weight::Affine(q) if isa.nibble_order(q.bits()))
}

/// Input rows (of a multiple of 32 columns) in nibble order.
pub(crate) fn to_nibble_order(x: &[f32]) -> Vec<f32> {
    x.chunks(32).flat_map(nibble_block).collect()
}

/// [`to_nibble_order`] in parallel, for a product's input (a prefill chunk's is megabytes, and
/// made on one thread it held up the stage's region). Not for [`self_check`], whose work must
/// stay on its thread.
pub(crate) fn to_nibble_order_in_parallel(x: &[f32]) -> Vec<f32> {
    // Tasks of 256 blocks (32 KB): one block is too little work to hand out.
    const TASK: usize = 32 * 256;
    let mut out = vec![0f32; x.len()];
    team::for_chunks(&mut out, TASK, |i, o| {
        let x = &x[i * TASK..(i * TASK + o.len())];
        for (o, block) in o.chunks_mut(32).zip(x.chunks(32)) {
            o.copy_from_slice(&nibble_block(block));
        }
    });
    out
}

/// Input rows from which the AVX-512 kernel dequantises weight panels once for all of them
/// rather than once per four (the results are the same to the bit either way).
const TILED_FROM_ROWS: usize = 8;

/// `out_t[(j - first) · rows + i] = W[j] · x_i` for the weight rows `first..first + count`
/// and every input row of `xs` (in the kernel's order).
pub(crate) fn product_rows(
    isa: Isa,
    w: &QuantMatrix,
    first: usize,
    xs: &[f32],
    rows: usize,
    out_t: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && rows >= TILED_FROM_ROWS {
        let count = out_t.len() / rows;
        // SAFETY: the caller's `isa` is one this CPU runs (`products_with` checks it).
        unsafe { avx512_tiles::product_rows(w, first, count, xs, rows, out_t) };
        return;
    }
    for (j, out) in out_t.chunks_mut(rows).enumerate() {
        dot_rows(isa, w, first + j, xs, out);
    }
}

/// `out[i] = W[row] · x_i` for every input row of `xs` (in the kernel's order).
fn dot_rows(isa: Isa, w: &QuantMatrix, row: usize, xs: &[f32], out: &mut [f32]) {
    match isa {
        Isa::Portable => portable::dot_rows(w, row, xs, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `quant_matmul_with` checked that the CPU has AVX2 and FMA.
        Isa::Avx2 => unsafe { avx2::dot_rows(w, row, xs, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `quant_matmul_with` checked that the CPU has AVX-512F.
        Isa::Avx512 => unsafe { avx512::dot_rows(w, row, xs, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the portable kernel exists off x86_64"),
    }
}

/// Compares `isa` with the portable kernel on small 4- and 8-bit products, built and run on this
/// thread alone. It runs inside `detect`'s one-time initialiser, often within another thread's
/// step: a parallel region there (quantising the test matrix was one) would wait for that step
/// while the step waits for the initialiser. CI hung so (on rayon's pool, a worker stealing a job
/// that called `detect` while it ran the initialiser).
fn self_check(isa: Isa) -> Result<(), String> {
    for (rows, cols, bits, group) in [(40, 256, 4, 64), (24, 128, 8, 64), (8, 192, 4, 32)] {
        let groups = rows * cols / group;
        let codes = (0..rows * cols * bits as usize / 32)
            .map(|i| {
                (i as u32)
                    .wrapping_mul(0x9e37_79b9)
                    .rotate_left(i as u32 % 29)
            })
            .collect();
        let scales = (0..groups)
            .map(|g| bf16::from_f32(((g * 37 % 17) as f32 + 1.0) / 64.0))
            .collect();
        let biases = (0..groups)
            .map(|g| bf16::from_f32((g * 11 % 9) as f32 / 8.0 - 0.5))
            .collect();
        let w = QuantMatrix::from_parts(rows, cols, bits, group, codes, scales, biases)
            .map_err(|e| e.to_string())?;
        let x: Vec<f32> = (0..5 * cols)
            .map(|i| ((i % 13) as f32 - 6.0) / 6.0)
            .collect();
        let on_this_thread = |isa: Isa| {
            let xs = match nibble_order(isa, Weight::Affine(&w)) {
                true => to_nibble_order(&x),
                false => x.clone(),
            };
            let mut out_t = vec![0f32; rows * 5];
            product_rows(isa, &w, 0, &xs, 5, &mut out_t);
            out_t
        };
        let (want, got) = (on_this_thread(Isa::Portable), on_this_thread(isa));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        if diff > 1e-5 * scale {
            return Err(format!(
                "{bits}-bit {rows}x{cols}: differs from the portable kernel by {diff:e}"
            ));
        }
    }
    Ok(())
}

/// One 32-column block in nibble order: even columns, then odd ones.
fn nibble_block(block: &[f32]) -> [f32; 32] {
    let mut out = [0f32; 32];
    for i in 0..16 {
        out[i] = block[2 * i];
        out[16 + i] = block[2 * i + 1];
    }
    out
}

#[cfg(test)]
mod tests;
