//! One decode step as a fixed sequence of launches, all on one stream, nothing read back: the
//! token comes from the state's slot, routing and the argmax stay on the device, and the step
//! ends by writing the chosen token into the slot and advancing the position. Because nothing in
//! the sequence depends on the host, it is captured once per sequence as a CUDA graph.

use anyhow::{Result, ensure};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice};
use lily_core::config::ModelConfig;

use crate::compile::ATTN_SPLITS;
use crate::gpu::{Gpu, KArg, ptr};
use crate::launch;
use crate::mat::{DeviceMat, MatArg, ROW_BLOCK, gemv_shape};
use crate::state::{CudaState, LayerState};
use crate::weights::{DeviceAttention, DeviceGdn, DeviceMixer, DeviceWeights};

/// Activations of one step, shared by every sequence (steps run one at a time).
pub struct Scratch {
    pub hidden: CudaSlice<f32>,
    pub x: CudaSlice<f32>,
    pub proj: CudaSlice<f32>,
    pub conv_out: CudaSlice<f32>,
    pub gdn_o: CudaSlice<f32>,
    pub gdn_y: CudaSlice<f32>,
    pub q: CudaSlice<f32>,
    pub part_ml: CudaSlice<f32>,
    pub part_acc: CudaSlice<f32>,
    pub attn_out: CudaSlice<f32>,
    pub mix_out: CudaSlice<f32>,
    pub router_logits: CudaSlice<f32>,
    pub ids: CudaSlice<i32>,
    pub weights: CudaSlice<f32>,
    pub act: CudaSlice<f32>,
    pub moe_out: CudaSlice<f32>,
    pub logits: CudaSlice<f32>,
    pub arg_v: CudaSlice<f32>,
    pub arg_i: CudaSlice<i32>,
}

/// Blocks of the first argmax stage (kernels/sample.cu, ARGMAX_BLOCKS).
const ARGMAX_BLOCKS: u32 = 128;

impl Scratch {
    pub fn new(gpu: &Gpu, c: &ModelConfig) -> Result<Self> {
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        let gdn_proj = c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads;
        let attn_proj = nh * 2 * hd + 2 * nkv * hd;
        let parts = nkv * ATTN_SPLITS * (nh / nkv);
        Ok(Scratch {
            hidden: gpu.zeros(c.hidden_size)?,
            x: gpu.zeros(c.hidden_size)?,
            proj: gpu.zeros(gdn_proj.max(attn_proj))?,
            conv_out: gpu.zeros(c.gdn_conv_dim())?,
            gdn_o: gpu.zeros(c.gdn_value_dim())?,
            gdn_y: gpu.zeros(c.gdn_value_dim())?,
            q: gpu.zeros(nh * hd)?,
            part_ml: gpu.zeros(parts * 2)?,
            part_acc: gpu.zeros(parts * hd)?,
            attn_out: gpu.zeros(nh * hd)?,
            mix_out: gpu.zeros(c.hidden_size)?,
            router_logits: gpu.zeros(c.num_experts + 1)?,
            ids: gpu.zeros(c.experts_per_token)?,
            weights: gpu.zeros(c.experts_per_token)?,
            act: gpu.zeros(
                c.experts_per_token * c.moe_intermediate_size + c.shared_intermediate_size,
            )?,
            moe_out: gpu.zeros(c.hidden_size)?,
            logits: gpu.zeros(c.vocab_size)?,
            arg_v: gpu.zeros(ARGMAX_BLOCKS as usize)?,
            arg_i: gpu.zeros(ARGMAX_BLOCKS as usize)?,
        })
    }
}

fn round_up_warp(n: usize) -> u32 {
    (n.div_ceil(32) * 32).min(1024) as u32
}

/// `y = [m0 | m1 | ...] · x`, one launch for matrices that share their input.
fn gemv(gpu: &Gpu, mats: &[&DeviceMat], x: u64, y: u64) -> Result<()> {
    ensure!(
        !mats.is_empty() && mats.len() <= 4,
        "gemv takes 1 to 4 matrices"
    );
    let bits = mats[0].bits;
    ensure!(
        mats.iter().all(|m| m.bits == bits),
        "matrices launched together must share a format"
    );
    let mut args = [MatArg::default(); 4];
    for (a, m) in args.iter_mut().zip(mats) {
        *a = m.arg(gpu);
    }
    let rows: Vec<usize> = mats.iter().map(|m| m.rows).collect();
    let name = format!("gemv_b{bits}");
    let args = [args[0], args[1], args[2], args[3]].map(KArg::Mat);
    gpu.launch(
        &name,
        gemv_shape(&rows),
        &[
            args[0],
            args[1],
            args[2],
            args[3],
            KArg::Ptr(x),
            KArg::Ptr(y),
        ],
    )?;
    Ok(())
}

