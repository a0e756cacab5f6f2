//! Writes the PTX of every CUDA kernel file as the backend compiles it for a model, without a
//! GPU (NVRTC only), for tools/sass.sh to assemble and disassemble:
//!
//!     cargo run --release -p lily-cuda --example kernel_ptx -- qwen3.6-35b-a3b sm_90 OUT_DIR
//!
//! The model is a synthetic configuration's name (lily_core::synthetic); the KV cache is bf16, as
//! in production.

use anyhow::{Context, Result, bail};
use lily_core::synthetic::synthetic_config;
use lily_cuda::compile::{KvPrecision, compile_all};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, arch, out] = args.as_slice() else {
        bail!("usage: kernel_ptx MODEL ARCH OUT_DIR (e.g. qwen3.6-35b-a3b sm_90 /tmp/ptx)");
    };
    let config = synthetic_config(model)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {out}"))?;
    for (file, target, ptx) in compile_all(&config, KvPrecision::Bf16, arch, false)? {
        let path = std::path::Path::new(out).join(format!("{}.{target}.ptx", file.name));
        std::fs::write(&path, ptx.to_src())
            .with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(())
}
