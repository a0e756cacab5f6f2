//! Every kernel this CPU runs against dequantise-then-f32-product, and the SIMD kernels against
//! the portable one, at shapes that leave partial passes and odd task splits.

use lily_core::quant::QuantMatrix;
use lily_core::rng::uniform_at;
use lily_core::weights::Matrix;

use super::*;
use crate::ops::dense_matmul;
use crate::products::{Kernel, Product, Weight, products_with};

fn random_matrix(rows: usize, cols: usize, bits: u32, group: usize, seed: u64) -> QuantMatrix {
    // Per-row magnitudes differ so the scales and biases differ between groups and rows.
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| uniform_at(seed, i as u64) * (1.0 + (i / cols % 7) as f32))
        .collect();
    QuantMatrix::quantize(rows, cols, bits, group, &values).unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn every_kernel_equals_dequantise_then_multiply() {
    let isas = Isa::available();
    eprintln!(
        "kernels tested on this CPU: {isas:?}; best: {:?}{}",
        Isa::detect(),
        if isas.contains(&Isa::Avx512) {
            ""
        } else {
            " (no AVX-512 here: that kernel is checked at start-up on machines that have it)"
        }
    );
    let shapes = [
        // (weight rows, cols, bits, group, input rows)
        (1, 64, 4, 64, 1),
        (37, 128, 4, 64, 1),
        (37, 128, 4, 64, 5),
        (70, 192, 4, 32, 9),
        (33, 256, 4, 128, 3),
        (40, 128, 8, 64, 1),
        (29, 192, 8, 32, 6),
        (17, 256, 8, 128, 4),
        (300, 512, 4, 64, 2),
    ];
    for (i, &(n, k, bits, group, rows)) in shapes.iter().enumerate() {
        let w = random_matrix(n, k, bits, group, i as u64);
        let x: Vec<f32> = (0..rows * k)
            .map(|j| uniform_at(100 + i as u64, j as u64))
            .collect();
        let dense = Matrix {
            rows: n,
            cols: k,
            data: w.dequantize(),
        };
        let want = dense_matmul(&x, rows, &dense);
        let portable = quant_matmul_with(Isa::Portable, &x, rows, &w);
        for &isa in &isas {
            let got = quant_matmul_with(isa, &x, rows, &w);
            assert_eq!(got.len(), rows * n);
            let d = max_rel(&got, &want);
            assert!(
                d < 2e-6,
                "{isa:?} {n}x{k} {bits}-bit g{group} rows {rows}: {d:e}"
            );
            let d = max_rel(&got, &portable);
            assert!(d < 2e-6, "{isa:?} vs portable, {n}x{k}: {d:e}");
        }
    }
}

#[test]
fn the_start_up_check_passes_for_every_kernel_here() {
    for isa in Isa::available() {
        self_check(isa).unwrap();
    }
}

#[test]
fn nibble_order_puts_even_columns_first() {
    let block: Vec<f32> = (0..32).map(|i| i as f32).collect();
    let o = nibble_block(&block);
    assert_eq!(o[..3], [0.0, 2.0, 4.0]);
    assert_eq!(o[15], 30.0);
    assert_eq!(o[16..18], [1.0, 3.0]);
    assert_eq!(o[31], 31.0);
    let rows: Vec<f32> = (0..3 * 4096).map(|i| uniform_at(7, i as u64)).collect();
    assert_eq!(to_nibble_order_in_parallel(&rows), to_nibble_order(&rows));
}

/// The tiled AVX-512 product (from `TILED_FROM_ROWS` input rows) against the row kernel fed one
/// input row at a time, to the bit: at ragged row counts (partial register tiles, several input
/// blocks at 4,096 columns), partial panels, both bit widths and every group size.
#[test]
fn the_tiled_product_equals_the_row_kernel_to_the_bit() {
    if !Isa::available().contains(&Isa::Avx512) {
        eprintln!("NOT RUN: this CPU has no AVX-512, so the tiled product cannot run here");
        return;
    }
    let shapes = [
        // (weight rows, cols, bits, group, input rows)
        (1, 64, 4, 64, 8),
        (5, 128, 4, 64, 9),
        (33, 256, 8, 64, 10),
        (70, 192, 4, 32, 11),
        (9, 512, 8, 128, 37),
        (7, 4096, 4, 64, 41),
        (300, 2048, 4, 64, 64),
    ];
    for (i, &(n, k, bits, group, rows)) in shapes.iter().enumerate() {
        let w = random_matrix(n, k, bits, group, 100 + i as u64);
        let x: Vec<f32> = (0..rows * k)
            .map(|j| uniform_at(200 + i as u64, j as u64))
            .collect();
        let tiled = quant_matmul_with(Isa::Avx512, &x, rows, &w);
        for (r, x_r) in x.chunks(k).enumerate() {
            let alone = quant_matmul_with(Isa::Avx512, x_r, 1, &w);
            let got = &tiled[r * n..(r + 1) * n];
            assert!(
                got.iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{n}x{k} {bits}-bit g{group}, {rows} rows: row {r} differs"
            );
        }
    }
}

