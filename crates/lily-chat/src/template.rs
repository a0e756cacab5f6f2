//! The chat template, rendered as transformers renders it: jinja2 with trim_blocks and
//! lstrip_blocks, no trailing newline, a `raise_exception` function, Python string methods, and a
//! `tojson` that writes what Python's `json.dumps(x, ensure_ascii=False)` writes.

use std::fmt::Write as _;

use anyhow::{Context, Result, anyhow};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value as JinjaValue};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::Value;

/// Qwen3.6's `chat_template.jinja` (provenance: assets/qwen3.6/README.md).
pub const QWEN36_CHAT_TEMPLATE: &str = include_str!("../../../assets/qwen3.6/chat_template.jinja");

const TEMPLATE_NAME: &str = "chat";

pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| anyhow!("{e}"))?;
        env.set_syntax(syntax);
        // Prompts are plain text: nothing may be HTML-escaped.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("chat template does not parse: {e}"))?;
        Ok(ChatTemplate { env })
    }

    /// Renders `context` (`messages`, `tools`, `add_generation_prompt`, `enable_thinking`, …).
    /// A `raise_exception` in the template becomes an error with its message.
    pub fn render(&self, context: &Value) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .context("chat template")?;
        let context: JinjaValue = serde_json::from_value(context.clone())
            .map_err(|e| anyhow!("chat template context: {e}"))?;
        template.render(context).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => anyhow!(
                "{}",
                e.detail()
                    .unwrap_or("the chat template rejected the messages")
            ),
            _ => anyhow!("rendering the chat template: {e}"),
        })
    }
}

fn raise_exception(message: String) -> Result<JinjaValue, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)`: `", "` and `": "` separators, keys in
/// insertion order, non-ASCII text as is.
fn tojson(
    value: JinjaValue,
    indent: Option<usize>,
    kwargs: Kwargs,
) -> Result<JinjaValue, JinjaError> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(n) => Some(n),
        None => indent,
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&mut out, &json, indent, 0);
    Ok(JinjaValue::from_safe_string(out))
}

fn write_python_json(out: &mut String, value: &Value, indent: Option<usize>, depth: usize) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    // Python's separators: "," + newline when indenting, ", " when not.
    let item_separator = if indent.is_some() { "," } else { ", " };
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                write_python_json(out, item, indent, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                let _ = write!(out, "{}: ", Value::String(key.clone()));
                write_python_json(out, item, indent, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        // Scalars, `[]` and `{}` print the same in both languages.
        other => {
            let _ = write!(out, "{other}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let value = json!({"b": [1, 2.5, "é\"\n"], "a": {}, "c": [], "d": null, "e": true});
        let mut out = String::new();
        write_python_json(&mut out, &value, None, 0);
        assert_eq!(
            out,
            r#"{"b": [1, 2.5, "é\"\n"], "a": {}, "c": [], "d": null, "e": true}"#
        );
        let mut out = String::new();
        write_python_json(&mut out, &json!({"k": [1, {"x": 2}]}), Some(2), 0);
        assert_eq!(
            out,
            "{\n  \"k\": [\n    1,\n    {\n      \"x\": 2\n    }\n  ]\n}"
        );
    }

    #[test]
    fn raise_exception_becomes_the_error_message() {
        let template = ChatTemplate::new(QWEN36_CHAT_TEMPLATE).unwrap();
        let err = template
            .render(&json!({"messages": [], "add_generation_prompt": true}))
            .unwrap_err();
        assert_eq!(err.to_string(), "No messages provided.");
        let err = template
            .render(&json!({"messages": [{"role": "assistant", "content": "hi"}]}))
            .unwrap_err();
        assert_eq!(err.to_string(), "No user query found in messages.");
    }
}
