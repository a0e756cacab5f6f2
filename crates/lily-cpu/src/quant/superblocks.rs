//! A weight row's code blocks taken together so that each i32 lane of the AVX-512 int8 kernel's
//! sums stays in one quantisation group over several blocks (int8_avx512.rs).
//!
//! In a block (64 code bytes) lane `l` holds columns `l·c..(l + 1)·c` (`c` = 8 for 4 bits, 4 for
//! 8), so a group of 64 four-bit columns is a run of 8 lanes and a block holds two groups. A
//! lane's integer sum can only run on while its group does: scaled by the group's scale every
//! block, the kernel spent three float instructions (convert, scale, add) a block and input row
//! per weight row beside two `vpdpbusd`, and was bound by them. Here `2^levels` blocks (a
//! super-block) go through a network of shuffles that leaves every lane of every output vector
//! in one group: each level pairs the runs of one group in two vectors, halving the runs, until
//! they are one lane long (or the super-block's blocks are used up). Then a lane sums its group's
//! products over the whole super-block in integers, exactly, and is scaled once.
//!
//! The network is given as indices ([`select`], [`butterflies`]), so the kernel's shuffles of the
//! codes and the layout the inputs are rounded into follow one schedule; [`totals`] sums many
//! vectors' lanes at once with the same shuffles.

use std::sync::{Arc, Mutex, OnceLock};

/// i32 lanes of a vector.
pub(crate) const LANES: usize = 16;

/// The most blocks a super-block takes: sixteen runs of one lane each.
const MAX_LEVELS: u32 = 4;

/// One level's lane choice, as `vpermt2d` would read it (an index below [`LANES`] takes `a`'s
/// lane, at or above it `b`'s). Both outputs of a pair hold, in the same places, lanes of `a`'s
/// groups and of `b`'s, half as many of each: so the lanes of a family of outputs share their
/// groups, whatever the level. The choices are those of cheap instructions (the kernel's
/// `mix`): with groups in runs of 16 or 8 lanes, whole quarters of the vector
/// (`vshufi32x4`); then, within each quarter, alternate dwords (`vpunpckl/hdq`), then qwords
/// (`vpunpckl/hqdq`). `run` names the level by the runs it starts from: 16, 8, 4 or 2.
pub(crate) fn select(run: usize, second: bool) -> [i32; LANES] {
    let s = second as usize;
    std::array::from_fn(|t| {
        let (quarter, dword) = (t / 4, t % 4);
        let from = match run {
            // Quarters (a 2s, a 2s+1, b 2s, b 2s+1).
            16 => quarter / 2 * LANES + (2 * s + quarter % 2) * 4 + dword,
            // Quarters (a s, a s+2, b s, b s+2).
            8 => quarter / 2 * LANES + (s + 2 * (quarter % 2)) * 4 + dword,
            // In each quarter, dwords (a 2s, b 2s, a 2s+1, b 2s+1).
            4 => dword % 2 * LANES + quarter * 4 + 2 * s + dword / 2,
            // In each quarter, dwords (a 2s, a 2s+1, b 2s, b 2s+1).
            2 => dword / 2 * LANES + quarter * 4 + 2 * s + dword % 2,
            _ => unreachable!("no level starts from runs of {run}"),
        };
        from as i32
    })
}

/// The network over a super-block's `n` vectors (its blocks in order) as butterflies
/// `f(i, j, run)`, in order: `v[i]` and `v[j]` are replaced by [`select`]'s first and second
/// outputs of the pair. Level `l` pairs member `m` of each family of `2^l` vectors (neighbours
/// the levels before mixed) with member `m` of the next family, with runs of `first_run >> l`.
/// Indices only, so the vector code and the layout of the inputs follow one schedule; plain
/// loops, inlined, so the kernel's schedule is unrolled where `n` is known.
#[inline(always)]
pub(crate) fn butterflies(n: usize, first_run: usize, mut f: impl FnMut(usize, usize, usize)) {
    assert!(n.is_power_of_two() && n <= 1 << MAX_LEVELS && n <= first_run.max(1));
    let (mut family, mut run) = (1, first_run);
    while family < n {
        for pair in (0..n).step_by(2 * family) {
            for i in pair..pair + family {
                f(i, i + family, run);
            }
        }
        (family, run) = (2 * family, run / 2);
    }
}

