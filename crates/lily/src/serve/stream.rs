//! Server-sent events: the engine's events for one request, turned into `data: {json}` chunks by
//! an endpoint's format, then `data: [DONE]`. Dropping the body (the client disconnected) drops
//! the receiver, which cancels the generation.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::engine::{EngineEvent, Outcome};
use super::error::{ApiError, ApiResult};
use super::worker::WorkerEvent;

/// A comment line keeps proxies and clients from timing out during a long prefill.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

pub struct Step {
    pub chunks: Vec<Value>,
    /// The format has said everything; `[DONE]` follows.
    pub done: bool,
}

/// How one endpoint turns engine events into chunks.
pub trait StreamFormat: Send + 'static {
    /// Chunks sent before the first event (e.g. the assistant role).
    fn opening(&mut self) -> Vec<Value>;
    fn on_event(&mut self, event: WorkerEvent) -> Step;

    /// The SSE `event:` line of a chunk: Anthropic names every event by its type, OpenAI none.
    fn event_name(&self, _chunk: &Value) -> Option<String> {
        None
    }

    /// Whether `data: [DONE]` ends the stream (OpenAI's convention; Anthropic's is an event).
    fn done_marker(&self) -> bool {
        true
    }
}

enum Phase {
    Opening,
    Events,
    Finished,
}

pub fn sse_response<F: StreamFormat>(
    events: UnboundedReceiver<WorkerEvent>,
    format: F,
) -> Response {
    let stream = futures_util::stream::unfold(
        (events, format, Phase::Opening),
        |(mut events, mut format, mut phase)| async move {
            loop {
                let step = match phase {
                    Phase::Finished => return None,
                    Phase::Opening => {
                        phase = Phase::Events;
                        Step {
                            chunks: format.opening(),
                            done: false,
                        }
                    }
                    Phase::Events => match tokio::time::timeout(KEEP_ALIVE, events.recv()).await {
                        Err(_) => {
                            let ping = Bytes::from_static(b": keep-alive\n\n");
                            return Some((Ok::<Bytes, Infallible>(ping), (events, format, phase)));
                        }
                        Ok(Some(event)) => format.on_event(event),
                        Ok(None) => Step {
                            chunks: vec![
                                ApiError::internal("the generation ended without a result").body(),
                            ],
                            done: true,
                        },
                    },
                };
                // An empty chunk would end a chunked HTTP/1.1 body: wait for content instead.
                if step.chunks.is_empty() && !step.done {
                    continue;
                }
                if step.done {
                    phase = Phase::Finished;
                }
                let bytes = frames(&format, &step.chunks, step.done);
                return Some((Ok(bytes), (events, format, phase)));
            }
        },
    );
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

fn frames(format: &impl StreamFormat, chunks: &[Value], done: bool) -> Bytes {
    let mut out = String::new();
    for chunk in chunks {
        if let Some(name) = format.event_name(chunk) {
            out.push_str("event: ");
            out.push_str(&name);
            out.push('\n');
        }
        out.push_str("data: ");
        out.push_str(&chunk.to_string());
        out.push_str("\n\n");
    }
    if done && format.done_marker() {
        out.push_str("data: [DONE]\n\n");
    }
    Bytes::from(out)
}

/// A reply built from the engine's events (Anthropic's content blocks, Responses' items): the
/// same parts give a stream's events and a whole answer.
pub trait Reply {
    /// The stream events for one engine event.
    fn on_engine_event(&mut self, event: EngineEvent) -> Vec<Value>;
    /// The events that close the reply.
    fn finish(&mut self) -> Vec<Value>;
}

/// The whole reply of a request that does not stream, and how its generation ended (the stream
/// events are dropped; the reply keeps what the answer needs).
pub async fn collect<R: Reply>(
    mut events: UnboundedReceiver<WorkerEvent>,
    mut reply: R,
) -> ApiResult<(R, Outcome)> {
    while let Some(event) = events.recv().await {
        match event {
            WorkerEvent::Engine(event) => {
                reply.on_engine_event(event);
            }
            WorkerEvent::Failed(message) => return Err(ApiError::internal(message)),
            WorkerEvent::Done(outcome) => {
                reply.finish();
                return Ok((reply, outcome));
            }
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}
