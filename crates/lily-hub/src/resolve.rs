//! `--model ORG/NAME[@REVISION]`: the cached snapshot it names, found without any network,
//! and checked to hold a whole checkpoint (a snapshot left half-way by an interrupted pull is
//! reported as such, not loaded).

use std::path::{Path, PathBuf};

use crate::cache::RepoCache;
use crate::error::HubError;
use crate::names::{RepoId, Revision};
use crate::settings::HubSettings;

/// A repository and revision as named on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    pub repo: RepoId,
    pub revision: Revision,
}

impl ModelSpec {
    /// `ORG/NAME` (revision `main`) or `ORG/NAME@REVISION`.
    pub fn parse(text: &str) -> Result<Self, HubError> {
        let (repo, revision) = match text.split_once('@') {
            Some((repo, revision)) => (repo, Revision::parse(revision)?),
            None => (text, Revision::main()),
        };
        Ok(ModelSpec {
            repo: RepoId::parse(repo)?,
            revision,
        })
    }
}

/// The snapshot directory of `spec` in the cache, if it holds `config.json` and every
/// safetensors file the checkpoint needs.
pub fn find_cached_model(settings: &HubSettings, spec: &ModelSpec) -> Result<PathBuf, HubError> {
    let cache = RepoCache::new(&settings.cache_dir, &spec.repo);
    let snapshot = cache.find_snapshot(&spec.revision)?;
    if let Some(missing) = first_missing_file(&snapshot)? {
        return Err(HubError::IncompleteSnapshot {
            repo: cache.repo_spec(&spec.revision),
            snapshot,
            missing,
        });
    }
    Ok(snapshot)
}

/// The first file a checkpoint directory needs and lacks: `config.json`, then the shards the
/// safetensors index names, or `model.safetensors` without an index. `exists` follows the
/// snapshot's symlinks, so a link to a missing blob counts as missing.
fn first_missing_file(dir: &Path) -> Result<Option<String>, HubError> {
    if !dir.join("config.json").exists() {
        return Ok(Some("config.json".to_string()));
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        let single = "model.safetensors";
        return Ok((!dir.join(single).exists()).then(|| single.to_string()));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| HubError::io(&index, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        HubError::io(
            &index,
            std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        )
    })?;
    let mut shards: Vec<&str> = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| m.values().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    shards.sort_unstable();
    shards.dedup();
    // A malformed name is left for the checkpoint loader to report; only plain names are
    // looked up here.
    Ok(shards
        .into_iter()
        .filter(|s| !s.contains('/') && !s.contains('\\') && *s != "..")
        .find(|s| !dir.join(s).exists())
        .map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(cache: &Path) -> HubSettings {
        let mut s = HubSettings::from_vars(|name| (name == "HOME").then(|| "/nonexistent".into()))
            .expect("settings");
        s.cache_dir = cache.to_path_buf();
        s
    }

    #[test]
    fn specs_name_a_repo_and_an_optional_revision() {
        let spec = ModelSpec::parse("org/name").unwrap();
        assert_eq!(spec.revision, Revision::main());
        let spec = ModelSpec::parse("org/name@v2").unwrap();
        assert_eq!(spec.repo.to_string(), "org/name");
        assert_eq!(spec.revision.as_str(), "v2");
        assert!(ModelSpec::parse("org/name@").is_err());
        assert!(ModelSpec::parse("name").is_err());
    }

    #[test]
    fn only_complete_snapshots_resolve() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path());
        let spec = ModelSpec::parse("org/name").unwrap();
        assert!(matches!(
            find_cached_model(&s, &spec),
            Err(HubError::NotCached { .. })
        ));
        let commit = "c".repeat(40);
        let repo = dir.path().join("models--org--name");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), &commit).unwrap();
        let snap = repo.join("snapshots").join(&commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        std::fs::write(
            snap.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}"#,
        )
        .unwrap();
        std::fs::write(snap.join("model-1.safetensors"), "x").unwrap();
        match find_cached_model(&s, &spec) {
            Err(HubError::IncompleteSnapshot { missing, .. }) => {
                assert_eq!(missing, "model-2.safetensors")
            }
            other => panic!("expected an incomplete snapshot, got {other:?}"),
        }
        std::fs::write(snap.join("model-2.safetensors"), "x").unwrap();
        assert_eq!(find_cached_model(&s, &spec).unwrap(), snap);
    }
}
