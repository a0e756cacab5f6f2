//! The `lily` binary as a user runs it: the CLI contract of design.md, oracle agreement through
//! the command line, and clear one-line errors (never a panic) for broken checkpoints and input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lily_core::npy;
use lily_core::safetensors_write::{TensorBytes, write_safetensors};
use safetensors::SafeTensors;
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

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn cases(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("cases.json")).unwrap())
        .unwrap()
}

fn join(ids: &Value) -> String {
    ids.as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Asserts a failed run: non-zero exit, a single `error: ` line naming `needle`, no panic.
fn assert_clean_failure(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(
        err.contains(needle),
        "error does not mention {needle:?}: {err}"
    );
}

#[test]
fn score_dumps_the_oracle_logits() {
    let c = cases("tiny-a");
    let seq = &c["sequences"][0];
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("logits.npy");
    let o = lily(&[
        "score",
        "--model",
        fixture("tiny-a").to_str().unwrap(),
        "--tokens",
        &join(&seq["tokens"]),
        "--dump-logits",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, ours) = npy::read_f32(&out).unwrap();
    let (ref_shape, reference) =
        npy::read_f32(&fixture("tiny-a").join(seq["logits"].as_str().unwrap())).unwrap();
    assert_eq!(shape, ref_shape);
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = ours
        .iter()
        .zip(&reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff / scale <= 1e-4, "{}", diff / scale);

    // numpy itself must read the file (scripts/test.sh installs numpy).
    let check = Command::new("python3")
        .args([
            "-c",
            "import numpy, sys; a = numpy.load(sys.argv[1]); print(a.dtype, a.shape)",
        ])
        .arg(&out)
        .output()
        .expect("python3 runs");
    assert!(
        check.status.success(),
        "numpy could not load the file: {}",
        stderr(&check)
    );
    assert_eq!(
        stdout(&check).trim(),
        format!("float32 ({}, {})", shape[0], shape[1])
    );

    let json: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let positions = json["positions"].as_array().unwrap();
    assert_eq!(positions.len(), shape[0]);
    let vocab = shape[1];
    for (t, p) in positions.iter().enumerate() {
        let row = &reference[t * vocab..(t + 1) * vocab];
        let best = (0..vocab).fold(0, |b, i| if row[i] > row[b] { i } else { b });
        assert_eq!(p["argmax"], best, "position {t}");
        if t + 1 < positions.len() {
            let lp = p["logprob"].as_f64().unwrap();
            assert!(lp < 0.0 && lp.is_finite(), "position {t}: {lp}");
        } else {
            assert!(p["logprob"].is_null());
        }
    }
}

#[test]
fn generate_reproduces_the_oracle_greedy_tokens() {
    for name in ["tiny-a", "tiny-b"] {
        let c = cases(name);
        let g = &c["greedy"][0];
        let n = g["generated"].as_array().unwrap().len().to_string();
        let dir = fixture(name);
        let o = lily(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            &join(&g["prompt"]),
            "--max-tokens",
            &n,
            "--temperature",
            "0",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let json: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(json["tokens"], g["generated"], "{name}");
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let run = |seed: &str| {
        let o = lily(&[
            "generate",
            "--model",
            "synthetic:tiny",
            "--tokens",
            "1,2,3",
            "--max-tokens",
            "12",
            "--seed",
            seed,
            "--temperature",
            "1.0",
            "--json",
            "--ignore-eos",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<Value>(&stdout(&o)).unwrap()["tokens"].clone()
    };
    let a = run("5");
    assert_eq!(a.as_array().unwrap().len(), 12);
    assert_eq!(a, run("5"));
    assert_ne!(a, run("6"));
}

#[test]
fn inspect_reports_the_full_size_model_without_allocating_it() {
    let o = lily(&["inspect", "--model", "synthetic:qwen3.6-35b-a3b", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let json: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(json["parameters"], 34_660_610_688u64);
    let text = lily(&["inspect", "--model", "synthetic:qwen3.6-35b-a3b"]);
    assert!(stdout(&text).contains("34.66 B"), "{}", stdout(&text));
}

#[test]
fn bench_prints_its_table() {
    let o = lily(&[
        "bench",
        "--model",
        "synthetic:tiny",
        "--prompt-lens",
        "16,33",
        "--contexts",
        "8",
        "--decode-steps",
        "4",
        "--runs",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("| prefill | 33 |") && out.contains("| decode | 8 |"),
        "{out}"
    );
}

/// The "× llama.cpp" column divides by the peer's figures of the same run (llama-bench JSON),
/// only where the peer measured the same phase and length; a file that is not llama-bench's is
/// refused before the model loads.
#[test]
fn bench_compares_with_the_peer_results_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let peer = dir.path().join("llama.json");
    // A prefill figure at 16 tokens and a decode figure at depth 8; nothing at 33.
    std::fs::write(
        &peer,
        r#"[{"n_prompt": 16, "n_gen": 0, "n_depth": 0, "avg_ts": 0.001},
            {"n_prompt": 0, "n_gen": 64, "n_depth": 8, "avg_ts": 0.001}]"#,
    )
    .unwrap();
    let args = |peer: &str| {
        lily(&[
            "bench",
            "--model",
            "synthetic:tiny",
            "--device",
            "cpu",
            "--prompt-lens",
            "16,33",
            "--contexts",
            "8",
            "--decode-steps",
            "2",
            "--runs",
            "1",
            "--peer",
            peer,
        ])
    };
    let o = args(peer.to_str().unwrap());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let ratio = |prefix: &str| -> String {
        let line = out
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{out}"));
        line.trim_end_matches(" |")
            .rsplit("| ")
            .next()
            .unwrap()
            .to_string()
    };
    // Any real speed over 0.001 tok/s is a ratio far above 1; no figure at 33 gives none.
    for row in ["| prefill | 16 |", "| decode | 8 |"] {
        let r: f64 = ratio(row)
            .parse()
            .unwrap_or_else(|_| panic!("{row}: {out}"));
        assert!(r > 10.0, "{row}: {r}");
    }
    assert_eq!(ratio("| prefill | 33 |"), "—", "{out}");
    std::fs::write(&peer, "{\"not\": \"a list\"}").unwrap();
    let o = args(peer.to_str().unwrap());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("llama-bench JSON"), "{}", stderr(&o));
}

/// Copies tiny-a with its tensors edited, then checks `score` fails cleanly naming the problem.
#[test]
fn broken_checkpoints_fail_with_a_clear_error() {
    let src = fixture("tiny-a");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let original: Vec<(String, String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                format!("{:?}", v.dtype()),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect();

    type Edit = fn(&mut Vec<(String, String, Vec<usize>, Vec<u8>)>);
    let edits: [(&str, Edit, &str); 3] = [
        (
            "extra",
            |t| {
                t.push((
                    "model.layers.0.mystery.weight".into(),
                    "F32".into(),
                    vec![2],
                    vec![0; 8],
                ))
            },
            "model.layers.0.mystery.weight",
        ),
        (
            "missing",
            |t| t.retain(|x| x.0 != "model.layers.0.linear_attn.A_log"),
            "layers.0.linear_attn.A_log",
        ),
        (
            "misshaped",
            |t| {
                let x = t
                    .iter_mut()
                    .find(|x| x.0 == "model.layers.0.linear_attn.A_log")
                    .unwrap();
                x.2 = vec![2];
                x.3.truncate(8);
            },
            "shape",
        ),
    ];
    for (label, edit, needle) in edits {
        eprintln!("checkpoint with a {label} tensor");
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
        let mut tensors = original.clone();
        edit(&mut tensors);
        let views: Vec<TensorBytes> = tensors
            .iter()
            .map(|(n, d, s, b)| TensorBytes {
                name: n,
                dtype: d,
                shape: s.clone(),
                bytes: b,
            })
            .collect();
        write_safetensors(&dir.path().join("model.safetensors"), &views).unwrap();
        let o = lily(&[
            "score",
            "--model",
            dir.path().to_str().unwrap(),
            "--tokens",
            "1,2,3",
        ]);
        assert_clean_failure(&o, needle);
    }

    // Truncated: the file ends in the middle of the last tensor.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        &bytes[..bytes.len() - 100],
    )
    .unwrap();
    let o = lily(&[
        "score",
        "--model",
        dir.path().to_str().unwrap(),
        "--tokens",
        "1,2,3",
    ]);
    assert_clean_failure(&o, "truncated");
}

#[test]
fn bad_input_is_a_clear_error() {
    let tiny_a = fixture("tiny-a");
    let model = tiny_a.to_str().unwrap();
    assert_clean_failure(
        &lily(&["score", "--model", model, "--tokens", "1,999"]),
        "out of range",
    );
    assert_clean_failure(
        &lily(&["score", "--model", model, "--tokens", "1,x"]),
        "\"x\"",
    );
    assert_clean_failure(
        &lily(&["score", "--model", "/nonexistent", "--tokens", "1"]),
        "/nonexistent",
    );
    assert_clean_failure(
        &lily(&["score", "--model", "synthetic:huge", "--tokens", "1"]),
        "synthetic:tiny",
    );
    assert_clean_failure(
        &lily(&[
            "generate",
            "--model",
            model,
            "--tokens",
            "1",
            "--temperature=-1",
        ]),
        "--temperature",
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        "{\"model_type\": \"qwen3_5_moe_text\"}",
    )
    .unwrap();
    assert_clean_failure(
        &lily(&["inspect", "--model", dir.path().to_str().unwrap()]),
        "num_hidden_layers",
    );
}
