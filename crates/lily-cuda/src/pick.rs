//! The whole choice of a token on the device (kernels/pick.cu): the constraint's mask, the
//! penalties and logit_bias, temperature / top-k / min-p / top-p with the host's draw, and the
//! log-probabilities, applied to the logits where the step left them. Only the pick comes back:
//! the token and its top log-probabilities, 176 bytes instead of a megabyte of logits a token.
//! The rows of a batched step choose together, a row per grid y of each launch.
//!
//! The kernels follow the host's rule (`lily_core::choice::Choice::pick`) candidate for
//! candidate. Where the rule would walk past the best `PICK_TOP` tokens (no top-k, and a
//! distribution so flat that min-p, top-p or the draw reach beyond them), the device says so and
//! the host finishes the choice from the logits with the same draw.

use std::ffi::c_void;

use anyhow::{Context, Result, ensure};
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
pub(crate) const OUT_WORDS: usize = 4 + 2 * PICK_LOGPROBS;
/// PickOut's status when the host must finish the choice.
const PICK_HOST: u32 = 1;

/// One row's arguments, with the C layout of pick.cu's PickArgs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct PickArgs {
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

/// Rows one launch of the pick kernels takes, a row per grid y (pick.cu PICK_ROWS): a decode
/// step's most.
pub const PICK_ROWS: usize = crate::gpu::MAX_ROWS;

/// Every pick kernel's one parameter (pick.cu's PickRows): row `y` of the grid reads `row[y]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct PickRows {
    row: [PickArgs; PICK_ROWS],
}

/// Bytes of every pick kernel's parameter (the NVRTC test holds pick.cu to it).
pub fn pick_args_bytes() -> usize {
    std::mem::size_of::<PickRows>()
}

/// One row's buffers: a row's choice writes only its own.
struct RowScratch {
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
}

impl RowScratch {
    fn new(gpu: &Gpu, vocab: usize) -> Result<Self> {
        let lists = vocab.div_ceil(PICK_CHUNK);
        Ok(RowScratch {
            adjusted: gpu.zeros(vocab)?,
            allowed: gpu.zeros(vocab.div_ceil(32))?,
            adjustments: gpu.zeros(4 * 256)?,
            row_parts: gpu.zeros(2 * PICK_BLOCKS as usize)?,
            top_v: gpu.zeros(lists * PICK_TOP)?,
            top_i: gpu.zeros(lists * PICK_TOP)?,
            mass_parts: gpu.zeros(3 * lists)?,
            raw_top_v: gpu.zeros(lists * PICK_TOP)?,
            raw_top_i: gpu.zeros(lists * PICK_TOP)?,
        })
    }
}

/// The pick kernels' buffers, a set for each row a step can hold (one step runs at a time).
pub struct PickScratch {
    vocab: usize,
    /// Whether the vocabulary's candidate lists fit one sorting block; beyond, every choice is
    /// the host's, from the row.
    fits: bool,
    rows: Vec<RowScratch>,
    /// Every row's PickOut record, one after another.
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

/// One row's choice: the logits it chooses from (a row of the vocabulary, on the device), the
/// token slot the pick goes into (the next step's input), and the request's choice.
pub struct PickRow<'a, 'c> {
    pub logits: CudaView<'a, f32>,
    pub slot: &'a mut CudaSlice<u32>,
    pub choice: &'a mut Choice<'c>,
}

/// What a row's launches need besides its arguments, and what reading its record does.
#[derive(Clone, Copy)]
pub(crate) struct RowPlan {
    prepare: bool,
    lists: usize,
    adjustments: usize,
    raw_lists: bool,
    logprobs: Option<usize>,
    pub(crate) draw: f32,
}

impl PickScratch {
    /// Buffers for steps of up to `rows` sequences (1 to [`PICK_ROWS`]).
    pub fn new(gpu: &Gpu, vocab: usize, rows: usize) -> Result<Self> {
        ensure!(
            (1..=PICK_ROWS).contains(&rows),
            "the pick kernels take 1 to {PICK_ROWS} rows, not {rows}"
        );
        let lists = vocab.div_ceil(PICK_CHUNK);
        Ok(PickScratch {
            vocab,
            fits: lists * PICK_TOP <= PICK_CHUNK,
            rows: (0..rows)
                .map(|_| RowScratch::new(gpu, vocab))
                .collect::<Result<_>>()?,
            out: gpu.zeros(rows * OUT_WORDS)?,
            counts: PickCounts::default(),
        })
    }

