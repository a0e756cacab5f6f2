//! Chat messages to prompt tokens through the chat template.

use anyhow::Result;
use lily_chat::TextModel;
use serde_json::{Map, Value};

/// Where every generation prompt of a ChatML template begins.
const TURN_START: &str = "<|im_start|>";

#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    pub tokens: Vec<u32>,
    /// The tokens of the conversation so far, before the generation prompt: where the next turn
    /// of this conversation will branch off.
    pub turn_boundary: Option<usize>,
    /// The prompt opened `<think>`: the output starts as reasoning.
    pub thinking: bool,
}

/// Renders and tokenises a conversation. Template errors (`raise_exception`) are returned as
/// they are: they describe what is wrong with the messages.
pub fn chat_prompt(
    text: &TextModel,
    messages: &[Value],
    tools: &[Value],
    kwargs: &Map<String, Value>,
) -> Result<ChatPrompt> {
    let mut context = kwargs.clone();
    context.insert("messages".into(), messages.to_vec().into());
    if !tools.is_empty() {
        context.insert("tools".into(), tools.to_vec().into());
    }
    context.insert("add_generation_prompt".into(), true.into());
    let full = text.template.render(&Value::Object(context.clone()))?;
    context.insert("add_generation_prompt".into(), false.into());
    let history = text.template.render(&Value::Object(context))?;
    let thinking = full.trim_end().ends_with("<think>");
    // A control token always starts a new token, so the two parts tokenise independently.
    if let Some(generation_prompt) = full.strip_prefix(history.as_str())
        && generation_prompt.starts_with(TURN_START)
        && !history.is_empty()
    {
        let mut tokens = text.tokenizer.encode(&history)?;
        let boundary = tokens.len();
        tokens.extend(text.tokenizer.encode(generation_prompt)?);
        return Ok(ChatPrompt {
            tokens,
            turn_boundary: Some(boundary),
            thinking,
        });
    }
    Ok(ChatPrompt {
        tokens: text.tokenizer.encode(&full)?,
        turn_boundary: None,
        thinking,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_boundary_splits_history_from_the_generation_prompt() {
        let text = TextModel::embedded().unwrap();
        let messages = [json!({"role": "user", "content": "Hello, how are you?"})];
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), false.into());
        let prompt = chat_prompt(&text, &messages, &[], &kwargs).unwrap();
        // The oracle's ids for this exact prompt (tokenizer_oracle.json).
        let expected = [
            248045, 846, 198, 9419, 11, 1204, 513, 488, 30, 248046, 198, 248045, 74455, 198,
            248068, 271, 248069, 271,
        ];
        assert_eq!(prompt.tokens, expected);
        assert_eq!(prompt.turn_boundary, Some(11));
        assert!(!prompt.thinking);
        kwargs.insert("enable_thinking".into(), true.into());
        let prompt = chat_prompt(&text, &messages, &[], &kwargs).unwrap();
        assert!(prompt.thinking);
        assert_eq!(&prompt.tokens[11..], &[248045, 74455, 198, 248068, 198]);
    }
}
