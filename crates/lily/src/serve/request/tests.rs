use serde_json::json;

use super::*;

fn defaults() -> SamplingDefaults {
    SamplingDefaults::for_model(None).unwrap()
}

fn body(value: Value) -> Map<String, Value> {
    value.as_object().unwrap().clone()
}

fn chat(value: Value) -> ApiResult<ChatRequest> {
    parse_chat(&body(value), &defaults(), true)
}

#[test]
fn a_typical_client_request_is_read_and_unknown_fields_are_ignored() {
    let request = chat(json!({
        "model": "m", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "Hi", "name": "ann"},
            {"role": "assistant", "content": null, "reasoning_content": "hmm",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
        "max_completion_tokens": 50, "temperature": 0, "top_k": -1, "seed": -3, "stop": "END",
        "stream": true, "stream_options": {"include_usage": true}, "n": 1,
        "presence_penalty": 0.0, "user": "x", "store": false, "parallel_tool_calls": true
    }))
    .unwrap();
    assert_eq!(
        request.messages[0],
        json!({"role": "system", "content": "Be brief."})
    );
    assert_eq!(
        request.messages[2],
        json!({"role": "assistant", "content": null, "reasoning_content": "hmm",
               "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": [2]}}}]})
    );
    // Argument keys keep the client's order, as the template prints them.
    let args = request.messages[2]["tool_calls"][0]["function"]["arguments"]
        .as_object()
        .unwrap();
    assert_eq!(args.keys().collect::<Vec<_>>(), ["b", "a"]);
    let c = &request.common;
    assert_eq!(
        (c.max_tokens, c.stream, c.include_usage),
        (Some(50), true, true)
    );
    assert_eq!(c.stop, ["END"]);
    assert_eq!(
        (c.sampling.temperature, c.sampling.top_k, c.sampling.seed),
        (0.0, 0, (-3i64) as u64)
    );
    assert_eq!((c.sampling.top_p, c.sampling.min_p), (0.95, 0.0));
    assert_eq!(
        request.template_kwargs.get("enable_thinking"),
        Some(&json!(true))
    );
}

#[test]
fn defaults_apply_to_what_the_request_leaves_out() {
    let request = chat(
        json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                              "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .unwrap();
    let s = &request.common.sampling;
    assert_eq!((s.temperature, s.top_k, s.top_p), (1.0, 20, 0.95));
    assert_eq!(request.common.max_tokens, None);
    assert_eq!(
        request.template_kwargs.get("enable_thinking"),
        Some(&json!(false))
    );
    let off = parse_chat(
        &body(json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})),
        &defaults(),
        false,
    )
    .unwrap();
    assert_eq!(
        off.template_kwargs.get("enable_thinking"),
        Some(&json!(false))
    );
}

/// The error's param and a piece of its message.
fn rejects(value: Value, param: &str, says: &str) {
    let error = chat(value).unwrap_err();
    assert_eq!(error.status, axum::http::StatusCode::BAD_REQUEST);
    assert_eq!(error.param.as_deref(), Some(param), "{error:?}");
    assert!(
        error.message.contains(says),
        "{:?} does not say {says:?}",
        error.message
    );
}

