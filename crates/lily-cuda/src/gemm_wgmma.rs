//! The wgmma path of the prefill GEMM (kernels/gemm_wgmma.cu, sm_90a): which GPUs take it
//! ([`GemmPath`]) and its block shapes. gemm.rs and gemm_grouped.rs launch it in place of
//! gemm.cu's 4-bit entries.

use anyhow::{Result, ensure};

use crate::compile::KERNEL_FILES;
use crate::gemm::{DenseTiling, GEMM_GROUPED_BN, SPLIT_MIN_K};
use crate::mat::MatArg;

/// Which kernels run the prefill GEMMs of 4-bit weights (the model's). 8-bit and f32 weights, the
/// 16-row expert tiles, and 4-bit weights gemm_wgmma.cu does not take ([`takes`]) run gemm.cu on
/// either path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// gemm.cu: `mma.sync` m16n8k16 fed by `ldmatrix`, on every GPU Lily runs on.
    MmaSync,
    /// gemm_wgmma.cu: warpgroup MMA reading both operands from shared memory, sm_90 only.
    Wgmma,
}

impl GemmPath {
    pub const ALL: [GemmPath; 2] = [GemmPath::Wgmma, GemmPath::MmaSync];

    /// The paths a GPU of `arch` ("sm_90") can run, the one it takes by default first: wgmma
    /// where its file compiles for the GPU (sm_90a), then mma.sync everywhere.
    pub fn supported(arch: &str) -> Vec<GemmPath> {
        let wgmma = KERNEL_FILES
            .iter()
            .any(|f| f.name == "gemm_wgmma" && f.target(arch).is_some());
        let mut paths = Vec::new();
        if wgmma {
            paths.push(GemmPath::Wgmma);
        }
        paths.push(GemmPath::MmaSync);
        paths
    }

    /// The path for a GPU of `arch`: `forced` if given (an error where the GPU lacks it), else
    /// its default.
    pub fn choose(arch: &str, forced: Option<GemmPath>) -> Result<GemmPath> {
        let supported = Self::supported(arch);
        let Some(forced) = forced else {
            return Ok(supported[0]);
        };
        ensure!(
            supported.contains(&forced),
            "the {forced:?} GEMM path (LILY_GEMM) is not available on an {arch} GPU"
        );
        Ok(forced)
    }
}

/// Whether gemm_wgmma.cu takes weight `w` (as the kernels see it): 4-bit codes in groups of a power
/// of two, at least 32 (a thread's 32 codes, or a half step, in one group), a multiple of 4 groups
/// a row, and 8-byte-aligned scales and biases. Every step of 64 columns is then whole and a
/// window of 4 groups one 8-byte load, which spares the kernel the checks (and registers) ragged
/// rows would cost. MLX's groups (32, 64, 128) and the model's rows (2,048 to 4,096 columns in
/// groups of 64) all qualify; the kernel traps on any other.
pub fn takes(w: &MatArg, bits: u32) -> bool {
    let group = w.group as usize;
    bits == 4
        && group >= 32
        && group.is_power_of_two()
        && (w.cols as usize / group).is_multiple_of(4)
        && (w.scales | w.biases).is_multiple_of(8)
}

/// The dense entry (gemm_b4's arguments).
pub(crate) const DENSE_ENTRY: &str = "gemm_wgmma_b4";
/// The grouped entry for 64-row expert tiles (gemm_grouped64_b4's arguments).
pub(crate) const GROUPED_ENTRY: &str = "gemm_wgmma_grouped64_b4";
/// The same two with X as bf16 rows (`GemmX::bf16`), every operand copied steps ahead.
pub(crate) const DENSE_X16_ENTRY: &str = "gemm_wgmma_b4_x16";
pub(crate) const GROUPED_X16_ENTRY: &str = "gemm_wgmma_grouped64_b4_x16";
/// The experts' gate and up projections with the SwiGLU (`GemmGateUp`), X as bf16 rows.
pub(crate) const GATE_UP_X16_ENTRY: &str = "gemm_wgmma_gate_up64_b4_x16";

