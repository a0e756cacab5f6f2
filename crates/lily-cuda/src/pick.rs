//! The whole choice of a token on the device (kernels/pick.cu): the constraint's mask, the
//! penalties and logit_bias, temperature / top-k / min-p / top-p with the host's draw, and the
//! log-probabilities, applied to the logits where the step left them. Only the pick comes back:
//! the token and its top log-probabilities, 176 bytes instead of a megabyte of logits a token.
//!
//! The kernels follow the host's rule (`lily_core::choice::Choice::pick`) candidate for
//! candidate. Where the rule would walk past the best `PICK_TOP` tokens (no top-k, and a
//! distribution so flat that min-p, top-p or the draw reach beyond them), the device says so and
//! the host finishes the choice from the logits with the same draw.

use std::ffi::c_void;

use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, CudaView};
use lily_core::choice::{Choice, Pick};
use lily_core::logprobs::TokenLogprobs;
use lily_core::penalties::Adjustment;

use crate::gpu::{Gpu, LaunchKind, ptr};

/// Blocks of `pick_prepare` (pick.cu PICK_BLOCKS; its per-block sums are sized for this many).
const PICK_BLOCKS: u32 = 128;
/// Entries one block of `pick_top` takes (pick.cu PICK_CHUNK); `pick_choose` holds every list's
/// candidates in as many, so a vocabulary of up to PICK_CHUNK² / PICK_TOP (262,144) tokens is
/// chosen from on the device.
const PICK_CHUNK: usize = 4096;
/// Threads of `pick_top` and `pick_choose`: 32 warps, each sorting 128 of a chunk's entries or
/// merging two lists.
const SORT_THREADS: u32 = 1024;
/// Candidates a list keeps (pick.cu PICK_TOP).
const PICK_TOP: usize = 64;
/// Top log-probabilities the record holds (pick.cu PICK_LOGPROBS).
const PICK_LOGPROBS: usize = lily_core::choice::MAX_TOP_LOGPROBS;
/// The words of pick.cu's PickOut: status, token, logprob, count, then the top ids and values.
const OUT_WORDS: usize = 4 + 2 * PICK_LOGPROBS;
/// PickOut's status when the host must finish the choice.
const PICK_HOST: u32 = 1;

/// Every pick kernel's one parameter, with the C layout of pick.cu's PickArgs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PickArgs {
    logits: u64,
    adjusted: u64,
    allowed: u64,
    adjustments: u64,
    row_parts: u64,
    top_v: u64,
    top_i: u64,
    mass_parts: u64,
    raw_top_v: u64,
    raw_top_i: u64,
    token: u64,
    out: u64,
    vocab: i32,
    choosable: i32,
    n_adjustments: i32,
    lists: i32,
    inv_t: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    draw: f32,
    logprobs: i32,
    raw_lists: i32,
}

/// Bytes of every pick kernel's parameter (the NVRTC test holds pick.cu to it).
pub fn pick_args_bytes() -> usize {
    std::mem::size_of::<PickArgs>()
}

/// The pick kernels' buffers, shared by every sequence (one step runs at a time).
pub struct PickScratch {
    vocab: usize,
    /// Whether the vocabulary's candidate lists fit one sorting block; beyond, every choice is
    /// the host's, from the row.
    fits: bool,
    adjusted: CudaSlice<f32>,
    allowed: CudaSlice<u32>,
    /// [`Adjustment`]s as four words each, grown to the longest list seen.
    adjustments: CudaSlice<u32>,
    row_parts: CudaSlice<f64>,
    top_v: CudaSlice<f32>,
    top_i: CudaSlice<i32>,
    mass_parts: CudaSlice<f64>,
    raw_top_v: CudaSlice<f32>,
    raw_top_i: CudaSlice<i32>,
    out: CudaSlice<u32>,
    /// Choices made: on the device alone, and finished on the host.
    counts: PickCounts,
}

/// How the device's choices ended, since the backend started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PickCounts {
    pub on_device: u64,
    pub finished_on_host: u64,
}

impl PickScratch {
    pub fn new(gpu: &Gpu, vocab: usize) -> Result<Self> {
        let lists = vocab.div_ceil(PICK_CHUNK);
        Ok(PickScratch {
            vocab,
            fits: lists * PICK_TOP <= PICK_CHUNK,
            adjusted: gpu.zeros(vocab)?,
            allowed: gpu.zeros(vocab.div_ceil(32))?,
            adjustments: gpu.zeros(4 * 256)?,
            row_parts: gpu.zeros(2 * PICK_BLOCKS as usize)?,
            top_v: gpu.zeros(lists * PICK_TOP)?,
            top_i: gpu.zeros(lists * PICK_TOP)?,
            mass_parts: gpu.zeros(3 * lists)?,
            raw_top_v: gpu.zeros(lists * PICK_TOP)?,
            raw_top_i: gpu.zeros(lists * PICK_TOP)?,
            out: gpu.zeros(OUT_WORDS)?,
            counts: PickCounts::default(),
        })
    }

    pub fn counts(&self) -> PickCounts {
        self.counts
    }

