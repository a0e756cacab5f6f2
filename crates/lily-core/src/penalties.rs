//! What changes the logits before a token is chosen, with vLLM's semantics (which follow
//! OpenAI's for the first three): `logit_bias`, then presence and frequency penalties over the
//! tokens generated so far, then the repetition penalty over the prompt and the generated tokens.

use std::collections::{HashMap, HashSet};

#[derive(Clone, Debug, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token the output already holds.
    pub presence: f32,
    /// Subtracted from a token's logit once per time the output already holds it.
    pub frequency: f32,
    /// CTRL's penalty: a token of the prompt or the output has a positive logit divided by this
    /// and a negative one multiplied by it. 1 means none.
    pub repetition: f32,
    /// Added to the logits of these ids.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl Penalties {
    /// Nothing to apply: the raw logits decide.
    pub fn is_none(&self) -> bool {
        *self == Penalties::default()
    }
}

/// The penalties over one sequence: what the prompt holds and how often each token has been
/// generated.
#[derive(Clone, Debug)]
pub struct LogitAdjuster {
    penalties: Penalties,
    prompt: HashSet<u32>,
    generated: HashMap<u32, u32>,
}

impl LogitAdjuster {
    pub fn new(penalties: Penalties, prompt: &[u32]) -> Self {
        // Only the repetition penalty looks at the prompt.
        let prompt = if penalties.repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        LogitAdjuster {
            penalties,
            prompt,
            generated: HashMap::new(),
        }
    }

    /// `token` was generated.
    pub fn record(&mut self, token: u32) {
        *self.generated.entry(token).or_default() += 1;
    }

    /// Applies every penalty to `logits` (ids past its end are ignored).
    pub fn apply(&self, logits: &mut [f32]) {
        let p = &self.penalties;
        for &(id, bias) in &p.logit_bias {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit += bias;
            }
        }
        for (&id, &count) in &self.generated {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit -= p.presence + p.frequency * count as f32;
            }
        }
        if p.repetition != 1.0 {
            let seen = self
                .prompt
                .iter()
                .chain(self.generated.keys().filter(|id| !self.prompt.contains(id)));
            for &id in seen {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit = if *logit > 0.0 {
                        *logit / p.repetition
                    } else {
                        *logit * p.repetition
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adjusted(penalties: Penalties, prompt: &[u32], generated: &[u32]) -> Vec<f32> {
        let mut adjuster = LogitAdjuster::new(penalties, prompt);
        generated.iter().for_each(|&t| adjuster.record(t));
        let mut logits = vec![2.0, -2.0, 1.0, 0.5];
        adjuster.apply(&mut logits);
        logits
    }

    #[test]
    fn each_penalty_moves_only_the_logits_it_names_by_its_rule() {
        let none = adjusted(Penalties::default(), &[0, 1], &[2, 2]);
        assert_eq!(none, [2.0, -2.0, 1.0, 0.5]);
        // Token 2 generated twice, token 1 once.
        let presence = Penalties {
            presence: 0.5,
            ..Penalties::default()
        };
        assert_eq!(adjusted(presence, &[0], &[2, 1, 2]), [2.0, -2.5, 0.5, 0.5]);
        let frequency = Penalties {
            frequency: 0.25,
            ..Penalties::default()
        };
        assert_eq!(
            adjusted(frequency, &[0], &[2, 1, 2]),
            [2.0, -2.25, 0.5, 0.5]
        );
        // Prompt tokens count for the repetition penalty, once each however often they occur.
        let repetition = Penalties {
            repetition: 2.0,
            ..Penalties::default()
        };
        assert_eq!(
            adjusted(repetition, &[0, 1, 1], &[2, 2]),
            [1.0, -4.0, 0.5, 0.5]
        );
        let bias = Penalties {
            logit_bias: vec![(3, 10.0), (1, -1.0), (99, 5.0)],
            ..Penalties::default()
        };
        assert_eq!(adjusted(bias, &[], &[]), [2.0, -3.0, 1.0, 10.5]);
    }

    #[test]
    fn negative_penalties_favour_repeats_and_bias_comes_first() {
        let p = Penalties {
            presence: -1.0,
            repetition: 2.0,
            logit_bias: vec![(1, 3.0)],
            ..Penalties::default()
        };
        // Token 1: -2 + 3 (bias) + 1 (presence) = 2, then halved as positive.
        assert_eq!(adjusted(p, &[], &[1]), [2.0, 1.0, 1.0, 0.5]);
    }
}
