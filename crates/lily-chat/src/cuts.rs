//! Where a long text can be cut so that its pieces, tokenised apart (on threads of their own),
//! give exactly the ids of the whole. Tokenising sits ahead of the first token: on the 2-core
//! development machine (`examples/tokenize_speed.rs`, four runs) 32K tokens took 70-110 ms on one
//! thread and 46-61 ms cut over both cores; at 1K tokens (1.4-2.4 ms) the two were within the
//! machine's noise.
//!
//! A cut is safe for one tokenizer pipeline only, Qwen's: NFC, then the pre-tokenizer's regex
//! split, then byte-level BPE within each piece of that split ([`cuts_keep_tokens`] checks a
//! `tokenizer.json` is exactly that). A cut goes before a space that follows an ASCII letter or
//! digit and precedes an ASCII letter (`…word| Word…`). There the whole text's split has a
//! boundary: the letters (or the single digit) before it cannot take the space, and the space
//! with the letters after it is the pattern's second alternative, which the first (English
//! contractions, which start with an apostrophe) cannot take. Each side's split is then the
//! whole's: nothing in the pattern looks behind, and the only look-ahead follows whitespace,
//! which is not where the left piece ends. NFC cannot compose across an ASCII space, and no added
//! token holds a space or strips one next to it.

use serde_json::{Value, json};
use tokenizers::Tokenizer;
use tokenizers::models::ModelWrapper;

/// Qwen's pre-tokenizer split pattern (`tokenizer.json`).
const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Fewest bytes a piece holds (~250 tokens of English): spawning a thread for less costs more
/// than it saves.
const MIN_PIECE_BYTES: usize = 1024;

/// Whether the cuts of [`cut_points`] keep a tokenizer's ids: it is Qwen's pipeline, NFC (or no
/// normaliser), its split pattern then the byte-level step without a prefix space, BPE without
/// dropout, and added tokens that strip no whitespace.
pub fn cuts_keep_tokens(tokenizer: &Tokenizer) -> bool {
    let as_json = |part: Option<Value>| part.unwrap_or(Value::Null);
    let normalizer = as_json(
        tokenizer
            .get_normalizer()
            .and_then(|n| serde_json::to_value(n).ok()),
    );
    let pre_tokenizer = as_json(
        tokenizer
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_value(p).ok()),
    );
    let qwen_pre_tokenizer = json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]
    });
    let bpe = matches!(tokenizer.get_model(), ModelWrapper::BPE(b) if b.dropout.is_none());
    let plain_added = tokenizer
        .get_added_tokens_decoder()
        .values()
        .all(|t| !t.lstrip && !t.rstrip && !t.single_word);
    (normalizer.is_null() || normalizer == json!({"type": "NFC"}))
        && pre_tokenizer == qwen_pre_tokenizer
        && bpe
        && plain_added
}

/// Up to `pieces − 1` byte offsets, ascending, that cut `text` into pieces of at least
/// [`MIN_PIECE_BYTES`], each where the module's rule allows; fewer where the text is short or
/// has no such places. Every offset is an ASCII byte, so a char boundary.
pub fn cut_points(text: &str, pieces: usize) -> Vec<usize> {
    let bytes = text.as_bytes();
    let pieces = pieces.min(bytes.len() / MIN_PIECE_BYTES).max(1);
    let mut cuts = Vec::with_capacity(pieces - 1);
    let mut from = 0;
    for k in 1..pieces {
        let target = (bytes.len() * k / pieces).max(from + MIN_PIECE_BYTES);
        let Some(at) = (target..bytes.len().saturating_sub(MIN_PIECE_BYTES)).find(|&i| {
            bytes[i] == b' '
                && bytes[i - 1].is_ascii_alphanumeric()
                && bytes[i + 1].is_ascii_alphabetic()
        }) else {
            break;
        };
        cuts.push(at);
        from = at;
    }
    cuts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_before_a_space_between_ascii_words_and_leave_long_pieces() {
        let text = "word ".repeat(2000);
        let cuts = cut_points(&text, 4);
        assert_eq!(cuts.len(), 3);
        let mut from = 0;
        for &at in &cuts {
            assert!(at - from >= MIN_PIECE_BYTES, "{cuts:?}");
            assert_eq!(&text[at - 1..at + 2], "d w");
            from = at;
        }
        assert!(text.len() - from >= MIN_PIECE_BYTES);
        // Too short to cut, one piece asked for, or nowhere to cut.
        assert!(cut_points(&"word ".repeat(300), 4).is_empty());
        assert!(cut_points(&text, 1).is_empty());
        let nowhere = ["word, ", "1 2 ", "é é ", "word\n", "word  "].map(|s| s.repeat(1000));
        for t in nowhere {
            assert!(cut_points(&t, 4).is_empty(), "{:?}", &t[..12]);
        }
    }

    #[test]
    fn only_qwens_pipeline_is_cut() {
        let json = crate::tokenizer::embedded_json().expect("the embedded tokenizer");
        let qwen: Value = serde_json::from_slice(&json).expect("JSON");
        let keeps = |t: &Value| {
            let bytes = serde_json::to_vec(t).expect("JSON");
            cuts_keep_tokens(&Tokenizer::from_bytes(bytes).expect("a tokenizer"))
        };
        assert!(keeps(&qwen));
        let changed = |edit: &dyn Fn(&mut Value)| {
            let mut t = qwen.clone();
            edit(&mut t);
            keeps(&t)
        };
        let pre = |i: usize| format!("/pre_tokenizer/pretokenizers/{i}");
        assert!(!changed(&|t| t["normalizer"] = json!({"type": "NFKC"})));
        assert!(!changed(&|t| {
            *t.pointer_mut(&format!("{}/add_prefix_space", pre(1)))
                .unwrap() = true.into()
        }));
        assert!(!changed(&|t| {
            *t.pointer_mut(&format!("{}/pattern/Regex", pre(0))).unwrap() = r"\s+".into()
        }));
        assert!(!changed(&|t| t["model"]["dropout"] = 0.1.into()));
        assert!(!changed(&|t| t["added_tokens"][0]["rstrip"] = true.into()));
        assert!(changed(&|t| t["normalizer"] = Value::Null));
    }
}
