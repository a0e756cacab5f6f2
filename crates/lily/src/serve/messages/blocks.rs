//! A reply as Anthropic content blocks: the parser's reasoning, answer and tool-call deltas
//! become `thinking`, `text` and `tool_use` blocks, each opened, filled and closed as the
//! stream events `content_block_start`, `content_block_delta` and `content_block_stop` say.

use std::sync::Arc;

use lily_chat::{ChatDelta, ChatOutputParser, TextModel};
use serde_json::{Map, Value, json};

use crate::serve::engine::{EngineEvent, Finish, Outcome};
use crate::serve::ids::new_id;
use crate::serve::stream::{Reply, Step, StreamFormat};
use crate::serve::worker::WorkerEvent;

pub struct MessageHead {
    pub id: String,
    pub model: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Thinking,
    Text,
    ToolUse,
}

struct Block {
    kind: Kind,
    /// The thinking, the text, or the tool input's JSON as it streamed.
    body: String,
    /// `toolu_…` and the tool's name, for a `tool_use` block.
    id: String,
    name: String,
}

pub struct Blocks {
    parser: ChatOutputParser,
    text: Arc<TextModel>,
    stop: Vec<String>,
    blocks: Vec<Block>,
    /// The last block still takes deltas.
    open: bool,
    cached_tokens: usize,
}

impl Blocks {
    pub fn new(parser: ChatOutputParser, text: Arc<TextModel>, stop: Vec<String>) -> Self {
        Blocks {
            parser,
            text,
            stop,
            blocks: Vec::new(),
            open: false,
            cached_tokens: 0,
        }
    }

    fn close(&mut self) -> Option<Value> {
        let was_open = std::mem::replace(&mut self.open, false);
        let index = self.blocks.len().checked_sub(1)?;
        was_open.then(|| json!({"type": "content_block_stop", "index": index}))
    }

    /// Opens a block of `kind` unless the open one is of that kind already.
    fn open(&mut self, kind: Kind, name: &str, events: &mut Vec<Value>) {
        if self.open && self.blocks.last().is_some_and(|b| b.kind == kind) && kind != Kind::ToolUse
        {
            return;
        }
        events.extend(self.close());
        let block = Block {
            kind,
            body: String::new(),
            id: if kind == Kind::ToolUse {
                new_id("toolu_")
            } else {
                String::new()
            },
            name: name.to_string(),
        };
        let start = match kind {
            Kind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Kind::Text => json!({"type": "text", "text": ""}),
            Kind::ToolUse => json!({"type": "tool_use", "id": block.id, "name": name, "input": {}}),
        };
        self.blocks.push(block);
        self.open = true;
        events.push(
            json!({"type": "content_block_start", "index": self.blocks.len() - 1,
                           "content_block": start}),
        );
    }

    fn apply(&mut self, delta: ChatDelta) -> Vec<Value> {
        let mut events = Vec::new();
        let (kind, piece) = match delta {
            ChatDelta::Reasoning(t) => (Kind::Thinking, t),
            ChatDelta::Content(t) => (Kind::Text, t),
            ChatDelta::ToolCallStart { name, .. } => {
                self.open(Kind::ToolUse, &name, &mut events);
                return events;
            }
            ChatDelta::ToolCallArguments { fragment, .. } => (Kind::ToolUse, fragment),
        };
        if piece.is_empty() {
            return events;
        }
        if kind == Kind::ToolUse {
            // Arguments belong to the call that started last; without one there is nothing.
            if !self.open || self.blocks.last().is_none_or(|b| b.kind != Kind::ToolUse) {
                return events;
            }
        } else {
            self.open(kind, "", &mut events);
        }
        let index = self.blocks.len() - 1;
        let delta = match kind {
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": piece}),
            Kind::Text => json!({"type": "text_delta", "text": piece}),
            Kind::ToolUse => json!({"type": "input_json_delta", "partial_json": piece}),
        };
        if let Some(block) = self.blocks.last_mut() {
            block.body.push_str(&piece);
        }
        events.push(json!({"type": "content_block_delta", "index": index, "delta": delta}));
        events
    }

