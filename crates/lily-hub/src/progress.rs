//! What a pull reports while it works, for a progress bar (the binary's) or a test's record.

use crate::error::HubError;
use crate::metadata::RepoInfo;

/// What happens to a file's bytes at the moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Hashing a copy already on disk (a cached blob or a partial download).
    Verifying,
    Downloading,
}

/// How a file came to be in the snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileOutcome {
    /// A valid copy was already in the cache.
    Cached,
    /// Downloaded, continuing a partial download of `resumed_from` bytes when not zero.
    Downloaded { resumed_from: u64 },
    /// The cached copy failed its check; it was deleted and downloaded again.
    Refetched,
}

pub trait PullProgress {
    /// The commit being pulled and its files.
    fn begin(&mut self, _repo: &str, _info: &RepoInfo) {}
    /// Work on `file` (re)starts at byte `position` of `size`.
    fn stage(&mut self, _file: &str, _stage: Stage, _position: u64, _size: u64) {}
    /// `bytes` more of the current stage are done.
    fn advance(&mut self, _bytes: u64) {}
    /// Attempt `attempt` on `file` failed with `error`; another follows.
    fn retry(&mut self, _file: &str, _attempt: u32, _error: &HubError) {}
    /// `file` is in the snapshot.
    fn done(&mut self, _file: &str, _outcome: &FileOutcome) {}
}

/// Reports nothing.
pub struct Quiet;

impl PullProgress for Quiet {}
