//! The streamed reasoning / tool-call parser: arbitrary text cut at arbitrary points must parse
//! without panicking, and the same text whole or in pieces must give the same result.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lily_chat::{ChatDelta, ChatOutputParser, ToolSchemas};

fn run(pieces: &[&str], thinking: bool) -> Vec<ChatDelta> {
    let tools = ToolSchemas::from_tools(&[serde_json::json!({
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}
    })]);
    let mut parser = ChatOutputParser::new(thinking, Some(tools));
    let mut out = Vec::new();
    for p in pieces {
        out.extend(parser.push(p));
    }
    out.extend(parser.finish());
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    // Cut the text at char boundaries chosen by the first byte.
    let step = (first as usize % 7) + 1;
    let mut pieces = Vec::new();
    let mut start = 0;
    for (i, _) in text.char_indices().skip(1).step_by(step) {
        pieces.push(&text[start..i]);
        start = i;
    }
    pieces.push(&text[start..]);
    let thinking = first & 0x80 != 0;
    let _ = run(&pieces, thinking);
    let _ = run(&[text], thinking);
});
