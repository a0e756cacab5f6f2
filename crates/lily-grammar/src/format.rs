//! `response_format` (chat), `text.format` (Responses) as Lark grammars for llguidance.

use serde_json::{Value, json};

#[derive(Clone, Debug, PartialEq)]
pub enum OutputFormat {
    /// Any one JSON object.
    JsonObject,
    /// One JSON value valid against this schema.
    JsonSchema(Value),
}

impl OutputFormat {
    /// The Lark rule `answer`: one JSON value, written compactly (flexible whitespace would let
    /// a model pad forever).
    pub fn answer_lark(&self) -> String {
        let schema = match self {
            OutputFormat::JsonObject => json!({"type": "object"}),
            OutputFormat::JsonSchema(schema) => schema.clone(),
        };
        format!("answer: {}\n", json_rule(schema))
    }
}

/// `%json {…}`: a JSON value valid against `schema`, without whitespace between its tokens.
pub fn json_rule(mut schema: Value) -> String {
    if let Value::Object(map) = &mut schema {
        map.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"}),
        );
    }
    format!("%json {schema}")
}
