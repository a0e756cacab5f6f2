//! `lily bench`: the protocol of design.md. Prefill from an empty state (time to the first
//! sampled token) and decode (64 greedy steps after a prefill to the context length and one
//! untimed step; with `--sampled` the same again with Qwen's sampling; with `--batch` for
//! several sequences decoded together), each a warm-up run then the median of `--runs`, on a
//! pseudo-random token sequence fixed by seed. One sequence's decode is also reported against its
//! memory-bandwidth ceiling.

mod breakdown;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use lily_core::backend::{Backend, DecodeRow};
use lily_core::choice::Choice;
use lily_core::config::{LayerKind, ModelConfig};
use lily_core::generate::prefill_choose;
use lily_core::load::{WeightFormat, weight_format};
use lily_core::rng::Rng;
use lily_core::sampling::{Sampler, SamplingParams};
use rayon::prelude::*;

use crate::backends::{AnyBackend, AnyState};
use crate::cmd::quantize::QuantizeArg;
use crate::device::{Device, load_with};

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or synthetic:NAME.
    #[arg(long)]
    model: String,
    /// Prompt lengths for prefill (the protocol's full list is
    /// 256,512,1024,2048,4096,8192,16384,32768,65536,131072; the CPU default is shorter).
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024")]
    prompt_lens: Vec<usize>,
    /// Context lengths for decode.
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    contexts: Vec<usize>,
    /// Greedy steps timed per decode sample.
    #[arg(long, default_value_t = 64)]
    decode_steps: usize,
    /// Also time decode with Qwen's recommended sampling (temperature 0.7, top-p 0.8, top-k 20;
    /// seeded), chosen where the backend chooses.
    #[arg(long)]
    sampled: bool,
    /// Sequences decoded together, each decode figure measured for each (one batched step a
    /// token: the total and the per-sequence rate).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Timed runs per figure (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write every sample and the run's metadata as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Quantise --model's bf16/f32 weights to 4 bits at load (what `lily quantize` would write).
    #[arg(long, value_enum)]
    quantize: Option<QuantizeArg>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// llama-bench JSON results measured on this machine in the same run (`peer.sh gpu|cpu`
    /// writes them), for the "× llama.cpp" column; without them the column stays empty.
    #[arg(long, value_delimiter = ',')]
    peer: Vec<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    ensure!(args.runs >= 1, "--runs must be at least 1");
    ensure!(args.decode_steps >= 1, "--decode-steps must be at least 1");
    // Read before the model loads: a bad file fails in a second, not after the weights.
    let peer = Peer::read(&args.peer)?;
    let backend = load_with(&args.model, args.device, args.quantize.is_some())?;
    let c = backend.config().clone();
    let longest = args
        .prompt_lens
        .iter()
        .chain(&args.contexts)
        .max()
        .copied()
        .unwrap_or(1);
    ensure!(
        longest + args.decode_steps < c.max_position_embeddings,
        "benchmark length {} exceeds the model's context of {}",
        longest + args.decode_steps + 1,
        c.max_position_embeddings
    );
    let mut rng = Rng::new(args.seed);
    let tokens: Vec<u32> = (0..longest)
        .map(|_| (rng.next_u64() % c.vocab_size as u64) as u32)
        .collect();

    // The decode ceiling: the device's own copy rate over the bytes a token must read.
    let (bandwidth, bandwidth_source, kv_elem) = match &backend {
        AnyBackend::Cuda(gpu) => (gpu.copy_bandwidth()?, "device", 2),
        AnyBackend::Cpu(_) => (measure_copy_bandwidth(), "host", 4),
    };
    // Weights read per decoded token: the active ones (chosen experts, not the embedding table)
    // in the format they were loaded in.
    let format = weight_format(
        &crate::cmd::pull::resolve_model(&args.model)?,
        args.quantize.is_some(),
    )?;
    let weight_bytes = match format {
        WeightFormat::F32 => c.param_count().active * 4,
        WeightFormat::Mlx => c.weight_bytes().q4_active,
    } as f64;
    let bytes_per_token = |ctx: usize| {
        // Weights once per token, the recurrent state read and written, the KV read.
        weight_bytes
            + (2 * c.recurrent_state_bytes() + c.kv_bytes_per_token(kv_elem) * ctx as u64) as f64
    };

    // The prefill ceiling: the dense bf16 tensor-core rate over the FLOPs a prompt token costs
    // (perf.md). Only the H200's rate is known (measured there), so other GPUs get no ceiling.
    let matmul_rate = match &backend {
        AnyBackend::Cuda(_) if backend.device_name().contains("H200") => Some(H200_BF16_FLOPS),
        _ => None,
    };
    let prefill_ceiling = |len: usize| matmul_rate.map(|rate| rate / prefill_flops(&c, len));

    let mut rows = Vec::new();
    for &len in &args.prompt_lens {
        let samples = timed(args.runs, || {
            let mut state = backend.new_state(len + 1)?;
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let start = Instant::now();
            prefill_choose(
                &backend,
                &mut state,
                &tokens[..len],
                &mut Choice::of(&mut sampler),
            )?;
            Ok(len as f64 / start.elapsed().as_secs_f64())
        })?;
        eprintln!("prefill {len}: {:.1} tok/s", median(&samples));
        rows.push(Row {
            kind: "prefill",
            length: len,
            batch: 1,
            sampled: false,
            samples,
            ceiling: prefill_ceiling(len),
        });
    }
    ensure!(
        args.batch.iter().all(|&b| b >= 1),
        "--batch sizes must be at least 1"
    );
    let mut decodes = Vec::new();
    for sampled in [false, true].into_iter().filter(|&s| !s || args.sampled) {
        for &batch in &args.batch {
            decodes.extend(args.contexts.iter().map(|&ctx| (sampled, batch, ctx)));
        }
    }
    for (sampled, batch, ctx) in decodes {
        let params = if sampled {
            SamplingParams {
                temperature: 0.7,
                top_k: 20,
                top_p: 0.8,
                min_p: 0.0,
                seed: args.seed,
            }
        } else {
            SamplingParams::greedy()
        };
        let samples = timed(args.runs, || {
            decode_rate(&backend, &tokens, ctx, batch, args.decode_steps, &params)
        })?;
        let how = if sampled { ", sampled" } else { "" };
        eprintln!(
            "decode at {ctx}{how}, {batch} at once: {:.1} tok/s",
            median(&samples)
        );
        // The ceiling counts one sequence's bytes: a batch reads more experts per step.
        let ceiling = (batch == 1).then(|| bandwidth / bytes_per_token(ctx));
        rows.push(Row {
            kind: "decode",
            length: ctx,
            batch,
            sampled,
            samples,
            ceiling,
        });
    }

    let commit = env!("LILY_COMMIT");
    println!(
        "lily bench  model {}  device {}  commit {commit}",
        args.model,
        backend.device_name()
    );
    println!(
        "{bandwidth_source} copy bandwidth {:.1} GB/s (read + write); {:.3} GB of {format:?} weights \
         read per decoded token\n",
        bandwidth / 1e9,
        weight_bytes / 1e9
    );
    println!(
        "| phase | tokens | sequences | tok/s (median of {}) | per sequence | ceiling tok/s | % of ceiling | weights GB/s | × llama.cpp, same machine |",
        args.runs
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let m = median(&r.samples);
        let (ceil, pct, rate) = match r.ceiling {
            Some(cl) => (
                format!("{cl:.1}"),
                format!("{:.0} %", 100.0 * m / cl),
                match r.kind {
                    "decode" => format!("{:.1}", m * weight_bytes / 1e9),
                    _ => "—".into(),
                },
            ),
            None => ("—".into(), "—".into(), "—".into()),
        };
        // llama-bench decodes greedily, one sequence: other rows have no peer figure.
        let peer = peer
            .get(r.kind, r.length)
            .filter(|_| !r.sampled && r.batch == 1)
            .map_or("—".into(), |p| format!("{:.2}", m / p));
        let phase = if r.sampled { "decode, sampled" } else { r.kind };
        let per = m / r.batch as f64;
        println!(
            "| {phase} | {} | {} | {m:.1} | {per:.1} | {ceil} | {pct} | {rate} | {peer} |",
            r.length, r.batch
        );
    }
    breakdown::print_breakdowns(&backend, &args, &tokens, &rows)?;
    if let Some(path) = &args.json {
        let record = serde_json::json!({
            "commit": commit,
            "model": args.model,
            "device": backend.device_name(),
            "cpu": cpu_model(),
            "copy_bandwidth_bytes_per_s": bandwidth,
            "copy_bandwidth_of": bandwidth_source,
            "weight_bytes_per_decoded_token": weight_bytes,
            "decode_steps": args.decode_steps,
            "seed": args.seed,
            // `batch` sequences decoded together: tok/s counts all of them, per_sequence one.
            "results": rows.iter().map(|r| serde_json::json!({
                "phase": r.kind, "tokens": r.length, "batch": r.batch, "sampled": r.sampled,
                "median_tok_s": median(&r.samples), "samples_tok_s": r.samples,
                "per_sequence_tok_s": median(&r.samples) / r.batch as f64,
                "ceiling_tok_s": r.ceiling,
                "llama_cpp_tok_s": peer.get(r.kind, r.length).filter(|_| r.batch == 1 && !r.sampled),
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&record)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// The H200's dense bf16 matrix rate, measured with an 8192³ product (perf.md).
const H200_BF16_FLOPS: f64 = 790e12;

/// FLOPs one prompt token costs at prompt length `len` (perf.md): every active matrix weight once
/// (the embedding is a lookup, the lm_head runs for the last token only, so one vocab × hidden
/// table is left out), attention's QKᵀ and PV over half the prompt on average, and the Gated
/// DeltaNet's state work (about 10 FLOPs per state element and token in the chunked form).
fn prefill_flops(c: &ModelConfig, len: usize) -> f64 {
    let matrices = c.param_count().active - (c.vocab_size * c.hidden_size) as u64;
    let attention_layers = c
        .layer_kinds
        .iter()
        .filter(|k| **k == LayerKind::Attention)
        .count();
    let gdn_layers = c.layer_kinds.len() - attention_layers;
    let attention = 4.0
        * (c.num_attention_heads * c.head_dim) as f64
        * (len as f64 / 2.0)
        * attention_layers as f64;
    let state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
    2.0 * matrices as f64 + attention + 10.0 * (state * gdn_layers) as f64
}

/// llama.cpp's figures from `llama-bench -o json` files of the same run (../shared/peer/peer.sh
/// writes them): tok/s by phase and length (prompt length for prefill, depth for decode).
#[derive(Default)]
struct Peer(Vec<(&'static str, usize, f64)>);

impl Peer {
    fn read(paths: &[PathBuf]) -> Result<Self> {
        let mut rows = Vec::new();
        for path in paths {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the peer results {}", path.display()))?;
            let records: Vec<serde_json::Value> =
                serde_json::from_str(&text).with_context(|| {
                    format!(
                        "{} is not llama-bench JSON (a list of records)",
                        path.display()
                    )
                })?;
            for r in records {
                let field = |k: &str| r.get(k).and_then(|v| v.as_f64());
                let (Some(prompt), Some(generated), Some(ts)) =
                    (field("n_prompt"), field("n_gen"), field("avg_ts"))
                else {
                    anyhow::bail!(
                        "{}: a record without n_prompt, n_gen and avg_ts",
                        path.display()
                    );
                };
                let depth = field("n_depth").unwrap_or(0.0);
                rows.push(if generated == 0.0 {
                    ("prefill", prompt as usize, ts)
                } else {
                    ("decode", depth as usize, ts)
                });
            }
        }
        Ok(Peer(rows))
    }

    fn get(&self, phase: &str, tokens: usize) -> Option<f64> {
        self.0
            .iter()
            .find(|(p, t, _)| *p == phase && *t == tokens)
            .map(|(_, _, v)| *v)
    }
}

struct Row {
    kind: &'static str,
    length: usize,
    /// Sequences decoded together (1 for prefill).
    batch: usize,
    /// Decode with `--sampled`'s sampling rather than greedy.
    sampled: bool,
    samples: Vec<f64>,
    ceiling: Option<f64>,
}

/// Tokens a second over `batch` sequences decoded together for `steps` steps, each prefilled to
/// `ctx` tokens (each its own rotation of `tokens`, so that the rows differ) and stepped once
/// untimed: a sequence's first step captures its decode graph (milliseconds on CUDA), a cost
/// paid once per sequence or batch. Each context has room for one step more, which the last one
/// queues.
fn decode_rate(
    backend: &AnyBackend,
    tokens: &[u32],
    ctx: usize,
    batch: usize,
    steps: usize,
    params: &SamplingParams,
) -> Result<f64> {
    let mut samplers: Vec<Sampler> = (0..batch)
        .map(|i| {
            let seed = params.seed.wrapping_add(i as u64);
            Sampler::new(SamplingParams {
                seed,
                ..params.clone()
            })
        })
        .collect();
    let mut states = Vec::with_capacity(batch);
    let mut next = Vec::with_capacity(batch);
    for (i, sampler) in samplers.iter_mut().enumerate() {
        let mut state = backend.new_state(ctx + steps + 2)?;
        let prompt = rotated(tokens, ctx, i);
        let first = prefill_choose(backend, &mut state, &prompt, &mut Choice::of(sampler))?;
        states.push(state);
        next.push(first.token);
    }
    let mut step = |states: &mut [AnyState], next: &mut [u32]| -> Result<()> {
        let mut rows: Vec<DecodeRow<'_, AnyState>> = states
            .iter_mut()
            .zip(samplers.iter_mut())
            .zip(next.iter())
            .map(|((state, sampler), &token)| DecodeRow {
                state,
                token,
                choice: Choice::of(sampler),
                // As a generation does: the device runs the next step while the host reads this
                // one's tokens (the last one queued, with the room for it below, goes untimed).
                queue_next: true,
            })
            .collect();
        let picks = backend.decode_batch(&mut rows)?;
        drop(rows);
        next.iter_mut().zip(picks).for_each(|(t, p)| *t = p.token);
        Ok(())
    };
    step(&mut states, &mut next)?;
    let start = Instant::now();
    for _ in 0..steps {
        step(&mut states, &mut next)?;
    }
    Ok((batch * steps) as f64 / start.elapsed().as_secs_f64())
}

/// Sequence i's prompt of `ctx` tokens: the first `ctx` of `tokens` rotated left by i, so that
/// the sequences of a batch differ (and route to different experts) at the same length.
fn rotated(tokens: &[u32], ctx: usize, i: usize) -> Vec<u32> {
    tokens[i % ctx..ctx]
        .iter()
        .chain(&tokens[..i % ctx])
        .copied()
        .collect()
}

/// One warm-up, then `runs` timed samples.
fn timed(runs: usize, mut f: impl FnMut() -> Result<f64>) -> Result<Vec<f64>> {
    f()?;
    (0..runs).map(|_| f()).collect()
}

/// The middle sample, or the mean of the two middle ones (of two runs, the upper one had been
/// reported: the faster sample, not a median).
fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => s[n / 2],
        _ => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Best of five parallel copies of 256 MiB, counting bytes read plus written.
fn measure_copy_bandwidth() -> f64 {
    let n = 64 << 20;
    let src = vec![1f32; n];
    let mut dst = vec![0f32; n];
    let mut best = 0f64;
    for _ in 0..5 {
        let start = Instant::now();
        dst.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s));
        let secs = start.elapsed().as_secs_f64();
        best = best.max(2.0 * (n * 4) as f64 / secs);
    }
    std::hint::black_box(&dst);
    best
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split(':').nth(1)?.trim().to_string())
}

#[cfg(test)]
mod tests {
    use lily_core::config::QWEN36_35B_A3B_CONFIG;

    use super::*;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[30.0, 10.0, 20.0]), 20.0);
        assert_eq!(median(&[33.6, 32.8]), 33.2);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
    }

    #[test]
    fn each_sequence_of_a_batch_gets_its_own_rotation_of_the_prompt() {
        let tokens: Vec<u32> = (10..20).collect();
        assert_eq!(rotated(&tokens, 4, 0), [10, 11, 12, 13]);
        assert_eq!(rotated(&tokens, 4, 1), [11, 12, 13, 10]);
        assert_eq!(rotated(&tokens, 4, 6), [12, 13, 10, 11]);
        assert_eq!(rotated(&tokens, 1, 3), [10]);
    }

    /// perf.md: about 147,000 tok/s at 4K and 100,000 at 32K on the H200.
    #[test]
    fn the_prefill_ceiling_is_perf_mds() {
        let c = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        let at = |len| H200_BF16_FLOPS / prefill_flops(&c, len);
        assert!((140e3..152e3).contains(&at(4096)), "{}", at(4096));
        assert!((95e3..105e3).contains(&at(32768)), "{}", at(32768));
    }
}
