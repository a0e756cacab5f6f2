//! `lily serve`: the OpenAI-compatible HTTP server.

mod batch_plan;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lily_core::backend::Backend;
use lily_core::config::ModelConfig;
use lily_core::model_ref::ModelRef;

use self::batch_plan::BatchPlan;
use crate::cmd::pull::resolve_model;
use crate::cmd::quantize::QuantizeArg;
use crate::device::{Device, load_with};
use crate::serve::access::Access;
use crate::serve::constrained::GrammarEngine;
use crate::serve::engine::Engine;
use crate::serve::ids::unix_time;
use crate::serve::listen;
use crate::serve::metrics::Metrics;
use crate::serve::routes::{AppState, router};
use crate::serve::sampling_defaults::SamplingDefaults;
use crate::serve::text_model_for;
use crate::serve::worker::EngineHandle;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or synthetic:NAME.
    #[arg(long)]
    model: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The context length in tokens, prompt and reply together [default: 32768, or the model's
    /// positions if fewer].
    #[arg(long)]
    max_seq: Option<usize>,
    /// Requests that may wait while the batch is full; more get 429.
    #[arg(long, default_value_t = 16)]
    queue_size: usize,
    /// The reply length of a request that sets no max_tokens [default: the rest of the context].
    /// A request that asks for more than its context leaves is a 400.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Generations run at once, each advancing one token per batched step [default: 8 on
    /// CUDA; on the CPU the number of cores, from 2 to 8].
    #[arg(long)]
    max_batch: Option<usize>,
    /// Memory for snapshots of conversation states (multi-turn reuse), in MiB; 0 turns it off.
    #[arg(long, default_value_t = 2048)]
    snapshot_cache_mb: usize,
    /// Thinking off unless a request sets chat_template_kwargs.enable_thinking.
    #[arg(long)]
    no_thinking: bool,
    /// The model name clients send (default: the --model argument).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Quantise --model's bf16/f32 weights to 4 bits at load (what `lily quantize` would write).
    #[arg(long, value_enum)]
    quantize: Option<QuantizeArg>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health [env: LILY_API_KEY].
    #[arg(long)]
    api_key: Option<String>,
    /// Let web pages from this origin call the server (repeatable; `*` for any). CORS is off
    /// without it.
    #[arg(long)]
    cors_origin: Vec<String>,
    /// The largest request body, in MiB; a larger one is a 413. Long conversations are
    /// megabytes of JSON.
    #[arg(long, default_value_t = 64)]
    max_body_mb: usize,
    /// A request body that has not fully arrived after this many seconds is a 408.
    #[arg(long, default_value_t = 60.0)]
    body_timeout_s: f64,
    /// Open connections beyond this many get a 503 at once.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
}

/// How long a shutdown waits for in-flight responses (which end at their next decode step)
/// before it exits anyway: a client that stopped reading must not keep the process alive.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's headers before its connection is closed.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

