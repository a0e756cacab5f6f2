//! The bf16 mode's products against an independent definition (`half`'s rounding, `f32::mul_add`
//! for the dequantisation), to the bit: both sum with the same dot product, so any difference is
//! a rounding point placed differently.

use half::bf16 as Bf16;
use lily_core::quant::QuantMatrix;
use lily_core::rng::uniform_at;
use lily_core::weights::{Linear, Matrix};

use super::*;
use crate::ops::{dense_matmul, matmul};

fn half_round(x: f32) -> f32 {
    Bf16::from_f32(x).to_f32()
}

#[test]
fn rounding_is_to_nearest_even_as_half_does_it() {
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        // Exact ties, below and above an even kept part, and one bit either side of a tie.
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0xbf81_8000),
        f32::from_bits(0x3f80_7fff),
        f32::from_bits(0x3f80_8001),
    ];
    values.extend((0..10_000).map(|i| uniform_at(5, i) * 10f32.powi((i % 20) as i32 - 10)));
    for v in values {
        assert_eq!(bf16(v).to_bits(), half_round(v).to_bits(), "{v:e}");
    }
    assert!(bf16(f32::NAN).is_nan());
}

/// The weight as the definition rounds it: bf16(fmaf(scale, code, bias)) element by element.
fn definition_weights(w: &Linear) -> Matrix {
    let data = match w {
        Linear::Dense(m) => m.data.iter().map(|&v| half_round(v)).collect(),
        Linear::Affine(q) => (0..q.rows() * q.cols())
            .map(|i| {
                let (r, c) = (i / q.cols(), i % q.cols());
                let g = c / q.group_size();
                let (s, b) = (q.row_scales(r)[g].to_f32(), q.row_biases(r)[g].to_f32());
                half_round(s.mul_add(q.code(r, c) as f32, b))
            })
            .collect(),
    };
    Matrix {
        rows: w.rows(),
        cols: w.cols(),
        data,
    }
}

#[test]
fn bf16_products_equal_the_definition_to_the_bit() {
    let shapes = [
        // (weight rows, cols, bits (32: dense), group, input rows)
        (1, 32, 32, 0, 1),
        (17, 45, 32, 0, 3),
        (37, 128, 4, 64, 1),
        (70, 192, 4, 32, 9),
        (33, 256, 4, 128, 5),
        (29, 192, 8, 32, 6),
        (17, 256, 8, 128, 2),
        (300, 512, 4, 64, 4),
    ];
    for (i, &(n, k, bits, group, rows)) in shapes.iter().enumerate() {
        // Magnitudes spread over several octaves, so that scales, biases and inputs take many
        // exponents.
        let values: Vec<f32> = (0..n * k)
            .map(|j| uniform_at(i as u64, j as u64) * (1.0 + (j % 13) as f32))
            .collect();
        let w = match bits {
            32 => Linear::Dense(Matrix {
                rows: n,
                cols: k,
                data: values,
            }),
            b => Linear::Affine(QuantMatrix::quantize(n, k, b, group, &values).unwrap()),
        };
        let x: Vec<f32> = (0..rows * k)
            .map(|j| uniform_at(50 + i as u64, j as u64) * 3.7)
            .collect();
        let rounded_x: Vec<f32> = x.iter().map(|&v| half_round(v)).collect();
        let want = dense_matmul(&rounded_x, rows, &definition_weights(&w));
        let got = Numerics::TensorCoreBf16.matmul(&x, rows, &w);
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{n}x{k} {bits}-bit g{group} rows {rows}");
        // The rounding is real: the f32 product of the same operands differs.
        let exact = Numerics::F32.matmul(&x, rows, &w);
        assert!(got != exact, "{n}x{k}: the bf16 product rounded nothing");
    }
}

#[test]
fn f32_numerics_leave_operands_and_products_as_they_are() {
    let x: Vec<f32> = (0..3 * 64).map(|j| uniform_at(9, j) * 1.3).collect();
    assert!(matches!(Numerics::F32.operand(&x), Cow::Borrowed(_)));
    let values: Vec<f32> = (0..40 * 64).map(|j| uniform_at(10, j)).collect();
    let w = Linear::Affine(QuantMatrix::quantize(40, 64, 4, 64, &values).unwrap());
    assert_eq!(Numerics::F32.matmul(&x, 3, &w), matmul(&x, 3, &w));
}
