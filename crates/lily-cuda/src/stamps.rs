//! In-graph timestamps of a decode step (`LILY_STAMPS=1`, [`crate::options::CudaOptions::stamps`]).
//!
//! Launched one by one (`lily bench`'s other breakdown), each kernel family pays its launch and
//! its start-up in full; in the captured graph, programmatic launch overlaps them with the kernel
//! ahead. These stamps are taken inside the graph: every block of every launch records, at its
//! wait (kernels/common.cuh, `stamp_wait`), when it reached the wait and when the wait returned.
//! A launch's first return is the moment the kernel before it ended, so the time between two
//! launches' first returns is what that launch costs the step's chain; the time from its first
//! block's arrival to that return is how long its blocks sat resident with their weights
//! requested; a block that arrives after the first return found no room beside the kernel
//! ahead and started late. Some kernels also stamp points inside them (`STAMP_AT`, `STAMP_END`:
//! the phases [`point_name`] names), each block's time after the launch's first return.

use std::collections::{BTreeMap, HashMap, HashSet};

use anyhow::{Result, bail, ensure};

/// Words of one record (kernels/common.cuh, `STAMP_WORDS`).
pub const STAMP_WORDS: usize = 4;
/// Records the buffer holds: four replays of a step of ~300 launches of up to ~400 blocks, a
/// wait and up to five points each (~1M at B = 1), with room to spare (128 MB of device memory,
/// only while stamping).
pub const STAMP_RECORDS: usize = 1 << 22;

/// Replays of a stamped step before the stamps are kept, and replays summed (the last but one
/// of them: the last only ends its chain).
pub const WARM_REPLAYS: usize = 3;
pub const STAMPED_REPLAYS: usize = 4;
/// Decode steps a stamped run takes a sequence forward: the room its state needs.
pub const STEPS: usize = WARM_REPLAYS + STAMPED_REPLAYS;

/// The device buffer's length in u64 words: the count, the capacity, then the records.
pub fn buffer_words() -> usize {
    2 + STAMP_WORDS * STAMP_RECORDS
}

/// One launch of a stamped run, from its blocks' records (times in ns of the GPU's global timer).
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchStamps {
    /// The first and last block's arrival at the wait.
    pub first_reached: u64,
    pub last_reached: u64,
    /// The first block's return from the wait (its first wait, for a kernel with two).
    pub first_ready: u64,
    /// Each point's blocks, ns after `first_ready` (0 for one stamped before it).
    pub points: BTreeMap<u8, Vec<u64>>,
}

/// What point k of a kernel marks (kernels/*.cu, `STAMP_AT(k)` and `STAMP_END(k)`), by the
/// kernel's name; None for a point no kernel of that name stamps.
pub fn point_name(kernel: &str, point: u8) -> Option<&'static str> {
    const POINTS: [(&str, &[&str]); 6] = [
        (
            "moe_route_gate_up_",
            &[
                "x staged",
                "router rows done",
                "barrier passed",
                "top-k done",
                "end",
            ],
        ),
        ("moe_down_", &["act staged", "end"]),
        ("gemv_mma_", &["x staged", "end"]),
        ("gdn_step", &["end"]),
        ("gdn_decode_step", &["end"]),
        ("attn_split", &["end"]),
    ];
    let (_, names) = POINTS
        .iter()
        .find(|(prefix, _)| kernel.starts_with(prefix))?;
    names.get(usize::from(point).checked_sub(1)?).copied()
}

