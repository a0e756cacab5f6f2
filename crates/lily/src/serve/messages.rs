//! `POST /v1/messages`, Anthropic's Messages API, on the engine chat uses: `system`, content
//! blocks (text, `tool_use`, `tool_result`, `thinking`) turned into the messages the chat
//! template reads, `tools` as function tools, `thinking` as the template's `enable_thinking`;
//! the reply parsed into content blocks (`blocks`), streamed as Anthropic's named events.
//! Errors come in Anthropic's shape (`{"type": "error", "error": {type, message}}`).

mod blocks;

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lily_chat::{ChatOutputParser, ToolSchemas};
use lily_core::penalties::Penalties;
use lily_core::sampling::SamplingParams;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use self::blocks::{Blocks, MessageHead, MessagesStream};
use super::constrained::{GrammarJob, OutputRule, compile_grammar, parse_format};
use super::error::{ApiError, ApiResult};
use super::ids::{new_id, random_u64};
use super::prompt::{ChatPrompt, chat_prompt};
use super::request::{CommonRequest, MAX_MESSAGES, MAX_TOOLS, parse_body};
use super::routes::{AppState, read_body};
use super::sampling_defaults::SamplingDefaults;
use super::stream::{collect, sse_response};
use super::worker::WorkerEvent;

pub async fn messages(State(app): State<Arc<AppState>>, body: Body) -> Response {
    match handle(app, body).await {
        Ok(response) => response,
        Err(error) => anthropic_error(&error),
    }
}

/// Anthropic's error object, with the type its clients map to their exception classes.
pub fn anthropic_error_body(error: &ApiError) -> Value {
    let kind = match error.status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_client_error() => "invalid_request_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": error.message}})
}

fn anthropic_error(error: &ApiError) -> Response {
    (error.status, Json(anthropic_error_body(error))).into_response()
}

/// A request as the engine and the template take it.
pub(super) struct MessagesRequest {
    common: CommonRequest,
    conversation: Conversation,
}

/// What a Messages request gives the chat template, and the output it forces: the part that
/// `/v1/messages/count_tokens` reads too.
pub(super) struct Conversation {
    messages: Vec<Value>,
    tools: Vec<Value>,
    /// `output_config.format`, or `tool_choice` "any" or "tool" (tool calls only).
    forced: Option<OutputRule>,
    /// `tool_choice.disable_parallel_tool_use`.
    parallel: bool,
    thinking: Option<bool>,
}

impl Conversation {
    /// The prompt the model reads, rendered off the async runtime (`thinking` unset: the
    /// server's default).
    async fn prompt(&self, app: &AppState) -> ApiResult<ChatPrompt> {
        let mut kwargs = Map::new();
        let thinking = self.thinking.unwrap_or(app.default_thinking);
        kwargs.insert("enable_thinking".into(), thinking.into());
        let text = app.text.clone();
        let (messages, tools) = (self.messages.clone(), self.tools.clone());
        tokio::task::spawn_blocking(move || chat_prompt(&text, &messages, &tools, &kwargs))
            .await
            .map_err(|e| ApiError::internal(format!("rendering the prompt: {e}")))?
            .map_err(|e| ApiError::param("messages", format!("{e:#}")))
    }
}

async fn handle(app: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let body = parse_body(&read_body(body, &app).await?)?;
    let MessagesRequest {
        common,
        conversation: request,
    } = parse_messages_request(&body, &app.defaults)?;
    app.check_model(&common.model)?;
    let prompt = request.prompt(&app).await?;
    let mut job = app.job(prompt.tokens, prompt.turn_boundary, &common, "messages")?;
    let grammar = request.forced.clone().map(|rule| GrammarJob {
        rule,
        tools: request.tools.clone(),
        parallel: request.parallel,
        thinking: prompt.thinking,
        format_param: "output_config.format",
    });
    job.grammar = compile_grammar(&app, grammar).await?;
    let events = app.engine.submit(job)?;
    let schemas = (!request.tools.is_empty()).then(|| ToolSchemas::from_tools(&request.tools));
    let blocks = Blocks::new(
        ChatOutputParser::new(prompt.thinking, schemas),
        app.text.clone(),
        common.stop.clone(),
    );
    let head = MessageHead {
        id: new_id("msg_"),
        model: app.model_name.clone(),
    };
    if common.stream {
        return Ok(sse_response(events, MessagesStream::new(head, blocks)));
    }
    answer(events, head, blocks).await
}

