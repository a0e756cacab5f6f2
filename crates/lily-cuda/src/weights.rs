//! The model's weights on the device: projections that read the same input stay separate
//! matrices but are launched together; experts are stacked so a kernel reaches expert e by offset.
//!
//! One walk over the model's structure ([`DeviceWeights::build`]) asks a [`WeightSource`] for
//! each tensor by its canonical name (as the loader names them): the host model uploaded as it is
//! ([`HostWeights`]), or a synthetic model made on the device (`crate::synthetic`). So the layout
//! the kernels read is written once, whatever the weights' origin.

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::CudaSlice;
use lily_core::config::{LayerKind, ModelConfig};
use lily_core::weights::{Expert, LayerWeights, Linear, Mixer, ModelWeights};

use crate::gpu::Gpu;
use crate::mat::DeviceMat;

/// Where the device weights come from; [`DeviceWeights::build`] asks for every tensor once.
pub trait WeightSource {
    /// Bytes the device copy takes, checked against free memory before anything is allocated.
    fn device_bytes(&self, c: &ModelConfig) -> usize;

    /// The linear `module` as `count` matrices of `rows × cols` (an expert stack when
    /// `count > 1`), stacked as [`DeviceMat::stack`] lays them out.
    fn mat(
        &mut self,
        gpu: &Gpu,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMat>;

    /// A zero-centred RMSNorm weight as the multiplier `1 + w` the kernels apply.
    fn norm(&mut self, gpu: &Gpu, name: &str, len: usize) -> Result<CudaSlice<f32>>;

    /// Any other f32 tensor: conv taps, A_log, dt_bias, the GDN's plain norm gain.
    fn floats(&mut self, gpu: &Gpu, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>>;
}

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

impl DeviceMoe {
    /// The routed experts' gate, up and down, then the shared expert's: every expert matrix.
    pub fn experts(&self) -> [&DeviceMat; 6] {
        let [sg, su, sd] = &self.shared;
        [&self.gate, &self.up, &self.down, sg, su, sd]
    }
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
    /// The formats of the matrices the decode step's dense GEMVs read (the mixers' projections
    /// and the lm_head), each once.
    pub fn gemv_formats(&self) -> Vec<(u32, usize)> {
        let mut mats = vec![&self.lm_head];
        for layer in &self.layers {
            match &layer.mixer {
                DeviceMixer::GatedDeltaNet(g) => {
                    mats.extend(g.proj.iter());
                    mats.push(&g.out_proj);
                }
                DeviceMixer::Attention(a) => {
                    mats.extend(a.proj.iter());
                    mats.push(&a.o_proj);
                }
            }
        }
        let mut formats: Vec<(u32, usize)> = mats.iter().map(|m| (m.bits, m.group)).collect();
        formats.sort_unstable();
        formats.dedup();
        formats
    }

    /// Every tensor the config implies, from `src`.
    pub fn build(gpu: &Gpu, c: &ModelConfig, src: &mut dyn WeightSource) -> Result<Self> {
        ensure!(c.num_experts > 0 && c.num_layers() > 0, "empty model");
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let mut at = At {
            gpu,
            src,
            prefix: String::new(),
        };
        let embed = at.mat("embed_tokens", vocab, h)?;
        let mut layers = Vec::with_capacity(c.num_layers());
        for (i, kind) in c.layer_kinds.iter().enumerate() {
            at.prefix = format!("layers.{i}.");
            layers.push(build_layer(c, &mut at, *kind).with_context(|| format!("layer {i}"))?);
        }
        at.prefix.clear();
        Ok(DeviceWeights {
            embed,
            layers,
            final_norm: at.norm("norm.weight", h)?,
            lm_head: at.mat("lm_head", vocab, h)?,
        })
    }
}

/// The source, with the name prefix of the part being walked.
struct At<'a> {
    gpu: &'a Gpu,
    src: &'a mut dyn WeightSource,
    prefix: String,
}

impl At<'_> {
    fn mat(&mut self, name: &str, rows: usize, cols: usize) -> Result<DeviceMat> {
        self.stack(name, 1, rows, cols)
    }