/// The int8 kernel against its definition (module docs of int8.rs) evaluated in f64 from the
/// same rounded inputs, with one part and with two, and against the f32 kernel within what each
/// rounding costs.
#[test]
fn the_int8_kernel_computes_its_definition() {
    let isas = Int8Isa::available();
    if isas.is_empty() {
        eprintln!("NOT RUN: this CPU has neither AVX2 nor AVX-512 VNNI: no int8 kernel runs here");
        return;
    }
    if !isas.contains(&Int8Isa::Avx512Vnni) {
        eprintln!("NOT RUN here: the AVX-512 VNNI int8 kernel (this CPU has no VNNI)");
    }
    let shapes = [
        // (weight rows, cols, bits, group, input rows)
        (1, 128, 4, 64, 1),
        (5, 64, 4, 32, 2),
        (37, 256, 4, 32, 3),
        (33, 384, 4, 128, 5),
        (40, 128, 8, 64, 1),
        (29, 192, 8, 32, 6),
        (17, 256, 8, 128, 4),
        (300, 2048, 4, 64, 9),
    ];
    for (i, &(n, k, bits, group, rows)) in shapes.iter().enumerate() {
        let w = random_matrix(n, k, bits, group, 300 + i as u64);
        // Rows of different magnitudes, one all zero (a group with no step).
        let x: Vec<f32> = (0..rows * k)
            .map(|j| {
                let r = j / k;
                if r == 2 {
                    0.0
                } else {
                    uniform_at(400 + i as u64, j as u64) * (1 + r) as f32
                }
            })
            .collect();
        let f32_result = quant_matmul_with(Isa::detect(), &x, rows, &w);
        // Measured from the f32 kernel: 1.3e-3 to 8.0e-3 with one part, 1.5e-5 to 9.2e-5 with two.
        for (parts, near) in [(InputParts::One, 2e-2), (InputParts::Two, 2e-4)] {
            let want = int8_definition(&w, &x, rows, parts);
            // The AVX2 kernel takes 4-bit codes only (its i16 sums would overflow with 8).
            for isa in isas.iter().copied().filter(|isa| isa.fits(&w)) {
                let product = [Product::new(Weight::Affine(&w), &x, rows)];
                let got = products_with(Kernel::Int8(isa, parts), &product).remove(0);
                let what = format!("{isa:?} {parts:?} {n}x{k} {bits}-bit g{group} rows {rows}");
                let d = max_rel(&got, &want);
                assert!(d < 2e-6, "{what}: {d:e} from the definition");
                let d = max_rel(&got, &f32_result);
                eprintln!("int8 {what}: {d:e} from the f32 kernel");
                assert!(d < near && d > 1e-7, "{what}: {d:e} from the f32 kernel");
            }
        }
    }
}

/// `x · Wᵀ` as the int8 kernel defines it, in f64: each input rounded per group to `X` (one
/// part `h`, or `128·h + l`) and every weight `s·q + b` times `X`'s step.
fn int8_definition(w: &QuantMatrix, x: &[f32], rows: usize, parts: InputParts) -> Vec<f32> {
    let (n, k, group) = (w.rows(), w.cols(), w.group_size());
    let unit = match parts {
        InputParts::One => 1.0,
        InputParts::Two => 128.0,
    };
    let mut want = vec![0f32; rows * n];
    for (r, xr) in x.chunks(k).enumerate() {
        for j in 0..n {
            let mut sum = 0f64;
            for (g, xg) in xr.chunks(group).enumerate() {
                let step = xg.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                let (s, b) = (
                    w.row_scales(j)[g].to_f32() as f64,
                    w.row_biases(j)[g].to_f32() as f64,
                );
                for (c, &v) in xg.iter().enumerate() {
                    let q = w.code(j, g * group + c) as f64;
                    let y = if step > 0.0 { v * (1.0 / step) } else { 0.0 };
                    let high = y.round_ties_even().clamp(-127.0, 127.0);
                    let steps = match parts {
                        InputParts::One => high as f64,
                        InputParts::Two => {
                            128.0 * high as f64 + ((y - high) * 128.0).round_ties_even() as f64
                        }
                    };
                    sum += (s * q + b) * (step / unit) as f64 * steps;
                }
            }
            want[r * n + j] = sum as f32;
        }
    }
    want
}