/// The launches of `replays` replays of one graph in the order they were scheduled, from the
/// buffer's words (the count, the capacity, records). A graph node keeps its `%gridid` from one
/// replay to the next, so a node's records are split into replays at the largest gaps between
/// them (microseconds within a replay, a whole step between two). A block that waits twice
/// (moe_route_gate_up) counts once, at its first.
pub fn launches(words: &[u64], replays: usize) -> Result<Vec<LaunchStamps>> {
    ensure!(words.len() >= 2, "no stamp header");
    ensure!(replays > 0, "no replays");
    let (count, capacity) = (words[0] as usize, words[1] as usize);
    if count > capacity {
        bail!("{count} stamps for room of {capacity}: the run overflowed the buffer");
    }
    ensure!(
        words.len() >= 2 + STAMP_WORDS * count,
        "{count} stamps in {} words",
        words.len()
    );
    // grid -> its waits as (ready, reached, block), and its points as (time, point).
    let mut by_grid: HashMap<u64, Vec<(u64, u64, u64)>> = HashMap::new();
    let mut points: HashMap<u64, Vec<(u64, u8)>> = HashMap::new();
    for r in words[2..2 + STAMP_WORDS * count].chunks_exact(STAMP_WORDS) {
        let block = r[3] & ((1 << 40) - 1);
        match (r[3] >> 56) as u8 {
            0 => by_grid.entry(r[0]).or_default().push((r[2], r[1], block)),
            point => points.entry(r[0]).or_default().push((r[1], point)),
        }
    }
    let mut all = Vec::with_capacity(by_grid.len() * replays);
    for (grid, mut records) in by_grid {
        ensure!(
            records.len() >= replays,
            "launch {grid:#x} has {} stamps for {replays} replays",
            records.len()
        );
        records.sort_unstable();
        // The replay boundaries: the replays - 1 largest gaps, in time order.
        let mut gaps: Vec<(u64, usize)> = records
            .windows(2)
            .enumerate()
            .map(|(i, w)| (w[1].0 - w[0].0, i + 1))
            .collect();
        gaps.sort_unstable_by(|a, b| b.cmp(a));
        let mut cuts: Vec<usize> = gaps[..replays - 1].iter().map(|&(_, at)| at).collect();
        cuts.sort_unstable();
        let bounds = std::iter::once(0)
            .chain(cuts)
            .chain(std::iter::once(records.len()));
        let bounds: Vec<usize> = bounds.collect();
        let mut replayed: Vec<LaunchStamps> = bounds
            .windows(2)
            .map(|w| launch_of(&records[w[0]..w[1]]))
            .collect();
        // A point belongs to the last replay of its node whose first block had arrived by then.
        for &(t, point) in points.get(&grid).map_or(&[][..], Vec::as_slice) {
            let at = replayed
                .iter()
                .rposition(|l| l.first_reached <= t)
                .unwrap_or(0);
            let l = &mut replayed[at];
            l.points
                .entry(point)
                .or_default()
                .push(t.saturating_sub(l.first_ready));
        }
        all.extend(replayed);
    }
    // A launch is scheduled only once every block of the one before it has reached its wait, so
    // the first arrivals order the launches.
    all.sort_by_key(|l| l.first_reached);
    Ok(all)
}

/// One launch from its blocks' records (ready, reached, block), sorted by ready.
fn launch_of(records: &[(u64, u64, u64)]) -> LaunchStamps {
    let mut l = LaunchStamps {
        first_reached: u64::MAX,
        last_reached: 0,
        first_ready: u64::MAX,
        points: BTreeMap::new(),
    };
    let mut seen = HashSet::new();
    for &(ready, reached, block) in records {
        // Sorted by ready, so a block's first record is its first wait.
        if !seen.insert(block) {
            continue;
        }
        l.first_reached = l.first_reached.min(reached);
        l.last_reached = l.last_reached.max(reached);
        l.first_ready = l.first_ready.min(ready);
    }
    l
}

/// One kernel's share of a stamped step, summed over its launches (µs).
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyStamps {
    /// The family and the kernel, as "family · kernel".
    pub family: String,
    pub launches: usize,
    /// From each launch's first return to the next launch's: its cost to the step's chain.
    pub chain_us: f64,
    /// From each launch's first arrival to its first return: how long it sat requested.
    pub resident_us: f64,
    /// From each launch's first return to its last block's arrival, where that is later: how
    /// long blocks waited for room after the kernel ahead had ended.
    pub late_us: f64,
    /// Points inside the kernel: (point, the median block's µs after the launch's first return,
    /// the last block's), each summed over the launches.
    pub points: Vec<(u8, f64, f64)>,
}

