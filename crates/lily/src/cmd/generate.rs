use std::io::Write;
use std::ops::ControlFlow;

use anyhow::{Result, bail};
use lily_core::backend::Backend;
use lily_core::generate::generate;
use lily_core::sampling::{Sampler, SamplingParams};

use crate::device::{Device, load};

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or synthetic:NAME.
    #[arg(long)]
    model: String,
    /// Prompt token ids, comma-separated (no template or tokenizer is used).
    #[arg(long, conflicts_with = "prompt")]
    tokens: Option<String>,
    /// Prompt text (rendered with the chat template).
    #[arg(long)]
    prompt: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 for greedy decoding.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// 0 for no limit.
    #[arg(long, default_value_t = 20)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Context length to allocate (default: prompt plus max-tokens).
    #[arg(long)]
    max_seq: Option<usize>,
    /// Print {"tokens": [...], "text": ...} instead of plain ids.
    #[arg(long)]
    json: bool,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

pub fn run(args: Args) -> Result<()> {
    let prompt = match (&args.tokens, &args.prompt) {
        (Some(t), None) => super::parse_tokens(t)?,
        (None, Some(_)) => {
            bail!("--prompt needs the tokenizer, which is not built yet; use --tokens")
        }
        _ => bail!("give --tokens or --prompt"),
    };
    check_sampling(args.temperature, args.top_p, args.min_p)?;
    let backend = load(&args.model, args.device)?;
    let max_seq = args.max_seq.unwrap_or(prompt.len() + args.max_tokens);
    let mut state = backend.new_state(max_seq)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
    };
    let stop: Vec<u32> = if args.ignore_eos {
        Vec::new()
    } else {
        backend.config().eos_token_ids.clone()
    };
    let mut sampler = Sampler::new(params);
    let stdout = std::io::stdout();
    let json = args.json;
    let mut first = true;
    let generation = generate(
        &backend,
        &mut state,
        &prompt,
        args.max_tokens,
        &stop,
        &mut sampler,
        |t| {
            if !json {
                let mut out = stdout.lock();
                let _ = write!(out, "{}{t}", if first { "" } else { "," });
                let _ = out.flush();
                first = false;
            }
            ControlFlow::Continue(())
        },
    )?;
    if json {
        let value = serde_json::json!({ "tokens": generation.tokens, "text": null });
        println!("{value}");
    } else {
        println!();
    }
    Ok(())
}

pub fn check_sampling(temperature: f32, top_p: f32, min_p: f32) -> Result<()> {
    if !(temperature >= 0.0 && temperature.is_finite()) {
        bail!("--temperature must be a finite number >= 0");
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        bail!("--top-p must be in (0, 1]");
    }
    if !(0.0..=1.0).contains(&min_p) {
        bail!("--min-p must be in [0, 1]");
    }
    Ok(())
}
