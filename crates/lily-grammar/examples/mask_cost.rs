//! What constrained decoding costs per token at the real 248K vocabulary: builds the grammar
//! engine for Qwen3.6's tokenizer, compiles a few grammars, and times the mask (llguidance's
//! computation plus setting the forbidden logits to -inf, as the host applies it; on CUDA the
//! device applies the bits instead) over generations driven by random logits. Not a test: a
//! measurement, whose figure goes into docs/BENCHMARKS.md.
//!
//!     cargo run -p lily-grammar --example mask_cost [-- TOKENS]

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lily_chat::TextTokenizer;
use lily_core::rng::Rng;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::sampling_stage::Grammar;
use lily_grammar::{Grammars, OutputFormat, tool_call_lark};
use serde_json::json;

/// The model's rows of logits (the tokenizer's ids plus padding).
const VOCAB: usize = 248_320;

fn main() -> Result<()> {
    let tokens: usize = match std::env::args().nth(1) {
        Some(n) => n.parse().context("TOKENS must be a count")?,
        None => 2_000,
    };
    let tokenizer = TextTokenizer::embedded()?;
    let turn_end = tokenizer
        .special_id("<|im_end|>")
        .context("no <|im_end|>")?;
    let started = Instant::now();
    let grammars = Grammars::new(&tokenizer, vec![turn_end])?;
    println!(
        "grammar engine for {} tokens: {:.0} ms",
        tokenizer.decodable_len(),
        ms(started.elapsed())
    );
    let nested = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 100000},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat", "lon"]}},
        "required": ["name", "tags", "size", "where"]});
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}),
    ];
    let cases = [
        ("json_object", OutputFormat::JsonObject.answer_lark()),
        (
            "json_schema (nested)",
            OutputFormat::JsonSchema(nested).answer_lark(),
        ),
        ("forced tool call", tool_call_lark(&tools, None, true)?),
    ];
    println!("{tokens} tokens each, random logits at temperature 1:");
    for (name, lark) in cases {
        let started = Instant::now();
        let grammar = grammars.compile(&lark, false)?;
        let compile = started.elapsed();
        let mut times = Vec::with_capacity(tokens);
        let mut rng = Rng::new(1);
        let mut generated = 0;
        while generated < tokens {
            // A fresh generation whenever one ends (the grammar completes).
            let mut walk = grammar.start()?;
            let mut sampler = Sampler::new(SamplingParams {
                temperature: 1.0,
                seed: generated as u64,
                ..SamplingParams::greedy()
            });
            while generated < tokens {
                let mut logits: Vec<f32> = (0..VOCAB).map(|_| rng.next_f32() * 10.0).collect();
                let started = Instant::now();
                walk.allowed()?.apply(&mut logits);
                times.push(started.elapsed());
                let token = sampler.sample(&logits);
                generated += 1;
                if token == turn_end {
                    break;
                }
                walk.advance(token)?;
            }
        }
        times.sort();
        let mean = times.iter().sum::<Duration>() / times.len() as u32;
        println!(
            "  {name:<22} compile {:>6.1} ms   mask mean {:>6.3} ms  p50 {:>6.3}  p99 {:>6.3}  max {:>7.3}",
            ms(compile),
            ms(mean),
            ms(times[times.len() / 2]),
            ms(times[times.len() * 99 / 100]),
            ms(times[times.len() - 1]),
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
