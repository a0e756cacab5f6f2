//! Weight matrices on the device, as stored: dense f32, or MLX affine codes with bf16 scales
//! and biases (the runtime format on every backend, uploaded byte for byte). Kernels see one
//! `Mat` struct by value.

use anyhow::{Result, bail, ensure};
use cudarc::driver::{CudaSlice, DeviceRepr};
use lily_core::weights::Linear;

use crate::gpu::{Gpu, Shape, ptr};

/// The kernels' `struct Mat` (kernels/common.cuh), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MatArg {
    pub w: u64,
    pub scales: u64,
    pub biases: u64,
    pub rows: i32,
    pub cols: i32,
    pub group: i32,
}

// SAFETY: plain-old-data with the C layout of `struct Mat`.
unsafe impl DeviceRepr for MatArg {}

pub struct DeviceMat {
    /// 4 or 8 for affine codes, 32 for dense f32.
    pub bits: u32,
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    w: CudaSlice<u8>,
    scales: Option<CudaSlice<u16>>,
    biases: Option<CudaSlice<u16>>,
}

/// Bits, columns and group of a weight, as the kernels name them.
fn format(l: &Linear) -> (u32, usize, usize) {
    match l {
        Linear::Dense(m) => (32, m.cols, m.cols),
        Linear::Affine(q) => (q.bits(), q.cols(), q.group_size()),
    }
}

impl DeviceMat {
    pub fn upload(gpu: &Gpu, l: &Linear) -> Result<Self> {
        Self::stack(gpu, &[l])
    }

    /// Uploads equal-shaped matrices one after another (experts), rows concatenated.
    pub fn stack(gpu: &Gpu, parts: &[&Linear]) -> Result<Self> {
        let Some(first) = parts.first() else {
            bail!("no matrices to upload")
        };
        let (bits, cols, group) = format(first);
        ensure!(
            parts
                .iter()
                .all(|p| format(p) == (bits, cols, group) && p.rows() == first.rows()),
            "stacked matrices must share shape and format"
        );
        if bits != 32 {
            ensure!(
                group % (128 / bits as usize) == 0,
                "group size {group} does not suit the {bits}-bit GPU kernels"
            );
        }
        let mut out = Self::zeros(gpu, bits, first.rows() * parts.len(), cols, group)?;
        let s = &gpu.stream;
        let DeviceMat {
            w, scales, biases, ..
        } = &mut out;
        let (mut at_w, mut at_g) = (0, 0);
        for part in parts {
            match part {
                Linear::Dense(m) => {
                    let bytes: Vec<u8> = m.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                    s.memcpy_htod(&bytes, &mut w.slice_mut(at_w..at_w + bytes.len()))?;
                    at_w += bytes.len();
                }
                Linear::Affine(q) => {
                    let bytes: Vec<u8> = q.codes().iter().flat_map(|v| v.to_le_bytes()).collect();
                    s.memcpy_htod(&bytes, &mut w.slice_mut(at_w..at_w + bytes.len()))?;
                    at_w += bytes.len();
                    let n = q.scales().len();
                    let sc: Vec<u16> = q.scales().iter().map(|v| v.to_bits()).collect();
                    let bi: Vec<u16> = q.biases().iter().map(|v| v.to_bits()).collect();
                    if let (Some(ds), Some(db)) = (scales.as_mut(), biases.as_mut()) {
                        s.memcpy_htod(&sc, &mut ds.slice_mut(at_g..at_g + n))?;
                        s.memcpy_htod(&bi, &mut db.slice_mut(at_g..at_g + n))?;
                    }
                    at_g += n;
                }
            }
        }
        Ok(out)
    }

    /// A zeroed matrix of this format, for an upload or a kernel to fill.
    pub(crate) fn zeros(
        gpu: &Gpu,
        bits: u32,
        rows: usize,
        cols: usize,
        group: usize,
    ) -> Result<Self> {
        // One element more than the groups: the persistent step reads a scale or bias as the
        // aligned 4-byte word holding it (gemv_stream.cuh), which for the last one may be the
        // pad. Never downloaded.
        let n = rows * cols / group;
        let groups = || gpu.zeros::<u16>(n + 1);
        let (scales, biases) = match bits {
            32 => (None, None),
            _ => (Some(groups()?), Some(groups()?)),
        };
        Ok(DeviceMat {
            bits,
            rows,
            cols,
            group,
            w: gpu.zeros::<u8>(rows * cols * bits as usize / 8)?,
            scales,
            biases,
        })
    }

    /// The stored bytes: codes (or f32 values), scales and biases (empty for a dense matrix), so
    /// that tests can compare two devices' copies to the bit.
    pub fn download(&self, gpu: &Gpu) -> Result<[Vec<u8>; 3]> {
        let n = self.rows * self.cols / self.group;
        let halves = |b: &Option<CudaSlice<u16>>| -> Result<Vec<u8>> {
            let values = b.as_ref().map(|b| gpu.download(b)).transpose()?;
            Ok(values
                .unwrap_or_default()
                .iter()
                .take(n)
                .flat_map(|v| v.to_le_bytes())
                .collect())
        };
        Ok([
            gpu.download(&self.w)?,
            halves(&self.scales)?,
            halves(&self.biases)?,
        ])
    }

    pub fn arg(&self, gpu: &Gpu) -> MatArg {
        MatArg {
            w: ptr(&self.w, &gpu.stream),
            scales: self.scales.as_ref().map_or(0, |s| ptr(s, &gpu.stream)),
            biases: self.biases.as_ref().map_or(0, |s| ptr(s, &gpu.stream)),
            rows: self.rows as i32,
            cols: self.cols as i32,
            group: self.group as i32,
        }
    }
}

/// Rows one warp of `gemv_b*` computes (kernels/gemv_staged.cuh, GEMV_ROWS).
const GEMV_ROWS: usize = 4;
/// The widest input the staged GEMVs hold in shared memory (kernels/gemv_staged.cuh, XS_COLS).
pub const XS_COLS: usize = 8192;
/// Most blocks of a staged kernel: each stages x once and strides over its share of the rows, so
/// the lm_head's 62,000 warps of work need not each stage x again.
const MAX_BLOCKS: usize = 1024;

/// The launch shape of a staged kernel (`gemv_*`, `moe_*`) over `units` warps of work. Small
/// launches get four-warp blocks, so that they spread over more SMs.
pub fn staged_shape(units: usize) -> Shape {
    let warps = if units >= 8 * 264 { 8 } else { 4 };
    Shape {
        grid: (units.div_ceil(warps).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block: warps as u32 * 32,
    }
}

/// A launch of `units` warps of work in blocks of `warps` warps, at most `resident` blocks (one
/// wave: warps then take further units in turn instead of a second wave of blocks staging
/// their input again).
pub fn wave_shape(units: usize, warps: usize, resident: u32) -> Shape {
    Shape {
        grid: (
            units.div_ceil(warps).clamp(1, resident.max(1) as usize) as u32,
            1,
            1,
        ),
        block: warps as u32 * 32,
    }
}

/// The launch shape of `gemv_b*` over matrices with these row counts: whole warps per matrix.
pub fn gemv_shape(rows: &[usize]) -> Shape {
    staged_shape(rows.iter().map(|r| r.div_ceil(GEMV_ROWS)).sum())
}
