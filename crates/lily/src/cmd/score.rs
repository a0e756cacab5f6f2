use std::path::PathBuf;

use anyhow::{Context, Result};
use lily_core::backend::{Backend, LogitRows};
use lily_core::generate::prefill;
use lily_core::npy;
use lily_core::sampling::argmax;

use crate::device::{Device, load_cpu};

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or synthetic:NAME.
    #[arg(long)]
    model: String,
    /// Token ids, comma-separated.
    #[arg(long)]
    tokens: String,
    /// Write all logits as a float32 .npy of shape [tokens, vocab].
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Print per-position argmax and next-token log-probability as JSON.
    #[arg(long)]
    json: bool,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

pub fn run(args: Args) -> Result<()> {
    let tokens = super::parse_tokens(&args.tokens)?;
    let backend = load_cpu(&args.model, args.device)?;
    let vocab = backend.config().vocab_size;
    let mut state = backend.new_state(tokens.len())?;
    let logits = prefill(&backend, &mut state, &tokens, LogitRows::All)?;

    if let Some(path) = &args.dump_logits {
        npy::write_f32(path, &[tokens.len(), vocab], &logits)
            .with_context(|| format!("--dump-logits {}", path.display()))?;
    }
    let mut positions = Vec::new();
    let mut nll = 0.0f64;
    for (t, row) in logits.chunks(vocab).enumerate() {
        let best = argmax(row);
        let next = tokens.get(t + 1).copied();
        let logprob = next.map(|n| log_softmax_at(row, n as usize));
        if let Some(lp) = logprob {
            nll -= lp;
        }
        positions.push(serde_json::json!({
            "position": t,
            "argmax": best,
            "next_token": next,
            "logprob": logprob,
        }));
    }
    let predicted = tokens.len() - 1;
    let mean_nll = if predicted > 0 {
        nll / predicted as f64
    } else {
        0.0
    };
    if args.json {
        let out = serde_json::json!({
            "tokens": tokens,
            "positions": positions,
            "mean_nll": mean_nll,
            "perplexity": mean_nll.exp(),
        });
        println!("{out}");
    } else {
        println!(
            "tokens {}  mean NLL {mean_nll:.4}  perplexity {:.3}",
            tokens.len(),
            mean_nll.exp()
        );
    }
    Ok(())
}

/// log softmax(row)[i], computed in f64 with the max subtracted.
fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    row[i] as f64 - max - sum.ln()
}
