//! A single-file checkpoint: the header, offsets and dtypes of arbitrary bytes must be accepted
//! or refused with an error; every tensor the header admits must be readable.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lily_core::checkpoint::Checkpoint;
use lily_core::source::TensorSource;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("model.safetensors"), data).expect("write");
    if let Ok(mut ckpt) = Checkpoint::open(dir.path()) {
        let names: Vec<String> = ckpt.remaining().map(str::to_string).collect();
        for name in names {
            let shape = ckpt.shape(&name).map(<[usize]>::to_vec).unwrap_or_default();
            let _ = ckpt.take_f32(&name, &shape);
        }
        let _ = Box::new(ckpt).finish();
    }
});
