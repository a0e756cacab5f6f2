//! Several generations in one batch on `synthetic:tiny`: each gives exactly what it gives alone
//! (the CPU's batched step is bit-identical per row), whatever joins or leaves around it, and a
//! newcomer's first token comes after one prefill chunk, not after the others finish.

use std::cell::RefCell;
use std::ops::ControlFlow;
use std::rc::Rc;

use lily_core::sampling::SamplingParams;
use serde_json::json;

use super::tests::{engine, job, sampled};
use super::*;

/// Every event of a batch, in order, as (generation, event).
type Log = Rc<RefCell<Vec<(usize, EngineEvent)>>>;

struct Recorder {
    id: usize,
    log: Log,
}

impl Sink for Recorder {
    fn emit(&mut self, event: EngineEvent) -> ControlFlow<()> {
        self.log.borrow_mut().push((self.id, event));
        ControlFlow::Continue(())
    }
    fn cancelled(&self) -> bool {
        false
    }
}

/// The text each choice of generation `id` streamed.
fn texts(log: &Log, id: usize, n: usize) -> Vec<String> {
    let mut texts = vec![String::new(); n];
    for (who, event) in log.borrow().iter() {
        if let (true, EngineEvent::Text { choice, text, .. }) = (*who == id, event) {
            texts[*choice].push_str(text);
        }
    }
    texts
}

/// One user message.
pub(super) fn ask(content: &str, max_tokens: usize, sampling: SamplingParams) -> GenerationJob {
    job(
        &[json!({"role": "user", "content": content})],
        max_tokens,
        sampling,
    )
}

/// Greedy, sampled with log-probabilities, two choices, penalised, sampled.
pub(super) fn jobs() -> Vec<GenerationJob> {
    let mut scored = ask("Name three rivers.", 9, sampled(5));
    scored.logprobs = Some(3);
    let mut choices = ask("Write a haiku.", 7, sampled(11));
    choices.n = 2;
    let mut penalised = ask(
        "Count to ten, please, slowly.",
        14,
        SamplingParams::greedy(),
    );
    penalised.penalties.frequency = 0.5;
    vec![
        ask("Hello.", 20, SamplingParams::greedy()),
        scored,
        choices,
        penalised,
        ask("What is the capital of France, and why?", 5, sampled(2)),
    ]
}

#[test]
fn each_generation_in_a_batch_gives_what_it_gives_alone() {
    let jobs = jobs();
    let mut alone = engine(0);
    let solo: Vec<(Outcome, Vec<String>)> = jobs
        .iter()
        .map(|job| {
            let log: Log = Rc::default();
            let sink = Recorder {
                id: 0,
                log: log.clone(),
            };
            let text = alone.text_model();
            let mut batch = vec![alone.admit(job.clone(), sink, &text).ok().unwrap()];
            let outcome = loop {
                if let Some(f) = alone.step(&mut batch).pop() {
                    break f.result.unwrap();
                }
            };
            (outcome, texts(&log, 0, job.n))
        })
        .collect();

    // Three start together; the others join after 3 and 6 steps, while the first generate.
    let mut engine = engine(0);
    let text = engine.text_model();
    let log: Log = Rc::default();
    let mut batch = Vec::new();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; jobs.len()];
    let mut largest = 0;
    for step in 0.. {
        for (id, job) in jobs.iter().enumerate() {
            if [0, 0, 0, 3, 6][id] == step {
                let sink = Recorder {
                    id,
                    log: log.clone(),
                };
                batch.push(engine.admit(job.clone(), sink, &text).ok().unwrap());
            }
        }
        largest = largest.max(batch.len());
        for finished in engine.step(&mut batch) {
            outcomes[finished.sink.id] = Some(finished.result.unwrap());
        }
        if step > 6 && batch.is_empty() {
            break;
        }
    }
    assert!(largest >= 4, "only {largest} ran at once");
    for (id, (outcome, solo_texts)) in solo.iter().enumerate() {
        assert_eq!(outcomes[id].as_ref(), Some(outcome), "generation {id}");
        assert_eq!(&texts(&log, id, jobs[id].n), solo_texts, "generation {id}");
        assert!(outcome.completion_tokens() > 0, "generation {id}");
    }
}

