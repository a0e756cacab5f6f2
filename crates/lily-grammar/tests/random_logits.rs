//! Whatever the logits, a constrained generation follows its grammar: random logits over the
//! real 248K vocabulary, sampled and greedy, through the sampling stage.

use std::sync::OnceLock;

use lily_chat::TextTokenizer;
use lily_core::rng::Rng;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::sampling_stage::{Grammar, SamplingStage};
use lily_grammar::{CompiledGrammar, Grammars, OutputFormat, tool_call_lark};
use serde_json::{Value, json};

/// The model's vocabulary (the tokenizer's plus padding rows).
const VOCAB: usize = 248_320;
const MAX_TOKENS: usize = 400;

fn tokenizer() -> &'static TextTokenizer {
    static TOKENIZER: OnceLock<TextTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| TextTokenizer::embedded().unwrap())
}

fn turn_end() -> u32 {
    tokenizer().special_id("<|im_end|>").unwrap()
}

fn grammars() -> &'static Grammars {
    static GRAMMARS: OnceLock<Grammars> = OnceLock::new();
    GRAMMARS.get_or_init(|| Grammars::new(tokenizer(), vec![turn_end()]).unwrap())
}

/// Generates from random logits until the turn ends; the text, or `None` at `MAX_TOKENS`. The
/// logits favour `prefix` first (a reasoning that a thinking reply opens with), and the end of
/// the turn still more while it lasts.
fn generate(
    grammar: &CompiledGrammar,
    temperature: f32,
    seed: u64,
    prefix: &[u32],
) -> Option<String> {
    let params = SamplingParams {
        temperature,
        seed,
        ..SamplingParams::greedy()
    };
    let sampler = Sampler::new(params).with_vocab_limit(tokenizer().decodable_len());
    let mut stage = SamplingStage::new(sampler, None).with_constraint(grammar.start().unwrap());
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut tokens = Vec::new();
    for step in 0..MAX_TOKENS {
        let mut logits: Vec<f32> = (0..VOCAB).map(|_| rng.next_f32() * 10.0).collect();
        // A model that wants to write `prefix` first (the reasoning a thinking reply opens with).
        if let Some(&want) = prefix.get(step) {
            logits[want as usize] = 1e3;
            logits[turn_end() as usize] = 2e3;
        }
        let token = stage.pick(&logits).unwrap().token;
        if token == turn_end() {
            return Some(tokenizer().decode(&tokens));
        }
        tokens.push(token);
    }
    None
}

fn check(schema: &Value, answer_lark: &str, valid: impl Fn(&str) -> bool) {
    let grammar = grammars().compile(answer_lark, false).unwrap();
    let mut finished = 0;
    for (seed, temperature) in [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)] {
        if let Some(text) = generate(&grammar, temperature, seed, &[]) {
            assert!(valid(&text), "{schema}: {text:?}");
            finished += 1;
        }
    }
    assert!(
        finished >= 3,
        "{schema}: {finished} of 4 finished in {MAX_TOKENS} tokens"
    );
}

#[test]
fn json_schema_outputs_validate_whatever_the_logits() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "colour": {"enum": ["red", "green"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["name", "age", "colour", "tags"],
        "additionalProperties": false,
    });
    check(
        &schema,
        &OutputFormat::JsonSchema(schema.clone()).answer_lark(),
        |text| {
            let Ok(Value::Object(v)) = serde_json::from_str::<Value>(text) else {
                return false;
            };
            v.len() == 4
                && v["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
                && v["age"].as_u64().is_some_and(|a| a <= 150)
                && (v["colour"] == "red" || v["colour"] == "green")
                && v["tags"]
                    .as_array()
                    .is_some_and(|t| t.len() <= 3 && t.iter().all(Value::is_boolean))
        },
    );
}

