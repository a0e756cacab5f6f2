//! `POST /v1/chat/completions`, streamed or not: reasoning goes to `reasoning_content`, the
//! answer to `content`, Qwen's XML tool calls to `tool_calls` with JSON arguments.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use lily_chat::{ChatDelta, ChatOutputParser, ToolSchemas};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::engine::{EngineEvent, Finish, Outcome};
use super::error::{ApiError, ApiResult};
use super::ids::{new_id, unix_time};
use super::prompt::chat_prompt;
use super::request::{parse_body, parse_chat};
use super::routes::{AppState, outcome_usage, read_body};
use super::stream::{Step, StreamFormat, sse_response};
use super::worker::WorkerEvent;

pub async fn chat_completions(State(app): State<Arc<AppState>>, body: Body) -> Response {
    handle(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn handle(app: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let body = parse_body(&read_body(body, &app).await?)?;
    let request = parse_chat(&body, &app.defaults, app.default_thinking)?;
    app.check_model(&request.common.model)?;
    let text = app.text.clone();
    let (messages, tools, kwargs) = (
        request.messages,
        request.tools.clone(),
        request.template_kwargs,
    );
    let prompt =
        tokio::task::spawn_blocking(move || chat_prompt(&text, &messages, &tools, &kwargs))
            .await
            .map_err(|e| ApiError::internal(format!("rendering the prompt: {e}")))?
            .map_err(|e| ApiError::param("messages", format!("{e:#}")))?;
    let job = app.job(
        prompt.tokens,
        prompt.turn_boundary,
        &request.common,
        "messages",
    )?;
    let events = app.engine.submit(job)?;
    let schemas = (!request.tools.is_empty()).then(|| ToolSchemas::from_tools(&request.tools));
    let turn = ChatTurn::new(ChatOutputParser::new(prompt.thinking, schemas));
    let head = Head {
        id: new_id("chatcmpl-"),
        created: unix_time(),
        model: app.model_name.clone(),
    };
    if request.common.stream {
        let format = ChatStream {
            head,
            turn,
            include_usage: request.common.include_usage,
        };
        return Ok(sse_response(events, format));
    }
    collect(events, head, turn).await
}

/// What every response and chunk of one completion repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
}

/// The parsed state of one reply, fed by engine events.
struct ChatTurn {
    parser: ChatOutputParser,
    /// `call_…` ids, one per tool call, assigned as calls start.
    call_ids: Vec<String>,
}

enum TurnStep {
    Deltas(Vec<ChatDelta>),
    Finished(Vec<ChatDelta>, Outcome),
    Failed(String),
}

impl ChatTurn {
    fn new(parser: ChatOutputParser) -> Self {
        ChatTurn {
            parser,
            call_ids: Vec::new(),
        }
    }

    fn on_event(&mut self, event: WorkerEvent) -> TurnStep {
        match event {
            WorkerEvent::Engine(EngineEvent::Started { .. }) => TurnStep::Deltas(Vec::new()),
            WorkerEvent::Engine(EngineEvent::Text(text)) => {
                TurnStep::Deltas(self.parser.push(&text))
            }
            WorkerEvent::Done(outcome) => TurnStep::Finished(self.parser.finish(), outcome),
            WorkerEvent::Failed(message) => TurnStep::Failed(message),
        }
    }

    fn call_id(&mut self, index: usize) -> String {
        while self.call_ids.len() <= index {
            self.call_ids.push(new_id("call_"));
        }
        self.call_ids[index].clone()
    }

    fn finish_reason(&self, outcome: &Outcome) -> &'static str {
        match outcome.finish {
            Finish::Length => "length",
            _ if self.parser.tool_calls() > 0 => "tool_calls",
            _ => "stop",
        }
    }
}

