//! The mixture-of-experts block (spec §2.6): softmax router, top-k, renormalise, SwiGLU experts
//! on the rows routed to them, plus the sigmoid-gated shared expert.

use lily_core::config::ModelConfig;
use lily_core::weights::{Expert, MoeWeights};

use crate::numerics::Numerics;
use crate::ops::{sigmoid, silu, softmax};
use crate::products::Product;
use crate::profile::{Stage, stage};
use crate::team;

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
    // A total order (probability down, then index up), so selecting the k first and sorting
    // them gives what sorting all 256 did, in a tenth of the time.
    let before = |a: &usize, b: &usize| p[*b].total_cmp(&p[*a]).then(a.cmp(b));
    let mut order: Vec<usize> = (0..p.len()).collect();
    let k = c.experts_per_token.min(order.len());
    if k < order.len() {
        order.select_nth_unstable_by(k, before);
    }
    order.truncate(k);
    order.sort_by(before);
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
        // Rows in parallel: a prefill chunk's 256 routes took ~2.5 ms a layer on one thread.
        let routes = team::map(rows, |t| {
            route(c, &logits[t * c.num_experts..(t + 1) * c.num_experts])
        });
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
    // Each expert's rows of the chunk (ascending) and their routing weights.
    let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); w.experts.len()];
    let mut weights_of: Vec<Vec<f32>> = vec![Vec::new(); w.experts.len()];
    for (t, r) in routes.iter().enumerate() {
        for (&e, &weight) in r.experts.iter().zip(&r.weights) {
            rows_of[e].push(t);
            weights_of[e].push(weight);
        }
    }
    let chosen: Vec<usize> = (0..w.experts.len())
        .filter(|&e| !rows_of[e].is_empty())
        .collect();
    // Routed experts first, in expert order, then the shared one on every row. A routed
    // expert's products take its rows of `x` by index (the int8 kernel from the chunk's one
    // rounded copy).
    let mut runs: Vec<(&Expert, Option<&[usize]>)> = chosen
        .iter()
        .map(|&e| (&w.experts[e], Some(rows_of[e].as_slice())))
        .collect();
    runs.push((&w.shared_expert, None));
    let gate_up = nx.products_of(runs.iter().flat_map(|&(e, pick)| {
        let input = |m| match pick {
            Some(pick) => Product::picked(m, x, pick),
            None => Product::new(m, x, rows),
        };
        [input(&e.gate_proj), input(&e.up_proj)]
    }));
    let acts: Vec<Vec<f32>> = team::map(gate_up.len() / 2, |e| {
        let (g, u) = (&gate_up[2 * e], &gate_up[2 * e + 1]);
        g.iter().zip(u).map(|(g, u)| silu(*g) * u).collect()
    });
    let downs = nx.products_of(
        runs.iter()
            .zip(&acts)
            .map(|(&(e, _), act)| Product::new(&e.down_proj, act, act.len() / e.down_proj.cols())),
    );

    // The combine, in parallel over rows: each row adds its experts' outputs in expert order,
    // then the gated shared expert's, the order a pass over the experts would give (on one
    // thread, a prefill chunk's combine reads 16 MB a layer). `parts[t]`: row t's (product,
    // row in it, weight), in expert order.
    let mut parts: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); rows];
    for (k, &e) in chosen.iter().enumerate() {
        for (i, (&t, &weight)) in rows_of[e].iter().zip(&weights_of[e]).enumerate() {
            parts[t].push((k, i, weight));
        }
    }
    let shared = &downs[chosen.len()];
    let mut out = team::zeros(rows * h);
    team::for_chunks(&mut out, h, |t, dst| {
        for &(k, i, weight) in &parts[t] {
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

#[cfg(test)]
mod tests {
    use lily_core::rng::uniform_at;
    use lily_core::synthetic::synthetic_config;

    use super::*;

    /// The top k by selection equals the top k of a full sort (probability down, index up), ties
    /// included: logits drawn from a few values make many equal probabilities.
    #[test]
    fn a_route_is_the_top_k_of_a_full_sort_ties_included() {
        let mut c = synthetic_config("qwen3.6-35b-a3b").unwrap();
        assert!(c.norm_topk_prob, "the weights below are renormalised");
        for (case, (k, levels)) in [(8, 4), (8, 1000), (1, 3), (256, 5), (255, 2)]
            .into_iter()
            .enumerate()
        {
            c.experts_per_token = k;
            let logits: Vec<f32> = (0..256)
                .map(|i| (uniform_at(case as u64, i) * levels as f32).floor())
                .collect();
            let mut p = logits.clone();
            softmax(&mut p);
            let mut want: Vec<usize> = (0..256).collect();
            want.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            want.truncate(k);
            let r = route(&c, &logits);
            assert_eq!(r.experts, want, "k {k}, {levels} levels");
            let sum: f32 = want.iter().map(|&e| p[e]).sum();
            let weights: Vec<f32> = want.iter().map(|&e| p[e] / sum).collect();
            assert_eq!(r.weights, weights, "k {k}, {levels} levels");
        }
    }
}
