//! The Qwen3.6 chat template over arbitrary request contexts (messages, tools, kwargs): a render or
//! an error, never a panic or a hang.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use lily_chat::ChatTemplate;

const TEMPLATE: &str = include_str!("../../assets/qwen3.6/chat_template.jinja");

fn template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| ChatTemplate::new(TEMPLATE).expect("the shipped template compiles"))
}

fuzz_target!(|data: &[u8]| {
    let Ok(context) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let _ = template().render(&context);
});
