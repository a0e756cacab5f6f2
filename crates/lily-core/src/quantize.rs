//! Converting a bf16 or f32 checkpoint to MLX 4-bit as `mlx_lm.convert -q` does (with
//! `--dtype bfloat16`): every weight is first rounded to bf16; linears are quantised at the
//! bits [`mlx_quant_bits`] gives them (group 64), or kept bf16 where their input dim does not
//! divide into groups; zero-centred norms become bf16(1 + w); `A_log` keeps its values; every
//! other tensor is rounded to bf16.
//!
//! The same rules run at load time ([`QuantizingSource`], `--quantize q4`) and when writing a
//! directory ([`write_mlx_checkpoint`], `lily quantize`), so both give identical weights.

mod write;

use anyhow::Result;
use half::bf16;

use crate::mlx::{is_zero_centred_norm, mlx_quant_bits};
use crate::quant::{DEFAULT_GROUP_SIZE, QuantMatrix};
use crate::source::TensorSource;
use crate::weights::{Linear, Matrix};

pub use write::{WriteSummary, write_mlx_checkpoint};

/// What mlx-lm stores for an unquantised tensor of canonical name `name` (values in f32).
pub fn mlx_plain_values(name: &str, mut values: Vec<f32>, norms_shifted: bool) -> Vec<f32> {
    let round = |v: f32| bf16::from_f32(v).to_f32();
    if name.ends_with("A_log") {
        // mlx-lm's cast_predicate leaves A_log in its stored dtype.
    } else if is_zero_centred_norm(name) && !norms_shifted {
        values.iter_mut().for_each(|v| *v = round(1.0 + *v));
    } else {
        values.iter_mut().for_each(|v| *v = round(*v));
    }
    values
}

/// What mlx-lm makes of the weight of linear module `module`: quantised, or bf16-rounded.
pub fn mlx_linear(module: &str, weight: Linear) -> Result<Linear> {
    Ok(match weight {
        Linear::Dense(m) => match mlx_quant_bits(module, m.cols) {
            Some(bits) => Linear::Affine(QuantMatrix::quantize(
                m.rows,
                m.cols,
                bits,
                DEFAULT_GROUP_SIZE,
                &m.data,
            )?),
            None => Linear::Dense(Matrix {
                data: mlx_plain_values(module, m.data, true),
                ..m
            }),
        },
        quantised => quantised,
    })
}

/// A source that quantises another as it is read (`--quantize q4`).
pub struct QuantizingSource {
    inner: Box<dyn TensorSource>,
}

impl QuantizingSource {
    pub fn new(inner: Box<dyn TensorSource>) -> Self {
        QuantizingSource { inner }
    }
}

impl TensorSource for QuantizingSource {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn take_f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let shifted = self.inner.norms_are_shifted();
        let values = self.inner.take_f32(name, shape)?;
        Ok(mlx_plain_values(name, values, shifted))
    }

    fn take_linears(
        &mut self,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Linear>> {
        self.inner
            .take_linears(module, count, rows, cols)?
            .into_iter()
            .map(|w| mlx_linear(module, w))
            .collect()
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.inner.finish()
    }

    fn norms_are_shifted(&self) -> bool {
        true
    }
}
