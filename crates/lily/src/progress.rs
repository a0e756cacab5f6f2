//! Progress bars on stderr, drawn only when stderr is a terminal (a pipe or a log file gets the
//! messages without the bar): one for `pull`, one for loading weights.

use std::io::IsTerminal;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use lily_core::config::ModelConfig;
use lily_core::source::TensorSource;
use lily_core::weights::Linear;
use lily_hub::{FileOutcome, HubError, PullProgress, RepoInfo, Stage};

fn bar(len: u64, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    ProgressBar::new(len).with_style(style)
}

/// A line for the user, above the bar when there is one.
fn say(bar: &ProgressBar, line: &str) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

/// `lily pull`'s bar: the file in hand, bytes checked or downloaded, speed and time left.
pub struct PullBar {
    bar: ProgressBar,
    files: usize,
    done: usize,
}

impl PullBar {
    pub fn new() -> Self {
        PullBar {
            bar: bar(
                0,
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            ),
            files: 0,
            done: 0,
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl PullProgress for PullBar {
    fn begin(&mut self, repo: &str, info: &RepoInfo) {
        self.files = info.files.len();
        say(
            &self.bar,
            &format!(
                "pulling {repo} at {}: {} files, {:.2} GB",
                info.commit,
                self.files,
                info.total_bytes() as f64 / 1e9
            ),
        );
    }

    fn stage(&mut self, file: &str, stage: Stage, position: u64, size: u64) {
        let verb = match stage {
            Stage::Verifying => "checking",
            Stage::Downloading => "downloading",
        };
        self.bar.reset();
        self.bar.set_length(size);
        self.bar.set_position(position);
        self.bar
            .set_message(format!("[{}/{}] {verb} {file}", self.done + 1, self.files));
    }

    fn advance(&mut self, bytes: u64) {
        self.bar.inc(bytes);
    }

    fn retry(&mut self, file: &str, attempt: u32, error: &HubError) {
        say(
            &self.bar,
            &format!("warning: {file}: attempt {attempt} failed ({error}); trying again"),
        );
    }

    fn done(&mut self, _file: &str, _outcome: &FileOutcome) {
        self.done += 1;
    }
}

/// A tensor source that advances a bar by the parameters the loader takes from it.
pub struct LoadBar {
    inner: Box<dyn TensorSource>,
    bar: ProgressBar,
}

impl LoadBar {
    /// Wraps `source`; the bar counts up to the model's parameter count.
    pub fn wrap(source: Box<dyn TensorSource>, config: &ModelConfig) -> Box<dyn TensorSource> {
        let bar = bar(
            config.param_count().total,
            "loading weights [{bar:30}] {percent}% {elapsed} eta {eta}",
        );
        Box::new(LoadBar { inner: source, bar })
    }
}

impl TensorSource for LoadBar {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn take_f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let values = self.inner.take_f32(name, shape)?;
        self.bar.inc(values.len() as u64);
        Ok(values)
    }

    fn take_linears(
        &mut self,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Linear>> {
        let linears = self.inner.take_linears(module, count, rows, cols)?;
        self.bar.inc((count * rows * cols) as u64);
        Ok(linears)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.bar.finish_and_clear();
        self.inner.finish()
    }

    fn norms_are_shifted(&self) -> bool {
        self.inner.norms_are_shifted()
    }
}
