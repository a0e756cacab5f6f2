//! `lily pull`, and `--model ORG/NAME[@REVISION]` for every command: the Hub cache first,
//! the network only through `pull` or `--download`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Result, bail};
use lily_core::model_ref::ModelRef;
use lily_hub::{
    HubError, HubSettings, ModelSpec, PullReport, RepoId, Revision, find_cached_model,
    place_in_dir, pull,
};

use crate::progress::PullBar;

#[derive(clap::Args)]
pub struct Args {
    /// Repository on the Hub: ORG/NAME, or ORG/NAME@REVISION.
    #[arg(default_value = lily_hub::DEFAULT_REPO)]
    repo: String,
    /// Branch, tag or commit hash to pull (default: main).
    #[arg(long)]
    revision: Option<String>,
    /// Also lay the files out in DIR as a plain checkpoint directory (hard links into the
    /// cache where the file system allows, so no second copy; do not edit them in place).
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Set by `--download`: `--model ORG/NAME` may fetch what the cache lacks.
static DOWNLOAD_MISSING: AtomicBool = AtomicBool::new(false);

pub fn allow_downloads(allow: bool) {
    DOWNLOAD_MISSING.store(allow, Ordering::Relaxed);
}

pub fn run(args: Args) -> Result<()> {
    let mut spec = ModelSpec::parse(&args.repo)?;
    if let Some(revision) = &args.revision {
        if args.repo.contains('@') {
            bail!(
                "give the revision either as {} or with --revision, not both",
                args.repo
            );
        }
        spec.revision = Revision::parse(revision)?;
    }
    let settings = HubSettings::from_env()?;
    let report = pull_with_progress(&settings, &spec.repo, &spec.revision)?;
    println!("{}", summary(&report));
    println!("snapshot {}", report.snapshot.display());
    match &args.dir {
        Some(dir) => {
            place_in_dir(&report, dir)?;
            println!(
                "files in {}; use it with --model {}",
                dir.display(),
                dir.display()
            );
        }
        None => println!(
            "use it with --model {}",
            model_name(&spec.repo, &spec.revision)
        ),
    }
    Ok(())
}

/// What `--model` names: a directory, `synthetic:NAME`, or a Hub repository, which resolves
/// to its snapshot in the cache (downloaded first with `--download`).
pub fn resolve_model(spec: &str) -> Result<ModelRef> {
    let is_repo = !spec.starts_with("synthetic:") && !Path::new(spec).is_dir();
    let Some(hub_spec) = is_repo.then(|| ModelSpec::parse(spec).ok()).flatten() else {
        return ModelRef::parse(spec);
    };
    let settings = HubSettings::from_env()?;
    match find_cached_model(&settings, &hub_spec) {
        Ok(dir) => return Ok(ModelRef::Dir(dir)),
        Err(HubError::NotCached { .. } | HubError::IncompleteSnapshot { .. })
            if DOWNLOAD_MISSING.load(Ordering::Relaxed) => {}
        Err(e) => return Err(e.into()),
    }
    let report = pull_with_progress(&settings, &hub_spec.repo, &hub_spec.revision)?;
    // stdout belongs to the command that asked for the model.
    eprintln!("{}", summary(&report));
    Ok(ModelRef::Dir(find_cached_model(&settings, &hub_spec)?))
}

fn pull_with_progress(
    settings: &HubSettings,
    repo: &RepoId,
    revision: &Revision,
) -> Result<PullReport, HubError> {
    let mut bar = PullBar::new();
    let report = pull(settings, repo, revision, &mut bar);
    bar.finish();
    report
}

fn summary(report: &PullReport) -> String {
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    let downloaded = report.downloaded_bytes();
    format!(
        "{} at {}: {} files, {} ({} downloaded, {} already on disk)",
        model_name(&report.repo, &report.revision),
        report.commit,
        report.files.len(),
        gb(report.total_bytes()),
        gb(downloaded),
        gb(report.total_bytes() - downloaded)
    )
}

fn model_name(repo: &RepoId, revision: &Revision) -> String {
    if *revision == Revision::main() {
        repo.to_string()
    } else {
        format!("{repo}@{revision}")
    }
}
