//! The gated delta rule of one value head, in its two forms (spec §2.5 step 7 and §4).
//!
//! State `S` is `[dk][dv]`. Per token: `S ← αS`, `δ = β(v − Sᵀk)`, `S ← S + kδᵀ`, `o = Sᵀq`,
//! with `α = exp(g)`. The recurrent form runs that loop; the chunked (WY) form computes the same
//! result 64 tokens at a time with small dense products, which is how a GPU runs prefill. The two
//! agree to f32 rounding, and tests hold them to it.
//!
//! Both are plain loops over rows of 128 values. Built for baseline x86-64 they vectorise to
//! 4-wide SSE2; where the CPU has AVX2 the same code is compiled a second time for it and chosen
//! at run time (8-wide). The two builds give the same bits: the loops are element-wise or sum
//! in a fixed order (`ops::dot`), and no multiply and add are fused in either.

use crate::ops::dot;

/// One head's inputs over `t` tokens. q is already L2-normalised and scaled by 1/√dk, k normalised.
pub struct HeadInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: &'a [f32],
    /// Log-decay per token, ≤ 0.
    pub g: &'a [f32],
    pub dk: usize,
    pub dv: usize,
}

impl HeadInputs<'_> {
    fn tokens(&self) -> usize {
        self.beta.len()
    }
}

/// Runs `body` compiled for AVX2 where the CPU has it.
macro_rules! widest {
    ($body:ident($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            #[target_feature(enable = "avx2")]
            unsafe fn avx2<'a>(x: &HeadInputs<'a>, state: &mut [f32], out: &mut [f32], chunk: usize) {
                $body(x, state, out, chunk)
            }
            // SAFETY: the CPU has AVX2 (just checked).
            return unsafe { avx2($($arg),*) };
        }
        $body($($arg),*)
    }};
}

/// Token by token. `out` is `[t, dv]`.
pub fn recurrent(x: &HeadInputs, state: &mut [f32], out: &mut [f32]) {
    widest!(recurrent_in(x, state, out, 1))
}

#[inline(always)]
fn recurrent_in(x: &HeadInputs, state: &mut [f32], out: &mut [f32], _: usize) {
    let (dk, dv) = (x.dk, x.dv);
    let mut delta = vec![0f32; dv];
    for t in 0..x.tokens() {
        let (q, k, v) = (
            &x.q[t * dk..][..dk],
            &x.k[t * dk..][..dk],
            &x.v[t * dv..][..dv],
        );
        // Two passes over the state instead of four: the decay folds into the read of Sᵀk
        // (α·(Sᵀk) = (αS)ᵀk) and into the pass that adds kδᵀ and reads o.
        let alpha = x.g[t].exp();
        delta.fill(0.0);
        for (i, ki) in k.iter().enumerate() {
            let row = &state[i * dv..(i + 1) * dv];
            delta.iter_mut().zip(row).for_each(|(d, s)| *d += s * ki);
        }
        delta
            .iter_mut()
            .zip(v)
            .for_each(|(d, v)| *d = x.beta[t] * (v - alpha * *d));
        let o = &mut out[t * dv..(t + 1) * dv];
        o.fill(0.0);
        for i in 0..dk {
            let row = &mut state[i * dv..(i + 1) * dv];
            row.iter_mut()
                .zip(&delta)
                .for_each(|(s, d)| *s = alpha * *s + k[i] * d);
            o.iter_mut()
                .zip(row.iter())
                .for_each(|(o, s)| *o += q[i] * s);
        }
    }
}

/// The chunked (WY) form over chunks of `chunk` tokens; a short last chunk is handled as if it
/// were padded with β = 0, g = 0 tokens.
pub fn chunked(x: &HeadInputs, chunk: usize, state: &mut [f32], out: &mut [f32]) {
    widest!(chunked_in(x, state, out, chunk))
}

#[inline(always)]
fn chunked_in(x: &HeadInputs, state: &mut [f32], out: &mut [f32], chunk: usize) {
    let (dk, dv) = (x.dk, x.dv);
    let mut start = 0;
    while start < x.tokens() {
        let end = (start + chunk).min(x.tokens());
        let part = HeadInputs {
            q: &x.q[start * dk..end * dk],
            k: &x.k[start * dk..end * dk],
            v: &x.v[start * dv..end * dv],
            beta: &x.beta[start..end],
            g: &x.g[start..end],
            dk,
            dv,
        };
        one_chunk(&part, state, &mut out[start * dv..end * dv]);
        start = end;
    }
}

