//! The fused decode GEMVs (kernels/gemv.cu) against the CPU: `gemv_norm_b*` (RMSNorm of the
//! residual stream computed by every block while staging x) and `gemv_add_b*` (the result added
//! into y). Ragged row counts, several matrices per launch, widths that take one and two load
//! batches per lane, and a row count large enough that every warp strides over several units.
//! Then the batched step's `gemv_rows_*` (several sequences' rows, each weight read once) against
//! the single-row kernels, bit for bit, and the integer tensor-core GEMVs (`gemv_q4_*`, through the
//! step's launcher) against the CPU and each row against itself alone. Needs a CUDA GPU
//! (`--include-ignored` on the H200).

mod support;

use lily_core::rng::uniform_at;
use lily_core::synthetic::synthetic_config;
use lily_core::weights::Linear;
use lily_cuda::gemv::{GemvForm, GemvRoute, gemv, gemv_route, rows_shared_bytes};
use lily_cuda::gpu::{Gpu, Shape, ptr};
use lily_cuda::kernel_args::{GemvAdd, GemvNorm, GemvRowsAdd, GemvRowsNorm};
use lily_cuda::mat::{DeviceMat, MatArg, gemv_shape};
use lily_cuda::{CudaOptions, DecodeKernels, KvPrecision};
use support::{dense_of, random_linear, random_linear_grouped, rel_diff};

/// Random matrices of `shapes` rows and `cols` columns in one format, on the host and the device,
/// and the kernels' four matrix arguments (the unused ones empty).
fn upload(
    gpu: &Gpu,
    bits: u32,
    cols: usize,
    shapes: &[usize],
    seed: u64,
) -> (Vec<Linear>, Vec<DeviceMat>, [MatArg; 4]) {
    let mats: Vec<Linear> = shapes
        .iter()
        .enumerate()
        .map(|(i, &r)| random_linear(r, cols, bits, seed * i as u64 + cols as u64))
        .collect();
    let dev: Vec<DeviceMat> = mats
        .iter()
        .map(|m| DeviceMat::upload(gpu, m).unwrap())
        .collect();
    let mut args = [MatArg::default(); 4];
    for (a, m) in args.iter_mut().zip(&dev) {
        *a = m.arg(gpu);
    }
    (mats, dev, args)
}

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
            let (mats, _dev, mats_args) = upload(&gpu, bits, cols, &shapes, 7);
            let hidden: Vec<f32> = (0..cols).map(|i| 3.0 * uniform_at(11, i as u64)).collect();
            let norm_w: Vec<f32> = (0..cols).map(|i| 1.0 + uniform_at(12, i as u64)).collect();
            let total: usize = shapes.iter().sum();
            let start: Vec<f32> = (0..total).map(|i| uniform_at(13, i as u64)).collect();
            let (dh, dn) = (gpu.upload(&hidden).unwrap(), gpu.upload(&norm_w).unwrap());
            let (dy_norm, dy_add) = (
                gpu.zeros::<f32>(total).unwrap(),
                gpu.upload(&start).unwrap(),
            );
            let norm_args = GemvNorm {
                mats: mats_args,
                hidden: ptr(&dh, &gpu.stream),
                norm_w: ptr(&dn, &gpu.stream),
                eps,
                y: ptr(&dy_norm, &gpu.stream),
            };
            gpu.launch(
                &format!("gemv_norm_b{bits}"),
                gemv_shape(&shapes),
                &norm_args,
            )
            .unwrap();
            let add_args = GemvAdd {
                mats: mats_args,
                x: ptr(&dh, &gpu.stream),
                y: ptr(&dy_add, &gpu.stream),
            };
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

