//! One decode step as a fixed sequence of launches, all on one stream, nothing read back: the
//! token comes from the state's slot, routing and the argmax stay on the device, and the step
//! ends by writing the chosen token into the slot and advancing the position. Because nothing in
//! the sequence depends on the host, it is captured once per sequence as a CUDA graph.

use anyhow::{Result, ensure};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice};
use lily_core::config::ModelConfig;

use crate::compile::MAX_ATTN_SPLITS;
use crate::gpu::{Gpu, KArg, ptr};
use crate::launch;
use crate::mat::{DeviceMat, MatArg, XS_COLS, gemv_shape, staged_shape, wave_shape};
use crate::state::{CudaState, LayerState};
use crate::weights::{DeviceAttention, DeviceGdn, DeviceMixer, DeviceMoe, DeviceWeights};

/// Activations of one step, shared by every sequence (steps run one at a time).
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
    /// Blocks of the router launch that have finished (the last one routes and resets it).
    pub route_done: CudaSlice<u32>,
    pub logits: CudaSlice<f32>,
    pub arg_v: CudaSlice<f32>,
    pub arg_i: CudaSlice<i32>,
}

/// Rows one warp of the router GEMV in `moe_route_b*` computes (kernels/moe.cu, ROUTE_ROWS).
const ROUTE_ROWS: usize = 2;
/// Output rows one warp of `moe_down_b*` computes at a time (kernels/moe.cu, DOWN_ROWS).
const DOWN_ROWS: usize = 2;

/// Blocks of the first argmax stage (kernels/sample.cu, ARGMAX_BLOCKS).
const ARGMAX_BLOCKS: u32 = 128;

impl Scratch {
    pub fn new(gpu: &Gpu, c: &ModelConfig) -> Result<Self> {
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        let gdn_proj = c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads;
        let attn_proj = nh * 2 * hd + 2 * nkv * hd;
        let parts = nkv * MAX_ATTN_SPLITS * (nh / nkv);
        Ok(Scratch {
            hidden: gpu.zeros(c.hidden_size)?,
            proj: gpu.zeros(gdn_proj.max(attn_proj))?,
            conv_out: gpu.zeros(c.gdn_conv_dim())?,
            gdn_o: gpu.zeros(c.gdn_value_dim())?,
            gdn_y: gpu.zeros(c.gdn_value_dim())?,
            q: gpu.zeros(nh * hd)?,
            part_ml: gpu.zeros(parts * 2)?,
            part_acc: gpu.zeros(parts * hd)?,
            attn_out: gpu.zeros(nh * hd)?,
            router_logits: gpu.zeros(c.num_experts + 1)?,
            ids: gpu.zeros(c.experts_per_token)?,
            weights: gpu.zeros(c.experts_per_token)?,
            act: gpu.zeros(
                c.experts_per_token * c.moe_intermediate_size + c.shared_intermediate_size,
            )?,
            route_done: gpu.zeros(1)?,
            logits: gpu.zeros(c.vocab_size)?,
            arg_v: gpu.zeros(ARGMAX_BLOCKS as usize)?,
            arg_i: gpu.zeros(ARGMAX_BLOCKS as usize)?,
        })
    }
}

fn round_up_warp(n: usize) -> u32 {
    (n.div_ceil(32) * 32).min(1024) as u32
}

/// What a GEMV launch does with its input and output (the `gemv_*` kernels of gemv.cu).
enum GemvForm {
    /// `y = W · (RMSNorm(x) · norm)`, x being the residual stream.
    Norm(u64, f32),
    /// `y += W · x`, y being the residual stream.
    Add,
}

