//! Tokenising a long prompt on one thread (the tokenizers crate directly) against
//! `TextTokenizer::encode`, which cuts it over threads (src/cuts.rs), and a conversation's next
//! turn, which starts from the last turn's ids (src/recent.rs): medians of 15, and the same ids
//! asserted. `cargo run --release -p lily-chat --example tokenize_speed`.

use std::time::Instant;

fn median_ms(mut run: impl FnMut() -> Vec<u32>) -> (f64, Vec<u32>) {
    let mut times = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..15 {
        let start = Instant::now();
        ids = run();
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], ids)
}

fn main() -> anyhow::Result<()> {
    let ours = lily_chat::TextTokenizer::embedded()?;
    let json = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/qwen3.6/tokenizer.json"),
    );
    let plain = match json {
        Ok(json) => tokenizers::Tokenizer::from_bytes(json).map_err(|e| anyhow::anyhow!("{e}"))?,
        Err(e) => anyhow::bail!("reading ../shared/data/qwen3.6/tokenizer.json: {e}"),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("{threads} threads available");
    // The text tokenised on this thread by the tokenizers crate, and by ours: medians and ids.
    let both = |text: &str| {
        let plain = median_ms(|| {
            let encoding = plain.encode_fast(text, false).expect("tokenizing");
            encoding.get_ids().to_vec()
        });
        let ours = median_ms(|| ours.encode(text).expect("tokenizing"));
        assert_eq!(ours.1, plain.1);
        (plain.0, ours.0, plain.1.len())
    };
    for repeats in [100, 3200] {
        let text = format!(
            "<|im_start|>user\n{}<|im_end|>\n",
            "The quick brown fox jumps over the lazy dog. ".repeat(repeats)
        );
        let (one, cut, tokens) = both(&text);
        println!("{tokens} tokens: one thread {one:.2} ms, cut {cut:.2} ms");
        let next = format!(
            "{text}<|im_start|>assistant\nSure.<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n"
        );
        let (fresh, reused, _) = both(&next);
        println!(
            "  the next turn: one thread {fresh:.2} ms, from the last turn's ids {reused:.2} ms"
        );
    }
    Ok(())
}
