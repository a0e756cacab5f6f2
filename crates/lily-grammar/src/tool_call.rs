//! A forced tool call as a grammar: Qwen's XML format (`<tool_call>\n<function=NAME>\n`, one
//! `<parameter=P>\nVALUE\n</parameter>\n` per argument, `</function>\n</tool_call>`) with each
//! value valid against its parameter's schema, as the output parser will read it back
//! (`lily_chat::ToolSchemas`): a string parameter is raw text, any other type is JSON.
//! Required parameters come first in the schema's order, then the optional ones, each of which
//! may be left out.

use std::fmt;

use serde_json::{Map, Value};

use crate::format::json_rule;

/// A tool whose schema cannot be made a grammar; `param` names the field in the request.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCallError {
    pub param: String,
    pub message: String,
}

impl fmt::Display for ToolCallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.param, self.message)
    }
}

impl std::error::Error for ToolCallError {}

/// The Lark rules (top rule `answer`) of a reply that is only tool calls: of the function
/// `only` if named, else of any of `tools`; one call, or one or more with `parallel`.
pub fn tool_call_lark(
    tools: &[Value],
    only: Option<&str>,
    parallel: bool,
) -> Result<String, ToolCallError> {
    let mut rules = String::new();
    let mut calls = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function").unwrap_or(tool);
        let Some(name) = function.get("name").and_then(Value::as_str) else {
            continue;
        };
        if only.is_some_and(|only| only != name) {
            continue;
        }
        let at = format!("tools[{i}].function.parameters");
        let params = parameter_items(function.get("parameters"), &at, i, &mut rules)?;
        let head = literal(&format!("<tool_call>\n<function={name}>\n"));
        let tail = literal("</function>\n</tool_call>");
        rules.push_str(&format!("call_{i}: {head} {params} {tail}\n"));
        calls.push(format!("call_{i}"));
    }
    if calls.is_empty() {
        return Err(ToolCallError {
            param: "tool_choice".into(),
            message: match only {
                Some(name) => format!("names {name:?}, which is not one of the tools"),
                None => "needs at least one tool".into(),
            },
        });
    }
    let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
    Ok(format!(
        "answer: call{repeat}\ncall: {}\n{rules}",
        calls.join(" | ")
    ))
}

/// The parameter rules of tool `tool`, in the order they are written; their sequence.
fn parameter_items(
    schema: Option<&Value>,
    at: &str,
    tool: usize,
    rules: &mut String,
) -> Result<String, ToolCallError> {
    let fail = |param: String, message: &str| ToolCallError {
        param,
        message: message.to_string(),
    };
    let empty = Map::new();
    let properties = match schema.and_then(|s| s.get("properties")) {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(p)) => p,
        Some(_) => return Err(fail(format!("{at}.properties"), "must be an object")),
    };
    let required: Vec<&str> = match schema.and_then(|s| s.get("required")) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(r)) => r.iter().filter_map(Value::as_str).collect(),
        Some(_) => return Err(fail(format!("{at}.required"), "must be a list of names")),
    };
    if let Some(missing) = required.iter().find(|r| !properties.contains_key(**r)) {
        return Err(fail(
            format!("{at}.required"),
            &format!("names {missing:?}, which is not among the properties"),
        ));
    }
    let mut order: Vec<(&String, &Value)> = properties
        .iter()
        .filter(|(name, _)| required.contains(&name.as_str()))
        .collect();
    order.extend(
        properties
            .iter()
            .filter(|(name, _)| !required.contains(&name.as_str())),
    );
    let mut items = Vec::new();
    for (j, (name, schema)) in order.into_iter().enumerate() {
        let value = value_rule(schema)
            .map_err(|message| fail(format!("{at}.properties.{name}"), &message))?;
        let rule = format!("p_{tool}_{j}");
        let open = literal(&format!("<parameter={name}>\n"));
        let close = literal("\n</parameter>\n");
        rules.push_str(&format!("{rule}: {open} {value} {close}\n"));
        let optional = if required.contains(&name.as_str()) {
            ""
        } else {
            "?"
        };
        items.push(format!("{rule}{optional}"));
    }
    Ok(items.join(" "))
}

/// A parameter's value as the parser reads it back: raw text for a string, else JSON.
fn value_rule(schema: &Value) -> Result<String, String> {
    let types: Vec<&str> = match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    match types.as_slice() {
        ["string"] => string_rule(schema),
        [] => Err("needs a \"type\" for a forced tool call (it decides how the value is read)".into()),
        ts if ts.contains(&"string") => Err(
            "mixes \"string\" with other types, which a forced tool call cannot write unambiguously"
                .into(),
        ),
        _ => Ok(json_rule(schema.clone())),
    }
}

/// A string parameter's raw text: its `enum` or `const`, its `pattern`, or any text without
/// `<` (which would open the closing tag) within its length bounds.
fn string_rule(schema: &Value) -> Result<String, String> {
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        let options: Vec<String> = options
            .iter()
            .map(|o| o.as_str().map(literal).ok_or("enum values must be strings"))
            .collect::<Result<_, _>>()?;
        if options.is_empty() {
            return Err("enum must not be empty".into());
        }
        return Ok(format!("({})", options.join(" | ")));
    }
    if let Some(value) = schema.get("const") {
        return value
            .as_str()
            .map(literal)
            .ok_or_else(|| "const must be a string".into());
    }
    if schema.get("format").is_some() {
        return Err("string format is not supported in a forced tool call".into());
    }
    if let Some(pattern) = schema.get("pattern") {
        let pattern = pattern.as_str().ok_or("pattern must be a string")?;
        // A schema's pattern searches; the whole value matching it is one of its matches.
        let pattern = pattern.strip_prefix('^').unwrap_or(pattern);
        let pattern = pattern.strip_suffix('$').unwrap_or(pattern);
        return Ok(format!("/{}/", pattern.replace('/', "\\/")));
    }
    let bound = |key: &str| schema.get(key).and_then(Value::as_u64);
    let min = bound("minLength").unwrap_or(0);
    Ok(match bound("maxLength") {
        Some(max) => format!("/[^<]{{{min},{max}}}/"),
        None => format!("/[^<]{{{min},}}/"),
    })
}

/// A Lark string literal.
fn literal(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}
