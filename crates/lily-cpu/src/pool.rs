//! The CPU backend's threads: a rayon pool of its own, whose threads flush subnormal floats to
//! zero (x86: the MXCSR's flush-to-zero and denormals-are-zero bits). Every forward pass and
//! decode step runs in it (`profile::on_pool`), so every parallel region inside does too; the
//! process's global pool, which other libraries share, keeps IEEE subnormals.
//!
//! Why flush: the chunked delta rule exponentiates cumulative log-decays, e^{γ_t} and
//! e^{γ_t − γ_s}, which pass through the subnormal range (e^-87 .. e^-104) in nearly every head
//! of every chunk (decay rates of 1 to 16 a token reach it within 64 tokens), and the W·S and
//! e^{γ_t}·Sᵀq products then run whole rows of subnormal operands. Intel cores take a microcode
//! assist for each vector instruction with a subnormal lane (AMD's Zen 4 does not: a probe on
//! the development machine ran subnormal FMAs as fast as normal ones). On the GPU host's Xeon the
//! GDN stage of a 256-token prefill took 40 ms a layer at 16 threads against 51 at 2 on the Zen 4,
//! six times the time a head, where every other stage scaled by 3 to 4. What flushing changes is
//! below 1.2e-38 of a value: no sum the model forms can see it.
//!
//! Why a pool of its own: setting the mode on the global pool's threads after they exist needs a
//! broadcast to all of them, which deadlocks when a worker waits on whoever broadcasts; a pool
//! built here sets it as each thread starts.

use std::sync::OnceLock;

use rayon::{ThreadPool, ThreadPoolBuilder};

/// The pool, built on first use with as many threads as rayon's global pool would have.
pub(crate) fn pool() -> &'static ThreadPool {
    static POOL: OnceLock<ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        ThreadPoolBuilder::new()
            .thread_name(|i| format!("lily-cpu-{i}"))
            .start_handler(|_| flush_subnormals_here())
            .build()
            .unwrap_or_else(|e| panic!("the CPU backend could not start its threads: {e}"))
    })
}

/// This thread's floating-point state: subnormal results and operands as zero.
#[cfg(target_arch = "x86_64")]
fn flush_subnormals_here() {
    // MXCSR bit 15 (FTZ) and bit 6 (DAZ); the VEX and EVEX forms of the vector instructions obey
    // them too.
    const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
    let mut csr = 0u32;
    // SAFETY: stmxcsr and ldmxcsr read and write only the 4 bytes given and this thread's MXCSR;
    // the value written is the current one with two mode bits set.
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
        csr |= FTZ_DAZ;
        std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags));
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn flush_subnormals_here() {}

#[cfg(test)]
mod tests {
    use std::hint::black_box;

    use rayon::prelude::*;

    use crate::profile::on_pool;

    /// An underflowing product and a subnormal operand are zero on every thread a step's
    /// parallel regions use, and what IEEE says on a thread outside the backend's pool (rayon's
    /// global pool included).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_backends_threads_flush_subnormals_and_others_do_not() {
        let tiny = f32::from_bits(1); // the smallest subnormal
        let ieee = black_box(1e-30f32) * black_box(1e-10f32);
        assert!(ieee > 0.0 && ieee < f32::MIN_POSITIVE, "{ieee:e}");
        let global: Vec<f32> = (0..64)
            .into_par_iter()
            .map(|_| black_box(1e-30f32) * black_box(1e-10f32))
            .collect();
        assert!(global.iter().all(|&p| p == ieee), "the global pool flushed");
        let on_backend: Vec<(f32, f32, f32)> = on_pool(|| {
            (0..4096)
                .into_par_iter()
                .map(|_| {
                    (
                        black_box(1e-30f32) * black_box(1e-10f32),
                        black_box(tiny) * black_box(1.0f32),
                        black_box(1e-20f32) * black_box(1e-10f32),
                    )
                })
                .collect()
        });
        let normal = black_box(1e-20f32) * black_box(1e-10f32);
        assert!(
            on_backend
                .iter()
                .all(|&(p, q, n)| p == 0.0 && q == 0.0 && n == normal),
            "{:?}",
            on_backend
                .iter()
                .find(|&&(p, q, n)| p != 0.0 || q != 0.0 || n != normal)
        );
    }
}
