//! Gated full attention (spec §2.4): per-head q|gate split, q/k RMSNorm, partial rotate-half
//! RoPE, GQA over the KV cache, sigmoid output gate.

use lily_core::config::ModelConfig;
use lily_core::weights::AttentionWeights;

use crate::numerics::{FA_KEYS, Numerics, bf16};
use crate::ops::{dot, rms_norm_rows, row_of, sigmoid};
use crate::products::Product;
use crate::profile::{Stage, stage};
use crate::state::KvCache;
use crate::team;

/// Runs `rows` tokens starting at absolute position `start`; appends them to `cache`.
pub fn attention(
    c: &ModelConfig,
    w: &AttentionWeights,
    x: &[f32],
    rows: usize,
    start: usize,
    cache: &mut KvCache,
    nx: Numerics,
) -> Vec<f32> {
    let p = stage(Stage::MixerInput, || Projections::of(w, x, rows, nx));
    let out = stage(Stage::Attention, || attend(c, w, p, start, cache, nx));
    stage(Stage::MixerOutput, || nx.matmul(&out, rows, &w.o_proj))
}

/// One decode step of several sequences, row `i` of `x` at position `starts[i]` of
/// `caches[i]`: the projections take every row at once (each weight read once), the attention
/// itself runs per sequence over its own cache.
pub fn attention_batch(
    c: &ModelConfig,
    w: &AttentionWeights,
    x: &[f32],
    starts: &[usize],
    caches: &mut [&mut KvCache],
    nx: Numerics,
) -> Vec<f32> {
    let rows = caches.len();
    let p = stage(Stage::MixerInput, || Projections::of(w, x, rows, nx));
    // One sequence after another, each spread over the team by heads (a flat region: a batch
    // is a handful of sequences, fewer than the threads).
    let out: Vec<f32> = stage(Stage::Attention, || {
        caches
            .iter_mut()
            .zip(starts)
            .enumerate()
            .flat_map(|(i, (cache, &start))| attend(c, w, p.row(i, rows), start, cache, nx))
            .collect()
    });
    stage(Stage::MixerOutput, || nx.matmul(&out, rows, &w.o_proj))
}

/// The query (with its gate), key and value rows of a chunk.
struct Projections {
    qg: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Projections {
    fn of(w: &AttentionWeights, x: &[f32], rows: usize, nx: Numerics) -> Self {
        let [qg, k, v] = nx.products([
            Product::new(&w.q_proj, x, rows),
            Product::new(&w.k_proj, x, rows),
            Product::new(&w.v_proj, x, rows),
        ]);
        Projections { qg, k, v }
    }

    /// Row `i` of `rows`, on its own.
    fn row(&self, i: usize, rows: usize) -> Projections {
        let at = |m: &[f32]| row_of(m, i, rows);
        Projections {
            qg: at(&self.qg),
            k: at(&self.k),
            v: at(&self.v),
        }
    }
}

/// Attention of one sequence's projected rows (the first at position `start`) over its cache,
/// which takes their keys and values; the gated output before `o_proj`.
fn attend(
    c: &ModelConfig,
    w: &AttentionWeights,
    p: Projections,
    start: usize,
    cache: &mut KvCache,
    nx: Numerics,
) -> Vec<f32> {
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
    let Projections { qg, mut k, v } = p;
    let rows = qg.len() / (nh * 2 * hd);
    // Per row in parallel: split q from its gate, normalise the heads of q and k, rotate them.
    // On one thread this was most of a prefill chunk's attention stage at 16 threads (~9 ms a
    // layer: 4,096 q heads' norms and 150 K sines and cosines).
    let mut q = team::zeros(rows * nh * hd);
    let mut gate = team::zeros(rows * nh * hd);
    let rope = Rope::new(c);
    team::for_chunks3(
        (&mut q, nh * hd),
        (&mut gate, nh * hd),
        (&mut k, nkv * hd),
        |t, q, gate, k| {
            let row = &qg[t * nh * 2 * hd..(t + 1) * nh * 2 * hd];
            for (h, (q, gate)) in q.chunks_mut(hd).zip(gate.chunks_mut(hd)).enumerate() {
                q.copy_from_slice(&row[h * 2 * hd..h * 2 * hd + hd]);
                gate.copy_from_slice(&row[h * 2 * hd + hd..(h + 1) * 2 * hd]);
            }
            rms_norm_rows(q, &w.q_norm, c.rms_norm_eps);
            rms_norm_rows(k, &w.k_norm, c.rms_norm_eps);
            let turns = rope.turns(start + t);
            q.chunks_mut(hd)
                .chain(k.chunks_mut(hd))
                .for_each(|head| rope.apply(head, &turns));
        },
    );
    cache.append(&k, &v);

    // The bf16 mode rounds q and the cache once here, as the kernel rounds them into its tiles.
    let (q, keys, values) = (nx.operand(&q), nx.operand(&cache.k), nx.operand(&cache.v));
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; rows * nh * hd];
    team::for_chunks(&mut out, hd, |i, o| {
        let (t, h) = (i / nh, i % nh);
        let kvh = h / group;
        let head = Head {
            q: &q[i * hd..(i + 1) * hd],
            keys: &keys,
            values: &values,
            at: |p| (p * nkv + kvh) * hd..(p * nkv + kvh + 1) * hd,
            scale,
        };
        let visible = start + t + 1;
        match nx {
            Numerics::F32 | Numerics::Int8Inputs(_) => head.softmax(visible, o),
            Numerics::TensorCoreBf16 => head.tiled_bf16(visible, o),
        }
        let g = &gate[i * hd..(i + 1) * hd];
        o.iter_mut().zip(g).for_each(|(o, g)| *o *= sigmoid(*g));
    });
    out
}