/// The sums of the lanes of each of `slots` vectors (a power of two up to 16), into one vector,
/// as merges `f(c, a, b, run)`: `v[c]` becomes the sum of [`select`]'s two outputs of `v[a]` and
/// `v[b]` at `run`, for runs of 16 down to 2; once one vector is left, it merges with itself.
/// Each output lane adds two lanes of one input, in places that do not depend on which input
/// or on how many there are, so a slot's lanes are summed in one tree whatever its place or
/// the count: a pair's result does not depend on the shape of the pass that computed it.
/// [`total_lanes`] says where each slot's sum lands.
#[inline(always)]
pub(crate) fn totals(slots: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    assert!(slots.is_power_of_two() && slots <= LANES);
    let mut n = slots;
    for run in [16, 8, 4, 2] {
        if n == 1 {
            f(0, 0, 0, run);
        }
        for c in 0..n / 2 {
            f(c, 2 * c, 2 * c + 1, run);
        }
        n = n.div_ceil(2);
    }
}

/// Where [`totals`] over `slots` vectors leaves slot `s`'s sum: lane `total_lanes(slots)[s]`.
pub(crate) fn total_lanes(slots: usize) -> [u8; LANES] {
    let mut v: Vec<[usize; LANES]> = (0..slots).map(|s| [s; LANES]).collect();
    totals(slots, |c, a, b, run| v[c] = pick(&v[a], &v[b], run, false));
    std::array::from_fn(|s| v[0].iter().position(|&l| l == s).unwrap_or(0) as u8)
}

/// Where the network over `n` blocks puts each block lane: output `k`'s lane `λ` holds block
/// `s / LANES`'s lane `s % LANES`, for `s = sources(…)[k][λ]`.
fn sources(n: usize, first_run: usize) -> Vec<[u16; LANES]> {
    let mut v: Vec<[u16; LANES]> = (0..n)
        .map(|b| std::array::from_fn(|l| (b * LANES + l) as u16))
        .collect();
    butterflies(n, first_run, |i, j, run| {
        let (a, b) = (v[i], v[j]);
        (v[i], v[j]) = (pick(&a, &b, run, false), pick(&a, &b, run, true));
    });
    v
}

/// [`select`]'s output from `a` and `b`.
fn pick<T: Copy>(a: &[T; LANES], b: &[T; LANES], run: usize, second: bool) -> [T; LANES] {
    let index = select(run, second);
    std::array::from_fn(|t| {
        let i = index[t] as usize;
        if i < LANES { a[i] } else { b[i - LANES] }
    })
}

/// One super-block of a row: blocks `first_block..first_block + 2^levels`.
#[derive(Clone, Debug)]
pub(crate) struct Superblock {
    pub first_block: usize,
    pub levels: u32,
    /// Its first group, and how many it covers (at most [`LANES`]).
    pub first_group: usize,
    pub groups: usize,
    /// Each output lane's group, from `first_group`.
    pub lane_group: [i32; LANES],
}

impl Superblock {
    pub fn blocks(&self) -> usize {
        1 << self.levels
    }
}

/// A row's blocks in super-blocks, for rows of `cols` columns of `bits`-bit codes in groups of
/// `group`.
#[derive(Clone, Debug)]
pub(crate) struct Superblocks {
    pub list: Vec<Superblock>,
    /// Lanes of one group in a block, at most [`LANES`]: the network's first run.
    pub first_run: usize,
    /// [`total_lanes`] for 1, 2, 4, 8 and 16 slots.
    pub total_lanes: [[u8; LANES]; 5],
}