/// Dynamic shared memory of a block with `bm` rows of X (`gemm_wgmma_shared_bytes`): two X and
/// two W tiles of 128-byte rows, and 1 KiB to align them to 1,024 bytes.
const fn shared_bytes(bm: usize) -> u32 {
    (2 * (bm + GEMM_GROUPED_BN) * 128 + 1024) as u32
}

/// Bytes of an _x16 block's raw slot: a step's codes (32 bytes a W row) and a window's scales
/// and biases (8 bytes each a row); `GEMM_WG_RAW_BYTES`.
const RAW_SLOT_BYTES: usize = GEMM_GROUPED_BN * (32 + 8 + 8);

/// Dynamic shared memory of an _x16 block of `bm` rows copying `ahead` steps ahead
/// (`gemm_wgmma_x16_shared_bytes`): `ahead` + 1 X tiles, two W tiles, `ahead` raw slots, 1 KiB
/// of alignment.
const fn x16_shared_bytes(bm: usize, ahead: usize) -> u32 {
    ((ahead + 1) * bm * 128 + 2 * GEMM_GROUPED_BN * 128 + ahead * RAW_SLOT_BYTES + 1024) as u32
}

/// Steps ahead the _x16 entries copy (`GEMM_WG_DENSE_AHEAD`, `GEMM_WG_GROUPED_AHEAD`).
const DENSE_AHEAD: usize = 3;
const GROUPED_AHEAD: usize = 2;

/// Dense blocks: 128 × 256 (128 accumulators a thread), one an SM, 97 KiB.
pub(crate) const WGMMA_DENSE: DenseTiling = DenseTiling {
    bm: 128,
    bn: 256,
    bk: 64,
    blocks_per_sm: 1,
    shared: shared_bytes(128),
};

/// Dense _x16 blocks: the same tiles, 165 KiB.
pub(crate) const WGMMA_DENSE_X16: DenseTiling = DenseTiling {
    shared: x16_shared_bytes(128, DENSE_AHEAD),
    ..WGMMA_DENSE
};

/// Grouped blocks (64-row tiles, 256 columns): 81 KiB, two an SM.
pub(crate) const WGMMA_GROUPED_SHARED: u32 = shared_bytes(64);
/// Grouped _x16 blocks: 113 KiB, two an SM.
pub(crate) const WGMMA_GROUPED_X16_SHARED: u32 = x16_shared_bytes(64, GROUPED_AHEAD);

// A step of a tile row is one 128-byte swizzle row of bf16, and a split along K whole steps.
const _: () = assert!(WGMMA_DENSE.bk * 2 == 128 && SPLIT_MIN_K.is_multiple_of(WGMMA_DENSE.bk));
// Two grouped blocks fit an SM of the H100 and H200 (228 KiB, of which 1 KiB a block is
// reserved), with X in f32 or bf16; one dense _x16 block fits the 227 KiB a block may take.
const _: () = assert!(2 * (WGMMA_GROUPED_SHARED + 1024) <= 228 * 1024);
const _: () = assert!(2 * (WGMMA_GROUPED_X16_SHARED + 1024) <= 228 * 1024);
const _: () = assert!(WGMMA_DENSE_X16.shared <= 227 * 1024);

