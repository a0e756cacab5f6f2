//! One file into the cache: reuse a valid cached blob, else download it to
//! `blobs/{etag}.incomplete` (resuming what is there), check its size and hash, and only then
//! rename it to `blobs/{etag}`. A failed or cut transfer leaves at most the `.incomplete`
//! file, never a wrong blob; a copy that fails its hash is deleted.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;

use crate::cache::RepoCache;
use crate::error::HubError;
use crate::http::{HubClient, Subject, backoff, header};
use crate::metadata::RepoFile;
use crate::names::RepoId;
use crate::progress::{FileOutcome, PullProgress, Stage};
use crate::verify::{ContentHasher, hash_file};

/// Bytes moved per read and write.
const CHUNK: usize = 1 << 20;

/// A file of one commit to bring into the cache.
pub struct FileJob<'a> {
    pub client: &'a HubClient,
    pub cache: &'a RepoCache,
    pub repo: &'a RepoId,
    pub commit: &'a str,
    pub file: &'a RepoFile,
}

impl FileJob<'_> {
    /// Makes `snapshots/{commit}/{file}` point at a verified blob, downloading it if needed.
    pub fn run(&self, progress: &mut dyn PullProgress) -> Result<FileOutcome, HubError> {
        let etag = &self.file.etag;
        let blobs = self.cache.dir().join("blobs");
        std::fs::create_dir_all(&blobs).map_err(|e| HubError::io(&blobs, e))?;
        let _lock = self.cache.lock_blob(etag)?;
        let blob = self.cache.blob_path(etag);
        let mut refetch = false;
        if blob.exists() {
            if self.verify_copy(&blob, progress)? {
                self.cache
                    .link_snapshot_file(self.commit, &self.file.path, etag)?;
                return Ok(FileOutcome::Cached);
            }
            // A wrong blob must not stay where a good one belongs.
            std::fs::remove_file(&blob).map_err(|e| HubError::io(&blob, e))?;
            refetch = true;
        }
        let resumed_from = self.download(progress)?;
        self.cache
            .link_snapshot_file(self.commit, &self.file.path, etag)?;
        Ok(if refetch {
            FileOutcome::Refetched
        } else {
            FileOutcome::Downloaded { resumed_from }
        })
    }

    /// Whether the copy at `path` has the file's size and hash.
    fn verify_copy(&self, path: &Path, progress: &mut dyn PullProgress) -> Result<bool, HubError> {
        let len = file_len(path)?;
        if len != self.file.size {
            return Ok(false);
        }
        progress.stage(&self.file.path, Stage::Verifying, 0, len);
        let mut hasher = ContentHasher::new(&self.file.checksum, self.file.size);
        hash_file(path, &mut hasher, &mut |n| progress.advance(n))
            .map_err(|e| HubError::io(path, e))?;
        Ok(hasher.finish() == self.file.checksum.expected())
    }

    /// Downloads into the `.incomplete` file and renames it into place once it checks out.
    /// Returns how many bytes of an earlier partial download were kept.
    fn download(&self, progress: &mut dyn PullProgress) -> Result<u64, HubError> {
        let partial = self.cache.incomplete_path(&self.file.etag);
        let settings = self.client.settings();
        let mut hasher = None;
        let mut resumed_from = None;
        let mut attempt = 1;
        loop {
            match self.attempt(&partial, &mut hasher, &mut resumed_from, progress) {
                Ok(()) => break,
                Err(e) => {
                    let retry = e.is_transient() || matches!(e, HubError::ChecksumMismatch { .. });
                    if !retry || attempt >= settings.attempts {
                        return Err(e);
                    }
                    progress.retry(&self.file.path, attempt, &e);
                    std::thread::sleep(backoff(settings.retry_delay, attempt));
                    attempt += 1;
                }
            }
        }
        let blob = self.cache.blob_path(&self.file.etag);
        std::fs::rename(&partial, &blob).map_err(|e| HubError::io(&blob, e))?;
        Ok(resumed_from.unwrap_or(0))
    }

    /// One try: continue the partial file to the full size, then check it. `hasher` carries
    /// the hash of the partial file between tries, so a resumed file is not read twice.
    fn attempt(
        &self,
        partial: &Path,
        hasher: &mut Option<ContentHasher>,
        resumed_from: &mut Option<u64>,
        progress: &mut dyn PullProgress,
    ) -> Result<(), HubError> {
        let (size, name) = (self.file.size, &self.file.path);
        // Creating it here also covers an empty file, which needs no transfer.
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(partial)
            .map_err(|e| HubError::io(partial, e))?;
        let mut have = file_len(partial)?;
        if have > size {
            // Longer than the file can be: not a prefix of it.
            truncate(partial)?;
            have = 0;
        }
        resumed_from.get_or_insert(have);
        let mut state = match hasher.take() {
            Some(h) if h.hashed_len() == have => h,
            _ => {
                let mut fresh = ContentHasher::new(&self.file.checksum, size);
                if have > 0 {
                    progress.stage(name, Stage::Verifying, 0, have);
                    hash_file(partial, &mut fresh, &mut |n| progress.advance(n))
                        .map_err(|e| HubError::io(partial, e))?;
                }
                fresh
            }
        };
        if have < size
            && let Err(e) = self.transfer(partial, have, &mut state, progress)
        {
            *hasher = Some(state);
            return Err(e);
        }
        let got = file_len(partial)?;
        if got != size {
            *hasher = Some(state);
            return Err(HubError::Interrupted {
                file: name.clone(),
                received: got,
                expected: size,
                cause: "the connection closed early".to_string(),
            });
        }
        let actual = state.finish();
        if actual != self.file.checksum.expected() {
            std::fs::remove_file(partial).map_err(|e| HubError::io(partial, e))?;
            return Err(HubError::ChecksumMismatch {
                file: name.clone(),
                algorithm: self.file.checksum.algorithm(),
                expected: self.file.checksum.expected().to_string(),
                actual,
            });
        }
        Ok(())
    }

    /// Appends the bytes from `have` on to the partial file (or rewrites it when the server
    /// ignores the range), hashing them as they are written.
    fn transfer(
        &self,
        partial: &Path,
        have: u64,
        hasher: &mut ContentHasher,
        progress: &mut dyn PullProgress,
    ) -> Result<(), HubError> {
        let (size, name) = (self.file.size, &self.file.path);
        let url = self.client.resolve_url(self.repo, self.commit, name);
        let subject = Subject::File {
            repo: self.repo,
            revision: self.commit,
            file: name,
        };
        let (response, hub) = self.client.get(&url, (have > 0).then_some(have), subject)?;
        if let Some(commit) = hub.commit.filter(|c| c != self.commit) {
            return Err(HubError::BadMetadata(format!(
                "{url} served commit {commit}, not the requested {}",
                self.commit
            )));
        }
        let mut start = have;
        let mut out = if response.status().as_u16() == 206 {
            check_content_range(&url, header(&response, "content-range"), have, size)?;
            OpenOptions::new().append(true).open(partial)
        } else {
            // A 200 is the whole file: start over.
            start = 0;
            *hasher = ContentHasher::new(&self.file.checksum, size);
            File::create(partial)
        }
        .map_err(|e| HubError::io(partial, e))?;
        progress.stage(name, Stage::Downloading, start, size);
        let mut body = response.into_body().into_reader();
        let mut buf = vec![0u8; CHUNK];
        let mut received = start;
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(HubError::Interrupted {
                        file: name.clone(),
                        received,
                        expected: size,
                        cause: e.to_string(),
                    });
                }
            };
            if received + n as u64 > size {
                drop(out);
                truncate(partial)?;
                return Err(HubError::BadMetadata(format!(
                    "{url} sent more than the {size} bytes the file list gives"
                )));
            }
            out.write_all(&buf[..n])
                .map_err(|e| HubError::io(partial, e))?;
            hasher.update(&buf[..n]);
            received += n as u64;
            progress.advance(n as u64);
        }
        // On disk before it can be renamed into place.
        out.sync_all().map_err(|e| HubError::io(partial, e))
    }
}

