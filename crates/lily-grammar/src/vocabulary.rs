//! The token bytes llguidance reads, from Lily's tokenizer (its byte pieces, special tokens
//! marked as toktrie expects), so that no second tokenizer library is built.

use std::sync::Arc;

use anyhow::{Result, anyhow};
use lily_chat::TextTokenizer;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// The end of an assistant turn: what a complete grammar allows, and nothing else.
pub const TURN_END: &str = "<|im_end|>";

pub fn token_env(tokenizer: &TextTokenizer) -> Result<TokEnv> {
    let eos = tokenizer
        .special_id(TURN_END)
        .ok_or_else(|| anyhow!("the tokenizer has no {TURN_END} token"))?;
    let words: Vec<Vec<u8>> = (0..tokenizer.decodable_len() as u32)
        .map(|id| match tokenizer.piece(id) {
            Some(bytes) => bytes.to_vec(),
            None => {
                // Special tokens are matched only by name, never as text.
                let mut word = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                word.extend(tokenizer.decode_with_special(&[id]).into_bytes());
                word
            }
        })
        .collect();
    let info = TokRxInfo::new(words.len() as u32, eos);
    Ok(Arc::new(ApproximateTokEnv::new(TokTrie::from(
        &info, &words,
    ))))
}
