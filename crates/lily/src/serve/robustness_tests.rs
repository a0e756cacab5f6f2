//! Randomised inputs, in process, for the parsers that see what clients send and what the model
//! writes: request bodies, conversations through the chat template, and streamed model output
//! through the reasoning/tool-call parser. Each must answer (Ok or an error), never panic. This
//! is no coverage-guided fuzzer (see docs/RELIABILITY.md); the seeds are fixed so that a
//! failure reproduces.

use std::panic::{AssertUnwindSafe, catch_unwind};

use lily_chat::{ChatOutputParser, TextModel, ToolSchemas};
use serde_json::{Map, Value, json};

use super::prompt::chat_prompt;
use super::request::{parse_body, parse_chat, parse_completion};
use super::sampling_defaults::SamplingDefaults;

/// xorshift64*: enough randomness for test inputs, with no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

const KEYS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "role",
    "content",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "include_usage",
    "tools",
    "tool_choice",
    "type",
    "function",
    "name",
    "arguments",
    "parameters",
    "tool_calls",
    "chat_template_kwargs",
    "enable_thinking",
    "n",
    "logprobs",
    "response_format",
    "text",
    "reasoning_content",
    "properties",
    "input",
    "instructions",
    "system",
    "max_output_tokens",
    "thinking",
    "input_schema",
    "stop_sequences",
    "tool_use_id",
    "call_id",
    "output",
    "output_config",
    "format",
    "effort",
    "reasoning",
    "previous_response_id",
    "tokens",
    "add_special",
    "with_pieces",
    "add_generation_prompt",
];

const STRINGS: &[&str] = &[
    "",
    "synthetic:tiny",
    "user",
    "assistant",
    "system",
    "tool",
    "developer",
    "function",
    "text",
    "auto",
    "none",
    "{}",
    "{\"city\": \"Roma\"}",
    "[1]",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "{{ raise_exception('x') }}",
    "{% if %}",
    "é🙂\u{0}",
    "get_weather",
    "object",
    "string",
    "integer",
    "tool_use",
    "tool_result",
    "thinking",
    "enabled",
    "disabled",
    "input_text",
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
];

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    let leaf = depth >= 4 || rng.below(3) == 0;
    match rng.below(if leaf { 5 } else { 7 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => json!(*rng.pick(&[0.0, -1.0, 1.0, 0.5, 2.5, 1e308, -1e308, 4294967296.0])),
        3 => json!(*rng.pick(&[0_i64, 1, 2, -1, 16, 248319, 1 << 40, i64::MIN, i64::MAX])),
        4 => Value::String(rng.pick(STRINGS).to_string()),
        5 => (0..rng.below(4))
            .map(|_| random_value(rng, depth + 1))
            .collect(),
        _ => Value::Object(
            (0..rng.below(5))
                .map(|_| (rng.pick(KEYS).to_string(), random_value(rng, depth + 1)))
                .collect(),
        ),
    }
}

fn no_panic(what: &str, input: &dyn std::fmt::Debug, run: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(run)).is_err() {
        panic!("{what} panicked on {input:?}");
    }
}

fn text() -> &'static TextModel {
    static TEXT: std::sync::OnceLock<TextModel> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| TextModel::embedded().expect("the built-in tokenizer and template"))
}

#[test]
fn random_bodies_never_panic_the_request_parsers() {
    let mut rng = Rng(0x5eed_0001);
    let defaults = SamplingDefaults::for_model(None).expect("built-in defaults");
    for _ in 0..20_000 {
        let mut body = Map::new();
        for _ in 0..rng.below(8) {
            body.insert(rng.pick(KEYS).to_string(), random_value(&mut rng, 0));
        }
        no_panic("parse_chat", &body, || {
            let _ = parse_chat(&body, &defaults, true);
        });
        no_panic("parse_completion", &body, || {
            let _ = parse_completion(&body, &defaults);
        });
        no_panic("parse_messages_request", &body, || {
            let _ = super::messages::parse_messages_request(&body, &defaults);
        });
        no_panic("parse_responses_request", &body, || {
            let _ = super::responses::parse_responses_request(&body, &defaults);
        });
        no_panic("tokenize", &body, || {
            let _ = super::tokenize::tokenize_body(text(), &body, true, 512);
            let _ = super::tokenize::detokenize_body(text(), &body, 248320);
        });
        let bytes: Vec<u8> = (0..rng.below(40)).map(|_| rng.next() as u8).collect();
        no_panic("parse_body", &bytes, || {
            let _ = parse_body(&bytes);
        });
    }
}