/// `gemv_rows_{norm,add}_b*` for 2 to 8 rows give every row the bits `gemv_{norm,add}_b*` give it
/// alone: at every format, widths of one and several load batches, ragged row counts, 2, 3, 5, 7
/// and 8 rows (bounds 2, 4, 8 and rows short of them), and grids of one block and of one wave.
#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_gemvs_give_each_row_its_single_row_bits() {
    let config = synthetic_config("tiny").unwrap();
    let gpu = Gpu::new(&config, KvPrecision::F32).expect("needs a CUDA GPU");
    let eps = 1e-6f32;
    for bits in [4u32, 8, 32] {
        for (cols, shapes) in [
            (64usize, vec![1usize, 7, 33]),
            (2048, vec![257, 1]),
            (4096, vec![1030]),
        ] {
            let (_, _dev, mats_args) = upload(&gpu, bits, cols, &shapes, 5);
            let total: usize = shapes.iter().sum();
            let norm_w: Vec<f32> = (0..cols).map(|i| 1.0 + uniform_at(22, i as u64)).collect();
            let dn = gpu.upload(&norm_w).unwrap();
            for nx in [2usize, 3, 5, 7, 8] {
                let bound = nx.next_power_of_two();
                let x: Vec<f32> = (0..nx * cols)
                    .map(|i| 3.0 * uniform_at(21 + nx as u64, i as u64))
                    .collect();
                let start: Vec<f32> = (0..nx * total).map(|i| uniform_at(23, i as u64)).collect();
                let dx = gpu.upload(&x).unwrap();
                let single = gemv_shape(&shapes);
                let shared = rows_shared_bytes(bits, cols, bound) as u32;
                for blocks in [1u32, single.grid.0.min(132)] {
                    let (y_norm, y_add) = (
                        gpu.zeros::<f32>(nx * total).unwrap(),
                        gpu.upload(&start).unwrap(),
                    );
                    let shape = || Shape {
                        grid: (blocks, 1, 1),
                        block: single.block,
                    };
                    let a = GemvRowsNorm {
                        mats: mats_args,
                        nx: nx as i32,
                        hidden: ptr(&dx, &gpu.stream),
                        norm_w: ptr(&dn, &gpu.stream),
                        eps,
                        y: ptr(&y_norm, &gpu.stream),
                    };
                    let name = format!("gemv_rows_norm_b{bits}_x{bound}");
                    gpu.launch_shared(&name, shape(), shared, &a).unwrap();
                    let a = GemvRowsAdd {
                        mats: mats_args,
                        nx: nx as i32,
                        x: ptr(&dx, &gpu.stream),
                        y: ptr(&y_add, &gpu.stream),
                    };
                    let name = format!("gemv_rows_add_b{bits}_x{bound}");
                    gpu.launch_shared(&name, shape(), shared, &a).unwrap();
                    let (got_norm, got_add) = (
                        gpu.download(&y_norm).unwrap(),
                        gpu.download(&y_add).unwrap(),
                    );
                    for n in 0..nx {
                        let xr = gpu.upload(&x[n * cols..(n + 1) * cols]).unwrap();
                        let yn = gpu.zeros::<f32>(total).unwrap();
                        let ya = gpu.upload(&start[n * total..(n + 1) * total]).unwrap();
                        let a = GemvNorm {
                            mats: mats_args,
                            hidden: ptr(&xr, &gpu.stream),
                            norm_w: ptr(&dn, &gpu.stream),
                            eps,
                            y: ptr(&yn, &gpu.stream),
                        };
                        gpu.launch(&format!("gemv_norm_b{bits}"), gemv_shape(&shapes), &a)
                            .unwrap();
                        let a = GemvAdd {
                            mats: mats_args,
                            x: ptr(&xr, &gpu.stream),
                            y: ptr(&ya, &gpu.stream),
                        };
                        gpu.launch(&format!("gemv_add_b{bits}"), gemv_shape(&shapes), &a)
                            .unwrap();
                        let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let rows = n * total..(n + 1) * total;
                        let label = format!(
                            "{bits}-bit, {cols} cols, rows {shapes:?}, {nx} rows, {blocks} blocks, row {n}"
                        );
                        assert_eq!(
                            bits_of(&got_norm[rows.clone()]),
                            bits_of(&gpu.download(&yn).unwrap()),
                            "gemv_rows_norm {label}"
                        );
                        assert_eq!(
                            bits_of(&got_add[rows]),
                            bits_of(&gpu.download(&ya).unwrap()),
                            "gemv_rows_add {label}"
                        );
                    }
                }
            }
            eprintln!(
                "{bits}-bit, {cols} cols, rows {shapes:?}: every batched row equals its single-row bits"
            );
        }
    }
}

/// `gemv` on `rows` rows of x (row after row) with y starting as `y0`, through the step's launcher.
fn launch_gemv(
    gpu: &Gpu,
    form: GemvForm,
    mats: &[&DeviceMat],
    rows: usize,
    x: &[f32],
    y0: &[f32],
) -> Vec<f32> {
    let (dx, dy) = (gpu.upload(x).unwrap(), gpu.upload(y0).unwrap());
    let (px, py) = (ptr(&dx, &gpu.stream), ptr(&dy, &gpu.stream));
    gemv(gpu, form, mats, rows, px, py).unwrap();
    gpu.download(&dy).unwrap()
}

/// Both tensor-core GEMVs, the routes of 4-bit codes in groups of a multiple of 64 (bf16
/// `gemv_mma_*` and the integer `gemv_q4_*`): both forms against the CPU (f64 sums of the
/// dequantised weights), and every row of 2 to 8 bit for bit what it gets alone. Widths of one slab to 64 (a quad cut short at 192 and 2,624; K split
/// over 2 to 8 warps where units are few), groups of 64 and 128, ragged row counts, several
/// matrices a launch, enough rows that every block strides over many units, and inputs whose
/// slabs span very different magnitudes (the parts' scale is a slab's own).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tensor_core_gemvs_match_the_cpu_and_give_each_row_its_own_bits() {
    let config = synthetic_config("tiny").unwrap();
    for (kernels, route) in [
        (DecodeKernels::Mma, GemvRoute::Mma),
        (DecodeKernels::Imma, GemvRoute::Imma),
    ] {
        let options = CudaOptions {
            kv: KvPrecision::F32,
            decode_kernels: kernels,
            ..CudaOptions::default()
        };
        let gpu = Gpu::with_options(&config, &options).expect("needs a CUDA GPU");
        tensor_core_gemvs_on(&gpu, route);
    }
}

