//! Where to download from, where the cache is and which token to send, read from the same
//! environment variables as huggingface_hub, so that Lily and the Python tools share one cache.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::HubError;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

#[derive(Clone, Debug)]
pub struct HubSettings {
    /// Base URL of the Hub, without a trailing slash (`HF_ENDPOINT`).
    pub endpoint: String,
    /// The hub cache: the folder that holds `models--ORG--NAME` (`$HF_HOME/hub`).
    pub cache_dir: PathBuf,
    /// Access token for gated and private repositories (`HF_TOKEN`).
    pub token: Option<String>,
    /// Downloads are refused (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// Limit on establishing a connection (TCP and TLS).
    pub connect_timeout: Duration,
    /// Limit on any single read while waiting for headers or body bytes: a stalled transfer
    /// fails after this long instead of hanging, however long the whole file takes.
    pub read_timeout: Duration,
    /// How many times one file is tried (resuming each time) before giving up.
    pub attempts: u32,
    /// Wait before the second attempt; it doubles for each later one.
    pub retry_delay: Duration,
}

impl HubSettings {
    /// Settings from the process environment.
    pub fn from_env() -> Result<Self, HubError> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// Settings from `var`, a lookup of environment variables, in huggingface_hub's order:
    /// `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
    /// `~/.cache/huggingface/hub`; the token from `HF_TOKEN`, else the file `HF_TOKEN_PATH`,
    /// else `$HF_HOME/token` (what `huggingface-cli login` writes).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, HubError> {
        let hf_home = match var("HF_HOME") {
            Some(home) => PathBuf::from(home),
            None => {
                let cache = match var("XDG_CACHE_HOME") {
                    Some(xdg) => PathBuf::from(xdg),
                    None => PathBuf::from(var("HOME").ok_or(HubError::NoCacheDir)?).join(".cache"),
                };
                cache.join("huggingface")
            }
        };
        let cache_dir = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token_file = var("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("token"));
        let token = var("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(token_file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true")
        });
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Ok(HubSettings {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            cache_dir,
            token,
            offline,
            connect_timeout: Duration::from_secs(30),
            read_timeout: Duration::from_secs(60),
            attempts: 5,
            retry_delay: Duration::from_secs(2),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn settings(vars: &[(&str, &str)]) -> HubSettings {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubSettings::from_vars(|name| vars.get(name).cloned()).unwrap()
    }

    #[test]
    fn defaults_follow_huggingface_hub() {
        let s = settings(&[("HOME", "/home/u")]);
        assert_eq!(s.endpoint, "https://huggingface.co");
        assert_eq!(s.cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(s.token, None);
        assert!(!s.offline);
    }

    #[test]
    fn variables_override_in_the_documented_order() {
        let s = settings(&[
            ("HOME", "/home/u"),
            ("HF_HOME", "/data/hf"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_TOKEN", "hf_abc"),
            ("HF_HUB_OFFLINE", "1"),
        ]);
        assert_eq!(s.cache_dir, PathBuf::from("/data/hf/hub"));
        assert_eq!(s.endpoint, "http://127.0.0.1:9");
        assert_eq!(s.token.as_deref(), Some("hf_abc"));
        assert!(s.offline);
        let s = settings(&[("HF_HOME", "/data/hf"), ("HF_HUB_CACHE", "/fast/hub")]);
        assert_eq!(s.cache_dir, PathBuf::from("/fast/hub"));
        let s = settings(&[("XDG_CACHE_HOME", "/xdg")]);
        assert_eq!(s.cache_dir, PathBuf::from("/xdg/huggingface/hub"));
    }

    #[test]
    fn the_token_file_is_read_when_hf_token_is_unset() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_from_file\n").unwrap();
        let home = dir.path().to_str().unwrap();
        assert_eq!(
            settings(&[("HF_HOME", home)]).token.as_deref(),
            Some("hf_from_file")
        );
        assert_eq!(
            settings(&[("HF_HOME", home), ("HF_TOKEN", "hf_env")])
                .token
                .as_deref(),
            Some("hf_env")
        );
    }
}
