//! The CPU backend's settings from the environment, read in one place.

use anyhow::{Result, bail};

use crate::Numerics;
use crate::quant::{InputParts, int8_available};

/// What `LILY_CPU_NUMERICS` chooses: `f32` (the default), `int8` or `int8x2` (the inputs of
/// quantised products rounded to one or two int8 parts, [`Numerics::Int8Inputs`]).
/// `LILY_CPU_THREADS`, the size of the process's one team of threads, is checked here too, so a
/// bad value stops the CLI before anything runs; the team reads it through [`threads`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuOptions {
    pub numerics: Numerics,
}

impl CpuOptions {
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The defaults with the overrides `var` gives (a variable's value by name).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut o = CpuOptions::default();
        threads_from(&var)?;
        if let Some(v) = var("LILY_CPU_NUMERICS") {
            let parts = match v.as_str() {
                "f32" => None,
                "int8" => Some(InputParts::One),
                "int8x2" => Some(InputParts::Two),
                _ => bail!("LILY_CPU_NUMERICS={v:?}: expected f32, int8 or int8x2"),
            };
            o.numerics = match parts {
                None => Numerics::F32,
                Some(parts) if int8_available() => Numerics::Int8Inputs(parts),
                Some(_) => bail!(
                    "LILY_CPU_NUMERICS={v} needs AVX2 or AVX-512 VNNI, which this CPU does not report"
                ),
            };
        }
        Ok(o)
    }
}

/// Threads in the backend's team: `LILY_CPU_THREADS`, else one a logical CPU (a bad value,
/// which [`CpuOptions::from_env`] refuses, counts as unset).
pub(crate) fn threads() -> usize {
    threads_from(&|name| std::env::var(name).ok())
        .ok()
        .flatten()
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn threads_from(var: &impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    let Some(v) = var("LILY_CPU_THREADS") else {
        return Ok(None);
    };
    match v.parse::<usize>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(Some(n)),
        _ => bail!("LILY_CPU_THREADS={v:?}: expected a count of threads from 1 to 1024"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_chooses_the_numerics_and_bad_values_are_refused() {
        let of = |v: &str| {
            CpuOptions::from_vars(|name| (name == "LILY_CPU_NUMERICS").then(|| v.to_string()))
        };
        assert_eq!(
            CpuOptions::from_vars(|_| None).unwrap().numerics,
            Numerics::F32
        );
        assert_eq!(of("f32").unwrap().numerics, Numerics::F32);
        for (v, parts) in [("int8", InputParts::One), ("int8x2", InputParts::Two)] {
            match of(v) {
                Ok(o) => assert_eq!(o.numerics, Numerics::Int8Inputs(parts)),
                Err(e) => assert!(!int8_available() && e.to_string().contains("AVX2"), "{e}"),
            }
        }
        let err = of("fast").unwrap_err().to_string();
        assert!(err.contains("expected f32, int8 or int8x2"), "{err}");
    }

    #[test]
    fn the_thread_count_is_checked() {
        let threads = |v: &str| {
            let v = v.to_string();
            threads_from(&move |name: &str| (name == "LILY_CPU_THREADS").then(|| v.clone()))
        };
        assert_eq!(threads("12").unwrap(), Some(12));
        assert_eq!(threads_from(&|_: &str| None).unwrap(), None);
        for bad in ["0", "-3", "many", "", "100000"] {
            let err = threads(bad).unwrap_err().to_string();
            assert!(err.contains("LILY_CPU_THREADS"), "{err}");
            let cli =
                CpuOptions::from_vars(|name| (name == "LILY_CPU_THREADS").then(|| bad.into()));
            assert!(cli.is_err(), "{bad}");
        }
    }
}
