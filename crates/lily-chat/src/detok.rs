//! Incremental detokenisation: one token at a time in, whole UTF-8 characters out.
//!
//! A byte-level token can end inside a multi-byte character (an emoji is often two or three
//! tokens), so bytes are held until they complete a character. Bytes that can never become valid
//! UTF-8 are emitted as U+FFFD at once, as a full `decode` would, instead of stalling the stream.

use crate::tokenizer::TextTokenizer;

pub struct IncrementalDecoder<'t> {
    tokenizer: &'t TextTokenizer,
    pending: Vec<u8>,
}

impl<'t> IncrementalDecoder<'t> {
    pub fn new(tokenizer: &'t TextTokenizer) -> Self {
        IncrementalDecoder {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// The text that `id` completes (often empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> String {
        if let Some(piece) = self.tokenizer.piece(id) {
            self.pending.extend_from_slice(piece);
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just validated; from_utf8_lossy only avoids an unsafe call.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is still held at the end of generation (an unfinished character), as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
