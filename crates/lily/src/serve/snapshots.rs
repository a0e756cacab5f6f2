//! Snapshots of sequence states at conversation turn boundaries, kept LRU under a memory budget,
//! so that a follow-up turn prefills only its new tokens.
//!
//! The Gated DeltaNet layers fold every token into a fixed-size recurrent state that cannot be
//! rolled back, so a state can only be reused by a prompt that extends its tokens exactly. The
//! engine therefore snapshots where later requests branch: at the end of the conversation before
//! the generation prompt, after the whole prompt, and after a finished reply.

pub struct Snapshot<S> {
    /// The tokens the state has consumed.
    pub tokens: Vec<u32>,
    pub state: S,
    /// The logits after the last token, when kept, so that the same prompt needs no prefill.
    pub logits: Option<Vec<f32>>,
    bytes: usize,
    last_used: u64,
}

pub struct SnapshotCache<S> {
    entries: Vec<Snapshot<S>>,
    budget_bytes: usize,
    used_bytes: usize,
    clock: u64,
}

impl<S> SnapshotCache<S> {
    /// A budget of 0 disables the cache.
    pub fn new(budget_bytes: usize) -> Self {
        SnapshotCache {
            entries: Vec::new(),
            budget_bytes,
            used_bytes: 0,
            clock: 0,
        }
    }

    /// The snapshot that covers the longest prefix of `prompt` and still leaves a token to
    /// prefill, or covers all of it and kept its logits.
    pub fn longest_prefix(&mut self, prompt: &[u32]) -> Option<&Snapshot<S>> {
        let usable = |s: &Snapshot<S>| {
            prompt.starts_with(&s.tokens) && (s.tokens.len() < prompt.len() || s.logits.is_some())
        };
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, s)| usable(s))
            .max_by_key(|(_, s)| s.tokens.len())
            .map(|(i, _)| i)?;
        self.clock += 1;
        self.entries[best].last_used = self.clock;
        Some(&self.entries[best])
    }

    /// Whether a snapshot of exactly these tokens is kept (with logits, if `with_logits`).
    pub fn contains(&self, tokens: &[u32], with_logits: bool) -> bool {
        self.entries
            .iter()
            .any(|s| s.tokens == tokens && (s.logits.is_some() || !with_logits))
    }

    /// Whether a snapshot of `bytes` (plus `logits` floats) can be kept at all; checked before
    /// paying for a copy of the state.
    pub fn fits(&self, bytes: usize, logits: usize) -> bool {
        bytes + logits * 4 <= self.budget_bytes
    }

    /// Keeps a snapshot of `bytes`, evicting the least recently used ones to stay in budget.
    /// One that does not fit the budget alone is not kept.
    pub fn insert(&mut self, tokens: Vec<u32>, state: S, logits: Option<Vec<f32>>, bytes: usize) {
        let logit_count = logits.as_ref().map_or(0, Vec::len);
        if !self.fits(bytes, logit_count) {
            return;
        }
        let bytes = bytes + logit_count * 4;
        if let Some(i) = self.entries.iter().position(|s| s.tokens == tokens) {
            let old = self.entries.swap_remove(i);
            self.used_bytes -= old.bytes;
        }
        while self.used_bytes + bytes > self.budget_bytes {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used)
            else {
                break;
            };
            let evicted = self.entries.swap_remove(oldest);
            self.used_bytes -= evicted.bytes;
        }
        self.clock += 1;
        self.used_bytes += bytes;
        self.entries.push(Snapshot {
            tokens,
            state,
            logits,
            bytes,
            last_used: self.clock,
        });
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_usable_prefix_wins() {
        let mut cache = SnapshotCache::new(1000);
        cache.insert(vec![1, 2], "two", None, 10);
        cache.insert(vec![1, 2, 3], "three", None, 10);
        cache.insert(vec![1, 9], "other", None, 10);
        assert_eq!(
            cache.longest_prefix(&[1, 2, 3, 4]).map(|s| s.state),
            Some("three")
        );
        // Covering the whole prompt without logits leaves nothing to sample from.
        assert_eq!(
            cache.longest_prefix(&[1, 2, 3]).map(|s| s.state),
            Some("two")
        );
        assert!(cache.longest_prefix(&[5, 1, 2]).is_none());
        cache.insert(vec![1, 2, 3], "three+logits", Some(vec![0.0; 2]), 10);
        assert_eq!(
            cache.longest_prefix(&[1, 2, 3]).map(|s| s.state),
            Some("three+logits")
        );
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.used_bytes(), 10 + 10 + 18);
    }

    #[test]
    fn least_recently_used_snapshots_are_evicted_to_fit_the_budget() {
        let mut cache = SnapshotCache::new(30);
        cache.insert(vec![1], "a", None, 10);
        cache.insert(vec![2], "b", None, 10);
        cache.insert(vec![3], "c", None, 10);
        // Using "a" makes "b" the oldest.
        assert!(cache.longest_prefix(&[1, 5]).is_some());
        cache.insert(vec![4], "d", None, 10);
        assert!(cache.contains(&[1], false));
        assert!(!cache.contains(&[2], false));
        assert!(cache.contains(&[4], false));
        assert_eq!(cache.used_bytes(), 30);
        // Too big for the whole budget: not kept, nothing evicted.
        cache.insert(vec![5], "e", None, 31);
        assert_eq!(cache.len(), 3);
        let mut off = SnapshotCache::new(0);
        off.insert(vec![1], "a", None, 1);
        assert_eq!(off.len(), 0);
    }
}
