//! A decode token's MoE on the integer tensor cores (kernels/moe_imma.cu): where it applies, and
//! its three launches for every row of a step.

use anyhow::Result;
use cudarc::driver::CudaSlice;
use lily_core::config::ModelConfig;

use crate::gemv_imma::{imma_plan, imma_shared_bytes, imma_tiles};
use crate::gpu::{Gpu, MAX_ROWS, Shape, ptr};
use crate::kernel_args::{MoeDownImma, MoeGateUpImma, MoeRouteImma};
use crate::options::DecodeKernels;
use crate::step::Scratch;
use crate::weights::DeviceMoe;

/// Whether the MoE block runs on the integer tensor cores (kernels/moe_imma.cuh): with
/// `DecodeKernels::Imma`, every expert matrix 4-bit and the router and shared gate 8-bit, in
/// groups of 64, with the hidden width and both intermediate widths whole quads of 256 inputs,
/// and the staged inputs within a block's shared memory. The real model's layout; others take
/// the FMA kernels.
pub fn moe_imma_fits(gpu: &Gpu, c: &ModelConfig, m: &DeviceMoe) -> bool {
    let shared_optin = gpu.shared_optin;
    let quads = |n: usize| n.is_multiple_of(256);
    let experts = m.experts();
    gpu.decode_kernels == DecodeKernels::Imma
        && experts.iter().all(|x| x.bits == 4 && x.group == 64)
        && [&m.router, &m.shared_gate]
            .iter()
            .all(|x| x.bits == 8 && x.group == 64)
        && quads(c.hidden_size)
        && quads(c.moe_intermediate_size)
        && quads(c.shared_intermediate_size)
        && imma_shared_bytes(c.hidden_size, imma_tiles(MAX_ROWS)) <= shared_optin
        && imma_shared_bytes(down_inputs(c), 1) <= shared_optin
}

/// The inputs of one output row of the down projection: every chosen slot's, then the shared
/// expert's.
fn down_inputs(c: &ModelConfig) -> usize {
    c.experts_per_token * c.moe_intermediate_size + c.shared_intermediate_size
}

/// A launch of an integer tensor-core kernel over `units` units of `cols` inputs for each of
/// `grid_y` rows (kernels/gemv_imma.cuh): its plan's split, and its shape.
fn imma_shape(gpu: &Gpu, units: usize, cols: usize, grid_y: u32) -> (i32, Shape) {
    let plan = imma_plan(units, cols, gpu.sms as usize);
    let shape = Shape {
        grid: (plan.blocks as u32, grid_y, 1),
        block: 32 * plan.warps as u32,
    };
    (plan.split as i32, shape)
}

/// The MoE block of one layer on the integer tensor cores: the router for every row in one
/// launch, then gate/up and down each over every row (the grid's y).
pub(crate) fn experts_imma(
    gpu: &Gpu,
    c: &ModelConfig,
    m: &DeviceMoe,
    post_norm: u64,
    s: &Scratch,
    rows: usize,
) -> Result<()> {
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let (h, eps, b) = (c.hidden_size, c.rms_norm_eps, rows as u32);
    let (inter, shared) = (c.moe_intermediate_size, c.shared_intermediate_size);
    let ids = ptr(&s.ids, &gpu.stream);
    let units = m.router.rows.div_ceil(16) + m.shared_gate.rows.div_ceil(16);
    let (split, shape) = imma_shape(gpu, units, h, 1);
    let tiles = imma_tiles(rows);
    let route = MoeRouteImma {
        router: m.router.arg(gpu),
        sh_gate: m.shared_gate.arg(gpu),
        nx: rows as i32,
        hidden: p(&s.hidden),
        norm_w: post_norm,
        eps,
        logits: p(&s.router_logits),
        ids,
        weights: p(&s.weights),
        done: ptr(&s.route_sync, &gpu.stream),
        split,
    };
    let bytes = imma_shared_bytes(h, tiles) as u32;
    gpu.launch_shared(&format!("moe_route_imma_t{tiles}"), shape, bytes, &route)?;
    // A unit is 8 outputs: 8 rows of gate and the same 8 of up.
    let units = (c.experts_per_token * inter + shared) / 8;
    let (split, shape) = imma_shape(gpu, units, h, b);
    let gate_up = MoeGateUpImma {
        gate: m.gate.arg(gpu),
        up: m.up.arg(gpu),
        sh_gate: m.shared[0].arg(gpu),
        sh_up: m.shared[1].arg(gpu),
        inter: inter as i32,
        ids,
        weights: p(&s.weights),
        logits: p(&s.router_logits),
        hidden: p(&s.hidden),
        norm_w: post_norm,
        eps,
        act: p(&s.act),
        split,
    };
    let bytes = imma_shared_bytes(h, 1) as u32;
    gpu.launch_shared("moe_gate_up_imma", shape, bytes, &gate_up)?;
    let cols = down_inputs(c);
    let (split, shape) = imma_shape(gpu, h / 16, cols, b);
    let down = MoeDownImma {
        down: m.down.arg(gpu),
        sh_down: m.shared[2].arg(gpu),
        inter: inter as i32,
        hidden: h as i32,
        ids,
        act: p(&s.act),
        residual: p(&s.hidden),
        split,
    };
    gpu.launch_shared(
        "moe_down_imma",
        shape,
        imma_shared_bytes(cols, 1) as u32,
        &down,
    )
}
