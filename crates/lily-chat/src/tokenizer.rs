//! The byte-level BPE tokenizer (HF `tokenizer.json`) and the bytes each token id stands for.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use tokenizers::Tokenizer;
use tokenizers::decoders::DecoderWrapper;

/// Qwen3.6's `tokenizer.json`, gzip-compressed (20 MB → 3.8 MB), so that `synthetic:*` models
/// have the real tokenizer from any directory. Provenance: assets/qwen3.6/README.md.
const EMBEDDED_TOKENIZER_GZ: &[u8] = include_bytes!("../../../assets/qwen3.6/tokenizer.json.gz");

pub struct TextTokenizer {
    inner: Tokenizer,
    /// The bytes of each decodable id; `None` for special tokens, which decoding skips as
    /// transformers does with `skip_special_tokens=True`.
    pieces: Vec<Option<Box<[u8]>>>,
    special: HashMap<String, u32>,
}

impl TextTokenizer {
    /// Qwen3.6's tokenizer, built into the binary.
    pub fn embedded() -> Result<Self> {
        let mut json = Vec::with_capacity(20 << 20);
        flate2::read::GzDecoder::new(EMBEDDED_TOKENIZER_GZ)
            .read_to_end(&mut json)
            .context("decompressing the embedded tokenizer.json")?;
        Self::from_json(&json).context("the embedded tokenizer.json")
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
        Ok(TextTokenizer {
            inner,
            pieces,
            special,
        })
    }

    /// Text to ids. Control tokens written in the text (`<|im_start|>`) become their ids, as the
    /// chat template needs; no BOS is added (Qwen has none).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
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
