//! Choosing a device and loading the model onto it.

use anyhow::{Result, bail};
use clap::ValueEnum;
use lily_core::load::load_weights;
use lily_core::model_ref::ModelRef;
use lily_cpu::CpuBackend;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA if a GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// Loads `model` for the CPU backend (the only one built so far).
pub fn load_cpu(model: &str, device: Device) -> Result<CpuBackend> {
    load_cpu_with(model, device, false)
}

/// As [`load_cpu`]; `quantize` makes MLX 4-bit weights of a bf16/f32 checkpoint (`--quantize q4`).
pub fn load_cpu_with(model: &str, device: Device, quantize: bool) -> Result<CpuBackend> {
    if device == Device::Cuda {
        bail!("--device cuda: this build has no CUDA backend yet; use --device cpu");
    }
    let model = ModelRef::parse(model)?;
    // Refuses, naming the sizes, when the weights (f32, or MLX 4-bit) do not fit in memory.
    let (config, weights) = load_weights(&model, quantize, |s, _| s)?;
    Ok(CpuBackend::new(config, weights))
}
