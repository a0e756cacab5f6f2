//! Log-probabilities from a row of logits: the model's own distribution over the whole row,
//! before any penalty, temperature or truncation (vLLM's default, and what `lily score`
//! reports), so that a client can compare them across sampling settings.

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, best first (ties by id), with their log-probabilities.
    pub top: Vec<(u32, f32)>,
}

/// log(Σ exp(row)), in f64 so that a 248K-entry row loses nothing.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln()
}

/// log p(row[i]) under softmax(row).
pub fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    row[i] as f64 - log_sum_exp(row)
}

/// The log-probability of `token` and the `top` most likely ids below `choosable` (ids at or
/// above it, such as padding rows, are never offered), normalised over the whole row.
pub fn token_logprobs(row: &[f32], token: u32, top: usize, choosable: usize) -> TokenLogprobs {
    let norm = log_sum_exp(row);
    let at = |i: u32| (row.get(i as usize).map_or(f64::NEG_INFINITY, |&v| v as f64) - norm) as f32;
    let n = choosable.min(row.len());
    let mut ids: Vec<u32> = (0..n as u32)
        .filter(|&i| !row[i as usize].is_nan())
        .collect();
    let by_logit = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    let k = top.min(ids.len());
    if k > 0 && k < ids.len() {
        ids.select_nth_unstable_by(k - 1, by_logit);
    }
    ids.truncate(k);
    ids.sort_unstable_by(by_logit);
    TokenLogprobs {
        token,
        logprob: at(token),
        top: ids.into_iter().map(|i| (i, at(i))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_ids_come_best_first() {
        // p = [0.1, 0.2, 0.3, 0.4] exactly.
        let row: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4]
            .iter()
            .map(|p| p.ln() + 7.0)
            .collect();
        let lp = token_logprobs(&row, 1, 2, 4);
        assert!((lp.logprob - 0.2f32.ln()).abs() < 1e-6, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [3, 2]);
        assert!((lp.top[0].1 - 0.4f32.ln()).abs() < 1e-6);
        // Ids at or past `choosable` are not offered, but still count in the normalisation.
        let lp = token_logprobs(&row, 0, 3, 2);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 0]);
        assert!((lp.logprob - 0.1f32.ln()).abs() < 1e-6);
        assert!(token_logprobs(&row, 2, 0, 4).top.is_empty());
    }
}
