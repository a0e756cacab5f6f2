//! Launchers for kernels/attention_prefill.cu: gated attention over a chunk of tokens.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::gpu::Gpu;
use crate::launch;

/// Query vectors per attention block (FA_ROWS in the kernel file).
const QUERY_TILE: usize = 64;
/// Threads per attention block (FA_THREADS in the kernel file).
const THREADS: u32 = 128;

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
    /// The gated attention output `[tokens, NH·HD]` f32.
    pub out: u64,
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
    let block = (c.head_dim.div_ceil(32) * 32) as u32;
    launch!(gpu, "attn_prep_rows", (heads, t as u32, 1), block;
        chunk.qkv, ld, q_norm, k_norm, pos0, chunk.q, chunk.k_cache, chunk.v_cache,
        c.rms_norm_eps);
    Ok(())
}

/// Causal attention of the chunk's queries over the cache, times the sigmoid gate, into
/// `chunk.out`. Runs after [`prep_rows`] has put the chunk's keys and values in the cache.
pub fn attend(gpu: &Gpu, c: &ModelConfig, chunk: &AttnChunk) -> Result<()> {
    let (t, pos0, ld) = chunk.ints()?;
    // The mma tiles cover 16 dims at a time; 64 query rows of 256 dims plus a K/V tile fill the
    // 48 KiB of static shared memory.
    ensure!(
        c.head_dim.is_multiple_of(16) && c.head_dim <= 256,
        "prefill attention takes head dims that are multiples of 16 up to 256, not {}",
        c.head_dim
    );
    let group = c.num_attention_heads / c.num_kv_heads;
    let tiles = (chunk.tokens * group).div_ceil(QUERY_TILE);
    ensure!(
        tiles <= MAX_GRID_Y,
        "{} tokens of {group} heads each are too many query tiles for one launch",
        chunk.tokens
    );
    launch!(gpu, "attn_prefill", (c.num_kv_heads as u32, tiles as u32, 1), THREADS;
        chunk.q, chunk.k_cache, chunk.v_cache, pos0, t, chunk.qkv, ld, chunk.out);
    Ok(())
}