    /// Whether the kernels choose for this vocabulary (else every choice is the host's).
    pub fn on_device(&self) -> bool {
        self.fits
    }

    pub fn counts(&self) -> PickCounts {
        self.counts
    }

    /// Makes each row's choice from its logits, writes the token into its slot and returns the
    /// picks in order: every row in one launch of each kernel and one read-back, each row's pick
    /// what it would be alone.
    pub fn pick(&mut self, gpu: &Gpu, rows: &mut [PickRow<'_, '_>]) -> Result<Vec<Pick>> {
        self.check_rows(rows)?;
        if !self.fits {
            return rows
                .iter_mut()
                .map(|row| {
                    let draw = row.choice.sampler.draw();
                    self.finish_on_host(gpu, row, draw)
                })
                .collect();
        }
        let plans = self.launch(gpu, rows)?;
        let out = gpu
            .stream
            .clone_dtoh(&self.out.slice(..rows.len() * OUT_WORDS))?;
        rows.iter_mut()
            .zip(&plans)
            .zip(out.chunks_exact(OUT_WORDS))
            .map(
                |((row, plan), out)| match self.read(row.choice, plan, out) {
                    Some(pick) => Ok(pick),
                    None => self.finish_on_host(gpu, row, plan.draw),
                },
            )
            .collect()
    }

    /// Whether the device always finishes `choice` itself, so that its token is in the slot
    /// once the kernels have run: a greedy rule, or a top-k within the candidates kept.
    pub(crate) fn finishes(&self, choice: &Choice<'_>) -> bool {
        let params = choice.sampler.params();
        self.fits && (params.is_greedy() || (1..=PICK_TOP).contains(&params.top_k))
    }

    /// Launches the choice of every row (each row's draw made now); row `i`'s record is
    /// [`Self::record`]`(i)` once they have run. Needs the candidate lists to fit one block.
    pub(crate) fn launch(
        &mut self,
        gpu: &Gpu,
        rows: &mut [PickRow<'_, '_>],
    ) -> Result<Vec<RowPlan>> {
        self.check_rows(rows)?;
        ensure!(
            self.fits,
            "the vocabulary's candidate lists outgrow one block"
        );
        let mut args = PickRows::default();
        let mut plans = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter_mut().enumerate() {
            let (row_args, plan) = self.row_args(gpu, i, row)?;
            args.row[i] = row_args;
            plans.push(plan);
        }
        let n = rows.len() as u32;
        let most = |f: fn(&RowPlan) -> usize| plans.iter().map(f).max().unwrap_or(0);
        if plans.iter().any(|p| p.prepare) {
            launch(gpu, "pick_prepare", (PICK_BLOCKS, n), 256, &mut args)?;
        }
        let adjustments = most(|p| p.adjustments);
        if adjustments > 0 {
            let blocks = adjustments.div_ceil(256) as u32;
            launch(gpu, "pick_adjust", (blocks, n), 256, &mut args)?;
        }
        let lists = most(|p| p.lists) as u32;
        launch(gpu, "pick_top", (lists, n), SORT_THREADS, &mut args)?;
        if plans.iter().any(|p| p.raw_lists) {
            launch(gpu, "pick_top_raw", (lists, n), SORT_THREADS, &mut args)?;
        }
        launch(gpu, "pick_choose", (1, n), SORT_THREADS, &mut args)?;
        Ok(plans)
    }

    fn check_rows(&self, rows: &[PickRow<'_, '_>]) -> Result<()> {
        ensure!(
            (1..=self.rows.len()).contains(&rows.len()),
            "the pick buffers take 1 to {} rows, not {}",
            self.rows.len(),
            rows.len()
        );
        let vocab = self.vocab;
        ensure!(
            rows.iter().all(|r| r.logits.len() >= vocab),
            "a row of logits holds {vocab} values"
        );
        Ok(())
    }

    /// Row `i`'s record (pick.cu's PickOut) on the device.
    pub(crate) fn record(&self, i: usize) -> CudaView<'_, u32> {
        self.out.slice(i * OUT_WORDS..(i + 1) * OUT_WORDS)
    }

    /// The pick a row's record holds, counted for `choice`'s penalties; None where the host must
    /// finish the choice from the logits.
    pub(crate) fn read(
        &mut self,
        choice: &mut Choice<'_>,
        plan: &RowPlan,
        out: &[u32],
    ) -> Option<Pick> {
        if out[0] == PICK_HOST {
            return None;
        }
        self.counts.on_device += 1;
        let token = out[1];
        choice.sampler.record(token);
        Some(Pick {
            token,
            logprobs: plan.logprobs.map(|_| read_logprobs(token, out)),
        })
    }

