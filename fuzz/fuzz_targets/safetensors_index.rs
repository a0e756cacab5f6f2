//! model.safetensors.index.json: arbitrary index text next to one valid shard.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lily_core::checkpoint::Checkpoint;
use lily_core::safetensors_write::{TensorBytes, f32_bytes, write_safetensors};

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    let values = f32_bytes(&[1.0, 2.0]);
    let tensor = TensorBytes { name: "model.norm.weight", dtype: "F32", shape: vec![2], bytes: &values };
    write_safetensors(&dir.path().join("a.safetensors"), &[tensor]).expect("shard");
    std::fs::write(dir.path().join("model.safetensors.index.json"), data).expect("write");
    let _ = Checkpoint::open(dir.path());
});
