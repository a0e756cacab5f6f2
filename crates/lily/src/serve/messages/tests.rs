//! Anthropic requests into template messages, and crafted model output into content blocks
//! and stream events (synthetic:tiny never calls a tool).

use std::sync::{Arc, OnceLock};

use lily_chat::TextModel;

use super::blocks::{Blocks, MessageHead, MessagesStream};
use super::*;
use crate::serve::engine::{ChoiceOutcome, EngineEvent, Finish, Outcome};
use crate::serve::stream::StreamFormat;

fn text() -> Arc<TextModel> {
    static TEXT: OnceLock<Arc<TextModel>> = OnceLock::new();
    TEXT.get_or_init(|| Arc::new(TextModel::embedded().unwrap()))
        .clone()
}

fn parse(value: Value) -> ApiResult<MessagesRequest> {
    let defaults = SamplingDefaults::for_model(None).unwrap();
    parse_messages_request(value.as_object().unwrap(), &defaults)
}

#[test]
fn blocks_become_the_messages_the_template_reads() {
    let request = parse(json!({
    "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
    "thinking": {"type": "disabled"}, "stop_sequences": ["END"],
    "tools": [{"name": "get_weather", "description": "Weather.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Roma"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Sunny"}]},
            {"type": "text", "text": "Thanks."}]},
    ]}))
    .unwrap();
    assert_eq!(
        request.conversation.messages,
        [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Weather in Rome?"}),
            json!({"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                   "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                   "arguments": {"city": "Roma"}}}]}),
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}),
            json!({"role": "user", "content": "Thanks."}),
        ]
    );
    assert_eq!(
        request.conversation.tools[0]["function"]["parameters"]["properties"]["city"]["type"],
        "string"
    );
    assert_eq!(request.conversation.thinking, Some(false));
    assert_eq!(
        (request.common.max_tokens, request.common.stop.clone()),
        (Some(5), vec!["END".to_string()])
    );
    // The template renders the history (a tool result needs the call before it).
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), false.into());
    let c = &request.conversation;
    let prompt = chat_prompt(&text(), &c.messages, &c.tools, &kwargs).unwrap();
    let rendered = text().tokenizer.decode_with_special(&prompt.tokens);
    assert!(
        rendered.contains("<tool_response>\nSunny\n</tool_response>"),
        "{rendered}"
    );
}

#[test]
fn what_is_wrong_or_unsupported_is_a_400_naming_the_field() {
    let user = json!([{"role": "user", "content": "Hi"}]);
    for (request, param) in [
        (json!({"model": "m", "messages": user}), "max_tokens"),
        (
            json!({"model": "m", "max_tokens": 0, "messages": user}),
            "max_tokens",
        ),
        (json!({"max_tokens": 4, "messages": user}), "model"),
        (
            json!({"model": "m", "max_tokens": 4, "messages": []}),
            "messages",
        ),
        (
            json!({"model": "m", "max_tokens": 4, "messages": user, "temperature": 1.5}),
            "temperature",
        ),
        (
            json!({"model": "m", "max_tokens": 4, "messages": user, "tool_choice": {"type": "any"}}),
            "tool_choice",
        ),
        (
            json!({"model": "m", "max_tokens": 4, "messages": user,
                   "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}),
            "mcp_servers",
        ),
        (
            json!({"model": "m", "max_tokens": 4, "messages": user, "thinking": {"type": "on"}}),
            "thinking.type",
        ),
        (
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"model": "m", "max_tokens": 4, "messages": user,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "tools[0]",
        ),
    ] {
        let error = parse(request.clone()).err().expect("refused");
        assert_eq!(error.param.as_deref(), Some(param), "{request}");
        let body = anthropic_error_body(&error);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with(param)
        );
    }
}

#[test]
fn count_tokens_reads_the_conversation_a_message_would() {
    let body = json!({
        "model": "m", "system": "Be brief.", "thinking": {"type": "disabled"},
        "tools": [{"name": "get_weather", "description": "Weather.",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "messages": [{"role": "user", "content": "Weather in Rome?"}]});
    // No max_tokens: count_tokens takes none.
    let counted = parse_conversation(body.as_object().unwrap()).unwrap();
    let mut sent = body.clone();
    sent["max_tokens"] = 4.into();
    let message = parse(sent).unwrap().conversation;
    assert_eq!(counted.messages, message.messages);
    assert_eq!(counted.tools, message.tools);
    assert_eq!(counted.thinking, Some(false));
    assert_eq!(counted.messages.len(), 2, "{:?}", counted.messages);
    // What a message would refuse, counting refuses, naming the field.
    let user = json!([{"role": "user", "content": "Hi"}]);
    for (body, param) in [
        (json!({"model": "m"}), "messages"),
        (json!({"model": "m", "messages": []}), "messages"),
        (
            json!({"model": "m", "messages": user, "thinking": {"type": "on"}}),
            "thinking.type",
        ),
        (
            json!({"model": "m", "messages": user, "tool_choice": {"type": "any"}}),
            "tool_choice",
        ),
    ] {
        let error = parse_conversation(body.as_object().unwrap())
            .err()
            .expect("refused");
        assert_eq!(error.param.as_deref(), Some(param), "{body}");
    }
}

const REPLY: &[&str] = &[
    "Weather needs a tool.\n</thi",
    "nk>\n\nChecking.\n\n<tool_",
    "call>\n<function=get_weather>\n<parameter=city>\nRoma\n</param",
    "eter>\n</function>\n</tool_call>",
];

fn blocks(stop: &[&str]) -> Blocks {
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}),
    ];
    let parser = ChatOutputParser::new(true, Some(ToolSchemas::from_tools(&tools)));
    Blocks::new(parser, text(), stop.iter().map(|s| s.to_string()).collect())
}

