//! A reply as Responses output items: the parser's reasoning, answer and tool-call deltas
//! become `reasoning`, `message` and `function_call` items, streamed as `response.*` events
//! with increasing `sequence_number`s.

use std::sync::Arc;

use lily_chat::{ChatDelta, ChatOutputParser};
use serde_json::{Map, Value, json};

use super::store::ResponseStore;
use crate::serve::engine::{EngineEvent, Finish, Outcome};
use crate::serve::ids::new_id;
use crate::serve::stream::{Reply, Step, StreamFormat};
use crate::serve::worker::WorkerEvent;

/// What the response object says besides its output.
pub struct ResponseHead {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    /// Request fields the response object repeats.
    pub echo: Value,
    /// With `store`: the conversation so far, which the reply completes and the store keeps.
    pub conversation: Option<Vec<Value>>,
    pub store: Arc<ResponseStore>,
}

impl ResponseHead {
    /// The response object; `None` while it is still being generated.
    pub fn response(&self, items: &Items, outcome: Option<&Outcome>) -> Value {
        let (status, incomplete) = match outcome.map(Outcome::finish) {
            None => ("in_progress", Value::Null),
            Some(Finish::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
            Some(_) => ("completed", Value::Null),
        };
        let mut response = json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "incomplete_details": incomplete, "error": null,
            "model": self.model, "output": if outcome.is_some() { items.output() } else { vec![] },
            "text": {"format": {"type": "text"}}, "metadata": {},
        });
        if let (Some(object), Some(echo)) = (response.as_object_mut(), self.echo.as_object()) {
            object.extend(echo.clone());
        }
        if let Some(outcome) = outcome {
            let output = outcome.completion_tokens();
            response["usage"] = json!({
                "input_tokens": outcome.prompt_tokens,
                "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": outcome.prompt_tokens + output,
            });
        }
        response
    }

    /// Stores the conversation with the reply, for a later `previous_response_id`.
    pub fn keep(&self, items: &Items) {
        if let Some(conversation) = &self.conversation {
            let mut conversation = conversation.clone();
            conversation.push(items.assistant_message());
            self.store.insert(self.id.clone(), conversation);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
    FunctionCall,
}

struct Item {
    kind: Kind,
    id: String,
    /// The reasoning, the text, or the call's arguments as they streamed.
    body: String,
    call_id: String,
    name: String,
}

pub struct Items {
    parser: ChatOutputParser,
    /// `parallel_tool_calls: false`: calls after the first are dropped.
    single_tool_call: bool,
    /// Reasoning items repeat their text as `encrypted_content` (it is not encrypted: a client
    /// that keeps no state only has to hand it back).
    encrypted_reasoning: bool,
    items: Vec<Item>,
    /// The last item still takes deltas.
    open: bool,
}

impl Items {
    pub fn new(
        parser: ChatOutputParser,
        single_tool_call: bool,
        encrypted_reasoning: bool,
    ) -> Self {
        Items {
            parser,
            single_tool_call,
            encrypted_reasoning,
            items: Vec::new(),
            open: false,
        }
    }

    fn item_json(&self, item: &Item, done: bool) -> Value {
        let status = if done { "completed" } else { "in_progress" };
        let body = if done { item.body.as_str() } else { "" };
        match item.kind {
            Kind::Reasoning => {
                let mut reasoning = json!({"type": "reasoning", "id": item.id, "summary": [],
                "content": if done { json!([{"type": "reasoning_text", "text": body}]) } else { json!([]) }});
                if self.encrypted_reasoning && done {
                    reasoning["encrypted_content"] = body.into();
                }
                reasoning
            }
            Kind::Message => json!({"type": "message", "id": item.id, "status": status,
                "role": "assistant",
                "content": if done { json!([text_part(body)]) } else { json!([]) }}),
            Kind::FunctionCall => json!({"type": "function_call", "id": item.id, "status": status,
                "call_id": item.call_id, "name": item.name, "arguments": body}),
        }
    }

    /// The items of a finished reply.
    pub fn output(&self) -> Vec<Value> {
        self.items.iter().map(|i| self.item_json(i, true)).collect()
    }

    /// The reply as the template reads it back in a later turn.
    pub fn assistant_message(&self) -> Value {
        let pick = |kind| -> String {
            self.items
                .iter()
                .filter(|i| i.kind == kind)
                .map(|i| i.body.as_str())
                .collect()
        };
        let mut message = json!({"role": "assistant", "content": pick(Kind::Message)});
        let reasoning = pick(Kind::Reasoning);
        if !reasoning.is_empty() {
            message["reasoning_content"] = reasoning.into();
        }
        let calls: Vec<Value> = self
            .items
            .iter()
            .filter(|i| i.kind == Kind::FunctionCall)
            .map(|i| {
                let arguments = serde_json::from_str::<Value>(&i.body)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or(Value::Object(Map::new()));
                json!({"type": "function", "function": {"name": i.name, "arguments": arguments}})
            })
            .collect();
        if !calls.is_empty() {
            message["tool_calls"] = calls.into();
        }
        message
    }

    fn close(&mut self) -> Vec<Value> {
        if !std::mem::replace(&mut self.open, false) {
            return Vec::new();
        }
        let Some(item) = self.items.last() else {
            return Vec::new();
        };
        let index = self.items.len() - 1;
        let mut events = Vec::new();
        let at = json!({"item_id": item.id, "output_index": index, "content_index": 0});
        let with = |kind: &str, extra: Value| {
            let mut event = at.clone();
            event["type"] = kind.into();
            if let (Some(e), Some(x)) = (event.as_object_mut(), extra.as_object()) {
                e.extend(x.clone());
            }
            event
        };
        match item.kind {
            Kind::Reasoning => {
                events.push(with(
                    "response.reasoning_text.done",
                    json!({"text": item.body}),
                ));
            }
            Kind::Message => {
                events.push(with(
                    "response.output_text.done",
                    json!({"text": item.body}),
                ));
                events.push(with(
                    "response.content_part.done",
                    json!({"part": text_part(&item.body)}),
                ));
            }
            Kind::FunctionCall => events.push(json!({
                "type": "response.function_call_arguments.done", "item_id": item.id,
                "output_index": index, "arguments": item.body})),
        }
        events.push(
            json!({"type": "response.output_item.done", "output_index": index,
                           "item": self.item_json(item, true)}),
        );
        events
    }

    fn open(&mut self, kind: Kind, name: &str) -> Vec<Value> {
        let mut events = self.close();
        let item = Item {
            kind,
            id: new_id(match kind {
                Kind::Reasoning => "rs_",
                Kind::Message => "msg_",
                Kind::FunctionCall => "fc_",
            }),
            body: String::new(),
            call_id: new_id("call_"),
            name: name.to_string(),
        };
        let index = self.items.len();
        events.push(
            json!({"type": "response.output_item.added", "output_index": index,
                           "item": self.item_json(&item, false)}),
        );
        if kind == Kind::Message {
            events.push(
                json!({"type": "response.content_part.added", "item_id": item.id,
                "output_index": index, "content_index": 0, "part": text_part("")}),
            );
        }
        self.items.push(item);
        self.open = true;
        events
    }

    fn apply(&mut self, delta: ChatDelta) -> Vec<Value> {
        let (kind, piece) = match delta {
            ChatDelta::Reasoning(t) => (Kind::Reasoning, t),
            ChatDelta::Content(t) => (Kind::Message, t),
            ChatDelta::ToolCallStart { index, name } => {
                if self.single_tool_call && index > 0 {
                    return Vec::new();
                }
                return self.open(Kind::FunctionCall, &name);
            }
            ChatDelta::ToolCallArguments { index, fragment } => {
                if self.single_tool_call && index > 0 {
                    return Vec::new();
                }
                (Kind::FunctionCall, fragment)
            }
        };
        let current = self.open && self.items.last().is_some_and(|i| i.kind == kind);
        if piece.is_empty() || (kind == Kind::FunctionCall && !current) {
            return Vec::new();
        }
        let mut events = if current {
            Vec::new()
        } else {
            self.open(kind, "")
        };
        let index = self.items.len() - 1;
        let Some(item) = self.items.last_mut() else {
            return events;
        };
        item.body.push_str(&piece);
        let kind = match kind {
            Kind::Reasoning => "response.reasoning_text.delta",
            Kind::Message => "response.output_text.delta",
            Kind::FunctionCall => "response.function_call_arguments.delta",
        };
        let mut event = json!({"type": kind, "item_id": item.id, "output_index": index,
                               "delta": piece});
        if kind != "response.function_call_arguments.delta" {
            event["content_index"] = 0.into();
        }
        events.push(event);
        events
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// `response.created` and `response.in_progress` once the prompt is in, the items' events, then
/// `response.completed` (or `response.incomplete`) with the whole response.
pub struct ResponsesStream {
    head: ResponseHead,
    items: Items,
    sequence: u64,
}

impl ResponsesStream {
    pub fn new(head: ResponseHead, items: Items) -> Self {
        ResponsesStream {
            head,
            items,
            sequence: 0,
        }
    }

    fn numbered(&mut self, events: Vec<Value>) -> Vec<Value> {
        events
            .into_iter()
            .map(|mut event| {
                event["sequence_number"] = self.sequence.into();
                self.sequence += 1;
                event
            })
            .collect()
    }
}

impl StreamFormat for ResponsesStream {
    fn opening(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn on_event(&mut self, event: WorkerEvent) -> Step {
        let (events, done) = match event {
            WorkerEvent::Engine(event) => {
                let mut events = Vec::new();
                if let EngineEvent::Started { .. } = event {
                    let response = self.head.response(&self.items, None);
                    events.push(json!({"type": "response.created", "response": response}));
                    events.push(json!({"type": "response.in_progress", "response": response}));
                }
                events.extend(self.items.on_engine_event(event));
                (events, false)
            }
            WorkerEvent::Failed(message) => (
                vec![
                    json!({"type": "error", "code": "server_error", "message": message,
                            "param": null}),
                ],
                true,
            ),
            WorkerEvent::Done(outcome) => {
                let mut events = self.items.finish();
                let response = self.head.response(&self.items, Some(&outcome));
                self.head.keep(&self.items);
                let kind = if outcome.finish() == Finish::Length {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                events.push(json!({"type": kind, "response": response}));
                (events, true)
            }
        };
        Step {
            chunks: self.numbered(events),
            done,
        }
    }

    fn event_name(&self, chunk: &Value) -> Option<String> {
        chunk
            .get("type")
            .and_then(Value::as_str)
            .map(str::to_string)
    }

    fn done_marker(&self) -> bool {
        false
    }
}

impl Reply for Items {
    /// The stream events (without sequence numbers) for what the engine produced.
    fn on_engine_event(&mut self, event: EngineEvent) -> Vec<Value> {
        match event {
            EngineEvent::Started { .. } => Vec::new(),
            EngineEvent::Text { text, .. } => {
                let deltas = self.parser.push(&text);
                deltas.into_iter().flat_map(|d| self.apply(d)).collect()
            }
        }
    }

    /// The events for the parser's last deltas, and the open item's end.
    fn finish(&mut self) -> Vec<Value> {
        let deltas = self.parser.finish();
        let mut events: Vec<Value> = deltas.into_iter().flat_map(|d| self.apply(d)).collect();
        events.extend(self.close());
        events
    }
}
