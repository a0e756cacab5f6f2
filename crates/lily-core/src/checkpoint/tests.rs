use std::path::Path;

use super::*;

use crate::safetensors_write::{TensorBytes, f32_bytes};

fn write_safetensors(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let views: Vec<TensorBytes> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| TensorBytes {
            name,
            dtype,
            shape: shape.clone(),
            bytes,
        })
        .collect();
    crate::safetensors_write::write_safetensors(path, &views).unwrap();
}

#[test]
fn names_are_canonicalised_and_extra_parts_skipped() {
    assert_eq!(
        canonical_name("model.language_model.layers.0.mlp.gate.weight").unwrap(),
        "layers.0.mlp.gate.weight"
    );
    assert_eq!(canonical_name("model.norm.weight").unwrap(), "norm.weight");
    assert_eq!(
        canonical_name("language_model.model.embed_tokens.weight").unwrap(),
        "embed_tokens.weight"
    );
    assert_eq!(
        canonical_name("language_model.lm_head.weight").unwrap(),
        "lm_head.weight"
    );
    assert_eq!(canonical_name("lm_head.weight").unwrap(), "lm_head.weight");
    for skipped in [
        "model.visual.blocks.0.attn.qkv.weight",
        "mtp.fc.weight",
        "vision_tower.x",
    ] {
        assert_eq!(canonical_name(skipped), None);
    }
}

#[test]
fn reads_f32_bf16_f16_and_checks_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let vals = [1.5f32, -2.0, 0.25, 3.0];
    let bf: Vec<u8> = vals
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let hf: Vec<u8> = vals
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[
            ("model.a", "F32", vec![2, 2], f32_bytes(&vals)),
            ("model.b", "BF16", vec![4, 1], bf),
            ("model.c", "F16", vec![1, 4], hf),
            ("model.d", "I64", vec![1], vec![0; 8]),
            ("mtp.fc.weight", "F32", vec![1], f32_bytes(&[9.0])),
        ],
    );
    let mut ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.skipped(), 1);
    assert_eq!(ck.take_f32("a", &[2, 2]).unwrap(), vals);
    assert_eq!(
        ck.take_f32("b", &[4]).unwrap(),
        vals,
        "size-1 dims are layout noise"
    );
    assert_eq!(ck.take_f32("c", &[4]).unwrap(), vals);
    let err = format!("{:#}", ck.take_f32("d", &[1]).unwrap_err());
    assert!(err.contains("I64") && err.contains("model.d"), "{err}");
    let err = format!("{:#}", ck.take_f32("a", &[2, 2]).unwrap_err());
    assert!(err.contains("no tensor \"a\""), "taken twice: {err}");
}

#[test]
fn shape_mismatch_missing_and_leftover_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[
            ("model.a", "F32", vec![2, 2], f32_bytes(&[0.0; 4])),
            ("model.extra", "F32", vec![1], f32_bytes(&[0.0])),
        ],
    );
    let mut ck = Checkpoint::open(dir.path()).unwrap();
    let err = format!("{:#}", ck.take_f32("a", &[4, 2]).unwrap_err());
    assert!(
        err.contains("model.a") && err.contains("[2, 2]") && err.contains("[4, 2]"),
        "{err}"
    );
    let err = format!("{:#}", ck.take_f32("missing", &[1]).unwrap_err());
    assert!(err.contains("missing"), "{err}");
    let err = format!("{:#}", Box::new(ck).finish().unwrap_err());
    assert!(
        err.contains("model.extra") && err.contains("not used"),
        "{err}"
    );
}

#[test]
fn sharded_checkpoints_follow_the_index() {
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(
        &dir.path().join("s1.safetensors"),
        &[("model.a", "F32", vec![1], f32_bytes(&[1.0]))],
    );
    write_safetensors(
        &dir.path().join("s2.safetensors"),
        &[("model.b", "F32", vec![1], f32_bytes(&[2.0]))],
    );
    let index = serde_json::json!({"metadata": {}, "weight_map": {"model.a": "s1.safetensors", "model.b": "s2.safetensors"}});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let mut ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.take_f32("b", &[1]).unwrap(), [2.0]);
    assert_eq!(ck.take_f32("a", &[1]).unwrap(), [1.0]);
    Box::new(ck).finish().unwrap();

    let bad = serde_json::json!({"weight_map": {"model.a": "../s1.safetensors"}});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        bad.to_string(),
    )
    .unwrap();
    assert!(Checkpoint::open(dir.path()).is_err());
    std::fs::write(dir.path().join("model.safetensors.index.json"), "{not json").unwrap();
    assert!(Checkpoint::open(dir.path()).is_err());
}

#[test]
fn truncated_and_garbage_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, &[("model.a", "F32", vec![4], f32_bytes(&[1.0; 4]))]);
    let full = std::fs::read(&path).unwrap();
    for cut in [0, 4, 8, 20, full.len() - 1] {
        std::fs::write(&path, &full[..cut]).unwrap();
        let err = Checkpoint::open(dir.path())
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(err.contains("model.safetensors"), "cut at {cut}: {err:?}");
    }
    let empty = tempfile::tempdir().unwrap();
    assert!(Checkpoint::open(empty.path()).is_err());
}
