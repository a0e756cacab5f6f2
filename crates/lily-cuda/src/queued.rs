//! Decode steps queued one ahead of the host (`DecodeRow::queue_next`, with
//! `CudaOptions::queue_steps`). Waiting for a step's tokens before launching the next leaves the
//! GPU idle for the copy's round trip and for whatever the host does with them (27-45 µs a step
//! at one sequence on an H100, docs/BENCHMARKS.md, thirteenth session). Here a call launches the
//! rows' step (where no queued one has made it already), then the step after it for every row
//! whose caller will feed the pick back, fed by the pick where the device left it in the row's
//! token slot, and only then reads the picks: each from a small page-locked record of its own
//! that an asynchronous copy fills behind the step, so reading one waits for that step alone.
//!
//! A row queues only where its next choice cannot depend on this one's pick (no mask, no
//! penalties: `Choice::is_memoryless`) and the device always finishes it (a greedy rule or a
//! top-k within the candidates: `PickScratch::finishes`), and only in a call whose rows the
//! device finishes too: a choice finished on the host reads logits that the queued step
//! overwrites.

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaView, PinnedHostSlice};
use lily_core::backend::DecodeRow;
use lily_core::choice::Pick;

use crate::pick::{OUT_WORDS, PickRow, RowPlan};
use crate::state::CudaState;
use crate::step::StepRow;
use crate::{Buffers, CudaBackend};

/// A state's two records: a queued step's pick lands in one while the host reads the other's.
pub(crate) struct Records([Record; 2]);

/// Where one step's pick lands: the argmax's token, or the pick kernels' record. Each is the
/// size of its copy, which takes its length from the destination. `copied` is recorded behind
/// the copy: the pinned slices' own events are recorded only where cudarc tracks streams, which
/// the backend turns off (one stream).
struct Record {
    token: PinnedHostSlice<u32>,
    picked: PinnedHostSlice<u32>,
    copied: CudaEvent,
}

impl Drop for Record {
    /// The page-locked memory is freed only once a copy into it has landed (a state dropped
    /// with a step queued).
    fn drop(&mut self) {
        let _ = self.copied.synchronize();
    }
}

/// A step queued for a state.
pub(crate) struct Queued {
    /// The pick it feeds on: the next call must feed the same.
    fed: u32,
    /// The record its pick lands in, and how to read it.
    record: usize,
    read: ReadAs,
}

/// How a row's pick is read from its record.
#[derive(Clone, Copy)]
enum ReadAs {
    /// The step's argmax: the record's first word.
    Argmax,
    /// The pick kernels' record (pick.cu's PickOut).
    Picked(RowPlan),
}

/// A row of a call: where its pick for this call comes from, and for a step run in this call,
/// the row of the step's logits it chose from.
struct Pending {
    record: usize,
    read: ReadAs,
    logits_row: usize,
}

