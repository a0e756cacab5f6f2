//! `lily quantize --model HF_DIR --out DIR`: a bf16 or f32 checkpoint to MLX affine 4-bit
//! (group 64, 8-bit router and shared-expert gate), as `mlx_lm.convert -q` writes it.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use lily_core::quantize::write_mlx_checkpoint;

#[derive(clap::Args)]
pub struct Args {
    /// A bf16 or f32 checkpoint directory (the official layout or transformers' save_pretrained).
    #[arg(long)]
    model: PathBuf,
    /// The directory to write (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: Args) -> Result<()> {
    let start = Instant::now();
    // The bar is drawn only on a terminal; a pipe or a log gets the summary line alone.
    let bar = if std::io::stderr().is_terminal() {
        let style = ProgressStyle::with_template(
            "quantizing [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        ProgressBar::new(0).with_style(style)
    } else {
        ProgressBar::hidden()
    };
    let summary = write_mlx_checkpoint(&args.model, &args.out, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} tensors ({:.2} GB, {} shard{}) to {} in {:.1} s",
        summary.tensors,
        summary.bytes as f64 / 1e9,
        summary.shards,
        if summary.shards == 1 { "" } else { "s" },
        args.out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `--quantize`: the format to quantise a bf16/f32 checkpoint to at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantizeArg {
    /// MLX affine 4-bit, group 64 (8-bit router and shared-expert gate), as `lily quantize`.
    Q4,
}