#[test]
fn forced_tool_calls_carry_typed_arguments() {
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "days"],
        }}}),
    ];
    let lark = tool_call_lark(&tools, Some("get_weather"), false).unwrap();
    check(&tools[0], &lark, |text| {
        let mut parser = lily_chat::ChatOutputParser::new(
            false,
            Some(lily_chat::ToolSchemas::from_tools(&tools)),
        );
        let mut deltas = parser.push(text);
        deltas.extend(parser.finish());
        let args: String = deltas
            .iter()
            .filter_map(|d| match d {
                lily_chat::ChatDelta::ToolCallArguments { fragment, .. } => Some(fragment.as_str()),
                _ => None,
            })
            .collect();
        let Ok(Value::Object(a)) = serde_json::from_str::<Value>(&args) else {
            return false;
        };
        let city = a["city"].as_str().unwrap_or("");
        parser.tool_calls() == 1
            && city.len() >= 2
            && city.chars().next().is_some_and(|c| c.is_ascii_uppercase())
            && a["days"].as_u64().is_some_and(|d| (1..=7).contains(&d))
            && a.get("unit").is_none_or(|u| u == "c" || u == "f")
    });
}

#[test]
fn reasoning_is_free_and_the_answer_after_it_is_not() {
    let format = OutputFormat::JsonSchema(json!({"type": "boolean"}));
    let grammar = grammars().compile(&format.answer_lark(), true).unwrap();
    let reasoning = tokenizer().encode("Let me think.</think>\n\n").unwrap();
    let text = generate(&grammar, 1.0, 9, &reasoning).unwrap();
    let answer = text.rsplit("</think>").next().unwrap().trim();
    assert!(answer == "true" || answer == "false", "{text:?}");
    assert!(text.starts_with("Let me think."), "{text:?}");
}

#[test]
fn bad_grammars_and_tool_choices_are_errors() {
    let bad =
        OutputFormat::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "frob"}}}));
    assert!(grammars().compile(&bad.answer_lark(), false).is_err());
    let tools = [
        json!({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"anyOf": [{"type": "string"}]}}}}}),
    ];
    let error = tool_call_lark(&tools, None, true).unwrap_err();
    assert_eq!(error.param, "tools[0].function.parameters.properties.x");
    let error = tool_call_lark(&tools, Some("g"), true).unwrap_err();
    assert_eq!(error.param, "tool_choice");
}

/// What a client controls (names, patterns, enum values, schemas) reaches the grammar's text;
/// whatever it holds, compiling answers (an error or a grammar), never panics, and a grammar
/// that compiles is followed.
#[test]
fn hostile_names_and_patterns_compile_or_fail_cleanly() {
    let strings = [
        "(",
        ")",
        "/",
        "\\",
        "\"",
        "\n",
        "a/b",
        "[",
        "{2,1}",
        "\u{0}",
        "é\u{1F600}",
        "<",
        "",
        "a{99999}",
        "%json",
        "\"start: x\"",
    ];
    for text in strings {
        let tools = [
            json!({"type": "function", "function": {"name": text, "parameters": {
            "type": "object", "properties": {
                text: {"type": "string", "pattern": text},
                "e": {"type": "string", "enum": [text, "x"]},
            }, "required": [text]}}}),
        ];
        if let Ok(lark) = tool_call_lark(&tools, None, false) {
            let _ = grammars().compile(&lark, false);
        }
        let schema = json!({"type": "object", "properties": {text: {"type": "string", "pattern": text}},
                            "required": [text]});
        let _ = grammars().compile(&OutputFormat::JsonSchema(schema).answer_lark(), true);
    }
    let mut deep = json!({"type": "integer"});
    for _ in 0..200 {
        deep = json!({"type": "array", "items": deep, "maxItems": 1});
    }
    let _ = grammars().compile(&OutputFormat::JsonSchema(deep).answer_lark(), false);
    // A name with a quote and a newline is still written exactly.
    let tools = [json!({"type": "function", "function": {"name": "a\"b\nc"}})];
    let grammar = grammars()
        .compile(&tool_call_lark(&tools, None, false).unwrap(), false)
        .unwrap();
    let text = generate(&grammar, 1.0, 5, &[]).unwrap();
    assert_eq!(
        text,
        "<tool_call>\n<function=a\"b\nc>\n</function>\n</tool_call>"
    );
}