impl CudaBackend {
    /// Whether `rows` take the queued path: queuing is on, and a row asks for it or has a step
    /// queued already (whose pick only this path returns).
    pub(crate) fn queues(&self, rows: &[DecodeRow<'_, CudaState>]) -> bool {
        self.queue_steps
            && self.persistent.is_none()
            && rows
                .iter()
                .any(|r| r.queue_next || r.state.queued.is_some())
    }

    /// One step of `rows` (at most [`Self::step_rows`]) by the queued path: the picks of their
    /// queued steps, a step now for the others, and the step after it queued for those that may.
    pub(crate) fn decode_queued(&self, rows: &mut [DecodeRow<'_, CudaState>]) -> Result<Vec<Pick>> {
        ensure!(
            rows.len() <= self.step_rows.max(1),
            "a step holds at most {} rows",
            self.step_rows.max(1)
        );
        let mut buffers = self.lock()?;
        let mut fresh = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            match &row.state.queued {
                Some(q) => ensure!(
                    q.fed == row.token,
                    "a step of this sequence is queued after token {}, but {} was fed",
                    q.fed,
                    row.token
                ),
                None => {
                    self.check_room(row.state, &[row.token])?;
                    fresh.push(i);
                }
            }
        }
        let mut pending: Vec<Option<Pending>> = rows
            .iter_mut()
            .map(|r| {
                r.state.queued.take().map(|q| Pending {
                    record: q.record,
                    read: q.read,
                    logits_row: 0,
                })
            })
            .collect();
        for &i in &fresh {
            let row = &mut rows[i];
            self.set_token(row.state, row.token)?;
        }
        if !fresh.is_empty() {
            let reads = self.launch_recorded(&mut buffers, rows, &fresh, |_| 0)?;
            for (j, (&i, read)) in fresh.iter().zip(reads).enumerate() {
                pending[i] = Some(Pending {
                    record: 0,
                    read,
                    logits_row: j,
                });
            }
        }
        // The steps queued now, where every row's pick is final on the device.
        let finished = rows
            .iter()
            .all(|r| r.choice.is_raw_greedy() || buffers.pick.finishes(&r.choice));
        let ahead: Vec<usize> = (0..rows.len())
            .filter(|&i| {
                let r = &rows[i];
                finished
                    && r.queue_next
                    && r.choice.is_memoryless()
                    && r.state.len < r.state.max_seq
            })
            .collect();
        let other = |i: usize| pending[i].as_ref().map_or(1, |p| 1 - p.record);
        let records: Vec<usize> = (0..rows.len()).map(other).collect();
        let queued = if ahead.is_empty() {
            Vec::new()
        } else {
            self.launch_recorded(&mut buffers, rows, &ahead, |i| records[i])?
        };
        let mut picks = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter_mut().enumerate() {
            let p = pending[i].take().context("a row with no step")?;
            let pick = self.read_record(&mut buffers, row, &p, ahead.is_empty())?;
            row.state.device_token = Some(pick.token);
            picks.push(pick);
        }
        for (&i, read) in ahead.iter().zip(queued) {
            let state = &mut rows[i].state;
            state.queued = Some(Queued {
                fed: picks[i].token,
                record: records[i],
                read,
            });
            // The queued step's own pick is in the slot now, unknown until read.
            state.device_token = None;
        }
        Ok(picks)
    }

    /// One step of the rows `which` of `rows` (each with its input in its token slot), then
    /// their choices, each row's pick copied into its record `record(i)` behind them; how each
    /// is to be read. Advances each row's length.
    fn launch_recorded(
        &self,
        buffers: &mut Buffers,
        rows: &mut [DecodeRow<'_, CudaState>],
        which: &[usize],
        record: impl Fn(usize) -> usize,
    ) -> Result<Vec<ReadAs>> {
        let vocab = self.config.vocab_size;
        // The graphs as the plain path launches them (decode_choose, decode_rows), so that
        // either path replays the other's.
        if let [i] = which {
            let row = &mut rows[*i];
            let c = &row.choice;
            let greedy = c.is_raw_greedy().then(|| c.sampler.choosable(vocab));
            self.step(row.state, &buffers.decode, greedy)?;
        } else {
            let step_rows: Vec<StepRow<'_>> = which
                .iter()
                .map(|&i| StepRow {
                    state: &*rows[i].state,
                    choices: rows[i].choice.sampler.choosable(vocab),
                })
                .collect();
            self.replay_batch(buffers, &step_rows)?;
            which.iter().for_each(|&i| rows[i].state.len += 1);
        }
        // (step row j, row i) of the rows the pick kernels choose for, in order.
        let picked: Vec<(usize, usize)> = which
            .iter()
            .enumerate()
            .filter(|&(_, &i)| !rows[i].choice.is_raw_greedy())
            .map(|(j, &i)| (j, i))
            .collect();
        let mut plans = Vec::new();
        if !picked.is_empty() {
            let Buffers { decode, pick, .. } = &mut *buffers;
            let mut pick_rows: Vec<PickRow<'_, '_>> = rows
                .iter_mut()
                .enumerate()
                .filter_map(|(i, row)| {
                    let &(j, _) = picked.iter().find(|&&(_, r)| r == i)?;
                    Some(PickRow {
                        logits: decode.logits.slice(j * vocab..(j + 1) * vocab),
                        slot: &mut row.state.token,
                        choice: &mut row.choice,
                    })
                })
                .collect();
            plans = pick.launch(&self.gpu, &mut pick_rows)?;
        }
        let mut reads = Vec::with_capacity(which.len());
        let mut plans = plans.into_iter().enumerate();
        for (j, &i) in which.iter().enumerate() {
            let (src, read) = if rows[i].choice.is_raw_greedy() {
                (buffers.decode.chosen.slice(j..j + 1), ReadAs::Argmax)
            } else {
                let (k, plan) = plans.next().context("a picked row without a plan")?;
                (buffers.pick.record(k), ReadAs::Picked(plan))
            };
            copy_record(self, src, &mut *rows[i].state, record(i), read)?;
            reads.push(read);
        }
        Ok(reads)
    }

    /// Row `i`'s pick from its record, waiting for the copy that fills it. A pick the device
    /// could not finish is finished on the host from the logits, which must still be the step's
    /// (`logits_intact`: nothing was queued after it).
    fn read_record(
        &self,
        buffers: &mut Buffers,
        row: &mut DecodeRow<'_, CudaState>,
        pending: &Pending,
        logits_intact: bool,
    ) -> Result<Pick> {
        let records = row.state.records.as_ref().context("no records")?;
        let record = &records.0[pending.record];
        record.copied.synchronize()?;
        let plan = match pending.read {
            ReadAs::Argmax => {
                return Ok(Pick {
                    token: record.token.as_slice()?[0],
                    logprobs: None,
                });
            }
            ReadAs::Picked(plan) => plan,
        };
        let words = record.picked.as_slice()?;
        if let Some(pick) = buffers.pick.read(&mut row.choice, &plan, words) {
            return Ok(pick);
        }
        if !logits_intact {
            bail!("a queued step's choice was left to the host, whose logits are gone");
        }
        // Only a step run in this call (never a queued one: those finish on the device) gets
        // here.
        let (vocab, j) = (self.config.vocab_size, pending.logits_row);
        let Buffers { decode, pick, .. } = &mut *buffers;
        let mut pick_row = PickRow {
            logits: decode.logits.slice(j * vocab..(j + 1) * vocab),
            slot: &mut row.state.token,
            choice: &mut row.choice,
        };
        pick.finish_on_host(&self.gpu, &mut pick_row, plan.draw)
    }
}

/// Makes a state's records at its first queued step: page-locked buffers of one pick each.
fn ensure_records(backend: &CudaBackend, state: &mut CudaState) -> Result<()> {
    if state.records.is_none() {
        let ctx = &backend.gpu.ctx;
        // SAFETY: a record is read only after a copy into it has completed (`as_slice` waits
        // for the copy's event), and any bit pattern is a valid u32.
        let make = |len| unsafe { ctx.alloc_pinned_with_flags::<u32>(len, 0) };
        let record = || -> Result<Record> {
            Ok(Record {
                token: make(1)?,
                picked: make(OUT_WORDS)?,
                copied: ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            })
        };
        state.records = Some(Records([record()?, record()?]));
    }
    Ok(())
}

/// Queues the copy of a pick (an argmax's token or a PickOut record, as `read` says) into
/// record `k` of `state`.
fn copy_record(
    backend: &CudaBackend,
    src: CudaView<'_, u32>,
    state: &mut CudaState,
    k: usize,
    read: ReadAs,
) -> Result<()> {
    ensure_records(backend, state)?;
    let record = &mut state.records.as_mut().context("no records")?.0[k];
    let dst = match read {
        ReadAs::Argmax => &mut record.token,
        ReadAs::Picked(_) => &mut record.picked,
    };
    ensure!(
        dst.len() == src.len(),
        "a record of {} words, not {}",
        dst.len(),
        src.len()
    );
    backend.gpu.stream.memcpy_dtoh(&src, dst)?;
    record.copied.record(&backend.gpu.stream)?;
    Ok(())
}
