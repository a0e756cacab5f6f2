//! `lily pull`: a whole repository at one revision into the cache, as huggingface_hub's
//! `snapshot_download` lays it out.

use std::path::{Path, PathBuf};

use crate::cache::RepoCache;
use crate::download::FileJob;
use crate::error::HubError;
use crate::http::HubClient;
use crate::metadata::RepoInfo;
use crate::names::{RepoId, Revision};
use crate::progress::{FileOutcome, PullProgress};
use crate::settings::HubSettings;

/// What a pull did.
#[derive(Clone, Debug)]
pub struct PullReport {
    pub repo: RepoId,
    pub revision: Revision,
    pub commit: String,
    /// `snapshots/{commit}`: a checkpoint directory.
    pub snapshot: PathBuf,
    /// Each file with its size and how it got there, sorted by path.
    pub files: Vec<(String, u64, FileOutcome)>,
}

impl PullReport {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, size, _)| size).sum()
    }

    /// Bytes that came over the network in this pull.
    pub fn downloaded_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|(_, size, outcome)| match outcome {
                FileOutcome::Cached => 0,
                FileOutcome::Downloaded { resumed_from } => size - resumed_from,
                FileOutcome::Refetched => *size,
            })
            .sum()
    }
}

/// Brings every file of `repo` at `revision` into the cache, checked against the Hub's sizes
/// and hashes. Files already there are verified and kept; partial downloads are resumed.
/// The ref for `revision` is written last, so it only ever points to a complete snapshot.
pub fn pull(
    settings: &HubSettings,
    repo: &RepoId,
    revision: &Revision,
    progress: &mut dyn PullProgress,
) -> Result<PullReport, HubError> {
    if settings.offline {
        return Err(HubError::Offline {
            repo: repo.to_string(),
        });
    }
    let client = HubClient::new(settings);
    let info = RepoInfo::from_json(client.repo_info(repo, revision)?)?;
    if revision.is_commit() && info.commit != revision.as_str() {
        return Err(HubError::BadMetadata(format!(
            "asked for commit {revision} of {repo}, the Hub described commit {}",
            info.commit
        )));
    }
    // Fail before downloading anything rather than on the first file.
    if info.gated && settings.token.is_none() {
        return Err(HubError::GatedWithoutToken {
            repo: repo.to_string(),
            endpoint: settings.endpoint.clone(),
        });
    }
    let cache = RepoCache::new(&settings.cache_dir, repo);
    let snapshot = cache.snapshot_dir(&info.commit);
    std::fs::create_dir_all(&snapshot).map_err(|e| HubError::io(&snapshot, e))?;
    progress.begin(&repo.to_string(), &info);
    let mut files = Vec::with_capacity(info.files.len());
    for file in &info.files {
        let job = FileJob {
            client: &client,
            cache: &cache,
            repo,
            commit: &info.commit,
            file,
        };
        let outcome = job.run(progress)?;
        progress.done(&file.path, &outcome);
        files.push((file.path.clone(), file.size, outcome));
    }
    cache.write_ref(revision, &info.commit)?;
    Ok(PullReport {
        repo: repo.clone(),
        revision: revision.clone(),
        commit: info.commit,
        snapshot,
        files,
    })
}

/// Lays the pulled files out as a plain directory at `dir` (for `lily pull --dir`): hard
/// links to the cache's blobs where the file system allows, copies elsewhere. Each file is
/// put in place with a rename, so an existing file is replaced whole or not at all.
pub fn place_in_dir(report: &PullReport, dir: &Path) -> Result<(), HubError> {
    for (name, _, _) in &report.files {
        let source = std::fs::canonicalize(report.snapshot.join(name))
            .map_err(|e| HubError::io(report.snapshot.join(name), e))?;
        let target = dir.join(name);
        let parent = target.parent().unwrap_or(dir);
        std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        let mut staged = target.clone().into_os_string();
        staged.push(format!(".lily-tmp-{}", std::process::id()));
        let staged = PathBuf::from(staged);
        let _ = std::fs::remove_file(&staged);
        if std::fs::hard_link(&source, &staged).is_err() {
            std::fs::copy(&source, &staged).map_err(|e| HubError::io(&staged, e))?;
        }
        std::fs::rename(&staged, &target).map_err(|e| {
            let _ = std::fs::remove_file(&staged);
            HubError::io(&target, e)
        })?;
    }
    Ok(())
}
