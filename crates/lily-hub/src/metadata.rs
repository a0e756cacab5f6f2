//! The Hub's description of a repository at one commit, checked before anything is written:
//! every name must be safe as a path, every file must have a size and a hash.

use serde::Deserialize;

use crate::error::HubError;
use crate::names::{check_blob_name, check_repo_path, is_commit_hash};
use crate::verify::Checksum;

/// One file of the repository, as the cache will hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// Path inside the repository, `/`-separated.
    pub path: String,
    pub size: u64,
    /// What the content must hash to.
    pub checksum: Checksum,
    /// The blob's name in the cache: the ETag the Hub gives the file, which is the sha256
    /// for LFS files and the git blob id for the others.
    pub etag: String,
}

/// A repository at one commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoInfo {
    pub commit: String,
    /// Whether downloads need a token of an account that accepted the repository's terms.
    pub gated: bool,
    /// Sorted by path.
    pub files: Vec<RepoFile>,
}

#[derive(Deserialize)]
struct RawInfo {
    sha: Option<String>,
    #[serde(default)]
    gated: serde_json::Value,
    #[serde(default)]
    siblings: Vec<RawSibling>,
}

#[derive(Deserialize)]
struct RawSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<RawLfs>,
}

#[derive(Deserialize)]
struct RawLfs {
    sha256: String,
    size: u64,
}

impl RepoInfo {
    /// Reads the answer of `/api/models/{repo}/revision/{rev}?blobs=true`.
    pub fn from_json(json: serde_json::Value) -> Result<Self, HubError> {
        let bad = |what: String| HubError::BadMetadata(what);
        let raw: RawInfo = serde_json::from_value(json)
            .map_err(|e| bad(format!("the repository description is malformed ({e})")))?;
        let commit = raw
            .sha
            .filter(|s| is_commit_hash(s))
            .ok_or_else(|| bad("the repository description has no commit hash".to_string()))?;
        // `gated` is false, or the kind of gate ("auto", "manual").
        let gated = !matches!(
            raw.gated,
            serde_json::Value::Null | serde_json::Value::Bool(false)
        );
        let mut files = Vec::with_capacity(raw.siblings.len());
        for s in raw.siblings {
            check_repo_path(&s.rfilename)?;
            let size = s.size.ok_or_else(|| {
                bad(format!(
                    "{} has no size (the file list was not asked with blobs=true?)",
                    s.rfilename
                ))
            })?;
            let (checksum, etag) = match (s.lfs, s.blob_id) {
                (Some(lfs), _) => {
                    if lfs.size != size {
                        return Err(bad(format!(
                            "{}: size {size} but LFS size {}",
                            s.rfilename, lfs.size
                        )));
                    }
                    let hash = lfs.sha256.to_ascii_lowercase();
                    check_hash(&s.rfilename, &hash, 64)?;
                    (Checksum::Sha256(hash.clone()), hash)
                }
                (None, Some(blob_id)) => {
                    let hash = blob_id.to_ascii_lowercase();
                    check_hash(&s.rfilename, &hash, 40)?;
                    (Checksum::GitBlobSha1(hash.clone()), hash)
                }
                (None, None) => {
                    return Err(bad(format!(
                        "{} has neither an LFS hash nor a blob id",
                        s.rfilename
                    )));
                }
            };
            files.push(RepoFile {
                path: s.rfilename,
                size,
                checksum,
                etag,
            });
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        if let Some(w) = files.windows(2).find(|w| w[0].path == w[1].path) {
            return Err(bad(format!("{} is listed twice", w[0].path)));
        }
        Ok(RepoInfo {
            commit,
            gated,
            files,
        })
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

fn check_hash(file: &str, hash: &str, hex_len: usize) -> Result<(), HubError> {
    check_blob_name(hash)?;
    if hash.len() != hex_len {
        return Err(HubError::BadMetadata(format!(
            "{file}: {hash:?} is not a {hex_len}-digit hash"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn reads_the_hubs_file_list() {
        let sha = "a".repeat(64);
        let info = RepoInfo::from_json(json!({
            "id": "org/name", "sha": COMMIT, "gated": "manual", "private": false,
            "siblings": [
                {"rfilename": "model.safetensors", "size": 10, "blobId": "b".repeat(40),
                 "lfs": {"sha256": sha, "size": 10, "pointerSize": 130}},
                {"rfilename": "config.json", "size": 3, "blobId": "C".repeat(40)},
            ]
        }))
        .unwrap();
        assert_eq!(info.commit, COMMIT);
        assert!(info.gated);
        assert_eq!(info.total_bytes(), 13);
        assert_eq!(info.files[0].path, "config.json");
        assert_eq!(
            info.files[0].checksum,
            Checksum::GitBlobSha1("c".repeat(40))
        );
        assert_eq!(info.files[1].etag, "a".repeat(64));
        assert_eq!(info.files[1].checksum, Checksum::Sha256("a".repeat(64)));
        let open = RepoInfo::from_json(json!({"sha": COMMIT, "gated": false, "siblings": []}));
        assert!(!open.unwrap().gated);
    }

    #[test]
    fn refuses_unsafe_or_incomplete_descriptions() {
        let blob = "b".repeat(40);
        for bad in [
            json!({"siblings": []}),
            json!({"sha": "main", "siblings": []}),
            json!({"sha": COMMIT, "siblings": [{"rfilename": "../evil", "size": 1, "blobId": blob}]}),
            json!({"sha": COMMIT, "siblings": [{"rfilename": "a", "blobId": blob}]}),
            json!({"sha": COMMIT, "siblings": [{"rfilename": "a", "size": 1}]}),
            json!({"sha": COMMIT, "siblings": [{"rfilename": "a", "size": 1, "blobId": "../x"}]}),
            json!({"sha": COMMIT, "siblings": [{"rfilename": "a", "size": 1, "blobId": blob,
                   "lfs": {"sha256": "a".repeat(64), "size": 2}}]}),
            json!({"sha": COMMIT, "siblings": [
                {"rfilename": "a", "size": 1, "blobId": blob},
                {"rfilename": "a", "size": 1, "blobId": blob}]}),
        ] {
            assert!(
                matches!(
                    RepoInfo::from_json(bad.clone()),
                    Err(HubError::BadMetadata(_))
                ),
                "accepted {bad}"
            );
        }
    }
}
