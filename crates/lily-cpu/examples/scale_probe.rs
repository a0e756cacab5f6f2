use lily_core::quant::QuantMatrix;
use lily_core::weights::Linear;
use lily_cpu::products::Product;
use lily_cpu::{InputParts, Numerics};
use std::time::Instant;
fn main() {
    let (r, c, n) = (512usize, 2048usize, 512usize);
    let vals: Vec<f32> = (0..r * c)
        .map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let base = QuantMatrix::quantize(r, c, 4, 64, &vals).unwrap();
    let ws: Vec<Linear> = (0..n).map(|_| Linear::Affine(base.clone())).collect();
    let rows: usize = std::env::var("ROWS")
        .map(|v| v.parse().unwrap())
        .unwrap_or(8);
    let x: Vec<f32> = (0..rows * c)
        .map(|i| ((i * 40503) % 997) as f32 / 997.0 - 0.5)
        .collect();
    let nx = Numerics::Int8Inputs(InputParts::One);
    let mut best = f64::MAX;
    for _ in 0..8 {
        let t = Instant::now();
        for _ in 0..4 {
            let out = nx.products_of(ws.iter().map(|w| Product::new(w, &x, rows)));
            std::hint::black_box(out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let macs = (4 * n * r * c * rows) as f64;
    println!(
        "threads {} rows {rows}: {:.1} ms, {:.1} GMAC/s",
        rayon::current_num_threads(),
        best * 1e3,
        macs / best / 1e9
    );
}