/// `y = [m0 | m1 | ...] · x` in one of its forms, one launch for matrices that share their input.
fn gemv(gpu: &Gpu, form: GemvForm, mats: &[&DeviceMat], x: u64, y: u64) -> Result<()> {
    ensure!(
        !mats.is_empty() && mats.len() <= 4,
        "gemv takes 1 to 4 matrices"
    );
    let (bits, cols) = (mats[0].bits, mats[0].cols);
    ensure!(
        mats.iter().all(|m| m.bits == bits && m.cols == cols),
        "matrices launched together must share a format and their input"
    );
    ensure!(
        cols <= XS_COLS,
        "the CUDA GEMV stages at most {XS_COLS} inputs, not {cols}"
    );
    let mut args = [MatArg::default(); 4];
    for (a, m) in args.iter_mut().zip(mats) {
        *a = m.arg(gpu);
    }
    let rows: Vec<usize> = mats.iter().map(|m| m.rows).collect();
    let mut kargs: Vec<KArg> = args.iter().map(|&a| KArg::Mat(a)).collect();
    kargs.push(KArg::Ptr(x));
    let name = match form {
        GemvForm::Add => format!("gemv_add_b{bits}"),
        GemvForm::Norm(norm, eps) => {
            kargs.extend([KArg::Ptr(norm), KArg::F32(eps)]);
            format!("gemv_norm_b{bits}")
        }
    };
    kargs.push(KArg::Ptr(y));
    gpu.launch(&name, gemv_shape(&rows), &kargs)
}

/// GPU-timeline events between the kernel families of a step, for `lily bench`'s breakdown.
#[derive(Default)]
pub struct Timeline {
    marks: Vec<(&'static str, CudaEvent)>,
}

impl Timeline {
    /// Records that the work enqueued since the previous mark belongs to `family`.
    pub(crate) fn mark(&mut self, gpu: &Gpu, family: &'static str) -> Result<()> {
        let event = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        event.record(&gpu.stream)?;
        self.marks.push((family, event));
        Ok(())
    }

