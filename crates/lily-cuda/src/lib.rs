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
mod decoding;
pub mod gdn_chunked;
pub mod gdn_decode;
pub mod gdn_prefill;
pub mod gemm;
pub mod gemm_grouped;
pub mod gemm_wgmma;
pub mod gemv;
pub mod gemv_imma;
pub mod gpu;
pub mod kernel_args;
pub mod mat;
mod measure;
pub mod moe_imma;
pub mod moe_prefill;
pub mod options;
pub mod pick;
mod prefill;
mod queued;
pub mod stamps;
mod state;
mod step;
mod step_constants;
pub mod synthetic;
mod timeline;
pub mod weights;

use std::sync::Mutex;

use anyhow::{Context, Result, bail, ensure};
use lily_core::backend::{Backend, DecodeRow, LogitRows, check_fork};
use lily_core::choice::{Choice, Pick};
use lily_core::config::ModelConfig;
use lily_core::weights::ModelWeights;

pub use compile::KvPrecision;
pub use gpu::gpu_available;
pub use options::{CudaOptions, DEFAULT_PREFILL_CHUNK, DecodeKernels};
pub use state::CudaState;

use crate::decode::{DecodePath, PersistentStep};
use crate::decoding::BatchGraph;
use crate::gpu::{Gpu, ptr};
use crate::pick::PickScratch;
use crate::prefill::{ChunkFork, Model, PrefillScratch, encode_chunk};
use crate::step::Scratch;
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
    /// Whether steps are queued ahead of the host where callers allow it (queued.rs).
    queue_steps: bool,
}

