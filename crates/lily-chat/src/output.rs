//! Splits the model's streamed text into reasoning, answer and tool calls.
//!
//! Qwen3.6 writes `reasoning\n</think>\n\nanswer`, where the opening `<think>` is already in the
//! prompt, and tool calls as `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n
//! </function>\n</tool_call>`. Tags can arrive split over several chunks, so text that may be the
//! start of a tag is held until it is known. Whitespace is cut where the chat template cuts it
//! when it renders the turn back (around `</think>`, before `<tool_call>`), so the next turn's
//! prompt matches what was generated.

use serde_json::Value;

use crate::stop::partial_match_len;
use crate::tool_schema::ToolSchemas;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatDelta {
    Reasoning(String),
    Content(String),
    /// A tool call begins; its arguments follow as JSON text fragments.
    ToolCallStart {
        index: usize,
        name: String,
    },
    /// The next piece of a call's JSON arguments; the pieces of one call concatenate to an object.
    ToolCallArguments {
        index: usize,
        fragment: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
    ToolCall,
}

struct Call {
    index: usize,
    name: Option<String>,
    params: usize,
    closed: bool,
}

pub struct ChatOutputParser {
    mode: Mode,
    /// Text not yet classified.
    buf: String,
    /// At the start of a reasoning or content segment, where leading newlines are dropped.
    segment_start: bool,
    /// `None` when the request has no tools: `<tool_call>` is then ordinary text.
    tools: Option<ToolSchemas>,
    call: Option<Call>,
    calls: usize,
    out: Vec<ChatDelta>,
}

impl ChatOutputParser {
    /// `thinking`: the prompt opened `<think>`, so the output starts as reasoning.
    pub fn new(thinking: bool, tools: Option<ToolSchemas>) -> Self {
        ChatOutputParser {
            mode: if thinking {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            segment_start: true,
            tools,
            call: None,
            calls: 0,
            out: Vec::new(),
        }
    }

    /// Feeds the next piece of text; returns what it completes.
    pub fn push(&mut self, text: &str) -> Vec<ChatDelta> {
        self.buf.push_str(text);
        while self.step() {}
        std::mem::take(&mut self.out)
    }

    /// Ends the stream: held text that turned out not to be a tag is released, and an unfinished
    /// tool call is closed so that its arguments are still a JSON object.
    pub fn finish(&mut self) -> Vec<ChatDelta> {
        let rest = std::mem::take(&mut self.buf);
        match self.mode {
            Mode::Reasoning => self.emit_reasoning(rest.trim()),
            Mode::Content => self.emit_content(rest.trim_end()),
            Mode::ToolCall => match self.call.take() {
                Some(call) if call.name.is_some() && !call.closed => self.close_arguments(&call),
                Some(call) if call.name.is_some() => {}
                _ => self.emit_content(format!("{CALL_OPEN}{rest}").trim_end()),
            },
        }
        std::mem::take(&mut self.out)
    }

    /// How many tool calls the output started.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Makes as much progress as the buffer allows; false when it must wait for more text.
    fn step(&mut self) -> bool {
        match self.mode {
            Mode::Reasoning => self.step_reasoning(),
            Mode::Content => self.step_content(),
            Mode::ToolCall => self.step_tool_call(),
        }
    }

    fn step_reasoning(&mut self) -> bool {
        if self.segment_start {
            // The prompt opened the block; a model that opens it again is not saying anything.
            if self.buf.len() < THINK_OPEN.len() && THINK_OPEN.starts_with(self.buf.as_str()) {
                return false;
            }
            if let Some(rest) = self.buf.strip_prefix(THINK_OPEN) {
                self.buf = rest.to_string();
            }
            if !self.drop_leading(char::is_whitespace) {
                return false;
            }
        }
        if let Some(at) = self.buf.find(THINK_CLOSE) {
            let reasoning = self.buf[..at].trim_end().to_string();
            self.emit_reasoning(&reasoning);
            self.buf.drain(..at + THINK_CLOSE.len());
            self.mode = Mode::Content;
            self.segment_start = true;
            return true;
        }
        let ready = self.ready_len(&[THINK_CLOSE]);
        let text: String = self.buf.drain(..ready).collect();
        self.emit_reasoning(&text);
        false
    }

    fn step_content(&mut self) -> bool {
        if self.segment_start && !self.drop_leading(|c| c == '\n') {
            return false;
        }
        if self.tools.is_some()
            && let Some(at) = self.buf.find(CALL_OPEN)
        {
            let content = self.buf[..at].trim_end().to_string();
            self.emit_content(&content);
            self.buf.drain(..at + CALL_OPEN.len());
            self.mode = Mode::ToolCall;
            self.call = Some(Call {
                index: self.calls,
                name: None,
                params: 0,
                closed: false,
            });
            self.calls += 1;
            return true;
        }
        let tags: &[&str] = if self.tools.is_some() {
            &[CALL_OPEN]
        } else {
            &[]
        };
        let ready = self.ready_len(tags);
        let text: String = self.buf.drain(..ready).collect();
        self.emit_content(&text);
        false
    }

    fn step_tool_call(&mut self) -> bool {
        let Some(mut call) = self.call.take() else {
            self.mode = Mode::Content;
            return true;
        };
        let progressed = self.advance_call(&mut call);
        if self.mode == Mode::ToolCall {
            self.call = Some(call);
        }
        progressed
    }

    fn advance_call(&mut self, call: &mut Call) -> bool {
        let Some(name) = call.name.clone() else {
            let close = self.buf.find(CALL_CLOSE);
            let open = match self.buf.find(FUNCTION_OPEN) {
                Some(open) if close.is_none_or(|close| open < close) => open,
                _ => return self.unstructured_call_ends(call),
            };
            let start = open + FUNCTION_OPEN.len();
            let Some(end) = self.buf[start..].find('>') else {
                return false;
            };
            let name = self.buf[start..start + end].trim().to_string();
            self.buf.drain(..start + end + 1);
            self.out.push(ChatDelta::ToolCallStart {
                index: call.index,
                name: name.clone(),
            });
            call.name = Some(name);
            return true;
        };
        let skipped = self.buf.len() - self.buf.trim_start().len();
        let body_starts = |tag: &str| self.buf[skipped..].starts_with(tag);
        if !call.closed && body_starts(PARAM_OPEN) {
            return self.take_parameter(call, &name, skipped + PARAM_OPEN.len());
        }
        if !call.closed && (body_starts(FUNCTION_CLOSE) || body_starts(CALL_CLOSE)) {
            if body_starts(FUNCTION_CLOSE) {
                self.buf.drain(..skipped + FUNCTION_CLOSE.len());
            }
            self.close_arguments(call);
            call.closed = true;
            return true;
        }
        if call.closed && body_starts(CALL_CLOSE) {
            self.buf.drain(..skipped + CALL_CLOSE.len());
            self.mode = Mode::Content;
            self.segment_start = true;
            return true;
        }
        let body = &self.buf[skipped..];
        let tags = [PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE];
        if body.is_empty() || tags.iter().any(|t| t.starts_with(body)) {
            return false;
        }
        // Stray text inside a call block is not part of any argument: skip to the next tag.
        let first = body.chars().next().map_or(0, char::len_utf8);
        let skip = body[first..].find('<').map_or(body.len(), |i| i + first);
        self.buf.drain(..skipped + skip);
        true
    }

    /// Parses `NAME>\nVALUE\n</parameter>` from `start` once it is complete.
    fn take_parameter(&mut self, call: &mut Call, function: &str, start: usize) -> bool {
        let Some(name_len) = self.buf[start..].find('>') else {
            return false;
        };
        let param = self.buf[start..start + name_len].trim().to_string();
        let value_start = start + name_len + 1;
        let Some(value_len) = self.buf[value_start..].find(PARAM_CLOSE) else {
            return false;
        };
        let raw = &self.buf[value_start..value_start + value_len];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = match &self.tools {
            Some(schemas) => schemas.convert(function, &param, raw),
            None => Value::String(raw.to_string()),
        };
        let separator = if call.params == 0 { "{" } else { "," };
        let fragment = format!("{separator}{}:{value}", Value::String(param));
        self.out.push(ChatDelta::ToolCallArguments {
            index: call.index,
            fragment,
        });
        call.params += 1;
        self.buf
            .drain(..value_start + value_len + PARAM_CLOSE.len());
        true
    }

    /// A `<tool_call>` block without a `<function=…>` is not a call: it stays text.
    fn unstructured_call_ends(&mut self, call: &Call) -> bool {
        let Some(end) = self.buf.find(CALL_CLOSE) else {
            return false;
        };
        let raw = format!("{CALL_OPEN}{}", &self.buf[..end + CALL_CLOSE.len()]);
        self.emit_content(&raw);
        self.buf.drain(..end + CALL_CLOSE.len());
        self.calls = call.index;
        self.mode = Mode::Content;
        self.segment_start = false;
        true
    }

    fn close_arguments(&mut self, call: &Call) {
        let fragment = if call.params == 0 { "{}" } else { "}" };
        self.out.push(ChatDelta::ToolCallArguments {
            index: call.index,
            fragment: fragment.to_string(),
        });
    }

    /// Drops leading characters matching `pred`; false if nothing else is buffered yet.
    fn drop_leading(&mut self, pred: impl Fn(char) -> bool) -> bool {
        let kept = self.buf.trim_start_matches(pred).len();
        self.buf.drain(..self.buf.len() - kept);
        if self.buf.is_empty() {
            return false;
        }
        self.segment_start = false;
        true
    }

    /// How much of the buffer can be released: all but a possible partial tag and the whitespace
    /// before it, which is cut if a tag follows.
    fn ready_len(&self, tags: &[&str]) -> usize {
        let partial = partial_match_len(&self.buf, tags);
        let before = &self.buf[..self.buf.len() - partial];
        before.trim_end().len()
    }

    fn emit_reasoning(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.out.last_mut() {
            Some(ChatDelta::Reasoning(prev)) => prev.push_str(text),
            _ => self.out.push(ChatDelta::Reasoning(text.to_string())),
        }
    }

    fn emit_content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.out.last_mut() {
            Some(ChatDelta::Content(prev)) => prev.push_str(text),
            _ => self.out.push(ChatDelta::Content(text.to_string())),
        }
    }
}

#[cfg(test)]
mod tests;
