//! The CUDA backend. Kernels are CUDA C++ files under `kernels/`, compiled with NVRTC at start
//! for the loaded model's dimensions and the GPU's architecture (`compile`), each paired with
//! the Rust code that launches it (`step`). A decode step runs entirely on the device: captured
//! once per sequence as a CUDA graph of launches, or, with `CudaOptions::decode` persistent, as
//! one persistent kernel (`decode`). Prefill runs the prompt in chunks through batched
//! kernels (`prefill`): tensor-core GEMMs, routing on the device, a register-resident GDN scan and
//! causal attention over the cache.

pub mod attention_prefill;
pub mod compile;
pub mod decode;
pub mod gdn_chunked;
pub mod gdn_prefill;
pub mod gemm;
pub mod gemm_wgmma;
pub mod gemv;
pub mod gemv_imma;
pub mod gpu;
pub mod kernel_args;
pub mod mat;
pub mod moe_imma;
pub mod moe_prefill;
pub mod options;
pub mod pick;
mod prefill;
pub mod stamps;
mod state;
mod step;
mod step_constants;
pub mod synthetic;
pub mod weights;

use std::sync::Mutex;

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};
use lily_core::backend::{Backend, DecodeRow, LogitRows};
use lily_core::choice::{Choice, Pick};
use lily_core::config::ModelConfig;
use lily_core::weights::ModelWeights;

pub use compile::KvPrecision;
pub use gpu::gpu_available;
pub use options::{CudaOptions, DEFAULT_PREFILL_CHUNK, DecodeKernels};
pub use state::CudaState;

use crate::decode::{DecodePath, PersistentStep};
use crate::gpu::{Gpu, ptr};
use crate::pick::{PickRow, PickScratch};
use crate::prefill::{Model, PrefillScratch, encode_chunk};
use crate::step::{Scratch, StepRow, Timeline, encode_step};
use crate::weights::{DeviceWeights, HostWeights, WeightSource};

pub struct CudaBackend {
    config: ModelConfig,
    gpu: Gpu,
    weights: DeviceWeights,
    /// The persistent decode step, or None where decode replays the graph of launches.
    persistent: Option<PersistentStep>,
    /// One step or chunk runs at a time; the scratch activations are shared by every sequence.
    scratch: Mutex<Buffers>,
    prefill_chunk: usize,
    /// The most sequences one decode step advances (the batched GEMVs' shared memory bounds it).
    step_rows: usize,
}

struct Buffers {
    decode: Scratch,
    prefill: PrefillScratch,
    pick: PickScratch,
    /// The captured step of the last batch of several sequences.
    batch: Option<BatchGraph>,
}

/// A captured step of several sequences: which states (by [`CudaState::id`]) with which
/// argmax ranges, in row order.
struct BatchGraph {
    rows: Vec<(u64, usize)>,
    graph: CudaGraph,
}

/// Device memory the backend takes beyond weights and sequence state: the prefill chunk's
/// activations, the decode step's for its most rows, and 128 MiB for the choice's scratch and
/// allocator slack.
pub fn activation_bytes(c: &ModelConfig, options: &CudaOptions) -> usize {
    PrefillScratch::bytes(c, options.prefill_chunk, options.gdn_prefill)
        + Scratch::bytes(c)
        + (128 << 20)
}

/// Logit rows computed per lm_head GEMM when every row is wanted (teacher-forced scoring): a
/// `[rows, vocab]` f32 buffer of 64 rows is 64 MB at the real vocabulary.
const LOGIT_ROWS: usize = 64;

