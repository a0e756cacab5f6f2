//! What the GPU tests of the GDN prefill kernels share (gpu_gdn_prefill.rs: the token scan,
//! conv and gated norm; gpu_gdn_chunked.rs: the chunked route): a layer's random parameters and
//! carried state, the chunk on the CPU (lily-cpu's delta rule), the chunk through the launchers,
//! and the comparison.
// Each of the two test binaries uses its own subset.
#![allow(dead_code)]

use cudarc::driver::CudaSlice;
use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use lily_core::rng::uniform_at;
use lily_cpu::delta_rule::{self, HeadInputs};
use lily_cpu::ops::{inv_rms, l2_normalize, sigmoid, silu, softplus};
use lily_cuda::gdn_prefill::{GdnPrefillRoute, conv_rows, gated_norm_rows, scan, scratch_floats};
use lily_cuda::gpu::{Gpu, ptr};

use crate::support::rel_diff;

/// (NK, NV, DK, DV): the production heads, and a small shape where a warp holds two columns of
/// 16-row keys and two value heads share a key head.
pub const SHAPES: [(usize, usize, usize, usize); 2] = [(16, 32, 128, 128), (2, 4, 16, 32)];

/// Extra floats at the end of every proj row, set to NaN: a kernel reading past its columns
/// (or using the row width instead of `ld`) turns its output into NaN.
pub const ROW_PAD: usize = 3;

/// Tolerance, as max |diff| / max |reference|. The GPU runs the same f32 operations in another
/// order (fused multiply-adds, split and shuffle-tree sums, α·(S·k) for (αS)·k) and `rsqrtf`/
/// `__expf` within a few ulp: about 1e-7 relative per token. The recurrence does not amplify
/// it (α ≤ 1, and I − βkkᵀ has norm ≤ 1 for β ≤ 1 and |k| = 1), so over 1,000 tokens errors stay
/// near 1e-6; 1e-5 leaves margin.
pub const TOL: f32 = 1e-5;

/// Eps of the q/k L2 norms (lily-cpu's gdn.rs, spec §2.2c).
pub const L2_EPS: f32 = 1e-6;

pub fn config(nk: usize, nv: usize, dk: usize, dv: usize) -> ModelConfig {
    let mut c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
    c.linear_num_key_heads = nk;
    c.linear_num_value_heads = nv;
    c.linear_key_head_dim = dk;
    c.linear_value_head_dim = dv;
    c
}

/// Floats of one [qkv | z | b | a] projection row.
pub fn proj_width(c: &ModelConfig) -> usize {
    c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads
}

pub fn random(n: usize, seed: u64, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| offset + scale * uniform_at(seed, i as u64))
        .collect()
}

/// A layer's parameters on the host.
pub struct Layer {
    pub conv_w: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub norm: Vec<f32>,
}

impl Layer {
    pub fn random(c: &ModelConfig, seed: u64) -> Self {
        let nv = c.linear_num_value_heads;
        Layer {
            conv_w: random(c.gdn_conv_dim() * c.conv_kernel, seed, 0.5, 0.0),
            // With a ∈ [-2, 2] this spans decays α from ~1e-3 (forget at once) to ~0.99 (a
            // memory of ~100 tokens), as the real model's heads do.
            a_log: random(nv, seed + 1, 1.5, -0.5),
            dt_bias: random(nv, seed + 2, 1.0, 0.0),
            norm: random(c.linear_value_head_dim, seed + 3, 0.2, 1.0),
        }
    }
}

/// What a chunk carries over: the conv window `[(K−1), conv_dim]` and the state `[NV, DK, DV]`.
#[derive(Clone)]
pub struct Carried {
    pub window: Vec<f32>,
    pub state: Vec<f32>,
}

impl Carried {
    /// Non-zero, as after an earlier chunk.
    pub fn random(c: &ModelConfig, seed: u64) -> Self {
        let nv = c.linear_num_value_heads;
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        Carried {
            window: random((c.conv_kernel - 1) * c.gdn_conv_dim(), seed, 1.0, 0.0),
            state: random(nv * dk * dv, seed + 1, 0.3, 0.0),
        }
    }
}

