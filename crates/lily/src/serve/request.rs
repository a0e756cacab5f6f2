//! Reading and validating OpenAI request bodies. Unknown fields are ignored (clients send many);
//! known fields with a value we cannot honour are a 400 that names them, never silently dropped.

use lily_core::penalties::Penalties;
use lily_core::sampling::SamplingParams;
use lily_core::sampling_stage::MAX_TOP_LOGPROBS;
use serde_json::{Map, Value};

use lily_grammar::OutputFormat;

use self::fields::{Fields, parse_logit_bias, parse_stop};
use super::constrained::{OutputRule, output_rule, parse_format, parse_tool_choice};
use super::error::{ApiError, ApiResult};
use super::ids::random_u64;
use super::sampling_defaults::SamplingDefaults;

/// The most messages in one request. Far more than any context holds, but it bounds the work of
/// rendering the template before the prompt's length is known.
pub const MAX_MESSAGES: usize = 10_000;
/// OpenAI's own limit; every tool's schema is rendered into the prompt.
pub const MAX_TOOLS: usize = 128;
/// The most choices one request may ask for: each is a whole generation, one after another.
pub const MAX_CHOICES: usize = 16;

/// What chat and text completions share.
#[derive(Clone, Debug)]
pub struct CommonRequest {
    pub model: String,
    /// The client's, or the endpoint's default (text completions: 16).
    pub max_tokens: Option<usize>,
    /// The client set `max_tokens` itself: more than the context leaves is then a 400, where
    /// a default is cut to fit.
    pub max_tokens_asked: bool,
    pub sampling: SamplingParams,
    /// `logit_bias` ids are checked against the vocabulary when the job is made.
    pub penalties: Penalties,
    pub n: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub common: CommonRequest,
    /// Messages as the chat template reads them (content as text, tool-call arguments as
    /// objects).
    pub messages: Vec<Value>,
    /// Empty when the request has none or `tool_choice` is "none".
    pub tools: Vec<Value>,
    /// `chat_template_kwargs`, with `enable_thinking` always set.
    pub template_kwargs: Map<String, Value>,
    /// `Some(top_logprobs)` when `logprobs` is true.
    pub logprobs: Option<usize>,
    /// vLLM's `return_tokens_as_token_ids`: tokens in log-probabilities as `token_id:N`.
    pub tokens_as_ids: bool,
    /// false: at most one tool call is returned.
    pub parallel_tool_calls: bool,
    /// `response_format` or a forced `tool_choice`.
    pub output: Option<OutputRule>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum CompletionPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub common: CommonRequest,
    pub prompt: CompletionPrompt,
    /// `logprobs`: how many alternatives beside each token (0 reports the token's alone).
    pub logprobs: Option<usize>,
    /// The prompt comes back before the output (with its log-probabilities when asked).
    pub echo: bool,
    pub tokens_as_ids: bool,
    /// `response_format` (an extension of vLLM's and llama.cpp's on completions).
    pub format: Option<OutputFormat>,
}

/// The body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> ApiResult<Map<String, Value>> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(body)) => Ok(body),
        Ok(_) => Err(ApiError::invalid("the request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

pub fn parse_chat(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
    default_thinking: bool,
) -> ApiResult<ChatRequest> {
    let fields = Fields(body);
    let common = parse_common(&fields, defaults, None, false)?;
    let logprobs = match (fields.flag("logprobs")?, fields.count("top_logprobs")?) {
        (_, Some(k)) if k > MAX_TOP_LOGPROBS => {
            return Err(ApiError::param(
                "top_logprobs",
                format!("must be from 0 to {MAX_TOP_LOGPROBS}, got {k}"),
            ));
        }
        (Some(true), k) => Some(k.unwrap_or(0)),
        (_, Some(k)) if k > 0 => {
            return Err(ApiError::param(
                "top_logprobs",
                "needs logprobs set to true",
            ));
        }
        _ => None,
    };
    // Fields of features this server lacks, which ignoring would silently change the answer.
    for (name, what) in [
        ("functions", "the legacy functions field (send tools)"),
        (
            "function_call",
            "the legacy function_call field (send tool_choice)",
        ),
        ("audio", "audio output"),
        ("prediction", "predicted outputs"),
        ("web_search_options", "web search"),
    ] {
        fields.require_neutral(name, &[], what)?;
    }
    match body.get("modalities") {
        None | Some(Value::Null) => {}
        Some(Value::Array(m)) if m.iter().all(|x| x == "text") => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "modalities",
                "output other than text",
            ));
        }
    }
    let format = parse_format(body.get("response_format"), "response_format", false)?;
    let messages = parse_messages(body)?;
    let tools = parse_tools(body)?;
    let output = output_rule(
        format,
        &parse_tool_choice(body)?,
        !tools.is_empty(),
        "response_format",
    )?;
    let mut template_kwargs = parse_template_kwargs(body, default_thinking)?;
    if let Some(thinking) = reasoning_effort_thinking(body)? {
        let explicit = body
            .get("chat_template_kwargs")
            .and_then(|k| k.get("enable_thinking"))
            .and_then(Value::as_bool);
        if explicit.is_some_and(|e| e != thinking) {
            return Err(ApiError::param(
                "reasoning_effort",
                "contradicts chat_template_kwargs.enable_thinking",
            ));
        }
        template_kwargs.insert("enable_thinking".into(), thinking.into());
    }
    Ok(ChatRequest {
        common,
        messages,
        tools,
        template_kwargs,
        logprobs,
        tokens_as_ids: fields.flag("return_tokens_as_token_ids")?.unwrap_or(false),
        parallel_tool_calls: fields.flag("parallel_tool_calls")?.unwrap_or(true),
        output,
    })
}

