use serde_json::{Value, json};

use super::*;

/// What a client ends up with: reasoning, content, and (name, JSON arguments) per call.
#[derive(Debug, PartialEq)]
struct Parsed {
    reasoning: String,
    content: String,
    calls: Vec<(String, String)>,
}

fn collect(deltas: impl IntoIterator<Item = ChatDelta>) -> Parsed {
    let mut parsed = Parsed {
        reasoning: String::new(),
        content: String::new(),
        calls: Vec::new(),
    };
    for delta in deltas {
        match delta {
            ChatDelta::Reasoning(t) => parsed.reasoning.push_str(&t),
            ChatDelta::Content(t) => parsed.content.push_str(&t),
            ChatDelta::ToolCallStart { index, name } => {
                assert_eq!(index, parsed.calls.len(), "calls are numbered in order");
                parsed.calls.push((name, String::new()));
            }
            ChatDelta::ToolCallArguments { index, fragment } => {
                parsed.calls[index].1.push_str(&fragment);
            }
        }
    }
    parsed
}

fn weather_tools() -> ToolSchemas {
    ToolSchemas::from_tools(&[json!({"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}})])
}

/// Parses `text` in the given pieces.
fn parse_pieces(pieces: &[&str], thinking: bool, tools: Option<ToolSchemas>) -> Parsed {
    let mut parser = ChatOutputParser::new(thinking, tools);
    let mut deltas = Vec::new();
    for piece in pieces {
        deltas.extend(parser.push(piece));
    }
    deltas.extend(parser.finish());
    collect(deltas)
}

/// The parse of `text` whole, after checking that every way of cutting it into two pieces, and
/// feeding it one character at a time, gives the same result.
fn parse(text: &str, thinking: bool, tools: Option<ToolSchemas>) -> Parsed {
    let whole = parse_pieces(&[text], thinking, tools.clone());
    for (cut, _) in text.char_indices().skip(1) {
        let split = parse_pieces(&[&text[..cut], &text[cut..]], thinking, tools.clone());
        assert_eq!(split, whole, "cut at byte {cut} of {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(parse_pieces(&chars, thinking, tools), whole, "char by char");
    whole
}

#[test]
fn reasoning_and_answer_split_at_the_closing_tag() {
    let parsed = parse("Two and two.\nFour.\n</think>\n\nIt is **4**.", true, None);
    assert_eq!(
        parsed,
        Parsed {
            reasoning: "Two and two.\nFour.".into(),
            content: "It is **4**.".into(),
            calls: vec![],
        }
    );
}

#[test]
fn a_repeated_opening_tag_and_unclosed_reasoning_are_reasoning() {
    let parsed = parse("<think>\nStill thinking <when cut", true, None);
    assert_eq!(parsed.reasoning, "Still thinking <when cut");
    assert_eq!(parsed.content, "");
}

#[test]
fn without_thinking_everything_is_content_and_partial_tags_are_released() {
    let parsed = parse("Hi </thi", false, Some(weather_tools()));
    assert_eq!(parsed.content, "Hi </thi");
    let parsed = parse("a <tool_", false, Some(weather_tools()));
    assert_eq!(parsed.content, "a <tool_");
}

#[test]
fn tool_calls_become_json_arguments_typed_by_the_schema() {
    let text = "Need weather.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n\
                <parameter=city>\nRoma\n</parameter>\n<parameter=days>\n3\n</parameter>\n\
                </function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n\
                <parameter=city>\nSan José\nCR\n</parameter>\n</function>\n</tool_call>";
    let parsed = parse(text, true, Some(weather_tools()));
    assert_eq!(parsed.reasoning, "Need weather.");
    assert_eq!(parsed.content, "Let me check.");
    assert_eq!(parsed.calls.len(), 2);
    assert_eq!(parsed.calls[0].0, "get_weather");
    let args: Value = serde_json::from_str(&parsed.calls[0].1).unwrap();
    assert_eq!(args, json!({"city": "Roma", "days": 3}));
    let args: Value = serde_json::from_str(&parsed.calls[1].1).unwrap();
    assert_eq!(args, json!({"city": "San José\nCR"}));
}

#[test]
fn arguments_stream_one_parameter_at_a_time() {
    let mut parser = ChatOutputParser::new(false, Some(weather_tools()));
    let first = parser.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nRo");
    assert_eq!(
        first,
        vec![ChatDelta::ToolCallStart {
            index: 0,
            name: "get_weather".into()
        }]
    );
    let second = parser.push("ma\n</parameter>\n<param");
    assert_eq!(
        second,
        vec![ChatDelta::ToolCallArguments {
            index: 0,
            fragment: "{\"city\":\"Roma\"".into()
        }]
    );
    assert_eq!(
        parser
            .push("eter=days>\n2\n</parameter>\n</function>\n</tool_call>")
            .len(),
        2
    );
    assert_eq!(parser.finish(), vec![]);
    assert_eq!(parser.tool_calls(), 1);
}

#[test]
fn an_unfinished_call_is_closed_and_a_call_without_function_stays_text() {
    let parsed = parse(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRoma\n</parameter>\n<parameter=da",
        false,
        Some(weather_tools()),
    );
    assert_eq!(
        parsed.calls,
        vec![("get_weather".into(), "{\"city\":\"Roma\"}".into())]
    );

    let parsed = parse(
        "<tool_call>oops</tool_call> done",
        false,
        Some(weather_tools()),
    );
    assert_eq!(parsed.content, "<tool_call>oops</tool_call> done");
    assert!(parsed.calls.is_empty());

    let parsed = parse(
        "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
        false,
        Some(weather_tools()),
    );
    assert_eq!(parsed.calls, vec![("ping".into(), "{}".into())]);
}

#[test]
fn without_tools_tool_call_tags_are_plain_content() {
    let text = "<tool_call>\n<function=f>\n</function>\n</tool_call>";
    let parsed = parse(text, false, None);
    assert_eq!(parsed.content, text);
    assert!(parsed.calls.is_empty());
}

#[test]
fn any_text_in_any_pieces_parses_without_panicking_and_the_same_way() {
    // Fragments that combine into tags, near-tags, whitespace and multi-byte text.
    let fragments = [
        "<",
        ">",
        "</",
        "think",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "get_weather",
        "</function>",
        "<parameter=",
        "city",
        "</parameter>",
        "\n",
        " ",
        "é",
        "雪",
        "🦜",
        "x",
        "{",
        "\"",
    ];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    for _ in 0..300 {
        let text: String = (0..next(40))
            .map(|_| fragments[next(fragments.len())])
            .collect();
        let thinking = next(2) == 0;
        let tools = (next(2) == 0).then(weather_tools);
        let whole = parse_pieces(&[&text], thinking, tools.clone());
        let cuts: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .filter(|_| next(3) == 0)
            .collect();
        let mut pieces = Vec::new();
        let mut start = 0;
        for cut in cuts.into_iter().chain([text.len()]) {
            pieces.push(&text[start..cut]);
            start = cut;
        }
        assert_eq!(
            parse_pieces(&pieces, thinking, tools),
            whole,
            "{text:?} in {pieces:?}"
        );
        for (_, arguments) in &whole.calls {
            assert!(
                serde_json::from_str::<Value>(arguments)
                    .unwrap()
                    .is_object(),
                "{text:?}"
            );
        }
    }
}