#[test]
fn what_we_cannot_honour_is_a_400_naming_the_field() {
    let user = json!([{"role": "user", "content": "Hi"}]);
    rejects(
        json!({"model": "m", "messages": user, "n": 17}),
        "n",
        "from 1 to 16",
    );
    rejects(
        json!({"model": "m", "messages": user, "n": 0}),
        "n",
        "from 1 to 16",
    );
    rejects(
        json!({"model": "m", "messages": user, "temperature": 3}),
        "temperature",
        "[0, 2]",
    );
    rejects(
        json!({"model": "m", "messages": user, "top_p": 0}),
        "top_p",
        "(0, 1]",
    );
    rejects(
        json!({"model": "m", "messages": user, "top_k": 2.5}),
        "top_k",
        "positive integer",
    );
    rejects(
        json!({"model": "m", "messages": user, "max_tokens": 0}),
        "max_tokens",
        "at least 1",
    );
    rejects(
        json!({"model": "m", "messages": user, "stop": ["a", ""]}),
        "stop",
        "empty",
    );
    rejects(
        json!({"model": "m", "messages": user, "logprobs": 1}),
        "logprobs",
        "true or false",
    );
    rejects(
        json!({"model": "m", "messages": user, "logprobs": true, "top_logprobs": 21}),
        "top_logprobs",
        "0 to 20",
    );
    rejects(
        json!({"model": "m", "messages": user, "top_logprobs": 2}),
        "top_logprobs",
        "needs logprobs",
    );
    rejects(
        json!({"model": "m", "messages": user, "tool_choice": "required"}),
        "tool_choice",
        "no tools",
    );
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    rejects(
        json!({"model": "m", "messages": user, "tools": tools, "tool_choice": "required",
               "response_format": {"type": "json_object"}}),
        "response_format",
        "not supported",
    );
    rejects(
        json!({"model": "m", "messages": user, "tool_choice": "always"}),
        "tool_choice",
        "not one of",
    );
    rejects(
        json!({"model": "m", "messages": user, "response_format": {"type": "json_schema"}}),
        "response_format.json_schema",
        "is required",
    );
    rejects(
        json!({"model": "m", "messages": user,
               "response_format": {"type": "json_schema", "json_schema": {"schema": true}}}),
        "response_format.json_schema.schema",
        "an object",
    );
    rejects(
        json!({"model": "m", "messages": user, "response_format": {"type": "yaml"}}),
        "response_format.type",
        "not one of",
    );
    rejects(
        json!({"model": "m", "messages": user, "frequency_penalty": 2.5}),
        "frequency_penalty",
        "[-2, 2]",
    );
    rejects(
        json!({"model": "m", "messages": user, "presence_penalty": -3}),
        "presence_penalty",
        "[-2, 2]",
    );
    rejects(
        json!({"model": "m", "messages": user, "repetition_penalty": 0}),
        "repetition_penalty",
        "(0, 2]",
    );
    rejects(
        json!({"model": "m", "messages": user, "logit_bias": {"12": 101}}),
        "logit_bias.12",
        "[-100, 100]",
    );
    rejects(
        json!({"model": "m", "messages": user, "logit_bias": {"a": 1}}),
        "logit_bias.a",
        "token ids",
    );
    rejects(
        json!({"model": "m", "messages": user, "logit_bias": [1]}),
        "logit_bias",
        "object",
    );
    for (field, value) in [
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("modalities", json!(["text", "audio"])),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("web_search_options", json!({})),
    ] {
        let mut body = json!({"model": "m", "messages": user});
        body[field] = value;
        rejects(body, field, "not supported");
    }
    assert!(chat(json!({"model": "m", "messages": user, "modalities": ["text"]})).is_ok());
    rejects(json!({"model": "m", "messages": []}), "messages", "empty");
    rejects(json!({"messages": user}), "model", "required");
    rejects(
        json!({"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
        "messages[0].role",
        "robot",
    );
    rejects(
        json!({"model": "m", "messages": [{"role": "user"}]}),
        "messages[0].content",
        "required",
    );
    rejects(
        json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        "messages[0].content[0]",
        "text-only",
    );
    rejects(
        json!({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}),
        "messages[0].tool_calls[0].function.arguments",
        "JSON object",
    );
    rejects(
        json!({"model": "m", "messages": user, "chat_template_kwargs": {"enable_thinking": "yes"}}),
        "chat_template_kwargs.enable_thinking",
        "true or false",
    );
    rejects(
        json!({"model": "m", "messages": user, "tools": [{"type": "retrieval"}]}),
        "tools[0]",
        "function",
    );
}

#[test]
fn lists_a_request_may_send_are_bounded() {
    let user = json!({"role": "user", "content": "Hi"});
    let tool = json!({"type": "function", "function": {"name": "f"}});
    let messages = vec![user.clone(); MAX_MESSAGES];
    assert!(chat(json!({"model": "m", "messages": messages})).is_ok());
    let messages = vec![user.clone(); MAX_MESSAGES + 1];
    rejects(
        json!({"model": "m", "messages": messages}),
        "messages",
        "at most 10000 messages",
    );
    let tools = vec![tool.clone(); MAX_TOOLS];
    assert!(chat(json!({"model": "m", "messages": [user], "tools": tools})).is_ok());
    let tools = vec![tool; MAX_TOOLS + 1];
    rejects(
        json!({"model": "m", "messages": [user], "tools": tools}),
        "tools",
        "at most 128 tools",
    );
    rejects(
        json!({"model": "m", "messages": [user], "stop": vec!["x"; 17]}),
        "stop",
        "at most 16 stop strings",
    );
}

#[test]
fn bodies_that_are_not_json_objects_are_rejected() {
    assert!(
        parse_body(b"{\"model\": ")
            .unwrap_err()
            .message
            .contains("not valid JSON")
    );
    assert!(
        parse_body(b"[1]")
            .unwrap_err()
            .message
            .contains("JSON object")
    );
}

#[test]
fn completion_prompts_are_text_or_token_ids() {
    let parse = |v: Value| parse_completion(&body(v), &defaults());
    let text = parse(json!({"model": "m", "prompt": "Once"})).unwrap();
    assert_eq!(text.prompt, CompletionPrompt::Text("Once".into()));
    assert_eq!(text.common.max_tokens, Some(16));
    let ids = parse(json!({"model": "m", "prompt": [1, 2, 3]})).unwrap();
    assert_eq!(ids.prompt, CompletionPrompt::Tokens(vec![1, 2, 3]));
    let nested = parse(json!({"model": "m", "prompt": [[4, 5]]})).unwrap();
    assert_eq!(nested.prompt, CompletionPrompt::Tokens(vec![4, 5]));
    let batch = parse(json!({"model": "m", "prompt": ["a", "b"]})).unwrap_err();
    assert_eq!(batch.param.as_deref(), Some("prompt"));
    assert!(parse(json!({"model": "m", "prompt": [-1]})).is_err());
    let echo = parse(json!({"model": "m", "prompt": "x", "echo": true, "max_tokens": 0})).unwrap();
    assert!(echo.echo && echo.common.max_tokens == Some(0) && echo.logprobs.is_none());
    let error = parse(json!({"model": "m", "prompt": "x", "max_tokens": 0})).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("max_tokens"));
    assert_eq!(
        parse(json!({"model": "m", "prompt": "x", "logprobs": 3}))
            .unwrap()
            .logprobs,
        Some(3)
    );
    let error = parse(json!({"model": "m", "prompt": "x", "logprobs": 21})).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("logprobs"));
}