/// What `reasoning_effort` asks of the template: "none" turns thinking off; the others keep it
/// on, since Qwen's thinking has no budget to scale (`None` when the field is absent).
fn reasoning_effort_thinking(body: &Map<String, Value>) -> ApiResult<Option<bool>> {
    match body.get("reasoning_effort") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(effort)) => match effort.as_str() {
            "none" => Ok(Some(false)),
            "minimal" | "low" | "medium" | "high" => Ok(Some(true)),
            other => Err(ApiError::param(
                "reasoning_effort",
                format!("{other:?} is not one of none, minimal, low, medium, high"),
            )),
        },
        Some(_) => Err(ApiError::param("reasoning_effort", "must be a string")),
    }
}

/// `chat_template_kwargs`, with `enable_thinking` always set.
pub fn parse_template_kwargs(
    body: &Map<String, Value>,
    default_thinking: bool,
) -> ApiResult<Map<String, Value>> {
    let mut kwargs = match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(kwargs)) => kwargs.clone(),
        Some(_) => return Err(ApiError::param("chat_template_kwargs", "must be an object")),
    };
    for reserved in ["messages", "tools", "add_generation_prompt"] {
        if kwargs.contains_key(reserved) {
            return Err(ApiError::param(
                format!("chat_template_kwargs.{reserved}"),
                "is set by the server",
            ));
        }
    }
    match kwargs.get("enable_thinking") {
        None | Some(Value::Null) => {
            kwargs.insert("enable_thinking".into(), default_thinking.into());
        }
        Some(Value::Bool(_)) => {}
        Some(_) => {
            return Err(ApiError::param(
                "chat_template_kwargs.enable_thinking",
                "must be true or false",
            ));
        }
    }
    Ok(kwargs)
}

/// `messages` as the chat template reads them.
pub fn parse_messages(body: &Map<String, Value>) -> ApiResult<Vec<Value>> {
    match body.get("messages") {
        Some(Value::Array(list)) if list.len() > MAX_MESSAGES => Err(ApiError::param(
            "messages",
            format!(
                "at most {MAX_MESSAGES} messages are allowed, got {}",
                list.len()
            ),
        )),
        Some(Value::Array(list)) if !list.is_empty() => list
            .iter()
            .enumerate()
            .map(|(i, m)| normalize_message(i, m))
            .collect(),
        Some(Value::Array(_)) => Err(ApiError::param("messages", "must not be empty")),
        Some(_) => Err(ApiError::param("messages", "must be a list of messages")),
        None => Err(ApiError::param("messages", "is required")),
    }
}

