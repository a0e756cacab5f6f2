//! The constants the persistent decode step (kernels/decode.cu) is compiled with: the weight
//! format of each role, the size of the warps' shared-memory rings (from the device's shared
//! memory), and the shapes it is written for. decode.rs compiles and launches it.

use anyhow::{Result, ensure};
use lily_core::config::ModelConfig;

use crate::compile::{KvPrecision, model_defines};
use crate::mat::{DeviceMat, XS_COLS};
use crate::weights::{DeviceMixer, DeviceWeights};

/// The weight format of each role in the step (bits: 4 or 8 affine, 32 dense), constants of the
/// compiled kernel. Every layer's matrices of one role must share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepFormats {
    pub embed: u32,
    pub lm_head: u32,
    pub gdn_in: u32,
    pub gdn_out: u32,
    pub attn_in: u32,
    pub attn_out: u32,
    pub router: u32,
    pub expert: u32,
}

impl StepFormats {
    /// MLX 4-bit checkpoints and the synthetic model: 8-bit router and shared-expert gate.
    pub const MLX_4BIT: StepFormats = StepFormats {
        embed: 4,
        lm_head: 4,
        gdn_in: 4,
        gdn_out: 4,
        attn_in: 4,
        attn_out: 4,
        router: 8,
        expert: 4,
    };
    /// f32 checkpoints (the tiny test fixtures).
    pub const DENSE: StepFormats = StepFormats {
        embed: 32,
        lm_head: 32,
        gdn_in: 32,
        gdn_out: 32,
        attn_in: 32,
        attn_out: 32,
        router: 32,
        expert: 32,
    };

    /// The formats of `w`, or an error naming the role whose layers differ.
    pub fn of(w: &DeviceWeights) -> Result<Self> {
        let first = &w.layers[0].moe;
        let mut f = StepFormats {
            embed: w.embed.bits,
            lm_head: w.lm_head.bits,
            gdn_in: first.gate.bits,
            gdn_out: first.gate.bits,
            attn_in: first.gate.bits,
            attn_out: first.gate.bits,
            router: first.router.bits,
            expert: first.gate.bits,
        };
        let mut seen = [false; 4];
        let mut set = |slot: usize,
                       field: &mut u32,
                       mats: &[&DeviceMat],
                       role: &str|
         -> Result<()> {
            for m in mats {
                if !seen[slot] {
                    *field = m.bits;
                    seen[slot] = true;
                }
                ensure!(
                    m.bits == *field,
                    "the persistent decode step needs one format for every {role} ({} and {} bits)",
                    m.bits,
                    *field
                );
            }
            Ok(())
        };
        for layer in &w.layers {
            match &layer.mixer {
                DeviceMixer::GatedDeltaNet(g) => {
                    let p = &g.proj;
                    set(
                        0,
                        &mut f.gdn_in,
                        &[&p[0], &p[1], &p[2], &p[3]],
                        "GDN input projection",
                    )?;
                    set(1, &mut f.gdn_out, &[&g.out_proj], "GDN output projection")?;
                }
                DeviceMixer::Attention(a) => {
                    let p = &a.proj;
                    set(
                        2,
                        &mut f.attn_in,
                        &[&p[0], &p[1], &p[2]],
                        "attention input projection",
                    )?;
                    set(
                        3,
                        &mut f.attn_out,
                        &[&a.o_proj],
                        "attention output projection",
                    )?;
                }
            }
            let m = &layer.moe;
            ensure!(
                m.router.bits == f.router && m.shared_gate.bits == f.router,
                "the persistent decode step needs one format for every router and shared-expert gate"
            );
            let experts = m.experts();
            ensure!(
                experts.iter().all(|e| e.bits == f.expert),
                "the persistent decode step needs one format for every expert projection"
            );
        }
        Ok(f)
    }

    fn defines(&self) -> [(String, String); 8] {
        let d = |k: &str, v: u32| (k.to_string(), v.to_string());
        [
            d("BITS_EMBED", self.embed),
            d("BITS_LM", self.lm_head),
            d("BITS_GDN_IN", self.gdn_in),
            d("BITS_GDN_OUT", self.gdn_out),
            d("BITS_ATTN_IN", self.attn_in),
            d("BITS_ATTN_OUT", self.attn_out),
            d("BITS_ROUTER", self.router),
            d("BITS_EXPERT", self.expert),
        ]
    }
}

