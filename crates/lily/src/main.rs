//! `lily`: the command-line front end (the contract is in design.md).

mod backends;
mod cmd;
mod device;
mod progress;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "lily",
    version,
    about = "A specialised inference engine for Qwen3.6-35B-A3B"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Let --model ORG/NAME download what the Hub cache lacks (otherwise only `pull` does).
    #[arg(long, global = true)]
    download: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Generate(cmd::generate::Args),
    /// Teacher-forced scoring: logits and log-probabilities of a token sequence.
    Score(cmd::score::Args),
    /// Describe a model: config, parameter count, memory needed.
    Inspect(cmd::inspect::Args),
    /// Measure prefill and decode speed (design.md, benchmark protocol).
    Bench(cmd::bench::Args),
    /// Download a model from the Hugging Face Hub into its cache (resumable, checksummed).
    Pull(cmd::pull::Args),
    /// Serve an OpenAI-compatible API (chat, completions, streaming, tools).
    Serve(cmd::serve::Args),
    /// Chat in the terminal (streamed, thinking dimmed).
    Chat(cmd::chat::Args),
    /// Convert a bf16/f32 checkpoint to MLX 4-bit (group 64), as mlx_lm.convert -q does.
    Quantize(cmd::quantize::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cmd::pull::allow_downloads(cli.download);
    let result = match cli.command {
        Command::Generate(args) => cmd::generate::run(args),
        Command::Score(args) => cmd::score::run(args),
        Command::Inspect(args) => cmd::inspect::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Pull(args) => cmd::pull::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Chat(args) => cmd::chat::run(args),
        Command::Quantize(args) => cmd::quantize::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the context chain joined with ": ".
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
