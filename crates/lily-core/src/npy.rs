//! NumPy `.npy` files of float32 matrices: written by `lily score --dump-logits`, read by tests
//! to compare against oracle outputs.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};

/// Writes a C-order float32 array of the given shape (format version 1.0).
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    ensure!(
        shape.iter().product::<usize>() == data.len(),
        "npy shape {shape:?} does not match {} values",
        data.len()
    );
    let dims = match shape {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' is padded to a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    data.iter()
        .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
    let mut file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    file.write_all(&bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Reads a C-order little-endian float32 array; returns (shape, values).
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_f32(&bytes).with_context(|| format!("{} is not a float32 .npy file", path.display()))
}

fn parse_f32(bytes: &[u8]) -> Result<(Vec<usize>, Vec<f32>)> {
    ensure!(
        bytes.len() >= 10 && &bytes[..6] == b"\x93NUMPY",
        "bad magic"
    );
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            ensure!(bytes.len() >= 12, "truncated header");
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => bail!("unsupported npy version {v}"),
    };
    let header = bytes
        .get(start..start + header_len)
        .context("truncated header")?;
    let header = std::str::from_utf8(header)?;
    ensure!(
        header.contains("'descr': '<f4'"),
        "dtype is not '<f4': {header}"
    );
    ensure!(
        header.contains("'fortran_order': False"),
        "array is not C-ordered"
    );
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .context("no shape in header")?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().context("bad shape"))
        .collect::<Result<Vec<_>>>()?;
    let body = &bytes[start + header_len..];
    let count: usize = shape.iter().product();
    ensure!(
        body.len() == count * 4,
        "expected {count} values, file has {} bytes",
        body.len()
    );
    let data = body
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok((shape, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        write_f32(&path, &[3, 4], &data).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            (bytes.len() - data.len() * 4) % 64,
            0,
            "header is 64-byte aligned"
        );
        assert_eq!(read_f32(&path).unwrap(), (vec![3, 4], data));
    }
}
