//! Several matrix products in one parallel region: the CPU's grouped GEMM.
//!
//! A decode step's work is dozens of small products per layer (four mixer projections, the
//! router, nine experts' gate, up and down), each only tens of microseconds of memory traffic
//! on many cores. Run one at a time, every product pays a fork and a join of all threads, and the
//! threads wait at each join for the slowest of them; together those waits cost as much as the
//! traffic. Here every product of a stage is cut into tasks of weight rows and the tasks of all
//! of them go to the threads at once, so a stage forks and joins once.
//!
//! Each weight row's dot products with an input row are computed by the same kernel in the same
//! order whatever else the region holds, so grouping never changes a result.

use std::borrow::Cow;

use lily_core::quant::QuantMatrix;
use lily_core::weights::{Linear, Matrix};
use rayon::prelude::*;

use crate::ops::dot;
#[cfg(target_arch = "x86_64")]
use crate::quant::int8::{self, RoundedRows};
use crate::quant::{
    InputParts, Int8Isa, Isa, nibble_order, product_rows, to_nibble_order_in_parallel,
};

/// A weight matrix as the kernels read it.
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    Dense(&'a Matrix),
    Affine(&'a QuantMatrix),
}

impl Weight<'_> {
    pub fn rows(self) -> usize {
        match self {
            Weight::Dense(m) => m.rows,
            Weight::Affine(q) => q.rows(),
        }
    }

    pub fn cols(self) -> usize {
        match self {
            Weight::Dense(m) => m.cols,
            Weight::Affine(q) => q.cols(),
        }
    }
}

impl<'a> From<&'a Linear> for Weight<'a> {
    fn from(w: &'a Linear) -> Self {
        match w {
            Linear::Dense(m) => Weight::Dense(m),
            Linear::Affine(q) => Weight::Affine(q),
        }
    }
}

/// `x · Wᵀ` for `x` of `rows` rows (`rows · w.cols()` values, natural column order).
#[derive(Clone, Copy)]
pub struct Product<'a> {
    pub w: Weight<'a>,
    pub x: &'a [f32],
    pub rows: usize,
}

impl<'a> Product<'a> {
    pub fn new(w: impl Into<Weight<'a>>, x: &'a [f32], rows: usize) -> Self {
        Product {
            w: w.into(),
            x,
            rows,
        }
    }
}

/// How a region computes its quantised products (dense ones always take f32 dot products).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Dequantised to f32, with this instruction set's kernel.
    F32(Isa),
    /// The inputs rounded to int8 parts per group, integer dot products (quant/int8.rs).
    Int8(Int8Isa, InputParts),
}

/// How a kernel reads a product's input: products of the same input and layout share one copy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    Natural,
    Nibbles,
    Rounded { bits: u32, group: usize },
}

fn layout(kernel: Kernel, w: Weight<'_>) -> Layout {
    match (kernel, w) {
        (_, Weight::Dense(_)) => Layout::Natural,
        #[cfg(target_arch = "x86_64")]
        (Kernel::Int8(isa, _), Weight::Affine(q)) if isa.fits(q) => Layout::Rounded {
            bits: q.bits(),
            group: q.group_size(),
        },
        (Kernel::Int8(..), w) => layout(Kernel::F32(Isa::detect()), w),
        (Kernel::F32(isa), w) if nibble_order(isa, w) => Layout::Nibbles,
        (Kernel::F32(_), _) => Layout::Natural,
    }
}

enum Input<'a> {
    F32(Cow<'a, [f32]>),
    #[cfg(target_arch = "x86_64")]
    Rounded(RoundedRows),
}

impl<'a> Input<'a> {
    fn of(p: &Product<'a>, order: Layout, kernel: Kernel) -> Self {
        match order {
            Layout::Natural => Input::F32(Cow::Borrowed(p.x)),
            Layout::Nibbles => Input::F32(Cow::Owned(to_nibble_order_in_parallel(p.x))),
            #[cfg(target_arch = "x86_64")]
            Layout::Rounded { bits, group } => {
                let Kernel::Int8(isa, parts) = kernel else {
                    unreachable!("only the int8 kernel rounds")
                };
                Input::Rounded(RoundedRows::new((isa, parts), p.x, p.rows, bits, group))
            }
            #[cfg(not(target_arch = "x86_64"))]
            Layout::Rounded { .. } => unreachable!("no int8 kernel off x86_64"),
        }
    }
}

