//! How the backend runs decode steps: a sequence's graph captured once and replayed (or the
//! persistent step), a batch's graph keyed by its rows, and the choice after a step, made by the
//! step's own argmax or by the pick kernels on the logits it left on the device.

use anyhow::{Context, Result, ensure};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};
use lily_core::backend::DecodeRow;
use lily_core::choice::{Choice, Pick};

use crate::decode::PersistentStep;
use crate::pick::{self, PickRow};
use crate::state::CudaState;
use crate::step::{self, Scratch, StepRow, encode_step};
use crate::timeline::Timeline;
use crate::{Buffers, CudaBackend};

/// Batch graphs kept at once ([`CudaBackend::replay_batch`]). A graph of states that have
/// ended is never replayed (ids are not reused) and leaves as newer ones come.
const BATCH_GRAPHS: usize = 4;

/// A captured step of several sequences: which states (by [`CudaState::id`]) with which
/// argmax ranges, in row order.
pub(crate) struct BatchGraph {
    rows: Vec<(u64, usize)>,
    graph: CudaGraph,
}

impl CudaBackend {
    /// Runs one step for `state` (its token slot already holds the input): replays the state's
    /// graph, capturing it on first use or when its argmax must range over other `choices`
    /// (`None`: the choice is not wanted, any graph will do).
    pub(crate) fn step(
        &self,
        state: &mut CudaState,
        scratch: &Scratch,
        choices: Option<usize>,
    ) -> Result<()> {
        if let Some(step) = &self.persistent {
            let choices = choices.unwrap_or(self.config.vocab_size);
            return self.persistent_step(step, state, scratch, choices, None);
        }
        let stale = match (&state.graph, choices) {
            (None, _) => true,
            (Some((_, had)), Some(want)) => *had != want,
            (Some(_), None) => false,
        };
        if stale {
            let choices = choices.unwrap_or(self.config.vocab_size);
            state.graph = None;
            let graph = self.capture_step(scratch, &[StepRow { state, choices }], None)?;
            state.graph = Some((graph, choices));
        }
        state.graph.as_ref().map(|(g, _)| g.launch()).transpose()?;
        state.len += 1;
        Ok(())
    }

