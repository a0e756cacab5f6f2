//! Choosing a device and loading the model onto it.

use anyhow::{Result, bail};
use clap::ValueEnum;
use lily_core::load::load_weights;
use lily_cpu::CpuBackend;

use crate::progress::LoadBar;

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
    let model = crate::cmd::pull::resolve_model(model)?;
    // Refuses, naming the sizes, when the weights (f32, or MLX 4-bit) do not fit in memory.
    let (config, weights) = load_weights(&model, quantize, LoadBar::wrap)?;
    Ok(CpuBackend::new(config, weights))
}

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
