//! The memory of the devices on this machine: the host's `MemAvailable`, and each NVIDIA GPU
//! as `nvidia-smi` reports it (asked as a separate program, so inspecting needs no CUDA
//! library and works on machines without a GPU).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::device::available_memory;

/// `nvidia-smi` that has not answered by then is treated as absent (a wedged driver).
const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(10);

/// Which backend runs on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// `cpu` or `cuda:N`.
    pub id: String,
    pub name: String,
    pub backend: BackendKind,
    /// What can be allocated now: `MemAvailable`, or the GPU's free memory.
    pub available: u64,
    pub total: Option<u64>,
}

/// The devices found, and a note when no GPU was (saying why).
pub fn detect() -> (Vec<DeviceMemory>, Option<String>) {
    let mut devices = Vec::new();
    if let Some(available) = available_memory() {
        devices.push(DeviceMemory {
            id: "cpu".to_string(),
            name: "host memory".to_string(),
            backend: BackendKind::Cpu,
            available,
            total: None,
        });
    }
    match query_nvidia_smi().and_then(|out| parse_nvidia_smi(&out)) {
        Ok(gpus) if gpus.is_empty() => (devices, Some("nvidia-smi lists no GPU".to_string())),
        Ok(gpus) => {
            devices.extend(gpus);
            (devices, None)
        }
        Err(why) => (devices, Some(format!("no NVIDIA GPU found: {why}"))),
    }
}

/// Runs `nvidia-smi --query-gpu=name,memory.total,memory.free`, bounded in time.
fn query_nvidia_smi() -> Result<String, String> {
    let mut child = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,memory.total,memory.free",
            "--format=csv,noheader,nounits",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => "nvidia-smi is not installed".to_string(),
            _ => format!("cannot run nvidia-smi: {e}"),
        })?;
    let deadline = Instant::now() + NVIDIA_SMI_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "nvidia-smi did not answer within {} s",
                    NVIDIA_SMI_TIMEOUT.as_secs()
                ));
            }
            Err(e) => return Err(format!("cannot wait for nvidia-smi: {e}")),
        }
    };
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        stdout
            .read_to_string(&mut out)
            .map_err(|e| format!("cannot read nvidia-smi's answer: {e}"))?;
    }
    if !status.success() {
        return Err(format!("nvidia-smi failed ({status})"));
    }
    Ok(out)
}

/// Reads lines of `name, total MiB, free MiB` (a name may itself contain commas).
fn parse_nvidia_smi(text: &str) -> Result<Vec<DeviceMemory>, String> {
    let mib = |field: &str| -> Result<u64, String> {
        field
            .trim()
            .parse::<u64>()
            .map(|m| m << 20)
            .map_err(|_| format!("nvidia-smi printed {field:?} where a size in MiB belongs"))
    };
    let mut gpus = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut fields = line.rsplitn(3, ',');
        let (Some(free), Some(total), Some(name)) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(format!("cannot read nvidia-smi's line {line:?}"));
        };
        gpus.push(DeviceMemory {
            id: format!("cuda:{}", gpus.len()),
            name: name.trim().to_string(),
            backend: BackendKind::Cuda,
            available: mib(free)?,
            total: Some(mib(total)?),
        });
    }
    Ok(gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nvidia_smi_as_it_prints_on_an_h200() {
        // Captured from the H200 this project measures on.
        let gpus = parse_nvidia_smi("NVIDIA H200, 143771, 143156\n").unwrap();
        assert_eq!(
            gpus,
            vec![DeviceMemory {
                id: "cuda:0".to_string(),
                name: "NVIDIA H200".to_string(),
                backend: BackendKind::Cuda,
                available: 143_156 << 20,
                total: Some(143_771 << 20),
            }]
        );
        let two = parse_nvidia_smi("A, B card, 24564, 100\nNVIDIA H200, 143771, 143156\n").unwrap();
        assert_eq!(two[0].name, "A, B card");
        assert_eq!(two[1].id, "cuda:1");
        assert!(parse_nvidia_smi("NVIDIA H200, [N/A], 1\n").is_err());
        assert!(parse_nvidia_smi("garbage\n").is_err());
        assert!(parse_nvidia_smi("").unwrap().is_empty());
    }
}
