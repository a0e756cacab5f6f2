//! Writing safetensors files: used by the quantiser and by tests that build checkpoints.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// One tensor to write: its stored name, safetensors dtype tag (`"F32"`, `"BF16"`, `"U32"`, ...),
/// shape and little-endian bytes.
pub struct TensorBytes<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

/// Writes `tensors` in the given order as one safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[TensorBytes]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for t in tensors {
        let end = offset + t.bytes.len();
        header.insert(
            t.name.to_string(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::Value::Object(header).to_string();
    // Pad the header with spaces so the data starts 8-byte aligned, as the reference writer does.
    header.push_str(&" ".repeat((8 - header.len() % 8) % 8));
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
    );
    file.write_all(&(header.len() as u64).to_le_bytes())?;
    file.write_all(header.as_bytes())?;
    for t in tensors {
        file.write_all(t.bytes)?;
    }
    file.flush()
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Little-endian bytes of f32 values.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}
