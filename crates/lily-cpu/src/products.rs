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

use crate::ops::dot;
#[cfg(target_arch = "x86_64")]
use crate::quant::int8::{self, RoundedRows};
use crate::quant::{
    InputParts, Int8Isa, Isa, nibble_order, product_rows, to_nibble_order_in_parallel,
};
use crate::team;

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
    /// The product's rows: all of `x`'s, or those `pick` names.
    pub rows: usize,
    /// Rows of `x` in the order the product takes them (`None`: all, in order).
    pub pick: Option<&'a [usize]>,
}

impl<'a> Product<'a> {
    pub fn new(w: impl Into<Weight<'a>>, x: &'a [f32], rows: usize) -> Self {
        Product {
            w: w.into(),
            x,
            rows,
            pick: None,
        }
    }

    /// `x`'s rows that `pick` names: a routed expert's share of a prefill chunk. The int8
    /// kernel reads them from the chunk's one rounded copy; the others from a gathered one.
    pub fn picked(w: impl Into<Weight<'a>>, x: &'a [f32], pick: &'a [usize]) -> Self {
        Product {
            w: w.into(),
            x,
            rows: pick.len(),
            pick: Some(pick),
        }
    }

    /// The product's input rows, contiguous.
    pub fn gathered(&self) -> Cow<'a, [f32]> {
        let cols = self.w.cols();
        match self.pick {
            None => Cow::Borrowed(self.x),
            Some(pick) => Cow::Owned(
                pick.iter()
                    .flat_map(|&r| &self.x[r * cols..(r + 1) * cols])
                    .copied()
                    .collect(),
            ),
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
            Layout::Natural => Input::F32(p.gathered()),
            Layout::Nibbles => Input::F32(Cow::Owned(to_nibble_order_in_parallel(&p.gathered()))),
            #[cfg(target_arch = "x86_64")]
            Layout::Rounded { bits, group } => {
                let Kernel::Int8(isa, parts) = kernel else {
                    unreachable!("only the int8 kernel rounds")
                };
                Input::Rounded(RoundedRows::new((isa, parts), p.x, p.w.cols(), bits, group))
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
        let cols = p.w.cols();
        match p.pick {
            None => assert_eq!(p.x.len(), p.rows * cols, "input shape"),
            Some(pick) => {
                assert!(p.x.len().is_multiple_of(cols), "input shape");
                assert!(pick.iter().all(|&r| r < p.x.len() / cols), "picked row");
            }
        }
    }
    // Products of the same input and layout share one prepared copy (a rounded one serves every
    // pick of its rows). Hundreds of copies (a prefill's experts' gathered rows, f32) are made
    // in parallel, a few (a decode step's, or a chunk's one rounded copy) one after another,
    // each in parallel inside.
    let mut firsts: Vec<(usize, Layout)> = Vec::new();
    let mut input_of = Vec::with_capacity(list.len());
    for (i, p) in list.iter().enumerate() {
        let order = layout(kernel, p.w);
        let same = |&(j, l): &(usize, Layout)| {
            let q = &list[j];
            let same_rows = matches!(l, Layout::Rounded { .. })
                || q.pick.map(<[usize]>::as_ptr) == p.pick.map(<[usize]>::as_ptr);
            std::ptr::eq(q.x, p.x) && l == order && same_rows
        };
        input_of.push(firsts.iter().position(same).unwrap_or_else(|| {
            firsts.push((i, order));
            firsts.len() - 1
        }));
    }
    let input = |&(j, order): &(usize, Layout)| Input::of(&list[j], order, kernel);
    let inputs: Vec<Input<'_>> = if firsts.len() < team::threads() {
        firsts.iter().map(input).collect()
    } else {
        team::map(firsts.len(), |i| input(&firsts[i]))
    };

