//! What `lily bench` prints after its table: where a decode step's and a prefill chunk's time
//! goes, family by family, on the GPU (kernels launched one by one, or the stamps inside the
//! graph, and the graph replayed back to back beside the timed step) or the CPU (a clock around
//! each stage of the forward pass).

use anyhow::Result;
use lily_core::backend::{Backend, LogitRows};
use lily_core::generate::prefill;

use super::{Args, Row, median, rotated};
use crate::backends::{AnyBackend, AnyState};

/// The breakdowns of the first context and the longest prompt asked for, after the timed rows
/// (`rows`, whose greedy steps the replayed graph is set beside).
pub(super) fn print_breakdowns(
    backend: &AnyBackend,
    args: &Args,
    tokens: &[u32],
    rows: &[Row],
) -> Result<()> {
    if let (AnyBackend::Cuda(gpu), Some(&ctx)) = (backend, args.contexts.first()) {
        // Where a step's time goes, op family by family: the persistent step's own timestamps,
        // or the graph's kernels launched one by one (so launch gaps show); one sequence, and
        // the largest batch the step takes of those asked for.
        let steps = 16;
        const REPLAYS: usize = 32;
        let largest = args
            .batch
            .iter()
            .copied()
            .filter(|&b| b <= gpu.step_rows())
            .max();
        let batches = [1].into_iter().chain(largest.filter(|&b| b > 1));
        // The timed greedy step of `batch` sequences at this context, in milliseconds.
        let timed_step_ms = |batch: usize| {
            rows.iter()
                .find(|r| r.kind == "decode" && !r.sampled && r.batch == batch && r.length == ctx)
                .map(|r| batch as f64 / median(&r.samples) * 1e3)
        };
        for batch in batches.filter(|&b| b == 1 || !gpu.persistent_decode()) {
            let mut states = Vec::with_capacity(batch);
            for i in 0..batch {
                // Room for the profiled steps and the stamped ones. Each sequence its own prompt,
                // as decode_rate's: identical sequences route alike, and a batch of them reads one
                // sequence's experts.
                let room = ctx + steps + lily_cuda::stamps::STEPS + REPLAYS + 2;
                let mut state = backend.new_state(room)?;
                prefill(
                    backend,
                    &mut state,
                    &rotated(tokens, ctx, i),
                    LogitRows::None,
                )?;
                states.push(state);
            }
            let mut rows: Vec<&mut lily_cuda::CudaState> = states
                .iter_mut()
                .filter_map(|s| match s {
                    AnyState::Cuda(s) => Some(&mut **s),
                    AnyState::Cpu(_) => None,
                })
                .collect();
            let families = gpu.profile_decode(&mut rows, steps)?;
            let total: f64 = families.iter().map(|(_, ms)| ms).sum();
            let how = if gpu.persistent_decode() {
                "timestamped inside the persistent kernel"
            } else {
                "kernels launched one by one"
            };
            println!(
                "\nper decode step of {batch} sequence(s) at context {ctx}, {how}: {total:.3} ms"
            );
            print_families(&families, total, "µs per step", 1e3);
            if !gpu.persistent_decode() {
                let replayed = gpu.replay_decode(&mut rows, REPLAYS)?;
                let timed = timed_step_ms(batch).map_or("not timed".into(), |ms| {
                    format!(
                        "{:.1} µs beyond the timed step's {ms:.3} ms",
                        (ms - replayed) * 1e3
                    )
                });
                println!(
                    "\nthe graph step replayed back to back, no token read between: {replayed:.3} ms \
                     ({:.1} tok/s); the host's turn between steps: {timed}",
                    batch as f64 / replayed * 1e3
                );
            }
            if gpu.stamping() && !gpu.persistent_decode() {
                print_stamps(batch, ctx, &gpu.stamp_decode(&mut rows)?);
            }
        }
    }
    if let (AnyBackend::Cuda(gpu), Some(&len)) = (backend, args.prompt_lens.iter().max()) {
        // One prefill chunk from an empty state, kernel family by family.
        let len = len.min(backend.max_prefill_chunk());
        let mut state = backend.new_state(len)?;
        if let AnyState::Cuda(s) = &mut state {
            let families = gpu.profile_prefill(s, &tokens[..len])?;
            let total: f64 = families.iter().map(|(_, ms)| ms).sum();
            println!(
                "\none prefill chunk of {len} tokens: {total:.2} ms ({:.0} tok/s)",
                len as f64 / total * 1e3
            );
            print_families(&families, total, "ms", 1.0);
        }
    }
    if let AnyBackend::Cpu(cpu) = &backend {
        // The same split on the CPU, from a clock around each stage of the forward pass.
        if let Some(&ctx) = args.contexts.first() {
            let steps = args.decode_steps.min(8);
            let mut state = cpu.new_state(ctx + steps + 1)?;
            prefill(&**cpu, &mut state, &tokens[..ctx], LogitRows::None)?;
            let (done, stages) = lily_cpu::profile::profiled(|| -> Result<()> {
                for &t in &tokens[..steps] {
                    cpu.decode(&mut state, t)?;
                }
                Ok(())
            });
            done?;
            let per_step: Vec<_> = stages
                .iter()
                .map(|&(s, ms)| (s, ms / steps as f64))
                .collect();
            let total: f64 = per_step.iter().map(|(_, ms)| ms).sum();
            println!("\nper decode step at context {ctx}, stage by stage: {total:.2} ms");
            print_families(&per_step, total, "ms per step", 1.0);
        }
        if let Some(&len) = args.prompt_lens.iter().max() {
            let len = len.min(backend.max_prefill_chunk());
            let mut state = cpu.new_state(len)?;
            let (done, stages) = lily_cpu::profile::profiled(|| {
                cpu.prefill(&mut state, &tokens[..len], LogitRows::Last)
            });
            done?;
            let total: f64 = stages.iter().map(|(_, ms)| ms).sum();
            println!(
                "\none prefill chunk of {len} tokens: {total:.1} ms ({:.1} tok/s)",
                len as f64 / total * 1e3
            );
            print_families(&stages, total, "ms", 1.0);
        }
    }
    Ok(())
}

