//! The `quantization` block of an MLX config.json: any JSON must be read or refused cleanly, and a
//! block that is read must answer for any module name.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lily_core::mlx::QuantizationConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(root) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    if let Ok(q) = QuantizationConfig::from_config(&root) {
        for module in ["layers.0.mlp.gate", "layers.0.mlp.switch_mlp.gate_proj", "embed_tokens", ""] {
            let _ = q.for_module(module);
        }
    }
});
