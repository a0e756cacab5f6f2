//! The fused decode GEMVs (kernels/gemv.cu) against the CPU: `gemv_norm_b*` (RMSNorm of the
//! residual stream computed by every block while staging x) and `gemv_add_b*` (the result added
//! into y). Ragged row counts, several matrices per launch, widths that take one and two load
//! batches per lane, and a row count large enough that every warp strides over several units.
//! Needs a CUDA GPU (`--include-ignored` on the H200).

mod support;

use lily_core::rng::uniform_at;
use lily_core::synthetic::synthetic_config;
use lily_core::weights::Linear;
use lily_cuda::KvPrecision;
use lily_cuda::gpu::{Gpu, KArg, ptr};
use lily_cuda::mat::{DeviceMat, MatArg, gemv_shape};
use support::{dense_of, random_linear, rel_diff};

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_norm_and_residual_gemvs_match_the_cpu() {
    let config = synthetic_config("tiny").unwrap();
    let gpu = Gpu::new(&config, KvPrecision::F32).expect("needs a CUDA GPU");
    let eps = 1e-6f32;
    for bits in [4u32, 8, 32] {
        for (cols, shapes) in [
            (64usize, vec![1usize, 7, 33, 259]),
            (192, vec![5, 3]),
            (2048, vec![257, 1]),
            (4096, vec![2048]),
            (64, vec![40_001]),
        ] {
            let mats: Vec<Linear> = shapes
                .iter()
                .enumerate()
                .map(|(i, &r)| random_linear(r, cols, bits, 7 * i as u64 + cols as u64))
                .collect();
            let hidden: Vec<f32> = (0..cols).map(|i| 3.0 * uniform_at(11, i as u64)).collect();
            let norm_w: Vec<f32> = (0..cols).map(|i| 1.0 + uniform_at(12, i as u64)).collect();
            let dev: Vec<DeviceMat> = mats
                .iter()
                .map(|m| DeviceMat::upload(&gpu, m).unwrap())
                .collect();
            let mut args = [MatArg::default(); 4];
            for (a, m) in args.iter_mut().zip(&dev) {
                *a = m.arg(&gpu);
            }
            let total: usize = shapes.iter().sum();
            let start: Vec<f32> = (0..total).map(|i| uniform_at(13, i as u64)).collect();
            let (dh, dn) = (gpu.upload(&hidden).unwrap(), gpu.upload(&norm_w).unwrap());
            let (dy_norm, dy_add) = (
                gpu.zeros::<f32>(total).unwrap(),
                gpu.upload(&start).unwrap(),
            );
            let mats_args = args.map(KArg::Mat);
            let p = |b| KArg::Ptr(b);
            let mut norm_args = mats_args.to_vec();
            norm_args.extend([
                p(ptr(&dh, &gpu.stream)),
                p(ptr(&dn, &gpu.stream)),
                KArg::F32(eps),
                p(ptr(&dy_norm, &gpu.stream)),
            ]);
            gpu.launch(
                &format!("gemv_norm_b{bits}"),
                gemv_shape(&shapes),
                &norm_args,
            )
            .unwrap();
            let mut add_args = mats_args.to_vec();
            add_args.extend([p(ptr(&dh, &gpu.stream)), p(ptr(&dy_add, &gpu.stream))]);
            gpu.launch(&format!("gemv_add_b{bits}"), gemv_shape(&shapes), &add_args)
                .unwrap();
            let (y_norm, y_add) = (
                gpu.download(&dy_norm).unwrap(),
                gpu.download(&dy_add).unwrap(),
            );

            let inv = 1.0 / (hidden.iter().map(|v| v * v).sum::<f32>() / cols as f32 + eps).sqrt();
            let x_norm: Vec<f32> = hidden
                .iter()
                .zip(&norm_w)
                .map(|(h, w)| h * inv * w)
                .collect();
            let (mut want_norm, mut want_add) = (Vec::new(), Vec::new());
            for m in &mats {
                let w = dense_of(m);
                for row in w.chunks(cols) {
                    let dot = |x: &[f32]| row.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
                    want_norm.push(dot(&x_norm));
                    want_add.push(dot(&hidden));
                }
            }
            want_add.iter_mut().zip(&start).for_each(|(w, s)| *w += s);
            let dn = rel_diff(&y_norm, &want_norm);
            let da = rel_diff(&y_add, &want_add);
            eprintln!(
                "{bits}-bit, {cols} cols, rows {shapes:?}: gemv_norm {dn:e}, gemv_add {da:e}"
            );
            // f32 sums of up to 4,096 products in another order, and a fast-math rsqrt in the
            // norm (2 ulp): a few 1e-7 of the largest output; 1e-5 leaves room, while a wrong
            // row, chunk or scale shows up at 1e-2 or more.
            assert!(dn <= 1e-5, "gemv_norm {bits}-bit {cols} cols: {dn:e}");
            assert!(da <= 1e-5, "gemv_add {bits}-bit {cols} cols: {da:e}");
        }
    }
}
