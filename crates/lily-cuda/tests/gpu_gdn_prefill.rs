//! The prefill Gated DeltaNet kernels (conv, scan, gated norm over a chunk) against a CPU
//! reference built from lily-cpu's delta rule, starting from a non-zero conv window and state as
//! after an earlier chunk; the delta rule by both routes (the token scan and the chunked WY form). These need a CUDA GPU: ignored by a plain `cargo test`, run on the
//! H200 with `--include-ignored`. Every comparison prints its measured error.

mod support;

use cudarc::driver::CudaSlice;
use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};
use lily_core::rng::uniform_at;
use lily_cpu::delta_rule::{self, HeadInputs};
use lily_cpu::ops::{inv_rms, l2_normalize, sigmoid, silu, softplus};
use lily_cuda::KvPrecision;
use lily_cuda::gdn_prefill::{GdnPrefillRoute, conv_rows, gated_norm_rows, scan, scratch_floats};
use lily_cuda::gpu::{Gpu, ptr};
use support::{NEEDS_GPU, rel_diff, time_ms};

/// (NK, NV, DK, DV): the production heads, and a small shape where a warp holds two columns of
/// 16-row keys and two value heads share a key head.
const SHAPES: [(usize, usize, usize, usize); 2] = [(16, 32, 128, 128), (2, 4, 16, 32)];

const LENGTHS: [usize; 6] = [1, 2, 7, 33, 200, 1000];

/// Extra floats at the end of every proj row, set to NaN: a kernel reading past its columns
/// (or using the row width instead of `ld`) turns its output into NaN.
const ROW_PAD: usize = 3;

/// Tolerance, as max |diff| / max |reference|. The GPU runs the same f32 operations in another
/// order (fused multiply-adds, split and shuffle-tree sums, α·(S·k) for (αS)·k) and `rsqrtf`/
/// `__expf` within a few ulp: about 1e-7 relative per token. The recurrence does not amplify
/// it (α ≤ 1, and I − βkkᵀ has norm ≤ 1 for β ≤ 1 and |k| = 1), so over 1,000 tokens errors stay
/// near 1e-6; 1e-5 leaves margin.
const TOL: f32 = 1e-5;

/// Tolerance of the chunked route, as [`TOL`]. Its products run on tensor cores as 3xTF32
/// (operands split into two TF32 halves, about 2⁻²² relative each) with f32 accumulation, and
/// everything stored (A, T, W, Tβ, P, V', S) is f32 (γ is summed in f64). An f64 model of the
/// same algebra ([`chunked_model`]) with each product's operands rounded as the kernels round
/// them stays within 5e-7 of the f64 recurrence at every length here, decays vanishing or not
/// (it was 2e-5 with γ summed in f32, hence f64), and f32 sums of 64 to 128 terms add about as
/// much; the f32 CPU reference is itself ~1e-6 off. 2e-5 is [`TOL`] doubled for that; an algebra
/// or fragment-layout mistake shows as 1e-2 or worse (plain TF32 would be ~1e-3).
const TOL_CHUNKED: f32 = 2e-5;

/// Lengths for the chunked route: one token, ragged single chunks, exactly one chunk, one past
/// it, and many chunks with a ragged last one.
const CHUNKED_LENGTHS: [usize; 8] = [1, 7, 33, 63, 64, 65, 200, 1000];

/// Eps of the q/k L2 norms (lily-cpu's gdn.rs, spec §2.2c).
const L2_EPS: f32 = 1e-6;

fn config(nk: usize, nv: usize, dk: usize, dv: usize) -> ModelConfig {
    let mut c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
    c.linear_num_key_heads = nk;
    c.linear_num_value_heads = nv;
    c.linear_key_head_dim = dk;
    c.linear_value_head_dim = dv;
    c
}

/// Floats of one [qkv | z | b | a] projection row.
fn proj_width(c: &ModelConfig) -> usize {
    c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads
}

fn random(n: usize, seed: u64, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| offset + scale * uniform_at(seed, i as u64))
        .collect()
}

