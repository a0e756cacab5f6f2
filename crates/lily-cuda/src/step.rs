//! One decode step as a fixed sequence of launches, all on one stream, nothing read back: the
//! tokens come from the sequences' slots, routing and the argmax stay on the device, and the step
//! ends by writing each chosen token into its slot and advancing each position. Because nothing
//! in the sequence depends on the host, it is captured once as a CUDA graph: per sequence for a
//! step of one, per set of sequences for a batched step.
//!
//! A step advances 1 to [`MAX_ROWS`] sequences. Their activations lie row after row in the
//! scratch buffers; kernels of per-sequence work (attention, the Gated DeltaNet, routing, the
//! experts, the argmax) take the row from the grid and the row's state from [`RowPtrs`], and the
//! dense GEMVs read each weight once for every row (gemv.rs). Every row gets the bits it gets in a
//! step of its own.

use anyhow::{Result, bail, ensure};
use cudarc::driver::{CudaSlice, CudaStream};
use lily_core::config::ModelConfig;

use crate::compile::{ATTN_COMBINE_THREADS, MAX_ATTN_SPLITS};
use crate::gdn_decode::{arrival_words, gdn_decode_step};
use crate::gemv::{GemvForm, GemvRoute, gemv, mat_route};
use crate::gemv_imma::{ConvOutput, GatedInput, IMMA_SLAB, gemv_gated, gemv_gdn_in};
use crate::gpu::{Gpu, MAX_ROWS, RowInts, RowPtrs, ptr};
use crate::kernel_args::{
    ArgmaxFinal, ArgmaxPartial, AttnCombine, AttnPrep, AttnSplit, EmbedRows, GdnDecodeStep,
    GdnStep, MoeDown, MoeRouteGateUp,
};
use crate::launch;
use crate::mat::{XS_COLS, wave_shape};
use crate::moe_imma::{experts_imma, moe_imma_fits};
use crate::state::{CudaState, LayerState};
use crate::timeline::Timeline;
use crate::weights::{DeviceAttention, DeviceGdn, DeviceMixer, DeviceMoe, DeviceWeights};

/// Activations of one step, row after row for the sequences it advances (at most
/// [`MAX_ROWS`]), shared by every sequence (steps run one at a time).
pub struct Scratch {
    /// The residual stream: the mixer and expert projections add into it, and the GEMVs that
    /// read it normalise it themselves.
    pub hidden: CudaSlice<f32>,
    pub proj: CudaSlice<f32>,
    pub conv_out: CudaSlice<f32>,
    pub gdn_o: CudaSlice<f32>,
    pub gdn_y: CudaSlice<f32>,
    pub q: CudaSlice<f32>,
    pub part_ml: CudaSlice<f32>,
    pub part_acc: CudaSlice<f32>,
    pub attn_out: CudaSlice<f32>,
    pub router_logits: CudaSlice<f32>,
    pub ids: CudaSlice<i32>,
    pub weights: CudaSlice<f32>,
    pub act: CudaSlice<f32>,
    /// A word a row: the router barrier's arrivals, back to zero after each launch (kernels/moe.cu,
    /// route_arrive); the integer path's router counts its finished blocks in it.
    pub route_sync: CudaSlice<u32>,
    /// A word a (row, GDN key head): the value heads' arrivals once they have read the key head's
    /// conv window, back to zero after each launch (kernels/gdn.cu, gdn_arrive).
    pub gdn_arrivals: CudaSlice<u32>,
    pub logits: CudaSlice<f32>,
    pub arg_v: CudaSlice<f32>,
    pub arg_i: CudaSlice<i32>,
    /// The greedy token of each row, all in one place for the host to read.
    pub chosen: CudaSlice<u32>,
}

/// Output rows one warp of `moe_down_b*` computes at a time (kernels/moe_decode.cuh, DOWN_ROWS);
/// `moe_down_b*_r1`, for one sequence, computes one.
const DOWN_ROWS: usize = 2;

/// Blocks of the first argmax stage (kernels/sample.cu, ARGMAX_BLOCKS).
const ARGMAX_BLOCKS: u32 = 128;

