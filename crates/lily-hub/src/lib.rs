//! Getting Lily's model from the Hugging Face Hub: `pull` a repository into the Hub's
//! standard cache (shared with the Python tools), and find a pulled model offline.
//!
//! Built directly on a small blocking HTTP client rather than on the `hf-hub` crate: its
//! blocking API (0.4) sets no timeouts, panics on some server answers, does not check
//! checksums and appends a full body to a partial file when a server ignores a range; its
//! current API (1.0) does not resume and needs tokio and the Xet client. What is kept from it,
//! and from huggingface_hub, is the protocol and the cache layout (see [`cache`] and [`http`]).
//!
//! Guarantees: bounded timeouts on every connection and read; the token is sent to the Hub's
//! own origin only; a file enters the cache only after its size and hash match the Hub's file
//! list; an interrupted download resumes where it stopped; a corrupt cached file is detected
//! and fetched again.

pub mod cache;
pub mod download;
pub mod error;
pub mod http;
pub mod metadata;
pub mod names;
pub mod progress;
pub mod pull;
pub mod resolve;
pub mod settings;
pub mod verify;

pub use error::HubError;
pub use metadata::{RepoFile, RepoInfo};
pub use names::{RepoId, Revision};
pub use progress::{FileOutcome, PullProgress, Quiet, Stage};
pub use pull::{PullReport, place_in_dir, pull};
pub use resolve::{ModelSpec, find_cached_model};
pub use settings::HubSettings;

/// The repository `lily pull` fetches when none is named: the MLX 4-bit checkpoint.
pub const DEFAULT_REPO: &str = "mlx-community/Qwen3.6-35B-A3B-4bit";
