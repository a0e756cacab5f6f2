//! Launchers for kernels/attention_prefill.cu: gated attention over a chunk of tokens.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gemm::GemmX;
use crate::gpu::{Gpu, Shape};
use crate::kernel_args::{AttnPrefill, AttnPrepRows};
use crate::launch;

/// Cache positions per K or V tile of the flash kernel (FA_KEYS in the kernel file). The tile
/// is where the running softmax max moves, so it decides where P is rounded to bf16.
pub const KEY_TILE: usize = 64;

/// A block shape of the flash kernel: query vectors per block (16 per warp) and slots of its
/// K/V ring, each one K or one V tile. All shapes give the same results; they differ in the
/// shared memory they need ([`AttnBlock::shared_bytes`]) and so in the devices they fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnBlock {
    pub rows: usize,
    pub slots: usize,
}

impl AttnBlock {
    /// Every compiled shape, fastest first as measured on the H200
    /// (`prefill_attention_speed_by_context`, docs/BENCHMARKS.md): 64 rows with 2 slots won by
    /// 1–3 % at every context from 0 to 60K cached positions, two blocks an SM hiding each
    /// other's barriers and softmax better than 128-row blocks gain by reading each K/V tile from
    /// L2 half as often. [`block_for`] takes the first that fits (it needs the least shared
    /// memory: 96 KiB at head dim 256, against 128 and 192); the others stay compiled and tested
    /// as the ladder the timing compares on other devices.
    pub const ALL: [AttnBlock; 3] = [
        AttnBlock { rows: 64, slots: 2 },
        AttnBlock {
            rows: 128,
            slots: 2,
        },
        AttnBlock {
            rows: 128,
            slots: 4,
        },
    ];

    /// The kernel entry compiled for this shape.
    pub fn entry(self) -> String {
        format!("attn_prefill_r{}_s{}", self.rows, self.slots)
    }

    /// Dynamic shared memory of a block: its queries and the ring, bf16.
    pub fn shared_bytes(self, c: &ModelConfig) -> usize {
        (self.rows + self.slots * KEY_TILE) * c.head_dim * 2
    }

    fn threads(self) -> u32 {
        (self.rows / 16 * 32) as u32
    }
}

/// The shapes that fit `max_shared` bytes of shared memory per block, with their dynamic
/// shared memory, for `Gpu::new` to raise their limit.
pub fn dynamic_shared(c: &ModelConfig, max_shared: usize) -> Vec<(String, u32)> {
    AttnBlock::ALL
        .into_iter()
        .filter(|b| b.shared_bytes(c) <= max_shared)
        .map(|b| (b.entry(), b.shared_bytes(c) as u32))
        .collect()
}

/// The fastest shape that fits the device.
pub fn block_for(gpu: &Gpu, c: &ModelConfig) -> Result<AttnBlock> {
    let least = AttnBlock::ALL.map(|b| b.shared_bytes(c)).into_iter().min();
    AttnBlock::ALL
        .into_iter()
        .find(|b| b.shared_bytes(c) <= gpu.shared_optin)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "prefill attention at head dim {} needs {} bytes of shared memory per block; the \
                 device allows {}",
                c.head_dim,
                least.unwrap_or_default(),
                gpu.shared_optin
            )
        })
}

/// One chunk of an attention layer's prefill, as raw device addresses. `q`, `out` and the caches
/// must be 16-byte aligned (the kernels move 16-byte vectors); `qkv` may have any stride.
pub struct AttnChunk {
    /// Tokens in the chunk (at least 1).
    pub tokens: usize,
    /// Position of the first token; positions below it are already in the cache.
    pub pos0: usize,
    /// The projection `[tokens, ld]` f32, each row `[q|gate per head | k | v]`.
    pub qkv: u64,
    /// Row stride of `qkv` in elements.
    pub ld: usize,
    /// Normed, rotated queries `[tokens, NH·HD]` f32: written by [`prep_rows`], read by
    /// [`attend`].
    pub q: u64,
    /// The layer's caches (`kv_t`: bf16 or f32 per `Gpu::kv`), holding at least
    /// `pos0 + tokens` positions.
    pub k_cache: u64,
    pub v_cache: u64,
    /// The gated attention output `[tokens, NH·HD]` f32, and its bf16 copy where wanted (the
    /// output projection's X).
    pub out: GemmX,
}

/// The CUDA limit on a grid's y dimension, which counts tokens (or query tiles) here.
const MAX_GRID_Y: usize = 65_535;

impl AttnChunk {
    /// Tokens, first position and row stride as the kernels' `int`s.
    fn ints(&self) -> Result<(i32, i32, i32)> {
        ensure!(
            self.tokens > 0,
            "an attention chunk needs at least one token"
        );
        ensure!(
            self.tokens <= MAX_GRID_Y && self.ld <= i32::MAX as usize,
            "attention chunk of {} tokens (row stride {}) is too large for one launch",
            self.tokens,
            self.ld
        );
        let pos0 = i32::try_from(self.pos0)
            .ok()
            .filter(|&p| p.checked_add(self.tokens as i32).is_some())
            .ok_or_else(|| anyhow::anyhow!("position {} is beyond 32-bit indices", self.pos0))?;
        Ok((self.tokens as i32, pos0, self.ld as i32))
    }
}