/// Every product's `[rows, w.rows()]` result, with the best f32 kernel.
pub fn products(list: &[Product<'_>]) -> Vec<Vec<f32>> {
    products_with(Kernel::F32(Isa::detect()), list)
}

/// Every product's result with a chosen kernel; panics if this CPU cannot run it.
pub fn products_with(kernel: Kernel, list: &[Product<'_>]) -> Vec<Vec<f32>> {
    match kernel {
        Kernel::F32(isa) => assert!(Isa::available().contains(&isa), "{isa:?} is not available"),
        Kernel::Int8(isa, _) => {
            assert!(
                Int8Isa::available().contains(&isa),
                "{isa:?} is not available"
            )
        }
    }
    for p in list {
        assert_eq!(p.x.len(), p.rows * p.w.cols(), "input shape");
    }
    // Products of the same input and layout share one prepared copy; the copies are made in
    // parallel (a prefill's experts have hundreds of distinct inputs).
    let mut firsts: Vec<(usize, Layout)> = Vec::new();
    let mut input_of = Vec::with_capacity(list.len());
    for (i, p) in list.iter().enumerate() {
        let order = layout(kernel, p.w);
        let same = |&(j, l): &(usize, Layout)| std::ptr::eq(list[j].x, p.x) && l == order;
        input_of.push(firsts.iter().position(same).unwrap_or_else(|| {
            firsts.push((i, order));
            firsts.len() - 1
        }));
    }
    let inputs: Vec<Input<'_>> = firsts
        .par_iter()
        .map(|&(j, order)| Input::of(&list[j], order, kernel))
        .collect();

    // Tasks are cut by work (multiply-adds), not by weight rows: a prefill's shared expert has
    // all the chunk's rows where a routed expert has a handful, and as one task it would be the
    // region's tail on many threads. Every thread gets several tasks to balance the region;
    // none is under 32 weight rows (tens of KB), which keeps rayon's overhead small next to the
    // memory traffic.
    let work = |p: &Product| p.w.cols() * p.rows;
    let total: usize = list.iter().map(|p| p.w.rows() * work(p)).sum();
    let per_task = total.div_ceil(rayon::current_num_threads() * 4);
    let mut outs_t: Vec<Vec<f32>> = list
        .iter()
        .map(|p| vec![0f32; p.w.rows() * p.rows])
        .collect();
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (i, (out, p)) in outs_t.iter_mut().zip(list).enumerate() {
        let weight_rows = per_task.div_ceil(work(p).max(1)).max(32);
        for (t, chunk) in out.chunks_mut((weight_rows * p.rows).max(1)).enumerate() {
            tasks.push((i, t * weight_rows, chunk));
        }
    }
    tasks.into_par_iter().for_each(|(i, first, chunk)| {
        let p = &list[i];
        match p.w {
            Weight::Dense(m) => {
                let Input::F32(xs) = &inputs[input_of[i]] else {
                    unreachable!("dense products read f32 inputs")
                };
                for (j, out) in chunk.chunks_mut(p.rows).enumerate() {
                    let wr = m.row(first + j);
                    for (o, xr) in out.iter_mut().zip(xs.chunks_exact(m.cols)) {
                        *o = dot(xr, wr);
                    }
                }
            }
            Weight::Affine(q) => match (&inputs[input_of[i]], kernel) {
                (Input::F32(xs), Kernel::F32(isa)) => {
                    product_rows(isa, q, first, xs, p.rows, chunk)
                }
                (Input::F32(xs), Kernel::Int8(..)) => {
                    product_rows(Isa::detect(), q, first, xs, p.rows, chunk)
                }
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the kernel's availability was checked above.
                (Input::Rounded(x), _) => unsafe { int8::product_rows(q, first, x, chunk) },
            },
        }
    });
    // The tasks wrote weight-row-major `[n, rows]`; callers want `[rows, n]`.
    outs_t
        .into_par_iter()
        .zip(list)
        .map(|(out_t, p)| transpose(out_t, p.w.rows(), p.rows))
        .collect()
}

/// `[n, rows]` to `[rows, n]`, in parallel over the output's rows: a prefill's projection is
/// megabytes, and on one thread its transpose was an Amdahl term of the stage. Each task walks
/// the input in panels of [`PANEL`] of its rows so the lines it reads serve all its rows.
pub(crate) fn transpose(m: Vec<f32>, n: usize, rows: usize) -> Vec<f32> {
    const PANEL: usize = 64;
    if rows == 1 {
        return m;
    }
    let mut out = vec![0f32; rows * n];
    let per_task = rows.div_ceil(rayon::current_num_threads()).clamp(1, 16);
    out.par_chunks_mut(per_task * n)
        .enumerate()
        .for_each(|(task, chunk)| {
            let first = task * per_task;
            for j0 in (0..n).step_by(PANEL) {
                let panel = j0..(j0 + PANEL).min(n);
                for (r, row) in chunk.chunks_exact_mut(n).enumerate() {
                    for j in panel.clone() {
                        row[j] = m[j * rows + first + r];
                    }
                }
            }
        });
    out
}