    fn stack(&mut self, name: &str, count: usize, rows: usize, cols: usize) -> Result<DeviceMat> {
        let module = format!("{}{name}", self.prefix);
        self.src.mat(self.gpu, &module, count, rows, cols)
    }

    fn norm(&mut self, name: &str, len: usize) -> Result<CudaSlice<f32>> {
        let name = format!("{}{name}", self.prefix);
        self.src.norm(self.gpu, &name, len)
    }

    fn floats(&mut self, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>> {
        let name = format!("{}{name}", self.prefix);
        self.src.floats(self.gpu, &name, shape)
    }
}

fn build_layer(c: &ModelConfig, at: &mut At, kind: LayerKind) -> Result<DeviceLayer> {
    let h = c.hidden_size;
    let input_norm = at.norm("input_layernorm.weight", h)?;
    let post_norm = at.norm("post_attention_layernorm.weight", h)?;
    let mixer = match kind {
        LayerKind::GatedDeltaNet => {
            let (conv, vd, nv) = (
                c.gdn_conv_dim(),
                c.gdn_value_dim(),
                c.linear_num_value_heads,
            );
            DeviceMixer::GatedDeltaNet(Box::new(DeviceGdn {
                proj: [
                    at.mat("linear_attn.in_proj_qkv", conv, h)?,
                    at.mat("linear_attn.in_proj_z", vd, h)?,
                    at.mat("linear_attn.in_proj_b", nv, h)?,
                    at.mat("linear_attn.in_proj_a", nv, h)?,
                ],
                conv: at.floats("linear_attn.conv1d.weight", &[conv, c.conv_kernel])?,
                a_log: at.floats("linear_attn.A_log", &[nv])?,
                dt_bias: at.floats("linear_attn.dt_bias", &[nv])?,
                norm: at.floats("linear_attn.norm.weight", &[c.linear_value_head_dim])?,
                out_proj: at.mat("linear_attn.out_proj", h, vd)?,
            }))
        }
        LayerKind::Attention => {
            let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
            DeviceMixer::Attention(Box::new(DeviceAttention {
                proj: [
                    at.mat("self_attn.q_proj", nh * hd * 2, h)?,
                    at.mat("self_attn.k_proj", nkv * hd, h)?,
                    at.mat("self_attn.v_proj", nkv * hd, h)?,
                ],
                q_norm: at.norm("self_attn.q_norm.weight", hd)?,
                k_norm: at.norm("self_attn.k_norm.weight", hd)?,
                o_proj: at.mat("self_attn.o_proj", h, nh * hd)?,
            }))
        }
    };
    let (e, inter, shared) = (
        c.num_experts,
        c.moe_intermediate_size,
        c.shared_intermediate_size,
    );
    let moe = DeviceMoe {
        router: at.mat("mlp.gate", e, h)?,
        shared_gate: at.mat("mlp.shared_expert_gate", 1, h)?,
        gate: at.stack("mlp.switch_mlp.gate_proj", e, inter, h)?,
        up: at.stack("mlp.switch_mlp.up_proj", e, inter, h)?,
        down: at.stack("mlp.switch_mlp.down_proj", e, h, inter)?,
        shared: [
            at.mat("mlp.shared_expert.gate_proj", shared, h)?,
            at.mat("mlp.shared_expert.up_proj", shared, h)?,
            at.mat("mlp.shared_expert.down_proj", h, shared)?,
        ],
    };
    Ok(DeviceLayer {
        input_norm,
        post_norm,
        mixer,
        moe,
    })
}

/// The host model, uploaded as it is, each tensor found by its canonical name.
pub struct HostWeights<'a>(pub &'a ModelWeights);