/// Every int8 kernel on many input rows (tiles of four weight rows by three input rows for
/// AVX-512, passes of a weight row by four input rows for AVX2) against the same kernel fed one
/// input row at a time, to the bit: partial tiles of input rows, weight rows left over after the
/// last four, both bit widths and part counts.
#[test]
fn the_int8_tiles_equal_the_int8_rows_to_the_bit() {
    let isas = Int8Isa::available();
    if isas.is_empty() {
        eprintln!("NOT RUN: this CPU has neither AVX2 nor AVX-512 VNNI: no int8 kernel runs here");
        return;
    }
    if !isas.contains(&Int8Isa::Avx512Vnni) {
        eprintln!("NOT RUN here: the AVX-512 VNNI int8 kernel (this CPU has no VNNI)");
    }
    let shapes = [
        (1, 128, 4, 64, 8),
        (7, 256, 4, 32, 10),
        (33, 2048, 4, 64, 11),
        (6, 192, 8, 64, 9),
        (70, 512, 4, 128, 16),
        (9, 384, 4, 64, 3),
        (13, 256, 4, 64, 2),
    ];
    for (i, &(n, k, bits, group, rows)) in shapes.iter().enumerate() {
        let w = random_matrix(n, k, bits, group, 500 + i as u64);
        let x: Vec<f32> = (0..rows * k)
            .map(|j| uniform_at(600 + i as u64, j as u64))
            .collect();
        let kernels = isas.iter().filter(|isa| isa.fits(&w));
        for (&isa, parts) in
            kernels.flat_map(|isa| [(isa, InputParts::One), (isa, InputParts::Two)])
        {
            let kernel = Kernel::Int8(isa, parts);
            let product = |x, rows| {
                products_with(kernel, &[Product::new(Weight::Affine(&w), x, rows)]).remove(0)
            };
            let tiled = product(&x, rows);
            for (r, x_r) in x.chunks(k).enumerate() {
                let alone = product(x_r, 1);
                let got = &tiled[r * n..(r + 1) * n];
                assert!(
                    got.iter()
                        .zip(&alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} {parts:?} {n}x{k} {bits}-bit g{group}, {rows} rows: row {r} differs"
                );
            }
        }
    }
}

/// A product of picked rows (a routed expert's share of a prefill) gives, to the bit, what the
/// product of those rows gathered gives, with every kernel here: the int8 kernels read them from
/// one rounded copy of the whole input. Picks are ragged, out of order and may repeat or be empty.
#[test]
fn picked_rows_equal_gathered_rows_to_the_bit() {
    let (n, k, rows) = (70, 512, 37);
    let w = random_matrix(n, k, 4, 64, 5);
    let x: Vec<f32> = (0..rows * k).map(|j| uniform_at(6, j as u64)).collect();
    let picks: [&[usize]; 4] = [&[3], &[0, 5, 6, 9, 36, 20, 21], &[8, 8, 2], &[]];
    for kernel in every_kernel() {
        let list: Vec<Product> = picks
            .iter()
            .map(|&p| Product::picked(Weight::Affine(&w), &x, p))
            .collect();
        let got = products_with(kernel, &list);
        for (p, out) in picks.iter().zip(&got) {
            let gathered: Vec<f32> = p
                .iter()
                .flat_map(|&r| &x[r * k..(r + 1) * k])
                .copied()
                .collect();
            let [want] = <[Vec<f32>; 1]>::try_from(products_with(
                kernel,
                &[Product::new(Weight::Affine(&w), &gathered, p.len())],
            ))
            .unwrap();
            assert_eq!(out.len(), p.len() * n);
            assert!(
                out.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kernel:?}, rows {p:?}"
            );
        }
    }
}

/// A NaN input reaches the output of its row, with every kernel, as the f32 path gives; the
/// other rows are untouched.
#[test]
fn a_nan_input_gives_nan_outputs_with_every_kernel() {
    let (n, k, rows) = (9, 256, 3);
    let w = random_matrix(n, k, 4, 64, 8);
    let mut x: Vec<f32> = (0..rows * k).map(|j| uniform_at(9, j as u64)).collect();
    x[k + 70] = f32::NAN;
    for kernel in every_kernel() {
        let [out] = <[Vec<f32>; 1]>::try_from(products_with(
            kernel,
            &[Product::new(Weight::Affine(&w), &x, rows)],
        ))
        .unwrap();
        for (r, row) in out.chunks(n).enumerate() {
            assert_eq!(
                row.iter().all(|v| v.is_nan()),
                r == 1,
                "{kernel:?}, row {r}"
            );
            assert!(
                r == 1 || row.iter().all(|v| v.is_finite()),
                "{kernel:?}, row {r}"
            );
        }
    }
}

/// Every f32 kernel and every int8 kernel (both part counts) this CPU runs.
fn every_kernel() -> Vec<Kernel> {
    let mut kernels: Vec<Kernel> = Isa::available().into_iter().map(Kernel::F32).collect();
    for isa in Int8Isa::available() {
        kernels.extend([InputParts::One, InputParts::Two].map(|p| Kernel::Int8(isa, p)));
    }
    kernels
}
