//! Subnormal floats flushed to zero on the threads the CPU backend computes on (x86: the MXCSR's
//! flush-to-zero and denormals-are-zero bits).
//!
//! Why: the chunked delta rule exponentiates cumulative log-decays, e^{γ_t} and e^{γ_t − γ_s},
//! which pass through the subnormal range (e^-87 .. e^-104) in nearly every head of every chunk
//! (decay rates of 1 to 16 a token reach it within 64 tokens), and the W·S and e^{γ_t}·Sᵀq
//! products then run whole rows of subnormal operands. Intel cores take a microcode assist for
//! each vector instruction with a subnormal lane (AMD's Zen 4 does not: a probe on the
//! development machine ran subnormal FMAs as fast as normal ones). On the GPU host's Xeon the
//! GDN stage of a 256-token prefill took 40 ms a layer at 16 threads against 51 at 2 on the Zen 4,
//! six times the time a head where every other stage scaled by 3 to 4. What flushing changes is
//! below 1.2e-38 of a value: no sum the model forms can see it.

use std::sync::Once;

/// Sets flush-to-zero and denormals-are-zero on every thread of rayon's pool, once a process.
pub(crate) fn flush_on_every_worker() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        rayon::broadcast(|_| flush_here());
    });
}

/// This thread's floating-point state: subnormal results and operands as zero.
#[cfg(target_arch = "x86_64")]
fn flush_here() {
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
fn flush_here() {}

#[cfg(test)]
mod tests {
    use std::hint::black_box;

    use super::*;

    /// A product that underflows and a subnormal operand are both zero on the pool after it,
    /// and stay what IEEE says on a thread outside it.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_pool_flushes_subnormals_and_other_threads_do_not() {
        let tiny = f32::from_bits(1); // the smallest subnormal
        let outside = std::thread::spawn(move || black_box(1e-30f32) * black_box(1e-10f32))
            .join()
            .unwrap();
        assert!(outside > 0.0 && outside < f32::MIN_POSITIVE, "{outside:e}");
        flush_on_every_worker();
        let on_pool: Vec<(f32, f32)> = rayon::broadcast(|_| {
            (
                black_box(1e-30f32) * black_box(1e-10f32),
                black_box(tiny) * black_box(1.0f32),
            )
        });
        assert!(
            on_pool.iter().all(|&(p, q)| p == 0.0 && q == 0.0),
            "{on_pool:?}"
        );
        // Normal results are untouched.
        let want = black_box(1e-20f32) * black_box(1e-10f32);
        let normal: Vec<f32> = rayon::broadcast(|_| black_box(1e-20f32) * black_box(1e-10f32));
        assert!(normal.iter().all(|&p| p == want), "{want:e}: {normal:?}");
    }
}
