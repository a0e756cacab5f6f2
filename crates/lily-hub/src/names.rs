//! Names that come from the user or the server and end up in URLs and cache paths: repository
//! ids, revisions and file paths inside a repository. Each is checked before use, so that no
//! name can escape the cache directory or change the meaning of a URL.

use std::fmt;

use crate::error::HubError;

/// The Hub's `ORG/NAME` id of a model repository.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RepoId {
    org: String,
    name: String,
}

impl RepoId {
    /// Checks `ORG/NAME` by the Hub's rules (huggingface_hub's `validate_repo_id`): letters,
    /// digits, `-`, `_` and `.`; no `--` or `..`; neither part starts or ends with `-` or `.`;
    /// at most 96 characters.
    pub fn parse(text: &str) -> Result<Self, HubError> {
        let invalid = || HubError::InvalidRepoId(text.to_string());
        let (org, name) = text.split_once('/').ok_or_else(invalid)?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && !p.contains("--")
                && !p.contains("..")
                && !p.starts_with(['-', '.'])
                && !p.ends_with(['-', '.'])
        };
        if text.len() > 96 || !part_ok(org) || !part_ok(name) {
            return Err(invalid());
        }
        Ok(RepoId {
            org: org.to_string(),
            name: name.to_string(),
        })
    }

    /// Whether `text` has the shape of a repository id (so that a missing directory of that
    /// name is better explained as a missing download).
    pub fn looks_like(text: &str) -> bool {
        Self::parse(text).is_ok()
    }

    /// The cache folder of the repository: `models--ORG--NAME`.
    pub fn cache_folder(&self) -> String {
        format!("models--{}--{}", self.org, self.name)
    }
}

impl fmt::Display for RepoId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.org, self.name)
    }
}

/// A branch, tag or commit of a repository.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revision(String);

impl Revision {
    /// The revision `main`, what the Hub serves by default.
    pub fn main() -> Self {
        Revision("main".to_string())
    }

    /// Checks a revision: it becomes a path under `refs/`, so it may contain `/` (as in
    /// `refs/pr/1`) but no empty, `.` or `..` component, no backslash and no control character.
    pub fn parse(text: &str) -> Result<Self, HubError> {
        if text.is_empty()
            || text.len() > 255
            || text.contains('\\')
            || text.chars().any(char::is_control)
            || text
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(HubError::InvalidRevision(text.to_string()));
        }
        Ok(Revision(text.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is a full commit hash (40 lowercase hex digits), which needs no `refs/`
    /// entry: it names its snapshot directly.
    pub fn is_commit(&self) -> bool {
        is_commit_hash(&self.0)
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `text` is a full git commit hash as the Hub writes it.
pub fn is_commit_hash(text: &str) -> bool {
    text.len() == 40 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Checks a file path inside a repository (from the Hub's file list or a user): relative,
/// `/`-separated, with no empty, `.` or `..` component, no backslash and no control character.
pub fn check_repo_path(path: &str) -> Result<(), HubError> {
    if path.is_empty()
        || path.len() > 1024
        || path.contains('\\')
        || path.chars().any(char::is_control)
        || path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(HubError::BadMetadata(format!(
            "{path:?} is not a safe relative file path"
        )));
    }
    Ok(())
}

/// Checks a blob name taken from the server (an ETag or hash): it becomes a file name in
/// `blobs/`, so only hex digits are accepted, which is what the Hub uses.
pub fn check_blob_name(name: &str) -> Result<(), HubError> {
    if name.is_empty() || name.len() > 128 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(HubError::BadMetadata(format!(
            "{name:?} is not a hexadecimal content hash"
        )));
    }
    Ok(())
}

/// Percent-encodes `text` for a URL path, leaving RFC 3986's unreserved characters and, when
/// `keep_slash`, the `/` separators (file paths keep them; revisions do not, as in
/// huggingface_hub's `quote(revision, safe="")`).
pub fn percent_encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else if b == b'/' && keep_slash {
            out.push('/');
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_follow_the_hub_rules() {
        let id = RepoId::parse("mlx-community/Qwen3.6-35B-A3B-4bit").unwrap();
        assert_eq!(id.to_string(), "mlx-community/Qwen3.6-35B-A3B-4bit");
        assert_eq!(
            id.cache_folder(),
            "models--mlx-community--Qwen3.6-35B-A3B-4bit"
        );
        for bad in [
            "Qwen", "a/b/c", "../etc", "org/..", "org/-x", "org/x.", "org/a--b", "org/a b",
            "/name", "org/",
        ] {
            assert!(RepoId::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn revisions_cannot_escape_refs() {
        assert!(Revision::parse("refs/pr/1").is_ok());
        assert!(Revision::parse("v1.0").is_ok());
        for bad in ["", "../x", "a/../b", "/main", "main/", "a\\b", "a\nb"] {
            assert!(Revision::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(Revision::parse(&"ab12".repeat(10)).unwrap().is_commit());
        assert!(!Revision::parse(&"AB12".repeat(10)).unwrap().is_commit());
        assert!(!Revision::main().is_commit());
    }

    #[test]
    fn file_paths_and_blob_names_are_checked() {
        assert!(check_repo_path("config.json").is_ok());
        assert!(check_repo_path("sub/dir/file.bin").is_ok());
        for bad in ["", "/etc/passwd", "../x", "a//b", "a/./b", "a\\b"] {
            assert!(check_repo_path(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(check_blob_name("0123abcdef").is_ok());
        for bad in ["", "../x", "abc/def", "W/\"abc\""] {
            assert!(check_blob_name(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn percent_encoding_keeps_only_unreserved_characters() {
        assert_eq!(percent_encode("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(percent_encode("dir/a b+c.json", true), "dir/a%20b%2Bc.json");
        assert_eq!(percent_encode("é", true), "%C3%A9");
    }
}
