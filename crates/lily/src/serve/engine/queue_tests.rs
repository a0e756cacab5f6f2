//! The engine over a backend that queues each next step before the host sees a pick
//! ([`DecodeRow::queue_next`]), as the CUDA backend does: the CPU model run by the contract's
//! letter, each queued step made at once and its pick kept for the call that feeds the token it
//! consumed. Every generation must give what it gives on the plain backend, and a reply that ends
//! its turn must leave the same snapshot, though its state has fed the stop token already.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicUsize, Ordering};

use lily_core::backend::{DecodeRow, LogitRows};
use lily_core::choice::{Choice, Pick};
use lily_core::config::ModelConfig;
use lily_core::sampling::SamplingParams;
use serde_json::json;

use super::batch_tests::{ask, jobs};
use super::tests::{engine, job, sampled, text_model};
use super::*;
use crate::backends::{AnyBackend, AnyState};
use crate::device::{Device, load_with};

/// A state and, where a step was queued, the token it fed and what it picked.
struct QueuedState {
    inner: AnyState,
    queued: Option<(u32, Pick)>,
}

struct Queueing {
    inner: AnyBackend,
    /// Steps queued, and of those the ones whose pick no call took.
    queued: AtomicUsize,
    taken: AtomicUsize,
}

impl Queueing {
    fn engine(snapshot_budget: usize) -> Engine<Queueing> {
        let backend = Queueing {
            inner: load_with("synthetic:tiny", Device::Cpu, false).unwrap(),
            queued: 0.into(),
            taken: 0.into(),
        };
        Engine::new(backend, text_model(), 4096, snapshot_budget).unwrap()
    }

    /// Anything but the queued step's own pick ends what was queued.
    fn fed(state: &mut QueuedState) -> &mut AnyState {
        state.queued = None;
        &mut state.inner
    }
}