/// The whole message of a request that does not stream.
async fn answer(
    events: UnboundedReceiver<WorkerEvent>,
    head: MessageHead,
    blocks: Blocks,
) -> ApiResult<Response> {
    let (blocks, outcome) = collect(events, blocks).await?;
    Ok(Json(blocks.message(&head, &outcome)).into_response())
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`, the tokens of the prompt the same
/// body would prefill on `/v1/messages` (system, messages, tools and thinking through the chat
/// template), so that an agent can budget its context before it sends.
pub async fn count_tokens(State(app): State<Arc<AppState>>, body: Body) -> Response {
    let counted = async {
        let body = parse_body(&read_body(body, &app).await?)?;
        app.check_model(&parse_model(&body)?)?;
        let prompt = parse_conversation(&body)?.prompt(&app).await?;
        Ok::<_, ApiError>(json!({"input_tokens": prompt.tokens.len()}))
    };
    match counted.await {
        Ok(count) => Json(count).into_response(),
        Err(error) => anthropic_error(&error),
    }
}

fn parse_model(body: &Map<String, Value>) -> ApiResult<String> {
    match body.get("model") {
        Some(Value::String(m)) => Ok(m.clone()),
        Some(_) => Err(ApiError::param("model", "must be a string")),
        None => Err(ApiError::param("model", "is required")),
    }
}

pub(super) fn parse_messages_request(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> ApiResult<MessagesRequest> {
    let model = parse_model(body)?;
    let max_tokens = match body.get("max_tokens").map(Value::as_u64) {
        Some(Some(n)) if n >= 1 => n as usize,
        Some(_) => return Err(ApiError::param("max_tokens", "must be a positive integer")),
        None => return Err(ApiError::param("max_tokens", "is required")),
    };
    let number = |name: &str, lo: f64, hi: f64| match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
            _ => Err(ApiError::param(
                name,
                format!("must be a number in [{lo}, {hi}]"),
            )),
        },
    };
    let top_k = match body.get("top_k") {
        None | Some(Value::Null) => defaults.top_k,
        Some(v) => match v.as_u64() {
            Some(k) => k as usize,
            None => return Err(ApiError::param("top_k", "must be a non-negative integer")),
        },
    };
    let sampling = SamplingParams {
        // Anthropic's range is [0, 1]; the model's own default applies when it is absent.
        temperature: number("temperature", 0.0, 1.0)?.unwrap_or(defaults.temperature),
        top_k,
        top_p: match number("top_p", 0.0, 1.0)? {
            Some(p) if p > 0.0 => p,
            Some(_) => return Err(ApiError::param("top_p", "must be in (0, 1]")),
            None => defaults.top_p,
        },
        min_p: defaults.min_p,
        seed: random_u64(),
    };
    let stop = match body.get("stop_sequences") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().filter(|s| !s.is_empty()).map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .filter(|stops| stops.len() <= 16)
            .ok_or_else(|| {
                ApiError::param("stop_sequences", "must be at most 16 non-empty strings")
            })?,
        Some(_) => {
            return Err(ApiError::param(
                "stop_sequences",
                "must be a list of strings",
            ));
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::param("stream", "must be true or false")),
    };
    Ok(MessagesRequest {
        common: CommonRequest {
            model,
            max_tokens: Some(max_tokens),
            max_tokens_asked: true,
            sampling,
            penalties: Penalties::default(),
            n: 1,
            stop,
            stream,
            include_usage: false,
        },
        conversation: parse_conversation(body)?,
    })
}

/// The conversation of a Messages body: `system`, `messages`, `tools`, `tool_choice`,
/// `thinking` and `output_config`.
pub(super) fn parse_conversation(body: &Map<String, Value>) -> ApiResult<Conversation> {
    let thinking = parse_thinking(body)?;
    // Server-side features: ignoring them would answer as if they had not been asked for.
    for (name, what) in [
        ("mcp_servers", "MCP servers"),
        ("container", "code execution containers"),
    ] {
        let asked = match body.get(name) {
            None | Some(Value::Null) => false,
            Some(Value::Array(list)) => !list.is_empty(),
            Some(_) => true,
        };
        if asked {
            return Err(ApiError::unsupported(name, what));
        }
    }
    let tools = parse_tools(body)?;
    let (forced, parallel) = parse_tool_choice(body, !tools.is_empty())?;
    // Anthropic's structured outputs: `output_config.format` is `{"type": "json_schema",
    // "schema": …}`, flat as Responses writes it.
    let format = parse_format(
        body.get("output_config").and_then(|c| c.get("format")),
        "output_config.format",
        true,
    )?;
    let forced = match (format, forced) {
        (Some(_), Some(_)) => {
            return Err(ApiError::unsupported(
                "output_config.format",
                "a structured output together with a forced tool call (send one of them)",
            ));
        }
        (Some(format), None) => Some(OutputRule::Format(format)),
        (None, forced) => forced,
    };
    let mut messages = system_messages(body.get("system"))?;
    match body.get("messages") {
        Some(Value::Array(list)) if list.len() > MAX_MESSAGES => {
            return Err(ApiError::param(
                "messages",
                format!("at most {MAX_MESSAGES} messages are allowed"),
            ));
        }
        Some(Value::Array(list)) if !list.is_empty() => {
            for (i, message) in list.iter().enumerate() {
                messages.extend(template_messages(i, message)?);
            }
        }
        Some(Value::Array(_)) => return Err(ApiError::param("messages", "must not be empty")),
        Some(_) => return Err(ApiError::param("messages", "must be a list of messages")),
        None => return Err(ApiError::param("messages", "is required")),
    }
    Ok(Conversation {
        messages,
        tools,
        forced,
        parallel,
        thinking,
    })
}

/// `thinking` as the template's `enable_thinking` ("enabled" and "adaptive" turn it on; the
/// budget is not enforced, as Qwen's thinking has none); `output_config.effort` is accepted and
/// changes nothing.
fn parse_thinking(body: &Map<String, Value>) -> ApiResult<Option<bool>> {
    if let Some(config) = body.get("output_config").filter(|c| !c.is_null()) {
        match config.get("effort") {
            None | Some(Value::Null) => {}
            Some(Value::String(e))
                if ["low", "medium", "high", "xhigh", "max"].contains(&e.as_str()) => {}
            Some(_) => {
                return Err(ApiError::param(
                    "output_config.effort",
                    "must be one of low, medium, high, xhigh, max",
                ));
            }
        }
    }
    let Some(thinking) = body.get("thinking").filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    match thinking.get("display").and_then(Value::as_str) {
        None | Some("summarized") => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "thinking.display",
                "thinking display other than \"summarized\"",
            ));
        }
    }
    match thinking.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        _ => Err(ApiError::param(
            "thinking.type",
            "must be \"enabled\", \"adaptive\" or \"disabled\"",
        )),
    }
}