fn tensor_core_gemvs_on(gpu: &Gpu, route: GemvRoute) {
    let eps = 1e-6f32;
    for (cols, group, shapes) in [
        (64usize, 64usize, vec![1usize, 7, 33]),
        (192, 64, vec![16, 5]),
        (2048, 64, vec![257, 1, 48]),
        (2048, 128, vec![300]),
        (2560, 64, vec![33]),
        (2624, 64, vec![700]),
        (4096, 64, vec![2048, 16]),
        (1024, 64, vec![20_001]),
    ] {
        assert_eq!(
            gemv_route(4, group, cols, gpu.shared_optin, gpu.decode_kernels),
            route
        );
        let mats: Vec<Linear> = shapes
            .iter()
            .enumerate()
            .map(|(i, &r)| random_linear_grouped(r, cols, 4, group, 31 * i as u64 + cols as u64))
            .collect();
        let dev: Vec<DeviceMat> = mats
            .iter()
            .map(|m| DeviceMat::upload(gpu, m).unwrap())
            .collect();
        let refs: Vec<&DeviceMat> = dev.iter().collect();
        let dense: Vec<f32> = mats.iter().flat_map(dense_of).collect();
        let total: usize = shapes.iter().sum();
        let norm_w: Vec<f32> = (0..cols).map(|i| 1.0 + uniform_at(32, i as u64)).collect();
        let dn = gpu.upload(&norm_w).unwrap();
        let norm = GemvForm::Norm(ptr(&dn, &gpu.stream), eps);
        for nx in [1usize, 2, 3, 5, 8] {
            // Each slab of 64 inputs its own magnitude, from 1e-6 to 1e3, so that a part scaled by
            // the wrong slab's exponent shows.
            let x: Vec<f32> = (0..nx * cols)
                .map(|i| {
                    let magnitude = 10f32.powi((i / 64 % 10) as i32 - 6);
                    magnitude * uniform_at(33 + nx as u64, i as u64)
                })
                .collect();
            let start: Vec<f32> = (0..nx * total).map(|i| uniform_at(34, i as u64)).collect();
            let y_norm = launch_gemv(gpu, norm, &refs, nx, &x, &vec![0.0; nx * total]);
            let y_add = launch_gemv(gpu, GemvForm::Add, &refs, nx, &x, &start);
            for n in 0..nx {
                let xr = &x[n * cols..(n + 1) * cols];
                let inv = 1.0
                    / (xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64
                        + eps as f64)
                        .sqrt();
                let dot = |row: &[f32], normed: bool| {
                    row.iter()
                        .zip(xr)
                        .zip(&norm_w)
                        .map(|((&w, &v), &g)| {
                            let v = if normed {
                                v as f64 * inv * g as f64
                            } else {
                                v as f64
                            };
                            w as f64 * v
                        })
                        .sum::<f64>()
                };
                let rows = n * total..(n + 1) * total;
                let want_norm: Vec<f32> = dense.chunks(cols).map(|r| dot(r, true) as f32).collect();
                let want_add: Vec<f32> = dense
                    .chunks(cols)
                    .zip(&start[rows.clone()])
                    .map(|(r, &s)| (dot(r, false) + s as f64) as f32)
                    .collect();
                let dn = rel_diff(&y_norm[rows.clone()], &want_norm);
                let da = rel_diff(&y_add[rows.clone()], &want_add);
                let label =
                    format!("{cols} cols, group {group}, rows {shapes:?}, {nx} rows, row {n}");
                // f32 sums of up to 4,096 exact products and a fast-math rsqrt: a few 1e-7 of
                // the largest output; a wrong slab, pair, part or scale shows at 1e-2 or more.
                assert!(dn <= 1e-5, "gemv_q4_norm {label}: {dn:e}");
                assert!(da <= 1e-5, "gemv_q4_add {label}: {da:e}");
                if nx > 1 {
                    let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    let alone_norm = launch_gemv(gpu, norm, &refs, 1, xr, &vec![0.0; total]);
                    let alone_add =
                        launch_gemv(gpu, GemvForm::Add, &refs, 1, xr, &start[rows.clone()]);
                    assert_eq!(
                        bits_of(&y_norm[rows.clone()]),
                        bits_of(&alone_norm),
                        "gemv_q4_norm {label}"
                    );
                    assert_eq!(
                        bits_of(&y_add[rows]),
                        bits_of(&alone_add),
                        "gemv_q4_add {label}"
                    );
                }
            }
            eprintln!(
                "{cols} cols, group {group}, rows {shapes:?}, {nx} rows: as the CPU, each row its own bits"
            );
        }
    }
}
