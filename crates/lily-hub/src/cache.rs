//! The Hub's cache layout, shared with huggingface_hub (so files that Python tools downloaded
//! are reused, and the other way round):
//!
//! ```text
//! {cache}/models--ORG--NAME/blobs/{etag}                  file contents, named by ETag: the
//!                                                         sha256 for LFS files, the git blob
//!                                                         sha1 for the others
//! {cache}/models--ORG--NAME/blobs/{etag}.incomplete       a download in progress (resumable)
//! {cache}/models--ORG--NAME/snapshots/{commit}/{file}     symlink -> ../../blobs/{etag}
//! {cache}/models--ORG--NAME/refs/{revision}               the commit a branch or tag pointed to
//! {cache}/.locks/models--ORG--NAME/{etag}.lock            flock held while a blob is written
//! ```

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::HubError;
use crate::names::{RepoId, Revision, is_commit_hash};

/// The cache folder of one repository.
#[derive(Clone, Debug)]
pub struct RepoCache {
    repo: RepoId,
    dir: PathBuf,
    locks: PathBuf,
}

impl RepoCache {
    pub fn new(cache_dir: &Path, repo: &RepoId) -> Self {
        RepoCache {
            repo: repo.clone(),
            dir: cache_dir.join(repo.cache_folder()),
            locks: cache_dir.join(".locks").join(repo.cache_folder()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blob_path(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// Where a blob is downloaded before it is verified: the name huggingface_hub uses, so a
    /// download it started can be resumed here and the other way round.
    pub fn incomplete_path(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(format!("{etag}.incomplete"))
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// The commit that `revision` resolved to when it was last pulled: the revision itself
    /// for a commit hash, else what `refs/{revision}` holds.
    pub fn read_ref(&self, revision: &Revision) -> Result<Option<String>, HubError> {
        if revision.is_commit() {
            return Ok(Some(revision.as_str().to_string()));
        }
        let path = self.dir.join("refs").join(revision.as_str());
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(HubError::io(path, e)),
        };
        let commit = text.trim();
        if !is_commit_hash(commit) {
            return Err(HubError::BadMetadata(format!(
                "{} holds {commit:?}, not a commit hash; delete it and pull again",
                path.display()
            )));
        }
        Ok(Some(commit.to_string()))
    }

    /// Records that `revision` is at `commit`. Not done for a commit hash, which needs no ref
    /// (huggingface_hub does the same).
    pub fn write_ref(&self, revision: &Revision, commit: &str) -> Result<(), HubError> {
        if revision.is_commit() {
            return Ok(());
        }
        let path = self.dir.join("refs").join(revision.as_str());
        write_atomically(&path, commit.as_bytes())
    }

    /// Points `snapshots/{commit}/{file}` at `blobs/{etag}` with a relative symlink, replacing
    /// whatever was there in one step.
    pub fn link_snapshot_file(
        &self,
        commit: &str,
        file: &str,
        etag: &str,
    ) -> Result<PathBuf, HubError> {
        let link = self.snapshot_dir(commit).join(file);
        let parent = parent_of(&link)?;
        std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        // From snapshots/{commit}/{file}: up over the file's own folders, the commit and
        // `snapshots`, then down into blobs.
        let depth = file.split('/').count() + 1;
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        let temp = sibling_temp_path(&link);
        let _ = std::fs::remove_file(&temp);
        symlink(&target, &temp).map_err(|e| HubError::io(&temp, e))?;
        std::fs::rename(&temp, &link).map_err(|e| {
            let _ = std::fs::remove_file(&temp);
            HubError::io(&link, e)
        })?;
        Ok(link)
    }

    /// Takes the lock that huggingface_hub also takes before writing a blob, so two
    /// downloads (Lily's or Python's) never write the same file at once.
    pub fn lock_blob(&self, etag: &str) -> Result<BlobLock, HubError> {
        std::fs::create_dir_all(&self.locks).map_err(|e| HubError::io(&self.locks, e))?;
        let path = self.locks.join(format!("{etag}.lock"));
        let file = File::create(&path).map_err(|e| HubError::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => Ok(BlobLock { _file: file }),
            Err(std::fs::TryLockError::WouldBlock) => Err(HubError::Locked(path)),
            Err(std::fs::TryLockError::Error(e)) => Err(HubError::io(path, e)),
        }
    }

    /// The snapshot directory `revision` resolves to in the cache, without any network.
    pub fn find_snapshot(&self, revision: &Revision) -> Result<PathBuf, HubError> {
        let not_cached = || HubError::NotCached {
            repo: self.repo_spec(revision),
            cache: self.dir.parent().unwrap_or(&self.dir).to_path_buf(),
        };
        let commit = self.read_ref(revision)?.ok_or_else(not_cached)?;
        let dir = self.snapshot_dir(&commit);
        if !dir.is_dir() {
            return Err(not_cached());
        }
        Ok(dir)
    }

    /// How the user names this repository at `revision` (`ORG/NAME` or `ORG/NAME@REV`).
    pub fn repo_spec(&self, revision: &Revision) -> String {
        if *revision == Revision::main() {
            self.repo.to_string()
        } else {
            format!("{}@{}", self.repo, revision)
        }
    }
}

/// An exclusive lock on one blob, released when dropped (the file closes).
pub struct BlobLock {
    _file: File,
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that readers see the
/// old content or the new one, never a part.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), HubError> {
    let parent = parent_of(path)?;
    std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
    let temp = sibling_temp_path(path);
    std::fs::write(&temp, bytes).map_err(|e| HubError::io(&temp, e))?;
    std::fs::rename(&temp, path).map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        HubError::io(path, e)
    })
}

fn parent_of(path: &Path) -> Result<&Path, HubError> {
    path.parent().ok_or_else(|| {
        HubError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path has no parent"),
        )
    })
}

/// A name next to `path` for staging a replacement; the process id keeps two writers apart.
fn sibling_temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".lily-tmp-{}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(windows)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::windows::fs::symlink_file(target, link)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_links_resolve_to_their_blob_at_any_depth() {
        let dir = tempfile::tempdir().unwrap();
        let repo = RepoCache::new(dir.path(), &RepoId::parse("org/name").unwrap());
        let commit = "a".repeat(40);
        std::fs::create_dir_all(repo.dir().join("blobs")).unwrap();
        std::fs::write(repo.blob_path("1234"), b"blob one").unwrap();
        for file in ["top.json", "sub/dir/deep.bin"] {
            let link = repo.link_snapshot_file(&commit, file, "1234").unwrap();
            assert_eq!(std::fs::read(&link).unwrap(), b"blob one", "{file}");
        }
        // Replacing a link points it at the new blob.
        std::fs::write(repo.blob_path("5678"), b"blob two").unwrap();
        let link = repo
            .link_snapshot_file(&commit, "top.json", "5678")
            .unwrap();
        assert_eq!(std::fs::read(link).unwrap(), b"blob two");
    }

    #[test]
    fn refs_round_trip_and_commits_need_none() {
        let dir = tempfile::tempdir().unwrap();
        let repo = RepoCache::new(dir.path(), &RepoId::parse("org/name").unwrap());
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let pr = Revision::parse("refs/pr/1").unwrap();
        assert_eq!(repo.read_ref(&pr).unwrap(), None);
        repo.write_ref(&pr, commit).unwrap();
        assert_eq!(repo.read_ref(&pr).unwrap().as_deref(), Some(commit));
        let pinned = Revision::parse(commit).unwrap();
        repo.write_ref(&pinned, commit).unwrap();
        assert!(!repo.dir().join("refs").join(commit).exists());
        assert_eq!(repo.read_ref(&pinned).unwrap().as_deref(), Some(commit));
        std::fs::write(repo.dir().join("refs/main"), "not a commit").unwrap();
        assert!(matches!(
            repo.read_ref(&Revision::main()),
            Err(HubError::BadMetadata(_))
        ));
    }

    #[test]
    fn a_blob_lock_excludes_a_second_writer_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let repo = RepoCache::new(dir.path(), &RepoId::parse("org/name").unwrap());
        let held = repo.lock_blob("abcd").unwrap();
        assert!(matches!(repo.lock_blob("abcd"), Err(HubError::Locked(_))));
        drop(held);
        assert!(repo.lock_blob("abcd").is_ok());
    }
}
