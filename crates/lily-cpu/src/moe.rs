//! The mixture-of-experts block (spec §2.6): softmax router, top-k, renormalise, SwiGLU experts
//! on the rows routed to them, plus the sigmoid-gated shared expert.

use lily_core::config::ModelConfig;
use lily_core::weights::{Expert, MoeWeights};
use rayon::prelude::*;

use crate::numerics::Numerics;
use crate::ops::{sigmoid, silu, softmax};
use crate::products::Product;
use crate::profile::{Stage, stage};

/// The experts chosen for one token and their combine weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Softmax first, then the top k (lowest index first among equals), then renormalise.
pub fn route(c: &ModelConfig, router_logits: &[f32]) -> Route {
    let mut p = router_logits.to_vec();
    softmax(&mut p);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(c.experts_per_token);
    let mut weights: Vec<f32> = order.iter().map(|&e| p[e]).collect();
    if c.norm_topk_prob {
        let sum: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    Route {
        experts: order,
        weights,
    }
}

pub fn moe(c: &ModelConfig, w: &MoeWeights, x: &[f32], rows: usize, nx: Numerics) -> Vec<f32> {
    let (routes, gates) = stage(Stage::Router, || {
        let [logits, gates] = nx.products([
            Product::new(&w.router, x, rows),
            Product::new(&w.shared_expert_gate, x, rows),
        ]);
        let routes: Vec<Route> = logits.chunks(c.num_experts).map(|l| route(c, l)).collect();
        (routes, gates)
    });
    stage(Stage::Experts, || {
        experts(c, w, x, rows, &routes, &gates, nx)
    })
}

/// The routed experts of every row and the shared expert, combined: each row's experts in
/// expert order, weighted by its route, then the shared expert scaled by its sigmoid gate.
///
/// Rows are grouped by expert so each chosen expert's weights are read once per call and only
/// chosen experts are computed. Every expert's gate and up products, the shared expert's
/// included, run in one parallel region, and every down product in a second (products.rs):
/// a decode step's nine experts are two forks and joins, not twenty-seven.
fn experts(
    c: &ModelConfig,
    w: &MoeWeights,
    x: &[f32],
    rows: usize,
    routes: &[Route],
    gates: &[f32],
    nx: Numerics,
) -> Vec<f32> {
    let h = c.hidden_size;
    let mut picked: Vec<Vec<(usize, f32)>> = vec![Vec::new(); w.experts.len()];
    for (t, r) in routes.iter().enumerate() {
        for (&e, &weight) in r.experts.iter().zip(&r.weights) {
            picked[e].push((t, weight));
        }
    }
    let chosen: Vec<usize> = (0..w.experts.len())
        .filter(|&e| !picked[e].is_empty())
        .collect();
    // Gathered, and the activations below made, in parallel: a prefill chunk picks hundreds of
    // experts, and on one thread these copies and exponentials cost a tenth of the products.
    let inputs: Vec<Vec<f32>> = chosen
        .par_iter()
        .map(|&e| {
            picked[e]
                .iter()
                .flat_map(|&(t, _)| x[t * h..(t + 1) * h].iter().copied())
                .collect()
        })
        .collect();
    // Routed experts first, in expert order, then the shared one on every row.
    let mut runs: Vec<(&Expert, &[f32], usize)> = chosen
        .iter()
        .zip(&inputs)
        .map(|(&e, input)| (&w.experts[e], input.as_slice(), picked[e].len()))
        .collect();
    runs.push((&w.shared_expert, x, rows));

    let gate_up = nx.products_of(runs.iter().flat_map(|&(e, x, n)| {
        [
            Product::new(&e.gate_proj, x, n),
            Product::new(&e.up_proj, x, n),
        ]
    }));
    let acts: Vec<Vec<f32>> = gate_up
        .par_chunks(2)
        .map(|gu| {
            gu[0]
                .iter()
                .zip(&gu[1])
                .map(|(g, u)| silu(*g) * u)
                .collect()
        })
        .collect();
    let downs = nx.products_of(
        runs.iter()
            .zip(&acts)
            .map(|(&(e, _, n), act)| Product::new(&e.down_proj, act, n)),
    );

    // The combine, in parallel over rows: each row adds its experts' outputs in expert order,
    // then the gated shared expert's, the order a pass over the experts would give (on one
    // thread, a prefill chunk's combine reads 16 MB a layer). `parts[t]`: row t's (product,
    // row in it, weight), in expert order.
    let mut parts: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); rows];
    for (k, &e) in chosen.iter().enumerate() {
        for (i, &(t, weight)) in picked[e].iter().enumerate() {
            parts[t].push((k, i, weight));
        }
    }
    let shared = &downs[chosen.len()];
    let mut out = vec![0f32; rows * h];
    out.par_chunks_mut(h)
        .zip(&parts)
        .enumerate()
        .for_each(|(t, (dst, row_parts))| {
            for &(k, i, weight) in row_parts {
                dst.iter_mut()
                    .zip(&downs[k][i * h..(i + 1) * h])
                    .for_each(|(d, v)| *d += weight * v);
            }
            let gate = sigmoid(gates[t]);
            dst.iter_mut()
                .zip(&shared[t * h..(t + 1) * h])
                .for_each(|(d, v)| *d += gate * v);
        });
    out
}
