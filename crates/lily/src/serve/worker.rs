//! The engine's own thread: it owns the backend and takes jobs from a bounded FIFO queue into a
//! batch of up to `max_batch` generations, which it advances together one engine step at a time
//! (a prefill chunk of the oldest newcomer, then one token for each of the others). A finished or
//! cancelled generation frees its place at once, and the next queued job takes it. Events go
//! back on a channel per request; a request whose receiver is gone (the client disconnected) is
//! cancelled at its next step, and so is every request once the server is shutting down.

use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, atomic::AtomicBool, atomic::Ordering};
use std::time::{Duration, Instant};

use lily_core::backend::Backend;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::engine::{Engine, EngineEvent, Finished, GenerationJob, Outcome, Sink};
use super::error::ApiError;
use super::metrics::Metrics;
use super::request_id::current_request_id;

#[derive(Debug)]
pub enum WorkerEvent {
    Engine(EngineEvent),
    Done(Outcome),
    Failed(String),
}

struct QueuedJob {
    job: GenerationJob,
    /// The request's id, which every line logged about it carries.
    request_id: String,
    events: UnboundedSender<WorkerEvent>,
    queued_at: Instant,
}

#[derive(Clone)]
pub struct EngineHandle {
    jobs: SyncSender<QueuedJob>,
    capacity: usize,
    alive: Arc<AtomicBool>,
    stopping: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// Starts the engine thread with room for `capacity` waiting requests, running up to
    /// `max_batch` at once.
    pub fn spawn<B: Backend + 'static>(
        engine: Engine<B>,
        capacity: usize,
        max_batch: usize,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self>
    where
        B::State: 'static,
    {
        let (jobs, queue) = sync_channel(capacity.max(1));
        let alive = Arc::new(AtomicBool::new(true));
        let stopping = Arc::new(AtomicBool::new(false));
        let (flag, stop, counts) = (alive.clone(), stopping.clone(), metrics.clone());
        std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || {
                serve_queue(engine, queue, max_batch.max(1), &stop, &counts);
                flag.store(false, Ordering::SeqCst);
            })?;
        Ok(EngineHandle {
            jobs,
            capacity: capacity.max(1),
            alive,
            stopping,
            metrics,
        })
    }

    /// Queues `job`; its events arrive on the returned receiver. A full queue is a 429.
    pub fn submit(&self, job: GenerationJob) -> Result<UnboundedReceiver<WorkerEvent>, ApiError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let (events, receiver) = unbounded_channel();
        let queued = QueuedJob {
            job,
            request_id: current_request_id(),
            events,
            queued_at: Instant::now(),
        };
        // Counted before sending, so that the engine's decrement can never come first.
        self.metrics.queued.fetch_add(1, Ordering::Relaxed);
        let refused = match self.jobs.try_send(queued) {
            Ok(()) => return Ok(receiver),
            Err(TrySendError::Full(_)) => ApiError::queue_full(self.capacity),
            Err(TrySendError::Disconnected(_)) => {
                ApiError::unavailable("the generation engine has stopped; restart the server")
            }
        };
        self.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        Err(refused)
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Ends the running generations and every queued one at their next step, each with a
    /// normal final event, and refuses new ones: what a shutdown needs to finish streams soon.
    pub fn stop_generating(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }
}

/// What a generation in the batch reports to: its request's channel and the metrics.
struct WorkerSink {
    request_id: String,
    events: UnboundedSender<WorkerEvent>,
    queued_at: Instant,
    started: Instant,
    /// When the first and the latest piece of generated text went out.
    first_text: Option<Instant>,
    last_text: Option<Instant>,
    stop: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

impl Sink for WorkerSink {
    fn emit(&mut self, event: EngineEvent) -> ControlFlow<()> {
        if let EngineEvent::Text { .. } = &event {
            let now = Instant::now();
            match self.last_text {
                None => {
                    self.metrics
                        .time_to_first_token
                        .observe(now - self.queued_at);
                    self.first_text = Some(now);
                }
                Some(previous) => self.metrics.inter_token.observe(now - previous),
            }
            self.last_text = Some(now);
        }
        match self.events.send(WorkerEvent::Engine(event)) {
            Ok(()) => ControlFlow::Continue(()),
            Err(_) => ControlFlow::Break(()),
        }
    }

