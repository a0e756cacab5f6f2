//! Turning logits into a token: greedy, or temperature / top-k / top-p / min-p with a seeded
//! stream so that the same seed gives the same text; penalties (`penalties`) first if any.

use crate::penalties::{Adjustment, LogitAdjuster, Penalties};
use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    /// 1 means no limit.
    pub top_p: f32,
    /// 0 means no limit; otherwise drop tokens below `min_p ·` the top probability.
    pub min_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Ids at or above this are never chosen (padding rows of the vocabulary).
    vocab_limit: Option<usize>,
    /// `None` when no penalty applies, so that nothing is copied or counted.
    adjuster: Option<LogitAdjuster>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler {
            params,
            rng,
            vocab_limit: None,
            adjuster: None,
        }
    }

    /// Applies `penalties` before every choice; `prompt` is what the repetition penalty sees
    /// besides the tokens this sampler chooses.
    pub fn with_penalties(mut self, penalties: Penalties, prompt: &[u32]) -> Self {
        self.adjuster = (!penalties.is_none()).then(|| LogitAdjuster::new(penalties, prompt));
        self
    }

    /// The choice is the argmax of the raw logits, which a device can make without sending
    /// them to the host; false when penalties or sampling need them.
    pub fn is_raw_greedy(&self) -> bool {
        self.params.is_greedy() && self.adjuster.is_none()
    }

    /// Whether penalties (or `logit_bias`) change the logits, from what was chosen before.
    pub fn has_penalties(&self) -> bool {
        self.adjuster.is_some()
    }

    /// Never choose ids at or above `limit` (e.g. lm_head rows that the tokenizer cannot decode).
    pub fn with_vocab_limit(mut self, limit: usize) -> Self {
        self.vocab_limit = Some(limit);
        self
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The id below which tokens may be chosen, when limited.
    pub fn vocab_limit(&self) -> Option<usize> {
        self.vocab_limit
    }

    /// How many of a row of `n` logits a choice ranges over: all, or the first `vocab_limit`
    /// (at least one).
    pub fn choosable(&self, n: usize) -> usize {
        self.vocab_limit.map_or(n, |l| l.clamp(1, n))
    }

    /// Chooses the next token, and counts it for the penalties.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let draw = self.draw();
        self.sample_drawn(logits, draw)
    }

    /// The uniform number in [0, 1) the next choice walks its distribution with; greedy
    /// choices take none (0), so a seed's stream is the same whoever draws it.
    pub fn draw(&mut self) -> f32 {
        if self.params.is_greedy() {
            0.0
        } else {
            self.rng.next_f32()
        }
    }

    /// [`Sampler::sample`] with the draw already made ([`Sampler::draw`]): a device's choice
    /// that the host must finish takes the draw the device was given.
    pub fn sample_drawn(&mut self, logits: &[f32], draw: f32) -> u32 {
        let adjusted = self.adjuster.as_ref().map(|adjuster| {
            let mut adjusted = logits.to_vec();
            adjuster.apply(&mut adjusted);
            adjusted
        });
        let token = self.choose(adjusted.as_deref().unwrap_or(logits), draw);
        self.record(token);
        token
    }

    /// `token` was chosen elsewhere (on a device): counts it for the penalties.
    pub fn record(&mut self, token: u32) {
        if let Some(adjuster) = &mut self.adjuster {
            adjuster.record(token);
        }
    }

    /// What the penalties do to the logits now, an entry per id they touch.
    pub fn adjustments(&self) -> &[Adjustment] {
        self.adjuster
            .as_ref()
            .map_or(&[], |adjuster| adjuster.adjustments())
    }

    /// The rule a device's choice must follow (kernels/pick.cu in lily-cuda walks the same
    /// candidates with the same f32 arithmetic): the best `top_k` by logit (ties by id), their
    /// softmax at the temperature, min-p, then top-p, each in that order, then the draw.
    fn choose(&self, logits: &[f32], draw: f32) -> u32 {
        let n = self.choosable(logits.len());
        let logits = &logits[..n];
        if self.params.is_greedy() {
            return argmax(logits);
        }
        // Candidates sorted by logit, best first; ties broken by id so the order is total.
        let mut ids: Vec<u32> = (0..n as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        if ids.is_empty() {
            return 0;
        }
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let k = if self.params.top_k == 0 {
            ids.len()
        } else {
            self.params.top_k.min(ids.len())
        };
        if k < ids.len() {
            ids.select_nth_unstable_by(k - 1, by_logit);
            ids.truncate(k);
        }
        ids.sort_unstable_by(by_logit);

        let inv_t = 1.0 / self.params.temperature;
        let top = logits[ids[0] as usize];
        let mut probs: Vec<f32> = ids
            .iter()
            .map(|&i| ((logits[i as usize] - top) * inv_t).exp())
            .collect();
        // Sums in f64: 248K terms in f32 would lose the small ones, and a device sums them in
        // another order.
        let total = probs.iter().map(|&p| p as f64).sum::<f64>() as f32;
        probs.iter_mut().for_each(|p| *p /= total);

        let mut keep = probs.len();
        if self.params.min_p > 0.0 {
            let floor = self.params.min_p * probs[0];
            keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        }
        if self.params.top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut n = 0;
            for &p in &probs[..keep] {
                cumulative += p;
                n += 1;
                if cumulative >= self.params.top_p {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass = probs[..keep].iter().map(|&p| p as f64).sum::<f64>() as f32;
        let mut r = draw * mass;
        for (j, &p) in probs[..keep].iter().enumerate() {
            r -= p;
            if r < 0.0 {
                return ids[j];
            }
        }
        // Rounding left a little of the draw: the last kept token that can be chosen at all (a
        // masked one has probability 0).
        let last = probs[..keep].iter().rposition(|&p| p > 0.0).unwrap_or(0);
        ids[last]
    }
}

/// Index of the largest value; the first one on ties.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.0, 3.0, -1.0, 3.0]), 1);
    }

    #[test]
    fn the_choosable_ids_are_the_limit_within_the_row() {
        let s = |limit: Option<usize>| {
            let s = Sampler::new(SamplingParams::greedy());
            limit.map_or(s.clone(), |l| s.with_vocab_limit(l))
        };
        assert_eq!(s(None).choosable(10), 10);
        assert_eq!(s(Some(4)).choosable(10), 4);
        assert_eq!(s(Some(40)).choosable(10), 10);
        assert_eq!(s(Some(0)).choosable(10), 1);
    }

    #[test]
    fn vocab_limit_masks_padding_rows() {
        let mut s = Sampler::new(SamplingParams::greedy()).with_vocab_limit(2);
        assert_eq!(s.sample(&[0.0, 1.0, 9.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, seed));
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_and_top_p_and_min_p_restrict_the_support() {
        let logits = [5.0, 4.0, 3.0, 0.0, -2.0];
        let mut seen = [false; 5];
        let mut s = Sampler::new(params(1.0, 2, 1.0, 0.0, 1));
        (0..500).for_each(|_| seen[s.sample(&logits) as usize] = true);
        assert_eq!(seen, [true, true, false, false, false]);

        // p ≈ [0.66, 0.24, 0.09, ...]: top_p 0.8 keeps the first two.
        let mut seen = [false; 5];
        let mut s = Sampler::new(params(1.0, 0, 0.8, 0.0, 2));
        (0..500).for_each(|_| seen[s.sample(&logits) as usize] = true);
        assert_eq!(seen, [true, true, false, false, false]);

        // min_p 0.2: 0.09 / 0.66 < 0.2 drops the third.
        let mut seen = [false; 5];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.2, 3));
        (0..500).for_each(|_| seen[s.sample(&logits) as usize] = true);
        assert_eq!(seen, [true, true, false, false, false]);
    }

    #[test]
    fn a_strong_presence_penalty_forbids_the_repeat_greedy_would_make() {
        // Greedy picks token 2 every time on these logits.
        let logits = [1.0, 0.5, 3.0, 2.0];
        let mut plain = Sampler::new(SamplingParams::greedy());
        assert_eq!([0; 3].map(|_| plain.sample(&logits)), [2, 2, 2]);
        let presence = Penalties {
            presence: 2.0,
            ..Penalties::default()
        };
        let mut s = Sampler::new(SamplingParams::greedy()).with_penalties(presence, &[]);
        assert!(!s.is_raw_greedy());
        // 2 (3.0), then 3 (2.0 beats 3.0 - 2), then 0 (1.0 beats 2 - 2 and 3 - 2).
        assert_eq!([0; 3].map(|_| s.sample(&logits)), [2, 3, 0]);
    }

    #[test]
    fn repetition_penalty_sees_the_prompt_and_logit_bias_forces_a_token() {
        let logits = [1.0, 0.5, 3.0, 2.0];
        let repetition = Penalties {
            repetition: 2.0,
            ..Penalties::default()
        };
        // Token 2 is in the prompt: 3.0 / 2 loses to 2.0.
        let mut s = Sampler::new(SamplingParams::greedy()).with_penalties(repetition, &[2, 2]);
        assert_eq!(s.sample(&logits), 3);
        let bias = Penalties {
            logit_bias: vec![(1, 100.0)],
            ..Penalties::default()
        };
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 5)).with_penalties(bias, &[]);
        assert!((0..50).all(|_| s.sample(&logits) == 1));
        // No penalty: the device may choose.
        let none = Sampler::new(SamplingParams::greedy()).with_penalties(Penalties::default(), &[]);
        assert!(none.is_raw_greedy());
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with p = 0.75 / 0.25 at temperature 1.
        let logits = [3f32.ln(), 0.0];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 42));
        let ones = (0..20_000).filter(|_| s.sample(&logits) == 1).count();
        assert!((4_500..5_500).contains(&ones), "{ones}");
    }
}