/// `system`: a string or a list of text blocks.
fn system_messages(system: Option<&Value>) -> ApiResult<Vec<Value>> {
    let text = match system {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .enumerate()
            .map(|(i, b)| text_block(b, &format!("system[{i}]")))
            .collect::<ApiResult<String>>()?,
        Some(_) => return Err(ApiError::param("system", "must be a string or text blocks")),
    };
    Ok(vec![json!({"role": "system", "content": text})])
}

fn text_block(block: &Value, param: &str) -> ApiResult<String> {
    match (block.get("type").and_then(Value::as_str), block.get("text")) {
        (Some("text"), Some(Value::String(t))) => Ok(t.clone()),
        _ => Err(ApiError::param(param, "must be a text block")),
    }
}

/// One Anthropic message as template messages: a user message's `tool_result` blocks become
/// tool messages (before its text, as clients send results first); an assistant's `thinking`
/// becomes `reasoning_content` and its `tool_use` blocks tool calls.
fn template_messages(index: usize, message: &Value) -> ApiResult<Vec<Value>> {
    let at = |field: &str| format!("messages[{index}].{field}");
    let role = match message.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "assistant")) => role,
        Some(other) => {
            return Err(ApiError::param(
                at("role"),
                format!("{other:?} is not user or assistant"),
            ));
        }
        None => return Err(ApiError::param(at("role"), "is required")),
    };
    let blocks = match message.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(blocks)) => blocks.clone(),
        Some(_) => return Err(ApiError::param(at("content"), "must be a string or blocks")),
        None => return Err(ApiError::param(at("content"), "is required")),
    };
    let (mut text, mut reasoning, mut calls, mut out) =
        (String::new(), String::new(), vec![], vec![]);
    for (j, block) in blocks.iter().enumerate() {
        let param = at(&format!("content[{j}]"));
        match (role, block.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => text.push_str(&text_block(block, &param)?),
            ("assistant", Some("thinking")) => match block.get("thinking") {
                Some(Value::String(t)) => reasoning.push_str(t),
                _ => {
                    return Err(ApiError::param(
                        format!("{param}.thinking"),
                        "must be a string",
                    ));
                }
            },
            // Its content is encrypted by its maker; there is nothing for the template.
            ("assistant", Some("redacted_thinking")) => {}
            ("assistant", Some("tool_use")) => {
                let Some(name) = block.get("name").and_then(Value::as_str) else {
                    return Err(ApiError::param(format!("{param}.name"), "is required"));
                };
                let input = match block.get("input") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(Value::Object(input)) => Value::Object(input.clone()),
                    Some(_) => {
                        return Err(ApiError::param(
                            format!("{param}.input"),
                            "must be an object",
                        ));
                    }
                };
                calls.push(json!({"type": "function",
                                  "function": {"name": name, "arguments": input}}));
            }
            ("user", Some("tool_result")) => {
                let content = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .enumerate()
                        .map(|(k, p)| text_block(p, &format!("{param}.content[{k}]")))
                        .collect::<ApiResult<String>>()?,
                    Some(_) => {
                        return Err(ApiError::param(
                            format!("{param}.content"),
                            "must be a string or text blocks",
                        ));
                    }
                };
                let id = block
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            (_, Some(kind)) => {
                return Err(ApiError::unsupported(
                    &param,
                    &format!("a {kind:?} block in a {role} message"),
                ));
            }
            (_, None) => return Err(ApiError::param(format!("{param}.type"), "is required")),
        }
    }
    if role == "user" {
        if !text.is_empty() || out.is_empty() {
            out.push(json!({"role": "user", "content": text}));
        }
        return Ok(out);
    }
    let mut assistant = json!({"role": "assistant", "content": text});
    if !reasoning.is_empty() {
        assistant["reasoning_content"] = reasoning.into();
    }
    if !calls.is_empty() {
        assistant["tool_calls"] = calls.into();
    }
    Ok(vec![assistant])
}

