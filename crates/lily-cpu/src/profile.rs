//! Where a CPU forward pass spends its time, stage by stage (`lily bench` prints it).
//!
//! The stages run one after another on the calling thread, each spreading its own work over the
//! cores, so a clock around each stage on that thread splits the wall time without counting any
//! work twice. The clock is thread-local and off unless [`profiled`] runs: a stage costs one
//! thread-local read when nobody is looking.

use std::cell::RefCell;
use std::time::Instant;

/// The stages of one layer and the model's ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The RMSNorms, the embedding lookup and the residual adds.
    Norms,
    /// q/k/v (attention) and qkv/z/β/decay (Gated DeltaNet) projections.
    MixerInput,
    /// The Gated DeltaNet's causal conv (and its state's window).
    GdnConv,
    /// The delta rule over each value head, with its inputs' gathering and normalising.
    DeltaRule,
    /// The gated RMSNorm of the heads' outputs.
    GdnNorm,
    /// RoPE, the cache append and the softmax attention.
    Attention,
    /// `o_proj` and `out_proj`.
    MixerOutput,
    /// The router, its top-k and the shared expert's gate.
    Router,
    /// The routed and the shared experts' SwiGLU and their weighted combine (one region).
    Experts,
    /// The final norm's rows through the lm_head.
    LmHead,
}

const STAGES: [Stage; 10] = [
    Stage::Norms,
    Stage::MixerInput,
    Stage::GdnConv,
    Stage::DeltaRule,
    Stage::GdnNorm,
    Stage::Attention,
    Stage::MixerOutput,
    Stage::Router,
    Stage::Experts,
    Stage::LmHead,
];

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Norms => "norms, embedding, residual",
            Stage::MixerInput => "mixer input projections",
            Stage::GdnConv => "gated deltanet: conv",
            Stage::DeltaRule => "gated deltanet: delta rule",
            Stage::GdnNorm => "gated deltanet: gated norm",
            Stage::Attention => "attention (rope, cache, softmax)",
            Stage::MixerOutput => "mixer output projection",
            Stage::Router => "router and top-k",
            Stage::Experts => "experts (routed and shared)",
            Stage::LmHead => "lm_head",
        }
    }
}

thread_local! {
    static CLOCK: RefCell<Option<[f64; STAGES.len()]>> = const { RefCell::new(None) };
}

/// Runs `f`, charging its wall time to `stage` when this thread is being profiled.
pub(crate) fn stage<T>(stage: Stage, f: impl FnOnce() -> T) -> T {
    if CLOCK.with(|c| c.borrow().is_none()) {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let seconds = start.elapsed().as_secs_f64();
    CLOCK.with(|c| {
        if let Some(times) = c.borrow_mut().as_mut() {
            times[stage as usize] += seconds;
        }
    });
    out
}

/// Runs `f` with the clock on; returns its result and the milliseconds each stage took (every
/// stage, in model order, those that did not run included as zero).
pub fn profiled<T>(f: impl FnOnce() -> T) -> (T, Vec<(&'static str, f64)>) {
    let previous = CLOCK.with(|c| c.replace(Some([0.0; STAGES.len()])));
    let out = f();
    let times = CLOCK.with(|c| c.replace(previous)).unwrap_or_default();
    let stages = STAGES
        .iter()
        .map(|&s| (s.name(), times[s as usize] * 1e3))
        .collect();
    (out, stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_charged_only_while_profiled_and_only_to_themselves() {
        let spin = |ms: u64| std::thread::sleep(std::time::Duration::from_millis(ms));
        stage(Stage::LmHead, || spin(5));
        let (value, times) = profiled(|| {
            stage(Stage::Experts, || spin(20));
            stage(Stage::Router, || spin(2));
            7
        });
        assert_eq!(value, 7);
        assert!(get_of(&times, Stage::Experts) >= 20.0, "{times:?}");
        assert!(get_of(&times, Stage::Router) >= 2.0, "{times:?}");
        assert_eq!(get_of(&times, Stage::LmHead), 0.0, "{times:?}");
        assert_eq!(times.len(), STAGES.len());
    }

    /// Stage `s`'s milliseconds in a profile.
    fn get_of(times: &[(&'static str, f64)], s: Stage) -> f64 {
        times.iter().find(|(n, _)| *n == s.name()).unwrap().1
    }
}
