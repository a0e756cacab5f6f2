//! Responses input items into template messages, and crafted model output into output items
//! and stream events (synthetic:tiny never calls a tool).

use super::items::{Items, ResponseHead, ResponsesStream};
use super::*;
use crate::serve::engine::{ChoiceOutcome, EngineEvent, Finish, Outcome};
use crate::serve::stream::StreamFormat;

fn parse(value: Value) -> ApiResult<ResponsesRequest> {
    let defaults = SamplingDefaults::for_model(None).unwrap();
    parse_responses_request(value.as_object().unwrap(), &defaults)
}

#[test]
fn input_items_become_the_messages_the_template_reads() {
    let request = parse(json!({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7,
        "reasoning": {"effort": "none"}, "parallel_tool_calls": false, "store": false,
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Rome?"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Roma\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ]}))
    .unwrap();
    assert_eq!(
        request.input,
        [
            json!({"role": "system", "content": "Use tools."}),
            json!({"role": "user", "content": "Weather in Rome?"}),
            json!({"role": "assistant", "content": "", "reasoning_content": "Call it.",
                   "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                   "arguments": {"city": "Roma"}}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}),
            json!({"role": "assistant", "content": "Sunny."}),
        ]
    );
    assert_eq!(request.instructions.as_deref(), Some("Be brief."));
    assert_eq!(request.common.max_tokens, Some(7));
    assert_eq!(request.thinking, Some(false));
    assert!(!request.parallel_tool_calls && !request.store);
    assert_eq!(
        request.tools,
        [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})
        ]
    );
}

#[test]
fn what_is_wrong_or_unsupported_is_a_400_naming_the_field() {
    for (request, param) in [
        (json!({"model": "m"}), "input"),
        (json!({"model": "m", "input": []}), "input"),
        (
            json!({"model": "m", "input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"model": "m", "input": "x", "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "file_search"}]}),
            "tools[0]",
        ),
        (
            json!({"model": "m", "input": "x", "text": {"format": {"type": "json_schema"}}}),
            "text.format.schema",
        ),
        (
            json!({"model": "m", "input": "x", "reasoning": {"effort": "max"}}),
            "reasoning.effort",
        ),
        (
            json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}),
            "input[0]",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
            "input[0].content[0]",
        ),
        (
            json!({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "[1]"}]}),
            "input[0].arguments",
        ),
    ] {
        let error = parse(request.clone()).err().expect("refused");
        assert_eq!(error.param.as_deref(), Some(param), "{request}");
    }
}

const REPLY: &[&str] = &[
    "Weather needs a tool.\n</thi",
    "nk>\n\nChecking.\n\n<tool_",
    "call>\n<function=get_weather>\n<parameter=city>\nRoma\n</param",
    "eter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nMilano\n</parameter>\n</function>\n</tool_call>",
];

fn items(single: bool) -> Items {
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}),
    ];
    Items::new(
        ChatOutputParser::new(true, Some(ToolSchemas::from_tools(&tools))),
        single,
        true,
    )
}

fn head(store: &Arc<ResponseStore>) -> ResponseHead {
    ResponseHead {
        id: "resp_1".into(),
        created_at: 7,
        model: "m".into(),
        echo: json!({"tools": []}),
        conversation: Some(vec![json!({"role": "user", "content": "Weather?"})]),
        store: store.clone(),
    }
}

fn events(finish: Finish) -> Vec<WorkerEvent> {
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
            finish,
            tokens: vec![1; 20],
        }],
        prompt_tokens: 30,
        cached_tokens: 10,
    }));
    events
}

