//! Token ids in, output text out: incremental detokenisation followed by stop strings.

use crate::detok::IncrementalDecoder;
use crate::stop::{StopMatcher, StopStep};
use crate::tokenizer::TextTokenizer;

pub struct TextStream<'t> {
    decoder: IncrementalDecoder<'t>,
    stops: StopMatcher,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t TextTokenizer, stop_strings: &[String]) -> Self {
        TextStream {
            decoder: IncrementalDecoder::new(tokenizer),
            stops: StopMatcher::new(stop_strings),
        }
    }

    /// The text `id` releases, and whether a stop string ended the output.
    pub fn push(&mut self, id: u32) -> StopStep {
        let text = self.decoder.push(id);
        self.stops.push(&text)
    }

    /// The text still held when generation ends for another reason (a stop token, the length).
    pub fn finish(&mut self) -> StopStep {
        let tail = self.decoder.finish();
        let step = self.stops.push(&tail);
        if step.stopped {
            return step;
        }
        StopStep {
            text: step.text + &self.stops.finish(),
            stopped: false,
        }
    }
}