#[test]
fn penalties_choices_and_log_probabilities_are_read() {
    let user = json!([{"role": "user", "content": "Hi"}]);
    let request = chat(
        json!({"model": "m", "messages": user, "n": 3, "presence_penalty": 1.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"7": -100, "9": 2.5},
        "logprobs": true, "top_logprobs": 4}),
    )
    .unwrap();
    let p = &request.common.penalties;
    assert_eq!((p.presence, p.frequency, p.repetition), (1.5, -0.5, 1.1));
    let mut bias = p.logit_bias.clone();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, [(7, -100.0), (9, 2.5)]);
    assert_eq!((request.common.n, request.logprobs), (3, Some(4)));
    let plain = chat(json!({"model": "m", "messages": user, "logprobs": false})).unwrap();
    assert!(plain.common.penalties.is_none() && plain.logprobs.is_none());
    assert_eq!(plain.common.n, 1);
}

#[test]
fn reasoning_effort_none_turns_thinking_off_and_others_keep_it() {
    let user = json!([{"role": "user", "content": "Hi"}]);
    let thinking = |v: Value| chat(v).map(|r| r.template_kwargs["enable_thinking"].clone());
    let base = |effort: &str| json!({"model": "m", "messages": user, "reasoning_effort": effort});
    assert_eq!(thinking(base("none")).unwrap(), false);
    for effort in ["minimal", "low", "medium", "high"] {
        assert_eq!(thinking(base(effort)).unwrap(), true, "{effort}");
    }
    rejects(base("extreme"), "reasoning_effort", "not one of");
    let mut conflict = base("none");
    conflict["chat_template_kwargs"] = json!({"enable_thinking": true});
    rejects(conflict, "reasoning_effort", "contradicts");
    let request = chat(json!({"model": "m", "messages": user, "parallel_tool_calls": false}));
    assert!(!request.unwrap().parallel_tool_calls);
    rejects(
        json!({"model": "m", "messages": user, "parallel_tool_calls": "no"}),
        "parallel_tool_calls",
        "true or false",
    );
}
