//! Constrained decoding on the server: what `response_format` (chat, completions),
//! `text.format` (Responses) and a forced `tool_choice` ask the output to follow, checked when
//! the request is read and compiled into a grammar before the job is queued. A schema the
//! grammar engine cannot compile is a 400 naming the field, before any token is generated.

use std::sync::{Arc, OnceLock};

use lily_chat::TextModel;
use lily_core::sampling_stage::Grammar;
use lily_grammar::{Grammars, OutputFormat, tool_call_lark};
use serde_json::{Map, Value};

use super::error::{ApiError, ApiResult};
use super::routes::AppState;

/// OpenAI's `tool_choice` (chat's and Responses' shapes alike).
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    /// At least one call, of any tool.
    Required,
    /// One call of this function.
    Named(String),
}

impl ToolChoice {
    pub fn offers_tools(&self) -> bool {
        *self != ToolChoice::None
    }
}

/// What the output must follow.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputRule {
    Format(OutputFormat),
    /// Only tool calls, of the named function if any.
    ToolCall(Option<String>),
}

pub fn parse_tool_choice(body: &Map<String, Value>) -> ApiResult<ToolChoice> {
    let named = |choice: &Value| {
        // Chat nests the name under `function`; Responses writes it flat.
        let name = choice
            .pointer("/function/name")
            .or(choice.get("name"))
            .and_then(Value::as_str);
        match (choice.get("type").and_then(Value::as_str), name) {
            (Some("function"), Some(name)) => Ok(ToolChoice::Named(name.to_string())),
            (Some("function"), None) => {
                Err(ApiError::param("tool_choice.function.name", "is required"))
            }
            _ => Err(ApiError::param(
                "tool_choice",
                "must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", …}",
            )),
        }
    };
    match body.get("tool_choice") {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(c)) => match c.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::param(
                "tool_choice",
                format!("{other:?} is not one of auto, none, required"),
            )),
        },
        Some(choice @ Value::Object(_)) => named(choice),
        Some(_) => Err(ApiError::param(
            "tool_choice",
            "must be a string or an object",
        )),
    }
}

/// `response_format` (`param`): `None` for text. Chat nests a schema under `json_schema`;
/// Responses' `text.format` writes it flat (`flat`).
pub fn parse_format(
    format: Option<&Value>,
    param: &str,
    flat: bool,
) -> ApiResult<Option<OutputFormat>> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputFormat::JsonObject)),
        Some("json_schema") => {
            let (holder, at) = if flat {
                (Some(format), param.to_string())
            } else {
                (format.get("json_schema"), format!("{param}.json_schema"))
            };
            let Some(holder) = holder.filter(|h| h.is_object()) else {
                return Err(ApiError::param(at, "is required (an object with a schema)"));
            };
            match holder.get("schema") {
                Some(schema @ Value::Object(_)) => {
                    Ok(Some(OutputFormat::JsonSchema(schema.clone())))
                }
                Some(_) => Err(ApiError::param(format!("{at}.schema"), "must be an object")),
                None => Err(ApiError::param(format!("{at}.schema"), "is required")),
            }
        }
        Some(other) => Err(ApiError::param(
            format!("{param}.type"),
            format!("{other:?} is not one of text, json_object, json_schema"),
        )),
        None => Err(ApiError::param(format!("{param}.type"), "is required")),
    }
}

/// The one rule of a request, from its format and its tool choice; asking for both is a 400.
pub fn output_rule(
    format: Option<OutputFormat>,
    choice: &ToolChoice,
    has_tools: bool,
    format_param: &str,
) -> ApiResult<Option<OutputRule>> {
    let forced = match choice {
        ToolChoice::Required => Some(None),
        ToolChoice::Named(name) => Some(Some(name.clone())),
        ToolChoice::Auto | ToolChoice::None => None,
    };
    if forced.is_some() && !has_tools {
        return Err(ApiError::param(
            "tool_choice",
            "forces a tool call but no tools are given",
        ));
    }
    match (format, forced) {
        (Some(_), Some(_)) => Err(ApiError::unsupported(
            format_param,
            "a structured output together with a forced tool call (send one of them)",
        )),
        (Some(format), None) => Ok(Some(OutputRule::Format(format))),
        (None, Some(only)) => Ok(Some(OutputRule::ToolCall(only))),
        (None, None) => Ok(None),
    }
}

/// The server's grammar engine, made on the first constrained request (building it for the
/// 248K vocabulary takes a moment that plain requests need not wait for).
pub struct GrammarEngine {
    /// The tokens that end a turn, which the reasoning before a constrained answer may not use.
    turn_ends: Vec<u32>,
    grammars: OnceLock<Result<Grammars, String>>,
}

/// The most of an engine's error message a 400 repeats.
const MAX_ERROR_CHARS: usize = 600;

impl GrammarEngine {
    pub fn new(turn_ends: Vec<u32>) -> Self {
        GrammarEngine {
            turn_ends,
            grammars: OnceLock::new(),
        }
    }

    /// Compiles `rule` for a prompt that opens a reasoning block or not (`thinking`); blocking.
    fn compile(&self, text: &TextModel, job: &GrammarJob) -> ApiResult<Arc<dyn Grammar>> {
        let grammars = self
            .grammars
            .get_or_init(|| {
                Grammars::new(&text.tokenizer, self.turn_ends.clone()).map_err(|e| format!("{e:#}"))
            })
            .as_ref()
            .map_err(|e| ApiError::internal(format!("the grammar engine: {e}")))?;
        let (lark, param) = match &job.rule {
            OutputRule::Format(format) => (format.answer_lark(), job.format_param.to_string()),
            OutputRule::ToolCall(only) => (
                tool_call_lark(&job.tools, only.as_deref(), job.parallel)
                    .map_err(|e| ApiError::param(e.param, e.message))?,
                "tools".to_string(),
            ),
        };
        let grammar = grammars.compile(&lark, job.thinking).map_err(|e| {
            let message: String = format!("{e:#}").chars().take(MAX_ERROR_CHARS).collect();
            ApiError::param(param, format!("cannot be followed: {message}"))
        })?;
        Ok(Arc::new(grammar))
    }
}

/// What one request's grammar is made from.
pub struct GrammarJob {
    pub rule: OutputRule,
    pub tools: Vec<Value>,
    pub parallel: bool,
    /// The prompt opens a reasoning block, which stays free.
    pub thinking: bool,
    /// Where the format came from (`response_format`, `text.format`), for errors.
    pub format_param: &'static str,
}

/// The grammar of `job`, compiled off the async threads; `None` without a rule.
pub async fn compile_grammar(
    app: &Arc<AppState>,
    job: Option<GrammarJob>,
) -> ApiResult<Option<Arc<dyn Grammar>>> {
    let Some(job) = job else {
        return Ok(None);
    };
    let app = app.clone();
    tokio::task::spawn_blocking(move || app.grammars.compile(&app.text, &job))
        .await
        .map_err(|e| ApiError::internal(format!("compiling the grammar: {e}")))?
        .map(Some)
}