fn random_message(rng: &mut Rng) -> Value {
    let role = *rng.pick(&["system", "user", "assistant", "tool", "developer"]);
    let content = if rng.below(4) == 0 {
        random_value(rng, 2)
    } else {
        Value::String((0..rng.below(4)).map(|_| *rng.pick(STRINGS)).collect())
    };
    let mut message = json!({"role": role, "content": content});
    if role == "assistant" && rng.below(2) == 0 {
        let arguments = *rng.pick(&[
            "{}",
            "{\"city\": \"Roma\", \"days\": 2}",
            "",
            "{\"a\": [1]}",
        ]);
        message["tool_calls"] = json!([{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]);
        message["reasoning_content"] = json!(rng.pick(STRINGS));
    }
    message
}

#[test]
fn random_conversations_render_or_fail_cleanly() {
    let text = TextModel::embedded().expect("the built-in tokenizer and template");
    let defaults = SamplingDefaults::for_model(None).expect("built-in defaults");
    let mut rng = Rng(0x5eed_0002);
    let mut rendered = 0;
    for _ in 0..2_000 {
        let messages: Vec<Value> = (0..1 + rng.below(6))
            .map(|_| random_message(&mut rng))
            .collect();
        let tools: Vec<Value> = (0..rng.below(3))
            .map(|_| {
                json!({"type": "function", "function": {"name": rng.pick(STRINGS),
                "description": rng.pick(STRINGS), "parameters": random_value(&mut rng, 2)}})
            })
            .collect();
        let body = json!({"model": "m", "messages": messages, "tools": tools,
                          "chat_template_kwargs": {"enable_thinking": rng.below(2) == 0}});
        let Some(body) = body.as_object() else {
            unreachable!("built as an object");
        };
        let Ok(request) = parse_chat(body, &defaults, true) else {
            continue;
        };
        no_panic("chat_prompt", &request, || {
            let prompt = chat_prompt(
                &text,
                &request.messages,
                &request.tools,
                &request.template_kwargs,
            );
            rendered += usize::from(prompt.is_ok());
        });
    }
    // Most of them are valid conversations: the test must not pass by rejecting everything.
    assert!(rendered > 150, "only {rendered} conversations rendered");
    eprintln!("{rendered} of 2000 random conversations rendered");
}

const OUTPUT: &[&str] = &[
    "<think>",
    "</think>",
    "\n",
    "\n\n",
    "<tool_call>",
    "</tool_call>",
    "<function=get_weather>",
    "<function=",
    "<function=nope>",
    "</function>",
    "<parameter=city>",
    "<parameter=days>",
    "<parameter=",
    "</parameter>",
    "Roma",
    "2",
    "{\"a\": 1}",
    "<",
    ">",
    "</",
    "=",
    "é🙂",
    "text ",
    "<|im_end|>",
];

#[test]
fn random_model_output_never_panics_the_stream_parser() {
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
    ];
    let mut rng = Rng(0x5eed_0003);
    for _ in 0..20_000 {
        let output: String = (0..rng.below(30)).map(|_| *rng.pick(OUTPUT)).collect();
        // Cut into pieces at random character boundaries, as tokens arrive.
        let chars: Vec<char> = output.chars().collect();
        let mut pieces = Vec::new();
        let mut at = 0;
        while at < chars.len() {
            let len = 1 + rng.below(6);
            pieces.push(
                chars[at..(at + len).min(chars.len())]
                    .iter()
                    .collect::<String>(),
            );
            at += len;
        }
        let thinking = rng.below(2) == 0;
        let schemas = (rng.below(3) > 0).then(|| ToolSchemas::from_tools(&tools));
        no_panic("ChatOutputParser", &(thinking, &pieces), || {
            let mut parser = ChatOutputParser::new(thinking, schemas);
            for piece in &pieces {
                parser.push(piece);
            }
            parser.finish();
        });
    }
}