async fn collect(
    mut events: UnboundedReceiver<WorkerEvent>,
    head: Head,
    mut turn: ChatTurn,
) -> ApiResult<Response> {
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut apply = |turn: &mut ChatTurn, deltas: Vec<ChatDelta>| {
        for delta in deltas {
            match delta {
                ChatDelta::Reasoning(t) => reasoning.push_str(&t),
                ChatDelta::Content(t) => content.push_str(&t),
                ChatDelta::ToolCallStart { index, name } => {
                    turn.call_id(index);
                    calls.push((name, String::new()));
                }
                ChatDelta::ToolCallArguments { index, fragment } => {
                    if let Some(call) = calls.get_mut(index) {
                        call.1.push_str(&fragment);
                    }
                }
            }
        }
    };
    while let Some(event) = events.recv().await {
        match turn.on_event(event) {
            TurnStep::Deltas(deltas) => apply(&mut turn, deltas),
            TurnStep::Failed(message) => return Err(ApiError::internal(message)),
            TurnStep::Finished(deltas, outcome) => {
                apply(&mut turn, deltas);
                let tool_calls: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, (name, arguments))| {
                        json!({"id": turn.call_id(i), "type": "function",
                               "function": {"name": name, "arguments": arguments}})
                    })
                    .collect();
                let mut message = json!({
                    "role": "assistant",
                    // null, not "", beside tool calls or reasoning, as OpenAI-style servers answer.
                    "content": (!content.is_empty() || (tool_calls.is_empty() && reasoning.is_empty()))
                        .then_some(&content),
                    "reasoning_content": (!reasoning.is_empty()).then_some(&reasoning),
                });
                if !tool_calls.is_empty() {
                    message["tool_calls"] = tool_calls.into();
                }
                let body = json!({
                    "id": head.id, "object": "chat.completion", "created": head.created,
                    "model": head.model,
                    "choices": [{"index": 0, "message": message, "logprobs": null,
                                 "finish_reason": turn.finish_reason(&outcome)}],
                    "usage": outcome_usage(&outcome),
                });
                return Ok(Json(body).into_response());
            }
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

struct ChatStream {
    head: Head,
    turn: ChatTurn,
    include_usage: bool,
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        let mut chunk = json!({
            "id": self.head.id, "object": "chat.completion.chunk", "created": self.head.created,
            "model": self.head.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null,
                         "finish_reason": finish_reason}],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    fn delta_chunks(&mut self, deltas: Vec<ChatDelta>) -> Vec<Value> {
        let mut chunks = Vec::new();
        for delta in deltas {
            let delta = match delta {
                ChatDelta::Reasoning(t) => json!({"reasoning_content": t}),
                ChatDelta::Content(t) => json!({"content": t}),
                ChatDelta::ToolCallStart { index, name } => json!({"tool_calls": [{
                    "index": index, "id": self.turn.call_id(index), "type": "function",
                    "function": {"name": name, "arguments": ""}}]}),
                ChatDelta::ToolCallArguments { index, fragment } => json!({"tool_calls": [{
                    "index": index, "function": {"arguments": fragment}}]}),
            };
            chunks.push(self.chunk(delta, None));
        }
        chunks
    }
}

impl StreamFormat for ChatStream {
    fn opening(&mut self) -> Vec<Value> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), None)]
    }

    fn on_event(&mut self, event: WorkerEvent) -> Step {
        match self.turn.on_event(event) {
            TurnStep::Deltas(deltas) => Step {
                chunks: self.delta_chunks(deltas),
                done: false,
            },
            TurnStep::Failed(message) => Step {
                chunks: vec![ApiError::internal(message).body()],
                done: true,
            },
            TurnStep::Finished(deltas, outcome) => {
                let mut chunks = self.delta_chunks(deltas);
                let reason = self.turn.finish_reason(&outcome);
                chunks.push(self.chunk(json!({}), Some(reason)));
                if self.include_usage {
                    chunks.push(json!({
                        "id": self.head.id, "object": "chat.completion.chunk",
                        "created": self.head.created, "model": self.head.model,
                        "choices": [], "usage": outcome_usage(&outcome),
                    }));
                }
                Step { chunks, done: true }
            }
        }
    }
}

#[cfg(test)]
mod tests;
