//! The mixture-of-experts block (spec §2.6): softmax router, top-k, renormalise, SwiGLU experts
//! on the rows routed to them, plus the sigmoid-gated shared expert.

use lily_core::config::ModelConfig;
use lily_core::weights::{Expert, MoeWeights};
use rayon::prelude::*;

use crate::numerics::Numerics;
use crate::ops::{add_in_place, sigmoid, silu, softmax};

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
    let h = c.hidden_size;
    let logits = nx.matmul(x, rows, &w.router);
    let routes: Vec<Route> = logits.chunks(c.num_experts).map(|l| route(c, l)).collect();

    // Group rows by expert so each expert's weights are read once per chunk, and only the
    // selected experts are computed. The experts run in parallel (each product splits its rows
    // over cores too), so a decode step is two waves of work per layer, not one per expert.
    let mut picked: Vec<Vec<(usize, f32)>> = vec![Vec::new(); w.experts.len()];
    for (t, r) in routes.iter().enumerate() {
        for (&e, &weight) in r.experts.iter().zip(&r.weights) {
            picked[e].push((t, weight));
        }
    }
    let outputs: Vec<(usize, Vec<f32>)> = picked
        .par_iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(e, p)| {
            let gathered: Vec<f32> = p
                .iter()
                .flat_map(|&(t, _)| x[t * h..(t + 1) * h].iter().copied())
                .collect();
            (e, swiglu(&w.experts[e], &gathered, p.len(), nx))
        })
        .collect();
    let mut out = vec![0f32; rows * h];
    for (e, y) in outputs {
        for (i, &(t, weight)) in picked[e].iter().enumerate() {
            let dst = &mut out[t * h..(t + 1) * h];
            dst.iter_mut()
                .zip(&y[i * h..(i + 1) * h])
                .for_each(|(d, v)| *d += weight * v);
        }
    }

    let shared = swiglu(&w.shared_expert, x, rows, nx);
    let gates = nx.matmul(x, rows, &w.shared_expert_gate);
    for t in 0..rows {
        let gate = sigmoid(gates[t]);
        let scaled: Vec<f32> = shared[t * h..(t + 1) * h]
            .iter()
            .map(|v| gate * v)
            .collect();
        add_in_place(&mut out[t * h..(t + 1) * h], &scaled);
    }
    out
}

/// `down(silu(gate·x) ⊙ up·x)` for `rows` rows.
pub fn swiglu(e: &Expert, x: &[f32], rows: usize, nx: Numerics) -> Vec<f32> {
    let gate = nx.matmul(x, rows, &e.gate_proj);
    let up = nx.matmul(x, rows, &e.up_proj);
    let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
    nx.matmul(&act, rows, &e.down_proj)
}
