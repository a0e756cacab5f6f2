//! The byte-level BPE tokenizer (HF `tokenizer.json`) and the bytes each token id stands for.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use tokenizers::Tokenizer;
use tokenizers::decoders::DecoderWrapper;

use crate::cuts::{cut_points, cuts_keep_tokens};
use crate::recent::RecentTexts;

/// Qwen3.6's `tokenizer.json`, gzip-compressed (20 MB → 3.8 MB), so that `synthetic:*` models
/// have the real tokenizer from any directory. Provenance: assets/qwen3.6/README.md.
const EMBEDDED_TOKENIZER_GZ: &[u8] = include_bytes!("../../../assets/qwen3.6/tokenizer.json.gz");

pub struct TextTokenizer {
    inner: Tokenizer,
    /// The bytes of each decodable id; `None` for special tokens, which decoding skips as
    /// transformers does with `skip_special_tokens=True`.
    pieces: Vec<Option<Box<[u8]>>>,
    special: HashMap<String, u32>,
    /// Whether a long text may be cut and its pieces tokenised on threads of their own
    /// (`cuts`: exact for Qwen's pipeline only).
    cuttable: bool,
    /// The last long texts' ids, for a text that extends one before a control token (a chat's
    /// next turn); `None` where that is not exact for this tokenizer (`recent`).
    recent: Option<RecentTexts>,
}

impl TextTokenizer {
    /// Qwen3.6's tokenizer, built into the binary.
    pub fn embedded() -> Result<Self> {
        Self::from_json(&embedded_json()?).context("the embedded tokenizer.json")
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let json = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json(&json).with_context(|| format!("loading {}", path.display()))
    }

    pub fn from_json(json: &[u8]) -> Result<Self> {
        let inner = Tokenizer::from_bytes(json).map_err(|e| anyhow!("{e}"))?;
        // Incremental decoding works on raw bytes, which is exact only for a byte-level decoder
        // (Qwen's); anything else would need the tokenizer's own decoder chain.
        if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            bail!("only byte-level BPE tokenizers are supported (Qwen's decoder is ByteLevel)");
        }
        let unicode_to_byte = byte_level_alphabet();
        let added = inner.get_added_tokens_decoder();
        let len = inner.get_vocab_size(true);
        let mut pieces = Vec::with_capacity(len);
        let mut special = HashMap::new();
        for id in 0..len as u32 {
            let piece = if let Some(token) = added.get(&id) {
                if token.special {
                    special.insert(token.content.clone(), id);
                    None
                } else {
                    Some(token.content.as_bytes().into())
                }
            } else {
                let token = inner
                    .id_to_token(id)
                    .ok_or_else(|| anyhow!("token id {id} has no entry in the vocabulary"))?;
                let bytes = token
                    .chars()
                    .map(|c| unicode_to_byte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .ok_or_else(|| anyhow!("token {id} ({token:?}) is not byte-level encoded"))?;
                Some(bytes.into())
            };
            pieces.push(piece);
        }
        let cuttable = cuts_keep_tokens(&inner);
        let recent = if cuttable {
            RecentTexts::for_tokenizer(&inner)
        } else {
            None
        };
        Ok(TextTokenizer {
            inner,
            pieces,
            special,
            cuttable,
            recent,
        })
    }

