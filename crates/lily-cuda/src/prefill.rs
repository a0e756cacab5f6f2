//! One prefill chunk: T prompt tokens through the whole model at once. Every projection is a
//! tensor-core GEMM that reads each weight once per chunk (gemm.cu); routing, sorting by expert
//! and the combine stay on the device (moe_prefill.cu); the Gated DeltaNet runs its recurrence
//! over the chunk with the state in registers (gdn_prefill.cu); attention is causal over the
//! cache, which holds earlier chunks (attention_prefill.cu). Nothing is read back until the
//! logits, so the host only enqueues.

use anyhow::Result;
use cudarc::driver::CudaSlice;
use lily_core::config::ModelConfig;

use crate::attention_prefill::{self, AttnChunk};
use crate::gdn_prefill::{GdnPrefillRoute, WindowAt};
use crate::gemm::{GemmX, Parts};
use crate::gemm_grouped::{self, GateUp, GateUpRoute};
use crate::gemm_wgmma::GemmPath;
use crate::gpu::{Gpu, ptr};
use crate::kernel_args::{AddRmsNorm, Embed};
use crate::launch;
use crate::moe_prefill::{MoeTile, TileMap};
use crate::state::{CudaState, LayerState};
use crate::timeline::Timeline;
use crate::weights::{DeviceAttention, DeviceGdn, DeviceMixer, DeviceWeights};
use crate::{gdn_prefill, gemm, moe_prefill};

/// Activations of one chunk of up to `chunk` tokens, allocated once at the chunk size, so a
/// prompt of any length runs in bounded memory.
pub struct PrefillScratch {
    pub chunk: usize,
    tokens: CudaSlice<u32>,
    hidden: CudaSlice<f32>,
    x: CudaSlice<f32>,
    /// `x` rounded to bf16, two a word, for the GEMMs that read it so (`GemmX`).
    x16: CudaSlice<u32>,
    /// The mixer's fused input projection, `[T, proj_width]`.
    proj: CudaSlice<f32>,
    conv: CudaSlice<f32>,
    /// Per-token normalised q, k and gates for the GDN scan.
    gdn_prep: CudaSlice<f32>,
    gdn_o: CudaSlice<f32>,
    gdn_y: CudaSlice<f32>,
    q: CudaSlice<f32>,
    attn_out: CudaSlice<f32>,
    /// The mixer's output projection's X (`gdn_y` or `attn_out`) rounded to bf16.
    mix16: CudaSlice<u32>,
    mix_out: CudaSlice<f32>,
    /// `[T, NE + 1]`: router logits, then the shared-expert gate logit.
    router: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    gather: CudaSlice<i32>,
    slot_of: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    num_tiles: CudaSlice<i32>,
    /// The grid sort's per-block counts (`moe_prefill::sort_counts`).
    sort_counts: CudaSlice<i32>,
    /// Routed expert rows in sorted-slot order: gate (then SwiGLU in place; not written where
    /// the fused gate and up launch leaves the SwiGLU in bf16 only, `act16`), up, down.
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    /// The SwiGLU rows rounded to bf16 for the down projections, the routed experts' and then the
    /// shared expert's (fewer: `t · shared` against `t · top_k · inter`).
    act16: CudaSlice<u32>,
    down: CudaSlice<f32>,
    shared_gate: CudaSlice<f32>,
    shared_up: CudaSlice<f32>,
    shared_down: CudaSlice<f32>,
    moe_out: CudaSlice<f32>,
    /// The tile map of the chunk's rows as one expert (`moe_prefill::dense_tiles`): the shared
    /// expert's gate and up run through the routed experts' fused launch.
    shared_tiles: CudaSlice<i32>,
    shared_num_tiles: CudaSlice<i32>,
}

/// Widths of the fused mixer input projections: GDN [qkv | z | b | a], attention [q+gate | k | v].
fn proj_widths(c: &ModelConfig) -> (usize, usize) {
    let gdn = c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads;
    let attn = c.num_attention_heads * 2 * c.head_dim + 2 * c.num_kv_heads * c.head_dim;
    (gdn, attn)
}

