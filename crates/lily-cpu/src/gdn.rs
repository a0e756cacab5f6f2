//! The Gated DeltaNet layer (spec §2.5): projections, causal depthwise conv over q|k|v, L2 norms,
//! gates, the delta rule per value head, gated RMSNorm, output projection.

use lily_core::config::ModelConfig;
use lily_core::weights::GdnWeights;

use crate::delta_rule::{self, HeadInputs};
use crate::numerics::Numerics;
use crate::ops::{inv_rms, l2_normalize, row_of, sigmoid, silu, softplus};
use crate::products::Product;
use crate::profile::{Stage, stage};
use crate::state::GdnState;
use crate::team;

/// Which form of the delta rule a prefill uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnForm {
    /// Token by token, as decode runs.
    Recurrent,
    /// 64-token WY chunks, as a GPU prefill runs.
    Chunked,
}

/// The chunk length of the WY form (HF, FLA and llama.cpp all use 64).
pub const GDN_CHUNK: usize = 64;

/// Eps of the q/k L2 norms (inside the root).
const L2_EPS: f32 = 1e-6;

/// Channels of one row's causal conv a task computes.
const CONV_CHANNELS_PER_TASK: usize = 512;

pub fn gated_delta_net(
    c: &ModelConfig,
    w: &GdnWeights,
    x: &[f32],
    rows: usize,
    state: &mut GdnState,
    form: GdnForm,
    nx: Numerics,
) -> Vec<f32> {
    let p = stage(Stage::MixerInput, || Projections::of(w, x, rows, nx));
    let out = mix(c, w, &p, rows, state, form);
    stage(Stage::MixerOutput, || nx.matmul(&out, rows, &w.out_proj))
}

/// One decode step of several sequences, row `i` of `x` into `states[i]`: the projections take
/// every row at once (each weight read once), the conv and the delta rule run per sequence on
/// its own state.
pub fn gated_delta_net_batch(
    c: &ModelConfig,
    w: &GdnWeights,
    x: &[f32],
    states: &mut [&mut GdnState],
    nx: Numerics,
) -> Vec<f32> {
    let rows = states.len();
    let p = stage(Stage::MixerInput, || Projections::of(w, x, rows, nx));
    // One sequence after another, each spread over the team by heads (a flat region: a batch
    // is a handful of sequences, fewer than the threads).
    let out: Vec<f32> = states
        .iter_mut()
        .enumerate()
        .flat_map(|(i, state)| mix(c, w, &p.row(i, rows), 1, state, GdnForm::Recurrent))
        .collect();
    stage(Stage::MixerOutput, || nx.matmul(&out, rows, &w.out_proj))
}

/// The input projections of a chunk: q|k|v before the conv, the output gate z, and the rows
/// that become β and the decay.
struct Projections {
    mixed: Vec<f32>,
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
}

impl Projections {
    fn of(w: &GdnWeights, x: &[f32], rows: usize, nx: Numerics) -> Self {
        let [mixed, z, b, a] = nx.products([
            Product::new(&w.in_proj_qkv, x, rows),
            Product::new(&w.in_proj_z, x, rows),
            Product::new(&w.in_proj_b, x, rows),
            Product::new(&w.in_proj_a, x, rows),
        ]);
        Projections { mixed, z, b, a }
    }

    /// Row `i` of `rows`, on its own.
    fn row(&self, i: usize, rows: usize) -> Projections {
        let at = |m: &[f32]| row_of(m, i, rows);
        Projections {
            mixed: at(&self.mixed),
            z: at(&self.z),
            b: at(&self.b),
            a: at(&self.a),
        }
    }
}

/// One sequence's conv, delta rule and gated norm over its projected rows, advancing `state`;
/// the output before `out_proj`.
fn mix(
    c: &ModelConfig,
    w: &GdnWeights,
    p: &Projections,
    rows: usize,
    state: &mut GdnState,
    form: GdnForm,
) -> Vec<f32> {
    let conv = stage(Stage::GdnConv, || {
        causal_conv(c, w, &p.mixed, rows, &mut state.conv)
    });
    let per_head = stage(Stage::DeltaRule, || {
        delta_rule_heads(c, w, p, &conv, rows, &mut state.recurrent, form)
    });
    stage(Stage::GdnNorm, || gated_norm(c, w, &per_head, &p.z, rows))
}