/// A table of time per kernel family; `scale` converts milliseconds to `unit`.
fn print_families(families: &[(&str, f64)], total: f64, unit: &str, scale: f64) {
    println!("| kernel family | {unit} | share |\n|---|---:|---:|");
    for (family, ms) in families {
        println!(
            "| {family} | {:.2} | {:.0} % |",
            ms * scale,
            100.0 * ms / total
        );
    }
}

/// The in-graph breakdown of a step (lily_cuda::stamps): what each family costs the chain of
/// launches, how long its blocks sat resident before their inputs were ready, and how long its
/// last blocks waited for room after that.
fn print_stamps(batch: usize, ctx: usize, families: &[lily_cuda::stamps::FamilyStamps]) {
    let total: f64 = families.iter().map(|f| f.chain_us).sum();
    println!(
        "\nper decode step of {batch} sequence(s) at context {ctx}, in the graph, from the kernels' \
         stamps: {:.3} ms",
        total / 1e3
    );
    println!(
        "| kernel family | launches | µs on the chain | share | µs resident before ready | µs last block late |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for f in families {
        println!(
            "| {} | {} | {:.1} | {:.0} % | {:.1} | {:.1} |",
            f.family,
            f.launches,
            f.chain_us,
            100.0 * f.chain_us / total.max(1e-9),
            f.resident_us,
            f.late_us
        );
    }
    let with_points: Vec<_> = families.iter().filter(|f| !f.points.is_empty()).collect();
    if with_points.is_empty() {
        return;
    }
    println!(
        "\ninside the kernels, µs after a launch's first return (a launch: median block / last block)"
    );
    println!("| kernel | point | median block | last block |\n|---|---|---:|---:|");
    for f in with_points {
        let kernel = f.family.rsplit(" · ").next().unwrap_or(&f.family);
        for &(point, median, last) in &f.points {
            let name = lily_cuda::stamps::point_name(kernel, point).unwrap_or("?");
            let n = f.launches as f64;
            println!(
                "| {} | {point}: {name} | {:.2} | {:.2} |",
                f.family,
                median / n,
                last / n
            );
        }
    }
}