impl PrefillScratch {
    /// Device bytes the scratch of a `chunk`-token chunk takes (for the memory plan).
    /// With the GDN prefill route forced or not (CudaOptions::gdn_prefill).
    pub fn bytes(c: &ModelConfig, chunk: usize, gdn: Option<GdnPrefillRoute>) -> usize {
        Self::sizes(c, chunk, gdn).iter().sum::<usize>() * 4
    }

    /// Element counts of every buffer, in field order (all 4-byte elements).
    fn sizes(c: &ModelConfig, chunk: usize, route: Option<GdnPrefillRoute>) -> [usize; 31] {
        let (gdn, attn) = proj_widths(c);
        let (h, t) = (c.hidden_size, chunk);
        let pairs = t * c.experts_per_token;
        // Each chunk's tile height is chosen as it is enqueued: room for the height with the most.
        let tiles = MoeTile::ALL
            .map(|height| moe_prefill::max_tiles(pairs, c.num_experts, height))
            .into_iter()
            .fold(0, usize::max);
        let heads = c.num_attention_heads * c.head_dim;
        let (inter, shared) = (c.moe_intermediate_size, c.shared_intermediate_size);
        [
            t,
            t * h,
            t * h,
            (t * h).div_ceil(2),
            t * gdn.max(attn),
            t * c.gdn_conv_dim(),
            gdn_prefill::scan_scratch_floats(c, t, route),
            t * c.gdn_value_dim(),
            t * c.gdn_value_dim(),
            t * heads,
            t * heads,
            (t * heads.max(c.gdn_value_dim())).div_ceil(2),
            t * h,
            t * (c.num_experts + 1),
            pairs,
            pairs,
            pairs,
            pairs,
            3 * tiles,
            1,
            moe_prefill::sort_counts(pairs, c.num_experts),
            pairs * inter,
            pairs * inter,
            (pairs * inter).max(t * shared).div_ceil(2),
            pairs * h,
            t * shared,
            t * shared,
            t * h,
            t * h,
            3 * t.div_ceil(MoeTile::Rows64.rows()),
            1,
        ]
    }

    pub fn new(gpu: &Gpu, c: &ModelConfig, chunk: usize) -> Result<Self> {
        let n = Self::sizes(c, chunk, gpu.gdn_prefill_route);
        Ok(PrefillScratch {
            chunk,
            tokens: gpu.zeros(n[0])?,
            hidden: gpu.zeros(n[1])?,
            x: gpu.zeros(n[2])?,
            x16: gpu.zeros(n[3])?,
            proj: gpu.zeros(n[4])?,
            conv: gpu.zeros(n[5])?,
            gdn_prep: gpu.zeros(n[6])?,
            gdn_o: gpu.zeros(n[7])?,
            gdn_y: gpu.zeros(n[8])?,
            q: gpu.zeros(n[9])?,
            attn_out: gpu.zeros(n[10])?,
            mix16: gpu.zeros(n[11])?,
            mix_out: gpu.zeros(n[12])?,
            router: gpu.zeros(n[13])?,
            ids: gpu.zeros(n[14])?,
            weights: gpu.zeros(n[15])?,
            gather: gpu.zeros(n[16])?,
            slot_of: gpu.zeros(n[17])?,
            tiles: gpu.zeros(n[18])?,
            num_tiles: gpu.zeros(n[19])?,
            sort_counts: gpu.zeros(n[20])?,
            gate: gpu.zeros(n[21])?,
            up: gpu.zeros(n[22])?,
            act16: gpu.zeros(n[23])?,
            down: gpu.zeros(n[24])?,
            shared_gate: gpu.zeros(n[25])?,
            shared_up: gpu.zeros(n[26])?,
            shared_down: gpu.zeros(n[27])?,
            moe_out: gpu.zeros(n[28])?,
            shared_tiles: gpu.zeros(n[29])?,
            shared_num_tiles: gpu.zeros(n[30])?,
        })
    }

