//! `POST /v1/responses`, OpenAI's Responses API, on the engine chat uses: `input` items
//! (messages, function calls and their outputs, reasoning) and `instructions` become the
//! messages the chat template reads; the reply is parsed into output items (`items`).
//! `previous_response_id` continues a stored conversation: its messages are rendered again, so
//! the prompt starts with the tokens of the previous turn and the snapshot cache supplies them.

mod items;
mod store;

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use lily_chat::{ChatOutputParser, ToolSchemas};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use self::items::{Items, ResponseHead, ResponsesStream};
pub use self::store::ResponseStore;
use super::constrained::{
    GrammarJob, OutputRule, compile_grammar, output_rule, parse_format, parse_tool_choice,
};
use super::error::{ApiError, ApiResult};
use super::ids::{new_id, unix_time};
use super::prompt::chat_prompt;
use super::request::{CommonRequest, MAX_MESSAGES, MAX_TOOLS, parse_body, parse_common_fields};
use super::routes::{AppState, read_body};
use super::sampling_defaults::SamplingDefaults;
use super::stream::{collect, sse_response};
use super::worker::WorkerEvent;

pub async fn responses(State(app): State<Arc<AppState>>, body: Body) -> Response {
    handle(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(super) struct ResponsesRequest {
    common: CommonRequest,
    /// This request's input as template messages (without `instructions`).
    input: Vec<Value>,
    instructions: Option<String>,
    previous: Option<String>,
    tools: Vec<Value>,
    /// `text.format` or a forced `tool_choice`.
    output: Option<OutputRule>,
    thinking: Option<bool>,
    parallel_tool_calls: bool,
    store: bool,
    /// `include: ["reasoning.encrypted_content"]`: reasoning items carry their text there too.
    encrypted_reasoning: bool,
}

async fn handle(app: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let body = parse_body(&read_body(body, &app).await?)?;
    let request = parse_responses_request(&body, &app.defaults)?;
    app.check_model(&request.common.model)?;
    // The stored conversation, then this input: what the reply continues and what is stored.
    let mut conversation = match &request.previous {
        Some(id) => app.responses.conversation(id).ok_or_else(|| ApiError {
            status: axum::http::StatusCode::NOT_FOUND,
            ..ApiError::param(
                "previous_response_id",
                format!("no stored response has the id {id:?}"),
            )
        })?,
        None => Vec::new(),
    };
    conversation.extend(request.input.iter().cloned());
    let mut messages = Vec::new();
    if let Some(instructions) = &request.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(conversation.iter().cloned());
    let mut kwargs = Map::new();
    let thinking = request.thinking.unwrap_or(app.default_thinking);
    kwargs.insert("enable_thinking".into(), thinking.into());
    let (text, tools) = (app.text.clone(), request.tools.clone());
    let prompt =
        tokio::task::spawn_blocking(move || chat_prompt(&text, &messages, &tools, &kwargs))
            .await
            .map_err(|e| ApiError::internal(format!("rendering the prompt: {e}")))?
            .map_err(|e| ApiError::param("input", format!("{e:#}")))?;
    let mut job = app.job(
        prompt.tokens,
        prompt.turn_boundary,
        &request.common,
        "input",
    )?;
    let grammar = request.output.clone().map(|rule| GrammarJob {
        rule,
        tools: request.tools.clone(),
        parallel: request.parallel_tool_calls,
        thinking: prompt.thinking,
        format_param: "text.format",
    });
    job.grammar = compile_grammar(&app, grammar).await?;
    let events = app.engine.submit(job)?;
    let schemas = (!request.tools.is_empty()).then(|| ToolSchemas::from_tools(&request.tools));
    let items = Items::new(
        ChatOutputParser::new(prompt.thinking, schemas),
        !request.parallel_tool_calls,
        request.encrypted_reasoning,
    );
    let head = ResponseHead {
        id: new_id("resp_"),
        created_at: unix_time(),
        model: app.model_name.clone(),
        echo: json!({
            "instructions": request.instructions,
            "previous_response_id": request.previous,
            "tools": body.get("tools").cloned().unwrap_or(json!([])),
            "tool_choice": body.get("tool_choice").cloned().unwrap_or(json!("auto")),
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": request.common.sampling.temperature,
            "top_p": request.common.sampling.top_p,
            "max_output_tokens": request.common.max_tokens,
            "store": request.store,
        }),
        conversation: request.store.then_some(conversation),
        store: app.responses.clone(),
    };
    if request.common.stream {
        return Ok(sse_response(events, ResponsesStream::new(head, items)));
    }
    answer(events, head, items).await
}

/// The whole response of a request that does not stream, kept for `previous_response_id`.
async fn answer(
    events: UnboundedReceiver<WorkerEvent>,
    head: ResponseHead,
    items: Items,
) -> ApiResult<Response> {
    let (items, outcome) = collect(events, items).await?;
    let response = head.response(&items, Some(&outcome));
    head.keep(&items);
    Ok(Json(response).into_response())
}

pub(super) fn parse_responses_request(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> ApiResult<ResponsesRequest> {
    // The shared sampling fields under Responses' names; chat-only fields are unknown here.
    let mut common_body = body.clone();
    for chat_only in [
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stop",
        "logprobs",
    ] {
        common_body.remove(chat_only);
    }
    if let Some(max) = common_body.remove("max_output_tokens") {
        common_body.insert("max_tokens".into(), max);
    }
    let common = parse_common_fields(&common_body, defaults).map_err(|mut e| {
        if e.param.as_deref() == Some("max_tokens") {
            e.message = e.message.replacen("max_tokens", "max_output_tokens", 1);
            e.param = Some("max_output_tokens".into());
        }
        e
    })?;
    let string = |name: &str| match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::param(name, "must be a string")),
    };
    let flag = |name: &str, default: bool| match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::param(name, "must be true or false")),
    };
    if body
        .get("top_logprobs")
        .and_then(Value::as_u64)
        .is_some_and(|k| k > 0)
        || body
            .get("include")
            .and_then(Value::as_array)
            .is_some_and(|i| i.iter().any(|x| x == "message.output_text.logprobs"))
    {
        return Err(ApiError::unsupported(
            "top_logprobs",
            "log-probabilities on /v1/responses (chat and completions have them)",
        ));
    }
    if flag("background", false)? {
        return Err(ApiError::unsupported("background", "background responses"));
    }
    let format = parse_format(
        body.get("text").and_then(|t| t.get("format")),
        "text.format",
        true,
    )?;
    let thinking = match body.get("reasoning").and_then(|r| r.get("effort")) {
        None | Some(Value::Null) => None,
        Some(Value::String(e)) if e == "none" => Some(false),
        Some(Value::String(e)) if ["minimal", "low", "medium", "high"].contains(&e.as_str()) => {
            Some(true)
        }
        Some(_) => {
            return Err(ApiError::param(
                "reasoning.effort",
                "must be one of none, minimal, low, medium, high",
            ));
        }
    };
    let tools = parse_tools(body)?;
    let output = output_rule(
        format,
        &parse_tool_choice(body)?,
        !tools.is_empty(),
        "text.format",
    )?;
    let input = match body.get("input") {
        Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
        Some(Value::Array(items)) if items.len() > MAX_MESSAGES => {
            return Err(ApiError::param(
                "input",
                format!("at most {MAX_MESSAGES} items are allowed"),
            ));
        }
        Some(Value::Array(items)) if !items.is_empty() => input_messages(items)?,
        Some(Value::Array(_)) => return Err(ApiError::param("input", "must not be empty")),
        Some(_) => {
            return Err(ApiError::param(
                "input",
                "must be a string or a list of items",
            ));
        }
        None => return Err(ApiError::param("input", "is required")),
    };
    Ok(ResponsesRequest {
        common,
        input,
        instructions: string("instructions")?,
        previous: string("previous_response_id")?,
        tools,
        output,
        thinking,
        parallel_tool_calls: flag("parallel_tool_calls", true)?,
        store: flag("store", true)?,
        encrypted_reasoning: body
            .get("include")
            .and_then(Value::as_array)
            .is_some_and(|i| i.iter().any(|x| x == "reasoning.encrypted_content")),
    })
}

