//! Choosing a device and loading the model onto it.

use anyhow::{Result, bail};
use clap::ValueEnum;
use lily_core::weights::ModelWeights;
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
    if device == Device::Cuda {
        bail!("--device cuda: this build has no CUDA backend yet; use --device cpu");
    }
    let model = crate::cmd::pull::resolve_model(model)?;
    let (config, source) = model.open()?;
    // The CPU backend holds every weight as f32.
    let needed = config.param_count().total * 4;
    if let Some(available) = available_memory()
        && needed > available
    {
        bail!(
            "{} needs {:.1} GB for its f32 weights on the CPU, but only {:.1} GB of memory \
                 is available",
            model.display_name(),
            needed as f64 / 1e9,
            available as f64 / 1e9
        );
    }
    let weights = ModelWeights::load(&config, LoadBar::wrap(source, &config))?;
    Ok(CpuBackend::new(config, weights))
}

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
