//! Everything a download can run into, each with a message that tells the user what to do.
//! Messages are one line: the binary prints them after `error: `.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{0:?} is not a Hub repository id: expected ORG/NAME, e.g. mlx-community/Qwen3.6-35B-A3B-4bit"
    )]
    InvalidRepoId(String),

    #[error("{0:?} is not a valid revision (a branch, a tag or a commit hash)")]
    InvalidRevision(String),

    #[error(
        "{repo} is neither a directory nor in the Hub cache {cache}; run `lily pull {repo}` or \
         pass --download (the cache is $HF_HUB_CACHE, else $HF_HOME/hub, else \
         ~/.cache/huggingface/hub)"
    )]
    NotCached { repo: String, cache: PathBuf },

    #[error(
        "the cached snapshot of {repo} ({snapshot}) is incomplete: {missing} is missing; run \
         `lily pull {repo}` to finish it"
    )]
    IncompleteSnapshot {
        repo: String,
        snapshot: PathBuf,
        missing: String,
    },

    #[error(
        "repository {repo} was not found on {endpoint}, or it is private: check the name, and for \
         a private repository set HF_TOKEN to an access token that can read it"
    )]
    RepoNotFound { repo: String, endpoint: String },

    #[error(
        "{repo} is a gated repository: log in at {endpoint}/{repo}, accept its terms, then set \
         HF_TOKEN to an access token of that account"
    )]
    GatedWithoutToken { repo: String, endpoint: String },

    #[error(
        "the token in HF_TOKEN has no access to the gated repository {repo}: accept its terms at \
         {endpoint}/{repo} with the account the token belongs to{detail}"
    )]
    GatedWithoutAccess {
        repo: String,
        endpoint: String,
        detail: String,
    },

    #[error("the Hub rejected the access token ({message}): check HF_TOKEN")]
    BadToken { message: String },

    #[error("revision {revision:?} was not found in {repo}")]
    RevisionNotFound { repo: String, revision: String },

    #[error("{file} was not found in {repo} at revision {revision}")]
    EntryNotFound {
        repo: String,
        revision: String,
        file: String,
    },

    #[error("{url} answered HTTP {status}{detail}")]
    Status {
        url: String,
        status: u16,
        detail: String,
    },

    #[error("cannot reach {url}: {cause}")]
    Network { url: String, cause: String },

    #[error("the Hub's answer is not usable: {0}")]
    BadMetadata(String),

    #[error(
        "{file}: the transfer ended after {received} of {expected} bytes ({cause}); run the \
         same command again to resume from there"
    )]
    Interrupted {
        file: String,
        received: u64,
        expected: u64,
        cause: String,
    },

    #[error(
        "{file}: the downloaded data does not match the Hub's {algorithm} {expected} (got \
         {actual}); the bad copy was deleted, nothing in the cache was replaced"
    )]
    ChecksumMismatch {
        file: String,
        algorithm: &'static str,
        expected: String,
        actual: String,
    },

    #[error(
        "offline mode is on (HF_HUB_OFFLINE is set), so {repo} cannot be downloaded; unset it \
         to download"
    )]
    Offline { repo: String },

    #[error("another download of the same file is in progress (it holds the lock {0})")]
    Locked(PathBuf),

    #[error("neither HF_HOME nor HOME is set, so there is no cache directory: set HF_HOME")]
    NoCacheDir,

    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
}

impl HubError {
    /// Whether trying again may succeed: a dropped connection, a timeout, a server error or
    /// a transfer cut short. Answers that will not change (not found, no access) are final.
    pub fn is_transient(&self) -> bool {
        match self {
            HubError::Network { .. } | HubError::Interrupted { .. } => true,
            HubError::Status { status, .. } => matches!(status, 408 | 429 | 500..=599),
            _ => false,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        HubError::Io {
            path: path.into(),
            cause,
        }
    }
}