    /// One decode step of `rows` captured as a graph (launched programmatically), for replay;
    /// with a timeline (of launch counts: a capture may record nothing else), its families marked.
    pub(crate) fn capture_step(
        &self,
        scratch: &Scratch,
        rows: &[StepRow<'_>],
        timeline: Option<&mut Timeline>,
    ) -> Result<CudaGraph> {
        self.gpu
            .stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let encoded = self.gpu.programmatic(|| {
            let (gpu, c, w) = (&self.gpu, &self.config, &self.weights);
            encode_step(gpu, c, w, scratch, rows, timeline)
        });
        // The capture ends whether or not the encoding failed, so the stream is usable after.
        let graph = self.gpu.stream.end_capture(CUgraphInstantiate_flags(0));
        encoded?;
        graph?.context("graph capture produced no graph")
    }

    /// Makes `choice` from the logits the step or prefill left in the decode scratch, on the
    /// device, unless it is a plain argmax, which the step has made already (`greedy_done`) or
    /// which is made here.
    pub(crate) fn choose(
        &self,
        buffers: &mut Buffers,
        state: &mut CudaState,
        choice: &mut Choice<'_>,
        greedy_done: bool,
    ) -> Result<Pick> {
        let pick = if choice.is_raw_greedy() {
            if !greedy_done {
                let choices = choice.sampler.choosable(self.config.vocab_size);
                step::device_argmax(&self.gpu, &buffers.decode, state, choices)?;
            }
            Pick {
                token: self.gpu.download(&state.token)?[0],
                logprobs: None,
            }
        } else {
            let Buffers { decode, pick, .. } = buffers;
            let row = decode.logits.slice(..self.config.vocab_size);
            pick.pick_one(&self.gpu, row, &mut state.token, choice)?
        };
        state.device_token = Some(pick.token);
        Ok(pick)
    }

    /// The logits the last batched step left for its first `rows` rows, row after row: what a
    /// test compares with each sequence's step alone.
    pub fn batch_logits(&self, rows: usize) -> Result<Vec<f32>> {
        ensure!(
            rows <= self.step_rows,
            "a step holds at most {} rows",
            self.step_rows
        );
        let buffers = self.lock()?;
        let all = buffers.decode.logits.slice(..rows * self.config.vocab_size);
        Ok(self.gpu.stream.clone_dtoh(&all)?)
    }

    /// How the choices made on the device ended so far (`pick`).
    pub fn pick_counts(&self) -> Result<pick::PickCounts> {
        Ok(self.lock()?.pick.counts())
    }

    /// Makes `choice` from a row of `logits` given by the host, on the device, as a step would:
    /// the device's choice on inputs a test controls.
    pub fn choose_from(&self, logits: &[f32], choice: &mut Choice<'_>) -> Result<Pick> {
        ensure!(
            logits.len() == self.config.vocab_size,
            "a row of {} logits, not {}",
            self.config.vocab_size,
            logits.len()
        );
        let mut buffers = self.lock()?;
        let Buffers { decode, pick, .. } = &mut *buffers;
        let vocab = self.config.vocab_size;
        self.gpu
            .stream
            .memcpy_htod(logits, &mut decode.logits.slice_mut(..vocab))?;
        let mut slot = self.gpu.zeros::<u32>(1)?;
        pick.pick_one(&self.gpu, decode.logits.slice(..vocab), &mut slot, choice)
    }

    /// One persistent step of `state` (its table made at its first step), its choice over the
    /// first `choices` tokens; with a timeline, stamped op by op.
    pub(crate) fn persistent_step(
        &self,
        step: &PersistentStep,
        state: &mut CudaState,
        scratch: &Scratch,
        choices: usize,
        timeline: Option<&CudaSlice<u64>>,
    ) -> Result<()> {
        if state.step_table.is_none() {
            state.step_table = Some(step.state_table(&self.gpu, state)?);
        }
        let table = state.step_table.as_ref().context("no state table")?;
        step.launch(
            &self.gpu,
            &self.config,
            scratch,
            state,
            table,
            choices,
            timeline,
        )?;
        state.len += 1;
        Ok(())
    }

    /// One batched step of `rows` (2 to [`Self::step_rows`] sequences, each checked already):
    /// their graph replayed, captured first when the batch differs from the last one, then each
    /// row's choice: the step's own argmax where that is the choice, else the pick kernels on
    /// the row's logits.
    pub(crate) fn decode_rows(&self, rows: &mut [DecodeRow<'_, CudaState>]) -> Result<Vec<Pick>> {
        let mut buffers = self.lock()?;
        for row in rows.iter_mut() {
            self.set_token(row.state, row.token)?;
        }
        let step_rows: Vec<StepRow<'_>> = rows
            .iter()
            .map(|r| StepRow {
                state: &*r.state,
                choices: r.choice.sampler.choosable(self.config.vocab_size),
            })
            .collect();
        self.replay_batch(&mut buffers, &step_rows)?;
        let chosen = self
            .gpu
            .stream
            .clone_dtoh(&buffers.decode.chosen.slice(..rows.len()))?;
        let vocab = self.config.vocab_size;
        // The rows that choose otherwise than by the step's argmax, all in one set of pick
        // launches.
        let Buffers { decode, pick, .. } = &mut *buffers;
        let mut picked = Vec::new();
        let mut pick_rows = Vec::new();
        for (i, row) in rows.iter_mut().enumerate() {
            row.state.len += 1;
            if !row.choice.is_raw_greedy() {
                picked.push(i);
                pick_rows.push(PickRow {
                    logits: decode.logits.slice(i * vocab..(i + 1) * vocab),
                    slot: &mut row.state.token,
                    choice: &mut row.choice,
                });
            }
        }
        let mut device_picks = if pick_rows.is_empty() {
            Vec::new()
        } else {
            pick.pick(&self.gpu, &mut pick_rows)?
        }
        .into_iter();
        drop(pick_rows);
        let mut picks = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter_mut().enumerate() {
            let pick = if picked.contains(&i) {
                device_picks
                    .next()
                    .context("the pick kernels returned fewer picks than rows")?
            } else {
                Pick {
                    token: chosen[i],
                    logprobs: None,
                }
            };
            row.state.device_token = Some(pick.token);
            picks.push(pick);
        }
        Ok(picks)
    }

    /// Launches the step of `rows` (2 to [`Self::step_rows`], each input in its token slot):
    /// the graph of an earlier batch of the same rows replayed, else captured first. A few are
    /// kept: a batch larger than a step alternates between its groups' graphs, and a row joining
    /// the queued path runs a step of its own beside the batch's (queued.rs).
    pub(crate) fn replay_batch(&self, buffers: &mut Buffers, rows: &[StepRow<'_>]) -> Result<()> {
        let key: Vec<(u64, usize)> = rows.iter().map(|r| (r.state.id, r.choices)).collect();
        let batch = match buffers.batches.iter().position(|b| b.rows == key) {
            Some(i) => buffers.batches.remove(i),
            None => {
                if buffers.batches.len() == BATCH_GRAPHS {
                    buffers.batches.remove(0);
                }
                let graph = self.capture_step(&buffers.decode, rows, None)?;
                BatchGraph { rows: key, graph }
            }
        };
        batch.graph.launch()?;
        buffers.batches.push(batch);
        Ok(())
    }

    pub(crate) fn set_token(&self, state: &mut CudaState, token: u32) -> Result<()> {
        if state.device_token != Some(token) {
            self.gpu.stream.memcpy_htod(&[token], &mut state.token)?;
            state.device_token = Some(token);
        }
        Ok(())
    }
}
