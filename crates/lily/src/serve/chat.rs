//! `POST /v1/chat/completions`, streamed or not: reasoning goes to `reasoning_content`, the
//! answer to `content`, Qwen's XML tool calls to `tool_calls` with JSON arguments; `n` choices,
//! each parsed on its own, and log-probabilities when asked.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use lily_chat::{ChatDelta, ChatOutputParser, ToolSchemas};
use lily_core::logprobs::TokenLogprobs;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::constrained::{GrammarJob, compile_grammar};
use super::engine::{EngineEvent, Finish, Outcome};
use super::error::{ApiError, ApiResult};
use super::ids::{new_id, unix_time};
use super::logprobs::LogprobFormat;
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
    let output = request.output.clone();
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
    let mut job = app.job(
        prompt.tokens,
        prompt.turn_boundary,
        &request.common,
        "messages",
    )?;
    job.logprobs = request.logprobs;
    let grammar = output.map(|rule| GrammarJob {
        rule,
        tools: request.tools.clone(),
        parallel: request.parallel_tool_calls,
        thinking: prompt.thinking,
        format_param: "response_format",
    });
    job.grammar = compile_grammar(&app, grammar).await?;
    let events = app.engine.submit(job)?;
    let schemas = (!request.tools.is_empty()).then(|| ToolSchemas::from_tools(&request.tools));
    let logprobs = request
        .logprobs
        .map(|_| LogprobFormat::new(app.text.clone(), request.tokens_as_ids));
    let mut turns = ChatTurns::new(prompt.thinking, schemas, logprobs);
    turns.single_tool_call = !request.parallel_tool_calls;
    let head = Head {
        id: new_id("chatcmpl-"),
        created: unix_time(),
        model: app.model_name.clone(),
    };
    if request.common.stream {
        let format = ChatStream {
            head,
            turns,
            include_usage: request.common.include_usage,
            n: request.common.n,
        };
        return Ok(sse_response(events, format));
    }
    collect(events, head, turns).await
}

/// What every response and chunk of one completion repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
}

/// The parsed state of one choice's reply, fed by engine events.
struct ChatTurn {
    parser: ChatOutputParser,
    /// `call_…` ids, one per tool call, assigned as calls start.
    call_ids: Vec<String>,
}

impl ChatTurn {
    fn call_id(&mut self, index: usize) -> String {
        while self.call_ids.len() <= index {
            self.call_ids.push(new_id("call_"));
        }
        self.call_ids[index].clone()
    }

    fn finish_reason(&self, finish: Finish) -> &'static str {
        match finish {
            Finish::Length => "length",
            _ if self.parser.tool_calls() > 0 => "tool_calls",
            _ => "stop",
        }
    }
}

enum TurnStep {
    /// Deltas of one choice, and the log-probabilities of the tokens they came from.
    Deltas(usize, Vec<ChatDelta>, Vec<TokenLogprobs>),
    /// Every choice's last deltas, then the outcome.
    Finished(Vec<Vec<ChatDelta>>, Outcome),
    Failed(String),
}

/// Every choice of one request: a parser each, made as the choice first speaks.
struct ChatTurns {
    thinking: bool,
    schemas: Option<ToolSchemas>,
    logprobs: Option<LogprobFormat>,
    /// `parallel_tool_calls: false`: calls after a choice's first are dropped.
    single_tool_call: bool,
    turns: Vec<ChatTurn>,
}

impl ChatTurns {
    fn new(thinking: bool, schemas: Option<ToolSchemas>, logprobs: Option<LogprobFormat>) -> Self {
        ChatTurns {
            thinking,
            schemas,
            logprobs,
            single_tool_call: false,
            turns: Vec::new(),
        }
    }

    /// The deltas a client may see: with a single tool call allowed, none of a later call.
    fn allowed(&self, mut deltas: Vec<ChatDelta>) -> Vec<ChatDelta> {
        if self.single_tool_call {
            deltas.retain(|d| match d {
                ChatDelta::ToolCallStart { index, .. }
                | ChatDelta::ToolCallArguments { index, .. } => *index == 0,
                _ => true,
            });
        }
        deltas
    }

    fn turn(&mut self, choice: usize) -> &mut ChatTurn {
        while self.turns.len() <= choice {
            self.turns.push(ChatTurn {
                parser: ChatOutputParser::new(self.thinking, self.schemas.clone()),
                call_ids: Vec::new(),
            });
        }
        &mut self.turns[choice]
    }

    fn on_event(&mut self, event: WorkerEvent) -> TurnStep {
        match event {
            WorkerEvent::Engine(EngineEvent::Started { .. }) => {
                TurnStep::Deltas(0, Vec::new(), Vec::new())
            }
            WorkerEvent::Engine(EngineEvent::Text {
                choice,
                text,
                logprobs,
            }) => {
                let deltas = self.turn(choice).parser.push(&text);
                TurnStep::Deltas(choice, self.allowed(deltas), logprobs)
            }
            WorkerEvent::Done(outcome) => {
                let last = (0..outcome.choices.len())
                    .map(|c| {
                        let deltas = self.turn(c).parser.finish();
                        self.allowed(deltas)
                    })
                    .collect();
                TurnStep::Finished(last, outcome)
            }
            WorkerEvent::Failed(message) => TurnStep::Failed(message),
        }
    }

    fn logprobs(&self, logprobs: &[TokenLogprobs]) -> Value {
        match &self.logprobs {
            Some(format) => json!({"content": format.chat(logprobs)}),
            None => Value::Null,
        }
    }
}

/// One choice's whole message, built up from its deltas.
#[derive(Default)]
struct Message {
    reasoning: String,
    content: String,
    calls: Vec<(String, String)>,
    logprobs: Vec<TokenLogprobs>,
}