    /// Text to ids. Control tokens written in the text (`<|im_start|>`) become their ids, as the
    /// chat template needs; no BOS is added (Qwen has none).
    ///
    /// A text that extends one of the last long texts tokenised, a control token right after it
    /// (a chat's next turn), starts from that one's ids (`recent`). A long text is cut where its
    /// pieces tokenise to the same ids ([`cut_points`]) and the pieces go on threads of their own
    /// (up to 8).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let Some(recent) = &self.recent else {
            return self.encode_fresh(text);
        };
        let ids = match recent.longest_prefix(text) {
            Some((len, mut ids)) => {
                ids.extend(self.encode_fresh(&text[len..])?);
                ids
            }
            None => self.encode_fresh(text)?,
        };
        recent.keep(text, &ids);
        Ok(ids)
    }

    /// [`TextTokenizer::encode`] without the kept texts.
    fn encode_fresh(&self, text: &str) -> Result<Vec<u32>> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        let cuts = if self.cuttable {
            cut_points(text, threads)
        } else {
            Vec::new()
        };
        let Some(&first) = cuts.first() else {
            return self.encode_whole(text);
        };
        let ends: Vec<usize> = cuts.iter().skip(1).copied().chain([text.len()]).collect();
        std::thread::scope(|scope| {
            let rest: Vec<_> = cuts
                .iter()
                .zip(&ends)
                .map(|(&from, &to)| scope.spawn(move || self.encode_whole(&text[from..to])))
                .collect();
            let mut ids = self.encode_whole(&text[..first])?;
            for piece in rest {
                let piece = piece
                    .join()
                    .map_err(|_| anyhow!("a tokenizing thread panicked"))?;
                ids.extend(piece?);
            }
            Ok(ids)
        })
    }

    /// Text to ids on this thread.
    fn encode_whole(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text to ids with the tokenizer's own special-token rules (its post-processor), as
    /// `/tokenize` offers with `add_special`; Qwen's adds nothing, other tokenizers may.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, true)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids to text with special tokens written out (`<|im_end|>`), as `/detokenize` answers
    /// so that a round trip keeps them; invalid UTF-8 becomes U+FFFD.
    pub fn decode_with_special(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            match self.piece(id) {
                Some(piece) => bytes.extend_from_slice(piece),
                None => {
                    if let Some(token) = self.inner.id_to_token(id) {
                        bytes.extend_from_slice(token.as_bytes());
                    }
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Ids to text, skipping special tokens; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.piece(id).unwrap_or_default());
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes of `id`, or `None` for special and unknown ids.
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize)?.as_deref()
    }

    /// Ids at or above this never decode (e.g. the padding rows of the lm_head): mask them.
    pub fn decodable_len(&self) -> usize {
        self.pieces.len()
    }

    /// The id of a special token such as `<|im_end|>`.
    pub fn special_id(&self, content: &str) -> Option<u32> {
        self.special.get(content).copied()
    }

    /// The id of any single-token string, special or not (e.g. `</think>`).
    pub fn token_id(&self, content: &str) -> Option<u32> {
        self.inner.token_to_id(content)
    }
}

/// GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte.
/// The embedded `tokenizer.json`, decompressed.
pub(crate) fn embedded_json() -> Result<Vec<u8>> {
    let mut json = Vec::with_capacity(20 << 20);
    flate2::read::GzDecoder::new(EMBEDDED_TOKENIZER_GZ)
        .read_to_end(&mut json)
        .context("decompressing the embedded tokenizer.json")?;
    Ok(json)
}