/// The text of a message's content: a string, or input/output text parts.
fn content_text(content: Option<&Value>, param: &str) -> ApiResult<String> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (k, part) in parts.iter().enumerate() {
                let at = format!("{param}[{k}]");
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => match part.get("text") {
                        Some(Value::String(t)) => text.push_str(t),
                        _ => return Err(ApiError::param(format!("{at}.text"), "must be a string")),
                    },
                    Some(kind) => {
                        return Err(ApiError::unsupported(
                            &at,
                            &format!("content of type {kind:?} (this server is text-only)"),
                        ));
                    }
                    None => return Err(ApiError::param(format!("{at}.type"), "is required")),
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::param(
            param,
            "must be a string or a list of text parts",
        )),
    }
}

/// Input items as template messages. A function call joins the assistant message before it
/// (or starts one); reasoning goes into the assistant message that follows it.
fn input_messages(items: &[Value]) -> ApiResult<Vec<Value>> {
    let mut out: Vec<Value> = Vec::new();
    let mut reasoning = String::new();
    // Whether the last message is an assistant turn this input's items are still building.
    let mut open_assistant = false;
    for (i, item) in items.iter().enumerate() {
        let at = |field: &str| format!("input[{i}].{field}");
        let kind = item.get("type").and_then(Value::as_str);
        match kind {
            None | Some("message") => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("system" | "developer") => "system",
                    Some(role @ ("user" | "assistant")) => role,
                    Some(other) => {
                        return Err(ApiError::param(
                            at("role"),
                            format!("{other:?} is not one of system, developer, user, assistant"),
                        ));
                    }
                    None => return Err(ApiError::param(at("role"), "is required")),
                };
                let text = content_text(item.get("content"), &at("content"))?;
                let mut message = json!({"role": role, "content": text});
                if role == "assistant" && !reasoning.is_empty() {
                    message["reasoning_content"] = std::mem::take(&mut reasoning).into();
                }
                open_assistant = role == "assistant";
                out.push(message);
            }
            Some("reasoning") => reasoning.push_str(&reasoning_text(item)),
            Some("function_call") => {
                let Some(name) = item.get("name").and_then(Value::as_str) else {
                    return Err(ApiError::param(at("name"), "is required"));
                };
                let arguments = match item.get("arguments") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
                    Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                        Ok(args @ Value::Object(_)) => args,
                        _ => {
                            return Err(ApiError::param(
                                at("arguments"),
                                "must be a JSON object (as a string)",
                            ));
                        }
                    },
                    Some(_) => return Err(ApiError::param(at("arguments"), "must be a string")),
                };
                if !open_assistant {
                    let mut message = json!({"role": "assistant", "content": ""});
                    if !reasoning.is_empty() {
                        message["reasoning_content"] = std::mem::take(&mut reasoning).into();
                    }
                    out.push(message);
                    open_assistant = true;
                }
                let call = json!({"type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                if let Some(last) = out.last_mut() {
                    match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                }
            }
            Some("function_call_output") => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(parts @ Value::Array(_)) => content_text(Some(parts), &at("output"))?,
                    _ => return Err(ApiError::param(at("output"), "must be a string")),
                };
                let id = item.get("call_id").and_then(Value::as_str).unwrap_or("");
                out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
                open_assistant = false;
            }
            Some(other) => {
                return Err(ApiError::unsupported(
                    &format!("input[{i}]"),
                    &format!("an input item of type {other:?}"),
                ));
            }
        }
    }
    Ok(out)
}