pub fn parse_completion(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> ApiResult<CompletionRequest> {
    let fields = Fields(body);
    // OpenAI's default for text completions.
    let echo = fields.flag("echo")?.unwrap_or(false);
    // `max_tokens` 0 with `echo` scores the prompt alone (as evaluation harnesses do).
    let common = parse_common(&fields, defaults, Some(16), echo)?;
    fields.require_neutral("suffix", &[], "suffix")?;
    fields.require_neutral("best_of", &[1.into()], "best_of other than 1")?;
    let logprobs = match fields.0.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(v) => match v.as_u64() {
            Some(k) if k as usize <= MAX_TOP_LOGPROBS => Some(k as usize),
            _ => {
                return Err(ApiError::param(
                    "logprobs",
                    format!("must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                ));
            }
        },
    };
    let tokens_as_ids = fields.flag("return_tokens_as_token_ids")?.unwrap_or(false);
    let prompt = match body.get("prompt") {
        Some(Value::String(s)) => CompletionPrompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => CompletionPrompt::Text(s.clone()),
            [Value::Array(ids)] => CompletionPrompt::Tokens(token_ids(ids)?),
            ids if !ids.is_empty() && ids.iter().all(Value::is_number) => {
                CompletionPrompt::Tokens(token_ids(ids)?)
            }
            [] => return Err(ApiError::param("prompt", "must not be empty")),
            _ => {
                return Err(ApiError::unsupported(
                    "prompt",
                    "more than one prompt per request",
                ));
            }
        },
        Some(_) => {
            return Err(ApiError::param(
                "prompt",
                "must be a string or a list of token ids",
            ));
        }
        None => return Err(ApiError::param("prompt", "is required")),
    };
    if prompt == CompletionPrompt::Text(String::new()) {
        return Err(ApiError::param("prompt", "must not be empty"));
    }
    Ok(CompletionRequest {
        common,
        prompt,
        logprobs,
        echo,
        tokens_as_ids,
        format: parse_format(body.get("response_format"), "response_format", false)?,
    })
}

fn token_ids(values: &[Value]) -> ApiResult<Vec<u32>> {
    let ids = values
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::param("prompt", "token ids must be non-negative integers"))?;
    if ids.is_empty() {
        return Err(ApiError::param("prompt", "must not be empty"));
    }
    Ok(ids)
}

/// The sampling and output fields chat and completions share, for an endpoint of another shape
/// (Responses) that maps its own names onto them first.
pub fn parse_common_fields(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> ApiResult<CommonRequest> {
    parse_common(&Fields(body), defaults, None, false)
}

fn parse_common(
    fields: &Fields,
    defaults: &SamplingDefaults,
    default_max_tokens: Option<usize>,
    allow_zero_tokens: bool,
) -> ApiResult<CommonRequest> {
    let model = match fields.0.get("model") {
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(ApiError::param("model", "must be a string")),
        None => return Err(ApiError::param("model", "is required")),
    };
    let n = match fields.count("n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES).contains(&n) => n,
        Some(n) => {
            return Err(ApiError::param(
                "n",
                format!("must be from 1 to {MAX_CHOICES}, got {n}"),
            ));
        }
    };
    let penalties = Penalties {
        presence: fields
            .ranged("presence_penalty", -2.0, 2.0, true)?
            .unwrap_or(0.0),
        frequency: fields
            .ranged("frequency_penalty", -2.0, 2.0, true)?
            .unwrap_or(0.0),
        repetition: fields
            .ranged("repetition_penalty", 0.0, 2.0, false)?
            .unwrap_or(1.0),
        logit_bias: parse_logit_bias(fields.0.get("logit_bias"))?,
    };
    let asked = match fields.count("max_completion_tokens")? {
        Some(n) => Some(n),
        None => fields.count("max_tokens")?,
    };
    let max_tokens = asked.or(default_max_tokens);
    if max_tokens == Some(0) && !allow_zero_tokens {
        return Err(ApiError::param(
            "max_tokens",
            "must be at least 1 (0 only with echo)",
        ));
    }
    let top_k = match fields.number("top_k")? {
        None => defaults.top_k,
        Some(k) if k == -1.0 || k == 0.0 => 0,
        Some(k) if k >= 1.0 && k.fract() == 0.0 => k as usize,
        Some(_) => {
            return Err(ApiError::param(
                "top_k",
                "must be -1 (no limit) or a positive integer",
            ));
        }
    };
    let seed = match fields.0.get("seed") {
        None | Some(Value::Null) => random_u64(),
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(s), _) => s,
            // A negative seed is as good a seed as any other.
            (None, Some(s)) => s as u64,
            _ => return Err(ApiError::param("seed", "must be an integer")),
        },
    };
    let sampling = SamplingParams {
        temperature: fields
            .ranged("temperature", 0.0, 2.0, true)?
            .unwrap_or(defaults.temperature),
        top_k,
        top_p: fields
            .ranged("top_p", 0.0, 1.0, false)?
            .unwrap_or(defaults.top_p),
        min_p: fields
            .ranged("min_p", 0.0, 1.0, true)?
            .unwrap_or(defaults.min_p),
        seed,
    };
    let stream = match fields.0.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::param("stream", "must be true or false")),
    };
    let include_usage = match fields.0.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::param(
                    "stream_options.include_usage",
                    "must be true or false",
                ));
            }
        },
        Some(_) => return Err(ApiError::param("stream_options", "must be an object")),
    };
    Ok(CommonRequest {
        model,
        max_tokens,
        max_tokens_asked: asked.is_some(),
        sampling,
        penalties,
        n,
        stop: parse_stop(fields.0.get("stop"))?,
        stream,
        include_usage,
    })
}

