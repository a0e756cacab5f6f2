//! The GPU memory plan's weight figure, checked without a GPU.

use std::path::Path;

use lily_core::model_ref::ModelRef;
use lily_core::weights::ModelWeights;
use lily_cuda::weights::device_bytes;

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
