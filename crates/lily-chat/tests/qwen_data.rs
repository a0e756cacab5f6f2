//! The tokenizer and chat template against the reference data in assets/qwen3.6 (token ids from
//! the official tokenizer's public tests; prompts rendered by Python jinja2 as transformers does).

use lily_chat::{TextModel, TextTokenizer};
use serde_json::Value;

fn cases(json: &str) -> Vec<Value> {
    let root: Value = serde_json::from_str(json).expect("reference data is JSON");
    root["cases"].as_array().expect("a list of cases").clone()
}

#[test]
fn the_13_token_vectors_encode_and_decode() {
    let tokenizer = TextTokenizer::embedded().unwrap();
    let cases = cases(include_str!(
        "../../../assets/qwen3.6/tokenizer_oracle.json"
    ));
    assert_eq!(cases.len(), 13);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(
            tokenizer.encode(text).unwrap(),
            expected,
            "encoding {text:?}"
        );
        // Decoding skips special tokens (<|im_start|>, <|vision_start|>, …) but keeps <think>
        // and <tool_call>, which are ordinary added tokens.
        let special = [
            "<|im_start|>",
            "<|im_end|>",
            "<|vision_start|>",
            "<|image_pad|>",
            "<|vision_end|>",
        ];
        let visible = special
            .iter()
            .fold(text.to_string(), |t, s| t.replace(s, ""));
        // The normaliser composes "café" written with a combining accent; decoding gives NFC.
        let visible = visible.replace("cafe\u{301}", "café");
        assert_eq!(
            tokenizer.decode(&expected),
            visible,
            "decoding {expected:?}"
        );
        // With special tokens written out, decoding gives the text back (up to NFC).
        assert_eq!(
            tokenizer.decode_with_special(&expected),
            text.replace("cafe\u{301}", "café"),
            "decoding {expected:?} with special tokens"
        );
        // Qwen's tokenizer adds no BOS or EOS of its own.
        assert_eq!(tokenizer.encode_with_special(text).unwrap(), expected);
    }
}

#[test]
fn control_tokens_have_the_documented_ids() {
    let tokenizer = TextTokenizer::embedded().unwrap();
    assert_eq!(tokenizer.special_id("<|endoftext|>"), Some(248044));
    assert_eq!(tokenizer.special_id("<|im_end|>"), Some(248046));
    assert_eq!(tokenizer.token_id("</think>"), Some(248069));
    assert_eq!(tokenizer.token_id("<tool_call>"), Some(248058));
    assert_eq!(
        tokenizer.special_id("<think>"),
        None,
        "<think> is not special"
    );
    assert_eq!(tokenizer.decodable_len(), 248077);
}

#[test]
fn the_8_template_cases_render_exactly() {
    let model = TextModel::embedded().unwrap();
    let cases = cases(include_str!(
        "../../../assets/qwen3.6/chat_template_cases.json"
    ));
    assert_eq!(cases.len(), 8);
    for case in cases {
        let rendered = model.template.render(&case["ctx"]).unwrap();
        assert_eq!(
            rendered,
            case["expected"].as_str().unwrap(),
            "case {}",
            case["name"]
        );
    }
}
