//! `lily quantize` and `lily score --compare` as a user runs them, on the mlx-lm fixtures.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn lily(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .output()
        .expect("lily runs")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn long_tokens() -> String {
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-mlx-q4").join("cases.json")).unwrap(),
    )
    .unwrap();
    cases["sequences"][1]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn score_json(args: &[&str]) -> Value {
    let o = lily(args);
    assert!(o.status.success(), "{}", text(&o.stderr));
    serde_json::from_str(&text(&o.stdout)).unwrap()
}

#[test]
fn quantize_then_score_against_the_source_and_mlx_lm() {
    let out = tempfile::tempdir().unwrap();
    let q4 = out.path().join("q4");
    let hf = fixture("tiny-mlx-hf");
    let o = lily(&[
        "quantize",
        "--model",
        hf.to_str().unwrap(),
        "--out",
        q4.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("wrote 182 tensors"),
        "{}",
        text(&o.stderr)
    );

    let tokens = long_tokens();
    let base = ["score", "--device", "cpu", "--json", "--tokens", &tokens];
    // Our 4-bit directory against mlx-lm's conversion of the same weights: the same model.
    let mlx = fixture("tiny-mlx-q4");
    let mut args = base.to_vec();
    args.extend([
        "--model",
        q4.to_str().unwrap(),
        "--compare",
        mlx.to_str().unwrap(),
    ]);
    let same = score_json(&args);
    assert_eq!(same["compare"]["top1_agreement"], 1.0);
    assert_eq!(same["compare"]["perplexity_ratio"], 1.0);

    // 4-bit (quantised at load) against the bf16 weights it came from: close, not equal.
    let mut args = base.to_vec();
    args.extend(["--model", hf.to_str().unwrap(), "--quantize", "q4"]);
    args.extend(["--compare", hf.to_str().unwrap()]);
    let fidelity = score_json(&args);
    let agreement = fidelity["compare"]["top1_agreement"].as_f64().unwrap();
    let ratio = fidelity["compare"]["perplexity_ratio"].as_f64().unwrap();
    assert!(agreement > 0.3 && agreement < 1.0, "{agreement}");
    assert!(ratio > 0.5 && ratio < 2.0 && ratio != 1.0, "{ratio}");
    assert_eq!(fidelity["perplexity"], same["perplexity"]);

    // `generate --quantize q4` decodes with the weights `lily quantize` writes: the same tokens.
    let generate = |model: &Path, quantize: bool| {
        let mut args = vec![
            "generate",
            "--device",
            "cpu",
            "--json",
            "--temperature",
            "0",
        ];
        args.extend(["--max-tokens", "12", "--ignore-eos", "--tokens", &tokens]);
        args.extend(["--model", model.to_str().unwrap()]);
        if quantize {
            args.extend(["--quantize", "q4"]);
        }
        score_json(&args)["tokens"].clone()
    };
    let at_load = generate(&hf, true);
    assert_eq!(at_load.as_array().map(Vec::len), Some(12), "{at_load}");
    assert_eq!(at_load, generate(&q4, false));
    // `bench --quantize q4` measures, and counts the bytes of, the 4-bit weights.
    let bench_bytes = |quantize: bool| {
        let json = out.path().join(format!("bench-{quantize}.json"));
        let mut args = vec![
            "bench",
            "--device",
            "cpu",
            "--prompt-lens",
            "8",
            "--contexts",
            "8",
        ];
        args.extend([
            "--model",
            hf.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ]);
        if quantize {
            args.extend(["--quantize", "q4"]);
        }
        let o = lily(&args);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        report["weight_bytes_per_decoded_token"].as_f64().unwrap()
    };
    let (f32_bytes, q4_bytes) = (bench_bytes(false), bench_bytes(true));
    assert!(
        q4_bytes > 0.0 && q4_bytes * 5.0 < f32_bytes,
        "{q4_bytes} vs {f32_bytes}"
    );
    // And every command that loads a model takes the flag.
    for command in ["serve", "chat", "bench"] {
        let o = lily(&[command, "--help"]);
        assert!(
            text(&o.stdout).contains("--quantize <QUANTIZE>"),
            "{command}"
        );
    }
}

#[test]
fn quantize_refuses_an_mlx_checkpoint_with_one_line() {
    let out = tempfile::tempdir().unwrap();
    let o = lily(&[
        "quantize",
        "--model",
        fixture("tiny-mlx-q4").to_str().unwrap(),
        "--out",
        out.path().join("x").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("already MLX-quantised"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}
