//! Synthetic weights made on the device (kernels/synthetic.cu). Every quantised matrix is written
//! where it lives, bit-identical to what `lily_core::synthetic` makes on the host, so the
//! full-size synthetic model needs neither its ~18 GB on the host nor the upload. The small
//! tensors (norms, conv taps, A_log, dt_bias, linears too narrow to quantise) come from the host
//! generator itself and are uploaded: a few megabytes.

use anyhow::{Context, Result, ensure};
use cudarc::driver::CudaSlice;
use lily_core::config::ModelConfig;
use lily_core::plan::{Storage, TensorGroup};
use lily_core::quant::DEFAULT_GROUP_SIZE;
use lily_core::source::TensorSource;
use lily_core::synthetic::{QuantStream, SyntheticSource};
use lily_core::weights::offset_norm;

use crate::gpu::Gpu;
use crate::kernel_args::SyntheticQuant;
use crate::launch;
use crate::mat::DeviceMat;
use crate::weights::WeightSource;

/// Threads of a `synthetic_quant` block.
const THREADS: usize = 256;
/// Most blocks of a launch; the kernel strides over the rest (the full-size embedding table is
/// 64 M words).
const MAX_BLOCKS: usize = 8192;

/// Writes `rows × cols` of `stream` on the device: a whole expert stack when `rows` counts every
/// expert's rows (the stream's indices run over the stack, as [`DeviceMat::stack`] lays it out).
pub fn generate(gpu: &Gpu, stream: &QuantStream, rows: usize, cols: usize) -> Result<DeviceMat> {
    let group = DEFAULT_GROUP_SIZE;
    ensure!(
        cols.is_multiple_of(group),
        "{cols} columns do not divide into quantisation groups of {group}"
    );
    let words = rows * cols * stream.bits as usize / 32;
    let m = DeviceMat::zeros(gpu, stream.bits, rows, cols, group)?;
    let a = m.arg(gpu);
    let blocks = words.div_ceil(THREADS).clamp(1, MAX_BLOCKS) as u32;
    let count = |n: usize| {
        i32::try_from(n).with_context(|| format!("a {rows}x{cols} matrix is too large to generate"))
    };
    // Keys are u64 kernel arguments, passed as the 64-bit `Ptr` kind.
    let args = SyntheticQuant {
        w: a.w,
        scales: a.scales,
        biases: a.biases,
        words: count(words)?,
        groups: count(rows * cols / group)?,
        code_key: stream.code_key,
        scale_key: stream.scale_key,
        c: stream.scale,
        bits: stream.bits as i32,
    };
    launch!(gpu, "synthetic_quant", (blocks, 1, 1), THREADS as u32, args);
    Ok(m)
}

/// A synthetic model's weights: quantised matrices made on the device, the rest on the host.
pub struct SyntheticWeights {
    src: SyntheticSource,
}

impl SyntheticWeights {
    pub fn new(seed: u64) -> Self {
        SyntheticWeights {
            src: SyntheticSource::new(seed),
        }
    }
}

/// Device bytes of one group of tensors as the synthetic model makes them: MLX codes with a bf16
/// scale and bias per group where mlx-lm quantises, f32 elsewhere.
fn group_bytes(g: &TensorGroup) -> u64 {
    let (n, group) = (g.rows * g.cols * g.count, DEFAULT_GROUP_SIZE as u64);
    let bits = match g.storage {
        _ if !g.cols.is_multiple_of(group) => return n * 4,
        Storage::Plain => return n * 4,
        Storage::Quantised => 4,
        Storage::Quantised8 => 8,
    };
    n * bits / 8 + n / group * 4
}

impl WeightSource for SyntheticWeights {
    fn device_bytes(&self, c: &ModelConfig) -> usize {
        let mut total: u64 = c.tensor_inventory().iter().map(group_bytes).sum();
        // The inventory counts a tied lm_head once, as the embedding; the synthetic model makes
        // its own lm_head either way.
        if c.tie_word_embeddings {
            total += group_bytes(&TensorGroup {
                rows: c.vocab_size as u64,
                cols: c.hidden_size as u64,
                count: 1,
                active: 1,
                storage: Storage::Quantised,
            });
        }
        total as usize
    }

    fn mat(
        &mut self,
        gpu: &Gpu,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMat> {
        match self.src.quant_stream(module, cols) {
            Some(stream) => generate(gpu, &stream, count * rows, cols),
            None => {
                let parts = self.src.take_linears(module, count, rows, cols)?;
                DeviceMat::stack(gpu, &parts.iter().collect::<Vec<_>>())
            }
        }
    }

    fn norm(&mut self, gpu: &Gpu, name: &str, len: usize) -> Result<CudaSlice<f32>> {
        gpu.upload(&offset_norm(&mut self.src, name, len)?)
    }

    fn floats(&mut self, gpu: &Gpu, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>> {
        gpu.upload(&self.src.take_f32(name, shape)?)
    }
}