// SAFETY: every use of the stream and the scratch buffers goes through `&self` methods that take
// the scratch lock first, so work from two threads never interleaves on the stream.
unsafe impl Sync for CudaBackend {}
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    /// The host model on the GPU, with the environment's options ([`CudaOptions::from_env`]).
    pub fn new(config: ModelConfig, host: &ModelWeights) -> Result<Self> {
        Self::with_options(config, host, &CudaOptions::from_env()?)
    }

    /// As [`CudaBackend::new`] with the KV cache stored as `kv`.
    pub fn with_kv(config: ModelConfig, host: &ModelWeights, kv: KvPrecision) -> Result<Self> {
        Self::with_options(config, host, &CudaOptions::from_env()?.with_kv(kv))
    }

    /// The host model on the GPU, as `options` say.
    pub fn with_options(
        config: ModelConfig,
        host: &ModelWeights,
        options: &CudaOptions,
    ) -> Result<Self> {
        Self::from_source(config, &mut HostWeights(host), options)
    }

    /// A backend whose weights come from `src`: the host model ([`HostWeights`]), or a synthetic
    /// model made on the device ([`synthetic::SyntheticWeights`]).
    pub fn from_source(
        config: ModelConfig,
        src: &mut dyn WeightSource,
        options: &CudaOptions,
    ) -> Result<Self> {
        let prefill_chunk = options.prefill_chunk;
        check_shapes(&config)?;
        ensure!(
            prefill_chunk > 0,
            "the prefill chunk must hold at least one token"
        );
        let gpu = Gpu::with_options(&config, options)?;
        // Refused here rather than at the first prompt: a device without the shared memory for
        // any prefill attention block shape.
        attention_prefill::block_for(&gpu, &config)?;
        // The memory plan, before anything is allocated: weights as stored, the prefill chunk's
        // activations, and 256 MiB for the decode step and the first sequence's state
        // (new_state checks its own KV cache).
        let activations = activation_bytes(&config, options);
        let need = src.device_bytes(&config) + activations;
        let (free, total) = gpu.memory()?;
        ensure!(
            need <= free,
            "the weights need {:.2} GB of GPU memory (with {:.2} GB of activations for \
             {prefill_chunk}-token prefill chunks and decoding), but {} has {:.2} GB free of {:.2} GB",
            need as f64 / 1e9,
            activations as f64 / 1e9,
            gpu.name,
            free as f64 / 1e9,
            total as f64 / 1e9
        );
        let weights = DeviceWeights::build(&gpu, &config, src).context("loading the weights")?;
        let persistent = match options.decode {
            DecodePath::Persistent => Some(PersistentStep::new(&gpu, &config, &weights).context(
                "the persistent decode step (LILY_DECODE=graph replays launches instead)",
            )?),
            DecodePath::Graph => None,
        };
        let step_rows = gemv::step_rows(
            &config,
            &weights.gemv_formats(),
            gpu.shared_optin,
            gpu.decode_kernels,
        );
        let scratch = Mutex::new(Buffers {
            decode: Scratch::new(&gpu, &config)?,
            prefill: PrefillScratch::new(&gpu, &config, prefill_chunk)?,
            pick: PickScratch::new(&gpu, config.vocab_size, step_rows.max(1))?,
            batch: None,
        });
        // Every weight is written before the first step: kernels may read weights ahead of their
        // pdl_wait(), which orders them only after the kernel before them.
        gpu.sync()?;
        Ok(CudaBackend {
            config,
            gpu,
            weights,
            persistent,
            scratch,
            prefill_chunk,
            step_rows,
        })
    }

    /// The most sequences one decode step advances; a larger batch runs as several steps.
    pub fn step_rows(&self) -> usize {
        self.step_rows
    }

    /// Whether decode steps run the persistent kernel (else the graph of launches).
    pub fn persistent_decode(&self) -> bool {
        self.persistent.is_some()
    }

    fn model(&self) -> Model<'_> {
        Model {
            gpu: &self.gpu,
            c: &self.config,
            w: &self.weights,
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Buffers>> {
        self.scratch
            .lock()
            .map_err(|_| anyhow::anyhow!("GPU scratch lock poisoned"))
    }

    /// Runs one step for `state` (its token slot already holds the input): replays the state's
    /// graph, capturing it on first use or when its argmax must range over other `choices`
    /// (`None`: the choice is not wanted, any graph will do).
    fn step(&self, state: &mut CudaState, scratch: &Scratch, choices: Option<usize>) -> Result<()> {
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
    fn capture_step(
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
    fn choose(
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

    /// One persistent step of `state` (its table made at its first step), its choice over the
    /// first `choices` tokens; with a timeline, stamped op by op.
    fn persistent_step(
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

    /// Runs `tokens` through the prefill chunks. `All` returns every row's logits; `Last` leaves
    /// the last row's in the decode scratch's `logits`, on the device; `None` computes none. The
    /// device position is left stale ([`Self::set_position`]).
    fn encode_prompt(
        &self,
        buffers: &mut Buffers,
        state: &mut CudaState,
        tokens: &[u32],
        rows: LogitRows,
    ) -> Result<Vec<f32>> {
        let Buffers {
            decode, prefill, ..
        } = buffers;
        let (vocab, h) = (self.config.vocab_size, self.config.hidden_size);
        let all = rows == LogitRows::All;
        let chunks: Vec<&[u32]> = tokens.chunks(prefill.chunk).collect();
        let mut out = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let normed = encode_chunk(self.model(), prefill, state, chunk, all, None)?;
            state.len += chunk.len();
            if all {
                for first in (0..chunk.len()).step_by(LOGIT_ROWS) {
                    let n = LOGIT_ROWS.min(chunk.len() - first);
                    let x = normed + (first * h * 4) as u64;
                    let logits = self.gpu.zeros::<f32>(n * vocab)?;
                    let y = ptr(&logits, &self.gpu.stream);
                    gemm::gemm(&self.gpu, &self.weights.lm_head, x, n, y, vocab, 0)?;
                    out.extend(self.gpu.download(&logits)?);
                }
            } else if i + 1 == chunks.len() && rows == LogitRows::Last {
                let y = ptr(&decode.logits, &self.gpu.stream);
                gemm::gemm(&self.gpu, &self.weights.lm_head, normed, 1, y, vocab, 0)?;
            }
        }
        state.device_token = None;
        Ok(out)
    }

    /// The first row of the decode scratch's logits: a prefill's last row, a single step's row.
    fn first_logits(&self, s: &Scratch) -> Result<Vec<f32>> {
        let row = s.logits.slice(..self.config.vocab_size);
        Ok(self.gpu.stream.clone_dtoh(&row)?)
    }

    /// One batched step of `rows` (2 to [`Self::step_rows`] sequences, each checked already):
    /// their graph replayed, captured first when the batch differs from the last one, then each
    /// row's choice: the step's own argmax where that is the choice, else the pick kernels on
    /// the row's logits.
    fn decode_rows(&self, rows: &mut [DecodeRow<'_, CudaState>]) -> Result<Vec<Pick>> {
        let mut buffers = self.lock()?;
        for row in rows.iter_mut() {
            self.set_token(row.state, row.token)?;
        }
        let key: Vec<(u64, usize)> = rows
            .iter()
            .map(|r| {
                (
                    r.state.id,
                    r.choice.sampler.choosable(self.config.vocab_size),
                )
            })
            .collect();
        if buffers.batch.as_ref().is_none_or(|b| b.rows != key) {
            buffers.batch = None;
            let step_rows: Vec<StepRow<'_>> = rows
                .iter()
                .zip(&key)
                .map(|(r, &(_, choices))| StepRow {
                    state: &*r.state,
                    choices,
                })
                .collect();
            let graph = self.capture_step(&buffers.decode, &step_rows, None)?;
            buffers.batch = Some(BatchGraph { rows: key, graph });
        }
        if let Some(batch) = &buffers.batch {
            batch.graph.launch()?;
        }
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

    /// The decode graph reads the position from the device.
    fn set_position(&self, state: &mut CudaState) -> Result<()> {
        self.gpu
            .stream
            .memcpy_htod(&[state.len as i32], &mut state.pos)?;
        Ok(())
    }

    fn check_prompt(&self, state: &CudaState, tokens: &[u32]) -> Result<()> {
        ensure!(!tokens.is_empty(), "no tokens to run");
        self.check_room(state, tokens)
    }

    fn set_token(&self, state: &mut CudaState, token: u32) -> Result<()> {
        if state.device_token != Some(token) {
            self.gpu.stream.memcpy_htod(&[token], &mut state.token)?;
            state.device_token = Some(token);
        }
        Ok(())
    }

    fn check_room(&self, state: &CudaState, tokens: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is out of range (vocabulary size {vocab})");
        }
        if state.len + tokens.len() > state.max_seq {
            bail!(
                "sequence of {} tokens exceeds the context of {} tokens",
                state.len + tokens.len(),
                state.max_seq
            );
        }
        Ok(())
    }
}

/// Shapes the decode kernels are written for: one thread per head element in the per-head kernels
/// (at most 1,024 a block), the attention split's shared memory (48 KiB a block: queries and four
/// warps' partial outputs of one GQA group), one warp's registers for the router's probabilities.
fn check_shapes(c: &ModelConfig) -> Result<()> {
    let group = c.num_attention_heads / c.num_kv_heads;
    // Prefill attention keeps 16 rows × head dim f32 of output per warp in registers (128 a lane
    // at 256) and feeds the tensor cores 16 dims at a time.
    ensure!(
        c.head_dim.is_multiple_of(16) && c.head_dim <= 256,
        "the CUDA prefill attention needs a head dim that is a multiple of 16 and at most 256, not {}",
        c.head_dim
    );
    ensure!(
        c.head_dim <= 1024 && c.linear_value_head_dim <= 1024,
        "the CUDA kernels need head dims of at most 1,024 (head_dim {}, linear_value_head_dim {})",
        c.head_dim,
        c.linear_value_head_dim
    );
    ensure!(
        5 * group * c.head_dim * 4 + 1024 <= 48 * 1024,
        "the CUDA attention kernel holds a GQA group in shared memory: {group} query heads of {} \
         dims per KV head is too many",
        c.head_dim
    );
    ensure!(
        c.num_experts <= 1024,
        "the CUDA router handles at most 1,024 experts, not {}",
        c.num_experts
    );
    Ok(())
}

impl Backend for CudaBackend {
    type State = CudaState;

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device_name(&self) -> String {
        // The GEMM path too, so that a benchmark records which kernels it timed (LILY_GEMM).
        let gemm = match self.gpu.gemm_path() {
            gemm_wgmma::GemmPath::MmaSync => "mma.sync",
            gemm_wgmma::GemmPath::Wgmma => "wgmma",
        };
        let decode = if self.persistent.is_some() {
            "persistent"
        } else {
            "graph"
        };
        format!(
            "{} ({}, {gemm} GEMMs, {decode} decode)",
            self.gpu.name, self.gpu.arch
        )
    }

    fn max_prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    fn new_state(&self, max_seq: usize) -> Result<CudaState> {
        ensure!(max_seq > 0, "the context must hold at least one token");
        let kv = self.config.kv_bytes_per_token(self.gpu.kv.bytes()) as usize * max_seq;
        let (free, _) = self.gpu.memory()?;
        ensure!(
            kv + self.config.recurrent_state_bytes() as usize <= free,
            "a context of {max_seq} tokens needs {:.2} GB of KV cache and state, but the GPU has {:.2} GB free",
            kv as f64 / 1e9,
            free as f64 / 1e9
        );
        CudaState::new(&self.gpu, &self.config, max_seq)
    }

    fn state_len(&self, state: &CudaState) -> usize {
        state.len
    }

    /// The whole preallocated context counts, not just the tokens consumed.
    fn state_bytes(&self, state: &CudaState) -> usize {
        let c = &self.config;
        let kv = c.kv_bytes_per_token(self.gpu.kv.bytes()) * state.max_seq as u64;
        (kv + c.conv_state_bytes(4) + c.recurrent_state_bytes()) as usize
    }

    fn fork(&self, state: &CudaState) -> Result<CudaState> {
        let _lock = self.lock()?;
        state.fork(&self.gpu)
    }

    fn prefill(&self, state: &mut CudaState, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        self.check_prompt(state, tokens)?;
        let mut buffers = self.lock()?;
        let all = self.encode_prompt(&mut buffers, state, tokens, rows)?;
        self.set_position(state)?;
        match rows {
            LogitRows::All => Ok(all),
            LogitRows::Last => self.first_logits(&buffers.decode),
            LogitRows::None => Ok(Vec::new()),
        }
    }

    /// The first token is chosen on the device: only the pick comes back, not the logits.
    fn prefill_choose(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        self.check_prompt(state, tokens)?;
        let mut buffers = self.lock()?;
        self.encode_prompt(&mut buffers, state, tokens, LogitRows::Last)?;
        let pick = self.choose(&mut buffers, state, choice, false)?;
        // After the argmax, which advances the position as a decode step does.
        self.set_position(state)?;
        Ok(pick)
    }

    /// One graph step (the f32 GEMV path), logits read back.
    fn decode(&self, state: &mut CudaState, token: u32) -> Result<Vec<f32>> {
        self.check_room(state, &[token])?;
        let scratch = self.lock()?;
        self.set_token(state, token)?;
        self.step(state, &scratch.decode, None)?;
        // The step's argmax overwrote the slot with a token the host has not seen.
        state.device_token = None;
        self.first_logits(&scratch.decode)
    }

    fn decode_choose(
        &self,
        state: &mut CudaState,
        token: u32,
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        self.check_room(state, &[token])?;
        let mut buffers = self.lock()?;
        self.set_token(state, token)?;
        // The step's own argmax is the choice when nothing else is asked; otherwise the pick
        // kernels replace the token it wrote.
        let greedy = choice
            .is_raw_greedy()
            .then(|| choice.sampler.choosable(self.config.vocab_size));
        self.step(state, &buffers.decode, greedy)?;
        self.choose(&mut buffers, state, choice, true)
    }

    /// Up to [`CudaBackend::step_rows`] sequences a step, each weight read once for all of them;
    /// a larger batch runs as several steps. Every row is checked before any advances. The
    /// persistent step takes one sequence at a time.
    fn decode_batch(&self, rows: &mut [DecodeRow<'_, CudaState>]) -> Result<Vec<Pick>> {
        for row in rows.iter() {
            self.check_room(row.state, &[row.token])?;
        }
        if self.persistent.is_some() || self.step_rows < 2 {
            return rows
                .iter_mut()
                .map(|row| self.decode_choose(row.state, row.token, &mut row.choice))
                .collect();
        }
        let mut picks = Vec::with_capacity(rows.len());
        for group in rows.chunks_mut(self.step_rows) {
            if let [row] = group {
                picks.push(self.decode_choose(row.state, row.token, &mut row.choice)?);
            } else {
                picks.extend(self.decode_rows(group)?);
            }
        }
        Ok(picks)
    }
}

#[cfg(test)]
mod tests {
    use lily_core::config::QWEN36_35B_A3B_CONFIG;

    use super::*;

    #[test]
    fn the_real_shapes_fit_the_kernels_and_oversized_ones_are_refused() {
        let real = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        check_shapes(&real).unwrap();
        let mut wide = real.clone();
        wide.linear_value_head_dim = 2048;
        assert!(format!("{:#}", check_shapes(&wide).unwrap_err()).contains("head dims"));
        for head_dim in [24, 512] {
            let mut odd = real.clone();
            odd.head_dim = head_dim;
            odd.rotary_dim = 16;
            let err = format!("{:#}", check_shapes(&odd).unwrap_err());
            assert!(err.contains("multiple of 16"), "{err}");
        }
        let mut grouped = real.clone();
        grouped.num_attention_heads = 64;
        assert!(format!("{:#}", check_shapes(&grouped).unwrap_err()).contains("GQA group"));
        let mut experts = real;
        experts.num_experts = 2048;
        assert!(format!("{:#}", check_shapes(&experts).unwrap_err()).contains("experts"));
    }
}