/// A layer's parameters on the host.
struct Layer {
    conv_w: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
}

impl Layer {
    fn random(c: &ModelConfig, seed: u64) -> Self {
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
struct Carried {
    window: Vec<f32>,
    state: Vec<f32>,
}

impl Carried {
    /// Non-zero, as after an earlier chunk.
    fn random(c: &ModelConfig, seed: u64) -> Self {
        let nv = c.linear_num_value_heads;
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        Carried {
            window: random((c.conv_kernel - 1) * c.gdn_conv_dim(), seed, 1.0, 0.0),
            state: random(nv * dk * dv, seed + 1, 0.3, 0.0),
        }
    }
}

/// Proj rows `[t, ld]`: values in [-1, 1], the `a` columns in [-2, 2], padding NaN.
fn proj_rows(c: &ModelConfig, t: usize, seed: u64) -> (Vec<f32>, usize) {
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
struct Outputs {
    conv: Vec<f32>,
    o: Vec<f32>,
    y: Vec<f32>,
}

/// The chunk on the CPU, as lily-cpu's gdn.rs computes it (which is private there) with its
/// public delta rule, updating `carried`.
fn reference(
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
struct DeviceLayer {
    conv_w: CudaSlice<f32>,
    a_log: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    norm: CudaSlice<f32>,
    window: CudaSlice<f32>,
    state: CudaSlice<f32>,
}

impl DeviceLayer {
    fn upload(gpu: &Gpu, w: &Layer, carried: &Carried) -> Self {
        DeviceLayer {
            conv_w: gpu.upload(&w.conv_w).unwrap(),
            a_log: gpu.upload(&w.a_log).unwrap(),
            dt_bias: gpu.upload(&w.dt_bias).unwrap(),
            norm: gpu.upload(&w.norm).unwrap(),
            window: gpu.upload(&carried.window).unwrap(),
            state: gpu.upload(&carried.state).unwrap(),
        }
    }

    fn carried(&self, gpu: &Gpu) -> Carried {
        Carried {
            window: gpu.download(&self.window).unwrap(),
            state: gpu.download(&self.state).unwrap(),
        }
    }
}

/// One chunk through the three launchers (the delta rule by the token scan), updating the
/// device layer's window and state.
fn run_chunk(
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
fn run_chunk_by(
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
fn check(label: &str, got: (&Outputs, &Carried), want: (&Outputs, &Carried)) {
    check_within(label, got, want, TOL);
}

/// [`check`] with tolerance `tol`.
fn check_within(label: &str, got: (&Outputs, &Carried), want: (&Outputs, &Carried), tol: f32) {
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_chunk_matches_the_cpu_reference() {
    for (nk, nv, dk, dv) in SHAPES {
        let c = config(nk, nv, dk, dv);
        let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
        let w = Layer::random(&c, 10);
        for t in LENGTHS {
            let start = Carried::random(&c, 20 + t as u64);
            let (proj, ld) = proj_rows(&c, t, 30 + t as u64);
            let d = DeviceLayer::upload(&gpu, &w, &start);
            let got = run_chunk(&gpu, &c, &d, &proj, ld, t);
            let mut want_carried = start;
            let want = reference(&c, &w, &proj, ld, t, &mut want_carried);
            let label = format!("NK {nk} NV {nv} DK {dk} DV {dv}, T {t}");
            check(&label, (&got, &d.carried(&gpu)), (&want, &want_carried));
        }
    }
}

/// Chunks T1 then T2 leave what one chunk of T1 + T2 does, including T1 shorter than the conv
/// window (old window rows mixed into the new one).
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_chunks_equal_one() {
    for (nk, nv, dk, dv) in SHAPES {
        let c = config(nk, nv, dk, dv);
        let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
        let w = Layer::random(&c, 40);
        for (t1, t2) in [(1, 1), (2, 5), (1, 40), (33, 167), (600, 400)] {
            let t = t1 + t2;
            let start = Carried::random(&c, 50 + t1 as u64);
            let (proj, ld) = proj_rows(&c, t, 60 + t2 as u64);

            let whole = DeviceLayer::upload(&gpu, &w, &start);
            let one = run_chunk(&gpu, &c, &whole, &proj, ld, t);
            let one_carried = whole.carried(&gpu);

            let split = DeviceLayer::upload(&gpu, &w, &start);
            let first = run_chunk(&gpu, &c, &split, &proj, ld, t1);
            let second = run_chunk(&gpu, &c, &split, &proj[t1 * ld..], ld, t2);
            let two = Outputs {
                conv: [first.conv, second.conv].concat(),
                o: [first.o, second.o].concat(),
                y: [first.y, second.y].concat(),
            };
            let two_carried = split.carried(&gpu);

            let label = format!("NK {nk} NV {nv} DK {dk} DV {dv}, T {t1} + {t2}");
            let bitwise = two.o == one.o && two_carried.state == one_carried.state;
            eprintln!("{label}: two chunks bitwise equal to one: {bitwise}");
            // Each token runs the same operations in the same order either way, so the two
            // should agree to the bit; 1e-6 allows a compiler's different instruction choice.
            for (what, a, b) in [
                ("conv", &two.conv, &one.conv),
                ("o", &two.o, &one.o),
                ("y", &two.y, &one.y),
                ("state", &two_carried.state, &one_carried.state),
            ] {
                let d = rel_diff(a, b);
                assert!(d <= 1e-6, "{label}: {what} differs by {d:e}");
            }
            assert!(
                two_carried.window == one_carried.window,
                "{label}: the conv window differs"
            );
            let mut want_carried = start;
            let want = reference(&c, &w, &proj, ld, t, &mut want_carried);
            check(&label, (&two, &two_carried), (&want, &want_carried));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_matches_the_cpu_reference() {
    for (nk, nv, dk, dv) in SHAPES {
        let c = config(nk, nv, dk, dv);
        let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
        let w = Layer::random(&c, 70);
        for t in CHUNKED_LENGTHS {
            let start = Carried::random(&c, 80 + t as u64);
            let (proj, ld) = proj_rows(&c, t, 90 + t as u64);
            let d = DeviceLayer::upload(&gpu, &w, &start);
            let got = run_chunk_by(&gpu, &c, &d, &proj, ld, t, GdnPrefillRoute::Chunked);
            let mut want_carried = start;
            let want = reference(&c, &w, &proj, ld, t, &mut want_carried);
            let label = format!("chunked, NK {nk} NV {nv} DK {dk} DV {dv}, T {t}");
            check_within(
                &label,
                (&got, &d.carried(&gpu)),
                (&want, &want_carried),
                TOL_CHUNKED,
            );
        }
    }
}

/// Both routes on the same inputs and state, and the chunked route continued by a second call
/// (the state it leaves is the next call's start).
#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_matches_the_scan() {
    for (nk, nv, dk, dv) in SHAPES {
        let c = config(nk, nv, dk, dv);
        let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
        let w = Layer::random(&c, 100);
        for (t1, t2) in [(1, 64), (65, 63), (200, 1000), (1000, 7)] {
            let t = t1 + t2;
            let start = Carried::random(&c, 110 + t1 as u64);
            let (proj, ld) = proj_rows(&c, t, 120 + t2 as u64);
            let by = |route| {
                let d = DeviceLayer::upload(&gpu, &w, &start);
                let first = run_chunk_by(&gpu, &c, &d, &proj, ld, t1, route);
                let second = run_chunk_by(&gpu, &c, &d, &proj[t1 * ld..], ld, t2, route);
                let out = Outputs {
                    conv: [first.conv, second.conv].concat(),
                    o: [first.o, second.o].concat(),
                    y: [first.y, second.y].concat(),
                };
                (out, d.carried(&gpu))
            };
            let (chunked, chunked_carried) = by(GdnPrefillRoute::Chunked);
            let (scan, scan_carried) = by(GdnPrefillRoute::Scan);
            let label = format!("chunked vs scan, NK {nk} NV {nv} DK {dk} DV {dv}, T {t1} + {t2}");
            check_within(
                &label,
                (&chunked, &chunked_carried),
                (&scan, &scan_carried),
                TOL_CHUNKED,
            );
        }
    }
}

/// Decays so strong that α = exp(g) underflows to 0 in f32 for some tokens (the `a` columns
/// scaled to [-40, 40]): the chunked route takes log α, clamped, and must not turn 0 into NaN.
#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_survives_vanishing_decays() {
    let (nk, nv, dk, dv) = SHAPES[0];
    let c = config(nk, nv, dk, dv);
    let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
    let w = Layer::random(&c, 130);
    let t = 200;
    let start = Carried::random(&c, 140);
    let (mut proj, ld) = proj_rows(&c, t, 150);
    let a0 = proj_width(&c) - nv;
    for row in proj.chunks_mut(ld) {
        row[a0..a0 + nv].iter_mut().for_each(|a| *a *= 20.0);
    }
    let d = DeviceLayer::upload(&gpu, &w, &start);
    let got = run_chunk_by(&gpu, &c, &d, &proj, ld, t, GdnPrefillRoute::Chunked);
    let mut want_carried = start;
    let want = reference(&c, &w, &proj, ld, t, &mut want_carried);
    let label = format!("chunked, vanishing decays, T {t}");
    check_within(
        &label,
        (&got, &d.carried(&gpu)),
        (&want, &want_carried),
        TOL_CHUNKED,
    );
}

/// The chunked kernels' algebra in f64 on the host, in their order (γ by a serial sum, A and P
/// masked before exp, T by forward substitution a column at a time (the kernel inverts by 16 × 16
/// blocks, the same T in exact arithmetic), W and Tβ, then per chunk
/// V' = Tβ V − W S, O = (e^γ Q) S + P V', S ← e^{γ_C} S + (e^{γ_C − γ} K)ᵀ V', a ragged last
/// chunk padded with zeros), one value head with `q`, `k` `[t, dk]`, `v` `[t, dv]`. Returns o
/// `[t, dv]` and leaves the state `s` `[dk, dv]`. Indexed loops, to read like the kernels.
#[allow(clippy::needless_range_loop)]
fn chunked_model(
    (q, k, v): (&[f64], &[f64], &[f64]),
    (alpha, beta): (&[f64], &[f64]),
    (dk, dv): (usize, usize),
    s: &mut [f64],
) -> Vec<f64> {
    const C: usize = 64;
    let t = alpha.len();
    let mut o = vec![0.0; t * dv];
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for tok0 in (0..t).step_by(C) {
        let len = C.min(t - tok0);
        let row = |m: &[f64], d: usize, r: usize| -> Vec<f64> {
            if r < len {
                m[(tok0 + r) * d..][..d].to_vec()
            } else {
                vec![0.0; d]
            }
        };
        let (qc, kc, vc): (Vec<_>, Vec<_>, Vec<_>) = (0..C)
            .map(|r| (row(q, dk, r), row(k, dk, r), row(v, dv, r)))
            .collect::<Vec<_>>()
            .into_iter()
            .fold((vec![], vec![], vec![]), |mut acc, (a, b, c)| {
                acc.0.push(a);
                acc.1.push(b);
                acc.2.push(c);
                acc
            });
        let mut gam = [0.0f64; C];
        let mut bet = [0.0f64; C];
        for r in 0..len {
            gam[r] = alpha[tok0 + r].ln().max(-256.0);
            bet[r] = beta[tok0 + r];
        }
        for r in 1..C {
            gam[r] += gam[r - 1];
        }
        let d = |r: usize, s: usize| {
            if s <= r { (gam[r] - gam[s]).exp() } else { 0.0 }
        };
        let mut a = vec![[0.0f64; C]; C];
        let mut p = vec![[0.0f64; C]; C];
        for r in 0..C {
            for s in 0..C {
                if s < r {
                    a[r][s] = bet[r] * dot(&kc[r], &kc[s]) * d(r, s);
                }
                p[r][s] = dot(&qc[r], &kc[s]) * d(r, s);
            }
        }
        let mut tm = vec![[0.0f64; C]; C];
        for col in 0..C {
            tm[col][col] = 1.0;
            for r in col + 1..C {
                tm[r][col] = -(col..r).map(|s| a[r][s] * tm[s][col]).sum::<f64>();
            }
        }
        let w: Vec<Vec<f64>> = (0..C)
            .map(|r| {
                (0..dk)
                    .map(|i| {
                        (0..C)
                            .map(|s| tm[r][s] * bet[s] * gam[s].exp() * kc[s][i])
                            .sum()
                    })
                    .collect()
            })
            .collect();
        let g_end = gam[C - 1];
        let mut vp = vec![vec![0.0f64; dv]; C];
        for r in 0..C {
            for c in 0..dv {
                let u: f64 = (0..C).map(|s| tm[r][s] * bet[s] * vc[s][c]).sum();
                let ws: f64 = (0..dk).map(|i| w[r][i] * s[i * dv + c]).sum();
                vp[r][c] = u - ws;
            }
        }
        for r in 0..len {
            for c in 0..dv {
                let qs: f64 = (0..dk)
                    .map(|i| gam[r].exp() * qc[r][i] * s[i * dv + c])
                    .sum();
                let pv: f64 = (0..C).map(|x| p[r][x] * vp[x][c]).sum();
                o[(tok0 + r) * dv + c] = qs + pv;
            }
        }
        for i in 0..dk {
            for c in 0..dv {
                let kv: f64 = (0..C)
                    .map(|x| (g_end - gam[x]).exp() * kc[x][i] * vp[x][c])
                    .sum();
                s[i * dv + c] = g_end.exp() * s[i * dv + c] + kv;
            }
        }
    }
    o
}

/// Runs without a GPU: the chunked route's algebra (in f64, [`chunked_model`]) against the token
/// recurrence (in f64, the scan's order), at the lengths the GPU tests use, from a nonzero state,
/// with ordinary decays and with decays that underflow (α = 0, which the route clamps in log
/// space). Agreement to 1e-11 shows the reorganisation is exact; the GPU tests then measure the
/// kernels' rounding.
#[test]
fn the_chunked_algebra_matches_the_recurrence() {
    let (dk, dv) = (16, 8);
    for (t, strong) in [
        (1, false),
        (7, false),
        (63, false),
        (64, false),
        (65, false),
    ]
    .into_iter()
    .chain([(200, false), (300, true)])
    {
        let seed = 200 + t as u64;
        let f = |n: usize, s: u64| -> Vec<f64> {
            (0..n)
                .map(|i| uniform_at(seed + s, i as u64) as f64)
                .collect()
        };
        let unit = |x: Vec<f64>, scale: f64| -> Vec<f64> {
            x.chunks(dk)
                .flat_map(|r| {
                    let n = r.iter().map(|y| y * y).sum::<f64>().sqrt() + 1e-9;
                    r.iter().map(move |y| y / n * scale).collect::<Vec<_>>()
                })
                .collect()
        };
        let q = unit(f(t * dk, 1), 1.0 / (dk as f64).sqrt());
        let k = unit(f(t * dk, 2), 1.0);
        let v = f(t * dv, 3);
        let gate = if strong { 80.0 } else { 2.0 };
        let alpha: Vec<f64> = f(t, 4)
            .iter()
            // Rounded to f32 as gdn_scan_prep stores it: strong gates give exp(−120) = 0.
            .map(|a| (-1.5 * (1.0 + (gate * a).exp()).ln()).exp() as f32 as f64)
            .collect();
        let beta: Vec<f64> = f(t, 5).iter().map(|b| 1.0 / (1.0 + (-b).exp())).collect();
        let s0: Vec<f64> = f(dk * dv, 6).iter().map(|x| 0.3 * x).collect();

        let mut s_ref = s0.clone();
        let mut o_ref = vec![0.0; t * dv];
        for tok in 0..t {
            let (kt, qt) = (&k[tok * dk..][..dk], &q[tok * dk..][..dk]);
            for c in 0..dv {
                let pred: f64 = (0..dk).map(|i| s_ref[i * dv + c] * kt[i]).sum();
                let delta = beta[tok] * (v[tok * dv + c] - alpha[tok] * pred);
                for i in 0..dk {
                    s_ref[i * dv + c] = alpha[tok] * s_ref[i * dv + c] + kt[i] * delta;
                }
                o_ref[tok * dv + c] = (0..dk).map(|i| s_ref[i * dv + c] * qt[i]).sum();
            }
        }
        let mut s = s0;
        let o = chunked_model((&q, &k, &v), (&alpha, &beta), (dk, dv), &mut s);
        let rel = |a: &[f64], b: &[f64]| {
            let m = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            a.iter()
                .zip(b)
                .fold(0.0f64, |d, (x, y)| d.max((x - y).abs()))
                / m
        };
        let (d_o, d_s) = (rel(&o, &o_ref), rel(&s, &s_ref));
        let underflows = alpha.iter().filter(|&&a| a == 0.0).count();
        eprintln!("chunked algebra, T {t}: o {d_o:.1e}, state {d_s:.1e} ({underflows} α = 0)");
        assert!(
            d_o < 1e-11 && d_s < 1e-11,
            "T {t}: o {d_o:e}, state {d_s:e}"
        );
        if strong {
            assert!(underflows > 0, "the strong gates should underflow some α");
        }
    }
}

/// One layer's GDN family at the production heads over chunks of 16 … 4,096 tokens, the delta
/// rule by each route (each timing includes `gdn_scan_prep`), timed: a record for choosing the
/// route by length (`CHUNKED_FROM_TOKENS` in gdn_prefill.rs), not a pass/fail (beyond finite outputs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn delta_rule_speed_by_length() {
    let (nk, nv, dk, dv) = SHAPES[0];
    let c = config(nk, nv, dk, dv);
    let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
    for t in [16, 32, 64, 128, 256, 1024, 4096] {
        delta_rule_speed_at(&gpu, &c, t);
    }
}

fn delta_rule_speed_at(gpu: &Gpu, c: &ModelConfig, t: usize) {
    let w = Layer::random(c, 160);
    let d = DeviceLayer::upload(gpu, &w, &Carried::random(c, 170));
    let (proj, ld) = proj_rows(c, t, 180);
    let s = &gpu.stream;
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let dproj = gpu.upload(&proj).unwrap();
    let conv = gpu.zeros::<f32>(t * c.gdn_conv_dim()).unwrap();
    let prep = gpu
        .zeros::<f32>(scratch_floats(c, t, GdnPrefillRoute::Chunked))
        .unwrap();
    let o = gpu.zeros::<f32>(t * c.gdn_value_dim()).unwrap();
    let y = gpu.zeros::<f32>(t * c.gdn_value_dim()).unwrap();
    let conv_ms = time_ms(gpu, &|| {
        conv_rows(
            gpu,
            c,
            p(&dproj),
            ld,
            t,
            p(&d.conv_w),
            p(&d.window),
            p(&conv),
        )
        .unwrap()
    });
    let norm_ms = time_ms(gpu, &|| {
        let eps = c.rms_norm_eps;
        gated_norm_rows(gpu, c, p(&o), p(&dproj), ld, t, p(&d.norm), p(&y), eps).unwrap()
    });
    for route in [GdnPrefillRoute::Scan, GdnPrefillRoute::Chunked] {
        let ms = time_ms(gpu, &|| {
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
            .unwrap()
        });
        gpu.sync().unwrap();
        let finite = gpu.download(&o).unwrap().iter().all(|x| x.is_finite());
        eprintln!(
            "{route:?}: delta rule {ms:.3} ms, family (conv {conv_ms:.3} + this + norm \
             {norm_ms:.3}) {:.3} ms per layer at T {t}",
            conv_ms + ms + norm_ms
        );
        assert!(finite, "{route:?}: non-finite outputs");
    }
}