    // Tasks are cut by work (multiply-adds), not by weight rows: a prefill's shared expert has
    // all the chunk's rows where a routed expert has a handful, and as one task it would be the
    // region's tail on many threads. Every thread gets sixteen tasks' worth, so the region's
    // tail (a thread's last task while the others have finished) is short: at four, a decode
    // step's 72 gate and up tasks were 4 or 5 a thread on 16 threads, a tail of a fifth of the
    // region. None is under 64K multiply-adds (a decode step's 32 weight rows of 2,048), which
    // keeps a task's hand-out small next to its work, and weight rows go in fours (the tiles'
    // height). A floor in weight rows instead left a prefill's router (256 weight rows, all 256
    // input rows) nine tasks for 16 threads.
    let work = |p: &Product| p.w.cols() * p.rows;
    let total: usize = list.iter().map(|p| p.w.rows() * work(p)).sum();
    let per_task = total.div_ceil(team::threads() * 16).max(MIN_TASK_WORK);
    // Left unwritten here: the tasks write every element. Zeroed, they were a serial memset of
    // ~1 GB a prefill chunk on the leading thread (the heap keeps freed memory, so calloc
    // clears it), 5-7 % of a chunk on 16 threads.
    let mut outs: Vec<Vec<f32>> = list
        .iter()
        .map(|p| Vec::with_capacity(p.rows * p.w.rows()))
        .collect();
    let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
    for (i, p) in list.iter().enumerate().filter(|(_, p)| p.rows > 0) {
        let weight_rows = per_task.div_ceil(work(p).max(1)).next_multiple_of(4);
        for first in (0..p.w.rows()).step_by(weight_rows) {
            tasks.push((i, first, weight_rows.min(p.w.rows() - first)));
        }
    }
    let targets = Targets(outs.iter_mut().map(|o| o.as_mut_ptr()).collect());
    team::for_each(tasks.len(), |t| {
        let (i, first, count) = tasks[t];
        let p = &list[i];
        // The kernels write weight-row-major `[count, rows]`; callers want `[rows, n]`. A task
        // computes its rows a block at a time into a buffer that stays in L2 and writes the
        // block into place from there: a transpose of the whole output afterwards was a pass
        // over megabytes, and fresh memory to fault in.
        let block = (SCRATCH_FLOATS / p.rows).clamp(4, count.next_multiple_of(4));
        let mut scratch = vec![0f32; block * p.rows];
        for at in (first..first + count).step_by(block) {
            let n = block.min(first + count - at);
            let out_t = &mut scratch[..n * p.rows];
            rows_of(p, &inputs[input_of[i]], kernel, at, out_t);
            for r in 0..p.rows {
                // SAFETY: `targets.of(i)` is the buffer of product i's `[rows, w.rows()]`
                // output, allocated for all of it and alive until the region ends; this task
                // alone writes its columns `first..first + count`.
                unsafe {
                    let dst = targets.of(i).add(r * p.w.rows() + at);
                    for j in 0..n {
                        dst.add(j).write(out_t[j * p.rows + r]);
                    }
                }
            }
        }
    });
    for (out, p) in outs.iter_mut().zip(list) {
        // SAFETY: the region's tasks wrote every element (each product's weight rows are cut
        // into tasks whole, each task writes its rows for every input row); had one panicked,
        // the region would have resumed the panic before this.
        unsafe { out.set_len(p.rows * p.w.rows()) };
    }
    outs
}

/// The least work a task is given, in multiply-adds.
const MIN_TASK_WORK: usize = 64 << 10;

/// Floats of a task's block buffer (64 KB: a quarter of a core's L2 on the machines measured).
const SCRATCH_FLOATS: usize = 16 << 10;

/// The products' outputs, written by the region's tasks at disjoint places.
struct Targets(Vec<*mut f32>);

// SAFETY: the pointers are only written through, each element by one task (see the use).
unsafe impl Sync for Targets {}

impl Targets {
    fn of(&self, product: usize) -> *mut f32 {
        self.0[product]
    }
}

/// `out_t[(j - first) · rows + i] = W[j] · x_i` for `out_t.len() / rows` weight rows from
/// `first`, with the kernel `input` was prepared for.
fn rows_of(p: &Product, input: &Input, kernel: Kernel, first: usize, out_t: &mut [f32]) {
    match p.w {
        Weight::Dense(m) => {
            let Input::F32(xs) = input else {
                unreachable!("dense products read f32 inputs")
            };
            for (j, out) in out_t.chunks_mut(p.rows).enumerate() {
                let wr = m.row(first + j);
                for (o, xr) in out.iter_mut().zip(xs.chunks_exact(m.cols)) {
                    *o = dot(xr, wr);
                }
            }
        }
        Weight::Affine(q) => match (input, kernel) {
            (Input::F32(xs), Kernel::F32(isa)) => product_rows(isa, q, first, xs, p.rows, out_t),
            (Input::F32(xs), Kernel::Int8(..)) => {
                product_rows(Isa::detect(), q, first, xs, p.rows, out_t)
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `products_with` checked the kernel's availability.
            (Input::Rounded(x), _) => unsafe {
                int8::product_rows(q, first, &x.picked(p.pick), out_t)
            },
        },
    }
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
    let per_task = rows.div_ceil(team::threads()).clamp(1, 16);
    team::for_chunks(&mut out, per_task * n, |task, chunk| {
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
