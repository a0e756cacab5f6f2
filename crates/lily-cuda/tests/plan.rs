//! The GPU memory plan's weight figure, checked without a GPU.

use std::path::Path;

use lily_core::model_ref::ModelRef;
use lily_core::plan::Storage;
use lily_core::synthetic::{SyntheticSource, synthetic_config};
use lily_core::weights::ModelWeights;
use lily_cuda::synthetic::SyntheticWeights;
use lily_cuda::weights::{WeightSource, device_bytes};

#[test]
fn device_bytes_count_every_weight_once() {
    // An f32 checkpoint is held in f32: exactly four bytes per parameter.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a");
    let (config, source) = ModelRef::Dir(dir).open().unwrap();
    let weights = ModelWeights::load(&config, source).unwrap();
    assert_eq!(
        device_bytes(&weights) as u64,
        config.param_count().total * 4
    );

    // MLX 4-bit weights are held as stored: below the f32 figure by the quantisation ratio.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mlx-q4");
    let (config, source) = ModelRef::Dir(dir).open().unwrap();
    let weights = ModelWeights::load(&config, source).unwrap();
    let f32_bytes = config.param_count().total * 4;
    let held = device_bytes(&weights) as u64;
    assert!(
        held * 4 < f32_bytes,
        "{held} bytes for {f32_bytes} bytes of f32 weights"
    );
}

/// Synthetic weights made on the GPU are sized from the config alone (there is no host copy to
/// count); that figure must be what the host copy would take on the device: for the tiny model, a
/// tied one too narrow to quantise its hidden-size inputs, and the full-size model.
#[test]
fn synthetic_device_bytes_equal_the_host_copys() {
    let mut narrow = synthetic_config("tiny").unwrap();
    narrow.hidden_size = 96;
    narrow.tie_word_embeddings = true;
    let full = synthetic_config("qwen3.6-35b-a3b").unwrap();
    for config in [synthetic_config("tiny").unwrap(), narrow] {
        let host = ModelWeights::load(&config, Box::new(SyntheticSource::new(1))).unwrap();
        assert_eq!(
            SyntheticWeights::new(1).device_bytes(&config),
            device_bytes(&host),
            "hidden {}",
            config.hidden_size
        );
    }
    // The full-size model (too large to make on the host here): its 4-bit plan figure, with the
    // unquantised tensors (every input dim divides into groups) in f32 rather than bf16.
    let plain: u64 = full
        .tensor_inventory()
        .iter()
        .filter(|g| g.storage == Storage::Plain)
        .map(|g| g.rows * g.cols * g.count)
        .sum();
    let bytes = SyntheticWeights::new(1).device_bytes(&full) as u64;
    assert_eq!(bytes, full.weight_bytes().q4 + 2 * plain);
}
