//! Chunks and messages for crafted model output (synthetic:tiny never calls a tool).

use axum::body::to_bytes;
use serde_json::json;

use super::*;
use crate::serve::engine::ChoiceOutcome;

const REPLY: &[&str] = &[
    "Weather needs a tool.\n</thi",
    "nk>\n\nChecking.\n\n<tool_",
    "call>\n<function=get_weather>\n<parameter=city>\nRoma\n</param",
    "eter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
];

fn turn() -> ChatTurns {
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
    ];
    ChatTurns::new(true, Some(ToolSchemas::from_tools(&tools)), None)
}

fn head() -> Head {
    Head {
        id: "chatcmpl-1".into(),
        created: 7,
        model: "m".into(),
    }
}

fn events() -> Vec<WorkerEvent> {
    let mut events = vec![WorkerEvent::Engine(EngineEvent::Started {
        prompt_tokens: 30,
        cached_tokens: 10,
        prompt_logprobs: Vec::new(),
    })];
    events.extend(REPLY.iter().map(|t| {
        WorkerEvent::Engine(EngineEvent::Text {
            choice: 0,
            text: t.to_string(),
            logprobs: Vec::new(),
        })
    }));
    events.push(WorkerEvent::Done(Outcome {
        choices: vec![ChoiceOutcome {
            finish: Finish::Stop,
            tokens: vec![1; 25],
        }],
        prompt_tokens: 30,
        cached_tokens: 10,
    }));
    events
}

#[test]
fn streamed_chunks_carry_reasoning_content_and_tool_calls_by_index() {
    let mut stream = ChatStream {
        head: head(),
        turns: turn(),
        include_usage: true,
        n: 1,
    };
    let mut chunks = stream.opening();
    let mut done = false;
    for event in events() {
        let step = stream.on_event(event);
        chunks.extend(step.chunks);
        done = step.done;
    }
    assert!(done);
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).map(|choice| &choice["delta"]))
        .collect();
    assert_eq!(deltas[0], &json!({"role": "assistant", "content": ""}));
    assert_eq!(
        deltas[1],
        &json!({"reasoning_content": "Weather needs a tool."})
    );
    assert_eq!(deltas[2], &json!({"content": "Checking."}));
    let call_id = deltas[3]["tool_calls"][0]["id"].as_str().unwrap();
    assert!(call_id.starts_with("call_"));
    assert_eq!(
        deltas[3],
        &json!({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]})
    );
    let arguments: String = deltas[4..]
        .iter()
        .filter_map(|d| d["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&arguments).unwrap(),
        json!({"city": "Roma", "days": 2})
    );
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(finish["usage"], Value::Null);
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 30, "completion_tokens": 25, "total_tokens": 55,
               "prompt_tokens_details": {"cached_tokens": 10}})
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["id"] == "chatcmpl-1" && c["object"] == "chat.completion.chunk")
    );
}

#[tokio::test]
async fn a_whole_response_has_the_message_with_tool_calls() {
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
    for event in events() {
        sender.send(event).unwrap();
    }
    let response = collect(receiver, head(), turn()).await.unwrap();
    let body: Value =
        serde_json::from_slice(&to_bytes(response.into_body(), 1 << 20).await.unwrap()).unwrap();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["content"], "Checking.");
    assert_eq!(message["reasoning_content"], "Weather needs a tool.");
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments = call["function"]["arguments"].as_str().unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(arguments).unwrap(),
        json!({"city": "Roma", "days": 2})
    );
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 10);
}

#[tokio::test]
async fn without_parallel_tool_calls_only_the_first_call_is_returned() {
    let two_calls = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRoma\n</parameter>\n\
                     </function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n\
                     <parameter=city>\nMilano\n</parameter>\n</function>\n</tool_call>";
    // events() already holds one call (Roma, 2 days): three in all, or only that one.
    for (single, expected) in [(false, 3), (true, 1)] {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        let mut events = events();
        events.insert(
            events.len() - 1,
            WorkerEvent::Engine(EngineEvent::Text {
                choice: 0,
                text: format!("\n{two_calls}"),
                logprobs: Vec::new(),
            }),
        );
        for event in events {
            sender.send(event).unwrap();
        }
        let mut turns = turn();
        turns.single_tool_call = single;
        let response = collect(receiver, head(), turns).await.unwrap();
        let body: Value =
            serde_json::from_slice(&to_bytes(response.into_body(), 1 << 20).await.unwrap())
                .unwrap();
        let calls = body["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap();
        assert_eq!(calls.len(), expected, "{body}");
        let arguments = calls[0]["function"]["arguments"].as_str().unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(arguments).unwrap(),
            json!({"city": "Roma", "days": 2})
        );
    }
}
