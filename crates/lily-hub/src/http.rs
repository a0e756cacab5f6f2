//! Talking to the Hub over HTTP: one blocking client with bounded timeouts, redirects followed
//! by hand (so the token never leaves the Hub's own origin, and the Hub's headers are read on
//! the hop that carries them), and the Hub's error answers turned into errors that say what to do.
//!
//! What the Hub does, and what the tests' local server mimics:
//! - `GET /api/models/{repo}/revision/{rev}?blobs=true`: JSON with the commit `sha`, `gated`
//!   (`false`, `"auto"` or `"manual"`) and `siblings` (`rfilename`, `size`, `blobId`, and for
//!   LFS files `lfs.sha256`). The revision is percent-encoded with its slashes.
//! - `GET /{repo}/resolve/{rev}/{file}`: a regular file comes back directly (or after a relative
//!   redirect) with `ETag` = its git blob id; an LFS file is a 302 to a CDN whose headers carry
//!   `X-Linked-Etag` = its sha256 and `X-Linked-Size`. Every answer carries `X-Repo-Commit`.
//!   The CDN honours `Range: bytes=N-` with a 206.
//! - Errors carry `X-Error-Code` (`RepoNotFound`, `GatedRepo`, `RevisionNotFound`,
//!   `EntryNotFound`) and `X-Error-Message`. A missing or private repository is a 401 (the Hub
//!   does not tell them apart); a gated one is a 401 without a token and a 403 with a token
//!   that has not been granted access.

use std::time::Duration;

use ureq::Agent;
use ureq::http::Response;

use crate::error::HubError;
use crate::names::{RepoId, Revision, percent_encode};
use crate::settings::HubSettings;

/// At most this many redirects per request (the Hub uses one or two).
const MAX_REDIRECTS: usize = 10;
/// JSON answers larger than this are refused rather than read into memory.
const MAX_JSON_BYTES: u64 = 64 << 20;

/// What a request is about, to turn an error answer into a message that names it.
#[derive(Clone, Copy)]
pub enum Subject<'a> {
    Repo {
        repo: &'a RepoId,
        revision: &'a Revision,
    },
    File {
        repo: &'a RepoId,
        revision: &'a str,
        file: &'a str,
    },
}

/// The Hub's own headers on a file answer (from the hop served by the Hub, not the CDN).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileHeaders {
    pub commit: Option<String>,
    /// `X-Linked-Etag` if present (LFS), else `ETag`, without quotes or a weak prefix.
    pub etag: Option<String>,
}

pub struct HubClient {
    agent: Agent,
    settings: HubSettings,
}

impl HubClient {
    pub fn new(settings: &HubSettings) -> Self {
        let mut config = Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_connect(Some(settings.connect_timeout))
            .timeout_recv_response(Some(settings.read_timeout))
            .timeout_per_read(Some(settings.read_timeout))
            .timeout_per_write(Some(settings.read_timeout))
            .user_agent(format!("lily-hub/{}", env!("CARGO_PKG_VERSION")));
        // A proxy from the environment is for the outside world; a Hub on this machine (a
        // mirror, the tests' server) is reached directly.
        if is_loopback(&settings.endpoint) {
            config = config.proxy(None);
        }
        HubClient {
            agent: config.build().into(),
            settings: settings.clone(),
        }
    }

    pub fn settings(&self) -> &HubSettings {
        &self.settings
    }

    /// The repository's metadata at `revision`, with per-file sizes and hashes.
    pub fn repo_info(
        &self,
        repo: &RepoId,
        revision: &Revision,
    ) -> Result<serde_json::Value, HubError> {
        let url = format!(
            "{}/api/models/{repo}/revision/{}?blobs=true",
            self.settings.endpoint,
            percent_encode(revision.as_str(), false)
        );
        let (response, _) = self.get(&url, None, Subject::Repo { repo, revision })?;
        let text = response
            .into_body()
            .with_config()
            .limit(MAX_JSON_BYTES)
            .read_to_string()
            .map_err(|e| network(&url, &e))?;
        serde_json::from_str(&text)
            .map_err(|e| HubError::BadMetadata(format!("{url} did not answer JSON ({e})")))
    }

    /// The URL that serves `file` of `repo` at `commit`.
    pub fn resolve_url(&self, repo: &RepoId, commit: &str, file: &str) -> String {
        format!(
            "{}/{repo}/resolve/{}/{}",
            self.settings.endpoint,
            percent_encode(commit, false),
            percent_encode(file, true)
        )
    }

    /// GETs `url`, from byte `range_from` on when given, following redirects. Returns the
    /// final successful answer and the Hub's headers seen on the way.
    pub fn get(
        &self,
        url: &str,
        range_from: Option<u64>,
        subject: Subject,
    ) -> Result<(Response<ureq::Body>, FileHeaders), HubError> {
        let hub_origin = origin(&self.settings.endpoint);
        let mut headers = FileHeaders::default();
        let mut current = url.to_string();
        for _ in 0..=MAX_REDIRECTS {
            let on_hub = origin(&current) == hub_origin;
            let mut request = self.agent.get(&current);
            if let Some(from) = range_from {
                request = request.header("Range", format!("bytes={from}-"));
            }
            // The token is for the Hub only: CDN URLs are pre-signed.
            if let (true, Some(token)) = (on_hub, &self.settings.token) {
                request = request.header("Authorization", format!("Bearer {token}"));
            }
            let response = request.call().map_err(|e| network(&current, &e))?;
            if on_hub && let Some(commit) = header(&response, "x-repo-commit") {
                headers.commit = Some(commit);
                headers.etag = header(&response, "x-linked-etag")
                    .or_else(|| header(&response, "etag"))
                    .map(|e| clean_etag(&e));
            }
            let status = response.status().as_u16();
            if (300..400).contains(&status) && status != 304 {
                let location = header(&response, "location").ok_or_else(|| {
                    HubError::BadMetadata(format!("{current} redirected without a Location"))
                })?;
                current = join_location(&current, &location);
                continue;
            }
            if (200..300).contains(&status) {
                return Ok((response, headers));
            }
            return Err(self.error_for(&current, response, subject));
        }
        Err(HubError::BadMetadata(format!(
            "{url} redirected more than {MAX_REDIRECTS} times"
        )))
    }

