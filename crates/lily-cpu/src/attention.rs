//! Gated full attention (spec §2.4): per-head q|gate split, q/k RMSNorm, partial rotate-half
//! RoPE, GQA over the KV cache, sigmoid output gate.

use lily_core::config::ModelConfig;
use lily_core::weights::AttentionWeights;
use rayon::prelude::*;

use crate::ops::{dot, matmul, rms_norm_rows, sigmoid};
use crate::state::KvCache;

/// Runs `rows` tokens starting at absolute position `start`; appends them to `cache`.
pub fn attention(
    c: &ModelConfig,
    w: &AttentionWeights,
    x: &[f32],
    rows: usize,
    start: usize,
    cache: &mut KvCache,
) -> Vec<f32> {
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
    let qg = matmul(x, rows, &w.q_proj);
    let mut k = matmul(x, rows, &w.k_proj);
    let v = matmul(x, rows, &w.v_proj);

    let mut q = vec![0f32; rows * nh * hd];
    let mut gate = vec![0f32; rows * nh * hd];
    for (t, row) in qg.chunks(nh * 2 * hd).enumerate() {
        for h in 0..nh {
            let dst = (t * nh + h) * hd;
            q[dst..dst + hd].copy_from_slice(&row[h * 2 * hd..h * 2 * hd + hd]);
            gate[dst..dst + hd].copy_from_slice(&row[h * 2 * hd + hd..(h + 1) * 2 * hd]);
        }
    }
    rms_norm_rows(&mut q, &w.q_norm, c.rms_norm_eps);
    rms_norm_rows(&mut k, &w.k_norm, c.rms_norm_eps);
    let rope = Rope::new(c);
    for t in 0..rows {
        let pos = start + t;
        q[t * nh * hd..(t + 1) * nh * hd]
            .chunks_mut(hd)
            .for_each(|head| rope.apply(head, pos));
        k[t * nkv * hd..(t + 1) * nkv * hd]
            .chunks_mut(hd)
            .for_each(|head| rope.apply(head, pos));
    }
    cache.k.extend_from_slice(&k);
    cache.v.extend_from_slice(&v);

    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; rows * nh * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / nh, i % nh);
        let kvh = h / group;
        let qh = &q[i * hd..(i + 1) * hd];
        let visible = start + t + 1;
        let mut scores: Vec<f32> = (0..visible)
            .map(|p| dot(qh, &cache.k[(p * nkv + kvh) * hd..(p * nkv + kvh + 1) * hd]) * scale)
            .collect();
        crate::ops::softmax(&mut scores);
        for (p, s) in scores.iter().enumerate() {
            let vp = &cache.v[(p * nkv + kvh) * hd..(p * nkv + kvh + 1) * hd];
            o.iter_mut().zip(vp).for_each(|(o, v)| *o += s * v);
        }
        let g = &gate[i * hd..(i + 1) * hd];
        o.iter_mut().zip(g).for_each(|(o, g)| *o *= sigmoid(*g));
    });
    matmul(&out, rows, &w.o_proj)
}

/// Rotate-half RoPE over the first `rotary_dim` dims of a head; the rest pass through.
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(c: &ModelConfig) -> Self {
        let dim = c.rotary_dim;
        // Computed in f32 as the reference does: θ^(-2i/d) then position × frequency.
        let theta = c.rope_theta as f32;
        let inv_freq = (0..dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32))
            .collect();
        Rope { inv_freq }
    }

    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (i, f) in self.inv_freq.iter().enumerate() {
            let angle = pos as f32 * f;
            let (sin, cos) = angle.sin_cos();
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}
