//! Token-by-token output with the real tokenizer: characters split over tokens, stop strings
//! that span tokens.

use lily_chat::{TextStream, TextTokenizer};

#[test]
fn characters_split_over_tokens_come_out_whole() {
    let tokenizer = TextTokenizer::embedded().unwrap();
    let text = "Rare: 𝔘𝔫𝔦 ꙮ 🫠🦜 and 雪.";
    let ids = tokenizer.encode(text).unwrap();
    let mut stream = TextStream::new(&tokenizer, &[]);
    let mut pieces = Vec::new();
    for &id in &ids {
        let step = stream.push(id);
        assert!(!step.stopped);
        pieces.push(step.text);
    }
    pieces.push(stream.finish().text);
    assert_eq!(pieces.concat(), text);
    assert!(
        pieces.iter().any(String::is_empty),
        "some token ends inside a character, so its step releases nothing: {pieces:?}"
    );
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
}

#[test]
fn a_stop_string_spanning_tokens_ends_the_text_before_it() {
    let tokenizer = TextTokenizer::embedded().unwrap();
    let ids = tokenizer.encode("Hello, world! The END is near.").unwrap();
    let stops = vec!["D is n".to_string()];
    let mut stream = TextStream::new(&tokenizer, &stops);
    let mut text = String::new();
    let mut stopped_after = None;
    for (i, &id) in ids.iter().enumerate() {
        let step = stream.push(id);
        text.push_str(&step.text);
        if step.stopped {
            stopped_after = Some(i);
            break;
        }
    }
    assert_eq!(text, "Hello, world! The EN");
    // The stop completes only with the token that brings " near".
    let near = ids
        .iter()
        .position(|&id| tokenizer.decode(&[id]) == " near")
        .unwrap();
    assert_eq!(stopped_after, Some(near));
}

#[test]
fn invalid_bytes_become_replacement_characters_at_once() {
    let tokenizer = TextTokenizer::embedded().unwrap();
    // Byte-level tokens for a lone continuation byte (0x80) and then "ok".
    let lone = (0..tokenizer.decodable_len() as u32)
        .find(|&id| tokenizer.piece(id) == Some(&[0x80][..]))
        .unwrap();
    let ok = tokenizer.encode("ok").unwrap();
    let mut stream = TextStream::new(&tokenizer, &[]);
    assert_eq!(stream.push(lone).text, "\u{FFFD}");
    assert_eq!(stream.push(ok[0]).text, "ok");
}