    /// Milliseconds per family, summed over every step recorded (waits for the GPU).
    pub fn totals(&self) -> Result<Vec<(&'static str, f64)>> {
        let mut totals: Vec<(&'static str, f64)> = Vec::new();
        for pair in self.marks.windows(2) {
            let ms = pair[0].1.elapsed_ms(&pair[1].1)? as f64;
            match totals.iter_mut().find(|(f, _)| *f == pair[1].0) {
                Some((_, t)) => *t += ms,
                None => totals.push((pair[1].0, ms)),
            }
        }
        Ok(totals)
    }
}

/// The MoE block of one layer: router + top-k, then the chosen and shared experts' gate/up, then
/// their down projections, combined and added into the residual stream. Three launches.
fn experts(gpu: &Gpu, c: &ModelConfig, m: &DeviceMoe, post_norm: u64, s: &Scratch) -> Result<()> {
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    let (inter, shared) = (c.moe_intermediate_size, c.shared_intermediate_size);
    let (ids, done) = (ptr(&s.ids, &gpu.stream), ptr(&s.route_done, &gpu.stream));
    ensure!(
        m.router.bits == m.shared_gate.bits,
        "the router and the shared-expert gate must share a format"
    );
    ensure!(
        h <= XS_COLS && c.experts_per_token * inter + shared <= XS_COLS,
        "the CUDA expert kernels stage at most {XS_COLS} inputs"
    );
    let name = format!("moe_route_b{}", m.router.bits);
    // ROUTE_ROWS rows per warp (moe.cu), whole units per matrix as the kernel counts them.
    let units = m.router.rows.div_ceil(ROUTE_ROWS) + m.shared_gate.rows.div_ceil(ROUTE_ROWS);
    let shape = staged_shape(units);
    let (r, sg) = (m.router.arg(gpu), m.shared_gate.arg(gpu));
    gpu.launch(
        &name,
        shape,
        &[
            KArg::Mat(r),
            KArg::Mat(sg),
            KArg::Ptr(p(&s.hidden)),
            KArg::Ptr(post_norm),
            KArg::F32(eps),
            KArg::Ptr(p(&s.router_logits)),
            KArg::Ptr(ids),
            KArg::Ptr(p(&s.weights)),
            KArg::Ptr(done),
        ],
    )?;
    let bits = m.gate.bits;
    ensure!(
        [&m.up, &m.down, &m.shared[0], &m.shared[1], &m.shared[2]]
            .iter()
            .all(|x| x.bits == bits),
        "routed and shared experts must share a format"
    );
    // One (gate, up) row pair per warp and unit (moe.cu, PAIRS), eight warps a block, one wave
    // (three blocks an SM on the H200: __launch_bounds__(256, 3)).
    let pairs = c.experts_per_token * inter + shared;
    let (g, u, sg, su) = (
        m.gate.arg(gpu),
        m.up.arg(gpu),
        m.shared[0].arg(gpu),
        m.shared[1].arg(gpu),
    );
    let name = format!("moe_gate_up_b{bits}");
    let shape = wave_shape(pairs, 8, gpu.resident_blocks_256(&name)?);
    gpu.launch(
        &name,
        shape,
        &[
            KArg::Mat(g),
            KArg::Mat(u),
            KArg::Mat(sg),
            KArg::Mat(su),
            KArg::I32(inter as i32),
            KArg::Ptr(ids),
            KArg::Ptr(p(&s.hidden)),
            KArg::Ptr(post_norm),
            KArg::F32(eps),
            KArg::Ptr(p(&s.act)),
        ],
    )?;
    // DOWN_ROWS (moe.cu) output rows per warp and unit, eight warps a block.
    let name = format!("moe_down_b{bits}");
    let (d, sd) = (m.down.arg(gpu), m.shared[2].arg(gpu));
    let shape = wave_shape(h.div_ceil(DOWN_ROWS), 8, gpu.resident_blocks_256(&name)?);
    gpu.launch(
        &name,
        shape,
        &[
            KArg::Mat(d),
            KArg::Mat(sd),
            KArg::I32(inter as i32),
            KArg::I32(h as i32),
            KArg::Ptr(ids),
            KArg::Ptr(p(&s.weights)),
            KArg::Ptr(p(&s.router_logits)),
            KArg::Ptr(p(&s.act)),
            KArg::Ptr(p(&s.hidden)),
        ],
    )
}

/// Enqueues one whole decode step for `state`, its greedy choice ranging over the first
/// `choices` tokens; with a timeline, marks each kernel family.
pub fn encode_step(
    gpu: &Gpu,
    c: &ModelConfig,
    w: &DeviceWeights,
    s: &Scratch,
    state: &CudaState,
    choices: usize,
    mut timeline: Option<&mut Timeline>,
) -> Result<()> {
    let mut mark = |family: &'static str| match timeline.as_deref_mut() {
        Some(t) => t.mark(gpu, family),
        None => Ok(()),
    };
    mark("start")?;
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let eps = c.rms_norm_eps;
    let token = ptr(&state.token, &gpu.stream);
    let pos = ptr(&state.pos, &gpu.stream);

    let embed = w.embed.arg(gpu);
    let name = format!("embed_b{}", w.embed.bits);
    launch!(gpu, &name, (1, 1, 1), 256; embed, token, p(&s.hidden));
    mark("embed")?;