impl Backend for Queueing {
    type State = QueuedState;

    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn max_prefill_chunk(&self) -> usize {
        self.inner.max_prefill_chunk()
    }
    fn new_state(&self, max_seq: usize) -> Result<QueuedState> {
        Ok(QueuedState {
            inner: self.inner.new_state(max_seq)?,
            queued: None,
        })
    }
    fn state_len(&self, state: &QueuedState) -> usize {
        self.inner.state_len(&state.inner)
    }
    fn fork(&self, state: &QueuedState) -> Result<QueuedState> {
        Ok(QueuedState {
            inner: self.inner.fork(&state.inner)?,
            queued: None,
        })
    }
    fn state_bytes(&self, state: &QueuedState) -> usize {
        self.inner.state_bytes(&state.inner)
    }
    fn prefill(
        &self,
        state: &mut QueuedState,
        tokens: &[u32],
        rows: LogitRows,
    ) -> Result<Vec<f32>> {
        self.inner.prefill(Self::fed(state), tokens, rows)
    }
    fn prefill_choose(
        &self,
        state: &mut QueuedState,
        tokens: &[u32],
        choice: &mut Choice<'_>,
    ) -> Result<Pick> {
        self.inner.prefill_choose(Self::fed(state), tokens, choice)
    }
    fn decode_batch(&self, rows: &mut [DecodeRow<'_, QueuedState>]) -> Result<Vec<Pick>> {
        let mut picks = Vec::with_capacity(rows.len());
        for row in rows.iter_mut() {
            let pick = match row.state.queued.take() {
                Some((fed, pick)) => {
                    anyhow::ensure!(fed == row.token, "fed {}, not the queued {fed}", row.token);
                    self.taken.fetch_add(1, Ordering::Relaxed);
                    pick
                }
                None => {
                    let state = &mut row.state.inner;
                    self.inner
                        .decode_choose(state, row.token, &mut row.choice)?
                }
            };
            if row.queue_next && row.choice.is_memoryless() {
                let state = &mut row.state.inner;
                let next = self
                    .inner
                    .decode_choose(state, pick.token, &mut row.choice)?;
                row.state.queued = Some((pick.token, next));
                self.queued.fetch_add(1, Ordering::Relaxed);
            }
            picks.push(pick);
        }
        Ok(picks)
    }
}

fn run<B: Backend>(engine: &mut Engine<B>, job: &GenerationJob) -> (Outcome, Vec<EngineEvent>) {
    let mut events = Vec::new();
    let outcome = engine
        .run(
            job,
            |event| {
                events.push(event);
                ControlFlow::Continue(())
            },
            || false,
        )
        .unwrap();
    (outcome, events)
}

#[test]
fn queued_steps_change_no_generation() {
    let mut stopped = ask("Hello.", 30, SamplingParams::greedy());
    let mut plain = engine(0);
    let (free, _) = run(&mut plain, &stopped);
    // A stop string that the free run's text holds, so that the reply ends inside it.
    let free_text = text_model().tokenizer.decode(&free.tokens()[4..7]);
    stopped.stop = vec![free_text];
    let mut jobs = jobs();
    jobs.extend([
        ask("Hello.", 1, SamplingParams::greedy()),
        ask("Hello.", 2, sampled(3)),
        stopped,
    ]);
    let mut queueing = Queueing::engine(0);
    for (i, job) in jobs.iter().enumerate() {
        let want = run(&mut plain, job);
        assert_eq!(run(&mut queueing, job), want, "job {i}");
    }
    let queued = queueing.backend.queued.load(Ordering::Relaxed);
    let taken = queueing.backend.taken.load(Ordering::Relaxed);
    // Steps were queued, and only a choice that ended early (the stop string) left one untaken.
    assert!(taken > 30, "{taken} of {queued} queued steps taken");
    assert_eq!(queued - taken, 1, "{taken} of {queued} queued steps taken");
}

fn end_turns_with<B: Backend>(engine: &mut Engine<B>, stop: u32, then: u32) {
    engine.stop_ids = vec![stop];
    engine.turn_end = vec![stop, then];
}

#[test]
fn a_turn_that_ends_with_a_queued_step_leaves_the_same_snapshot() {
    let first = [json!({"role": "user", "content": "Name a colour."})];
    let first_job = job(&first, 12, SamplingParams::greedy());
    let (free, _) = run(&mut engine(0), &first_job);
    // The synthetic model never ends a turn of its own: its fourth token is made the end of
    // turn (the first of `<|im_end|>\n`), where neither engine has stopped before.
    let tokens = free.tokens();
    let stop = tokens[3];
    assert!(!tokens[..3].contains(&stop), "{tokens:?}");
    let mut plain = engine(256 << 20);
    let mut queueing = Queueing::engine(256 << 20);
    end_turns_with(&mut plain, stop, tokens[5]);
    end_turns_with(&mut queueing, stop, tokens[5]);
    let (a, _) = run(&mut plain, &first_job);
    let (b, _) = run(&mut queueing, &first_job);
    assert_eq!((a.finish(), a.tokens()), (Finish::Stop, &tokens[..3]));
    assert_eq!(a, b);
    assert_eq!(queueing.backend.queued.load(Ordering::Relaxed), 3);
    // The next turn starts from the snapshot after the turn's end on both, and goes on as a
    // cold run of the whole conversation does.
    let turn_end = [&first_job.prompt[..], &tokens[..3], &[stop, tokens[5]]].concat();
    let mut next = first_job.clone();
    next.prompt = [&turn_end[..], &first_job.prompt[1..]].concat();
    next.turn_boundary = None;
    let (cold, cold_events) = run(&mut engine(0), &next);
    for engine_run in [run(&mut plain, &next), run(&mut queueing, &next)] {
        let (warm, events) = engine_run;
        assert_eq!(warm.cached_tokens, turn_end.len());
        assert_eq!(
            (warm.tokens(), &events[1..]),
            (cold.tokens(), &cold_events[1..])
        );
    }
}
