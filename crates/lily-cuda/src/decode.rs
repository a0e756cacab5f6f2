//! The persistent decode step (kernels/decode.cu): one launch a token, one block per SM, the ops
//! of the step spread over every block with a grid barrier between dependent ones. The weight
//! table is built once per model, the state table once per sequence; the kernel's one argument
//! ([`DecArgs`]) points at both and at the scratch activations.
//!
//! The structs here mirror decode.cu's field for field; `decode_layout` reports the device's
//! sizes at start and a mismatch is refused, and the NVRTC test holds the kernel's parameter to
//! `size_of::<DecArgs>()` without a GPU.

use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DeviceRepr};
use lily_core::config::{LayerKind, ModelConfig};

use crate::compile::{DECODE_FILE, compile};
use crate::gpu::{Gpu, LaunchKind, ptr};
use crate::mat::MatArg;
use crate::state::{CudaState, LayerState};
use crate::step::Scratch;
use crate::weights::{DeviceMixer, DeviceWeights};

use crate::step_constants::STEP_WARPS;
pub use crate::step_constants::{StepFormats, check_shapes, step_defines, stream_warp_bytes};

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecGdn {
    qkv: MatArg,
    z: MatArg,
    b: MatArg,
    a: MatArg,
    out: MatArg,
    conv: u64,
    a_log: u64,
    dt_bias: u64,
    norm: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecAttn {
    q: MatArg,
    k: MatArg,
    v: MatArg,
    o: MatArg,
    q_norm: u64,
    k_norm: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecMoe {
    router: MatArg,
    sh_gate: MatArg,
    gate: MatArg,
    up: MatArg,
    down: MatArg,
    sh_gate_proj: MatArg,
    sh_up: MatArg,
    sh_down: MatArg,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecLayer {
    input_norm: u64,
    post_norm: u64,
    attention: i32,
    pad: i32,
    g: DecGdn,
    a: DecAttn,
    m: DecMoe,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecLayerState {
    window: u64,
    recurrent: u64,
    k: u64,
    v: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecModel {
    embed: MatArg,
    lm_head: MatArg,
    final_norm: u64,
}

/// decode_step's argument.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct DecArgs {
    model: u64,
    layers: u64,
    states: u64,
    hidden: u64,
    proj: u64,
    conv_out: u64,
    gdn_o: u64,
    part_ml: u64,
    part_acc: u64,
    attn_out: u64,
    router_logits: u64,
    ids: u64,
    weights: u64,
    act: u64,
    logits: u64,
    arg_v: u64,
    arg_i: u64,
    token: u64,
    pos: u64,
    sync: u64,
    timeline: u64,
    nlayers: i32,
    choices: i32,
    inter: i32,
    eps: f32,
}

// SAFETY: plain-old-data with the C layout of decode.cu's DecArgs.
unsafe impl DeviceRepr for DecArgs {}

/// Bytes of decode_step's one parameter.
pub fn args_bytes() -> usize {
    std::mem::size_of::<DecArgs>()
}

/// How decode steps run: the persistent kernel, or the captured graph of ~320 launches (the
/// reference rung it is measured against).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePath {
    Persistent,
    Graph,
}

/// The compiled step and the model's weight table.
pub struct PersistentStep {
    function: CudaFunction,
    _module: Arc<CudaModule>,
    model: CudaSlice<u8>,
    layers: CudaSlice<u8>,
    smem: u32,
    blocks: u32,
    /// Threads a block (decode.cu, DEC_THREADS).
    threads: u32,
    /// The grid barrier's counter and the finished-block count (decode.cu, DecArgs::sync).
    sync: CudaSlice<u32>,
    arg_v: CudaSlice<f32>,
    arg_i: CudaSlice<i32>,
}

/// A struct's bytes, for a table on the device.
fn bytes_of<T: Copy>(items: &[T]) -> Vec<u8> {
    let n = std::mem::size_of_val(items);
    // SAFETY: T is a repr(C) plain-old-data struct; reading its bytes (padding included, which
    // the kernel never reads) is defined for the Copy types used here.
    unsafe { std::slice::from_raw_parts(items.as_ptr() as *const u8, n) }.to_vec()
}

impl PersistentStep {
    pub fn new(gpu: &Gpu, c: &ModelConfig, w: &DeviceWeights) -> Result<Self> {
        check_shapes(c)?;
        let formats = StepFormats::of(w)?;
        let defines = step_defines(c, gpu.kv, &formats, stream_warp_bytes(gpu.shared_optin)?);
        let ptx = compile(&DECODE_FILE, &defines, &gpu.arch)?;
        let module = gpu
            .ctx
            .load_module(ptx)
            .context("loading kernels decode.cu")?;
        let function = module
            .load_function("decode_step")
            .context("kernel decode_step")?;
        let layout = module
            .load_function("decode_layout")
            .context("kernel decode_layout")?;
        let sizes = gpu.zeros::<u32>(6)?;
        gpu.launch_raw(
            &layout,
            ((1, 1, 1), 1),
            0,
            &mut [&mut ptr(&sizes, &gpu.stream) as *mut u64 as *mut c_void],
            LaunchKind::Plain,
        )?;
        let sizes = gpu.download(&sizes)?;
        let want = [
            std::mem::size_of::<DecArgs>(),
            std::mem::size_of::<DecLayer>(),
            std::mem::size_of::<DecLayerState>(),
            std::mem::size_of::<DecModel>(),
        ];
        ensure!(
            sizes[1..5].iter().map(|&s| s as usize).eq(want),
            "decode.rs mirrors decode.cu's structs wrongly: the device has {:?} bytes, the host {want:?}",
            &sizes[1..5]
        );
        let (smem, threads) = (sizes[0], sizes[5]);
        ensure!(
            threads as usize == STEP_WARPS * 32,
            "decode.cu's blocks have {threads} threads, decode.rs plans its rings for {}",
            STEP_WARPS * 32
        );
        ensure!(
            smem as usize <= gpu.shared_optin,
            "the persistent decode step needs {smem} bytes of shared memory a block, {} has {}",
            gpu.name,
            gpu.shared_optin
        );
        function
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| anyhow::anyhow!("decode_step: {smem} bytes of shared memory: {e:?}"))?;
        // One block an SM, all resident at once (the grid barrier needs it; the launch is
        // cooperative, so the driver refuses a grid that cannot be).
        let per_sm = function.occupancy_max_active_blocks_per_multiprocessor(
            threads,
            smem as usize,
            None,
        )?;
        ensure!(
            per_sm >= 1,
            "the persistent decode step does not fit an SM of {}",
            gpu.name
        );
        let blocks = gpu.sms;
        let table: Vec<DecLayer> = w.layers.iter().map(|l| layer_table(gpu, l)).collect();
        ensure!(
            gpu.ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)?
                == 1,
            "{} cannot launch cooperative grids, which the persistent decode step needs",
            gpu.name
        );
        let model = DecModel {
            embed: w.embed.arg(gpu),
            lm_head: w.lm_head.arg(gpu),
            final_norm: ptr(&w.final_norm, &gpu.stream),
        };
        Ok(PersistentStep {
            function,
            _module: module,
            model: gpu.upload(&bytes_of(&[model]))?,
            layers: gpu.upload(&bytes_of(&table))?,
            smem,
            blocks,
            threads,
            sync: gpu.zeros(2)?,
            arg_v: gpu.zeros(blocks as usize)?,
            arg_i: gpu.zeros(blocks as usize)?,
        })
    }

    /// The state table of `state` (its layers' buffers), for [`PersistentStep::launch`].
    pub fn state_table(&self, gpu: &Gpu, state: &CudaState) -> Result<CudaSlice<u8>> {
        let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
        let table: Vec<DecLayerState> = state
            .layers
            .iter()
            .map(|l| match l {
                LayerState::GatedDeltaNet { window, recurrent } => DecLayerState {
                    window: p(window),
                    recurrent: p(recurrent),
                    ..Default::default()
                },
                LayerState::Attention { k, v } => DecLayerState {
                    k: ptr(k, &gpu.stream),
                    v: ptr(v, &gpu.stream),
                    ..Default::default()
                },
            })
            .collect();
        gpu.upload(&bytes_of(&table))
    }

    /// Enqueues one step of `state`, whose table is `table`; the greedy choice ranges over the
    /// first `choices` tokens. With a timeline (at least [`PersistentStep::marks`] long), block 0
    /// records when it leaves each op.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        gpu: &Gpu,
        c: &ModelConfig,
        s: &Scratch,
        state: &CudaState,
        table: &CudaSlice<u8>,
        choices: usize,
        timeline: Option<&CudaSlice<u64>>,
    ) -> Result<()> {
        ensure!(
            choices >= 1 && choices <= c.vocab_size,
            "the greedy choice ranges over 1 ..= {} tokens, not {choices}",
            c.vocab_size
        );
        let st = &gpu.stream;
        let p = |b: &CudaSlice<f32>| ptr(b, st);
        let mut args = DecArgs {
            model: ptr(&self.model, st),
            layers: ptr(&self.layers, st),
            states: ptr(table, st),
            hidden: p(&s.hidden),
            proj: p(&s.proj),
            conv_out: p(&s.conv_out),
            gdn_o: p(&s.gdn_o),
            part_ml: p(&s.part_ml),
            part_acc: p(&s.part_acc),
            attn_out: p(&s.attn_out),
            router_logits: p(&s.router_logits),
            ids: ptr(&s.ids, st),
            weights: p(&s.weights),
            act: p(&s.act),
            logits: p(&s.logits),
            arg_v: p(&self.arg_v),
            arg_i: ptr(&self.arg_i, st),
            token: ptr(&state.token, st),
            pos: ptr(&state.pos, st),
            sync: ptr(&self.sync, st),
            timeline: timeline.map_or(0, |t| ptr(t, st)),
            nlayers: c.num_layers() as i32,
            choices: choices as i32,
            inter: c.moe_intermediate_size as i32,
            eps: c.rms_norm_eps,
        };
        gpu.launch_raw(
            &self.function,
            ((self.blocks, 1, 1), self.threads),
            self.smem,
            &mut [&mut args as *mut DecArgs as *mut c_void],
            LaunchKind::Cooperative,
        )
    }
}