    /// `stop_reason` and `stop_sequence`.
    fn stop_reason(&self, outcome: &Outcome) -> (&'static str, Option<String>) {
        match outcome.finish() {
            Finish::Length => ("max_tokens", None),
            _ if self.blocks.iter().any(|b| b.kind == Kind::ToolUse) => ("tool_use", None),
            _ => {
                // A stop string ends the output where it begins, so the whole decoded output
                // holds it only if it was what stopped it.
                let output = self.text.tokenizer.decode(outcome.tokens());
                let matched = self
                    .stop
                    .iter()
                    .filter_map(|s| output.find(s.as_str()).map(|at| (at, s)))
                    .min();
                match matched {
                    Some((_, stop)) => ("stop_sequence", Some(stop.clone())),
                    None => ("end_turn", None),
                }
            }
        }
    }

    fn usage(&self, outcome: &Outcome) -> Value {
        json!({
            "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
            "output_tokens": outcome.completion_tokens(),
            "cache_read_input_tokens": outcome.cached_tokens,
            "cache_creation_input_tokens": 0,
        })
    }

    /// The whole message, for a response that is not streamed.
    pub fn message(&self, head: &MessageHead, outcome: &Outcome) -> Value {
        let content: Vec<Value> = self
            .blocks
            .iter()
            .map(|b| match b.kind {
                Kind::Thinking => json!({"type": "thinking", "thinking": b.body, "signature": ""}),
                Kind::Text => json!({"type": "text", "text": b.body}),
                Kind::ToolUse => {
                    let input = serde_json::from_str::<Value>(&b.body)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or(Value::Object(Map::new()));
                    json!({"type": "tool_use", "id": b.id, "name": b.name, "input": input})
                }
            })
            .collect();
        let (reason, sequence) = self.stop_reason(outcome);
        json!({
            "id": head.id, "type": "message", "role": "assistant", "model": head.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": self.usage(outcome),
        })
    }
}

/// Anthropic's event stream: `message_start` once the prompt is in, the blocks' events, then
/// `message_delta` (the stop reason and usage) and `message_stop`.
pub struct MessagesStream {
    head: MessageHead,
    blocks: Blocks,
}

impl MessagesStream {
    pub fn new(head: MessageHead, blocks: Blocks) -> Self {
        MessagesStream { head, blocks }
    }
}

impl StreamFormat for MessagesStream {
    fn opening(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn on_event(&mut self, event: WorkerEvent) -> Step {
        match event {
            WorkerEvent::Engine(event) => {
                let mut chunks = Vec::new();
                if let EngineEvent::Started {
                    prompt_tokens,
                    cached_tokens,
                    ..
                } = &event
                {
                    chunks.push(json!({"type": "message_start", "message": {
                        "id": self.head.id, "type": "message", "role": "assistant",
                        "model": self.head.model, "content": [], "stop_reason": null,
                        "stop_sequence": null,
                        "usage": {"input_tokens": prompt_tokens - cached_tokens,
                                  "output_tokens": 0, "cache_read_input_tokens": cached_tokens,
                                  "cache_creation_input_tokens": 0}}}));
                }
                chunks.extend(self.blocks.on_engine_event(event));
                Step {
                    chunks,
                    done: false,
                }
            }
            WorkerEvent::Failed(message) => Step {
                chunks: vec![json!({"type": "error",
                                    "error": {"type": "api_error", "message": message}})],
                done: true,
            },
            WorkerEvent::Done(outcome) => {
                let mut chunks = self.blocks.finish();
                let (reason, sequence) = self.blocks.stop_reason(&outcome);
                chunks.push(json!({"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": outcome.completion_tokens()}}));
                chunks.push(json!({"type": "message_stop"}));
                Step { chunks, done: true }
            }
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

impl Reply for Blocks {
    /// The stream events for what the engine produced.
    fn on_engine_event(&mut self, event: EngineEvent) -> Vec<Value> {
        match event {
            EngineEvent::Started { cached_tokens, .. } => {
                self.cached_tokens = cached_tokens;
                Vec::new()
            }
            EngineEvent::Text { text, .. } => {
                let deltas = self.parser.push(&text);
                deltas.into_iter().flat_map(|d| self.apply(d)).collect()
            }
        }
    }

    /// The events for the parser's last deltas, and the open block's end.
    fn finish(&mut self) -> Vec<Value> {
        let deltas = self.parser.finish();
        let mut events: Vec<Value> = deltas.into_iter().flat_map(|d| self.apply(d)).collect();
        events.extend(self.close());
        events
    }
}
