use std::io::Write;
use std::ops::ControlFlow;
use std::sync::Arc;

use anyhow::{Result, bail};
use lily_core::backend::Backend;
use lily_core::generate::generate;
use lily_core::sampling::{Sampler, SamplingParams};

use crate::cmd::pull::resolve_model;
use crate::cmd::quantize::QuantizeArg;
use crate::device::{Device, load_with};
use crate::serve::engine::{Engine, EngineEvent, GenerationJob};
use crate::serve::prompt::chat_prompt;
use crate::serve::text_model_for;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or synthetic:NAME.
    #[arg(long)]
    model: String,
    /// Prompt token ids, comma-separated (no template or tokenizer is used).
    #[arg(long, conflicts_with = "prompt")]
    tokens: Option<String>,
    /// Prompt text, sent as one user message through the chat template.
    #[arg(long)]
    prompt: Option<String>,
    /// With --prompt: answer without thinking (the template's enable_thinking=false).
    #[arg(long, requires = "prompt")]
    no_thinking: bool,
    /// With --prompt: end the output where this text appears (repeatable); it is not printed.
    #[arg(long, requires = "prompt")]
    stop: Vec<String>,
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
    /// Quantise --model's bf16/f32 weights to 4 bits at load (what `lily quantize` would write).
    #[arg(long, value_enum)]
    quantize: Option<QuantizeArg>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

pub fn run(args: Args) -> Result<()> {
    check_sampling(args.temperature, args.top_p, args.min_p)?;
    match (&args.tokens, &args.prompt) {
        (Some(tokens), None) => run_tokens(&args, super::parse_tokens(tokens)?),
        (None, Some(prompt)) => run_prompt(&args, prompt),
        _ => bail!("give --tokens or --prompt"),
    }
}

fn sampling(args: &Args) -> SamplingParams {
    SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
    }
}

/// Token ids in and out, no tokenizer involved.
fn run_tokens(args: &Args, prompt: Vec<u32>) -> Result<()> {
    let backend = load_with(&args.model, args.device, args.quantize.is_some())?;
    let max_seq = args.max_seq.unwrap_or(prompt.len() + args.max_tokens);
    let mut state = backend.new_state(max_seq)?;
    let stop: Vec<u32> = if args.ignore_eos {
        Vec::new()
    } else {
        backend.config().eos_token_ids.clone()
    };
    let mut sampler = Sampler::new(sampling(args));
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

/// Text through the chat template, with the server's engine: the same sampling, masking of
/// undecodable ids, stop tokens and stop strings. Prints the raw output text (thinking included).
fn run_prompt(args: &Args, prompt: &str) -> Result<()> {
    if args.ignore_eos {
        bail!("--ignore-eos works with --tokens only; a chat reply ends at its end-of-turn token");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1 with --prompt");
    }
    let model = resolve_model(&args.model)?;
    let text = Arc::new(text_model_for(&model)?);
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), (!args.no_thinking).into());
    let messages = [serde_json::json!({"role": "user", "content": prompt})];
    let prompt = chat_prompt(&text, &messages, &[], &kwargs)?;
    let max_seq = args
        .max_seq
        .unwrap_or(prompt.tokens.len() + args.max_tokens);
    let mut engine = Engine::new(
        load_with(&args.model, args.device, args.quantize.is_some())?,
        text,
        max_seq,
        0,
    )?;
    let job = GenerationJob {
        stop: args.stop.clone(),
        ..GenerationJob::plain(prompt.tokens, args.max_tokens, sampling(args))
    };
    let json = args.json;
    let mut output = String::new();
    let stdout = std::io::stdout();
    let outcome = engine.run(
        &job,
        |event| {
            if let EngineEvent::Text { text: piece, .. } = event {
                if json {
                    output.push_str(&piece);
                } else {
                    let mut out = stdout.lock();
                    let _ = write!(out, "{piece}");
                    let _ = out.flush();
                }
            }
            ControlFlow::Continue(())
        },
        || false,
    )?;
    if json {
        println!(
            "{}",
            serde_json::json!({ "tokens": outcome.tokens(), "text": output })
        );
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
