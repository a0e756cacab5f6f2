//! What `--model` names: a checkpoint directory or `synthetic:NAME`. (A Hub repository
//! `ORG/NAME` is looked up in the download cache by the binary, and becomes its directory.)

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::source::TensorSource;
use crate::synthetic::{SyntheticSource, synthetic_config};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelRef {
    Dir(PathBuf),
    Synthetic(String),
}

/// The seed of every `synthetic:*` model, so that all tools see the same weights.
pub const SYNTHETIC_SEED: u64 = 0x5eed_0001;

impl ModelRef {
    pub fn parse(spec: &str) -> Result<Self> {
        if let Some(name) = spec.strip_prefix("synthetic:") {
            synthetic_config(name)?;
            return Ok(ModelRef::Synthetic(name.to_string()));
        }
        let path = Path::new(spec);
        if !path.is_dir() {
            bail!(
                "model {spec:?} is neither a checkpoint directory, a Hub repository ORG/NAME \
                 nor synthetic:NAME (e.g. synthetic:tiny)"
            );
        }
        Ok(ModelRef::Dir(path.to_path_buf()))
    }

    pub fn display_name(&self) -> String {
        match self {
            ModelRef::Dir(p) => p.display().to_string(),
            ModelRef::Synthetic(n) => format!("synthetic:{n}"),
        }
    }

    /// The validated config, without touching any weights.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            ModelRef::Dir(dir) => ModelConfig::from_dir(dir),
            ModelRef::Synthetic(name) => synthetic_config(name),
        }
    }

    /// The config and a source of its tensors.
    pub fn open(&self) -> Result<(ModelConfig, Box<dyn TensorSource>)> {
        let config = self.config()?;
        let source: Box<dyn TensorSource> = match self {
            ModelRef::Dir(dir) => Box::new(Checkpoint::open(dir)?),
            ModelRef::Synthetic(_) => Box::new(SyntheticSource::new(SYNTHETIC_SEED)),
        };
        Ok((config, source))
    }
}
