//! Qwen writes tool-call arguments as XML text (`<parameter=city>\nRome\n</parameter>`); clients
//! want JSON. Each value is typed by the tool's JSON schema, as the reference parsers do:
//! strings stay strings, and a value that does not parse as its declared type stays a string
//! rather than being lost.

use std::collections::HashMap;

use serde_json::Value;

/// The declared types of each tool's parameters, from the request's `tools`.
#[derive(Clone, Debug, Default)]
pub struct ToolSchemas {
    by_function: HashMap<String, HashMap<String, Vec<String>>>,
}

impl ToolSchemas {
    /// Reads `[{"type": "function", "function": {"name", "parameters": {"properties": …}}}]`;
    /// anything it does not understand leaves the parameter untyped (a string).
    pub fn from_tools(tools: &[Value]) -> Self {
        let mut by_function = HashMap::new();
        for tool in tools {
            let function = tool.get("function").unwrap_or(tool);
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                continue;
            };
            let mut params = HashMap::new();
            if let Some(properties) = function
                .pointer("/parameters/properties")
                .and_then(Value::as_object)
            {
                for (param, schema) in properties {
                    let types = match schema.get("type") {
                        Some(Value::String(t)) => vec![t.clone()],
                        Some(Value::Array(ts)) => ts
                            .iter()
                            .filter_map(Value::as_str)
                            .map(str::to_string)
                            .collect(),
                        _ => Vec::new(),
                    };
                    params.insert(param.clone(), types);
                }
            }
            by_function.insert(name.to_string(), params);
        }
        ToolSchemas { by_function }
    }

    /// The JSON value of `raw` for `param` of `function`.
    pub fn convert(&self, function: &str, param: &str, raw: &str) -> Value {
        let types = self
            .by_function
            .get(function)
            .and_then(|params| params.get(param))
            .map(Vec::as_slice)
            .unwrap_or_default();
        types
            .iter()
            .find_map(|t| typed_value(t, raw))
            .unwrap_or_else(|| Value::String(raw.to_string()))
    }
}

fn typed_value(declared: &str, raw: &str) -> Option<Value> {
    let trimmed = raw.trim();
    let parsed = || serde_json::from_str::<Value>(trimmed).ok();
    match declared {
        "integer" => parsed().filter(|v| v.is_i64() || v.is_u64()),
        "number" => parsed().filter(Value::is_number),
        "boolean" => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        "object" => parsed().filter(Value::is_object),
        "array" => parsed().filter(Value::is_array),
        "null" => (trimmed == "null" || trimmed == "None").then_some(Value::Null),
        // "string" and unknown types keep the text.
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_follow_the_declared_types_and_fall_back_to_strings() {
        let tools = [
            json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
                "o": {"type": "object"}, "s": {"type": "string"}, "u": {"type": ["null", "integer"]}
            }}}}),
        ];
        let schemas = ToolSchemas::from_tools(&tools);
        assert_eq!(schemas.convert("f", "n", "42"), json!(42));
        assert_eq!(schemas.convert("f", "n", "4.5"), json!("4.5"));
        assert_eq!(schemas.convert("f", "x", "4.5"), json!(4.5));
        assert_eq!(schemas.convert("f", "b", "True"), json!(true));
        assert_eq!(schemas.convert("f", "o", "{\"k\": [1]}"), json!({"k": [1]}));
        assert_eq!(schemas.convert("f", "o", "not json"), json!("not json"));
        assert_eq!(schemas.convert("f", "s", "42"), json!("42"));
        assert_eq!(schemas.convert("f", "u", "7"), json!(7));
        assert_eq!(schemas.convert("f", "missing", "7"), json!("7"));
        assert_eq!(schemas.convert("g", "n", "7"), json!("7"));
    }
}
