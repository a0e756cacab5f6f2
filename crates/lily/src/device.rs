//! Choosing a device and loading the model onto it.

use anyhow::Result;
use clap::ValueEnum;
use lily_core::load::load_weights;
use lily_core::model_ref::{ModelRef, SYNTHETIC_SEED};
use lily_cpu::{CpuBackend, CpuOptions};
use lily_cuda::synthetic::SyntheticWeights;
use lily_cuda::{CudaBackend, CudaOptions};

use crate::backends::AnyBackend;
use crate::progress::LoadBar;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA if a GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// Loads `model` onto the chosen device (`auto`: the GPU when one is present); `quantize` makes
/// MLX 4-bit weights of a bf16/f32 checkpoint (`--quantize q4`).
pub fn load_with(model: &str, device: Device, quantize: bool) -> Result<AnyBackend> {
    let use_cuda = match device {
        Device::Cuda => true,
        Device::Cpu => false,
        Device::Auto => lily_cuda::gpu_available(),
    };
    let model = crate::cmd::pull::resolve_model(model)?;
    if use_cuda {
        let options = CudaOptions::from_env()?;
        let backend = match &model {
            // Synthetic weights are made on the GPU, where they live: the host makes only the
            // small tensors. (`--quantize` rounds those to bf16, so it takes the host path.)
            ModelRef::Synthetic(_) if !quantize => {
                let mut source = SyntheticWeights::new(SYNTHETIC_SEED);
                CudaBackend::from_source(model.config()?, &mut source, &options)?
            }
            _ => {
                // Made in host memory first, then uploaded; this checks they fit there.
                let (config, weights) = load_weights(&model, quantize, LoadBar::wrap)?;
                CudaBackend::with_options(config, &weights, &options)?
            }
        };
        return Ok(AnyBackend::Cuda(Box::new(backend)));
    }
    // Read before the weights load: a bad setting fails at once, not after a minute.
    let options = CpuOptions::from_env()?;
    let (config, weights) = load_weights(&model, quantize, LoadBar::wrap)?;
    let backend = CpuBackend::new(config, weights).with_options(&options);
    Ok(AnyBackend::Cpu(Box::new(backend)))
}

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