    // No norm launches: the GEMVs that read the residual stream normalise it as they stage it,
    // and the mixer output and expert down projections add into it.
    for (layer, ls) in w.layers.iter().zip(&state.layers) {
        let input_norm = GemvForm::Norm(p(&layer.input_norm), eps);
        match (&layer.mixer, ls) {
            (DeviceMixer::GatedDeltaNet(g), LayerState::GatedDeltaNet { window, recurrent }) => {
                let DeviceGdn {
                    proj,
                    conv,
                    a_log,
                    dt_bias,
                    norm,
                    out_proj,
                } = g.as_ref();
                gemv(
                    gpu,
                    input_norm,
                    &[&proj[0], &proj[1], &proj[2], &proj[3]],
                    p(&s.hidden),
                    p(&s.proj),
                )?;
                let conv_dim = c.gdn_conv_dim();
                launch!(gpu, "gdn_conv", (conv_dim.div_ceil(256) as u32, 1, 1), 256;
                    p(&s.proj), p(conv), p(window), p(&s.conv_out));
                let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
                let cols = dv.min(32);
                launch!(gpu, "gdn_step", (nv as u32, dv.div_ceil(cols) as u32, 1), (cols * 4) as u32;
                    p(&s.conv_out), p(&s.proj), p(a_log), p(dt_bias), p(recurrent), p(&s.gdn_o));
                launch!(gpu, "gdn_gated_norm", (nv as u32, 1, 1), round_up_warp(dv);
                    p(&s.gdn_o), p(&s.proj), p(norm), p(&s.gdn_y), eps);
                mark("gated deltanet")?;
                gemv(gpu, GemvForm::Add, &[out_proj], p(&s.gdn_y), p(&s.hidden))?;
                mark("mixer output gemv")?;
            }
            (DeviceMixer::Attention(a), LayerState::Attention { k, v }) => {
                let DeviceAttention {
                    proj,
                    q_norm,
                    k_norm,
                    o_proj,
                } = a.as_ref();
                gemv(
                    gpu,
                    input_norm,
                    &[&proj[0], &proj[1], &proj[2]],
                    p(&s.hidden),
                    p(&s.proj),
                )?;
                mark("mixer input gemv")?;
                let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
                let kp = ptr(k, &gpu.stream);
                let vp = ptr(v, &gpu.stream);
                // One warp per head (head_norm_rope).
                launch!(gpu, "attn_prep", ((nh + nkv) as u32, 1, 1), 32;
                    p(&s.proj), p(q_norm), p(k_norm), pos, p(&s.q), kp, vp, eps);
                let splits = state.attn_splits;
                // 128 threads: attn_split is written for four warps (AS_WARPS).
                launch!(gpu, "attn_split", (nkv as u32, splits as u32, 1), 128;
                    p(&s.q), kp, vp, pos, p(&s.part_ml), p(&s.part_acc));
                launch!(gpu, "attn_combine", (nh as u32, 1, 1), round_up_warp(hd);
                    p(&s.part_ml), p(&s.part_acc), splits as i32, p(&s.proj), p(&s.attn_out));
                mark("attention")?;
                gemv(gpu, GemvForm::Add, &[o_proj], p(&s.attn_out), p(&s.hidden))?;
                mark("mixer output gemv")?;
            }
            _ => unreachable!("states are built from the same config as the weights"),
        }
        experts(gpu, c, &layer.moe, p(&layer.post_norm), s)?;
        mark("experts")?;
    }
    gemv(
        gpu,
        GemvForm::Norm(p(&w.final_norm), eps),
        &[&w.lm_head],
        p(&s.hidden),
        p(&s.logits),
    )?;
    mark("lm_head")?;
    device_argmax(gpu, s, choices, token, pos)?;
    mark("argmax")?;
    Ok(())
}

/// The greedy choice among the first `choices` of `s.logits` into the token slot `token`, the
/// lowest id on ties (as the host's `argmax`), and `pos` advanced by one.
pub fn device_argmax(gpu: &Gpu, s: &Scratch, choices: usize, token: u64, pos: u64) -> Result<()> {
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    ensure!(
        choices >= 1 && choices <= s.logits.len(),
        "the argmax ranges over 1 ..= {} logits, not {choices}",
        s.logits.len()
    );
    launch!(gpu, "argmax_partial", (ARGMAX_BLOCKS, 1, 1), 256;
        p(&s.logits), choices as i32, p(&s.arg_v), ptr(&s.arg_i, &gpu.stream));
    launch!(gpu, "argmax_final", (1, 1, 1), 32;
        p(&s.arg_v), ptr(&s.arg_i, &gpu.stream), token, pos);
    Ok(())
}