/// Warps a block of the step (decode.cu, DEC_THREADS / 32).
pub(crate) const STEP_WARPS: usize = 8;
/// Shared memory the step's ops other than the streamed GEMVs take beside the rings, at most
/// (decode.cu: the attention split's, ~74 KiB with 256-dim heads; decode_layout reports the
/// real total, which is checked against the device).
const OTHER_SMEM: usize = 80 * 1024;
/// The largest ring a warp gets: 5 stages of 4 row-chunks a lane (3,200 bytes each), 4 of them
/// in flight, 8 KB of codes a warp and ~8.5 MB over 132 SMs, above the ~6 MB that DRAM's
/// bandwidth × latency asks for.
const MAX_STREAM_WARP_BYTES: usize = 18 * 1024;
/// The smallest: two stages (gemv_stream.cuh refuses fewer).
const MIN_STREAM_WARP_BYTES: usize = 2 * 3200;

/// The shared-memory ring of one warp's streamed GEMV units (gemv_stream.cuh) on a device whose
/// blocks may take `shared_optin` bytes.
pub fn stream_warp_bytes(shared_optin: usize) -> Result<usize> {
    let fit = shared_optin.saturating_sub(OTHER_SMEM) / STEP_WARPS / 16 * 16;
    ensure!(
        fit >= MIN_STREAM_WARP_BYTES,
        "the persistent decode step needs at least {} bytes of shared memory a block, the device \
         allows {shared_optin} (use the graph step: LILY_DECODE=graph)",
        OTHER_SMEM + STEP_WARPS * MIN_STREAM_WARP_BYTES
    );
    Ok(fit.min(MAX_STREAM_WARP_BYTES))
}

/// Every -D constant of decode.cu for a model, its formats and the warps' rings.
pub fn step_defines(
    c: &ModelConfig,
    kv: KvPrecision,
    f: &StepFormats,
    stream_warp_bytes: usize,
) -> Vec<(String, String)> {
    let mut d = model_defines(c, kv);
    d.extend(f.defines());
    // The shared device code's loads for a kernel whose blocks read each other's outputs
    // (common.cuh, load_act), and the GEMVs' weights streamed (gemv_stream.cuh).
    d.push(("STEP_PERSISTENT".to_string(), "1".to_string()));
    d.push((
        "STREAM_WARP_BYTES".to_string(),
        stream_warp_bytes.to_string(),
    ));
    d
}

/// Shapes the persistent step is written for, beyond the graph step's (lib.rs, check_shapes).
pub fn check_shapes(c: &ModelConfig) -> Result<()> {
    ensure!(
        c.linear_num_value_heads <= 32,
        "the persistent decode step keeps one value head's norm per scratch slot: at most 32 value \
         heads, not {}",
        c.linear_num_value_heads
    );
    ensure!(
        c.hidden_size <= XS_COLS
            && c.gdn_value_dim() <= XS_COLS
            && c.num_attention_heads * c.head_dim <= XS_COLS,
        "the persistent decode step stages at most {XS_COLS} inputs"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rings take what the device's shared memory leaves beside the ops' own, capped, and a
    /// device with too little for two stages a warp is refused with the way out.
    #[test]
    fn the_rings_fit_the_devices_shared_memory() {
        // H100 / H200: the cap, 5 stages of 3,200 bytes.
        assert_eq!(stream_warp_bytes(232_448).unwrap(), MAX_STREAM_WARP_BYTES);
        // A100: what is left, a multiple of 16 bytes, at least two stages.
        let a100 = stream_warp_bytes(166_912).unwrap();
        assert_eq!(a100, (166_912 - OTHER_SMEM) / STEP_WARPS / 16 * 16);
        assert!((MIN_STREAM_WARP_BYTES..MAX_STREAM_WARP_BYTES).contains(&a100));
        // An RTX 4090's 99 KiB: refused, naming the graph step.
        let err = stream_warp_bytes(101_376).unwrap_err().to_string();
        assert!(err.contains("LILY_DECODE=graph"), "{err}");
    }
}
