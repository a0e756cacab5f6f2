//! The chunked (WY) route of the GDN delta rule (gdn_chunked.cu) against the CPU reference and
//! against the token scan, on the GPU; and, without a GPU, its algebra in f64 against the token
//! recurrence. The GPU tests are ignored by a plain `cargo test` and run on the H200 with
//! `--include-ignored`; every comparison prints its measured error.

#[path = "support/gdn_layer.rs"]
mod gdn_layer;
mod support;

use gdn_layer::*;
use lily_core::rng::uniform_at;
use lily_cuda::KvPrecision;
use lily_cuda::gdn_prefill::GdnPrefillRoute;
use lily_cuda::gpu::Gpu;
use support::NEEDS_GPU;

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

/// The shared shapes, then value heads narrower than a 32-column block: 16 and 8 columns per
/// `gdn_chunk_scan` block (GDNC_COLS), the tiny fixtures' DV = 16 among them.
fn chunked_shapes() -> impl Iterator<Item = (usize, usize, usize, usize)> {
    SHAPES.into_iter().chain([(2, 4, 16, 16), (2, 4, 16, 8)])
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_matches_the_cpu_reference() {
    for (nk, nv, dk, dv) in chunked_shapes() {
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
    for (nk, nv, dk, dv) in chunked_shapes() {
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