/// The ops of a step in order, as decode.cu runs them (layer_op), each ending at a timeline
/// mark: the family each belongs to.
pub fn op_families(c: &ModelConfig) -> Vec<&'static str> {
    let mut ops = vec!["embed"];
    for kind in &c.layer_kinds {
        match kind {
            LayerKind::GatedDeltaNet => {
                ops.extend(["mixer input gemv", "gated deltanet", "mixer output gemv"])
            }
            LayerKind::Attention => ops.extend([
                "mixer input gemv",
                "attention",
                "attention",
                "mixer output gemv",
            ]),
        }
        ops.extend(["router", "experts gate/up", "experts down"]);
    }
    ops.push("lm_head + argmax");
    ops
}

/// Milliseconds per op family from the timestamps of one step (`marks[0]` the start, then one
/// per op of [`op_families`]).
pub fn family_times(c: &ModelConfig, marks: &[u64]) -> Vec<(&'static str, f64)> {
    let mut totals: Vec<(&'static str, f64)> = Vec::new();
    for (family, pair) in op_families(c).into_iter().zip(marks.windows(2)) {
        let ms = pair[1].saturating_sub(pair[0]) as f64 / 1e6;
        match totals.iter_mut().find(|(f, _)| *f == family) {
            Some((_, t)) => *t += ms,
            None => totals.push((family, ms)),
        }
    }
    totals
}

fn layer_table(gpu: &Gpu, l: &crate::weights::DeviceLayer) -> DecLayer {
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let m = &l.moe;
    let mut t = DecLayer {
        input_norm: p(&l.input_norm),
        post_norm: p(&l.post_norm),
        m: DecMoe {
            router: m.router.arg(gpu),
            sh_gate: m.shared_gate.arg(gpu),
            gate: m.gate.arg(gpu),
            up: m.up.arg(gpu),
            down: m.down.arg(gpu),
            sh_gate_proj: m.shared[0].arg(gpu),
            sh_up: m.shared[1].arg(gpu),
            sh_down: m.shared[2].arg(gpu),
        },
        ..Default::default()
    };
    match &l.mixer {
        DeviceMixer::GatedDeltaNet(g) => {
            t.g = DecGdn {
                qkv: g.proj[0].arg(gpu),
                z: g.proj[1].arg(gpu),
                b: g.proj[2].arg(gpu),
                a: g.proj[3].arg(gpu),
                out: g.out_proj.arg(gpu),
                conv: p(&g.conv),
                a_log: p(&g.a_log),
                dt_bias: p(&g.dt_bias),
                norm: p(&g.norm),
            }
        }
        DeviceMixer::Attention(a) => {
            t.attention = 1;
            t.a = DecAttn {
                q: a.proj[0].arg(gpu),
                k: a.proj[1].arg(gpu),
                v: a.proj[2].arg(gpu),
                o: a.o_proj.arg(gpu),
                q_norm: p(&a.q_norm),
                k_norm: p(&a.k_norm),
            }
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C layouts the kernel reads (decode.cu): a field added on one side only changes these.
    #[test]
    fn the_mirrored_structs_have_the_kernels_sizes() {
        assert_eq!(std::mem::size_of::<MatArg>(), 40);
        assert_eq!(std::mem::size_of::<DecLayerState>(), 32);
        assert_eq!(std::mem::size_of::<DecLayer>(), 24 + 232 + 176 + 320);
        assert_eq!(std::mem::size_of::<DecModel>(), 2 * 40 + 8);
        assert_eq!(std::mem::size_of::<DecArgs>(), 3 * 8 + 18 * 8 + 4 * 4);
    }
}