impl Superblocks {
    /// The plan for a shape, made once: a decode step rounds hundreds of inputs, and making the
    /// plan for each (the network run on labels) was ~4 % of a decode-sized product.
    pub fn shared(cols: usize, block_cols: usize, group: usize) -> Arc<Superblocks> {
        type Plans = Mutex<Vec<((usize, usize, usize), Arc<Superblocks>)>>;
        static PLANS: OnceLock<Plans> = OnceLock::new();
        let key = (cols, block_cols, group);
        let mut plans = PLANS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, plan)) = plans.iter().find(|(k, _)| *k == key) {
            return plan.clone();
        }
        let plan = Arc::new(Superblocks::new(cols, block_cols, group));
        plans.push((key, plan.clone()));
        plan
    }

    pub fn new(cols: usize, block_cols: usize, group: usize) -> Self {
        assert!(cols.is_multiple_of(block_cols) && block_cols.is_multiple_of(LANES));
        let lane_cols = block_cols / LANES;
        assert!(group.is_multiple_of(lane_cols) && (group / lane_cols).is_power_of_two());
        // A group of 32 four-bit columns is a quarter's run of 4 lanes, the shortest.
        let first_run = (group / lane_cols).min(LANES);
        assert!(
            first_run >= 4,
            "groups of {group} columns are narrower than a quarter"
        );
        let most = first_run.trailing_zeros().min(MAX_LEVELS);
        let blocks = cols / block_cols;
        let mut list = Vec::new();
        let mut at = 0;
        // As many of the largest super-blocks as fit, then smaller ones: a row of 4 blocks (an
        // expert's 512-column down projection) is one of two levels rather than four of none.
        while at < blocks {
            let levels = most.min((blocks - at).ilog2());
            let n = 1usize << levels;
            let sources = sources(n, first_run);
            let group_of = |s: u16| {
                let (b, l) = (at + s as usize / LANES, s as usize % LANES);
                (b * block_cols + l * lane_cols) / group
            };
            let first_group = at * block_cols / group;
            let last_group = ((at + n) * block_cols - 1) / group;
            let lane_group: [i32; LANES] =
                std::array::from_fn(|l| (group_of(sources[0][l]) - first_group) as i32);
            assert!(
                sources
                    .iter()
                    .all(|v| (0..LANES)
                        .all(|l| group_of(v[l]) - first_group == lane_group[l] as usize)),
                "a lane left its group"
            );
            list.push(Superblock {
                first_block: at,
                levels,
                first_group,
                groups: last_group - first_group + 1,
                lane_group,
            });
            at += n;
        }
        Superblocks {
            list,
            first_run,
            total_lanes: std::array::from_fn(|i| total_lanes(1 << i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (cols, block_cols, group) the int8 kernel takes: the super-blocks cover the row,
    /// each block lane lands in exactly one output lane (`new` asserts that every lane keeps one
    /// group), and the lanes' groups are inside the super-block's.
    #[test]
    fn the_network_moves_every_block_lane_once() {
        for (cols, block_cols, group) in [
            (2048, 128, 64),
            (512, 128, 64),
            (384, 128, 64),
            (256, 128, 32),
            (2048, 128, 128),
            (1920, 128, 128),
            (192, 64, 64),
            (4096, 64, 128),
            (448, 64, 32),
            (128, 128, 64),
        ] {
            let plan = Superblocks::new(cols, block_cols, group);
            let blocks: usize = plan.list.iter().map(Superblock::blocks).sum();
            assert_eq!(blocks, cols / block_cols, "{cols} {block_cols} {group}");
            for sb in &plan.list {
                let n = sb.blocks();
                let mut seen = sources(n, plan.first_run).concat();
                seen.sort_unstable();
                assert!(seen.iter().copied().eq(0..(n * LANES) as u16));
                assert!(sb.groups <= LANES);
                assert!(sb.lane_group.iter().all(|&g| (g as usize) < sb.groups));
            }
        }
    }

    /// Each slot's total, to the bit, alone and among 2, 4, 8 or 16 slots, in f32 with values
    /// whose sum depends on the order of the additions; near the exact sum.
    #[test]
    fn every_slot_is_summed_in_one_tree() {
        let slot = |s: usize| -> [f32; LANES] {
            std::array::from_fn(|l| {
                let u = ((s * 131 + l * 71) % 97) as f32 / 97.0 - 0.5;
                u * 10f32.powi((l % 7) as i32 - 3)
            })
        };
        let fold = |slots: &[[f32; LANES]]| -> [f32; LANES] {
            let mut v = slots.to_vec();
            totals(slots.len(), |c, a, b, run| {
                let (x, y) = (
                    pick(&v[a], &v[b], run, false),
                    pick(&v[a], &v[b], run, true),
                );
                v[c] = std::array::from_fn(|t| x[t] + y[t]);
            });
            v[0]
        };
        let all: Vec<[f32; LANES]> = (0..LANES).map(slot).collect();
        let whole = fold(&all);
        for count in [1, 2, 4, 8, 16] {
            let lanes = total_lanes(count);
            for first in (0..LANES).step_by(count) {
                let part = fold(&all[first..first + count]);
                for s in 0..count {
                    let got = part[lanes[s] as usize];
                    let want = whole[total_lanes(LANES)[first + s] as usize];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "slot {} of {count}",
                        first + s
                    );
                    let exact: f64 = all[first + s].iter().map(|&v| v as f64).sum();
                    let size: f64 = all[first + s].iter().map(|&v| v.abs() as f64).sum();
                    assert!(
                        (got as f64 - exact).abs() < 1e-6 * size,
                        "{got} against {exact}"
                    );
                }
            }
        }
    }
}
