//! One step's choice of the next token, as a backend is asked for it: the sampler (parameters,
//! penalties, its seeded stream), the tokens a constraint allows, and how many
//! log-probabilities to report. Everything is in the request, so a device backend can make the
//! whole choice where the logits are and send back only the token and its top entries
//! (lily-cuda's `pick`); [`Choice::pick`] is the host's rule, which every device must equal.

use crate::logprobs::{TokenLogprobs, token_logprobs};
use crate::sampling::Sampler;

/// The most alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The tokens a constraint allows next.
#[derive(Clone, Copy, Debug)]
pub enum Allowed<'a> {
    /// Every token but these (while the reasoning is open: no end of turn yet).
    Except(&'a [u32]),
    /// Token `i` is allowed when bit `i % 32` of word `i / 32` is set; ids past the words (the
    /// model's padding rows) are not.
    Bits(&'a [u32]),
}

impl Allowed<'_> {
    pub fn allows(&self, id: u32) -> bool {
        match self {
            Allowed::Except(ids) => !ids.contains(&id),
            Allowed::Bits(words) => words
                .get(id as usize / 32)
                .is_some_and(|w| w & (1 << (id % 32)) != 0),
        }
    }

    /// The bit mask of the first `n` ids.
    pub fn to_bits(&self, n: usize) -> Vec<u32> {
        let mut words = vec![0u32; n.div_ceil(32)];
        match self {
            Allowed::Bits(bits) => {
                let k = bits.len().min(words.len());
                words[..k].copy_from_slice(&bits[..k]);
            }
            Allowed::Except(ids) => {
                words.iter_mut().for_each(|w| *w = u32::MAX);
                for &id in ids.iter().filter(|&&id| (id as usize) < n) {
                    words[id as usize / 32] &= !(1 << (id % 32));
                }
            }
        }
        // Bits past `n` in the last word stay clear.
        if !n.is_multiple_of(32)
            && let Some(last) = words.last_mut()
        {
            *last &= (1u32 << (n % 32)) - 1;
        }
        words
    }

    /// Sets the logit of every token not allowed to -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        match self {
            Allowed::Except(ids) => {
                for &id in *ids {
                    if let Some(logit) = logits.get_mut(id as usize) {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
            Allowed::Bits(words) => {
                for (i, chunk) in logits.chunks_mut(32).enumerate() {
                    let word = words.get(i).copied().unwrap_or(0);
                    if word == u32::MAX {
                        continue;
                    }
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
    }
}

/// Everything one step's choice needs.
pub struct Choice<'a> {
    pub sampler: &'a mut Sampler,
    /// `None`: every token may come next.
    pub allowed: Option<Allowed<'a>>,
    /// `Some(k)`: report the chosen token's log-probability and the `k` most likely.
    pub logprobs: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

impl<'a> Choice<'a> {
    /// A plain choice: the sampler alone.
    pub fn of(sampler: &'a mut Sampler) -> Self {
        Choice {
            sampler,
            allowed: None,
            logprobs: None,
        }
    }

    /// The same choice, borrowed for a shorter while (to hand a row on to another backend).
    pub fn reborrow(&mut self) -> Choice<'_> {
        Choice {
            sampler: &mut *self.sampler,
            allowed: self.allowed,
            logprobs: self.logprobs,
        }
    }

    /// The argmax of the raw logits, nothing reported: what a device can choose with no more
    /// than a maximum over the row.
    pub fn is_raw_greedy(&self) -> bool {
        self.sampler.is_raw_greedy() && self.allowed.is_none() && self.logprobs.is_none()
    }

    /// The next step's choice will be made as this one is, whatever this one picks: no mask,
    /// no penalties counting what is picked. What a backend needs to queue that step before
    /// the host has seen this one's pick.
    pub fn is_memoryless(&self) -> bool {
        self.allowed.is_none() && !self.sampler.has_penalties()
    }

    /// The top log-probabilities asked for, at most [`MAX_TOP_LOGPROBS`].
    pub fn top_logprobs(&self) -> Option<usize> {
        self.logprobs.map(|k| k.min(MAX_TOP_LOGPROBS))
    }

    /// The choice from a row of logits on the host.
    pub fn pick(&mut self, logits: &[f32]) -> Pick {
        let draw = self.sampler.draw();
        self.pick_drawn(logits, draw)
    }

    /// [`Choice::pick`] with the sampler's draw already made. Log-probabilities are the
    /// model's own, before the mask and the penalties.
    pub fn pick_drawn(&mut self, logits: &[f32], draw: f32) -> Pick {
        let token = match &self.allowed {
            None => self.sampler.sample_drawn(logits, draw),
            Some(allowed) => {
                let mut masked = logits.to_vec();
                allowed.apply(&mut masked);
                self.sampler.sample_drawn(&masked, draw)
            }
        };
        let choosable = self.sampler.choosable(logits.len());
        Pick {
            token,
            logprobs: self
                .top_logprobs()
                .map(|k| token_logprobs(logits, token, k, choosable)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    #[test]
    fn both_kinds_of_mask_give_the_same_bits_and_forbid_the_same_logits() {
        // Ids 0..70: all but 3 and 64, as a list and as bits (ragged last word).
        let n = 70;
        let except = Allowed::Except(&[3, 64, 500]);
        let bits = except.to_bits(n);
        assert_eq!(bits.len(), 3);
        assert_eq!(bits[0], !(1 << 3));
        assert_eq!(bits[2], (1 << 6) - 1 - 1, "bit 64 clear, none past id 69");
        let as_bits = Allowed::Bits(&bits);
        for id in 0..n as u32 {
            assert_eq!(as_bits.allows(id), except.allows(id), "id {id}");
        }
        assert!(!as_bits.allows(70), "past the words nothing is allowed");
        let (mut a, mut b) = (vec![1f32; n + 2], vec![1f32; n + 2]);
        except.apply(&mut a);
        as_bits.apply(&mut b);
        assert_eq!(a[..n], b[..n]);
        assert_eq!(
            (a[3], a[64], a[10]),
            (f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0)
        );
    }

    #[test]
    fn a_masked_token_is_never_chosen_whatever_the_draw() {
        // Two allowed tokens of tiny probability beside a forbidden favourite: even a draw at
        // the top of [0, 1) must land on an allowed one.
        let logits = [0.0, 50.0, 0.0, -3.0];
        let bits = [0b1101u32];
        for temperature in [0.5f32, 1.0, 4.0] {
            let mut sampler = Sampler::new(SamplingParams {
                temperature,
                ..SamplingParams::greedy()
            });
            let mut choice = Choice {
                allowed: Some(Allowed::Bits(&bits)),
                ..Choice::of(&mut sampler)
            };
            for draw in [0.0, 0.5, 0.999_999_9] {
                let token = choice.pick_drawn(&logits, draw).token;
                assert_ne!(token, 1, "draw {draw} at T {temperature}");
            }
        }
    }
}
