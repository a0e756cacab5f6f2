//! The OpenAI-compatible server and the generation engine it shares with `lily chat` and
//! `lily generate --prompt`.

pub mod access;
pub mod chat;
pub mod completions;
pub mod constrained;
pub mod engine;
pub mod error;
pub mod ids;
pub mod listen;
pub mod logprobs;
pub mod messages;
pub mod metrics;
pub mod prompt;
pub mod request;
pub mod request_id;
pub mod responses;
#[cfg(test)]
mod robustness_tests;
pub mod routes;
pub mod sampling_defaults;
pub mod snapshots;
pub mod stream;
pub mod tokenize;
pub mod worker;

use anyhow::Result;
use lily_chat::TextModel;
use lily_core::model_ref::ModelRef;

/// The tokenizer and chat template of `model`: a checkpoint's own files, or the built-in Qwen3.6
/// ones for synthetic models (which have the real vocabulary).
pub fn text_model_for(model: &ModelRef) -> Result<TextModel> {
    match model {
        ModelRef::Synthetic(_) => TextModel::embedded(),
        ModelRef::Dir(dir) => TextModel::from_dir(dir),
    }
}
