//! What changes the logits before a token is chosen, with vLLM's semantics (which follow
//! OpenAI's for the first three): `logit_bias`, then presence and frequency penalties over the
//! tokens generated so far, then the repetition penalty over the prompt and the generated tokens.

use std::collections::{BTreeSet, HashMap};

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

/// What the penalties do to one id's logit: `(logit + bias) - penalty`, then the repetition
/// factor unless it is 1. Every adjusted id has one, so a device applies them with one thread an
/// id (the CUDA pick kernels read this layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjustment {
    pub id: u32,
    pub bias: f32,
    pub penalty: f32,
    pub repetition: f32,
}

impl Adjustment {
    fn none(id: u32) -> Self {
        Adjustment {
            id,
            bias: 0.0,
            penalty: 0.0,
            repetition: 1.0,
        }
    }

    pub fn apply(&self, logit: f32) -> f32 {
        let v = (logit + self.bias) - self.penalty;
        if self.repetition == 1.0 {
            v
        } else if v > 0.0 {
            v / self.repetition
        } else {
            v * self.repetition
        }
    }
}

/// The penalties over one sequence, kept as one [`Adjustment`] per id they touch: the bias ids,
/// the prompt's ids when the repetition penalty looks at them, and every id generated so far.
/// Recording a token updates its one entry, so a step costs nothing per id already seen.
#[derive(Clone, Debug)]
pub struct LogitAdjuster {
    penalties: Penalties,
    adjustments: Vec<Adjustment>,
    /// How often each adjustment's id has been generated.
    generated: Vec<u32>,
    /// Where each id's adjustment is.
    index: HashMap<u32, usize>,
}

impl LogitAdjuster {
    pub fn new(penalties: Penalties, prompt: &[u32]) -> Self {
        let mut adjuster = LogitAdjuster {
            penalties,
            adjustments: Vec::new(),
            generated: Vec::new(),
            index: HashMap::new(),
        };
        // An id named twice has its biases summed.
        for i in 0..adjuster.penalties.logit_bias.len() {
            let (id, bias) = adjuster.penalties.logit_bias[i];
            let at = adjuster.slot(id);
            adjuster.adjustments[at].bias += bias;
        }
        // Only the repetition penalty looks at the prompt, each id once however often it occurs.
        let repetition = adjuster.penalties.repetition;
        if repetition != 1.0 {
            for id in prompt.iter().copied().collect::<BTreeSet<u32>>() {
                let at = adjuster.slot(id);
                adjuster.adjustments[at].repetition = repetition;
            }
        }
        adjuster
    }

    fn slot(&mut self, id: u32) -> usize {
        *self.index.entry(id).or_insert_with(|| {
            self.adjustments.push(Adjustment::none(id));
            self.generated.push(0);
            self.adjustments.len() - 1
        })
    }

    /// `token` was generated.
    pub fn record(&mut self, token: u32) {
        let (presence, frequency, repetition) = (
            self.penalties.presence,
            self.penalties.frequency,
            self.penalties.repetition,
        );
        if presence == 0.0 && frequency == 0.0 && repetition == 1.0 {
            return;
        }
        let at = self.slot(token);
        self.generated[at] += 1;
        let a = &mut self.adjustments[at];
        a.penalty = presence + frequency * self.generated[at] as f32;
        a.repetition = repetition;
    }

    /// One entry per adjusted id, no id twice.
    pub fn adjustments(&self) -> &[Adjustment] {
        &self.adjustments
    }

    /// Applies every penalty to `logits` (ids past its end are ignored).
    pub fn apply(&self, logits: &mut [f32]) {
        for a in &self.adjustments {
            if let Some(logit) = logits.get_mut(a.id as usize) {
                *logit = a.apply(*logit);
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

    #[test]
    fn an_id_biased_twice_gets_both_biases_and_each_id_one_entry() {
        let p = Penalties {
            presence: 0.5,
            repetition: 2.0,
            logit_bias: vec![(1, 3.0), (1, 1.5)],
            ..Penalties::default()
        };
        let mut adjuster = LogitAdjuster::new(p, &[1, 1, 2]);
        adjuster.record(1);
        adjuster.record(1);
        let ids: Vec<u32> = adjuster.adjustments().iter().map(|a| a.id).collect();
        assert_eq!(ids, [1, 2]);
        // Token 1: -2 + 4.5 (both biases) - 0.5 (presence) = 2, halved as positive.
        assert_eq!(adjusted_by(&adjuster), [2.0, 1.0, 0.5, 0.5]);
    }

    fn adjusted_by(adjuster: &LogitAdjuster) -> Vec<f32> {
        let mut logits = vec![2.0, -2.0, 1.0, 0.5];
        adjuster.apply(&mut logits);
        logits
    }
}
