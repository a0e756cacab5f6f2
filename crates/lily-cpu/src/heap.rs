//! Where a forward pass's buffers come from: memory the process already holds.
//!
//! A 256-token prefill chunk of the full model allocates and frees about a gigabyte of
//! activations (each product's output, the rounded inputs, the experts' rows), in blocks of
//! hundreds of kilobytes to tens of megabytes. glibc's malloc hands blocks above its mmap
//! threshold back to the kernel when they are freed, and trims the heap's free top above its trim
//! threshold, so the next chunk faults the same memory in again a page at a time (1.8 µs a 4 KB
//! page on the development VM). With both thresholds raised, the 2-core machine's int8 prefill
//! went from 33.9 to 38.5-40.5 tok/s (the trim threshold alone: 35.8; the mmap one alone: 33.4).
//! The cost: the process keeps the most it ever freed (about one chunk's activations) until it
//! exits.

/// Keeps freed memory in the process (glibc; elsewhere the allocator's own policy stands).
pub(crate) fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // 32 MB is the largest mmap threshold glibc accepts on 64-bit machines; blocks
            // above it (none in a forward pass) still go back at once.
            const MMAP_THRESHOLD: libc::c_int = 32 << 20;
            // SAFETY: mallopt only sets malloc's parameters; both values are in range, and a
            // refused one leaves the default (its result says so, and either way is correct).
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
                libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
            }
        });
    }
}