/// Proj rows `[t, ld]`: values in [-1, 1], the `a` columns in [-2, 2], padding NaN.
pub fn proj_rows(c: &ModelConfig, t: usize, seed: u64) -> (Vec<f32>, usize) {
    let width = proj_width(c);
    let ld = width + ROW_PAD;
    let a0 = width - c.linear_num_value_heads;
    let mut proj = random(t * ld, seed, 1.0, 0.0);
    for row in proj.chunks_mut(ld) {
        row[a0..width].iter_mut().for_each(|a| *a *= 2.0);
        row[width..].fill(f32::NAN);
    }
    (proj, ld)
}

/// A chunk's results: conv output `[t, conv_dim]`, scan output and gated norm `[t, NV·DV]`.
pub struct Outputs {
    pub conv: Vec<f32>,
    pub o: Vec<f32>,
    pub y: Vec<f32>,
}

/// The chunk on the CPU, as lily-cpu's gdn.rs computes it (which is private there) with its
/// public delta rule, updating `carried`.
pub fn reference(
    c: &ModelConfig,
    w: &Layer,
    proj: &[f32],
    ld: usize,
    t: usize,
    carried: &mut Carried,
) -> Outputs {
    let (nk, nv) = (c.linear_num_key_heads, c.linear_num_value_heads);
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    let (key_dim, conv_dim, kernel) = (c.gdn_key_dim(), c.gdn_conv_dim(), c.conv_kernel);
    let row = |tok: usize| &proj[tok * ld..tok * ld + proj_width(c)];

    let mut window = carried.window.clone();
    (0..t).for_each(|tok| window.extend_from_slice(&row(tok)[..conv_dim]));
    let mut conv = vec![0f32; t * conv_dim];
    for (tok, out) in conv.chunks_mut(conv_dim).enumerate() {
        for (ch, o) in out.iter_mut().enumerate() {
            let taps = &w.conv_w[ch * kernel..(ch + 1) * kernel];
            let sum: f32 = (0..kernel)
                .map(|j| taps[j] * window[(tok + j) * conv_dim + ch])
                .sum();
            *o = silu(sum);
        }
    }
    carried.window = window[t * conv_dim..].to_vec();

    let q_scale = 1.0 / (dk as f32).sqrt();
    let mut o = vec![0f32; t * nv * dv];
    for j in 0..nv {
        let kh = j / (nv / nk);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let (mut beta, mut g) = (Vec::new(), Vec::new());
        for tok in 0..t {
            let cr = &conv[tok * conv_dim..(tok + 1) * conv_dim];
            let mut qt = cr[kh * dk..(kh + 1) * dk].to_vec();
            let mut kt = cr[key_dim + kh * dk..key_dim + (kh + 1) * dk].to_vec();
            l2_normalize(&mut qt, L2_EPS);
            l2_normalize(&mut kt, L2_EPS);
            q.extend(qt.iter().map(|x| x * q_scale));
            k.extend(kt);
            v.extend_from_slice(&cr[2 * key_dim + j * dv..2 * key_dim + (j + 1) * dv]);
            let ba = &row(tok)[conv_dim + nv * dv..];
            beta.push(sigmoid(ba[j]));
            g.push(-w.a_log[j].exp() * softplus(ba[nv + j] + w.dt_bias[j]));
        }
        let inputs = HeadInputs {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: &g,
            dk,
            dv,
        };
        let mut head_out = vec![0f32; t * dv];
        let s = &mut carried.state[j * dk * dv..(j + 1) * dk * dv];
        delta_rule::recurrent(&inputs, s, &mut head_out);
        for tok in 0..t {
            o[(tok * nv + j) * dv..][..dv].copy_from_slice(&head_out[tok * dv..][..dv]);
        }
    }

    let mut y = vec![0f32; t * nv * dv];
    for tok in 0..t {
        for j in 0..nv {
            let at = (tok * nv + j) * dv;
            let oh = &o[at..at + dv];
            let inv = inv_rms(oh, c.rms_norm_eps);
            let z = &row(tok)[conv_dim + j * dv..conv_dim + (j + 1) * dv];
            for i in 0..dv {
                y[at + i] = oh[i] * inv * w.norm[i] * silu(z[i]);
            }
        }
    }
    Outputs { conv, o, y }
}

