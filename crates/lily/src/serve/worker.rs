//! The engine's own thread: it owns the backend and takes jobs from a bounded FIFO queue, one
//! generation at a time. Events go back on a channel per request; a request whose receiver is
//! gone (the client disconnected) is cancelled at the next step, and so is every request once
//! the server is shutting down.

use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, atomic::AtomicBool, atomic::Ordering};
use std::time::{Duration, Instant};

use lily_core::backend::Backend;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::engine::{Engine, EngineEvent, GenerationJob, Outcome};
use super::error::ApiError;
use super::metrics::Metrics;

#[derive(Debug)]
pub enum WorkerEvent {
    Engine(EngineEvent),
    Done(Outcome),
    Failed(String),
}

struct QueuedJob {
    job: GenerationJob,
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
    /// Starts the engine thread with room for `capacity` waiting requests.
    pub fn spawn<B: Backend + 'static>(
        engine: Engine<B>,
        capacity: usize,
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
                serve_queue(engine, queue, &stop, &counts);
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

    /// Ends the running generation and every queued one at their next step, each with a
    /// normal final event, and refuses new ones: what a shutdown needs to finish streams soon.
    pub fn stop_generating(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }
}

fn serve_queue<B: Backend>(
    mut engine: Engine<B>,
    queue: Receiver<QueuedJob>,
    stop: &AtomicBool,
    metrics: &Metrics,
) {
    while let Ok(QueuedJob {
        job,
        events,
        queued_at,
    }) = queue.recv()
    {
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        if events.is_closed() {
            continue;
        }
        let mut last_text: Option<Instant> = None;
        let emit = |event| {
            if let EngineEvent::Text { .. } = &event {
                let now = Instant::now();
                match last_text {
                    None => metrics.time_to_first_token.observe(now - queued_at),
                    Some(previous) => metrics.inter_token.observe(now - previous),
                }
                last_text = Some(now);
            }
            match events.send(WorkerEvent::Engine(event)) {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            }
        };
        let started = Instant::now();
        // A bug in one generation must not take the server down with it.
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            engine.run(&job, emit, || {
                events.is_closed() || stop.load(Ordering::SeqCst)
            })
        }));
        let last = match result {
            Ok(Ok(outcome)) => WorkerEvent::Done(outcome),
            Ok(Err(e)) => WorkerEvent::Failed(format!("{e:#}")),
            Err(_) => WorkerEvent::Failed("the generation engine panicked".into()),
        };
        match &last {
            WorkerEvent::Done(outcome) => {
                metrics.count_outcome(outcome);
                log_outcome(outcome, started.elapsed(), &engine);
            }
            WorkerEvent::Failed(message) => eprintln!("lily: generation failed: {message}"),
            WorkerEvent::Engine(_) => {}
        }
        let _ = events.send(last);
    }
}

fn log_outcome<B: Backend>(outcome: &Outcome, elapsed: Duration, engine: &Engine<B>) {
    let (snapshots, bytes) = engine.snapshot_usage();
    let seconds = elapsed.as_secs_f64();
    eprintln!(
        "lily: {} prompt tokens ({} cached), {} generated in {seconds:.2} s ({:.1} tok/s), {:?}; \
         {snapshots} snapshots ({:.1} MiB)",
        outcome.prompt_tokens,
        outcome.cached_tokens,
        outcome.completion_tokens(),
        outcome.completion_tokens() as f64 / seconds.max(1e-9),
        outcome.finish(),
        bytes as f64 / (1 << 20) as f64,
    );
}