/// Row `t` of a row-major matrix of width `w`.
#[inline(always)]
fn row(m: &[f32], t: usize, w: usize) -> &[f32] {
    &m[t * w..(t + 1) * w]
}

#[inline(always)]
fn one_chunk(x: &HeadInputs, state: &mut [f32], out: &mut [f32]) {
    let HeadInputs {
        q,
        k,
        v,
        beta,
        g,
        dk,
        dv,
    } = *x;
    let c = beta.len();

    // γ: inclusive cumulative log-decay. Only differences γ_t − γ_s with s ≤ t (≤ 0) are ever
    // exponentiated, so nothing overflows however strong the decay.
    let mut gamma = vec![0f32; c];
    let mut acc = 0.0;
    for t in 0..c {
        acc += g[t];
        gamma[t] = acc;
    }
    let decay = |t: usize, s: usize| (gamma[t] - gamma[s]).exp();

    // Forward substitution with the strictly lower A_ts = β_t (k_t·k_s) D_ts gives
    // U = (I + A)⁻¹ diag(β) V and W = (I + A)⁻¹ diag(β e^γ) K without forming the inverse.
    let mut u = vec![0f32; c * dv];
    let mut w = vec![0f32; c * dk];
    for t in 0..c {
        let kt = row(k, t, dk);
        let (bt, et) = (beta[t], gamma[t].exp());
        let mut ut: Vec<f32> = row(v, t, dv).iter().map(|x| bt * x).collect();
        let mut wt: Vec<f32> = kt.iter().map(|x| bt * et * x).collect();
        for s in 0..t {
            let a = bt * dot(kt, row(k, s, dk)) * decay(t, s);
            ut.iter_mut()
                .zip(row(&u, s, dv))
                .for_each(|(x, y)| *x -= a * y);
            wt.iter_mut()
                .zip(row(&w, s, dk))
                .for_each(|(x, y)| *x -= a * y);
        }
        u[t * dv..(t + 1) * dv].copy_from_slice(&ut);
        w[t * dk..(t + 1) * dk].copy_from_slice(&wt);
    }

    // V' = U − W S: the values corrected for what the incoming state already predicts.
    let mut vp = u;
    for t in 0..c {
        let wt = &w[t * dk..(t + 1) * dk];
        let vt = &mut vp[t * dv..(t + 1) * dv];
        for (i, wi) in wt.iter().enumerate() {
            vt.iter_mut()
                .zip(&state[i * dv..(i + 1) * dv])
                .for_each(|(x, s)| *x -= wi * s);
        }
    }

    // O_t = e^{γ_t} Sᵀq_t + Σ_{s≤t} (q_t·k_s) D_ts V'_s.
    for t in 0..c {
        let qt = row(q, t, dk);
        let ot = &mut out[t * dv..(t + 1) * dv];
        ot.fill(0.0);
        let et = gamma[t].exp();
        for (i, qi) in qt.iter().enumerate() {
            ot.iter_mut()
                .zip(&state[i * dv..(i + 1) * dv])
                .for_each(|(o, s)| *o += et * qi * s);
        }
        for s in 0..=t {
            let a = dot(qt, row(k, s, dk)) * decay(t, s);
            ot.iter_mut()
                .zip(row(&vp, s, dv))
                .for_each(|(o, x)| *o += a * x);
        }
    }

    // S ← e^{γ_C} S + Σ_s e^{γ_C − γ_s} k_s V'_sᵀ.
    let last = c - 1;
    let e_last = gamma[last].exp();
    state.iter_mut().for_each(|s| *s *= e_last);
    for s in 0..c {
        let f = decay(last, s);
        let ks = row(k, s, dk);
        let vs = row(&vp, s, dv);
        for i in 0..dk {
            let coef = f * ks[i];
            state[i * dv..(i + 1) * dv]
                .iter_mut()
                .zip(vs)
                .for_each(|(x, y)| *x += coef * y);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::rng::uniform_at;

    /// Owned inputs for one head.
    struct Owned {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        beta: Vec<f32>,
        g: Vec<f32>,
        dk: usize,
        dv: usize,
    }

    impl Owned {
        fn view(&self) -> HeadInputs<'_> {
            let Owned {
                q,
                k,
                v,
                beta,
                g,
                dk,
                dv,
            } = self;
            HeadInputs {
                q,
                k,
                v,
                beta,
                g,
                dk: *dk,
                dv: *dv,
            }
        }
    }

    /// Random normalised inputs with strong and weak decays mixed.
    fn inputs(t: usize, dk: usize, dv: usize, seed: u64) -> Owned {
        let r = |i: usize, salt: u64| uniform_at(seed ^ salt, i as u64);
        let unit_rows = |w: usize, salt: u64, scale: f32| {
            let mut m: Vec<f32> = (0..t * w).map(|i| r(i, salt)).collect();
            for row in m.chunks_mut(w) {
                let n = row.iter().map(|x| x * x).sum::<f32>().sqrt();
                row.iter_mut().for_each(|x| *x *= scale / n);
            }
            m
        };
        Owned {
            q: unit_rows(dk, 1, 1.0 / (dk as f32).sqrt()),
            k: unit_rows(dk, 2, 1.0),
            v: (0..t * dv).map(|i| r(i, 3)).collect(),
            beta: (0..t).map(|i| 0.5 + 0.5 * r(i, 4)).collect(),
            // Log-decays from ~0 down to about -8 (the state forgets almost at once).
            g: (0..t).map(|i| -4.0 * (1.0 + r(i, 5))).collect(),
            dk,
            dv,
        }
    }

    /// The build chosen at run time (AVX2 where the CPU has it) against the baseline build, to
    /// the bit, in both forms and from a nonzero state.
    #[test]
    fn every_build_gives_the_same_bits() {
        let x = inputs(70, 128, 128, 9);
        let start: Vec<f32> = (0..128 * 128)
            .map(|i| 0.1 * uniform_at(11, i as u64))
            .collect();
        let run = |f: &dyn Fn(&mut [f32], &mut [f32])| {
            let (mut s, mut o) = (start.clone(), vec![0f32; 70 * 128]);
            f(&mut s, &mut o);
            [s, o]
                .concat()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<u32>>()
        };
        let v = x.view();
        let chunked_bits = run(&|s, o| chunked(&v, 64, s, o));
        assert_eq!(chunked_bits, run(&|s, o| chunked_in(&v, s, o, 64)));
        assert_eq!(
            run(&|s, o| recurrent(&v, s, o)),
            run(&|s, o| recurrent_in(&v, s, o, 1))
        );
        assert_ne!(
            chunked_bits,
            run(&|s, o| recurrent(&v, s, o)),
            "the forms round apart"
        );
    }

    #[test]
    fn chunked_equals_recurrent_at_route_boundaries() {
        for &(t, dk, dv) in &[
            (1, 8, 8),
            (63, 16, 8),
            (64, 16, 16),
            (65, 8, 24),
            (200, 16, 16),
        ] {
            let owned = inputs(t, dk, dv, t as u64);
            let x = owned.view();
            // A non-zero incoming state, as in a continued prefill.
            let init: Vec<f32> = (0..dk * dv)
                .map(|i| 0.3 * uniform_at(99, i as u64))
                .collect();
            let (mut s_rec, mut s_chk) = (init.clone(), init);
            let (mut o_rec, mut o_chk) = (vec![0f32; t * dv], vec![0f32; t * dv]);
            recurrent(&x, &mut s_rec, &mut o_rec);
            chunked(&x, 64, &mut s_chk, &mut o_chk);
            let max_ref = o_rec.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = o_rec
                .iter()
                .zip(&o_chk)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= 1e-5 * max_ref.max(1.0),
                "t={t}: outputs differ by {diff}"
            );
            let diff = s_rec
                .iter()
                .zip(&s_chk)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff <= 1e-5, "t={t}: states differ by {diff}");
            assert!(max_ref > 0.01, "outputs are not trivially small");
        }
    }

    #[test]
    fn a_single_token_update_is_the_delta_rule() {
        // dk = dv = 1: S' = α S + k β (v − α S k), o = S' q.
        let (q, k, v, beta, g) = ([0.5f32], [1.0f32], [2.0f32], [0.25f32], [-0.5f32]);
        let x = HeadInputs {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: &g,
            dk: 1,
            dv: 1,
        };
        for form in 0..2 {
            let mut s = [3.0f32];
            let mut o = [0f32];
            if form == 0 {
                recurrent(&x, &mut s, &mut o)
            } else {
                chunked(&x, 64, &mut s, &mut o)
            }
            let a = (-0.5f32).exp();
            let expect = a * 3.0 + 0.25 * (2.0 - a * 3.0);
            assert!((s[0] - expect).abs() < 1e-6 && (o[0] - 0.5 * expect).abs() < 1e-6);
        }
    }
}