/// The causal conv of a chunk's q|k|v rows, silu applied; `cached` holds the `kernel - 1` rows
/// before them and is moved on past them.
fn causal_conv(
    c: &ModelConfig,
    w: &GdnWeights,
    mixed: &[f32],
    rows: usize,
    cached: &mut Vec<f32>,
) -> Vec<f32> {
    let (conv_dim, kernel) = (c.gdn_conv_dim(), c.conv_kernel);
    let keep = kernel - 1;
    // Row u of the window: the cached rows, then the chunk's. Read in place: the window as one
    // buffer was a serial copy of the chunk (8 MB at 256 tokens) on the leading thread.
    let window = |u: usize| -> &[f32] {
        if u < keep {
            &cached[u * conv_dim..(u + 1) * conv_dim]
        } else {
            &mixed[(u - keep) * conv_dim..(u - keep + 1) * conv_dim]
        }
    };
    // In blocks of channels within a row: a decode step has one row, whose 8,192 channels (an
    // exponential each) took ~60 µs a layer on one thread.
    let mut conv = team::zeros(rows * conv_dim);
    // Blocks that tile every row: the largest divisor of the row up to the block size.
    let block = (1..=CONV_CHANNELS_PER_TASK)
        .rev()
        .find(|d| conv_dim.is_multiple_of(*d))
        .unwrap_or(1);
    team::for_chunks(&mut conv, block, |i, out| {
        let (t, first) = (i * block / conv_dim, i * block % conv_dim);
        let taps_rows: Vec<&[f32]> = (0..kernel).map(|j| window(t + j)).collect();
        for (ch, o) in (first..).zip(out) {
            let taps = &w.conv1d.data[ch * kernel..(ch + 1) * kernel];
            let sum: f32 = (0..kernel).map(|j| taps[j] * taps_rows[j][ch]).sum();
            *o = silu(sum);
        }
    });
    let mut next = Vec::with_capacity(keep * conv_dim);
    for u in rows..rows + keep {
        next.extend_from_slice(window(u));
    }
    *cached = next;
    conv
}

/// Per value head: gather q/k (of its key head) and v, normalise, compute the gates and run the
/// delta rule on the head's state (`states`, `[value head, dk, dv]`); each head's output rows.
fn delta_rule_heads(
    c: &ModelConfig,
    w: &GdnWeights,
    p: &Projections,
    conv: &[f32],
    rows: usize,
    states: &mut [f32],
    form: GdnForm,
) -> Vec<Vec<f32>> {
    let (nk, nv) = (c.linear_num_key_heads, c.linear_num_value_heads);
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    let (key_dim, conv_dim) = (c.gdn_key_dim(), c.gdn_conv_dim());
    let (b, a) = (&p.b, &p.a);
    let ratio = nv / nk;
    let q_scale = 1.0 / (dk as f32).sqrt();
    // Each head's output made by its task (in parallel; they are megabytes at 256 tokens).
    let mut per_head: Vec<Vec<f32>> = vec![Vec::new(); nv];
    team::for_chunks2((&mut per_head, 1), (states, dk * dv), |j, o, s| {
        let o = &mut o[0];
        *o = vec![0f32; rows * dv];
        let kh = j / ratio;
        let (mut q, mut k, mut v) = (
            Vec::with_capacity(rows * dk),
            Vec::with_capacity(rows * dk),
            Vec::new(),
        );
        let (mut beta, mut g) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
        let a_rate = w.a_log[j].exp();
        for t in 0..rows {
            let row = &conv[t * conv_dim..(t + 1) * conv_dim];
            let mut qt = row[kh * dk..(kh + 1) * dk].to_vec();
            let mut kt = row[key_dim + kh * dk..key_dim + (kh + 1) * dk].to_vec();
            l2_normalize(&mut qt, L2_EPS);
            l2_normalize(&mut kt, L2_EPS);
            q.extend(qt.iter().map(|x| x * q_scale));
            k.extend(kt);
            v.extend_from_slice(&row[2 * key_dim + j * dv..2 * key_dim + (j + 1) * dv]);
            beta.push(sigmoid(b[t * nv + j]));
            g.push(-a_rate * softplus(a[t * nv + j] + w.dt_bias[j]));
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
        match form {
            GdnForm::Recurrent => delta_rule::recurrent(&inputs, s, o),
            GdnForm::Chunked => delta_rule::chunked(&inputs, GDN_CHUNK, s, o),
        }
    });
    per_head
}

/// Gated RMSNorm per value head: normalise, scale by the plain weight, gate with silu(z).
fn gated_norm(
    c: &ModelConfig,
    w: &GdnWeights,
    per_head: &[Vec<f32>],
    z: &[f32],
    rows: usize,
) -> Vec<f32> {
    let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
    let mut out = team::zeros(rows * nv * dv);
    // In parallel: at 16 threads a serial pass over a prompt chunk's rows costs as much as the
    // heads. A few tasks a thread: a head's row alone is too little work to hand out.
    let per_task = (rows * nv).div_ceil(4 * team::threads());
    team::for_chunks(&mut out, per_task * dv, |task, chunk| {
        for (th, dst) in (task * per_task..).zip(chunk.chunks_mut(dv)) {
            let (t, j) = (th / nv, th % nv);
            let o = &per_head[j][t * dv..(t + 1) * dv];
            let inv = inv_rms(o, c.rms_norm_eps);
            let zt = &z[th * dv..(th + 1) * dv];
            for i in 0..dv {
                dst[i] = o[i] * inv * w.norm[i] * silu(zt[i]);
            }
        }
    });
    out
}