/// The step's families from the launches of `replays` consecutive replays of one graph of
/// `families.len()` launches (`families[i]` is launch i's label): the last but one replay's
/// launches, the last of them ending its chain at the last replay's first return.
pub fn step_families(
    launches: &[LaunchStamps],
    families: &[String],
    replays: usize,
) -> Result<Vec<FamilyStamps>> {
    let n = families.len();
    ensure!(replays >= 2 && n > 0, "stamps need two replays of a graph");
    ensure!(
        launches.len() == replays * n,
        "{} stamped launches for {replays} replays of {n} launches: some kernel did not stamp",
        launches.len()
    );
    let step = &launches[(replays - 2) * n..];
    let mut out: Vec<FamilyStamps> = Vec::new();
    for (i, family) in families.iter().enumerate() {
        let (l, next) = (&step[i], &step[i + 1]);
        let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
        let f = match out.iter_mut().position(|f| f.family == *family) {
            Some(at) => &mut out[at],
            None => {
                out.push(FamilyStamps {
                    family: family.clone(),
                    launches: 0,
                    chain_us: 0.0,
                    resident_us: 0.0,
                    late_us: 0.0,
                    points: Vec::new(),
                });
                out.last_mut().expect("just pushed")
            }
        };
        f.launches += 1;
        f.chain_us += us(l.first_ready, next.first_ready);
        f.resident_us += us(l.first_reached, l.first_ready);
        f.late_us += us(l.first_ready, l.last_reached);
        for (&point, times) in &l.points {
            let mut sorted = times.clone();
            sorted.sort_unstable();
            let (median, last) = (sorted[sorted.len() / 2], sorted[sorted.len() - 1]);
            match f.points.iter_mut().find(|p| p.0 == point) {
                Some(p) => {
                    p.1 += median as f64 / 1e3;
                    p.2 += last as f64 / 1e3;
                }
                None => f
                    .points
                    .push((point, median as f64 / 1e3, last as f64 / 1e3)),
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(words: &mut Vec<u64>, grid: u64, block: u64, sm: u64, reached: u64, ready: u64) {
        words.extend([grid, reached, ready, block | sm << 40]);
        words[0] += 1;
    }

    #[test]
    fn launches_are_ordered_by_first_arrival_and_a_second_wait_counts_once() {
        let mut w = vec![0, 100];
        // Launch 7 (scheduled second) and launch 3 (first), records interleaved.
        record(&mut w, 7, 0, 5, 2_000, 5_000);
        record(&mut w, 3, 1, 9, 1_200, 2_500);
        record(&mut w, 3, 0, 2, 1_000, 2_400);
        record(&mut w, 7, 1, 2, 3_000, 5_100);
        // Block 0 of launch 7 waits again later: ignored.
        record(&mut w, 7, 0, 5, 6_000, 6_100);
        let l = launches(&w, 1).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(
            l[0],
            LaunchStamps {
                first_reached: 1_000,
                last_reached: 1_200,
                first_ready: 2_400,
                points: BTreeMap::new(),
            }
        );
        // Its second wait (6,000 → 6,100) counts neither as an arrival nor as a return.
        assert_eq!((l[1].first_ready, l[1].last_reached), (5_000, 3_000));
    }

    #[test]
    fn a_node_replayed_keeps_its_grid_and_is_split_into_its_replays() {
        let mut w = vec![0, 100];
        // Two nodes (grids 1 and 2), three replays 1 ms apart, each block stamped once a replay,
        // grid 2's block 0 twice; grid 1's blocks spread over 40 µs.
        for r in 0..3u64 {
            let t = 1_000_000 * r;
            record(&mut w, 1, 0, 0, t + 100, t + 1_000);
            record(&mut w, 1, 1, 1, t + 200, t + 41_000);
            record(&mut w, 2, 0, 0, t + 900, t + 50_000);
            record(&mut w, 2, 0, 0, t + 60_000, t + 60_100);
        }
        let l = launches(&w, 3).unwrap();
        assert_eq!(l.len(), 6);
        for (i, launch) in l.iter().enumerate() {
            let t = 1_000_000 * (i as u64 / 2);
            let want = if i % 2 == 0 {
                (t + 100, t + 200, t + 1_000)
            } else {
                (t + 900, t + 900, t + 50_000)
            };
            let got = (
                launch.first_reached,
                launch.last_reached,
                launch.first_ready,
            );
            assert_eq!(got, want, "launch {i}");
        }
        assert!(launches(&w, 13).is_err());
    }

    fn point(words: &mut Vec<u64>, grid: u64, block: u64, point: u64, t: u64) {
        words.extend([grid, t, t, block | point << 56]);
        words[0] += 1;
    }

    #[test]
    fn points_go_to_their_replay_and_sum_as_median_and_last_blocks() {
        let mut w = vec![0, 100];
        // One node of three blocks, two replays 1 ms apart; point 2 of each block after the
        // wait, one block's stamped before the launch's first return is counted as 0.
        for r in 0..2u64 {
            let t = 1_000_000 * r;
            for b in 0..3 {
                record(&mut w, 9, b, 0, t + 100, t + 1_000 + 10 * b);
            }
            point(&mut w, 9, 0, 2, t + 3_000);
            point(&mut w, 9, 1, 2, t + 8_000);
            point(&mut w, 9, 2, 2, t + 4_000);
            point(&mut w, 9, 0, 1, t + 500);
        }
        let l = launches(&w, 2).unwrap();
        assert_eq!(l.len(), 2);
        for launch in &l {
            assert_eq!(launch.points[&2], vec![2_000, 7_000, 3_000]);
            assert_eq!(launch.points[&1], vec![0]);
        }
        let f = step_families(&l[..], &["k".to_string()], 2).unwrap();
        assert_eq!(f[0].points.len(), 2);
        let p2 = f[0].points.iter().find(|p| p.0 == 2).unwrap();
        assert!(
            (p2.1 - 3.0).abs() < 1e-9 && (p2.2 - 7.0).abs() < 1e-9,
            "{p2:?}"
        );
        assert_eq!(
            point_name("moe_route_gate_up_b4_r8", 3),
            Some("barrier passed")
        );
        assert_eq!(point_name("gemv_mma_add_b4_t1", 2), Some("end"));
        assert_eq!(point_name("gemv_mma_add_b4_t1", 3), None);
        assert_eq!(point_name("gdn_scan", 1), None);
        assert_eq!(point_name("moe_down_b4_r1", 0), None);
    }

    #[test]
    fn an_overflowed_buffer_is_an_error() {
        let w = vec![5, 4];
        assert!(
            launches(&w, 1)
                .unwrap_err()
                .to_string()
                .contains("overflowed")
        );
    }

    #[test]
    fn families_sum_the_last_but_one_replay_whose_chain_ends_at_the_last() {
        // Three replays of a graph of three launches: a, b, a.
        let mut l = Vec::new();
        for r in 0..3u64 {
            let t0 = r * 100_000;
            for (i, ready) in [10_000u64, 14_000, 30_000].into_iter().enumerate() {
                l.push(LaunchStamps {
                    first_reached: t0 + ready - 3_000 + i as u64,
                    last_reached: t0 + ready + 500,
                    first_ready: t0 + ready,
                    points: BTreeMap::new(),
                });
            }
        }
        let labels = ["a", "b", "a"].map(String::from);
        let f = step_families(&l, &labels, 3).unwrap();
        assert_eq!(f.len(), 2);
        // a: 10→14 (4 µs) and 30→110 (the next replay's first return): 84 µs.
        assert_eq!((f[0].family.as_str(), f[0].launches), ("a", 2));
        assert!((f[0].chain_us - 84.0).abs() < 1e-9, "{}", f[0].chain_us);
        assert!((f[1].chain_us - 16.0).abs() < 1e-9);
        assert!((f[0].resident_us - (3.0 + 2.998)).abs() < 1e-9);
        assert!((f[1].late_us - 0.5).abs() < 1e-9);
        // The chain of the middle replay is the replay's period.
        let total: f64 = f.iter().map(|f| f.chain_us).sum();
        assert!((total - 100.0).abs() < 1e-9);
        assert!(step_families(&l[..8], &labels, 3).is_err());
    }
}