pub fn run(args: Args) -> Result<()> {
    let access = Arc::new(access(&args)?);
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    let body_timeout = Duration::try_from_secs_f64(args.body_timeout_s)
        .ok()
        .filter(|t| !t.is_zero())
        .context("--body-timeout-s must be a positive number of seconds")?;
    let model = resolve_model(&args.model)?;
    let max_seq = context_length(args.max_seq, &model.config()?)?;
    let dir = match &model {
        ModelRef::Dir(dir) => Some(dir.as_path()),
        ModelRef::Synthetic(_) => None,
    };
    let defaults = SamplingDefaults::for_model(dir)?;
    // Claim the address before the (possibly long) load, so a busy port fails at once.
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    listener.set_nonblocking(true)?;
    // Every endpoint returns text, so a checkpoint without a tokenizer cannot be served at all.
    let text = Arc::new(text_model_for(&model)?);
    let backend = load_with(&args.model, args.device, args.quantize.is_some())?;
    eprintln!(
        "lily: {} on {}",
        model.display_name(),
        backend.device_name()
    );
    eprintln!("lily: {}", text.provenance);
    let vocab_size = backend.config().vocab_size;
    let grammars = GrammarEngine::new(backend.config().eos_token_ids.clone());
    let max_batch = args
        .max_batch
        .unwrap_or_else(|| backend.default_max_batch());
    if max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    let budget = args.snapshot_cache_mb << 20;
    let plan = BatchPlan::check(&backend, max_seq, max_batch, budget as u64)?;
    eprintln!(
        "lily: {}; {} more requests may queue",
        plan.summary(),
        args.queue_size.max(1)
    );
    let engine = Engine::new(backend, text.clone(), max_seq, budget)?;
    let metrics = Metrics::new();
    let engine = EngineHandle::spawn(engine, args.queue_size, max_batch, metrics.clone())
        .context("starting the engine")?;
    let app = Arc::new(AppState {
        engine,
        text,
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| args.model.clone()),
        model_aliases: vec![args.model.clone()],
        created: unix_time(),
        max_seq,
        default_max_tokens: args.max_tokens,
        vocab_size,
        defaults,
        default_thinking: !args.no_thinking,
        max_body_bytes: args.max_body_mb.saturating_mul(1 << 20),
        body_timeout,
        metrics,
        responses: Default::default(),
        grammars,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let router = router(app.clone(), access);
    let limits = listen::Limits {
        header_timeout: HEADER_TIMEOUT,
        max_connections: args.max_connections,
        grace: SHUTDOWN_GRACE,
    };
    runtime.block_on(serve(app, router, listener, limits))
}

/// The API key from `--api-key` or `LILY_API_KEY`, and the CORS origins.
fn access(args: &Args) -> Result<Access> {
    let api_key = match &args.api_key {
        Some(key) => Some(key.clone()),
        None => std::env::var("LILY_API_KEY").ok(),
    };
    if api_key.as_ref().is_some_and(|k| k.trim().is_empty()) {
        bail!("the API key (--api-key or LILY_API_KEY) must not be empty");
    }
    let loopback = matches!(args.host.as_str(), "127.0.0.1" | "::1" | "localhost");
    if api_key.is_none() && !loopback {
        eprintln!(
            "lily: warning: listening on {} without --api-key: anyone who can reach it may use it",
            args.host
        );
    }
    Ok(Access {
        api_key,
        cors_origins: args.cors_origin.clone(),
    })
}

/// Serves until SIGTERM or Ctrl-C; then stops accepting, ends every generation at its next
/// step (streams get their final chunk and `[DONE]`), and returns once responses are out.
async fn serve(
    app: Arc<AppState>,
    router: axum::Router,
    listener: std::net::TcpListener,
    limits: listen::Limits,
) -> Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let address: SocketAddr = listener.local_addr()?;
    eprintln!("lily: serving {} on http://{address}/v1", app.model_name);
    let signal = async move {
        shutdown_signal().await;
        eprintln!("lily: shutting down: finishing in-flight responses");
        app.engine.stop_generating();
    };
    if !listen::serve(listener, router, limits, signal).await {
        eprintln!(
            "lily: responses still open after {} s; exiting anyway",
            SHUTDOWN_GRACE.as_secs()
        );
    }
    eprintln!("lily: stopped");
    Ok(())
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => return interrupt.await.unwrap_or(()),
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    interrupt.await.unwrap_or(());
}

/// `--max-seq`, checked against the positions the model has; 32768 by default.
pub fn context_length(requested: Option<usize>, config: &ModelConfig) -> Result<usize> {
    let positions = config.max_position_embeddings;
    let max_seq = requested.unwrap_or(positions.min(32768));
    if max_seq < 2 || max_seq > positions {
        bail!("--max-seq must be between 2 and the model's {positions} positions");
    }
    Ok(max_seq)
}