impl<'a> HostWeights<'a> {
    /// The layer a `layers.{i}.` name is in, and the rest of the name.
    fn layer<'n>(&self, name: &'n str) -> Option<(&'a LayerWeights, &'n str)> {
        let (i, rest) = name.strip_prefix("layers.")?.split_once('.')?;
        Some((self.0.layers.get(i.parse::<usize>().ok()?)?, rest))
    }

    /// The matrices of linear `module`: every expert's for a stack.
    fn linears(&self, module: &str) -> Option<Vec<&'a Linear>> {
        let w = self.0;
        let Some((layer, field)) = self.layer(module) else {
            return match module {
                "embed_tokens" => Some(vec![&w.embed_tokens]),
                "lm_head" => Some(vec![&w.lm_head]),
                _ => None,
            };
        };
        let m = &layer.moe;
        let experts = |f: fn(&Expert) -> &Linear| Some(m.experts.iter().map(f).collect());
        let l = match (&layer.mixer, field) {
            (Mixer::GatedDeltaNet(g), "linear_attn.in_proj_qkv") => &g.in_proj_qkv,
            (Mixer::GatedDeltaNet(g), "linear_attn.in_proj_z") => &g.in_proj_z,
            (Mixer::GatedDeltaNet(g), "linear_attn.in_proj_b") => &g.in_proj_b,
            (Mixer::GatedDeltaNet(g), "linear_attn.in_proj_a") => &g.in_proj_a,
            (Mixer::GatedDeltaNet(g), "linear_attn.out_proj") => &g.out_proj,
            (Mixer::Attention(a), "self_attn.q_proj") => &a.q_proj,
            (Mixer::Attention(a), "self_attn.k_proj") => &a.k_proj,
            (Mixer::Attention(a), "self_attn.v_proj") => &a.v_proj,
            (Mixer::Attention(a), "self_attn.o_proj") => &a.o_proj,
            (_, "mlp.gate") => &m.router,
            (_, "mlp.shared_expert_gate") => &m.shared_expert_gate,
            (_, "mlp.shared_expert.gate_proj") => &m.shared_expert.gate_proj,
            (_, "mlp.shared_expert.up_proj") => &m.shared_expert.up_proj,
            (_, "mlp.shared_expert.down_proj") => &m.shared_expert.down_proj,
            (_, "mlp.switch_mlp.gate_proj") => return experts(|e| &e.gate_proj),
            (_, "mlp.switch_mlp.up_proj") => return experts(|e| &e.up_proj),
            (_, "mlp.switch_mlp.down_proj") => return experts(|e| &e.down_proj),
            _ => return None,
        };
        Some(vec![l])
    }

    /// The f32 tensor `name` as the host holds it (norms already as their multipliers).
    fn floats_of(&self, name: &str) -> Option<&'a [f32]> {
        let Some((layer, field)) = self.layer(name) else {
            return (name == "norm.weight").then_some(&self.0.final_norm[..]);
        };
        Some(match (&layer.mixer, field) {
            (_, "input_layernorm.weight") => &layer.input_norm,
            (_, "post_attention_layernorm.weight") => &layer.post_attention_norm,
            (Mixer::GatedDeltaNet(g), "linear_attn.conv1d.weight") => &g.conv1d.data,
            (Mixer::GatedDeltaNet(g), "linear_attn.A_log") => &g.a_log,
            (Mixer::GatedDeltaNet(g), "linear_attn.dt_bias") => &g.dt_bias,
            (Mixer::GatedDeltaNet(g), "linear_attn.norm.weight") => &g.norm,
            (Mixer::Attention(a), "self_attn.q_norm.weight") => &a.q_norm,
            (Mixer::Attention(a), "self_attn.k_norm.weight") => &a.k_norm,
            _ => return None,
        })
    }
}

impl WeightSource for HostWeights<'_> {
    fn device_bytes(&self, _: &ModelConfig) -> usize {
        device_bytes(self.0)
    }

    fn mat(
        &mut self,
        gpu: &Gpu,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMat> {
        let Some(parts) = self.linears(module) else {
            bail!("the model has no linear {module}")
        };
        ensure!(
            parts.len() == count && parts.iter().all(|p| (p.rows(), p.cols()) == (rows, cols)),
            "{module}: expected {count} matrices of {rows}x{cols}"
        );
        DeviceMat::stack(gpu, &parts)
    }

    fn norm(&mut self, gpu: &Gpu, name: &str, len: usize) -> Result<CudaSlice<f32>> {
        self.floats(gpu, name, &[len])
    }

    fn floats(&mut self, gpu: &Gpu, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>> {
        let Some(values) = self.floats_of(name) else {
            bail!("the model has no tensor {name}")
        };
        ensure!(
            values.len() == shape.iter().product::<usize>(),
            "{name}: expected shape {shape:?}, the model holds {} values",
            values.len()
        );
        gpu.upload(values)
    }
}