struct Buffers {
    decode: Scratch,
    prefill: PrefillScratch,
    pick: PickScratch,
    /// The captured steps of the last batches of several sequences, the latest last.
    batches: Vec<BatchGraph>,
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
        let pick = PickScratch::new(&gpu, config.vocab_size, step_rows.max(1))?;
        // The queued path launches the pick kernels of every sampled row it steps.
        let queue_steps = options.queue_steps && pick.on_device();
        let scratch = Mutex::new(Buffers {
            decode: Scratch::new(&gpu, &config)?,
            prefill: PrefillScratch::new(&gpu, &config, prefill_chunk)?,
            pick,
            batches: Vec::new(),
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
            queue_steps,
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

    /// Runs `tokens` through the prefill chunks. `All` returns every row's logits; `Last` leaves
    /// the last row's in the decode scratch's `logits`, on the device; `None` computes none. The
    /// device position is left stale ([`Self::set_position`]). With `fork_at`, also returns a
    /// fork of the state after that many tokens: a copy of the state at the start of the chunk
    /// it falls in, filled inside the chunk's pass (`ChunkFork`).
    fn encode_prompt(
        &self,
        buffers: &mut Buffers,
        state: &mut CudaState,
        tokens: &[u32],
        rows: LogitRows,
        fork_at: Option<usize>,
    ) -> Result<(Vec<f32>, Option<CudaState>)> {
        let Buffers {
            decode, prefill, ..
        } = buffers;
        let (vocab, h) = (self.config.vocab_size, self.config.hidden_size);
        let all = rows == LogitRows::All;
        let chunks: Vec<&[u32]> = tokens.chunks(prefill.chunk).collect();
        let mut out = Vec::new();
        let (mut fork, mut chunk_start) = (None, 0);
        for (i, chunk) in chunks.iter().enumerate() {
            // The fork's tokens into this chunk, where it falls here.
            let into = fork_at
                .filter(|&at| chunk_start <= at && at < chunk_start + chunk.len())
                .map(|at| at - chunk_start);
            let chunk_fork = match into {
                Some(at) => {
                    let f: &mut CudaState = fork.insert(state.fork(&self.gpu)?);
                    f.len += at;
                    (at > 0).then_some(ChunkFork { at, state: f })
                }
                None => None,
            };
            let normed = encode_chunk(self.model(), prefill, state, chunk, all, chunk_fork, None)?;
            state.len += chunk.len();
            chunk_start += chunk.len();
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
        // A step queued for the state has fed its token already; its pick is not wanted.
        state.queued = None;
        if let Some(f) = &mut fork {
            f.device_token = None;
            self.set_position(f)?;
        }
        Ok((out, fork))
    }

    /// [`Backend::prefill`], and [`Backend::prefill_forking`] with `fork_at`.
    fn prefill_rows(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        rows: LogitRows,
        fork_at: Option<usize>,
    ) -> Result<(Vec<f32>, Option<CudaState>)> {
        self.check_prompt(state, tokens)?;
        let mut buffers = self.lock()?;
        let (all, fork) = self.encode_prompt(&mut buffers, state, tokens, rows, fork_at)?;
        self.set_position(state)?;
        let logits = match rows {
            LogitRows::All => all,
            LogitRows::Last => self.first_logits(&buffers.decode)?,
            LogitRows::None => Vec::new(),
        };
        Ok((logits, fork))
    }

    /// [`Backend::prefill_choose`], and [`Backend::prefill_choose_forking`] with `fork_at`.
    fn prefill_pick(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        choice: &mut Choice<'_>,
        fork_at: Option<usize>,
    ) -> Result<(Pick, Option<CudaState>)> {
        self.check_prompt(state, tokens)?;
        let mut buffers = self.lock()?;
        let (_, fork) =
            self.encode_prompt(&mut buffers, state, tokens, LogitRows::Last, fork_at)?;
        let pick = self.choose(&mut buffers, state, choice, false)?;
        // After the argmax, which advances the position as a decode step does.
        self.set_position(state)?;
        Ok((pick, fork))
    }

    /// The first row of the decode scratch's logits: a prefill's last row, a single step's row.
    fn first_logits(&self, s: &Scratch) -> Result<Vec<f32>> {
        let row = s.logits.slice(..self.config.vocab_size);
        Ok(self.gpu.stream.clone_dtoh(&row)?)
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
        // A benchmark's record says which decode path made its figures.
        let decode = match (self.persistent.is_some(), self.queue_steps) {
            (true, _) => "persistent",
            (false, false) => "graph",
            (false, true) => "queued graph",
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
        Ok(self.prefill_rows(state, tokens, rows, None)?.0)
    }

    /// The first token is chosen on the device: only the pick comes back, not the logits.
    fn prefill_choose(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        Ok(self.prefill_pick(state, tokens, choice, None)?.0)
    }

    /// The fork is taken inside the pass: no second prefill, the delta rule cut at `at`.
    fn prefill_forking(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        at: usize,
        rows: LogitRows,
    ) -> Result<(Vec<f32>, CudaState)> {
        check_fork(tokens, at)?;
        let (logits, fork) = self.prefill_rows(state, tokens, rows, Some(at))?;
        Ok((logits, fork.context("the prefill took no fork")?))
    }

    fn prefill_choose_forking(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        at: usize,
        choice: &mut Choice<'_>,
    ) -> Result<(Pick, CudaState)> {
        check_fork(tokens, at)?;
        let (pick, fork) = self.prefill_pick(state, tokens, choice, Some(at))?;
        Ok((pick, fork.context("the prefill took no fork")?))
    }

    /// One graph step (the f32 GEMV path), logits read back.
    fn decode(&self, state: &mut CudaState, token: u32) -> Result<Vec<f32>> {
        ensure!(
            state.queued.is_none(),
            "a step of this sequence is queued; its logits are not kept"
        );
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
        if state.queued.is_some() {
            let mut row = [DecodeRow {
                state,
                token,
                choice: choice.reborrow(),
                queue_next: false,
            }];
            let mut picks = self.decode_queued(&mut row)?;
            return picks.pop().context("no pick");
        }
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
        if self.queues(rows) {
            // Every row that runs a step now is checked before any advances.
            for row in rows.iter().filter(|r| r.state.queued.is_none()) {
                self.check_room(row.state, &[row.token])?;
            }
            let mut picks = Vec::with_capacity(rows.len());
            for group in rows.chunks_mut(self.step_rows.max(1)) {
                picks.extend(self.decode_queued(group)?);
            }
            return Ok(picks);
        }
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
