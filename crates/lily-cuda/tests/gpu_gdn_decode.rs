//! `gdn_decode_step` (kernels/gdn.cu: a GDN layer's conv, delta rule and gated norm for one
//! decode token of each row of a step) against the CPU reference of the GDN tests
//! (support/gdn_layer.rs) one token at a time: from non-zero windows and states, four tokens in a
//! row, rows of different states in one launch, at shapes that take each path of the kernel. Needs
//! a CUDA GPU: ignored by a plain `cargo test`, run with `--include-ignored`.

#[path = "support/gdn_layer.rs"]
mod gdn_layer;
mod support;

use cudarc::driver::CudaSlice;
use gdn_layer::*;
use lily_cuda::KvPrecision;
use lily_cuda::gdn_decode::{arrival_words, gdn_decode_step};
use lily_cuda::gpu::{Gpu, MAX_ROWS, RowPtrs, ptr};
use lily_cuda::kernel_args::GdnDecodeStep;
use support::{NEEDS_GPU, rel_diff};

/// (NK, NV, DK, DV): the production heads; two value heads a key head at small heads; one value
/// head a key head and a DV of no whole warps (48 columns × 4 row groups); four value heads a
/// key head with more q|k channels than threads (each thread convolves four); DV = 256 (1,024
/// threads); DV = 320 (three row groups, DK not a multiple of them).
const SHAPES: [(usize, usize, usize, usize); 6] = [
    (16, 32, 128, 128),
    (2, 4, 16, 32),
    (3, 3, 32, 48),
    (1, 4, 128, 16),
    (1, 2, 64, 256),
    (1, 1, 32, 320),
];

const TOKENS: usize = 4;

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_tokens_match_the_cpu_reference() {
    for (nk, nv, dk, dv) in SHAPES {
        let c = config(nk, nv, dk, dv);
        let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
        let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
        let w = Layer::random(&c, 70);
        let width = proj_width(&c);
        for rows in [1, 3, MAX_ROWS] {
            let label = format!("NK {nk} NV {nv} DK {dk} DV {dv}, {rows} rows");
            let mut want: Vec<Carried> = (0..rows)
                .map(|r| Carried::random(&c, 80 + r as u64))
                .collect();
            let dev: Vec<DeviceLayer> = want
                .iter()
                .map(|s| DeviceLayer::upload(&gpu, &w, s))
                .collect();
            let (mut windows, mut states) = (RowPtrs::default(), RowPtrs::default());
            for (r, d) in dev.iter().enumerate() {
                (windows.p[r], states.p[r]) = (p(&d.window), p(&d.state));
            }
            let arrivals = gpu.zeros::<u32>(arrival_words(&c, rows)).unwrap();
            let y = gpu.zeros::<f32>(rows * c.gdn_value_dim()).unwrap();
            for token in 0..TOKENS {
                let (padded, ld) = proj_rows(&c, rows, 90 + (10 * token + rows) as u64);
                let proj: Vec<f32> = padded
                    .chunks(ld)
                    .flat_map(|r| &r[..width])
                    .copied()
                    .collect();
                let dproj = gpu.upload(&proj).unwrap();
                let args = GdnDecodeStep {
                    proj: p(&dproj),
                    conv_w: p(&dev[0].conv_w),
                    windows,
                    a_log: p(&dev[0].a_log),
                    dt_bias: p(&dev[0].dt_bias),
                    states,
                    norm_w: p(&dev[0].norm),
                    arrivals: ptr(&arrivals, &gpu.stream),
                    y: p(&y),
                    eps: c.rms_norm_eps,
                };
                gdn_decode_step(&gpu, &c, rows, args).unwrap();
                gpu.sync().unwrap();
                let want_y: Vec<f32> = (0..rows)
                    .flat_map(|r| {
                        let row = &padded[r * ld..(r + 1) * ld];
                        reference(&c, &w, row, ld, 1, &mut want[r]).y
                    })
                    .collect();
                let d = rel_diff(&gpu.download(&y).unwrap(), &want_y);
                eprintln!("{label}, token {token}: y {d:.2e}");
                assert!(d <= TOL, "{label}, token {token}: y differs by {d:e}");
            }
            for (r, (d, want)) in dev.iter().zip(&want).enumerate() {
                let got = d.carried(&gpu);
                // The window is copies of inputs, slid by one block of the key head: exact.
                assert!(
                    got.window == want.window,
                    "{label}: row {r}'s conv window differs"
                );
                let ds = rel_diff(&got.state, &want.state);
                assert!(ds <= TOL, "{label}: row {r}'s state differs by {ds:e}");
            }
            let left = gpu.download(&arrivals).unwrap();
            assert!(
                left.iter().all(|&n| n == 0),
                "{label}: the arrival words are not back to zero: {left:?}"
            );
        }
    }
}
