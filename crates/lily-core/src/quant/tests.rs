//! Held bit-exact to `mx.quantize` / `mx.dequantize` (tests/fixtures/mlx-quant, made by
//! tools/make_mlx_fixtures.py with mlx 0.32.4).

use std::path::PathBuf;

use half::bf16;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::*;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mlx-quant")
}

struct Fixture {
    bytes: Vec<u8>,
    cases: Vec<Value>,
}

impl Fixture {
    fn load() -> Self {
        let dir = fixture_dir();
        let bytes = std::fs::read(dir.join("cases.safetensors")).unwrap();
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap())
                .unwrap();
        let cases = json["cases"].as_array().unwrap().clone();
        assert!(cases.len() >= 10, "too few cases");
        Fixture { bytes, cases }
    }

    fn tensor(&self, name: &str, dtype: Dtype) -> Vec<u8> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), dtype, "{name}");
        t.data().to_vec()
    }

    fn u32s(&self, name: &str) -> Vec<u32> {
        let b = self.tensor(name, Dtype::U32);
        b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn bf16s(&self, name: &str) -> Vec<bf16> {
        let b = self.tensor(name, Dtype::BF16);
        b.chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
            .collect()
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        let b = self.tensor(name, Dtype::F32);
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

struct Case {
    key: String,
    input: String,
    bits: u32,
    group: usize,
    rows: usize,
    cols: usize,
}

fn cases(f: &Fixture) -> Vec<Case> {
    f.cases
        .iter()
        .map(|c| Case {
            key: c["key"].as_str().unwrap().to_string(),
            input: c["input"].as_str().unwrap().to_string(),
            bits: c["bits"].as_u64().unwrap() as u32,
            group: c["group_size"].as_u64().unwrap() as usize,
            rows: c["rows"].as_u64().unwrap() as usize,
            cols: c["cols"].as_u64().unwrap() as usize,
        })
        .collect()
}

fn mlx_matrix(f: &Fixture, c: &Case) -> QuantMatrix {
    QuantMatrix::from_parts(
        c.rows,
        c.cols,
        c.bits,
        c.group,
        f.u32s(&format!("{}.codes", c.key)),
        f.bf16s(&format!("{}.scales", c.key)),
        f.bf16s(&format!("{}.biases", c.key)),
    )
    .unwrap()
}

#[test]
fn quantize_writes_the_codes_scales_and_biases_of_mx_quantize() {
    let f = Fixture::load();
    let mut bits_seen = std::collections::BTreeSet::new();
    for c in cases(&f) {
        let w: Vec<f32> = f
            .bf16s(&format!("{}.w", c.input))
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let ours = QuantMatrix::quantize(c.rows, c.cols, c.bits, c.group, &w).unwrap();
        let theirs = mlx_matrix(&f, &c);
        assert_eq!(ours.codes(), theirs.codes(), "{}: codes", c.key);
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(ours.scales()), bits(theirs.scales()), "{}", c.key);
        assert_eq!(bits(ours.biases()), bits(theirs.biases()), "{}", c.key);
        bits_seen.insert(c.bits);
    }
    assert_eq!(bits_seen.into_iter().collect::<Vec<_>>(), [4, 8]);
}

#[test]
fn dequantize_is_mx_dequantize_with_f32_scales_bit_for_bit() {
    let f = Fixture::load();
    for c in cases(&f) {
        let m = mlx_matrix(&f, &c);
        let want = f.f32s(&format!("{}.deq_f32", c.key));
        let got = m.dequantize();
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{}: {differ} values differ", c.key);
        assert!(want.iter().any(|v| *v != 0.0), "{}: all zero", c.key);
    }
}

/// MLX's bf16 dequantisation rounds the product and then the sum to bf16; checking that we can
/// reproduce it confirms we read codes, scales and biases exactly as MLX lays them out.
#[test]
fn bf16_dequantize_rounds_twice_as_mlx_does() {
    let f = Fixture::load();
    let round = |v: f32| bf16::from_f32(v).to_f32();
    for c in cases(&f) {
        let m = mlx_matrix(&f, &c);
        let want = f.bf16s(&format!("{}.deq_bf16", c.key));
        for r in 0..c.rows {
            for col in 0..c.cols {
                let g = col / c.group;
                let (s, b) = (m.row_scales(r)[g].to_f32(), m.row_biases(r)[g].to_f32());
                let v = round(round(s * m.code(r, col) as f32) + b);
                assert_eq!(
                    v.to_bits(),
                    want[r * c.cols + col].to_f32().to_bits(),
                    "{} at ({r}, {col})",
                    c.key
                );
            }
        }
    }
}

#[test]
fn codes_are_packed_lowest_bits_first() {
    // Row 0: codes 0..15 then 15..0 at 4 bits; one group of 32.
    let codes: Vec<u32> = (0..32u32)
        .map(|c| if c < 16 { c } else { 31 - c })
        .collect();
    let pack = |chunk: &[u32]| chunk.iter().rev().fold(0u32, |acc, &c| (acc << 4) | c);
    let words: Vec<u32> = codes.chunks(8).map(pack).collect();
    assert_eq!(words[0], 0x7654_3210);
    let m = QuantMatrix::from_parts(
        1,
        32,
        4,
        32,
        words,
        vec![bf16::from_f32(0.5)],
        vec![bf16::from_f32(-1.0)],
    )
    .unwrap();
    for (c, &want) in codes.iter().enumerate() {
        assert_eq!(m.code(0, c), want);
    }
    let mut row = vec![0f32; 32];
    m.dequantize_row(0, &mut row);
    assert_eq!(row[3], 0.5 * 3.0 - 1.0);
    assert_eq!(row[16], 0.5 * 15.0 - 1.0);
}

#[test]
fn splitting_rows_keeps_every_byte() {
    let w: Vec<f32> = (0..6 * 128)
        .map(|i| ((i * 37) % 101) as f32 - 50.0)
        .collect();
    let m = QuantMatrix::quantize(6, 128, 4, 64, &w).unwrap();
    let (a, b) = m.clone().split_rows(2).unwrap();
    assert_eq!((a.rows(), b.rows()), (2, 4));
    let joined: Vec<u32> = a.codes().iter().chain(b.codes()).copied().collect();
    assert_eq!(joined, m.codes());
    assert_eq!(b.row_scales(0), m.row_scales(2));
    assert_eq!(b.row_biases(3), m.row_biases(5));
}

#[test]
fn bad_formats_and_shapes_are_errors() {
    let err = |r: Result<QuantMatrix>| r.unwrap_err().to_string();
    let one = vec![bf16::ONE];
    assert!(err(QuantMatrix::quantize(1, 64, 3, 64, &[0.0; 64])).contains("3-bit"));
    assert!(err(QuantMatrix::quantize(1, 64, 4, 48, &[0.0; 64])).contains("group size 48"));
    assert!(err(QuantMatrix::quantize(1, 96, 4, 64, &[0.0; 96])).contains("96 columns"));
    let mut nan = vec![0.0; 64];
    nan[5] = f32::NAN;
    assert!(err(QuantMatrix::quantize(1, 64, 4, 64, &nan)).contains("column 5"));
    let short = QuantMatrix::from_parts(1, 64, 4, 64, vec![0; 7], one.clone(), one);
    assert!(err(short).contains("8 code words"));
}