    /// Turns an error answer into the error that tells the user what to do.
    fn error_for(&self, url: &str, response: Response<ureq::Body>, subject: Subject) -> HubError {
        let status = response.status().as_u16();
        let code = header(&response, "x-error-code").unwrap_or_default();
        let message = header(&response, "x-error-message").unwrap_or_default();
        let endpoint = self.settings.endpoint.clone();
        let has_token = self.settings.token.is_some();
        let (repo, revision, file) = match subject {
            Subject::Repo { repo, revision } => (repo.to_string(), revision.to_string(), None),
            Subject::File {
                repo,
                revision,
                file,
            } => (repo.to_string(), revision.to_string(), Some(file)),
        };
        match (code.as_str(), status, file) {
            ("GatedRepo", _, _) if has_token => HubError::GatedWithoutAccess {
                repo,
                endpoint,
                detail: if message.is_empty() {
                    String::new()
                } else {
                    format!(" (the Hub says: {message})")
                },
            },
            ("GatedRepo", _, _) => HubError::GatedWithoutToken { repo, endpoint },
            ("RevisionNotFound", _, _) => HubError::RevisionNotFound { repo, revision },
            ("EntryNotFound", _, Some(file)) | ("", 404, Some(file)) => HubError::EntryNotFound {
                repo,
                revision,
                file: file.to_string(),
            },
            // Without a code, a 401 that carries a token is the token's fault; otherwise the
            // Hub answers 401 alike for a missing and a private repository.
            ("", 401, _) if has_token => HubError::BadToken {
                message: if message.is_empty() {
                    "HTTP 401".to_string()
                } else {
                    message
                },
            },
            ("RepoNotFound", _, _) | ("", 401 | 404, _) => {
                HubError::RepoNotFound { repo, endpoint }
            }
            _ => HubError::Status {
                url: url.to_string(),
                status,
                detail: if message.is_empty() {
                    String::new()
                } else {
                    format!(": {message}")
                },
            },
        }
    }
}

/// A header's value as text, if present and printable.
pub fn header(response: &Response<ureq::Body>, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn network(url: &str, e: &ureq::Error) -> HubError {
    HubError::Network {
        url: url.to_string(),
        cause: e.to_string(),
    }
}

/// An ETag without the weak marker and quotes: `W/"abc"` -> `abc`.
fn clean_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(i) => &url[..after_scheme + i],
        None => url,
    }
}

/// Resolves a `Location` against the URL that answered with it.
fn join_location(current: &str, location: &str) -> String {
    if location.starts_with("http://") || location.starts_with("https://") {
        location.to_string()
    } else if location.starts_with('/') {
        format!("{}{location}", origin(current))
    } else {
        let path_end = current.find('?').unwrap_or(current.len());
        let base = &current[..path_end];
        let dir = &base[..base.rfind('/').map_or(base.len(), |i| i + 1)];
        format!("{dir}{location}")
    }
}

fn is_loopback(url: &str) -> bool {
    let host = origin(url).split("://").nth(1).unwrap_or("");
    let host = match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    host == "localhost"
        || host == "[::1]"
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Waits before attempt `attempt` (1-based retries): `delay`, then doubling.
pub fn backoff(delay: Duration, attempt: u32) -> Duration {
    delay.saturating_mul(1 << attempt.saturating_sub(1).min(6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_resolve_like_a_browser() {
        let cur = "https://huggingface.co/org/name/resolve/main/config.json?x=1";
        assert_eq!(
            join_location(cur, "https://cdn.example/abc?sig=1"),
            "https://cdn.example/abc?sig=1"
        );
        assert_eq!(
            join_location(cur, "/api/resolve-cache/models/org/name/c/config.json"),
            "https://huggingface.co/api/resolve-cache/models/org/name/c/config.json"
        );
        assert_eq!(
            join_location(cur, "other.json"),
            "https://huggingface.co/org/name/resolve/main/other.json"
        );
    }

    #[test]
    fn origins_and_loopback_hosts() {
        assert_eq!(origin("http://127.0.0.1:8080/a/b"), "http://127.0.0.1:8080");
        assert_eq!(origin("https://huggingface.co"), "https://huggingface.co");
        assert!(is_loopback("http://127.0.0.1:8080"));
        assert!(is_loopback("http://localhost:1/x"));
        assert!(is_loopback("http://[::1]:1/x"));
        assert!(!is_loopback("https://huggingface.co"));
        assert!(!is_loopback("https://127.example.com"));
    }

    #[test]
    fn etags_lose_quotes_and_weak_markers() {
        assert_eq!(clean_etag("W/\"abc123\""), "abc123");
        assert_eq!(clean_etag("\"def\""), "def");
    }

    #[test]
    fn backoff_doubles_and_is_bounded() {
        let d = Duration::from_secs(2);
        assert_eq!(backoff(d, 1), Duration::from_secs(2));
        assert_eq!(backoff(d, 3), Duration::from_secs(8));
        assert_eq!(backoff(d, 50), Duration::from_secs(128));
    }
}