/// Per (head, token): q/k RMSNorm and RoPE; queries to `chunk.q`, keys and values into the
/// caches at positions `pos0..pos0 + tokens`.
pub fn prep_rows(
    gpu: &Gpu,
    c: &ModelConfig,
    chunk: &AttnChunk,
    q_norm: u64,
    k_norm: u64,
) -> Result<()> {
    let (t, pos0, ld) = chunk.ints()?;
    let heads = (c.num_attention_heads + c.num_kv_heads) as u32;
    // One warp per (head, token): kernels/heads.cuh, head_norm_rope.
    let args = AttnPrepRows {
        qkv: chunk.qkv,
        ld,
        q_norm,
        k_norm,
        pos0,
        q_out: chunk.q,
        k_cache: chunk.k_cache,
        v_cache: chunk.v_cache,
        eps: c.rms_norm_eps,
    };
    launch!(gpu, "attn_prep_rows", (heads, t as u32, 1), 32, args);
    Ok(())
}

/// Causal attention of the chunk's queries over the cache, times the sigmoid gate, into
/// `chunk.out`. Runs after [`prep_rows`] has put the chunk's keys and values in the cache.
pub fn attend(gpu: &Gpu, c: &ModelConfig, chunk: &AttnChunk) -> Result<()> {
    attend_with(gpu, c, chunk, block_for(gpu, c)?)
}

/// [`attend`] with a chosen block shape (tests and timings compare them).
pub fn attend_with(gpu: &Gpu, c: &ModelConfig, chunk: &AttnChunk, block: AttnBlock) -> Result<()> {
    let (t, pos0, ld) = chunk.ints()?;
    // The mma tiles cover 16 dims at a time, and the kernel keeps 16 × head dim f32 of output
    // per warp in registers (128 a lane at 256).
    ensure!(
        c.head_dim.is_multiple_of(16) && c.head_dim <= 256,
        "prefill attention takes head dims that are multiples of 16 up to 256, not {}",
        c.head_dim
    );
    let shared = block.shared_bytes(c);
    ensure!(
        shared <= gpu.shared_optin,
        "prefill attention blocks of {} rows and {} slots need {shared} bytes of shared memory; \
         the device allows {}",
        block.rows,
        block.slots,
        gpu.shared_optin
    );
    let group = c.num_attention_heads / c.num_kv_heads;
    let tiles = (chunk.tokens * group).div_ceil(block.rows);
    ensure!(
        tiles <= MAX_GRID_Y,
        "{} tokens of {group} heads each are too many query tiles for one launch",
        chunk.tokens
    );
    let shape = Shape {
        grid: (c.num_kv_heads as u32, tiles as u32, 1),
        block: block.threads(),
    };
    gpu.launch_shared(
        &block.entry(),
        shape,
        shared as u32,
        &AttnPrefill {
            q: chunk.q,
            k_cache: chunk.k_cache,
            v_cache: chunk.v_cache,
            pos0,
            t,
            qkv: chunk.qkv,
            ld,
            out: chunk.out.f32,
            out16: chunk.out.bf16.unwrap_or(0),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::KERNEL_FILES;
    use lily_core::config::QWEN36_35B_A3B_CONFIG;

    /// The launchers name exactly the flash entries the kernel file instantiates and compile.rs
    /// loads, and both sides agree on the key tile, which sizes the shared memory.
    #[test]
    fn every_block_shape_is_compiled() {
        let file = KERNEL_FILES
            .iter()
            .find(|f| f.name == "attention_prefill")
            .unwrap();
        let mut launched: Vec<String> = AttnBlock::ALL.iter().map(|b| b.entry()).collect();
        launched.push("attn_prep_rows".to_string());
        let mut loaded: Vec<String> = file.entries.iter().map(|e| e.to_string()).collect();
        launched.sort();
        loaded.sort();
        assert_eq!(launched, loaded);
        for b in AttnBlock::ALL {
            let made = format!("ATTN_PREFILL({}, {})", b.rows, b.slots);
            assert!(file.source.contains(&made), "no {made}");
        }
        assert!(
            file.source
                .contains(&format!("#define FA_KEYS {KEY_TILE}\n"))
        );
    }

    #[test]
    fn shapes_fit_by_their_shared_memory() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        let fitting = |bytes| -> Vec<String> {
            dynamic_shared(&c, bytes)
                .into_iter()
                .map(|(e, _)| e)
                .collect()
        };
        // H200 (227 KiB), A100 (163 KiB), RTX 4090 (99 KiB), and too little.
        assert_eq!(fitting(232_448).len(), 3);
        assert_eq!(
            fitting(166_912),
            ["attn_prefill_r64_s2", "attn_prefill_r128_s2"]
        );
        assert_eq!(fitting(101_376), ["attn_prefill_r64_s2"]);
        assert!(fitting(49_152).is_empty());
        assert_eq!(AttnBlock::ALL[0].shared_bytes(&c), 96 * 1024);
        assert_eq!(AttnBlock::ALL[2].shared_bytes(&c), 192 * 1024);
    }
}
