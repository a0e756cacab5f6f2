//! The mixture-of-experts block (spec §2.6): softmax router, top-k, renormalise, SwiGLU experts
//! on the rows routed to them, plus the sigmoid-gated shared expert.

use lily_core::config::ModelConfig;
use lily_core::weights::{Expert, MoeWeights};

use crate::ops::{add_in_place, dot, matmul, sigmoid, silu, softmax};

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

pub fn moe(c: &ModelConfig, w: &MoeWeights, x: &[f32], rows: usize) -> Vec<f32> {
    let h = c.hidden_size;
    let logits = matmul(x, rows, &w.router);
    let routes: Vec<Route> = logits.chunks(c.num_experts).map(|l| route(c, l)).collect();

    // Group rows by expert so each expert's weights are read once per chunk, and only the
    // selected experts are computed.
    let mut out = vec![0f32; rows * h];
    for (e, expert) in w.experts.iter().enumerate() {
        let picked: Vec<(usize, f32)> = routes
            .iter()
            .enumerate()
            .filter_map(|(t, r)| {
                r.experts
                    .iter()
                    .position(|&x| x == e)
                    .map(|i| (t, r.weights[i]))
            })
            .collect();
        if picked.is_empty() {
            continue;
        }
        let gathered: Vec<f32> = picked
            .iter()
            .flat_map(|&(t, _)| x[t * h..(t + 1) * h].iter().copied())
            .collect();
        let y = swiglu(expert, &gathered, picked.len());
        for (i, &(t, weight)) in picked.iter().enumerate() {
            let dst = &mut out[t * h..(t + 1) * h];
            dst.iter_mut()
                .zip(&y[i * h..(i + 1) * h])
                .for_each(|(d, v)| *d += weight * v);
        }
    }

    let shared = swiglu(&w.shared_expert, x, rows);
    for t in 0..rows {
        let gate = sigmoid(dot(&x[t * h..(t + 1) * h], &w.shared_expert_gate));
        let scaled: Vec<f32> = shared[t * h..(t + 1) * h]
            .iter()
            .map(|v| gate * v)
            .collect();
        add_in_place(&mut out[t * h..(t + 1) * h], &scaled);
    }
    out
}

/// `down(silu(gate·x) ⊙ up·x)` for `rows` rows.
pub fn swiglu(e: &Expert, x: &[f32], rows: usize) -> Vec<f32> {
    let gate = matmul(x, rows, &e.gate_proj);
    let up = matmul(x, rows, &e.up_proj);
    let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
    matmul(&act, rows, &e.down_proj)
}