/// Floats of each buffer of [`Scratch`] for one row, in field order.
fn row_floats(c: &ModelConfig) -> [usize; 19] {
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
    let gdn_proj = c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads;
    let attn_proj = nh * 2 * hd + 2 * nkv * hd;
    // kernels/attention.cu, ATTN_PARTS: every split a row can have, for each query head.
    let parts = nkv * MAX_ATTN_SPLITS * (nh / nkv);
    [
        c.hidden_size,
        gdn_proj.max(attn_proj),
        c.gdn_conv_dim(),
        c.gdn_value_dim(),
        c.gdn_value_dim(),
        nh * hd,
        parts * 2,
        parts * hd,
        nh * hd,
        c.num_experts + 1,
        c.experts_per_token,
        c.experts_per_token,
        c.experts_per_token * c.moe_intermediate_size + c.shared_intermediate_size,
        1,
        arrival_words(c, 1),
        c.vocab_size,
        ARGMAX_BLOCKS as usize,
        ARGMAX_BLOCKS as usize,
        1,
    ]
}

impl Scratch {
    pub fn new(gpu: &Gpu, c: &ModelConfig) -> Result<Self> {
        let [
            hidden,
            proj,
            conv_out,
            gdn_o,
            gdn_y,
            q,
            part_ml,
            part_acc,
            attn_out,
            router_logits,
            ids,
            weights,
            act,
            route_sync,
            gdn_arrivals,
            logits,
            arg_v,
            arg_i,
            chosen,
        ] = row_floats(c).map(|n| n * MAX_ROWS);
        Ok(Scratch {
            hidden: gpu.zeros(hidden)?,
            proj: gpu.zeros(proj)?,
            conv_out: gpu.zeros(conv_out)?,
            gdn_o: gpu.zeros(gdn_o)?,
            gdn_y: gpu.zeros(gdn_y)?,
            q: gpu.zeros(q)?,
            part_ml: gpu.zeros(part_ml)?,
            part_acc: gpu.zeros(part_acc)?,
            attn_out: gpu.zeros(attn_out)?,
            router_logits: gpu.zeros(router_logits)?,
            ids: gpu.zeros(ids)?,
            weights: gpu.zeros(weights)?,
            act: gpu.zeros(act)?,
            route_sync: gpu.zeros(route_sync)?,
            gdn_arrivals: gpu.zeros(gdn_arrivals)?,
            logits: gpu.zeros(logits)?,
            arg_v: gpu.zeros(arg_v)?,
            arg_i: gpu.zeros(arg_i)?,
            chosen: gpu.zeros(chosen)?,
        })
    }

    /// Device bytes [`Scratch::new`] allocates (every buffer holds 4-byte elements).
    pub fn bytes(c: &ModelConfig) -> usize {
        row_floats(c).iter().sum::<usize>() * MAX_ROWS * 4
    }
}

/// One sequence's row in a decode step: its state, and the tokens its greedy choice ranges
/// over.
pub struct StepRow<'a> {
    pub state: &'a CudaState,
    pub choices: usize,
}

/// The step's per-row buffers and counts, as the kernels take them.
struct Rows {
    n: usize,
    token: RowPtrs,
    pos: RowPtrs,
    choices: RowInts,
    splits: RowInts,
}

