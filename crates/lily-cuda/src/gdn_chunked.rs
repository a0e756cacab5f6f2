//! Launchers for kernels/gdn_chunked.cu: the chunked (WY) form of the Gated DeltaNet delta rule
//! over a prefill chunk, `GdnPrefillRoute::Chunked` of gdn_prefill.rs, which chooses the route and
//! runs `gdn_scan_prep` before it. 64-token sub-chunks, products on tensor cores as 3xTF32.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gpu::{Gpu, Shape};
use crate::kernel_args::{GdnChunkPrep, GdnChunkScan};

/// Tokens per chunk (GDNC_C in the kernel file).
const CHUNK: usize = 64;
/// Warps per block of both chunked kernels (GDNC_WARPS).
const CHUNK_WARPS: usize = 8;

/// State columns per `gdn_chunk_scan` block (GDNC_COLS).
fn chunk_columns(dv: usize) -> usize {
    [32, 16]
        .into_iter()
        .find(|&n| dv.is_multiple_of(n))
        .unwrap_or(8)
}

/// Floats `gdn_chunk_prep` leaves per (value head, chunk): W `[C, DK]`, Tβ and P `[C, C]`, e^γ
/// and e^{γ_C − γ} `[C]` (GDNC_FLOATS).
fn chunk_floats(dk: usize) -> usize {
    CHUNK * dk + 2 * CHUNK * CHUNK + 2 * CHUNK
}

/// Dynamic shared memory of `gdn_chunk_prep` and `gdn_chunk_scan` in bytes (GDNC_PREP_SHARED,
/// GDNC_SCAN_SHARED): the prep's rows padded by 4 floats, the scan's (S, V, V' and the scaled
/// V', its A operands living in registers) by 8.
fn chunk_shared_bytes(dk: usize, dv: usize) -> (usize, usize) {
    let (ldk, ldc, ldb) = (dk + 4, CHUNK + 4, chunk_columns(dv) + 8);
    let prep = 2 * CHUNK * ldk + 2 * CHUNK * ldc + 3 * CHUNK;
    let scan = (dk + 3 * CHUNK) * ldb;
    (4 * prep, 4 * scan)
}

/// Whether the chunked route's kernels suit the model's GDN heads on a device allowing
/// `max_shared` bytes of shared memory per block.
pub fn fits(c: &ModelConfig, max_shared: usize) -> Result<()> {
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    ensure!(
        dk.is_multiple_of(16) && dv.is_multiple_of(8),
        "the chunked GDN route needs DK a multiple of 16 and DV of 8, not {dk} and {dv}"
    );
    let (prep, scan) = chunk_shared_bytes(dk, dv);
    ensure!(
        prep.max(scan) <= max_shared,
        "the chunked GDN route needs {} bytes of shared memory per block, above {max_shared}",
        prep.max(scan)
    );
    Ok(())
}

/// The chunked kernels and their dynamic shared memory, for `Gpu::new` to raise their limit
/// (none where the route does not fit the model or the device's `max_shared`).
pub fn dynamic_shared(c: &ModelConfig, max_shared: usize) -> Vec<(String, u32)> {
    if fits(c, max_shared).is_err() {
        return Vec::new();
    }
    let (prep, scan) = chunk_shared_bytes(c.linear_key_head_dim, c.linear_value_head_dim);
    vec![
        ("gdn_chunk_prep".to_string(), prep as u32),
        ("gdn_chunk_scan".to_string(), scan as u32),
    ]
}

/// Floats `gdn_chunk_prep` leaves for a chunk of `t` tokens: `[NV, ⌈t/64⌉]` blocks of
/// [`chunk_floats`] (32 MiB per 1,024 tokens at the production heads).
pub fn scratch_floats(c: &ModelConfig, t: usize) -> usize {
    t.div_ceil(CHUNK) * c.linear_num_value_heads * chunk_floats(c.linear_key_head_dim)
}

/// The delta rule over `t` tokens from `gdn_scan_prep`'s output `prep`: `out` (`[t, NV·DV]`)
/// gets each token's read-out and `state` (`[NV, DK, DV]`) ends as after the chunk. `scratch`
/// holds [`scratch_floats`] floats, 16-byte aligned. The caller has checked [`fits`].
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    gpu: &Gpu,
    c: &ModelConfig,
    conv: u64,
    prep: u64,
    scratch: u64,
    t: usize,
    state: u64,
    out: u64,
) -> Result<()> {
    let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
    let (prep_shared, scan_shared) = chunk_shared_bytes(c.linear_key_head_dim, dv);
    let threads = (CHUNK_WARPS * 32) as u32;
    let shape = Shape {
        grid: (t.div_ceil(CHUNK) as u32, nv as u32, 1),
        block: threads,
    };
    gpu.launch_shared(
        "gdn_chunk_prep",
        shape,
        prep_shared as u32,
        &GdnChunkPrep {
            prep,
            t: t as i32,
            scratch,
        },
    )?;
    let shape = Shape {
        grid: ((dv / chunk_columns(dv)) as u32, nv as u32, 1),
        block: threads,
    };
    gpu.launch_shared(
        "gdn_chunk_scan",
        shape,
        scan_shared as u32,
        &GdnChunkScan {
            conv,
            prep,
            scratch,
            t: t as i32,
            state,
            out,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::config::QWEN36_35B_A3B_CONFIG;

    #[test]
    fn the_chunked_route_fits_the_production_heads() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        // GDNC_PREP_SHARED and GDNC_SCAN_SHARED at DK = DV = 128 (32 columns per block).
        assert_eq!(chunk_shared_bytes(128, 128), (103_168, 51_200));
        assert_eq!(chunk_columns(128), 32);
        // H200: 227 KiB per block opted in, A100: 163 KiB; the prep's 101 KiB fits both.
        fits(&c, 227 * 1024).unwrap();
        fits(&c, 163 * 1024).unwrap();
        assert!(fits(&c, 100 * 1024).is_err());
        assert!(dynamic_shared(&c, 100 * 1024).is_empty());
        assert_eq!(dynamic_shared(&c, 163 * 1024).len(), 2);
        let mut odd = c.clone();
        odd.linear_key_head_dim = 24;
        assert!(fits(&odd, usize::MAX).is_err());
        let mut narrow = c.clone();
        narrow.linear_value_head_dim = 16;
        fits(&narrow, usize::MAX).unwrap();
        narrow.linear_value_head_dim = 12;
        assert!(fits(&narrow, usize::MAX).is_err());
        for t in [1usize, 63, 64, 65, 4096] {
            let blocks = t.div_ceil(64) * 32;
            assert_eq!(
                scratch_floats(&c, t),
                blocks * (64 * 128 + 2 * 64 * 64 + 2 * 64)
            );
        }
    }
}
