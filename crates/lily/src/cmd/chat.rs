//! `lily chat`: a conversation in the terminal, on a line editor (history, a pasted block as one
//! message) with slash commands (`conversation`). Replies stream as they are generated,
//! thinking dimmed; Ctrl-C stops one and keeps what it said; each turn reuses the state
//! snapshotted at the end of the previous one.

mod conversation;
mod input;

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use lily_chat::{ChatDelta, ChatOutputParser};
use serde_json::{Value, json};

use self::conversation::{Command, Conversation};
use self::input::{Input, Line};
use crate::cmd::pull::resolve_model;
use crate::cmd::quantize::QuantizeArg;
use crate::device::{Device, load_with};
use crate::serve::engine::{Engine, EngineEvent, Finish, GenerationJob, Outcome};
use crate::serve::ids::random_u64;
use crate::serve::prompt::chat_prompt;
use crate::serve::sampling_defaults::SamplingDefaults;
use crate::serve::text_model_for;

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or synthetic:NAME.
    #[arg(long)]
    model: String,
    /// A system message for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Answer without thinking.
    #[arg(long)]
    no_thinking: bool,
    /// The most tokens per reply (default: what the context has left).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Context length in tokens for the whole conversation [default: 32768, or the model's
    /// positions if fewer].
    #[arg(long)]
    max_seq: Option<usize>,
    /// Sampling; unset values come from the model's generation_config.json (0: greedy).
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    /// Seed of the first reply (each later reply uses the next one); random if unset.
    #[arg(long)]
    seed: Option<u64>,
    /// Memory for conversation snapshots in MiB (what makes later turns start fast).
    #[arg(long, default_value_t = 1024)]
    snapshot_cache_mb: usize,
    /// Quantise --model's bf16/f32 weights to 4 bits at load (what `lily quantize` would write).
    #[arg(long, value_enum)]
    quantize: Option<QuantizeArg>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

pub fn run(args: Args) -> Result<()> {
    let model = resolve_model(&args.model)?;
    let max_seq = super::serve::context_length(args.max_seq, &model.config()?)?;
    let text = Arc::new(text_model_for(&model)?);
    let dir = match &model {
        lily_core::model_ref::ModelRef::Dir(dir) => Some(dir.as_path()),
        lily_core::model_ref::ModelRef::Synthetic(_) => None,
    };
    let mut sampling = SamplingDefaults::for_model(dir)?;
    sampling.temperature = args.temperature.unwrap_or(sampling.temperature);
    sampling.top_k = args.top_k.unwrap_or(sampling.top_k);
    sampling.top_p = args.top_p.unwrap_or(sampling.top_p);
    sampling.min_p = args.min_p.unwrap_or(sampling.min_p);
    super::generate::check_sampling(sampling.temperature, sampling.top_p, sampling.min_p)?;
    let backend = load_with(&args.model, args.device, args.quantize.is_some())?;
    let budget = args.snapshot_cache_mb << 20;
    let mut engine = Engine::new(backend, text.clone(), max_seq, budget)?;
    ctrlc::set_handler(|| {
        if GENERATING.load(Ordering::SeqCst) {
            INTERRUPTED.store(true, Ordering::SeqCst);
        } else {
            // At a plain prompt (no line editor to catch it) Ctrl-C leaves, as it always did.
            std::process::exit(130);
        }
    })
    .context("installing the Ctrl-C handler")?;

    let style = Style {
        color: std::io::stdout().is_terminal(),
    };
    let mut input = Input::new()?;
    eprintln!(
        "lily chat: {} — /help lists the commands, /exit (or Ctrl-D) quits",
        model.display_name()
    );
    let mut conversation = Conversation::new(args.system.as_deref(), !args.no_thinking);
    let mut seed = args.seed.unwrap_or_else(random_u64);
    loop {
        let line = match input.read()? {
            Line::Text(line) => line,
            Line::Interrupted => continue,
            Line::End => return Ok(()),
        };
        if line.trim().is_empty() {
            continue;
        }
        let said = match conversation.command(&line) {
            Ok(Command::Say(said)) => said,
            Ok(Command::Exit) => return Ok(()),
            Ok(Command::Told(told)) => {
                eprintln!("{told}");
                continue;
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                continue;
            }
        };
        conversation
            .messages
            .push(json!({"role": "user", "content": said}));
        let kwargs = conversation.template_kwargs();
        let prompt = match chat_prompt(&text, &conversation.messages, &[], &kwargs) {
            Ok(prompt) => prompt,
            Err(e) => {
                eprintln!("error: {e:#}");
                conversation.messages.pop();
                continue;
            }
        };
        if prompt.tokens.len() >= max_seq {
            eprintln!(
                "error: the conversation has {} tokens, the context {}: /reset, or restart with a \
                 larger --max-seq",
                prompt.tokens.len(),
                max_seq
            );
            conversation.messages.pop();
            continue;
        }
        let max_tokens = args
            .max_tokens
            .unwrap_or(usize::MAX)
            .min(max_seq - prompt.tokens.len());
        let job = GenerationJob {
            turn_boundary: prompt.turn_boundary,
            ..GenerationJob::plain(prompt.tokens, max_tokens, sampling.params(seed))
        };
        seed = seed.wrapping_add(1);
        let mut reply = Reply::new(ChatOutputParser::new(prompt.thinking, None), style);
        INTERRUPTED.store(false, Ordering::SeqCst);
        GENERATING.store(true, Ordering::SeqCst);
        let interrupted = || INTERRUPTED.load(Ordering::SeqCst);
        let result = engine.run(
            &job,
            |event| {
                if interrupted() {
                    return ControlFlow::Break(());
                }
                reply.on_event(event)
            },
            interrupted,
        );
        GENERATING.store(false, Ordering::SeqCst);
        match result {
            Ok(outcome) => conversation.messages.push(reply.finish(&outcome)),
            Err(e) => {
                eprintln!("\nerror: {e:#}");
                conversation.messages.pop();
            }
        }
    }
}