/// The entries and the dynamic shared memory each launches with (above the default 48 KiB, so
/// `Gpu::new` raises their limit).
pub(crate) fn dynamic_shared() -> [(String, u32); 5] {
    [
        (DENSE_ENTRY.to_string(), WGMMA_DENSE.shared),
        (GROUPED_ENTRY.to_string(), WGMMA_GROUPED_SHARED),
        (DENSE_X16_ENTRY.to_string(), WGMMA_DENSE_X16.shared),
        (GROUPED_X16_ENTRY.to_string(), WGMMA_GROUPED_X16_SHARED),
        (GATE_UP_X16_ENTRY.to_string(), WGMMA_GROUPED_X16_SHARED),
    ]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::compile::KernelFile;
    use crate::gemm::GEMM_THREADS;
    use crate::moe_prefill::MoeTile;

    /// `#define NAME VALUE` of a kernel file, as a number.
    pub(crate) fn define(source: &str, name: &str) -> usize {
        source
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no #define {name}"))
    }

    pub(crate) fn file(name: &str) -> &'static KernelFile {
        KERNEL_FILES.iter().find(|f| f.name == name).unwrap()
    }

    /// The host's block shapes and shared memory are the kernel's own.
    #[test]
    fn tiling_matches_the_kernel() {
        let wgmma = crate::compile::WGMMA;
        let x16 = file("gemm_wgmma_x16").source;
        assert_eq!(WGMMA_DENSE.bm, define(wgmma, "GEMM_WG_DENSE_BM"));
        assert_eq!(WGMMA_DENSE.bn, define(wgmma, "GEMM_WG_BN"));
        assert_eq!(WGMMA_DENSE.bk, define(wgmma, "GEMM_WG_BK"));
        assert_eq!(GEMM_GROUPED_BN, define(wgmma, "GEMM_WG_BN"));
        assert_eq!(MoeTile::Rows64.rows(), define(wgmma, "GEMM_WG_GROUPED_BM"));
        assert_eq!(GEMM_THREADS as usize, define(wgmma, "GEMM_WG_THREADS"));
        assert_eq!(DENSE_AHEAD, define(x16, "GEMM_WG_DENSE_AHEAD"));
        assert_eq!(GROUPED_AHEAD, define(x16, "GEMM_WG_GROUPED_AHEAD"));
        assert!(x16.contains("#define GEMM_WG_RAW_BYTES (GEMM_WG_BN * (32 + 8 + 8))"));
        for (entry, _) in dynamic_shared() {
            let files = [file("gemm_wgmma"), file("gemm_wgmma_x16")];
            assert!(files.iter().any(|f| f.entries.contains(&entry.as_str())));
        }
    }

    #[test]
    fn takes_whole_windows_of_power_of_two_groups() {
        let w = |cols, group, scales| MatArg {
            w: 256,
            scales,
            biases: 512,
            rows: 8,
            cols,
            group,
        };
        assert!(takes(&w(2048, 64, 256), 4));
        assert!(takes(&w(512, 32, 256), 4));
        assert!(takes(&w(512, 128, 256), 4));
        assert!(!takes(&w(2048, 64, 256), 8));
        assert!(!takes(&w(384, 64, 256), 4), "6 groups");
        assert!(!takes(&w(96 * 8, 96, 256), 4), "group not a power of two");
        assert!(!takes(&w(256, 16, 256), 4), "a half step across groups");
        assert!(!takes(&w(2048, 64, 258), 4), "scales 2-byte aligned");
    }

    #[test]
    fn wgmma_is_chosen_on_sm90_only() {
        use GemmPath::*;
        assert_eq!(GemmPath::supported("sm_90"), vec![Wgmma, MmaSync]);
        for arch in ["sm_80", "sm_86", "sm_89", "sm_100", "sm_120"] {
            assert_eq!(GemmPath::supported(arch), vec![MmaSync], "{arch}");
        }
        assert_eq!(GemmPath::choose("sm_90", None).unwrap(), Wgmma);
        assert_eq!(GemmPath::choose("sm_89", None).unwrap(), MmaSync);
        assert_eq!(GemmPath::choose("sm_90", Some(MmaSync)).unwrap(), MmaSync);
        assert_eq!(GemmPath::choose("sm_90", Some(Wgmma)).unwrap(), Wgmma);
        assert!(GemmPath::choose("sm_80", Some(Wgmma)).is_err());
    }
}
