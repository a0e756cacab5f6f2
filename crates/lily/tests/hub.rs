//! `lily pull`, `--model ORG/NAME` and `lily inspect`'s memory plan, through the binary as a
//! user runs it, against the local Hub of lily-hub's tests (127.0.0.1 only) and a stand-in
//! `nvidia-smi`.

#[path = "../../lily-hub/tests/support/fake_hub.rs"]
mod fake_hub;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use fake_hub::{FakeFile, FakeHub, FakeRepo};
use serde_json::Value;

const COMMIT: &str = "2222222222222222222222222222222222222222";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// `tests/fixtures/tiny-a-official` as a Hub repository: JSON files in git, shards in LFS.
fn tiny_repo(id: &str) -> FakeRepo {
    let dir = fixture("tiny-a-official");
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    FakeRepo::new(
        id,
        COMMIT,
        vec![
            FakeFile::regular("config.json", &read("config.json")),
            FakeFile::regular(
                "model.safetensors.index.json",
                &read("model.safetensors.index.json"),
            ),
            FakeFile::lfs(
                "model-00001-of-00002.safetensors",
                &read("model-00001-of-00002.safetensors"),
            ),
            FakeFile::lfs(
                "model-00002-of-00002.safetensors",
                &read("model-00002-of-00002.safetensors"),
            ),
        ],
    )
}

/// Runs lily with a private Hub home, the Hub at `endpoint`, no token unless given.
fn lily(home: &Path, endpoint: &str, token: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lily"));
    cmd.args(args)
        .env("HF_HOME", home)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_TOKEN")
        .env_remove("HF_TOKEN_PATH")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE");
    if let Some(token) = token {
        cmd.env("HF_TOKEN", token);
    }
    cmd.output().expect("lily runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_ok(o: &Output) {
    assert!(
        o.status.success(),
        "lily failed:\n{}\n{}",
        stdout(o),
        stderr(o)
    );
}

/// A failed run: non-zero exit, one `error: ` line containing every needle, no panic.
fn assert_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected a failure: {}", stdout(o));
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: "), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    }
}