/// A layer's parameters and carried state on the device.
pub struct DeviceLayer {
    pub conv_w: CudaSlice<f32>,
    pub a_log: CudaSlice<f32>,
    pub dt_bias: CudaSlice<f32>,
    pub norm: CudaSlice<f32>,
    pub window: CudaSlice<f32>,
    pub state: CudaSlice<f32>,
}

impl DeviceLayer {
    pub fn upload(gpu: &Gpu, w: &Layer, carried: &Carried) -> Self {
        DeviceLayer {
            conv_w: gpu.upload(&w.conv_w).unwrap(),
            a_log: gpu.upload(&w.a_log).unwrap(),
            dt_bias: gpu.upload(&w.dt_bias).unwrap(),
            norm: gpu.upload(&w.norm).unwrap(),
            window: gpu.upload(&carried.window).unwrap(),
            state: gpu.upload(&carried.state).unwrap(),
        }
    }

    pub fn carried(&self, gpu: &Gpu) -> Carried {
        Carried {
            window: gpu.download(&self.window).unwrap(),
            state: gpu.download(&self.state).unwrap(),
        }
    }
}

/// One chunk through the three launchers (the delta rule by the token scan), updating the
/// device layer's window and state.
pub fn run_chunk(
    gpu: &Gpu,
    c: &ModelConfig,
    d: &DeviceLayer,
    proj: &[f32],
    ld: usize,
    t: usize,
) -> Outputs {
    run_chunk_by(gpu, c, d, proj, ld, t, GdnPrefillRoute::Scan)
}

/// [`run_chunk`] with the delta rule by `route`.
pub fn run_chunk_by(
    gpu: &Gpu,
    c: &ModelConfig,
    d: &DeviceLayer,
    proj: &[f32],
    ld: usize,
    t: usize,
    route: GdnPrefillRoute,
) -> Outputs {
    let s = &gpu.stream;
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let dproj = gpu.upload(&proj[..t * ld]).unwrap();
    let conv = gpu.zeros::<f32>(t * c.gdn_conv_dim()).unwrap();
    let prep = gpu.zeros::<f32>(scratch_floats(c, t, route)).unwrap();
    let o = gpu.zeros::<f32>(t * c.gdn_value_dim()).unwrap();
    let y = gpu.zeros::<f32>(t * c.gdn_value_dim()).unwrap();
    conv_rows(
        gpu,
        c,
        p(&dproj),
        ld,
        t,
        p(&d.conv_w),
        p(&d.window),
        p(&conv),
        None,
    )
    .unwrap();
    scan(
        gpu,
        c,
        route,
        p(&conv),
        p(&dproj),
        ld,
        t,
        p(&d.a_log),
        p(&d.dt_bias),
        p(&prep),
        p(&d.state),
        p(&o),
    )
    .unwrap();
    let eps = c.rms_norm_eps;
    gated_norm_rows(gpu, c, p(&o), p(&dproj), ld, t, p(&d.norm), p(&y), eps).unwrap();
    gpu.sync().unwrap();
    Outputs {
        conv: gpu.download(&conv).unwrap(),
        o: gpu.download(&o).unwrap(),
        y: gpu.download(&y).unwrap(),
    }
}

/// Asserts the GPU's chunk outputs and carried state against the reference, printing errors.
pub fn check(label: &str, got: (&Outputs, &Carried), want: (&Outputs, &Carried)) {
    check_within(label, got, want, TOL);
}

/// [`check`] with tolerance `tol`.
pub fn check_within(label: &str, got: (&Outputs, &Carried), want: (&Outputs, &Carried), tol: f32) {
    let d_conv = rel_diff(&got.0.conv, &want.0.conv);
    let d_o = rel_diff(&got.0.o, &want.0.o);
    let d_y = rel_diff(&got.0.y, &want.0.y);
    let d_state = rel_diff(&got.1.state, &want.1.state);
    eprintln!(
        "{label}: max rel diff conv {d_conv:.2e}, o {d_o:.2e}, y {d_y:.2e}, state {d_state:.2e}"
    );
    // The window is copies of inputs, so it must match exactly.
    assert!(
        got.1.window == want.1.window,
        "{label}: the conv window differs"
    );
    for (what, d) in [("conv", d_conv), ("o", d_o), ("y", d_y), ("state", d_state)] {
        assert!(d <= tol, "{label}: {what} differs by {d:e}");
    }
}
