//! Every choice of the CUDA backend that a user or a test may override, in one struct. The
//! defaults are the measured best on the H200; environment variables are overrides only, read
//! here and nowhere else, and a bad value is an error that names the variable.

use anyhow::{Result, bail};

use crate::compile::KvPrecision;
use crate::decode::DecodePath;
use crate::gdn_prefill::GdnPrefillRoute;
use crate::gemm_grouped::GateUpRoute;
use crate::gemm_wgmma::GemmPath;

/// The kernels of the graph decode step's 4-bit products (gemv.rs, step.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernels {
    /// bf16 `mma.sync` with x in three exact bf16 parts (kernels/gemv_mma.cuh) for the dense
    /// GEMVs, f32 FMAs for the router and the experts: the measured default.
    Mma,
    /// The integer tensor cores (kernels/gemv_imma.cuh, moe_imma.cuh): 4-bit codes as u8, x in
    /// four s8 parts, for the dense GEMVs, the router and the experts, with the Gated DeltaNet's
    /// conv and gated norm fused into its projections.
    Imma,
}

/// Tokens per prefill chunk unless told otherwise. Measured on the H200 (a 4K prompt of the
/// full-size model): chunks of 1,024, 2,048 and 4,096 tokens gave 12.4K, 15.0K and 16.2K tok/s;
/// longer chunks fill more of each expert's 64-row GEMM tiles. A 4,096-token chunk's activations
/// take about 1.3 GB at the real shapes.
pub const DEFAULT_PREFILL_CHUNK: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// How the KV cache stores keys and values (`LILY_KV_CACHE=bf16|f32`).
    pub kv: KvPrecision,
    /// Tokens per prefill chunk (`LILY_PREFILL_CHUNK=N`).
    pub prefill_chunk: usize,
    /// How a decode step runs (`LILY_DECODE=graph|persistent`).
    pub decode: DecodePath,
    /// Which tensor cores the graph step's 4-bit products run on (`LILY_DECODE_KERNELS=mma|imma`).
    pub decode_kernels: DecodeKernels,
    /// Programmatic dependent launch in the graph step, where the GPU has it (`LILY_PDL=0|1`).
    pub pdl: bool,
    /// The kernels of the 4-bit prefill GEMMs; None: the GPU's fastest (`LILY_GEMM=mma|wgmma`).
    pub gemm: Option<GemmPath>,
    /// One GDN prefill route for every chunk; None: chosen by chunk length
    /// (`LILY_GDN_PREFILL=scan|chunked`).
    pub gdn_prefill: Option<GdnPrefillRoute>,
    /// The routed experts' gate and up projections in prefill, where the wgmma kernels take them
    /// (`LILY_GATE_UP=split|fused`).
    pub gate_up: GateUpRoute,
    /// Kernels compiled to timestamp every block's wait, for `lily bench`'s in-graph breakdown of
    /// a decode step (stamps.rs; `LILY_STAMPS=0|1`).
    pub stamps: bool,
    /// Graph steps queued one ahead of the host where the caller allows it
    /// (`DecodeRow::queue_next`; queued.rs; `LILY_QUEUE_STEPS=0|1`).
    pub queue_steps: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            kv: KvPrecision::Bf16,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            // The graph stays the default while it is the faster (docs/BENCHMARKS.md).
            decode: DecodePath::Graph,
            // The bf16 kernels stay the default until the integer ones are measured on the GPU
            // in this form (docs/BENCHMARKS.md, 2026-12-05).
            decode_kernels: DecodeKernels::Mma,
            pdl: true,
            gemm: None,
            gdn_prefill: None,
            // Fused measured +3.5 % prefill at 4K on an H100 (docs/BENCHMARKS.md, sixteenth session).
            gate_up: GateUpRoute::Fused,
            stamps: false,
            // Off until it has run correctly on a GPU beside the plain path (docs/BENCHMARKS.md,
            // twenty-third session).
            queue_steps: false,
        }
    }
}