pub fn parse_tools(body: &Map<String, Value>) -> ApiResult<Vec<Value>> {
    let use_tools = parse_tool_choice(body)?.offers_tools();
    let tools = match body.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(ApiError::param("tools", "must be a list of tools")),
    };
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::param(
            "tools",
            format!("at most {MAX_TOOLS} tools are allowed, got {}", tools.len()),
        ));
    }
    for (i, tool) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::param(
                param,
                "only tools of type \"function\" are supported",
            ));
        }
        if tool
            .pointer("/function/name")
            .and_then(Value::as_str)
            .is_none()
        {
            return Err(ApiError::param(param, "function.name is required"));
        }
    }
    Ok(if use_tools { tools.clone() } else { Vec::new() })
}

/// One message as the template reads it.
fn normalize_message(index: usize, message: &Value) -> ApiResult<Value> {
    let at = |field: &str| format!("messages[{index}].{field}");
    let Some(message) = message.as_object() else {
        return Err(ApiError::param(
            format!("messages[{index}]"),
            "must be an object",
        ));
    };
    let role = match message.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => "system",
        Some(role @ ("user" | "assistant" | "tool")) => role,
        Some(other) => {
            return Err(ApiError::param(
                at("role"),
                format!("{other:?} is not one of system, developer, user, assistant, tool"),
            ));
        }
        None => return Err(ApiError::param(at("role"), "is required")),
    };
    let content = match message.get("content") {
        None | Some(Value::Null) if role == "assistant" => Value::Null,
        None | Some(Value::Null) => return Err(ApiError::param(at("content"), "is required")),
        Some(content) => Value::String(content_text(content, &at("content"))?),
    };
    let mut out = Map::new();
    out.insert("role".into(), role.into());
    out.insert("content".into(), content);
    if role == "assistant" {
        let reasoning = message
            .get("reasoning_content")
            .or(message.get("reasoning"));
        match reasoning {
            None | Some(Value::Null) => {}
            Some(Value::String(r)) => {
                out.insert("reasoning_content".into(), r.clone().into());
            }
            Some(_) => return Err(ApiError::param(at("reasoning_content"), "must be a string")),
        }
        match message.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                let calls = calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| normalize_tool_call(c, &at(&format!("tool_calls[{j}]"))))
                    .collect::<ApiResult<Vec<_>>>()?;
                out.insert("tool_calls".into(), calls.into());
            }
            Some(_) => return Err(ApiError::param(at("tool_calls"), "must be a list")),
        }
    }
    Ok(Value::Object(out))
}

/// A string, or a list of text parts joined; other parts (images, audio) are not supported.
fn content_text(content: &Value, param: &str) -> ApiResult<String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some("text"), _) => {
                        return Err(ApiError::param(
                            format!("{param}[{i}].text"),
                            "must be a string",
                        ));
                    }
                    (Some(kind), _) => {
                        return Err(ApiError::unsupported(
                            &format!("{param}[{i}]"),
                            &format!("content of type {kind:?} (this server is text-only)"),
                        ));
                    }
                    (None, _) => {
                        return Err(ApiError::param(format!("{param}[{i}].type"), "is required"));
                    }
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

/// OpenAI sends arguments as a JSON string; the template iterates them as an object.
fn normalize_tool_call(call: &Value, param: &str) -> ApiResult<Value> {
    let function = call.get("function").unwrap_or(call);
    let Some(name) = function.get("name").and_then(Value::as_str) else {
        return Err(ApiError::param(
            format!("{param}.function.name"),
            "is required",
        ));
    };
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(args)) => Value::Object(args),
            _ => {
                return Err(ApiError::param(
                    format!("{param}.function.arguments"),
                    "must be a JSON object (as a string)",
                ));
            }
        },
        Some(Value::Object(args)) => Value::Object(args.clone()),
        Some(_) => {
            return Err(ApiError::param(
                format!("{param}.function.arguments"),
                "must be a JSON object (as a string)",
            ));
        }
    };
    Ok(serde_json::json!({"type": "function", "function": {"name": name, "arguments": arguments}}))
}

mod fields;
#[cfg(test)]
mod tests;
