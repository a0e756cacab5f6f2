//! config.json: any bytes must parse to a validated config or an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(config) = lily_core::config::ModelConfig::from_json(text)
    {
        // A config that validates must also size itself without overflow or panic.
        let _ = config.param_count();
        let _ = config.weight_bytes();
        let _ = config.kv_bytes_per_token(2);
    }
});