/// GPU-timeline events between the kernel families of a step, for `lily bench`'s breakdown.
#[derive(Default)]
pub struct Timeline {
    marks: Vec<(&'static str, CudaEvent)>,
}

impl Timeline {
    /// Records that the work enqueued since the previous mark belongs to `family`.
    fn mark(&mut self, gpu: &Gpu, family: &'static str) -> Result<()> {
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

/// Enqueues one whole decode step for `state`; with a timeline, marks each kernel family.
pub fn encode_step(
    gpu: &Gpu,
    c: &ModelConfig,
    w: &DeviceWeights,
    s: &Scratch,
    state: &CudaState,
    mut timeline: Option<&mut Timeline>,
) -> Result<()> {
    let mut mark = |family: &'static str| match timeline.as_deref_mut() {
        Some(t) => t.mark(gpu, family),
        None => Ok(()),
    };
    mark("start")?;
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    let token = ptr(&state.token, &gpu.stream);
    let pos = ptr(&state.pos, &gpu.stream);
    let norm_block = round_up_warp(h);

    let embed = w.embed.arg(gpu);
    let name = format!("embed_b{}", w.embed.bits);
    launch!(gpu, &name, (1, 1, 1), 256; embed, token, p(&s.hidden));
    mark("embed")?;

    let mut delta = 0u64; // the previous layer's MoE output, added to the residual by the next norm
    for (layer, ls) in w.layers.iter().zip(&state.layers) {
        launch!(gpu, "add_rms_norm", (1, 1, 1), norm_block;
            p(&s.hidden), delta, p(&layer.input_norm), p(&s.x), h as i32, eps);
        mark("rms norm")?;
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
                    &[&proj[0], &proj[1], &proj[2], &proj[3]],
                    p(&s.x),
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
                gemv(gpu, &[out_proj], p(&s.gdn_y), p(&s.mix_out))?;
                mark("mixer output gemv")?;
            }
            (DeviceMixer::Attention(a), LayerState::Attention { k, v }) => {
                let DeviceAttention {
                    proj,
                    q_norm,
                    k_norm,
                    o_proj,
                } = a.as_ref();
                gemv(gpu, &[&proj[0], &proj[1], &proj[2]], p(&s.x), p(&s.proj))?;
                mark("mixer input gemv")?;
                let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
                let kp = ptr(k, &gpu.stream);
                let vp = ptr(v, &gpu.stream);
                launch!(gpu, "attn_prep", ((nh + nkv) as u32, 1, 1), round_up_warp(hd);
                    p(&s.proj), p(q_norm), p(k_norm), pos, p(&s.q), kp, vp, eps);
                launch!(gpu, "attn_split", (nkv as u32, ATTN_SPLITS as u32, 1), 128;
                    p(&s.q), kp, vp, pos, p(&s.part_ml), p(&s.part_acc));
                launch!(gpu, "attn_combine", (nh as u32, 1, 1), round_up_warp(hd);
                    p(&s.part_ml), p(&s.part_acc), p(&s.proj), p(&s.attn_out));
                mark("attention")?;
                gemv(gpu, &[o_proj], p(&s.attn_out), p(&s.mix_out))?;
                mark("mixer output gemv")?;
            }
            _ => unreachable!("states are built from the same config as the weights"),
        }
        launch!(gpu, "add_rms_norm", (1, 1, 1), norm_block;
            p(&s.hidden), p(&s.mix_out), p(&layer.post_norm), p(&s.x), h as i32, eps);
        mark("rms norm")?;

        let m = &layer.moe;
        gemv(
            gpu,
            &[&m.router, &m.shared_gate],
            p(&s.x),
            p(&s.router_logits),
        )?;
        launch!(gpu, "moe_topk", (1, 1, 1), 32;
            p(&s.router_logits), ptr(&s.ids, &gpu.stream), p(&s.weights));
        mark("router + top-k")?;
        let (inter, shared) = (c.moe_intermediate_size, c.shared_intermediate_size);
        let rows = c.experts_per_token * inter + shared;
        let bits = m.gate.bits;
        ensure!(
            [&m.up, &m.down, &m.shared[0], &m.shared[1], &m.shared[2]]
                .iter()
                .all(|x| x.bits == bits),
            "routed and shared experts must share a format"
        );
        let name = format!("moe_gate_up_b{bits}");
        let (g, u, sg, su) = (
            m.gate.arg(gpu),
            m.up.arg(gpu),
            m.shared[0].arg(gpu),
            m.shared[1].arg(gpu),
        );
        launch!(gpu, &name, (rows.div_ceil(8) as u32, 1, 1), ROW_BLOCK;
            g, u, sg, su, inter as i32, ptr(&s.ids, &gpu.stream), p(&s.x), p(&s.act));
        let name = format!("moe_down_b{bits}");
        let (d, sd) = (m.down.arg(gpu), m.shared[2].arg(gpu));
        launch!(gpu, &name, (h.div_ceil(8) as u32, 1, 1), ROW_BLOCK;
            d, sd, inter as i32, h as i32, ptr(&s.ids, &gpu.stream), p(&s.weights), p(&s.router_logits),
            p(&s.act), p(&s.moe_out));
        mark("experts")?;
        delta = p(&s.moe_out);
    }
    launch!(gpu, "add_rms_norm", (1, 1, 1), norm_block;
        p(&s.hidden), delta, p(&w.final_norm), p(&s.x), h as i32, eps);
    mark("rms norm")?;
    gemv(gpu, &[&w.lm_head], p(&s.x), p(&s.logits))?;
    mark("lm_head")?;
    launch!(gpu, "argmax_partial", (ARGMAX_BLOCKS, 1, 1), 256;
        p(&s.logits), c.vocab_size as i32, p(&s.arg_v), ptr(&s.arg_i, &gpu.stream));
    launch!(gpu, "argmax_final", (1, 1, 1), 32;
        p(&s.arg_v), ptr(&s.arg_i, &gpu.stream), token, pos);
    mark("argmax")?;
    Ok(())
}