/// One query head against the cache rows of its KV head.
struct Head<'a, F> {
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    /// Where position p's key (and value) lies in `keys` (`values`).
    at: F,
    scale: f32,
}

impl<F: Fn(usize) -> std::ops::Range<usize>> Head<'_, F> {
    /// Softmax attention over positions `0..visible`, into `o` (zeroed), in f32.
    fn softmax(&self, visible: usize, o: &mut [f32]) {
        let mut scores: Vec<f32> = (0..visible)
            .map(|p| dot(self.q, &self.keys[(self.at)(p)]) * self.scale)
            .collect();
        crate::ops::softmax(&mut scores);
        for (p, s) in scores.iter().enumerate() {
            let vp = &self.values[(self.at)(p)];
            o.iter_mut().zip(vp).for_each(|(o, v)| *o += s * v);
        }
    }

    /// As attention_prefill.cu computes it, q and the cache already in bf16, in log2 units with
    /// the scale folded in (c = log2(e)/√HD): over tiles of [`FA_KEYS`] positions from position
    /// 0, the running maximum m takes in the tile's fl(s·c), the sum l and the output are
    /// rescaled by 2^(m_old − m), then each position adds p = 2^(s·c − m) (one fused
    /// multiply-add) to l and bf16(p)·v to the output. So the output sums the probabilities
    /// rounded (P is an mma operand) and the normaliser sums them unrounded.
    fn tiled_bf16(&self, visible: usize, o: &mut [f32]) {
        let c = self.scale * std::f32::consts::LOG2_E;
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        let mut s = [0f32; FA_KEYS];
        for k0 in (0..visible).step_by(FA_KEYS) {
            let tile = &mut s[..FA_KEYS.min(visible - k0)];
            for (j, sj) in tile.iter_mut().enumerate() {
                *sj = dot(self.q, &self.keys[(self.at)(k0 + j)]);
            }
            // The first tile rescales the empty sums by 2^(−∞) = 0.
            let m_new = tile.iter().fold(m, |m, &sj| m.max(sj * c));
            let corr = (m - m_new).exp2();
            l *= corr;
            o.iter_mut().for_each(|v| *v *= corr);
            for (j, &sj) in tile.iter().enumerate() {
                let p = sj.mul_add(c, -m_new).exp2();
                l += p;
                let p = bf16(p);
                let vp = &self.values[(self.at)(k0 + j)];
                o.iter_mut().zip(vp).for_each(|(o, v)| *o += p * v);
            }
            m = m_new;
        }
        let inv = 1.0 / l;
        o.iter_mut().for_each(|v| *v *= inv);
    }
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

    /// Each frequency's (sin, cos) at position `pos`, the same for every head of the position.
    pub fn turns(&self, pos: usize) -> Vec<(f32, f32)> {
        self.inv_freq
            .iter()
            .map(|f| (pos as f32 * f).sin_cos())
            .collect()
    }

    /// Rotates one head by a position's [`Rope::turns`].
    pub fn apply(&self, head: &mut [f32], turns: &[(f32, f32)]) {
        let half = self.inv_freq.len();
        for (i, &(sin, cos)) in turns.iter().enumerate() {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

#[cfg(test)]
mod tests {
    use lily_core::rng::uniform_at;

    use super::*;

    /// The tiled attention against its definition written out in two passes, in log2 units
    /// (scores s_p·c, c = log2(e)/√HD): position p of tile j has the probability
    /// e_p = 2^(s_p·c − M_j), M_j the largest scaled score of tiles 0..=j; the output is
    /// Σ bf16(e_p)·2^(M_j − M)·v_p / Σ e_p·2^(M_j − M), M the largest of all. Scores
    /// that climb from tile to tile make every tile move the maximum; the last tile is partial.
    #[test]
    fn tiled_attention_rounds_each_tile_against_its_running_maximum() {
        let (hd, visible) = (16, 3 * FA_KEYS + 7);
        let rounded = |seed, n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|i| bf16(uniform_at(seed, i as u64) * scale))
                .collect()
        };
        let q = rounded(1, hd, 1.0);
        let mut keys = rounded(2, visible * hd, 1.0);
        for (p, k) in keys.chunks_mut(hd).enumerate() {
            // Along q, growing with the position: the running maximum rises tile by tile.
            for (k, q) in k.iter_mut().zip(&q) {
                *k = bf16(*k + 0.08 * p as f32 * q);
            }
        }
        let values = rounded(3, visible * hd, 2.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let head = Head {
            q: &q,
            keys: &keys,
            values: &values,
            at: |p| p * hd..(p + 1) * hd,
            scale,
        };
        let mut got = vec![0f32; hd];
        head.tiled_bf16(visible, &mut got);

        let c = scale * std::f32::consts::LOG2_E;
        let raw: Vec<f32> = keys.chunks(hd).map(|k| dot(&q, k)).collect();
        let running = |p: usize| {
            let end = ((p / FA_KEYS + 1) * FA_KEYS).min(visible);
            raw[..end]
                .iter()
                .map(|&s| (s * c) as f64)
                .fold(f64::NEG_INFINITY, f64::max)
        };
        let top = running(visible - 1);
        let definition = |tile_max: &dyn Fn(usize) -> f64, rounded_sum: bool| {
            let (mut o, mut l) = (vec![0f64; hd], 0f64);
            for (p, v) in values.chunks(hd).enumerate() {
                let e = raw[p].mul_add(c, -tile_max(p) as f32).exp2();
                let carry = (tile_max(p) - top).exp2();
                l += if rounded_sum { bf16(e) } else { e } as f64 * carry;
                for (o, v) in o.iter_mut().zip(v) {
                    *o += bf16(e) as f64 * carry * *v as f64;
                }
            }
            o.iter().map(|o| (o / l) as f32).collect::<Vec<f32>>()
        };
        let diff = |want: &[f32]| {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            got.iter()
                .zip(want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale
        };
        let tiled = diff(&definition(&running, false));
        // What the test must tell apart from the kernel's order: every probability rounded
        // against the final maximum, and the normaliser summing the rounded probabilities.
        let global = diff(&definition(&|_| top, false));
        let rounded_sum = diff(&definition(&running, true));
        eprintln!(
            "tiled attention: {tiled:e} from its definition; {global:e} from one maximum, \
             {rounded_sum:e} from a sum of rounded probabilities"
        );
        assert!(tiled < 1e-6, "{tiled:e}");
        assert!(global.min(rounded_sum) > 20.0 * tiled.max(1e-7));
    }
}