    fn cancelled(&self) -> bool {
        self.events.is_closed() || self.stop.load(Ordering::SeqCst)
    }
}

fn serve_queue<B: Backend>(
    mut engine: Engine<B>,
    queue: Receiver<QueuedJob>,
    max_batch: usize,
    stop: &Arc<AtomicBool>,
    metrics: &Arc<Metrics>,
) {
    let text = engine.text_model();
    let mut batch = Vec::new();
    loop {
        // Newcomers join in FIFO order while there is room; the thread sleeps only when
        // nothing runs.
        while batch.len() < max_batch {
            let queued = if batch.is_empty() {
                match queue.recv() {
                    Ok(queued) => queued,
                    Err(_) => return,
                }
            } else {
                match queue.try_recv() {
                    Ok(queued) => queued,
                    Err(_) => break,
                }
            };
            metrics.queued.fetch_sub(1, Ordering::Relaxed);
            if queued.events.is_closed() {
                continue;
            }
            let sink = WorkerSink {
                request_id: queued.request_id,
                events: queued.events,
                queued_at: queued.queued_at,
                started: Instant::now(),
                first_text: None,
                last_text: None,
                stop: stop.clone(),
                metrics: metrics.clone(),
            };
            match engine.admit(queued.job, sink, &text) {
                Ok(sequence) => batch.push(sequence),
                Err(finished) => report(finished, &engine),
            }
        }
        metrics.running.store(batch.len(), Ordering::Relaxed);
        // A bug in one step must not take the server down with it: the batch it ran fails.
        let finished = match std::panic::catch_unwind(AssertUnwindSafe(|| engine.step(&mut batch)))
        {
            Ok(finished) => finished,
            Err(_) => batch
                .drain(..)
                .map(|sequence| Finished {
                    sink: sequence.into_sink(),
                    result: Err(anyhow::anyhow!("the generation engine panicked")),
                })
                .collect(),
        };
        // Counted before the clients hear, so that /metrics after a reply never shows it.
        metrics.running.store(batch.len(), Ordering::Relaxed);
        finished.into_iter().for_each(|f| report(f, &engine));
    }
}

/// Sends a finished generation's last event, counts and logs it.
fn report<B: Backend>(finished: Finished<WorkerSink>, engine: &Engine<B>) {
    let sink = finished.sink;
    let last = match finished.result {
        Ok(outcome) => {
            sink.metrics.count_outcome(&outcome);
            let first_text = sink.first_text.map(|t| t - sink.queued_at);
            log_outcome(
                &sink.request_id,
                &outcome,
                sink.started.elapsed(),
                first_text,
                engine,
            );
            WorkerEvent::Done(outcome)
        }
        Err(e) => {
            let message = format!("{e:#}");
            eprintln!("lily: {}: generation failed: {message}", sink.request_id);
            WorkerEvent::Failed(message)
        }
    };
    let _ = sink.events.send(last);
}

/// One line per finished generation; `first_text` is the time from its arrival in the queue to
/// its first generated text, where it had any.
fn log_outcome<B: Backend>(
    id: &str,
    outcome: &Outcome,
    elapsed: Duration,
    first_text: Option<Duration>,
    engine: &Engine<B>,
) {
    let (snapshots, bytes) = engine.snapshot_usage();
    let seconds = elapsed.as_secs_f64();
    let first = first_text.map_or(String::new(), |t| {
        format!(", first text after {:.1} ms", t.as_secs_f64() * 1e3)
    });
    eprintln!(
        "lily: {id}: {} prompt tokens ({} cached), {} generated in {seconds:.2} s ({:.1} tok/s){first}, \
         {:?}; {snapshots} snapshots ({:.1} MiB)",
        outcome.prompt_tokens,
        outcome.cached_tokens,
        outcome.completion_tokens(),
        outcome.completion_tokens() as f64 / seconds.max(1e-9),
        outcome.finish(),
        bytes as f64 / (1 << 20) as f64,
    );
}
