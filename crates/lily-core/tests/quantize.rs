//! `lily quantize`'s writer against mlx-lm: converting tests/fixtures/tiny-mlx-hf must give, tensor
//! for tensor, the bytes `mlx_lm.convert -q` wrote into tests/fixtures/tiny-mlx-q4.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lily_core::quantize::write_mlx_checkpoint;
use safetensors::SafeTensors;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Every tensor of a directory: name → (dtype, shape, bytes).
fn tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, t) in st.tensors() {
                let value = (
                    format!("{:?}", t.dtype()),
                    t.shape().to_vec(),
                    t.data().to_vec(),
                );
                out.insert(name, value);
            }
        }
    }
    out
}

fn config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn lily_quantize_writes_mlx_lms_bytes() {
    let out = tempfile::tempdir().unwrap();
    let mut calls = 0;
    let summary = write_mlx_checkpoint(&fixture("tiny-mlx-hf"), out.path(), &mut |done, total| {
        assert!(done <= total);
        calls += 1;
    })
    .unwrap();
    let (ours, theirs) = (tensors(out.path()), tensors(&fixture("tiny-mlx-q4")));
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>()
    );
    for (name, (dtype, shape, bytes)) in &theirs {
        let o = &ours[name];
        assert_eq!((&o.0, &o.1), (dtype, shape), "{name}");
        assert!(o.2 == *bytes, "{name}: bytes differ");
    }
    assert_eq!(summary.tensors, theirs.len());
    assert_eq!(summary.shards, 1);
    assert!(calls > 10);
    let (c_ours, c_theirs) = (config(out.path()), config(&fixture("tiny-mlx-q4")));
    assert_eq!(c_ours["quantization"], c_theirs["quantization"]);
    assert_eq!(c_ours["quantization_config"], c_theirs["quantization"]);
    assert!(c_ours.get("vision_config").is_none());
    assert!(out.path().join("tokenizer.json").exists());
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), theirs.len());
}

#[test]
fn quantised_or_unsuitable_sources_are_refused() {
    let out = tempfile::tempdir().unwrap();
    let err = write_mlx_checkpoint(&fixture("tiny-mlx-q4"), out.path(), &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("already MLX-quantised"), "{err}");
    std::fs::write(out.path().join("x"), "").unwrap();
    let err = write_mlx_checkpoint(&fixture("tiny-mlx-hf"), out.path(), &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("not empty"), "{err}");
}