impl Message {
    fn apply(&mut self, turn: &mut ChatTurn, deltas: Vec<ChatDelta>) {
        for delta in deltas {
            match delta {
                ChatDelta::Reasoning(t) => self.reasoning.push_str(&t),
                ChatDelta::Content(t) => self.content.push_str(&t),
                ChatDelta::ToolCallStart { index, name } => {
                    turn.call_id(index);
                    self.calls.push((name, String::new()));
                }
                ChatDelta::ToolCallArguments { index, fragment } => {
                    if let Some(call) = self.calls.get_mut(index) {
                        call.1.push_str(&fragment);
                    }
                }
            }
        }
    }

    fn json(&self, turn: &mut ChatTurn) -> Value {
        let tool_calls: Vec<Value> = self
            .calls
            .iter()
            .enumerate()
            .map(|(i, (name, arguments))| {
                json!({"id": turn.call_id(i), "type": "function",
                       "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        let (content, reasoning) = (&self.content, &self.reasoning);
        let mut message = json!({
            "role": "assistant",
            // null, not "", beside tool calls or reasoning, as OpenAI-style servers answer.
            "content": (!content.is_empty() || (tool_calls.is_empty() && reasoning.is_empty()))
                .then_some(content),
            "reasoning_content": (!reasoning.is_empty()).then_some(reasoning),
        });
        if !tool_calls.is_empty() {
            message["tool_calls"] = tool_calls.into();
        }
        message
    }
}

fn message_at(messages: &mut Vec<Message>, choice: usize) -> &mut Message {
    while messages.len() <= choice {
        messages.push(Message::default());
    }
    &mut messages[choice]
}

async fn collect(
    mut events: UnboundedReceiver<WorkerEvent>,
    head: Head,
    mut turns: ChatTurns,
) -> ApiResult<Response> {
    let mut messages: Vec<Message> = Vec::new();
    while let Some(event) = events.recv().await {
        match turns.on_event(event) {
            TurnStep::Deltas(choice, deltas, logprobs) => {
                let message = message_at(&mut messages, choice);
                message.apply(turns.turn(choice), deltas);
                message.logprobs.extend(logprobs);
            }
            TurnStep::Failed(message) => return Err(ApiError::internal(message)),
            TurnStep::Finished(last, outcome) => {
                let mut choices = Vec::new();
                for (index, (deltas, result)) in last.into_iter().zip(&outcome.choices).enumerate()
                {
                    let message = message_at(&mut messages, index);
                    let turn = turns.turn(index);
                    message.apply(turn, deltas);
                    let body = message.json(turn);
                    let reason = turn.finish_reason(result.finish);
                    choices.push(json!({"index": index, "message": body,
                        "logprobs": turns.logprobs(&message.logprobs),
                        "finish_reason": reason}));
                }
                let body = json!({
                    "id": head.id, "object": "chat.completion", "created": head.created,
                    "model": head.model, "choices": choices, "usage": outcome_usage(&outcome),
                });
                return Ok(Json(body).into_response());
            }
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

struct ChatStream {
    head: Head,
    turns: ChatTurns,
    include_usage: bool,
    n: usize,
}

impl ChatStream {
    fn chunk(&self, index: usize, delta: Value, logprobs: Value, finish: Option<&str>) -> Value {
        let mut chunk = json!({
            "id": self.head.id, "object": "chat.completion.chunk", "created": self.head.created,
            "model": self.head.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// One chunk per delta; the log-probabilities ride on the first (or on an empty delta when
    /// the tokens released no text yet).
    fn delta_chunks(
        &mut self,
        choice: usize,
        deltas: Vec<ChatDelta>,
        logprobs: Vec<TokenLogprobs>,
    ) -> Vec<Value> {
        let mut logprobs = (!logprobs.is_empty()).then(|| self.turns.logprobs(&logprobs));
        let mut chunks = Vec::new();
        for delta in deltas {
            let turn = self.turns.turn(choice);
            let delta = match delta {
                ChatDelta::Reasoning(t) => json!({"reasoning_content": t}),
                ChatDelta::Content(t) => json!({"content": t}),
                ChatDelta::ToolCallStart { index, name } => json!({"tool_calls": [{
                    "index": index, "id": turn.call_id(index), "type": "function",
                    "function": {"name": name, "arguments": ""}}]}),
                ChatDelta::ToolCallArguments { index, fragment } => json!({"tool_calls": [{
                    "index": index, "function": {"arguments": fragment}}]}),
            };
            let lp = logprobs.take().unwrap_or(Value::Null);
            chunks.push(self.chunk(choice, delta, lp, None));
        }
        if let Some(lp) = logprobs {
            chunks.push(self.chunk(choice, json!({}), lp, None));
        }
        chunks
    }
}

impl StreamFormat for ChatStream {
    fn opening(&mut self) -> Vec<Value> {
        (0..self.n)
            .map(|i| {
                self.chunk(
                    i,
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    None,
                )
            })
            .collect()
    }

    fn on_event(&mut self, event: WorkerEvent) -> Step {
        match self.turns.on_event(event) {
            TurnStep::Deltas(choice, deltas, logprobs) => Step {
                chunks: self.delta_chunks(choice, deltas, logprobs),
                done: false,
            },
            TurnStep::Failed(message) => Step {
                chunks: vec![ApiError::internal(message).body()],
                done: true,
            },
            TurnStep::Finished(last, outcome) => {
                let mut chunks = Vec::new();
                for (index, (deltas, result)) in last.into_iter().zip(&outcome.choices).enumerate()
                {
                    chunks.extend(self.delta_chunks(index, deltas, Vec::new()));
                    let reason = self.turns.turn(index).finish_reason(result.finish);
                    chunks.push(self.chunk(index, json!({}), Value::Null, Some(reason)));
                }
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