/// Ctrl-C during a reply stops it (the engine polls this between steps); at a prompt the line
/// editor sees the key itself.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static GENERATING: AtomicBool = AtomicBool::new(false);

#[derive(Clone, Copy)]
struct Style {
    color: bool,
}

/// One streamed reply: prints as it goes and remembers what the history needs.
struct Reply {
    parser: ChatOutputParser,
    style: Style,
    reasoning: String,
    content: String,
    in_reasoning: bool,
    started: Option<Instant>,
}

impl Reply {
    fn new(parser: ChatOutputParser, style: Style) -> Self {
        Reply {
            parser,
            style,
            reasoning: String::new(),
            content: String::new(),
            in_reasoning: false,
            started: None,
        }
    }

    fn on_event(&mut self, event: EngineEvent) -> ControlFlow<()> {
        match event {
            EngineEvent::Started { .. } => self.started = Some(Instant::now()),
            EngineEvent::Text { text, .. } => {
                let deltas = self.parser.push(&text);
                self.print(deltas);
            }
        }
        ControlFlow::Continue(())
    }

    fn print(&mut self, deltas: Vec<ChatDelta>) {
        let mut out = std::io::stdout().lock();
        for delta in deltas {
            match delta {
                ChatDelta::Reasoning(t) => {
                    if !self.in_reasoning && self.style.color {
                        let _ = write!(out, "{DIM}");
                    }
                    self.in_reasoning = true;
                    let _ = write!(out, "{t}");
                    self.reasoning.push_str(&t);
                }
                ChatDelta::Content(t) => {
                    self.end_reasoning(&mut out);
                    let _ = write!(out, "{t}");
                    self.content.push_str(&t);
                }
                // Tools are not offered in the terminal, so the parser reports none.
                ChatDelta::ToolCallStart { .. } | ChatDelta::ToolCallArguments { .. } => {}
            }
        }
        let _ = out.flush();
    }

    fn end_reasoning(&mut self, out: &mut impl Write) {
        if self.in_reasoning {
            let _ = write!(out, "{}\n\n", if self.style.color { RESET } else { "" });
            self.in_reasoning = false;
        }
    }

    /// Prints the rest and the speed; returns the assistant message for the history.
    fn finish(&mut self, outcome: &Outcome) -> Value {
        let deltas = self.parser.finish();
        self.print(deltas);
        self.end_reasoning(&mut std::io::stdout().lock());
        println!();
        let seconds = self.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        let speed = outcome.completion_tokens() as f64 / seconds.max(1e-9);
        let (dim, reset) = if self.style.color {
            (DIM, RESET)
        } else {
            ("", "")
        };
        if outcome.finish() == Finish::Cancelled {
            eprintln!("{dim}(stopped){reset}");
        }
        eprintln!(
            "{dim}[{} tokens, {speed:.1} tok/s, {} of {} prompt tokens reused, {:?}]{reset}",
            outcome.completion_tokens(),
            outcome.cached_tokens,
            outcome.prompt_tokens,
            outcome.finish()
        );
        json!({"role": "assistant", "content": self.content, "reasoning_content": self.reasoning})
    }
}
