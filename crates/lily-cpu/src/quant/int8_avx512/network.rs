//! The super-blocks' network in AVX-512 instructions (superblocks.rs gives it as indices): the
//! shuffles of one butterfly, a super-block's vectors through all of its levels, and an input
//! row's rounded parts moved into the order the codes take.

use std::arch::x86_64::*;

use super::BLOCK_BYTES;
use crate::quant::superblocks::{Superblock, Superblocks, butterflies};

/// One output of a butterfly of the network: [`super::superblocks::select`] in one
/// instruction (quarters moved whole, or dwords and qwords unpacked within quarters).
///
/// # Safety
/// The CPU must support AVX-512 F. Not a `target_feature` function, so that it inlines into
/// the kernels' loops (which are).
#[inline(always)]
pub(super) unsafe fn mix(a: __m512i, b: __m512i, run: usize, second: bool) -> __m512i {
    // SAFETY: the caller's promise.
    unsafe {
        match (run, second) {
            (16, false) => _mm512_shuffle_i32x4::<0x44>(a, b),
            (16, true) => _mm512_shuffle_i32x4::<0xee>(a, b),
            (8, false) => _mm512_shuffle_i32x4::<0x88>(a, b),
            (8, true) => _mm512_shuffle_i32x4::<0xdd>(a, b),
            (4, false) => _mm512_unpacklo_epi32(a, b),
            (4, true) => _mm512_unpackhi_epi32(a, b),
            (_, false) => _mm512_unpacklo_epi64(a, b),
            (_, true) => _mm512_unpackhi_epi64(a, b),
        }
    }
}

/// An input row's parts (`parts · cols` bytes, blocks of `block_cols` bytes: one vector of
/// each half) from the kernel's column order into the packed order, `natural` to `packed`.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[target_feature(enable = "avx512f")]
pub(in crate::quant) unsafe fn pack_inputs(
    plan: &Superblocks,
    block_cols: usize,
    natural: &[i8],
    packed: &mut [i8],
) {
    assert!(natural.len() == packed.len() && natural.len().is_multiple_of(block_cols));
    let blocks: usize = plan.list.iter().map(Superblock::blocks).sum();
    let cols = blocks * block_cols;
    for part in (0..natural.len()).step_by(cols) {
        for sb in &plan.list {
            for half in (0..block_cols).step_by(BLOCK_BYTES) {
                let at = part + sb.first_block * block_cols + half;
                let (src, dst) = (
                    natural[at..].as_ptr() as *const u8,
                    packed[at..].as_mut_ptr(),
                );
                // SAFETY: the super-block's vectors lie inside both rows (`at` and every block
                // after it up to the super-block's end are inside a part of `cols` bytes).
                unsafe {
                    superblock_network(sb.blocks(), plan.first_run, src, block_cols, |k, v| {
                        _mm512_storeu_si512(dst.add(k * block_cols) as *mut _, v)
                    })
                }
            }
        }
    }
}

/// Loads a super-block's `n` vectors, `stride` bytes apart from `src`, puts them through the
/// network and gives output `k` to `put(k, v)`. The network's size and first run as constants,
/// so its butterflies unroll into registers.
///
/// # Safety
/// `n` vectors of 64 bytes at `src + k·stride` must be readable.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn superblock_network(
    n: usize,
    first_run: usize,
    src: *const u8,
    stride: usize,
    put: impl FnMut(usize, __m512i),
) {
    // SAFETY: the caller's promise.
    unsafe {
        match n {
            1 => network::<1>(first_run, src, stride, put),
            2 => network::<2>(first_run, src, stride, put),
            4 => network::<4>(first_run, src, stride, put),
            8 => network::<8>(first_run, src, stride, put),
            _ => network::<16>(first_run, src, stride, put),
        }
    }
}

#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn network<const N: usize>(
    first_run: usize,
    src: *const u8,
    stride: usize,
    mut put: impl FnMut(usize, __m512i),
) {
    // SAFETY: the caller's promise.
    let mut v: [__m512i; N] =
        std::array::from_fn(|k| unsafe { _mm512_loadu_si512(src.add(k * stride) as *const _) });
    let mut butterfly = |i: usize, j: usize, run: usize| {
        let (a, b) = (v[i], v[j]);
        // SAFETY: this function's build has AVX-512 F.
        (v[i], v[j]) = unsafe { (mix(a, b, run, false), mix(a, b, run, true)) };
    };
    match first_run {
        16 => butterflies(N, 16, &mut butterfly),
        8 => butterflies(N, 8, &mut butterfly),
        _ => butterflies(N, 4, &mut butterfly),
    }
    for (k, v) in v.into_iter().enumerate() {
        put(k, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Int8Isa;
    use crate::quant::superblocks::{LANES, select};

    /// Each level's instructions choose the lanes the network's definition says (the inputs'
    /// layout is made from the definition).
    #[test]
    fn mix_takes_the_lanes_select_names() {
        if !Int8Isa::available().contains(&Int8Isa::Avx512Vnni) {
            eprintln!("NOT RUN here: the AVX-512 VNNI int8 kernel (this CPU has no VNNI)");
            return;
        }
        let a: [i32; LANES] = std::array::from_fn(|l| 100 + l as i32);
        let b: [i32; LANES] = std::array::from_fn(|l| 200 + l as i32);
        for run in [16, 8, 4, 2] {
            for second in [false, true] {
                // SAFETY: AVX-512 F is available (checked above); the arrays are 16 i32 each.
                let got: [i32; LANES] = unsafe { mixed(&a, &b, run, second) };
                let want = select(run, second).map(|i| match i {
                    0..16 => a[i as usize],
                    _ => b[i as usize - LANES],
                });
                assert_eq!(got, want, "run {run}, second {second}");
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn mixed(a: &[i32; LANES], b: &[i32; LANES], run: usize, second: bool) -> [i32; LANES] {
        let mut out = [0i32; LANES];
        // SAFETY: 16 i32 values each.
        unsafe {
            let v = mix(
                _mm512_loadu_si512(a.as_ptr() as *const _),
                _mm512_loadu_si512(b.as_ptr() as *const _),
                run,
                second,
            );
            _mm512_storeu_si512(out.as_mut_ptr() as *mut _, v);
        }
        out
    }
}
