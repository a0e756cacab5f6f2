//! Loading a model's weights into host memory: choosing their format, checking they fit, and
//! quantising a bf16/f32 checkpoint on the way in when asked (`--quantize q4`).

use anyhow::{Result, bail};

use crate::config::ModelConfig;
use crate::mlx::QuantizationConfig;
use crate::model_ref::ModelRef;
use crate::quantize::QuantizingSource;
use crate::source::TensorSource;
use crate::weights::ModelWeights;

/// How the loaded linear weights are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// f32: a bf16 or f32 checkpoint as it is (the reference path).
    F32,
    /// MLX affine 4-bit (8-bit router and shared-expert gate): MLX checkpoints, synthetic
    /// models, and checkpoints quantised at load.
    Mlx,
}

/// Memory left free beyond the weights, for activations, states and the rest of the process.
const HEADROOM: u64 = 1 << 30;

/// The format `model` loads in; `quantize` asks for MLX 4-bit from a bf16/f32 checkpoint.
pub fn weight_format(model: &ModelRef, quantize: bool) -> Result<WeightFormat> {
    Ok(match model {
        ModelRef::Synthetic(_) => WeightFormat::Mlx,
        ModelRef::Dir(dir) if quantize || QuantizationConfig::from_dir(dir)?.is_quantised() => {
            WeightFormat::Mlx
        }
        ModelRef::Dir(_) => WeightFormat::F32,
    })
}

/// Host bytes of the loaded weights.
pub fn weight_bytes(config: &ModelConfig, format: WeightFormat) -> u64 {
    match format {
        WeightFormat::F32 => config.param_count().total * 4,
        WeightFormat::Mlx => config.weight_bytes().q4,
    }
}

/// Fails with a clear message unless `needed` bytes of weights fit in `available` bytes (with
/// headroom); `available` is `None` where the system does not say.
pub fn check_fits(
    name: &str,
    format: WeightFormat,
    needed: u64,
    available: Option<u64>,
) -> Result<()> {
    let Some(available) = available else {
        return Ok(());
    };
    if needed + HEADROOM > available {
        let what = match format {
            WeightFormat::F32 => "f32",
            WeightFormat::Mlx => "4-bit",
        };
        bail!(
            "{name} needs {:.1} GB for its {what} weights (plus {:.1} GB to run), but only \
             {:.1} GB of memory is available",
            needed as f64 / 1e9,
            HEADROOM as f64 / 1e9,
            available as f64 / 1e9
        );
    }
    Ok(())
}

/// An f32 load that does not fit is told what would: 4-bit weights, made at load by the
/// command's `--quantize q4` or written once by `lily quantize`.
fn with_quantize_hint(
    error: anyhow::Error,
    name: &str,
    config: &ModelConfig,
    format: WeightFormat,
) -> anyhow::Error {
    if format != WeightFormat::F32 {
        return error;
    }
    let q4 = weight_bytes(config, WeightFormat::Mlx) as f64 / 1e9;
    anyhow::anyhow!(
        "{error}; add --quantize q4 to load it as 4-bit weights ({q4:.1} GB), or write them once \
         with `lily quantize --model {name} --out DIR`"
    )
}

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Loads `model`'s config and weights after checking that they fit in this machine's memory;
/// `wrap` sees the tensor source first (a progress bar).
pub fn load_weights(
    model: &ModelRef,
    quantize: bool,
    wrap: impl FnOnce(Box<dyn TensorSource>, &ModelConfig) -> Box<dyn TensorSource>,
) -> Result<(ModelConfig, ModelWeights)> {
    let format = weight_format(model, quantize)?;
    let (config, source) = model.open()?;
    let needed = weight_bytes(&config, format);
    let name = model.display_name();
    check_fits(&name, format, needed, available_memory())
        .map_err(|e| with_quantize_hint(e, &name, &config, format))?;
    let source = if quantize {
        Box::new(QuantizingSource::new(source))
    } else {
        source
    };
    let weights = ModelWeights::load(&config, wrap(source, &config))?;
    Ok((config, weights))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::synthetic_config;

    #[test]
    fn the_full_model_needs_its_4_bit_bytes_and_a_short_machine_refuses_it() {
        let config = synthetic_config("qwen3.6-35b-a3b").unwrap();
        let model = ModelRef::parse("synthetic:qwen3.6-35b-a3b").unwrap();
        let format = weight_format(&model, false).unwrap();
        assert_eq!(format, WeightFormat::Mlx);
        let needed = weight_bytes(&config, format);
        assert!((needed as f64 / 1e9 - 19.51).abs() < 0.01, "{needed}");
        let err = check_fits("synthetic:qwen3.6-35b-a3b", format, needed, Some(16 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("19.5 GB for its 4-bit weights") && err.contains("17.2 GB"),
            "{err}"
        );
        check_fits("x", format, needed, Some(128 << 30)).unwrap();
        check_fits("x", format, needed, None).unwrap();
        let f32 = weight_bytes(&config, WeightFormat::F32);
        assert_eq!(f32, 4 * 34_660_610_688);
        // An f32 load that does not fit names the flag that makes it fit.
        let err = check_fits("big", WeightFormat::F32, f32, Some(64 << 30)).unwrap_err();
        let err = with_quantize_hint(err, "big", &config, WeightFormat::F32).to_string();
        assert!(
            err.contains("138.6 GB for its f32 weights")
                && err.contains("--quantize q4 to load it as 4-bit weights (19.5 GB)")
                && err.contains("lily quantize --model big"),
            "{err}"
        );
    }

    #[test]
    fn mlx_directories_load_as_mlx_and_hf_ones_as_f32_unless_asked() {
        let dir = |n: &str| {
            ModelRef::Dir(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../tests/fixtures")
                    .join(n),
            )
        };
        let f = |m: &ModelRef, q| weight_format(m, q).unwrap();
        assert_eq!(f(&dir("tiny-mlx-q4"), false), WeightFormat::Mlx);
        assert_eq!(f(&dir("tiny-mlx-hf"), false), WeightFormat::F32);
        assert_eq!(f(&dir("tiny-mlx-hf"), true), WeightFormat::Mlx);
    }
}
