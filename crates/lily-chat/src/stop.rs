//! Stop strings: generation ends where one appears in the text, and the stop string itself is not
//! returned. Tokens do not align with stop strings, so text that might be the start of one is held
//! back until the next token tells.

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

#[derive(Debug, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is certainly output.
    pub text: String,
    /// A stop string was found; `text` ends right before it.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopStep {
        self.held.push_str(text);
        let first_stop = self.stops.iter().filter_map(|s| self.held.find(s)).min();
        if let Some(at) = first_stop {
            let text = self.held[..at].to_string();
            self.held.clear();
            return StopStep {
                text,
                stopped: true,
            };
        }
        let keep = partial_match_len(&self.held, &self.stops);
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopStep {
            text,
            stopped: false,
        }
    }

    /// Text held back at the end of generation: it turned out not to be a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The length in bytes of the longest suffix of `text` that is a proper prefix of one of
/// `needles`: text that must wait for more before it can be classified.
pub fn partial_match_len<S: AsRef<str>>(text: &str, needles: &[S]) -> usize {
    let mut best = 0;
    for needle in needles {
        let needle = needle.as_ref();
        let longest = needle.len().saturating_sub(1).min(text.len());
        for len in (best + 1..=longest).rev() {
            let start = text.len() - len;
            if text.is_char_boundary(start) && needle.starts_with(&text[start..]) {
                best = len;
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for piece in pieces {
            let step = m.push(piece);
            out.push_str(&step.text);
            if step.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_string_across_token_boundaries_is_cut_with_what_follows() {
        assert_eq!(
            run(&["END"], &["one E", "N", "D two"]),
            ("one ".to_string(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".to_string(), true));
    }

    #[test]
    fn a_false_start_is_released_when_it_stops_matching() {
        let stops = vec!["STOP".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("xST").text, "x");
        assert_eq!(m.push("O").text, "");
        assert_eq!(m.push("P!").text, "");
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("ST").text, "");
        let step = m.push("ART");
        assert_eq!(
            step,
            StopStep {
                text: "START".into(),
                stopped: false
            }
        );
    }

    #[test]
    fn earliest_of_several_stops_wins_and_unfinished_text_is_flushed() {
        assert_eq!(
            run(&["b", "abc"], &["xxab", "c"]),
            ("xxa".to_string(), true)
        );
        assert_eq!(
            run(&["world"], &["hello wor"]),
            ("hello wor".to_string(), false)
        );
    }

    #[test]
    fn partial_matches_respect_char_boundaries() {
        assert_eq!(partial_match_len("caffè", &["è!"]), "è".len());
        assert_eq!(partial_match_len("abc", &["</think>"]), 0);
        assert_eq!(
            partial_match_len("abc</th", &["</think>", "<tool_call>"]),
            4
        );
    }
}