    /// [`Self::pick`] for one row.
    pub fn pick_one(
        &mut self,
        gpu: &Gpu,
        logits: CudaView<'_, f32>,
        slot: &mut CudaSlice<u32>,
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        let mut rows = [PickRow {
            logits,
            slot,
            choice,
        }];
        let mut picks = self.pick(gpu, &mut rows)?;
        picks.pop().context("the pick kernels returned no pick")
    }

    /// Row `i`'s arguments, its mask and penalties uploaded into its buffers, and the draw its
    /// sampler makes for this choice.
    fn row_args(
        &mut self,
        gpu: &Gpu,
        i: usize,
        row: &mut PickRow<'_, '_>,
    ) -> Result<(PickArgs, RowPlan)> {
        let (vocab, st) = (self.vocab, &gpu.stream);
        let s = &mut self.rows[i];
        let choice = &mut *row.choice;
        let choosable = choice.sampler.choosable(vocab);
        let draw = choice.sampler.draw();
        let params = choice.sampler.params().clone();
        let allowed = match &choice.allowed {
            Some(allowed) => {
                let bits = allowed.to_bits(choosable);
                st.memcpy_htod(&bits, &mut s.allowed.slice_mut(..bits.len()))?;
                ptr(&s.allowed, st)
            }
            None => 0,
        };
        let adjustments = choice.sampler.adjustments();
        if !adjustments.is_empty() {
            let words = adjustment_words(adjustments);
            if words.len() > s.adjustments.len() {
                s.adjustments = gpu.zeros(words.len().next_power_of_two())?;
            }
            st.memcpy_htod(&words, &mut s.adjustments.slice_mut(..words.len()))?;
        }
        let logprobs = choice.top_logprobs();
        let lists = choosable.div_ceil(PICK_CHUNK);
        // The top log-probabilities rank the raw logits; the candidates rank the adjusted ones,
        // which are the raw ones unless a mask or a penalty changed them.
        let raw_lists =
            logprobs.is_some_and(|k| k > 0) && (allowed != 0 || !adjustments.is_empty());
        let p = |b: &CudaSlice<f32>| ptr(b, st);
        let logits = ptr(&row.logits, st);
        // pick.cu needs_prepare: without log-probabilities, a mask or penalties the candidates
        // rank the logits as they are, and pick_prepare has nothing to do for the row.
        let prepare = logprobs.is_some() || allowed != 0 || !adjustments.is_empty();
        let args = PickArgs {
            logits,
            adjusted: if prepare { p(&s.adjusted) } else { logits },
            allowed,
            adjustments: ptr(&s.adjustments, st),
            row_parts: ptr(&s.row_parts, st),
            top_v: p(&s.top_v),
            top_i: ptr(&s.top_i, st),
            mass_parts: ptr(&s.mass_parts, st),
            raw_top_v: p(&s.raw_top_v),
            raw_top_i: ptr(&s.raw_top_i, st),
            token: ptr(&*row.slot, st),
            out: ptr(&self.out, st) + (i * OUT_WORDS * 4) as u64,
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
        let plan = RowPlan {
            prepare,
            lists,
            adjustments: adjustments.len(),
            raw_lists,
            logprobs,
            draw,
        };
        Ok((args, plan))
    }

    /// The choice made on the host from the row, with the draw the device was given.
    pub(crate) fn finish_on_host(
        &mut self,
        gpu: &Gpu,
        row: &mut PickRow<'_, '_>,
        draw: f32,
    ) -> Result<Pick> {
        let logits = gpu.stream.clone_dtoh(&row.logits.slice(..self.vocab))?;
        let pick = row.choice.pick_drawn(&logits, draw);
        gpu.stream.memcpy_htod(&[pick.token], &mut *row.slot)?;
        self.counts.finished_on_host += 1;
        Ok(pick)
    }
}

fn launch(
    gpu: &Gpu,
    name: &str,
    (blocks, rows): (u32, u32),
    threads: u32,
    args: &mut PickRows,
) -> Result<()> {
    gpu.launch_raw(
        gpu.function(name)?,
        ((blocks, rows, 1), threads),
        0,
        &mut [args as *mut PickRows as *mut c_void],
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