fn byte_level_alphabet() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        map.insert(c, b);
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Texts of every kind of piece the split pattern tells apart, cut and tokenised on threads,
    /// give the ids of the whole text tokenised at once.
    #[test]
    fn a_long_text_cut_into_pieces_tokenises_as_the_whole() {
        let tokenizer = TextTokenizer::embedded().unwrap();
        assert!(tokenizer.cuttable);
        let fragments = [
            "word",
            "Word",
            " the",
            " The",
            "it's",
            "They'LL",
            "'s",
            "dog.",
            " ",
            "  ",
            "\t",
            "\n",
            "\r\n",
            " \n ",
            "42",
            " 7",
            "3.14",
            ",",
            "!?",
            "«quote»",
            "café",
            "cafe\u{301}",
            "e\u{301}",
            "日本語",
            " 日本",
            "🙂",
            "Ωmega",
            "x²",
            "<|im_start|>",
            "<|im_end|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "{\"a\": 1}",
            "--",
            "__init__",
            "ÄÖÜ",
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut cut_texts = 0;
        for case in 0..40 {
            let target = 2_000 + (next() % 40_000) as usize;
            let mut text = String::new();
            while text.len() < target {
                // Mostly ASCII words between spaces, where cuts fall, with the rest mixed in.
                match next() % 3 {
                    0 => text.push_str(fragments[(next() % fragments.len() as u64) as usize]),
                    _ => text
                        .push_str([" alpha", " Beta", "gamma ", " delta9"][(next() % 4) as usize]),
                }
            }
            let cuts = cut_points(&text, 8);
            cut_texts += usize::from(!cuts.is_empty());
            let whole = tokenizer.encode_whole(&text).unwrap();
            assert_eq!(
                tokenizer.encode(&text).unwrap(),
                whole,
                "case {case}, cuts {cuts:?}"
            );
            // Each cut alone, too, whatever the thread count.
            for &at in &cuts {
                let mut ids = tokenizer.encode_whole(&text[..at]).unwrap();
                ids.extend(tokenizer.encode_whole(&text[at..]).unwrap());
                assert_eq!(ids, whole, "case {case}, cut at {at}");
            }
        }
        assert!(cut_texts >= 30, "only {cut_texts} of 40 texts were cut");
    }

    /// A conversation growing turn by turn, each turn's text starting from the last one's ids,
    /// gives the ids of the whole text tokenised at once; so does a text that extends a kept one
    /// without a control token next (not reused), and one that a later kept text also begins.
    #[test]
    fn a_text_extending_a_kept_one_tokenises_as_the_whole() {
        let tokenizer = TextTokenizer::embedded().unwrap();
        assert!(tokenizer.recent.is_some());
        let whole = |t: &str| tokenizer.encode_fresh(t).unwrap();
        let reply = "The answer, it's 42 — «café» and 日本語 too.\n\n".repeat(60);
        let mut text = String::new();
        for turn in 0..6 {
            text.push_str("<|im_start|>user\nWhat is it, again? Tell me ");
            text.push_str(&"word ".repeat(200 + 37 * turn));
            text.push_str("<|im_end|>\n<|im_start|>assistant\n<think>\n");
            text.push_str(&reply[..reply.len() / (turn + 1)].replace('—', "-"));
            text.push_str("</think>\n\nDone.<|im_end|>\n");
            let reused = tokenizer
                .recent
                .as_ref()
                .unwrap()
                .longest_prefix(&text)
                .is_some();
            assert_eq!(reused, turn > 0, "turn {turn}");
            assert_eq!(
                tokenizer.encode(&text).unwrap(),
                whole(&text),
                "turn {turn}"
            );
        }
        // The kept text's last word continued: no control token at the cut, so no reuse.
        let mut longer = text.clone();
        longer.push_str("more");
        let kept = text.trim_end_matches('\n');
        assert_eq!(tokenizer.encode(kept).unwrap(), whole(kept));
        let joined = format!("{kept}ed on");
        assert_eq!(tokenizer.encode(&joined).unwrap(), whole(&joined));
        assert_eq!(tokenizer.encode(&longer).unwrap(), whole(&longer));
        // A control token right after the kept text, then more: reused.
        let next = format!("{text}<|im_start|>user\nAnd then?<|im_end|>\n");
        let recent = tokenizer.recent.as_ref().unwrap();
        assert_eq!(
            recent.longest_prefix(&next).map(|(len, _)| len),
            Some(text.len())
        );
        assert_eq!(tokenizer.encode(&next).unwrap(), whole(&next));
    }

    /// An added token that could match across the end of a kept text turns the reuse off.
    #[test]
    fn a_vocabulary_with_a_token_across_a_control_tokens_start_keeps_no_texts() {
        let json = embedded_json().unwrap();
        let mut qwen: serde_json::Value = serde_json::from_slice(&json).unwrap();
        let added = qwen["added_tokens"].as_array_mut().unwrap();
        let mut straddling = added[0].clone();
        straddling["id"] = 248_400.into();
        straddling["content"] = "\n<|im".into();
        straddling["special"] = false.into();
        added.push(straddling);
        let edited = TextTokenizer::from_json(&serde_json::to_vec(&qwen).unwrap()).unwrap();
        assert!(edited.recent.is_none());
        assert!(TextTokenizer::embedded().unwrap().recent.is_some());
    }
}
