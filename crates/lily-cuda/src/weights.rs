//! The model's weights uploaded once: projections that read the same input stay separate
//! matrices but are launched together; experts are stacked so a kernel reaches expert e by offset.

use anyhow::{Result, ensure};
use cudarc::driver::CudaSlice;
use lily_core::config::ModelConfig;
use lily_core::weights::{Linear, Mixer, ModelWeights};

use crate::gpu::Gpu;
use crate::mat::DeviceMat;

pub struct DeviceWeights {
    pub embed: DeviceMat,
    pub layers: Vec<DeviceLayer>,
    pub final_norm: CudaSlice<f32>,
    pub lm_head: DeviceMat,
}

pub struct DeviceLayer {
    pub input_norm: CudaSlice<f32>,
    pub post_norm: CudaSlice<f32>,
    pub mixer: DeviceMixer,
    pub moe: DeviceMoe,
}

pub enum DeviceMixer {
    GatedDeltaNet(Box<DeviceGdn>),
    Attention(Box<DeviceAttention>),
}

pub struct DeviceGdn {
    /// qkv, z, b, a: one launch, outputs end to end.
    pub proj: [DeviceMat; 4],
    pub conv: CudaSlice<f32>,
    pub a_log: CudaSlice<f32>,
    pub dt_bias: CudaSlice<f32>,
    pub norm: CudaSlice<f32>,
    pub out_proj: DeviceMat,
}

pub struct DeviceAttention {
    /// q|gate, k, v.
    pub proj: [DeviceMat; 3],
    pub q_norm: CudaSlice<f32>,
    pub k_norm: CudaSlice<f32>,
    pub o_proj: DeviceMat,
}

pub struct DeviceMoe {
    pub router: DeviceMat,
    pub shared_gate: DeviceMat,
    /// Stacked over experts: gate and up `[E·inter, hidden]`, down `[E·hidden, inter]`.
    pub gate: DeviceMat,
    pub up: DeviceMat,
    pub down: DeviceMat,
    /// gate, up, down.
    pub shared: [DeviceMat; 3],
}

/// Bytes the device copy of `w` takes: every linear as stored, small tensors in f32.
pub fn device_bytes(w: &ModelWeights) -> usize {
    let floats = |v: &[f32]| v.len() * 4;
    let mut total = w.embed_tokens.byte_size() + w.lm_head.byte_size() + floats(&w.final_norm);
    for layer in &w.layers {
        total += floats(&layer.input_norm) + floats(&layer.post_attention_norm);
        total += match &layer.mixer {
            Mixer::GatedDeltaNet(g) => {
                [
                    &g.in_proj_qkv,
                    &g.in_proj_z,
                    &g.in_proj_b,
                    &g.in_proj_a,
                    &g.out_proj,
                ]
                .iter()
                .map(|l| l.byte_size())
                .sum::<usize>()
                    + floats(&g.conv1d.data)
                    + floats(&g.a_log)
                    + floats(&g.dt_bias)
                    + floats(&g.norm)
            }
            Mixer::Attention(a) => {
                [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                    .iter()
                    .map(|l| l.byte_size())
                    .sum::<usize>()
                    + floats(&a.q_norm)
                    + floats(&a.k_norm)
            }
        };
        let m = &layer.moe;
        let experts = m.experts.iter().chain(std::iter::once(&m.shared_expert));
        total += m.router.byte_size() + m.shared_expert_gate.byte_size();
        total += experts
            .map(|e| e.gate_proj.byte_size() + e.up_proj.byte_size() + e.down_proj.byte_size())
            .sum::<usize>();
    }
    total
}

impl DeviceWeights {
    pub fn upload(gpu: &Gpu, c: &ModelConfig, w: &ModelWeights) -> Result<Self> {
        ensure!(c.num_experts > 0 && !w.layers.is_empty(), "empty model");
        let up = |m: &Linear| DeviceMat::upload(gpu, m);
        let stack = |parts: Vec<&Linear>| DeviceMat::stack(gpu, &parts);
        let mut layers = Vec::with_capacity(w.layers.len());
        for layer in &w.layers {
            let mixer = match &layer.mixer {
                Mixer::GatedDeltaNet(g) => DeviceMixer::GatedDeltaNet(Box::new(DeviceGdn {
                    proj: [
                        up(&g.in_proj_qkv)?,
                        up(&g.in_proj_z)?,
                        up(&g.in_proj_b)?,
                        up(&g.in_proj_a)?,
                    ],
                    conv: gpu.upload(&g.conv1d.data)?,
                    a_log: gpu.upload(&g.a_log)?,
                    dt_bias: gpu.upload(&g.dt_bias)?,
                    norm: gpu.upload(&g.norm)?,
                    out_proj: up(&g.out_proj)?,
                })),
                Mixer::Attention(a) => DeviceMixer::Attention(Box::new(DeviceAttention {
                    proj: [up(&a.q_proj)?, up(&a.k_proj)?, up(&a.v_proj)?],
                    q_norm: gpu.upload(&a.q_norm)?,
                    k_norm: gpu.upload(&a.k_norm)?,
                    o_proj: up(&a.o_proj)?,
                })),
            };
            let m = &layer.moe;
            let shared = &m.shared_expert;
            layers.push(DeviceLayer {
                input_norm: gpu.upload(&layer.input_norm)?,
                post_norm: gpu.upload(&layer.post_attention_norm)?,
                mixer,
                moe: DeviceMoe {
                    router: up(&m.router)?,
                    shared_gate: up(&m.shared_expert_gate)?,
                    gate: stack(m.experts.iter().map(|e| &e.gate_proj).collect())?,
                    up: stack(m.experts.iter().map(|e| &e.up_proj).collect())?,
                    down: stack(m.experts.iter().map(|e| &e.down_proj).collect())?,
                    shared: [
                        up(&shared.gate_proj)?,
                        up(&shared.up_proj)?,
                        up(&shared.down_proj)?,
                    ],
                },
            });
        }
        Ok(DeviceWeights {
            embed: up(&w.embed_tokens)?,
            layers,
            final_norm: gpu.upload(&w.final_norm)?,
            lm_head: up(&w.lm_head)?,
        })
    }
}
