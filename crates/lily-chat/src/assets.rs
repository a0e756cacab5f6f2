//! Where a model's tokenizer and chat template come from: the checkpoint directory's own files
//! when present, else the Qwen3.6 copies built into the binary.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use crate::template::{ChatTemplate, QWEN36_CHAT_TEMPLATE};
use crate::tokenizer::TextTokenizer;

pub struct TextModel {
    pub tokenizer: TextTokenizer,
    pub template: ChatTemplate,
    /// Where the tokenizer and template came from, for the startup log.
    pub provenance: String,
}

impl TextModel {
    /// Qwen3.6's tokenizer and template, built in (what `synthetic:*` models use).
    pub fn embedded() -> Result<Self> {
        Ok(TextModel {
            tokenizer: TextTokenizer::embedded()?,
            template: ChatTemplate::new(QWEN36_CHAT_TEMPLATE)?,
            provenance: "built-in Qwen3.6 tokenizer and chat template".to_string(),
        })
    }

    /// A checkpoint directory's `tokenizer.json`, and its `chat_template.jinja` or the
    /// `chat_template` of its `tokenizer_config.json`; the built-in Qwen3.6 template if it has
    /// neither. A directory without a tokenizer is an error: its vocabulary is unknown.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            bail!(
                "{} has no tokenizer.json, so text cannot be encoded or decoded; copy \
                 tokenizer.json (and chat_template.jinja) from the original checkpoint, or \
                 use token ids",
                dir.display()
            );
        }
        let tokenizer = TextTokenizer::from_file(&tokenizer_path)?;
        let (source, from) = template_source(dir)?;
        let template = ChatTemplate::new(&source).with_context(|| from.clone())?;
        Ok(TextModel {
            tokenizer,
            template,
            provenance: format!(
                "{} with the chat template from {from}",
                tokenizer_path.display()
            ),
        })
    }
}

fn template_source(dir: &Path) -> Result<(String, String)> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja)
            .with_context(|| format!("reading {}", jinja.display()))?;
        return Ok((text, jinja.display().to_string()));
    }
    let config_path = dir.join("tokenizer_config.json");
    if config_path.is_file() {
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?;
        let config: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", config_path.display()))?;
        // Either one template, or a list of named ones of which "default" is the chat template.
        let template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            Some(_) => {
                return Err(anyhow!(
                    "{}: chat_template is neither a string nor a list of named templates",
                    config_path.display()
                ));
            }
            None => None,
        };
        if let Some(template) = template {
            return Ok((template, config_path.display().to_string()));
        }
    }
    Ok((
        QWEN36_CHAT_TEMPLATE.to_string(),
        "the built-in Qwen3.6 template".to_string(),
    ))
}