#[test]
fn a_newcomer_streams_its_first_token_while_a_long_generation_goes_on() {
    let mut engine = engine(0);
    let text = engine.text_model();
    let log: Log = Rc::default();
    // Biased to a whole word, so that every token streams text at once.
    let hello = |content: &str, max_tokens| {
        let mut job = job(
            &[json!({"role": "user", "content": content})],
            max_tokens,
            SamplingParams::greedy(),
        );
        job.penalties.logit_bias = vec![(9419, 100.0)];
        job
    };
    let (long, short) = (hello("Tell a long story.", 60), hello("Hi.", 3));
    let sink = |id| Recorder {
        id,
        log: log.clone(),
    };
    let mut batch = vec![engine.admit(long, sink(0), &text).ok().unwrap()];
    for _ in 0..5 {
        assert!(engine.step(&mut batch).is_empty());
    }
    batch.push(engine.admit(short, sink(1), &text).ok().unwrap());
    // The short prompt fits one chunk: one step brings it in and streams its first token (from
    // the prompt's logits), then the batched decode gives both their next one.
    let before = log.borrow().len();
    assert!(engine.step(&mut batch).is_empty());
    let events: Vec<(usize, bool)> = log.borrow()[before..]
        .iter()
        .map(|(id, event)| (*id, matches!(event, EngineEvent::Started { .. })))
        .collect();
    assert_eq!(events, [(1, true), (1, false), (0, false), (1, false)]);
    let mut order = Vec::new();
    while !batch.is_empty() {
        order.extend(engine.step(&mut batch).into_iter().map(|f| f.sink.id));
    }
    assert_eq!(order, [1, 0], "the short one finishes first");
    assert_eq!(texts(&log, 1, 1), ["Hello".repeat(3)]);
    let log = log.borrow();
    let is_text = |e: &EngineEvent| matches!(e, EngineEvent::Text { .. });
    let first_short = log.iter().position(|(id, e)| *id == 1 && is_text(e));
    let last_long = log.iter().rposition(|(id, _)| *id == 0);
    assert!(
        first_short.is_some() && first_short < last_long,
        "{first_short:?} {last_long:?}"
    );
}

/// A sink whose consumer goes away after `keep` text events.
struct Leaving {
    texts: usize,
    keep: usize,
}

impl Sink for Leaving {
    fn emit(&mut self, event: EngineEvent) -> ControlFlow<()> {
        if let EngineEvent::Text { .. } = event {
            self.texts += 1;
            if self.texts > self.keep {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }
    fn cancelled(&self) -> bool {
        self.texts > self.keep
    }
}

#[test]
fn a_consumer_that_leaves_frees_its_place_at_once_and_costs_the_others_nothing() {
    let jobs = jobs();
    let mut engine = engine(0);
    let text = engine.text_model();
    let (staying, leaving) = (&jobs[0], &jobs[3]);
    let alone = engine
        .run(staying, |_| ControlFlow::Continue(()), || false)
        .unwrap();
    let stay = Leaving {
        texts: 0,
        keep: usize::MAX,
    };
    let leave = Leaving { texts: 0, keep: 2 };
    let mut batch = vec![engine.admit(staying.clone(), stay, &text).ok().unwrap()];
    batch.push(engine.admit(leaving.clone(), leave, &text).ok().unwrap());
    // A job that cannot run never joins: the batch does not see it.
    let mut too_long = staying.clone();
    too_long.prompt = vec![1; 5000];
    let refused = engine.admit(too_long, Leaving { texts: 0, keep: 0 }, &text);
    assert!(refused.is_err_and(|f| f.result.is_err()));
    let mut left_at = None;
    let mut outcome = None;
    for step in 0.. {
        for finished in engine.step(&mut batch) {
            let result = finished.result.unwrap();
            if finished.sink.keep == 2 {
                assert_eq!(result.finish(), Finish::Cancelled);
                assert_eq!(
                    batch.len(),
                    1,
                    "the leaver's place is free in the step it left"
                );
                left_at = Some(step);
            } else {
                outcome = Some(result);
            }
        }
        if batch.is_empty() {
            break;
        }
    }
    assert!(left_at.is_some());
    assert_eq!(outcome.as_ref(), Some(&alone));
}