#[tokio::test]
async fn a_reply_is_reasoning_message_and_function_call_items_and_is_stored() {
    for (single, calls) in [(false, 2), (true, 1)] {
        let store = Arc::new(ResponseStore::default());
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        for event in events(Finish::Stop) {
            sender.send(event).unwrap();
        }
        let response = answer(receiver, head(&store), items(single)).await.unwrap();
        let body: Value = serde_json::from_slice(
            &axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(body["status"], "completed");
        let output = body["output"].as_array().unwrap();
        assert_eq!(output.len(), 2 + calls, "{body}");
        assert_eq!(
            output[0]["content"],
            json!([{"type": "reasoning_text", "text": "Weather needs a tool."}])
        );
        // Asked for with include: the same text, which a stateless client hands back.
        assert_eq!(output[0]["encrypted_content"], "Weather needs a tool.");
        assert_eq!(output[1]["content"][0]["text"], "Checking.");
        assert_eq!(output[2]["name"], "get_weather");
        let arguments: Value =
            serde_json::from_str(output[2]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(arguments, json!({"city": "Roma"}));
        assert_eq!(body["usage"]["input_tokens_details"]["cached_tokens"], 10);
        // The conversation, with the reply as the template reads it, for the next turn.
        let kept = store.conversation("resp_1").unwrap();
        assert_eq!(kept[0], json!({"role": "user", "content": "Weather?"}));
        assert_eq!(kept[1]["reasoning_content"], "Weather needs a tool.");
        assert_eq!(kept[1]["content"], "Checking.");
        assert_eq!(kept[1]["tool_calls"].as_array().unwrap().len(), calls);
        assert_eq!(
            kept[1]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Roma"})
        );
    }
}

#[test]
fn the_stream_numbers_its_events_and_opens_and_closes_each_item() {
    let store = Arc::new(ResponseStore::default());
    let mut stream = ResponsesStream::new(head(&store), items(false));
    let mut chunks = stream.opening();
    for event in events(Finish::Length) {
        chunks.extend(stream.on_event(event).chunks);
    }
    assert!(!stream.done_marker());
    let sequence: Vec<u64> = chunks
        .iter()
        .map(|c| c["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(sequence, (0..chunks.len() as u64).collect::<Vec<_>>());
    let kinds: Vec<String> = chunks
        .iter()
        .map(|c| stream.event_name(c).unwrap())
        .collect();
    assert_eq!(&kinds[..2], ["response.created", "response.in_progress"]);
    assert_eq!(kinds.last().unwrap(), "response.incomplete");
    let last = chunks.last().unwrap();
    assert_eq!(
        last["response"]["incomplete_details"]["reason"],
        "max_output_tokens"
    );
    // Each item is added, filled and done before the next is added.
    let mut open = None;
    let mut added = Vec::new();
    for chunk in &chunks {
        let index = chunk["output_index"].as_u64();
        match chunk["type"].as_str().unwrap() {
            "response.output_item.added" => {
                assert_eq!(open, None);
                open = index;
                added.push(chunk["item"]["type"].as_str().unwrap().to_string());
            }
            "response.output_item.done" => {
                assert_eq!(index, open);
                open = None;
            }
            kind if kind.ends_with(".delta") => assert_eq!(index, open, "{chunk}"),
            _ => {}
        }
    }
    assert_eq!(
        added,
        ["reasoning", "message", "function_call", "function_call"]
    );
    let text: String = chunks
        .iter()
        .filter(|c| c["type"] == "response.output_text.delta")
        .filter_map(|c| c["delta"].as_str())
        .collect();
    assert_eq!(text, "Checking.");
}

#[test]
fn a_reasoning_item_gives_its_content_else_its_summary_else_its_encrypted_text() {
    let reasoning_of = |item: Value| {
        let request = parse(json!({"model": "m", "input": [item,
            {"role": "assistant", "content": "Done."}]}))
        .unwrap();
        request.input[0]["reasoning_content"].clone()
    };
    let content = json!([{"type": "reasoning_text", "text": "full"}]);
    let summary = json!([{"type": "summary_text", "text": "short"}]);
    assert_eq!(
        reasoning_of(json!({"type": "reasoning", "content": content, "summary": summary})),
        "full"
    );
    assert_eq!(
        reasoning_of(json!({"type": "reasoning", "summary": summary})),
        "short"
    );
    assert_eq!(
        reasoning_of(json!({"type": "reasoning", "summary": [], "encrypted_content": "kept"})),
        "kept"
    );
}
