//! What `lily bench` measures of the backend beyond its steps: a step's kernel families timed
//! launch by launch or from the stamps inside its graph, a prefill chunk's families, and the
//! device's copy rate (the decode ceiling).

use anyhow::{Context, Result, ensure};

use crate::decode::{self, PersistentStep};
use crate::prefill::encode_chunk;
use crate::state::CudaState;
use crate::step::{Scratch, StepRow, encode_step};
use crate::timeline::Timeline;
use crate::{CudaBackend, stamps};

impl CudaBackend {
    /// A step's rows of `states`, each choosing over the whole vocabulary.
    fn whole_vocabulary_rows<'a>(&self, states: &'a [&mut CudaState]) -> Vec<StepRow<'a>> {
        states
            .iter()
            .map(|state| StepRow {
                state,
                choices: self.config.vocab_size,
            })
            .collect()
    }

    /// That `states` are a step's rows (1 to [`Self::step_rows`]) with room for `steps` more.
    fn check_profiled(&self, states: &[&mut CudaState], steps: usize) -> Result<()> {
        ensure!(
            (1..=self.step_rows.max(1)).contains(&states.len()),
            "a profiled step takes 1 to {} sequences, not {}",
            self.step_rows.max(1),
            states.len()
        );
        ensure!(
            steps > 0 && states.iter().all(|s| s.len + steps <= s.max_seq),
            "no room for {steps} profiled steps"
        );
        Ok(())
    }

    /// Runs `steps` decode steps of `states` (one sequence, or a batch of up to
    /// [`Self::step_rows`]) without the graph, timing each kernel family on the GPU's timeline;
    /// returns milliseconds per step by family. Launch gaps that a graph would remove show up
    /// here, so the sum exceeds a graph step's time. The persistent step profiles one sequence.
    pub fn profile_decode(
        &self,
        states: &mut [&mut CudaState],
        steps: usize,
    ) -> Result<Vec<(&'static str, f64)>> {
        self.check_profiled(states, steps)?;
        let scratch = self.lock()?;
        if let Some(step) = &self.persistent {
            ensure!(states.len() == 1, "the persistent step takes one sequence");
            return self.profile_persistent(step, states[0], &scratch.decode, steps);
        }
        let mut timeline = Timeline::default();
        for _ in 0..steps {
            let rows = self.whole_vocabulary_rows(states);
            self.gpu.programmatic(|| {
                encode_step(
                    &self.gpu,
                    &self.config,
                    &self.weights,
                    &scratch.decode,
                    &rows,
                    Some(&mut timeline),
                )
            })?;
            for state in states.iter_mut() {
                state.len += 1;
            }
        }
        for state in states.iter_mut() {
            state.device_token = None;
        }
        self.gpu.sync()?;
        let mut totals = timeline.totals()?;
        totals.iter_mut().for_each(|(_, ms)| *ms /= steps as f64);
        totals.retain(|(family, _)| *family != "start");
        Ok(totals)
    }

    /// Whether the kernels stamp their waits ([`Self::stamp_decode`]).
    pub fn stamping(&self) -> bool {
        self.gpu.stamps.is_some()
    }

    /// The graph step of `states` (as [`Self::profile_decode`] takes them) by kernel family, from
    /// the stamps its kernels take inside the graph (kernels compiled with
    /// [`options::CudaOptions::stamps`]): warmed up, then replays stamped and the last but one
    /// summed (stamps.rs).
    pub fn stamp_decode(&self, states: &mut [&mut CudaState]) -> Result<Vec<stamps::FamilyStamps>> {
        let buffer = self
            .gpu
            .stamps
            .as_ref()
            .context("the kernels were not compiled to stamp their waits (LILY_STAMPS=1)")?;
        ensure!(
            self.persistent.is_none(),
            "stamps time the graph step, not the persistent one"
        );
        self.check_profiled(states, stamps::STEPS)?;
        let scratch = self.lock()?;
        let mut timeline = Timeline::by_launch();
        let rows = self.whole_vocabulary_rows(states);
        let (graph, names) = self
            .gpu
            .logging_launches(|| self.capture_step(&scratch.decode, &rows, Some(&mut timeline)))?;
        let families = timeline.launch_families()?;
        ensure!(
            families.len() == names.len(),
            "{} launches, {} of them in a family",
            names.len(),
            families.len()
        );
        let labels: Vec<String> = families
            .iter()
            .zip(&names)
            .map(|(family, name)| format!("{family} · {name}"))
            .collect();
        let header = [0u64, stamps::STAMP_RECORDS as u64];
        let run = |replays: usize, states: &mut [&mut CudaState]| -> Result<()> {
            for _ in 0..replays {
                graph.launch()?;
                states.iter_mut().for_each(|s| s.len += 1);
            }
            Ok(())
        };
        let mut buffer = buffer
            .lock()
            .map_err(|_| anyhow::anyhow!("stamp buffer lock poisoned"))?;
        run(stamps::WARM_REPLAYS, states)?;
        self.gpu
            .stream
            .memcpy_htod(&header, &mut buffer.slice_mut(..2))?;
        run(stamps::STAMPED_REPLAYS, states)?;
        self.gpu.sync()?;
        states.iter_mut().for_each(|s| s.device_token = None);
        // The header first, then only the records written.
        let header = self.gpu.stream.clone_dtoh(&buffer.slice(..2))?;
        let written = (header[0] as usize).min(stamps::STAMP_RECORDS);
        let words = self
            .gpu
            .stream
            .clone_dtoh(&buffer.slice(..2 + stamps::STAMP_WORDS * written))?;
        let launched = stamps::launches(&words, stamps::STAMPED_REPLAYS)?;
        stamps::step_families(&launched, &labels, stamps::STAMPED_REPLAYS)
    }

    /// The graph step of `states` (as [`Self::profile_decode`] takes them) replayed `steps`
    /// times back to back, without the host reading a token between replays: milliseconds a
    /// step on the GPU's timeline. Beside the timed decode, the difference is what the host's
    /// turn between steps costs (the read-back, the wake-up, the next launch), which reading
    /// each token one step behind would hide.
    pub fn replay_decode(&self, states: &mut [&mut CudaState], steps: usize) -> Result<f64> {
        ensure!(
            self.persistent.is_none(),
            "replays time the graph step, not the persistent one"
        );
        self.check_profiled(states, steps + 1)?;
        let scratch = self.lock()?;
        let rows = self.whole_vocabulary_rows(states);
        let graph = self.capture_step(&scratch.decode, &rows, None)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (
            self.gpu.ctx.new_event(timing)?,
            self.gpu.ctx.new_event(timing)?,
        );
        // One replay first, so that the timed ones find the graph uploaded and the code warm.
        graph.launch()?;
        start.record(&self.gpu.stream)?;
        for _ in 0..steps {
            graph.launch()?;
        }
        end.record(&self.gpu.stream)?;
        let ms = start.elapsed_ms(&end)? as f64;
        states.iter_mut().for_each(|s| {
            s.len += steps + 1;
            s.device_token = None;
        });
        Ok(ms / steps as f64)
    }

    /// [`Self::profile_decode`] on the persistent step: the kernel's own timestamps, one as block
    /// 0 leaves each op (so an op's time includes its barrier).
    fn profile_persistent(
        &self,
        step: &PersistentStep,
        state: &mut CudaState,
        scratch: &Scratch,
        steps: usize,
    ) -> Result<Vec<(&'static str, f64)>> {
        let marks = decode::op_families(&self.config).len() + 1;
        let timeline = self.gpu.zeros::<u64>(marks)?;
        let mut totals: Vec<(&'static str, f64)> = Vec::new();
        for _ in 0..steps {
            let vocab = self.config.vocab_size;
            self.persistent_step(step, state, scratch, vocab, Some(&timeline))?;
            let stamps = self.gpu.download(&timeline)?;
            for (family, ms) in decode::family_times(&self.config, &stamps) {
                match totals.iter_mut().find(|(f, _)| *f == family) {
                    Some((_, t)) => *t += ms / steps as f64,
                    None => totals.push((family, ms / steps as f64)),
                }
            }
        }
        state.device_token = None;
        Ok(totals)
    }

    /// Runs one prefill chunk of `tokens` (at most the chunk length) for `state`, timing each
    /// kernel family on the GPU's timeline; returns milliseconds by family.
    pub fn profile_prefill(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
    ) -> Result<Vec<(&'static str, f64)>> {
        self.check_room(state, tokens)?;
        let mut buffers = self.lock()?;
        let mut timeline = Timeline::default();
        encode_chunk(
            self.model(),
            &mut buffers.prefill,
            state,
            tokens,
            false,
            None,
            Some(&mut timeline),
        )?;
        state.len += tokens.len();
        self.gpu
            .stream
            .memcpy_htod(&[state.len as i32], &mut state.pos)?;
        state.device_token = None;
        self.gpu.sync()?;
        let mut totals = timeline.totals()?;
        totals.retain(|(family, _)| *family != "start");
        Ok(totals)
    }

    /// Device-to-device copy rate in bytes per second (read plus written), best of five copies
    /// of 1 GiB: the decode ceiling `lily bench` reports against.
    pub fn copy_bandwidth(&self) -> Result<f64> {
        let _lock = self.lock()?;
        let n = 1usize << 30;
        let src = self.gpu.zeros::<u8>(n)?;
        let mut dst = self.gpu.zeros::<u8>(n)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = 0f64;
        for _ in 0..5 {
            let (start, end) = (
                self.gpu.ctx.new_event(timing)?,
                self.gpu.ctx.new_event(timing)?,
            );
            start.record(&self.gpu.stream)?;
            self.gpu.stream.memcpy_dtod(&src, &mut dst)?;
            end.record(&self.gpu.stream)?;
            let ms = start.elapsed_ms(&end)? as f64;
            best = best.max(2.0 * n as f64 / (ms / 1e3));
        }
        Ok(best)
    }
}
