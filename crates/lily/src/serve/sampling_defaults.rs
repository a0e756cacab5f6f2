//! The sampling a request gets for the fields it leaves out: the model's
//! `generation_config.json` (Qwen3.6: temperature 1.0, top-k 20, top-p 0.95).

use std::path::Path;

use anyhow::{Context, Result};
use lily_core::sampling::SamplingParams;
use serde_json::Value;

const QWEN36_GENERATION_CONFIG: &str =
    include_str!("../../../../assets/qwen3.6/generation_config.json");

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
}

impl SamplingDefaults {
    /// The checkpoint directory's `generation_config.json` when it has one, else Qwen3.6's.
    pub fn for_model(dir: Option<&Path>) -> Result<Self> {
        if let Some(path) = dir.map(|d| d.join("generation_config.json"))
            && path.is_file()
        {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            return Self::from_json(&text).with_context(|| format!("{}", path.display()));
        }
        Self::from_json(QWEN36_GENERATION_CONFIG)
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let config: Value = serde_json::from_str(text).context("parsing the generation config")?;
        let number = |key: &str| config.get(key).and_then(Value::as_f64);
        let greedy = config.get("do_sample").and_then(Value::as_bool) == Some(false);
        Ok(SamplingDefaults {
            temperature: if greedy {
                0.0
            } else {
                number("temperature").unwrap_or(1.0) as f32
            },
            top_k: config.get("top_k").and_then(Value::as_u64).unwrap_or(0) as usize,
            top_p: number("top_p").unwrap_or(1.0) as f32,
            min_p: number("min_p").unwrap_or(0.0) as f32,
        })
    }

    pub fn params(&self, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_defaults_come_from_its_generation_config() {
        let d = SamplingDefaults::for_model(None).unwrap();
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: 1.0,
                top_k: 20,
                top_p: 0.95,
                min_p: 0.0
            }
        );
        let greedy = SamplingDefaults::from_json(r#"{"do_sample": false, "temperature": 0.7}"#);
        assert_eq!(greedy.unwrap().temperature, 0.0);
    }
}