/// Checks `Content-Range: bytes START-END/TOTAL` of a 206 against what was asked.
fn check_content_range(
    url: &str,
    value: Option<String>,
    from: u64,
    size: u64,
) -> Result<(), HubError> {
    let bad = || {
        HubError::BadMetadata(format!(
            "{url} answered a range request with Content-Range {value:?}, expected bytes \
             {from}-{}/{size}",
            size.saturating_sub(1)
        ))
    };
    let spec = value.as_deref().and_then(|v| v.strip_prefix("bytes "));
    let (range, total) = spec.and_then(|s| s.split_once('/')).ok_or_else(bad)?;
    let start = range.split_once('-').map(|(s, _)| s.parse::<u64>());
    if start != Some(Ok(from)) || (total != "*" && total.parse::<u64>() != Ok(size)) {
        return Err(bad());
    }
    Ok(())
}

fn file_len(path: &Path) -> Result<u64, HubError> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(HubError::io(path, e)),
    }
}

fn truncate(path: &Path) -> Result<(), HubError> {
    File::create(path)
        .map(drop)
        .map_err(|e| HubError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_must_match_the_request() {
        let ok = |v: &str| check_content_range("u", Some(v.to_string()), 100, 1000).is_ok();
        assert!(ok("bytes 100-999/1000"));
        assert!(ok("bytes 100-999/*"));
        assert!(!ok("bytes 0-999/1000"));
        assert!(!ok("bytes 100-999/2000"));
        assert!(!ok("100-999/1000"));
        assert!(check_content_range("u", None, 100, 1000).is_err());
    }
}