    /// Makes `choice` from `logits` (a row of the vocabulary, on the device), writes the token
    /// into `token_slot` (the next step's input) and returns the pick.
    pub fn pick(
        &mut self,
        gpu: &Gpu,
        logits: &CudaView<'_, f32>,
        token_slot: &mut CudaSlice<u32>,
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        let vocab = self.vocab;
        ensure!(
            logits.len() >= vocab,
            "a row of logits holds {vocab} values"
        );
        let st = &gpu.stream;
        let choosable = choice.sampler.choosable(vocab);
        let draw = choice.sampler.draw();
        if !self.fits {
            return self.finish_on_host(gpu, logits, token_slot, choice, draw);
        }
        let params = choice.sampler.params().clone();
        let allowed = match &choice.allowed {
            Some(allowed) => {
                let bits = allowed.to_bits(choosable);
                st.memcpy_htod(&bits, &mut self.allowed.slice_mut(..bits.len()))?;
                ptr(&self.allowed, st)
            }
            None => 0,
        };
        let adjustments = choice.sampler.adjustments();
        if !adjustments.is_empty() {
            let words = adjustment_words(adjustments);
            if words.len() > self.adjustments.len() {
                self.adjustments = gpu.zeros(words.len().next_power_of_two())?;
            }
            st.memcpy_htod(&words, &mut self.adjustments.slice_mut(..words.len()))?;
        }
        let logprobs = choice.top_logprobs();
        let lists = choosable.div_ceil(PICK_CHUNK);
        // The top log-probabilities rank the raw logits; the candidates rank the adjusted ones,
        // which are the raw ones unless a mask or a penalty changed them.
        let raw_lists =
            logprobs.is_some_and(|k| k > 0) && (allowed != 0 || !adjustments.is_empty());
        let p = |b: &CudaSlice<f32>| ptr(b, st);
        let mut args = PickArgs {
            logits: ptr(logits, st),
            adjusted: p(&self.adjusted),
            allowed,
            adjustments: ptr(&self.adjustments, st),
            row_parts: ptr(&self.row_parts, st),
            top_v: p(&self.top_v),
            top_i: ptr(&self.top_i, st),
            mass_parts: ptr(&self.mass_parts, st),
            raw_top_v: p(&self.raw_top_v),
            raw_top_i: ptr(&self.raw_top_i, st),
            token: ptr(token_slot, st),
            out: ptr(&self.out, st),
            vocab: vocab as i32,
            choosable: choosable as i32,
            n_adjustments: adjustments.len() as i32,
            lists: lists as i32,
            inv_t: if params.is_greedy() {
                0.0
            } else {
                1.0 / params.temperature
            },
            top_k: params.top_k.min(i32::MAX as usize) as i32,
            top_p: params.top_p,
            min_p: params.min_p,
            draw,
            logprobs: logprobs.map_or(-1, |k| k as i32),
            raw_lists: raw_lists as i32,
        };
        launch(gpu, "pick_prepare", PICK_BLOCKS, 256, &mut args)?;
        if !adjustments.is_empty() {
            let blocks = adjustments.len().div_ceil(256) as u32;
            launch(gpu, "pick_adjust", blocks, 256, &mut args)?;
        }
        launch(gpu, "pick_top", lists as u32, SORT_THREADS, &mut args)?;
        if raw_lists {
            launch(gpu, "pick_top_raw", lists as u32, SORT_THREADS, &mut args)?;
        }
        launch(gpu, "pick_choose", 1, SORT_THREADS, &mut args)?;
        let out = gpu.download(&self.out)?;
        if out[0] == PICK_HOST {
            return self.finish_on_host(gpu, logits, token_slot, choice, draw);
        }
        self.counts.on_device += 1;
        let token = out[1];
        choice.sampler.record(token);
        Ok(Pick {
            token,
            logprobs: logprobs.map(|_| read_logprobs(token, &out)),
        })
    }
}

impl PickScratch {
    /// The choice made on the host from the row, with the draw the device was given.
    fn finish_on_host(
        &mut self,
        gpu: &Gpu,
        logits: &CudaView<'_, f32>,
        token_slot: &mut CudaSlice<u32>,
        choice: &mut Choice<'_>,
        draw: f32,
    ) -> Result<Pick> {
        let row = gpu.stream.clone_dtoh(&logits.slice(..self.vocab))?;
        let pick = choice.pick_drawn(&row, draw);
        gpu.stream.memcpy_htod(&[pick.token], token_slot)?;
        self.counts.finished_on_host += 1;
        Ok(pick)
    }
}

fn launch(gpu: &Gpu, name: &str, blocks: u32, threads: u32, args: &mut PickArgs) -> Result<()> {
    gpu.launch_raw(
        gpu.function(name)?,
        ((blocks, 1, 1), threads),
        0,
        &mut [args as *mut PickArgs as *mut c_void],
        LaunchKind::Plain,
    )
}

/// The adjustments as the kernels read them: id, bias, penalty, repetition.
fn adjustment_words(adjustments: &[Adjustment]) -> Vec<u32> {
    adjustments
        .iter()
        .flat_map(|a| {
            [
                a.id,
                a.bias.to_bits(),
                a.penalty.to_bits(),
                a.repetition.to_bits(),
            ]
        })
        .collect()
}

/// The log-probabilities of a PickOut record.
fn read_logprobs(token: u32, out: &[u32]) -> TokenLogprobs {
    let n = (out[3] as usize).min(PICK_LOGPROBS);
    let values = 4 + PICK_LOGPROBS;
    TokenLogprobs {
        token,
        logprob: f32::from_bits(out[2]),
        top: (0..n)
            .map(|j| (out[4 + j], f32::from_bits(out[values + j])))
            .collect(),
    }
}