    /// The map of `shared_tiles` for a chunk of `t` rows.
    fn shared_map(&self, gpu: &Gpu, t: usize) -> TileMap {
        TileMap {
            tiles: ptr(&self.shared_tiles, &gpu.stream),
            num_tiles: ptr(&self.shared_num_tiles, &gpu.stream),
            height: MoeTile::Rows64,
            max_tiles: t.div_ceil(MoeTile::Rows64.rows()),
        }
    }
}

/// What every launch of a chunk needs: the device, the model's shape and its weights there.
#[derive(Clone, Copy)]
pub struct Model<'a> {
    pub gpu: &'a Gpu,
    pub c: &'a ModelConfig,
    pub w: &'a DeviceWeights,
}

/// A fork of the state taken inside a chunk's pass (`Backend::prefill_forking`): `state`, a
/// copy of the sequence's state at the chunk's start, gets every layer's state after the chunk's
/// first `at` tokens (0 < `at` < the chunk's length): the attention rows up to there, the conv
/// windows, and the recurrent states, for which the delta rule runs as two parts cut at `at`.
/// Its length is the caller's to set.
pub struct ChunkFork<'a> {
    pub at: usize,
    pub state: &'a mut CudaState,
}

/// Enqueues one chunk of `tokens` (at most `s.chunk`) for `state`, starting at position
/// `state.len` (the caller advances it), and fills `fork` where one is asked for. Returns the
/// device address of the final-normed hidden rows `[rows, hidden]` for the lm_head: every row
/// with `all_rows`, else only the last.
pub fn encode_chunk(
    model: Model,
    s: &mut PrefillScratch,
    state: &CudaState,
    tokens: &[u32],
    all_rows: bool,
    mut fork: Option<ChunkFork>,
    mut timeline: Option<&mut Timeline>,
) -> Result<u64> {
    let Model { gpu, c, w } = model;
    let mut mark = |family: &'static str| match timeline.as_deref_mut() {
        Some(t) => t.mark(gpu, family),
        None => Ok(()),
    };
    mark("start")?;
    let t = tokens.len();
    anyhow::ensure!(
        t > 0 && t <= s.chunk,
        "a prefill chunk holds 1 to {} tokens, not {t}",
        s.chunk
    );
    if let Some(f) = &fork {
        anyhow::ensure!(
            f.at > 0 && f.at < t && f.state.layers.len() == state.layers.len(),
            "a fork inside a chunk of {t} tokens cannot be taken after {}",
            f.at
        );
    }
    gpu.stream
        .memcpy_htod(tokens, &mut s.tokens.slice_mut(0..t))?;
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    let rows = t as u32;
    let norm_block = (h.div_ceil(32) * 32).min(1024) as u32;
    // The normed rows that the mixer's and the MoE's GEMMs read, in f32 and, where the wgmma
    // kernels read them, in bf16 too (`GemmX`).
    let wgmma = gpu.gemm_path() == GemmPath::Wgmma;
    let with16 = |f32, bf16: &CudaSlice<u32>| GemmX {
        f32,
        bf16: wgmma.then(|| ptr(bf16, &gpu.stream)),
    };
    let x = with16(p(&s.x), &s.x16);
    // The output projection's X, from the GDN's gated norm or from attention.
    let attn_out = with16(p(&s.attn_out), &s.mix16);
    // out = RMSNorm(hidden += delta) · scale for `rows` rows (delta 0: none), and its bf16 copy
    // into out16 unless that is 0.
    let add_rms_norm =
        |rows: u32, hidden: u64, delta: Parts, scale: u64, out: GemmX| -> Result<()> {
            let n = h as i32;
            let (parts, part_stride) = delta.ints()?;
            let args = AddRmsNorm {
                hidden,
                delta: delta.at,
                parts,
                part_stride,
                scale,
                out: out.f32,
                out16: out.bf16.unwrap_or(0),
                n,
                eps,
            };
            launch!(gpu, "add_rms_norm", (rows, 1, 1), norm_block, args);
            Ok(())
        };
    let (gdn_w, attn_w) = proj_widths(c);

    let name = format!("embed_b{}", w.embed.bits);
    let args = Embed {
        table: w.embed.arg(gpu),
        tokens: ptr(&s.tokens, &gpu.stream),
        out: p(&s.hidden),
    };
    launch!(gpu, &name, (rows, 1, 1), 256, args);
    if wgmma && gpu.gate_up == GateUpRoute::Fused {
        moe_prefill::dense_tiles(gpu, t, &s.shared_map(gpu, t))?;
    }
    mark("embed")?;

    let mut delta = 0u64;
    for (i, (layer, ls)) in w.layers.iter().zip(&state.layers).enumerate() {
        // This layer's part of the fork, if one is asked for.
        let mut fork_layer = fork.as_mut().map(|f| (f.at, &mut f.state.layers[i]));
        add_rms_norm(rows, p(&s.hidden), delta.into(), p(&layer.input_norm), x)?;
        mark("rms norm")?;
        // The mixer's output, in parts where its projection split K (the norm adds them).
        let mixed = match (&layer.mixer, ls) {
            (DeviceMixer::GatedDeltaNet(g), LayerState::GatedDeltaNet { window, recurrent }) => {
                let DeviceGdn {
                    proj,
                    conv,
                    a_log,
                    dt_bias,
                    norm,
                    out_proj,
                } = g.as_ref();
                gemm::gemm_stack(gpu, &proj.each_ref(), x, t, p(&s.proj), gdn_w, 0)?;
                mark("mixer input gemm")?;
                let fork_gdn = match &mut fork_layer {
                    Some((
                        at,
                        LayerState::GatedDeltaNet {
                            window: fork_window,
                            recurrent: fork_recurrent,
                        },
                    )) => Some((*at, fork_window, fork_recurrent)),
                    _ => None,
                };
                let window_at = fork_gdn.as_ref().map(|(at, fork_window, _)| WindowAt {
                    at: *at,
                    window: p(fork_window),
                });
                gdn_prefill::conv_rows(
                    gpu,
                    c,
                    p(&s.proj),
                    gdn_w,
                    t,
                    p(conv),
                    p(window),
                    p(&s.conv),
                    window_at,
                )?;
                // The delta rule over rows `[first, end)` of the chunk.
                let scan_rows = |first: usize, end: usize| {
                    gdn_prefill::scan(
                        gpu,
                        c,
                        gdn_prefill::route_for(gpu, c, end - first),
                        p(&s.conv) + (first * c.gdn_conv_dim() * 4) as u64,
                        p(&s.proj) + (first * gdn_w * 4) as u64,
                        gdn_w,
                        end - first,
                        p(a_log),
                        p(dt_bias),
                        p(&s.gdn_prep),
                        p(recurrent),
                        p(&s.gdn_o) + (first * c.gdn_value_dim() * 4) as u64,
                    )
                };
                match fork_gdn {
                    Some((at, _, fork_recurrent)) => {
                        scan_rows(0, at)?;
                        gpu.stream.memcpy_dtod(recurrent, fork_recurrent)?;
                        scan_rows(at, t)?;
                    }
                    None => scan_rows(0, t)?,
                }
                // The gated norm's rows in f32 only for an output projection that reads f32.
                let mut gdn_y = with16(p(&s.gdn_y), &s.mix16);
                if gemm::path_of(gpu, out_proj) == GemmPath::Wgmma {
                    gdn_y.f32 = 0;
                }
                gdn_prefill::gated_norm_rows(
                    gpu,
                    c,
                    p(&s.gdn_o),
                    p(&s.proj),
                    gdn_w,
                    t,
                    p(norm),
                    gdn_y,
                    eps,
                )?;
                mark("gated deltanet")?;
                let out = gemm::gemm_parts(gpu, out_proj, gdn_y, t, p(&s.mix_out))?;
                mark("mixer output gemm")?;
                out
            }
            (DeviceMixer::Attention(a), LayerState::Attention { k, v }) => {
                let DeviceAttention {
                    proj,
                    q_norm,
                    k_norm,
                    o_proj,
                } = a.as_ref();
                let mut col = 0;
                for m in proj {
                    gemm::gemm(gpu, m, x, t, p(&s.proj), attn_w, col)?;
                    col += m.rows;
                }
                mark("mixer input gemm")?;
                let chunk = AttnChunk {
                    tokens: t,
                    pos0: state.len,
                    qkv: p(&s.proj),
                    ld: attn_w,
                    q: p(&s.q),
                    k_cache: ptr(k, &gpu.stream),
                    v_cache: ptr(v, &gpu.stream),
                    out: attn_out,
                };
                attention_prefill::prep_rows(gpu, c, &chunk, p(q_norm), p(k_norm))?;
                if let Some((
                    at,
                    LayerState::Attention {
                        k: fork_k,
                        v: fork_v,
                    },
                )) = fork_layer
                {
                    // The chunk's first `at` rows of the caches, position-major.
                    let row = c.num_kv_heads * c.head_dim * gpu.kv.bytes() / 2;
                    let rows = state.len * row..(state.len + at) * row;
                    let st = &gpu.stream;
                    st.memcpy_dtod(&k.slice(rows.clone()), &mut fork_k.slice_mut(rows.clone()))?;
                    st.memcpy_dtod(&v.slice(rows.clone()), &mut fork_v.slice_mut(rows))?;
                }
                attention_prefill::attend(gpu, c, &chunk)?;
                mark("attention")?;
                let out = gemm::gemm_parts(gpu, o_proj, attn_out, t, p(&s.mix_out))?;
                mark("mixer output gemm")?;
                out
            }
            _ => unreachable!("states are built from the same config as the weights"),
        };
        add_rms_norm(rows, p(&s.hidden), mixed, p(&layer.post_norm), x)?;
        mark("rms norm")?;
        encode_moe(gpu, c, layer, s, x, t, &mut mark)?;
        delta = p(&s.moe_out);
    }
    // The final norm, for the rows whose logits are wanted.
    let (first, n) = if all_rows { (0, t) } else { (t - 1, 1) };
    let at = |b: &CudaSlice<f32>| p(b) + (first * h * 4) as u64;
    add_rms_norm(
        n as u32,
        at(&s.hidden),
        at(&s.moe_out).into(),
        p(&w.final_norm),
        at(&s.x).into(),
    )?;
    mark("rms norm")?;
    Ok(at(&s.x))
}