/// The text of a reasoning item: its full `content`, else its `summary`, else the
/// `encrypted_content` this server writes (the same text, which a client that keeps no state
/// hands back).
fn reasoning_text(item: &Value) -> String {
    for key in ["content", "summary"] {
        let text: String = item
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect();
        if !text.is_empty() {
            return text;
        }
    }
    item.get("encrypted_content")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

/// Function tools, flat as Responses writes them, into chat's nested form; none when
/// `tool_choice` is "none".
fn parse_tools(body: &Map<String, Value>) -> ApiResult<Vec<Value>> {
    let use_tools = parse_tool_choice(body)?.offers_tools();
    let tools = match body.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(tools)) if tools.len() <= MAX_TOOLS => tools,
        Some(_) => {
            return Err(ApiError::param(
                "tools",
                format!("must be a list of at most {MAX_TOOLS} tools"),
            ));
        }
    };
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(kind) => {
                return Err(ApiError::unsupported(
                    &format!("tools[{i}]"),
                    &format!("tools of type {kind:?}"),
                ));
            }
            None => return Err(ApiError::param(format!("tools[{i}].type"), "is required")),
        }
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(ApiError::param(format!("tools[{i}].name"), "is required"));
        };
        let mut function = json!({"name": name});
        for key in ["description", "parameters"] {
            if let Some(v) = tool.get(key).filter(|v| !v.is_null()) {
                function[key] = v.clone();
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(if use_tools { out } else { Vec::new() })
}

#[cfg(test)]
mod tests;