impl Rows {
    fn of(gpu: &Gpu, rows: &[StepRow<'_>]) -> Self {
        let st = &gpu.stream;
        Rows {
            n: rows.len(),
            token: RowPtrs::of(rows.iter().map(|r| ptr(&r.state.token, st))),
            pos: RowPtrs::of(rows.iter().map(|r| ptr(&r.state.pos, st))),
            choices: RowInts::of(rows.iter().map(|r| r.choices as i32)),
            splits: RowInts::of(rows.iter().map(|r| r.state.attn_splits as i32)),
        }
    }
}

/// The MoE block of one layer for every row: router + top-k with the chosen and shared experts'
/// gate/up in one launch, then their down projections, combined and added into the residual
/// stream. Each launch over every row (the grid's y), on the integer tensor cores where the
/// formats allow ([`moe_imma_fits`]), else on f32 FMAs.
fn experts(
    gpu: &Gpu,
    c: &ModelConfig,
    m: &DeviceMoe,
    post_norm: u64,
    s: &Scratch,
    rows: usize,
) -> Result<()> {
    if moe_imma_fits(gpu, c, m) {
        return experts_imma(gpu, c, m, post_norm, s, rows);
    }
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    let (inter, shared) = (c.moe_intermediate_size, c.shared_intermediate_size);
    let ids = ptr(&s.ids, &gpu.stream);
    let b = rows as u32;
    ensure!(
        m.router.bits == m.shared_gate.bits,
        "the router and the shared-expert gate must share a format"
    );
    ensure!(
        h <= XS_COLS && c.experts_per_token * inter + shared <= XS_COLS,
        "the CUDA expert kernels stage at most {XS_COLS} inputs"
    );
    // The kernels are compiled for the model's shapes (kernels/moe.cu, fixed_shape).
    let ne = c.num_experts;
    let shapes = [
        (&m.router, ne, h),
        (&m.shared_gate, 1, h),
        (&m.gate, ne * inter, h),
        (&m.up, ne * inter, h),
        (&m.down, ne * h, inter),
        (&m.shared[0], shared, h),
        (&m.shared[1], shared, h),
        (&m.shared[2], h, shared),
    ];
    for (mat, rows, cols) in shapes {
        ensure!(
            (mat.rows, mat.cols) == (rows, cols),
            "an expert-stage matrix is {} × {}, where the model's shape is {rows} × {cols}",
            mat.rows,
            mat.cols
        );
    }
    let bits = m.gate.bits;
    ensure!(
        [&m.up, &m.down, &m.shared[0], &m.shared[1], &m.shared[2]]
            .iter()
            .all(|x| x.bits == bits),
        "routed and shared experts must share a format"
    );
    // One (gate, up) row pair per warp and unit (moe_decode.cuh, PAIRS), eight warps a block. The
    // blocks of a row meet at a barrier after the router (kernels/moe.cu, route_arrive), so every
    // block of the launch must be resident at once: at most one wave, shared by the rows.
    let pairs = c.experts_per_token * inter + shared;
    let name = format!("moe_route_gate_up_b{bits}_r{}", m.router.bits);
    let wave = gpu.resident_blocks_256(&name)? / b;
    ensure!(wave > 0, "{name}: {rows} rows do not fit one wave");
    let mut shape = wave_shape(pairs, 8, wave);
    shape.grid.1 = b;
    let route_gate_up = MoeRouteGateUp {
        router: m.router.arg(gpu),
        shared_logit: m.shared_gate.arg(gpu),
        gate: m.gate.arg(gpu),
        up: m.up.arg(gpu),
        shared_gate: m.shared[0].arg(gpu),
        shared_up: m.shared[1].arg(gpu),
        hidden: p(&s.hidden),
        norm_w: post_norm,
        eps,
        logits: p(&s.router_logits),
        ids,
        weights: p(&s.weights),
        sync: ptr(&s.route_sync, &gpu.stream),
        act: p(&s.act),
    };
    // Output rows per warp and unit, eight warps a block: one for one sequence, which would fill
    // half the GPU with two (kernels/moe_decode.cuh, DOWN_ROWS).
    let (down_name, rows_a_warp) = if rows == 1 && bits != 32 {
        (format!("moe_down_b{bits}_r1"), 1)
    } else {
        (format!("moe_down_b{bits}"), DOWN_ROWS)
    };
    let wave = gpu.resident_blocks_256(&down_name)?.div_ceil(b);
    let mut down_shape = wave_shape(h.div_ceil(rows_a_warp), 8, wave);
    down_shape.grid.1 = b;
    let down = MoeDown {
        down: m.down.arg(gpu),
        sh_down: m.shared[2].arg(gpu),
        ids,
        weights: p(&s.weights),
        logits: p(&s.router_logits),
        act: p(&s.act),
        residual: p(&s.hidden),
        sync: ptr(&s.route_sync, &gpu.stream),
    };
    // What can refuse is checked above, before either launch: the router barrier's count goes
    // back to zero only in moe_down.
    gpu.launch(&name, shape, &route_gate_up)?;
    gpu.launch(&down_name, down_shape, &down)
}

/// Enqueues one whole decode step for `rows` (1 to [`MAX_ROWS`] sequences, each weight read
/// once for all of them); with a timeline, marks each kernel family.
pub fn encode_step(
    gpu: &Gpu,
    c: &ModelConfig,
    w: &DeviceWeights,
    s: &Scratch,
    step_rows: &[StepRow<'_>],
    mut timeline: Option<&mut Timeline>,
) -> Result<()> {
    ensure!(
        (1..=MAX_ROWS).contains(&step_rows.len()),
        "a decode step takes 1 to {MAX_ROWS} sequences, not {}",
        step_rows.len()
    );
    let mut mark = |family: &'static str| match timeline.as_deref_mut() {
        Some(t) => t.mark(gpu, family),
        None => Ok(()),
    };
    mark("start")?;
    let st = &gpu.stream;
    let p = |b: &CudaSlice<f32>| ptr(b, st);
    let eps = c.rms_norm_eps;
    let rows = Rows::of(gpu, step_rows);
    let (n, b) = (rows.n, rows.n as u32);

    let name = format!("embed_rows_b{}", w.embed.bits);
    let args = EmbedRows {
        table: w.embed.arg(gpu),
        tokens: rows.token,
        out: p(&s.hidden),
    };
    launch!(gpu, &name, (b, 1, 1), 256, args);
    mark("embed")?;

    // No norm launches: the GEMVs that read the residual stream normalise it as they stage it,
    // and the mixer output and expert down projections add into it.
    for (l, layer) in w.layers.iter().enumerate() {
        let input_norm = GemvForm::Norm(p(&layer.input_norm), eps);
        match &layer.mixer {
            DeviceMixer::GatedDeltaNet(g) => {
                let DeviceGdn {
                    proj,
                    conv,
                    a_log,
                    dt_bias,
                    norm,
                    out_proj,
                } = g.as_ref();
                let (window, recurrent) = gdn_rows(step_rows, l, st)?;
                let mats = [&proj[0], &proj[1], &proj[2], &proj[3]];
                let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
                let imma = mat_route(gpu, &proj[0]) == GemvRoute::Imma
                    && mat_route(gpu, out_proj) == GemvRoute::Imma
                    && dv.is_multiple_of(IMMA_SLAB);
                if imma {
                    // The integer route: the conv in the input projection, the gated norm in
                    // the output projection's staging.
                    let out = ConvOutput {
                        conv_w: p(conv),
                        window,
                        conv: p(&s.conv_out),
                    };
                    let input = (p(&s.hidden), p(&layer.input_norm), eps);
                    gemv_gdn_in(gpu, &mats, n, input, p(&s.proj), out)?;
                    let cols = dv.min(32);
                    let args = GdnStep {
                        conv: p(&s.conv_out),
                        proj: p(&s.proj),
                        a_log: p(a_log),
                        dt_bias: p(dt_bias),
                        state: recurrent,
                        out: p(&s.gdn_o),
                    };
                    launch!(
                        gpu,
                        "gdn_step",
                        (nv as u32, dv.div_ceil(cols) as u32, b),
                        (cols * 4) as u32,
                        args
                    );
                    mark("gated deltanet")?;
                    let input = GatedInput {
                        o: p(&s.gdn_o),
                        proj: p(&s.proj),
                        norm_w: p(norm),
                        eps,
                    };
                    gemv_gated(gpu, out_proj, n, input, p(&s.hidden))?;
                } else {
                    gemv(gpu, input_norm, &mats, n, p(&s.hidden), p(&s.proj))?;
                    let args = GdnDecodeStep {
                        proj: p(&s.proj),
                        conv_w: p(conv),
                        windows: window,
                        a_log: p(a_log),
                        dt_bias: p(dt_bias),
                        states: recurrent,
                        norm_w: p(norm),
                        arrivals: ptr(&s.gdn_arrivals, st),
                        y: p(&s.gdn_y),
                        eps,
                    };
                    gdn_decode_step(gpu, c, n, args)?;
                    mark("gated deltanet")?;
                    gemv(
                        gpu,
                        GemvForm::Add,
                        &[out_proj],
                        n,
                        p(&s.gdn_y),
                        p(&s.hidden),
                    )?;
                }
                mark("mixer output gemv")?;
            }
            DeviceMixer::Attention(a) => {
                let DeviceAttention {
                    proj,
                    q_norm,
                    k_norm,
                    o_proj,
                } = a.as_ref();
                let (k, v) = attention_rows(step_rows, l, st)?;
                gemv(
                    gpu,
                    input_norm,
                    &[&proj[0], &proj[1], &proj[2]],
                    n,
                    p(&s.hidden),
                    p(&s.proj),
                )?;
                mark("mixer input gemv")?;
                let (nh, nkv) = (c.num_attention_heads, c.num_kv_heads);
                // One warp per head (head_norm_rope).
                let args = AttnPrep {
                    qkv: p(&s.proj),
                    q_norm: p(q_norm),
                    k_norm: p(k_norm),
                    pos: rows.pos,
                    q_out: p(&s.q),
                    k_cache: k,
                    v_cache: v,
                    eps,
                };
                launch!(gpu, "attn_prep", ((nh + nkv) as u32, b, 1), 32, args);
                let splits = step_rows
                    .iter()
                    .map(|r| r.state.attn_splits)
                    .max()
                    .unwrap_or(1);
                // 128 threads: attn_split is written for four warps (AS_WARPS).
                let args = AttnSplit {
                    q: p(&s.q),
                    k_cache: k,
                    v_cache: v,
                    pos: rows.pos,
                    nsplit: rows.splits,
                    part_ml: p(&s.part_ml),
                    part_acc: p(&s.part_acc),
                };
                launch!(gpu, "attn_split", (nkv as u32, splits as u32, b), 128, args);
                let args = AttnCombine {
                    part_ml: p(&s.part_ml),
                    part_acc: p(&s.part_acc),
                    pos: rows.pos,
                    nsplit: rows.splits,
                    qkv: p(&s.proj),
                    out: p(&s.attn_out),
                };
                launch!(
                    gpu,
                    "attn_combine",
                    (nh as u32, b, 1),
                    ATTN_COMBINE_THREADS,
                    args
                );
                mark("attention")?;
                gemv(
                    gpu,
                    GemvForm::Add,
                    &[o_proj],
                    n,
                    p(&s.attn_out),
                    p(&s.hidden),
                )?;
                mark("mixer output gemv")?;
            }
        }
        experts(gpu, c, &layer.moe, p(&layer.post_norm), s, n)?;
        mark("experts")?;
    }
    gemv(
        gpu,
        GemvForm::Norm(p(&w.final_norm), eps),
        &[&w.lm_head],
        n,
        p(&s.hidden),
        p(&s.logits),
    )?;
    mark("lm_head")?;
    argmax_rows(gpu, s, &rows)?;
    mark("argmax")?;
    Ok(())
}

/// Layer `l`'s conv windows and recurrent states of every row.
fn gdn_rows(step_rows: &[StepRow<'_>], l: usize, st: &CudaStream) -> Result<(RowPtrs, RowPtrs)> {
    let (mut window, mut recurrent) = (RowPtrs::default(), RowPtrs::default());
    for (i, row) in step_rows.iter().enumerate() {
        let LayerState::GatedDeltaNet {
            window: w,
            recurrent: r,
        } = &row.state.layers[l]
        else {
            bail!("layer {l} of a state is not a Gated DeltaNet");
        };
        (window.p[i], recurrent.p[i]) = (ptr(w, st), ptr(r, st));
    }
    Ok((window, recurrent))
}

/// Layer `l`'s K and V caches of every row.
fn attention_rows(
    step_rows: &[StepRow<'_>],
    l: usize,
    st: &CudaStream,
) -> Result<(RowPtrs, RowPtrs)> {
    let (mut k, mut v) = (RowPtrs::default(), RowPtrs::default());
    for (i, row) in step_rows.iter().enumerate() {
        let LayerState::Attention { k: kc, v: vc } = &row.state.layers[l] else {
            bail!("layer {l} of a state is not an attention layer");
        };
        (k.p[i], v.p[i]) = (ptr(kc, st), ptr(vc, st));
    }
    Ok((k, v))
}

/// Each row's greedy choice among its first `choices` logits (row r at `r · vocab` of
/// `s.logits`) into its token slot and `s.chosen[r]`, the lowest id on ties (as the host's
/// `argmax`), and each row's position advanced by one.
fn argmax_rows(gpu: &Gpu, s: &Scratch, rows: &Rows) -> Result<()> {
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let vocab = s.logits.len() / MAX_ROWS;
    ensure!(
        rows.choices.n[..rows.n]
            .iter()
            .all(|&n| n >= 1 && n as usize <= vocab),
        "the argmax ranges over 1 ..= {vocab} logits, not {:?}",
        &rows.choices.n[..rows.n]
    );
    let b = rows.n as u32;
    let partial = ArgmaxPartial {
        logits: p(&s.logits),
        stride: vocab as i32,
        choices: rows.choices,
        part_v: p(&s.arg_v),
        part_i: ptr(&s.arg_i, &gpu.stream),
    };
    launch!(gpu, "argmax_partial", (ARGMAX_BLOCKS, b, 1), 256, partial);
    let last = ArgmaxFinal {
        part_v: p(&s.arg_v),
        part_i: ptr(&s.arg_i, &gpu.stream),
        choices: rows.choices,
        token: rows.token,
        pos: rows.pos,
        chosen: ptr(&s.chosen, &gpu.stream),
    };
    launch!(gpu, "argmax_final", (b, 1, 1), 32, last);
    Ok(())
}

/// The greedy choice among the first `choices` of the first row of `s.logits` into the token
/// slot of `state`, the lowest id on ties, and its position advanced by one (after a prefill).
pub fn device_argmax(gpu: &Gpu, s: &Scratch, state: &CudaState, choices: usize) -> Result<()> {
    argmax_rows(gpu, s, &Rows::of(gpu, &[StepRow { state, choices }]))
}
