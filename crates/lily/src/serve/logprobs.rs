//! Log-probabilities as the OpenAI APIs write them: chat's `{"content": [{token, logprob,
//! bytes, top_logprobs}]}` and completions' parallel lists (`tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`).

use std::sync::Arc;

use lily_chat::TextModel;
use lily_core::logprobs::TokenLogprobs;
use serde_json::{Map, Value, json};

#[derive(Clone)]
pub struct LogprobFormat {
    text: Arc<TextModel>,
    /// vLLM's `return_tokens_as_token_ids`: `token_id:N` instead of text, which a byte-level
    /// token that splits a character cannot give back exactly.
    as_ids: bool,
}

impl LogprobFormat {
    pub fn new(text: Arc<TextModel>, as_ids: bool) -> Self {
        LogprobFormat { text, as_ids }
    }

    /// The bytes of `id`: special tokens as their written form.
    fn bytes(&self, id: u32) -> Vec<u8> {
        let tokenizer = &self.text.tokenizer;
        match tokenizer.piece(id) {
            Some(piece) => piece.to_vec(),
            None => tokenizer.decode_with_special(&[id]).into_bytes(),
        }
    }

    fn token(&self, id: u32) -> String {
        if self.as_ids {
            format!("token_id:{id}")
        } else {
            String::from_utf8_lossy(&self.bytes(id)).into_owned()
        }
    }

    fn chat_entry(&self, id: u32, logprob: f32) -> Map<String, Value> {
        let mut entry = Map::new();
        entry.insert("token".into(), self.token(id).into());
        entry.insert("logprob".into(), logprob.into());
        entry.insert("bytes".into(), self.bytes(id).into());
        entry
    }

    /// Chat's `logprobs.content` entries.
    pub fn chat(&self, logprobs: &[TokenLogprobs]) -> Vec<Value> {
        logprobs
            .iter()
            .map(|lp| {
                let mut entry = self.chat_entry(lp.token, lp.logprob);
                let top: Vec<Value> = lp
                    .top
                    .iter()
                    .map(|&(id, logprob)| Value::Object(self.chat_entry(id, logprob)))
                    .collect();
                entry.insert("top_logprobs".into(), top.into());
                Value::Object(entry)
            })
            .collect()
    }

    /// Completions' `logprobs` object for `tokens`, whose text starts at character `offset` of
    /// the choice's text. `logprobs[i]` belongs to `tokens[i]`; `None` (the first prompt token,
    /// which nothing predicts) is written as null.
    pub fn completion(
        &self,
        tokens: &[u32],
        logprobs: &[Option<&TokenLogprobs>],
        mut offset: usize,
    ) -> Value {
        let mut texts = Vec::with_capacity(tokens.len());
        let mut offsets = Vec::with_capacity(tokens.len());
        for &id in tokens {
            let token = self.token(id);
            offsets.push(offset);
            offset += String::from_utf8_lossy(&self.bytes(id)).chars().count();
            texts.push(token);
        }
        let token_logprobs: Vec<Value> = logprobs
            .iter()
            .map(|lp| lp.map_or(Value::Null, |lp| lp.logprob.into()))
            .collect();
        let top: Vec<Value> = logprobs
            .iter()
            .map(|lp| match lp {
                None => Value::Null,
                Some(lp) => Value::Object(
                    lp.top
                        .iter()
                        .map(|&(id, logprob)| (self.token(id), logprob.into()))
                        .collect(),
                ),
            })
            .collect();
        json!({"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": top,
               "text_offset": offsets})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_tokens_by_text_bytes_or_id() {
        let text = Arc::new(TextModel::embedded().unwrap());
        let lp = TokenLogprobs {
            token: 1204,
            logprob: -0.5,
            top: vec![(1204, -0.5), (248046, -1.5)],
        };
        let chat = LogprobFormat::new(text.clone(), false).chat(std::slice::from_ref(&lp));
        assert_eq!(
            chat,
            [
                json!({"token": " how", "logprob": -0.5, "bytes": [32, 104, 111, 119],
                    "top_logprobs": [
                        {"token": " how", "logprob": -0.5, "bytes": [32, 104, 111, 119]},
                        {"token": "<|im_end|>", "logprob": -1.5, "bytes": b"<|im_end|>".to_vec()}]})
            ]
        );
        let ids = LogprobFormat::new(text, true);
        assert_eq!(
            ids.chat(std::slice::from_ref(&lp))[0]["token"],
            "token_id:1204"
        );
        // "Hello" then " how": the second starts 5 characters after the first.
        let completion = ids.completion(&[9419, 1204], &[None, Some(&lp)], 3);
        assert_eq!(
            completion,
            json!({"tokens": ["token_id:9419", "token_id:1204"], "token_logprobs": [null, -0.5],
                   "top_logprobs": [null, {"token_id:1204": -0.5, "token_id:248046": -1.5}],
                   "text_offset": [3, 8]})
        );
    }
}
