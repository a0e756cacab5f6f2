//! The ids of the last long texts tokenised, reused where a new text extends one of them. A
//! chat's next turn renders the whole conversation again, and tokenising it again sits ahead of
//! the first token even when the prefill comes from a snapshot (32K tokens: 46-110 ms on the
//! two-core development machine, `examples/tokenize_speed.rs`).
//!
//! A kept text's ids stand for the same bytes at the start of a longer text when the rest begins
//! with a control token (`<|im_start|>`, as every turn of a ChatML conversation does): the
//! tokenizer splits added tokens out before anything else, so in both texts the kept one's last
//! segment ends there, and each segment is normalised, pre-tokenised and encoded on its own. NFC
//! cannot compose across the cut, since every control token taken here starts with an ASCII
//! character. What could still differ is an added token matched across the cut in the longer
//! text: one whose content, from a character past its first, begins a control token or is begun
//! by one. [`RecentTexts::for_tokenizer`] refuses a vocabulary that has one (Qwen's has none),
//! and is only asked for one that strips no whitespace around its added tokens
//! (`cuts_keep_tokens`).

use std::collections::VecDeque;
use std::sync::Mutex;

use tokenizers::Tokenizer;

/// Texts kept: a few conversations going on at once.
const KEPT: usize = 8;
/// Shortest text kept (~1K tokens): below it, tokenising again costs about what the lookup does.
const MIN_BYTES: usize = 4096;

pub(crate) struct RecentTexts {
    entries: Mutex<VecDeque<Kept>>,
    /// The contents of the control tokens a reused text may be followed by.
    starters: Vec<String>,
}

struct Kept {
    text: String,
    ids: Vec<u32>,
}

impl RecentTexts {
    /// Reuse for `tokenizer`'s texts, or `None` where an added token could match across the end
    /// of a kept text (above).
    pub(crate) fn for_tokenizer(tokenizer: &Tokenizer) -> Option<Self> {
        let added: Vec<_> = tokenizer.get_added_tokens_decoder().into_values().collect();
        let starters: Vec<String> = added
            .iter()
            .filter(|t| t.special && t.content.starts_with(|c: char| c.is_ascii()))
            .map(|t| t.content.clone())
            .collect();
        let straddles = added.iter().any(|t| {
            t.content.char_indices().skip(1).any(|(i, _)| {
                let tail = &t.content[i..];
                starters
                    .iter()
                    .any(|s| tail.starts_with(s.as_str()) || s.starts_with(tail))
            })
        });
        (!straddles && !starters.is_empty()).then(|| RecentTexts {
            entries: Mutex::new(VecDeque::with_capacity(KEPT)),
            starters,
        })
    }

    /// The longest kept text that `text` extends with a control token right after it: its length
    /// in bytes and its ids.
    pub(crate) fn longest_prefix(&self, text: &str) -> Option<(usize, Vec<u32>)> {
        let entries = self.entries.lock().ok()?;
        entries
            .iter()
            .filter(|k| {
                text.len() > k.text.len()
                    && text.starts_with(k.text.as_str())
                    && self
                        .starters
                        .iter()
                        .any(|s| text[k.text.len()..].starts_with(s.as_str()))
            })
            .max_by_key(|k| k.text.len())
            .map(|k| (k.text.len(), k.ids.clone()))
    }

    /// Keeps `text` and its ids (if it is long enough), the oldest kept text leaving.
    pub(crate) fn keep(&self, text: &str, ids: &[u32]) {
        if text.len() < MIN_BYTES {
            return;
        }
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        if entries.iter().any(|k| k.text == text) {
            return;
        }
        if entries.len() == KEPT {
            entries.pop_back();
        }
        entries.push_front(Kept {
            text: text.to_string(),
            ids: ids.to_vec(),
        });
    }
}