fn events(reply: &[&str], finish: Finish, tokens: Vec<u32>) -> Vec<WorkerEvent> {
    let mut events = vec![WorkerEvent::Engine(EngineEvent::Started {
        prompt_tokens: 30,
        cached_tokens: 10,
        prompt_logprobs: Vec::new(),
    })];
    events.extend(reply.iter().map(|t| {
        WorkerEvent::Engine(EngineEvent::Text {
            choice: 0,
            text: t.to_string(),
            logprobs: Vec::new(),
        })
    }));
    events.push(WorkerEvent::Done(Outcome {
        choices: vec![ChoiceOutcome { finish, tokens }],
        prompt_tokens: 30,
        cached_tokens: 10,
    }));
    events
}

fn head() -> MessageHead {
    MessageHead {
        id: "msg_1".into(),
        model: "m".into(),
    }
}

#[tokio::test]
async fn a_reply_is_thinking_text_and_tool_use_blocks() {
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
    for event in events(REPLY, Finish::Stop, vec![1; 20]) {
        sender.send(event).unwrap();
    }
    let response = answer(receiver, head(), blocks(&[])).await.unwrap();
    let body: Value = serde_json::from_slice(
        &axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap(),
    )
    .unwrap();
    let content = body["content"].as_array().unwrap();
    assert_eq!(
        content[0],
        json!({"type": "thinking", "thinking": "Weather needs a tool.", "signature": ""})
    );
    assert_eq!(content[1], json!({"type": "text", "text": "Checking."}));
    assert_eq!(content[2]["type"], "tool_use");
    assert!(content[2]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(
        (content[2]["name"].clone(), content[2]["input"].clone()),
        (json!("get_weather"), json!({"city": "Roma"}))
    );
    assert_eq!(body["stop_reason"], "tool_use");
    assert_eq!(
        body["usage"],
        json!({"input_tokens": 20, "output_tokens": 20, "cache_read_input_tokens": 10,
               "cache_creation_input_tokens": 0})
    );
}

#[test]
fn the_stream_opens_fills_and_closes_each_block_in_order() {
    let mut stream = MessagesStream::new(head(), blocks(&[]));
    let mut chunks = stream.opening();
    let mut done = false;
    for event in events(REPLY, Finish::Stop, vec![1; 20]) {
        let step = stream.on_event(event);
        chunks.extend(step.chunks);
        done = step.done;
    }
    assert!(done && !stream.done_marker());
    let kinds: Vec<String> = chunks
        .iter()
        .map(|c| stream.event_name(c).unwrap())
        .collect();
    assert_eq!(kinds.first().map(String::as_str), Some("message_start"));
    assert_eq!(&kinds[kinds.len() - 2..], ["message_delta", "message_stop"]);
    // Each block: a start, deltas at its index, a stop, before the next starts.
    let mut open: Option<u64> = None;
    let mut started = Vec::new();
    for chunk in &chunks {
        let index = chunk["index"].as_u64();
        match chunk["type"].as_str().unwrap() {
            "content_block_start" => {
                assert_eq!(open, None, "{chunks:?}");
                open = index;
                started.push(chunk["content_block"]["type"].as_str().unwrap().to_string());
            }
            "content_block_delta" => assert_eq!(index, open),
            "content_block_stop" => {
                assert_eq!(index, open);
                open = None;
            }
            _ => {}
        }
    }
    assert_eq!(open, None);
    assert_eq!(started, ["thinking", "text", "tool_use"]);
    let input: String = chunks
        .iter()
        .filter_map(|c| c["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&input).unwrap(),
        json!({"city": "Roma"})
    );
    let last = &chunks[chunks.len() - 2];
    assert_eq!(last["delta"]["stop_reason"], "tool_use");
    assert_eq!(last["usage"]["output_tokens"], 20);
}

#[tokio::test]
async fn stop_reasons_name_the_stop_sequence_or_the_length() {
    let tokens = text().tokenizer.encode("Fine. END").unwrap();
    let reply = ["</think>\n\nFine. "];
    for (finish, stop, reason, sequence) in [
        (
            Finish::Stop,
            &["END", "Fi"][..],
            "stop_sequence",
            json!("Fi"),
        ),
        (Finish::Stop, &["NOPE"][..], "end_turn", Value::Null),
        (Finish::Length, &["END"][..], "max_tokens", Value::Null),
    ] {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        for event in events(&reply, finish, tokens.clone()) {
            sender.send(event).unwrap();
        }
        let response = answer(receiver, head(), blocks(stop)).await.unwrap();
        let body: Value = serde_json::from_slice(
            &axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (body["stop_reason"].clone(), body["stop_sequence"].clone()),
            (json!(reason), sequence)
        );
        assert_eq!(
            body["content"],
            json!([{"type": "text", "text": "Fine."}]),
            "{body}"
        );
    }
}