/// Anthropic's `tool_choice`: "any" forces a call of some tool, "tool" of the named one (each a
/// grammar); `disable_parallel_tool_use` allows one call only.
fn parse_tool_choice(
    body: &Map<String, Value>,
    has_tools: bool,
) -> ApiResult<(Option<OutputRule>, bool)> {
    let Some(choice) = body.get("tool_choice").filter(|c| !c.is_null()) else {
        return Ok((None, true));
    };
    let parallel = match choice.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(disable)) => !disable,
        Some(_) => {
            return Err(ApiError::param(
                "tool_choice.disable_parallel_tool_use",
                "must be true or false",
            ));
        }
    };
    let forced = match choice.get("type").and_then(Value::as_str) {
        Some("auto" | "none") => None,
        Some("any") => Some(OutputRule::ToolCall(None)),
        Some("tool") => match choice.get("name").and_then(Value::as_str) {
            Some(name) => Some(OutputRule::ToolCall(Some(name.to_string()))),
            None => return Err(ApiError::param("tool_choice.name", "is required")),
        },
        _ => {
            return Err(ApiError::param(
                "tool_choice.type",
                "must be auto, any, tool or none",
            ));
        }
    };
    if forced.is_some() && !has_tools {
        return Err(ApiError::param(
            "tool_choice",
            "forces a tool call but no tools are given",
        ));
    }
    Ok((forced, parallel))
}

/// Anthropic tools (`name`, `description`, `input_schema`) as the template's function tools;
/// none when `tool_choice` is "none".
fn parse_tools(body: &Map<String, Value>) -> ApiResult<Vec<Value>> {
    let use_tools = body
        .get("tool_choice")
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
        != Some("none");
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
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(ApiError::param(format!("tools[{i}].name"), "is required"));
        };
        if let Some(kind) = tool.get("type").and_then(Value::as_str)
            && kind != "custom"
        {
            return Err(ApiError::unsupported(
                &format!("tools[{i}]"),
                &format!("the server tool {kind:?}"),
            ));
        }
        let schema = tool
            .get("input_schema")
            .cloned()
            .unwrap_or(json!({"type": "object"}));
        let mut function = json!({"name": name, "parameters": schema});
        if let Some(description) = tool.get("description") {
            function["description"] = description.clone();
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(if use_tools { out } else { Vec::new() })
}

#[cfg(test)]
mod tests;