impl CudaOptions {
    /// The defaults with the environment's overrides.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The defaults with the overrides `var` gives (a variable's value by name).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut o = CudaOptions::default();
        // A variable naming one of a setting's values: that value, else an error naming both.
        let pick = |name: &str, values: &[&str]| -> Result<Option<usize>> {
            let Some(v) = var(name) else { return Ok(None) };
            match values.iter().position(|&x| x == v) {
                Some(i) => Ok(Some(i)),
                None => bail!("{name}={v:?}: expected {}", values.join(" or ")),
            }
        };
        if let Some(i) = pick("LILY_KV_CACHE", &["bf16", "f32"])? {
            o.kv = [KvPrecision::Bf16, KvPrecision::F32][i];
        }
        if let Some(v) = var("LILY_PREFILL_CHUNK") {
            o.prefill_chunk = match v.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => bail!("LILY_PREFILL_CHUNK={v:?}: expected a positive number of tokens"),
            };
        }
        if let Some(i) = pick("LILY_DECODE", &["graph", "persistent"])? {
            o.decode = [DecodePath::Graph, DecodePath::Persistent][i];
        }
        if let Some(i) = pick("LILY_DECODE_KERNELS", &["mma", "imma"])? {
            o.decode_kernels = [DecodeKernels::Mma, DecodeKernels::Imma][i];
        }
        if let Some(i) = pick("LILY_PDL", &["0", "1"])? {
            o.pdl = i == 1;
        }
        if let Some(i) = pick("LILY_STAMPS", &["0", "1"])? {
            o.stamps = i == 1;
        }
        if let Some(i) = pick("LILY_QUEUE_STEPS", &["0", "1"])? {
            o.queue_steps = i == 1;
        }
        if let Some(i) = pick("LILY_GEMM", &["mma", "wgmma"])? {
            o.gemm = Some([GemmPath::MmaSync, GemmPath::Wgmma][i]);
        }
        if let Some(i) = pick("LILY_GDN_PREFILL", &["scan", "chunked"])? {
            o.gdn_prefill = Some([GdnPrefillRoute::Scan, GdnPrefillRoute::Chunked][i]);
        }
        if let Some(i) = pick("LILY_GATE_UP", &["split", "fused"])? {
            o.gate_up = [GateUpRoute::Split, GateUpRoute::Fused][i];
        }
        Ok(o)
    }

    /// These options with the KV cache stored as `kv`.
    pub fn with_kv(self, kv: KvPrecision) -> Self {
        CudaOptions { kv, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn no_variables_give_the_defaults_and_each_variable_overrides_its_field() {
        assert_eq!(
            CudaOptions::from_vars(vars(&[])).unwrap(),
            CudaOptions::default()
        );
        let o = CudaOptions::from_vars(vars(&[
            ("LILY_KV_CACHE", "f32"),
            ("LILY_PREFILL_CHUNK", "512"),
            ("LILY_DECODE", "persistent"),
            ("LILY_DECODE_KERNELS", "imma"),
            ("LILY_PDL", "0"),
            ("LILY_GEMM", "mma"),
            ("LILY_GDN_PREFILL", "scan"),
            ("LILY_STAMPS", "1"),
            ("LILY_GATE_UP", "split"),
            ("LILY_QUEUE_STEPS", "1"),
        ]))
        .unwrap();
        let want = CudaOptions {
            kv: KvPrecision::F32,
            prefill_chunk: 512,
            decode: DecodePath::Persistent,
            decode_kernels: DecodeKernels::Imma,
            pdl: false,
            gemm: Some(GemmPath::MmaSync),
            gdn_prefill: Some(GdnPrefillRoute::Scan),
            gate_up: GateUpRoute::Split,
            stamps: true,
            queue_steps: true,
        };
        assert_eq!(o, want);
    }

    #[test]
    fn a_bad_value_is_refused_naming_its_variable() {
        for (name, value) in [
            ("LILY_KV_CACHE", "fp8"),
            ("LILY_PREFILL_CHUNK", "0"),
            ("LILY_PREFILL_CHUNK", "many"),
            ("LILY_DECODE", "fast"),
            ("LILY_DECODE_KERNELS", "wmma"),
            ("LILY_PDL", "yes"),
            ("LILY_GEMM", "cublas"),
            ("LILY_GDN_PREFILL", "wy"),
            ("LILY_STAMPS", "on"),
            ("LILY_GATE_UP", "both"),
            ("LILY_QUEUE_STEPS", "ahead"),
        ] {
            let err = CudaOptions::from_vars(vars(&[(name, value)])).unwrap_err();
            let text = format!("{err:#}");
            assert!(
                text.contains(name) && text.contains(value),
                "{name}={value}: {text}"
            );
        }
    }
}
