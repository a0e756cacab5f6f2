//! `POST /v1/completions`: raw text (or token ids) in, raw text out, no template.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::engine::{EngineEvent, Finish, Outcome};
use super::error::{ApiError, ApiResult};
use super::ids::{new_id, unix_time};
use super::request::{CompletionPrompt, parse_body, parse_completion};
use super::routes::{AppState, outcome_usage, read_body};
use super::stream::{Step, StreamFormat, sse_response};
use super::worker::WorkerEvent;

pub async fn completions(State(app): State<Arc<AppState>>, body: Body) -> Response {
    handle(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn handle(app: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let body = parse_body(&read_body(body, &app).await?)?;
    let request = parse_completion(&body, &app.defaults)?;
    app.check_model(&request.common.model)?;
    // Output is always text, so even a prompt of token ids needs the tokenizer.
    let text = app.text.clone();
    let tokens = match request.prompt {
        CompletionPrompt::Tokens(ids) => {
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= app.vocab_size) {
                return Err(ApiError::param(
                    "prompt",
                    format!(
                        "token id {bad} is outside the vocabulary of {}",
                        app.vocab_size
                    ),
                ));
            }
            ids
        }
        CompletionPrompt::Text(prompt) => {
            tokio::task::spawn_blocking(move || text.tokenizer.encode(&prompt))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e}")))?
                .map_err(|e| ApiError::param("prompt", format!("{e:#}")))?
        }
    };
    let job = app.job(tokens, None, &request.common, "prompt")?;
    let events = app.engine.submit(job)?;
    let head = CompletionHead {
        id: new_id("cmpl-"),
        created: unix_time(),
        model: app.model_name.clone(),
    };
    if request.common.stream {
        let format = CompletionStream {
            head,
            include_usage: request.common.include_usage,
        };
        return Ok(sse_response(events, format));
    }
    collect(events, head).await
}

struct CompletionHead {
    id: String,
    created: u64,
    model: String,
}

impl CompletionHead {
    fn body(&self, text: &str, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": null,
                         "finish_reason": finish_reason}],
        })
    }
}

fn finish_reason(outcome: &Outcome) -> &'static str {
    match outcome.finish {
        Finish::Length => "length",
        Finish::Stop | Finish::Cancelled => "stop",
    }
}

async fn collect(
    mut events: UnboundedReceiver<WorkerEvent>,
    head: CompletionHead,
) -> ApiResult<Response> {
    let mut text = String::new();
    while let Some(event) = events.recv().await {
        match event {
            WorkerEvent::Engine(EngineEvent::Text(t)) => text.push_str(&t),
            WorkerEvent::Engine(EngineEvent::Started { .. }) => {}
            WorkerEvent::Failed(message) => return Err(ApiError::internal(message)),
            WorkerEvent::Done(outcome) => {
                let mut body = head.body(&text, Some(finish_reason(&outcome)));
                body["usage"] = outcome_usage(&outcome);
                return Ok(Json(body).into_response());
            }
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

struct CompletionStream {
    head: CompletionHead,
    include_usage: bool,
}

impl CompletionStream {
    fn chunk(&self, text: &str, finish_reason: Option<&str>) -> Value {
        let mut chunk = self.head.body(text, finish_reason);
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

impl StreamFormat for CompletionStream {
    fn opening(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn on_event(&mut self, event: WorkerEvent) -> Step {
        let (chunks, done) = match event {
            WorkerEvent::Engine(EngineEvent::Started { .. }) => (Vec::new(), false),
            WorkerEvent::Engine(EngineEvent::Text(text)) => (vec![self.chunk(&text, None)], false),
            WorkerEvent::Failed(message) => (vec![ApiError::internal(message).body()], true),
            WorkerEvent::Done(outcome) => {
                let mut chunks = vec![self.chunk("", Some(finish_reason(&outcome)))];
                if self.include_usage {
                    let mut last = self.head.body("", None);
                    last["choices"] = json!([]);
                    last["usage"] = outcome_usage(&outcome);
                    chunks.push(last);
                }
                (chunks, true)
            }
        };
        Step { chunks, done }
    }
}
