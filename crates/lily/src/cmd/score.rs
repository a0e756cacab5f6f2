//! `lily score`: teacher-forced logits and log-probabilities of a token sequence, and with
//! `--compare` a fidelity report of one model against another (e.g. 4-bit against the bf16
//! weights it came from): top-1 agreement and the perplexity ratio.

use std::path::PathBuf;

use anyhow::{Context, Result};
use lily_core::backend::{Backend, LogitRows};
use lily_core::generate::prefill;
use lily_core::logprobs::log_softmax_at;
use lily_core::npy;
use lily_core::sampling::argmax;

use super::quantize::QuantizeArg;
use crate::device::{Device, load_with};

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
    /// Quantise --model's bf16/f32 weights at load (the result `lily quantize` would write).
    #[arg(long, value_enum)]
    quantize: Option<QuantizeArg>,
    /// A reference model (loaded after --model is done with): report how often the two agree on
    /// the most likely next token, and the ratio of their perplexities.
    #[arg(long)]
    compare: Option<String>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

/// What one model makes of the sequence.
struct Scored {
    logits: Vec<f32>,
    argmax: Vec<u32>,
    /// log p(tokens[t + 1] | tokens[..=t]) for every position but the last.
    logprobs: Vec<f64>,
}

impl Scored {
    fn mean_nll(&self) -> f64 {
        if self.logprobs.is_empty() {
            0.0
        } else {
            -self.logprobs.iter().sum::<f64>() / self.logprobs.len() as f64
        }
    }
}

fn score(model: &str, quantize: bool, device: Device, tokens: &[u32]) -> Result<Scored> {
    let backend = load_with(model, device, quantize)?;
    let vocab = backend.config().vocab_size;
    let mut state = backend.new_state(tokens.len())?;
    let logits = prefill(&backend, &mut state, tokens, LogitRows::All)?;
    let argmax = logits.chunks(vocab).map(argmax).collect();
    let logprobs = logits
        .chunks(vocab)
        .zip(&tokens[1..])
        .map(|(row, &next)| log_softmax_at(row, next as usize))
        .collect();
    Ok(Scored {
        logits,
        argmax,
        logprobs,
    })
}

/// Top-1 agreement (fraction of positions with the same argmax) and perplexity ratio of `a`
/// against the reference `b`.
fn fidelity(a: &Scored, b: &Scored) -> (f64, f64) {
    let same = a
        .argmax
        .iter()
        .zip(&b.argmax)
        .filter(|(x, y)| x == y)
        .count();
    let agreement = same as f64 / a.argmax.len() as f64;
    (agreement, (a.mean_nll() - b.mean_nll()).exp())
}

pub fn run(args: Args) -> Result<()> {
    let tokens = super::parse_tokens(&args.tokens)?;
    let ours = score(&args.model, args.quantize.is_some(), args.device, &tokens)?;
    if let Some(path) = &args.dump_logits {
        let vocab = ours.logits.len() / tokens.len();
        npy::write_f32(path, &[tokens.len(), vocab], &ours.logits)
            .with_context(|| format!("--dump-logits {}", path.display()))?;
    }
    let reference = match &args.compare {
        Some(other) => Some(
            score(other, false, args.device, &tokens)
                .with_context(|| format!("--compare {other}"))?,
        ),
        None => None,
    };
    let mean_nll = ours.mean_nll();
    if args.json {
        let positions: Vec<_> = (0..tokens.len())
            .map(|t| {
                serde_json::json!({
                    "position": t,
                    "argmax": ours.argmax[t],
                    "next_token": tokens.get(t + 1),
                    "logprob": ours.logprobs.get(t),
                })
            })
            .collect();
        let mut out = serde_json::json!({
            "tokens": tokens,
            "positions": positions,
            "mean_nll": mean_nll,
            "perplexity": mean_nll.exp(),
        });
        if let (Some(r), Some(name)) = (&reference, &args.compare) {
            let (agreement, ratio) = fidelity(&ours, r);
            out["compare"] = serde_json::json!({
                "model": name,
                "top1_agreement": agreement,
                "perplexity": r.mean_nll().exp(),
                "perplexity_ratio": ratio,
            });
        }
        println!("{out}");
    } else {
        println!(
            "tokens {}  mean NLL {mean_nll:.4}  perplexity {:.3}",
            tokens.len(),
            mean_nll.exp()
        );
        if let (Some(r), Some(name)) = (&reference, &args.compare) {
            let (agreement, ratio) = fidelity(&ours, r);
            println!(
                "against {name}: top-1 agreement {:.2} % of {} positions, perplexity {:.3} vs \
                 {:.3} ({:+.2} %)",
                100.0 * agreement,
                tokens.len(),
                mean_nll.exp(),
                r.mean_nll().exp(),
                100.0 * (ratio - 1.0)
            );
        }
    }
    Ok(())
}

/// log softmax(row)[i], computed in f64 with the max subtracted.
#[cfg(test)]
mod tests {
    use super::*;

    fn scored(argmax: &[u32], logprobs: &[f64]) -> Scored {
        Scored {
            logits: Vec::new(),
            argmax: argmax.to_vec(),
            logprobs: logprobs.to_vec(),
        }
    }

    #[test]
    fn fidelity_counts_agreeing_positions_and_divides_perplexities() {
        let a = scored(&[1, 2, 3, 4], &[-1.0, -2.0, -3.0]);
        let b = scored(&[1, 2, 9, 4], &[-1.0, -1.0, -1.0]);
        let (agreement, ratio) = fidelity(&a, &b);
        assert_eq!(agreement, 0.75);
        // exp(2) / exp(1)
        assert!((ratio - 1f64.exp()).abs() < 1e-12);
    }
}