#[test]
fn a_pulled_model_runs_offline_by_its_repository_id() {
    let home = tempfile::tempdir().unwrap();
    let hub = FakeHub::start(vec![tiny_repo("lily-test/tiny-a")]);
    let endpoint = hub.endpoint.clone();

    let out = lily(home.path(), &endpoint, None, &["pull", "lily-test/tiny-a"]);
    assert_ok(&out);
    let text = stdout(&out);
    assert!(
        text.contains(&format!("lily-test/tiny-a at {COMMIT}: 4 files")),
        "{text}"
    );
    assert!(
        text.contains("use it with --model lily-test/tiny-a"),
        "{text}"
    );
    let snapshot = home
        .path()
        .join("hub/models--lily-test--tiny-a/snapshots")
        .join(COMMIT);
    assert!(text.contains(&snapshot.display().to_string()), "{text}");
    drop(hub); // From here on, nothing can be downloaded.

    let args = |model: &str| -> Vec<String> {
        [
            "score", "--model", model, "--tokens", "1,2,3,4", "--json", "--device", "cpu",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = |model: &str| {
        let a = args(model);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        lily(home.path(), &endpoint, None, &a)
    };
    let by_id = run("lily-test/tiny-a");
    assert_ok(&by_id);
    let by_dir = run(fixture("tiny-a-official").to_str().unwrap());
    assert_ok(&by_dir);
    assert!(stdout(&by_id).len() > 10, "{}", stdout(&by_id));
    assert_eq!(stdout(&by_id), stdout(&by_dir));
    // A pinned commit names the same snapshot.
    let pinned = run(&format!("lily-test/tiny-a@{COMMIT}"));
    assert_eq!(stdout(&pinned), stdout(&by_dir));

    // A repository never pulled is a clear error that says what to do.
    assert_error(
        &run("lily-test/missing"),
        &[
            "lily-test/missing",
            "lily pull lily-test/missing",
            "--download",
        ],
    );
}

#[test]
fn download_pulls_what_the_cache_lacks_before_running() {
    let home = tempfile::tempdir().unwrap();
    let hub = FakeHub::start(vec![tiny_repo("lily-test/tiny-a")]);
    let model_args = ["inspect", "--model", "lily-test/tiny-a", "--json"];
    let without = lily(home.path(), &hub.endpoint, None, &model_args);
    assert_error(&without, &["lily pull lily-test/tiny-a"]);
    assert!(hub.requests().is_empty(), "looked up offline only");

    let mut with = model_args.to_vec();
    with.push("--download");
    let out = lily(home.path(), &hub.endpoint, None, &with);
    assert_ok(&out);
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let name = json["model"].as_str().unwrap();
    assert!(name.starts_with("lily-test/tiny-a ("), "{name}");
    assert!(
        name.contains("models--lily-test--tiny-a/snapshots"),
        "{name}"
    );
    assert_eq!(json["format"]["files"], 2);
    let on_disk: u64 = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    .iter()
    .map(|f| {
        std::fs::metadata(fixture("tiny-a-official").join(f))
            .unwrap()
            .len()
    })
    .sum();
    assert_eq!(json["bytes_on_disk"], on_disk);

    // Once cached, --download changes nothing and asks the Hub nothing.
    hub.clear_log();
    assert_ok(&lily(home.path(), &hub.endpoint, None, &with));
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());
}

#[test]
fn a_gated_repository_without_a_token_is_a_one_line_error() {
    let home = tempfile::tempdir().unwrap();
    let mut gated = tiny_repo("lily-test/gated");
    gated.gated_tokens = Some(vec!["hf_ok".to_string()]);
    let hub = FakeHub::start(vec![gated]);
    let out = lily(
        home.path(),
        &hub.endpoint,
        None,
        &["pull", "lily-test/gated"],
    );
    assert_error(
        &out,
        &["gated", "HF_TOKEN", "accept its terms", "lily-test/gated"],
    );
    let out = lily(
        home.path(),
        &hub.endpoint,
        Some("hf_ok"),
        &["pull", "lily-test/gated"],
    );
    assert_ok(&out);
}

#[test]
fn pull_dir_lays_out_a_plain_checkpoint() {
    let home = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let hub = FakeHub::start(vec![tiny_repo("lily-test/tiny-a")]);
    let dir = out_dir.path().join("tiny");
    let out = lily(
        home.path(),
        &hub.endpoint,
        None,
        &["pull", "lily-test/tiny-a", "--dir", dir.to_str().unwrap()],
    );
    assert_ok(&out);
    for f in ["config.json", "model-00002-of-00002.safetensors"] {
        assert_eq!(
            std::fs::read(dir.join(f)).unwrap(),
            std::fs::read(fixture("tiny-a-official").join(f)).unwrap(),
            "{f}"
        );
    }
}

/// A directory holding an `nvidia-smi` that prints `output` (or fails when `None`).
fn fake_nvidia_smi(output: Option<&str>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script = match output {
        Some(text) => format!("#!/bin/sh\nprintf '{text}'\n"),
        None => "#!/bin/sh\nexit 9\n".to_string(),
    };
    let path = dir.path().join("nvidia-smi");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn inspect_with_gpus(nvidia_smi: Option<&str>, args: &[&str]) -> Output {
    let bin = fake_nvidia_smi(nvidia_smi);
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new(env!("CARGO_BIN_EXE_lily"))
        .arg("inspect")
        .args(args)
        .env("PATH", path)
        .output()
        .expect("lily runs")
}

#[test]
fn inspect_plans_the_full_model_on_each_gpu_found() {
    let args = [
        "--model",
        "synthetic:qwen3.6-35b-a3b",
        "--max-seq",
        "32768",
        "--json",
    ];
    let out = inspect_with_gpus(
        Some("NVIDIA H200, 143771, 143156\\nNVIDIA GeForce RTX 3060, 12288, 11000\\n"),
        &args,
    );
    assert_ok(&out);
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    // perf.md: 19.5 GB of 4-bit weights, 20 KiB of KV per token, 60 MiB of recurrent state.
    let cuda = &json["backends"]["cuda"];
    let weights = cuda["weight_bytes"].as_u64().unwrap();
    assert!((weights as f64 / 1e9 - 19.5).abs() < 0.05, "{weights}");
    assert_eq!(cuda["kv_bytes_per_token"], 20_480);
    assert_eq!(json["recurrent_state_bytes"], 62_914_560);
    let gpus: Vec<&Value> = json["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["backend"] == "cuda")
        .collect();
    assert_eq!(gpus.len(), 2, "{json}");
    assert_eq!(gpus[0]["name"], "NVIDIA H200");
    assert_eq!(gpus[0]["total_bytes"], 143_771u64 << 20);
    assert_eq!(gpus[0]["fits"], true);
    assert_eq!(gpus[0]["longest_context"], 262_144);
    assert_eq!(gpus[1]["fits"], false);
    assert!(gpus[1]["longest_context"].is_null());

    // The text report says the same to a person.
    let text_args = &args[..4];
    let out = inspect_with_gpus(Some("NVIDIA H200, 143771, 143156\\n"), text_args);
    assert_ok(&out);
    let text = stdout(&out);
    for needle in [
        "19.51 GB MLX 4-bit (group 64) weights + 671.1 MB bf16 KV (20480 B/token)",
        "recurrent state 60.0 MiB",
        "cuda:0 NVIDIA H200 (150.11 GB free of 150.75 GB, cuda backend): fits",
    ] {
        assert!(text.contains(needle), "{needle:?} not in:\n{text}");
    }

    // Without a working nvidia-smi the report says no GPU was found, and why.
    let out = inspect_with_gpus(None, &args);
    assert_ok(&out);
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert!(
        json["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["backend"] == "cpu")
    );
    let note = json["gpu_note"].as_str().unwrap();
    assert!(note.contains("nvidia-smi failed"), "{note}");
}