/// The MoE block over the chunk: router and shared gate as one `[T, NE+1]` GEMM output, top-k,
/// the pairs sorted by expert into tiles of the height the chunk's length calls for, gate/up/down
/// as grouped GEMMs over the tiles, the shared expert as dense GEMMs, and the weighted combine.
/// `x` is the post-attention norm's output (`s.x`, and its bf16 copy where there is one).
fn encode_moe(
    gpu: &Gpu,
    c: &ModelConfig,
    layer: &crate::weights::DeviceLayer,
    s: &mut PrefillScratch,
    x: GemmX,
    t: usize,
    mark: &mut impl FnMut(&'static str) -> Result<()>,
) -> Result<()> {
    let p = |b: &CudaSlice<f32>| ptr(b, &gpu.stream);
    let pi = |b: &CudaSlice<i32>| ptr(b, &gpu.stream);
    let m = &layer.moe;
    let (h, ne) = (c.hidden_size, c.num_experts);
    let (inter, shared) = (c.moe_intermediate_size, c.shared_intermediate_size);
    let pairs = t * c.experts_per_token;
    gemm::gemm(gpu, &m.router, p(&s.x), t, p(&s.router), ne + 1, 0)?;
    gemm::gemm(gpu, &m.shared_gate, p(&s.x), t, p(&s.router), ne + 1, ne)?;
    moe_prefill::topk_rows(gpu, p(&s.router), t, pi(&s.ids), p(&s.weights))?;
    let tall_path = gemm::path_of(gpu, &m.gate);
    let height = MoeTile::for_chunk(t, c.experts_per_token, ne, tall_path);
    let map = TileMap {
        tiles: pi(&s.tiles),
        num_tiles: pi(&s.num_tiles),
        height,
        max_tiles: moe_prefill::max_tiles(pairs, ne, height),
    };
    let (ids, gather, slot_of, counts) = (
        pi(&s.ids),
        pi(&s.gather),
        pi(&s.slot_of),
        pi(&s.sort_counts),
    );
    moe_prefill::sort(gpu, ids, pairs, gather, slot_of, counts, &map)?;
    mark("router + sort")?;
    let grouped =
        |w, n, x: GemmX, gather, y| gemm_grouped::gemm_grouped(gpu, w, n, x, gather, &map, y);
    // The down projections' X: f32 in place of gate, and bf16 where the wgmma kernels read it.
    let act16 = ptr(&s.act16, &gpu.stream);
    let act = |f32| GemmX {
        f32,
        bf16: x.bf16.map(|_| act16),
    };
    let tall = map.height == MoeTile::Rows64;
    let gate_up = GateUp {
        gate: &m.gate,
        up: &m.up,
        n: inter,
    };
    match x.bf16 {
        Some(x16) if gpu.gate_up == GateUpRoute::Fused && gate_up.fusable(gpu, map.height) => {
            // act in f32 only for a down projection that will not read the bf16 copy.
            let down16 = tall && gemm::path_of(gpu, &m.down) == GemmPath::Wgmma;
            let act_f32 = if down16 { 0 } else { p(&s.gate) };
            gemm_grouped::gemm_gate_up(gpu, gate_up, x16, pi(&s.gather), &map, act_f32, act16)?;
        }
        _ => {
            grouped(&m.gate, inter, x, pi(&s.gather), p(&s.gate))?;
            grouped(&m.up, inter, x, pi(&s.gather), p(&s.up))?;
            moe_prefill::swiglu(gpu, p(&s.gate), p(&s.up), pairs * inter, act(p(&s.gate)))?;
        }
    }
    grouped(&m.down, h, act(p(&s.gate)), 0, p(&s.down))?;
    mark("expert gemms")?;

    let [sg, su, sd] = &m.shared;
    let shared_gate_up = GateUp {
        gate: sg,
        up: su,
        n: shared,
    };
    match x.bf16 {
        // One launch over the chunk's rows in 64-row tiles (the map encode_chunk wrote), where
        // two split-K GEMMs, their reductions and a SwiGLU launch took ~46 µs a layer at 1K.
        Some(x16)
            if gpu.gate_up == GateUpRoute::Fused
                && shared_gate_up.fusable(gpu, MoeTile::Rows64) =>
        {
            let act_f32 = match gemm::path_of(gpu, sd) {
                GemmPath::Wgmma => 0,
                GemmPath::MmaSync => p(&s.shared_gate),
            };
            let map = s.shared_map(gpu, t);
            gemm_grouped::gemm_gate_up(gpu, shared_gate_up, x16, 0, &map, act_f32, act16)?;
        }
        _ => {
            gemm::gemm(gpu, sg, x, t, p(&s.shared_gate), shared, 0)?;
            gemm::gemm(gpu, su, x, t, p(&s.shared_up), shared, 0)?;
            moe_prefill::swiglu(
                gpu,
                p(&s.shared_gate),
                p(&s.shared_up),
                t * shared,
                act(p(&s.shared_gate)),
            )?;
        }
    }
    // In parts where K was split: the combine adds them.
    let shared_down = gemm::gemm_parts(gpu, sd, act(p(&s.shared_gate)), t, p(&s.shared_down))?;
    mark("shared expert")?;
    moe_prefill::combine(
        gpu,
        p(&s.down),
        pi(&s.slot_of),
        p(&s.weights),
        p(&s.router),
        shared_down,
        t,
        h,
        p(&s.moe_out),
    )?;
    mark("combine")?;
    Ok(())
}
