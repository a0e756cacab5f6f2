//! The CPU backend's threads: a team that stays awake through a forward pass.
//!
//! A decode step is some 500 parallel regions (a dozen a layer), most of them tens of
//! microseconds of work. On a pool whose idle threads sleep (rayon's), each region first wakes
//! them: on the development VM that cost 16-30 µs a region at two threads (a probe: regions of
//! 10 µs of work after 20-1,000 µs of serial work took 26-70 µs), and on the 16-vCPU host the
//! router's region, a few µs of weights, took 78 µs a layer. Here the thread that runs a step
//! leads it, and the team's other threads spin between its regions, so a region starts in the
//! time one cache line takes to cross the chip. They go to sleep a while after a step ends.
//!
//! A region's indices are dealt out in contiguous shares, one a thread, each taken from the
//! front by its thread and then by any thread that has finished its own. Handing out one index at
//! a time to whichever thread asked made neighbouring heads of a Gated DeltaNet layer land on
//! different threads, and its decode heads took 194 µs a layer against 105 with shares (the
//! full model's states, 60 MB, stream from memory; 2-core probe, int8); the whole decode step
//! went 64-71 → 59-60 ms (alternated runs, three each).
//!
//! Regions are flat: a region started inside a task runs on that task's thread, in order. The
//! callers split their work so that one level holds the parallelism (a product's tasks, a
//! layer's heads).
//!
//! The team's threads, and the leader for the length of its step, flush subnormal floats to zero
//! (x86: the MXCSR's flush-to-zero and denormals-are-zero bits). The chunked delta rule
//! exponentiates cumulative log-decays, e^{γ_t} and e^{γ_t − γ_s}, which pass through the
//! subnormal range (e^-87 .. e^-104) in nearly every head of every chunk, and the W·S and
//! e^{γ_t}·Sᵀq products then run whole rows of subnormal operands. Intel cores take a microcode
//! assist for each vector instruction with a subnormal lane (Zen 4 does not): on the GPU host's
//! Xeon the GDN stage of a 256-token prefill took six times the time a head that the other stages
//! did. What flushing changes is below 1.2e-38 of a value: no sum the model forms can see it.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// How long the team spins after a step before it sleeps: a server's next decode step follows
/// within a millisecond or two (sampling, detokenising, streaming).
const LINGER: Duration = Duration::from_millis(3);

/// Spins between yields while waiting: a spinning thread gives its core to any other runnable
/// thread (a test binary runs several) every few microseconds.
const SPINS_PER_YIELD: u32 = 64;

type Task<'a> = &'a (dyn Fn(usize) + Sync);

struct Team {
    /// Threads in all, the leader's included.
    threads: usize,
    /// Held by the thread leading a step: steps run one at a time.
    step: Mutex<()>,
    /// `epoch << 1 | open`: a region opens with a new epoch and closes with the same one.
    region: AtomicU64,
    /// The open region's work: a `Task` on the leader's stack.
    task: AtomicPtr<()>,
    /// Each thread's share of the open region's indices, a contiguous run that it takes from
    /// the front, and the others take from too once theirs is done.
    shares: Box<[Share]>,
    /// Threads that saw the region open and may still use its task. The leader returns from a
    /// region only when this is zero after it closed the region, so a task never outlives it.
    busy: AtomicUsize,
    /// The first panic of a region's tasks, resumed on the leader.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Whether a step runs (the threads spin) or not (they sleep after [`LINGER`]).
    stepping: AtomicBool,
    awake: Mutex<bool>,
    wake: Condvar,
    /// When the last step ended, in nanoseconds from `born`.
    step_ended: AtomicU64,
    born: Instant,
}

thread_local! {
    /// This thread runs a region's task: regions it starts run here, in order.
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
    /// This thread leads a step.
    static LEADING: Cell<bool> = const { Cell::new(false) };
}

/// Threads in the team: `LILY_CPU_THREADS`, else one a logical CPU.
pub fn threads() -> usize {
    team().threads
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let threads = crate::options::threads();
        let team: &'static Team = Box::leak(Box::new(Team {
            threads,
            step: Mutex::new(()),
            region: AtomicU64::new(0),
            task: AtomicPtr::new(std::ptr::null_mut()),
            shares: (0..threads).map(|_| Share::default()).collect(),
            busy: AtomicUsize::new(0),
            panic: Mutex::new(None),
            stepping: AtomicBool::new(false),
            awake: Mutex::new(false),
            wake: Condvar::new(),
            step_ended: AtomicU64::new(0),
            born: Instant::now(),
        }));
        for seat in 1..team.threads {
            std::thread::Builder::new()
                .name(format!("lily-cpu-{seat}"))
                .spawn(move || team.work(seat))
                .unwrap_or_else(|e| panic!("the CPU backend could not start its threads: {e}"));
        }
        team
    })
}

/// Runs `f` as a step that this thread leads (at once, when it already leads one or runs a
/// task). Steps from several threads run one after another.
pub(crate) fn step<R>(f: impl FnOnce() -> R) -> R {
    if LEADING.get() || IN_TASK.get() {
        return f();
    }
    let team = team();
    let _lead = Lead::begin(team);
    f()
}

/// `f(i)` for every `i` in `0..n`, spread over the team.
pub(crate) fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    if n == 1 || IN_TASK.get() || threads() == 1 {
        (0..n).for_each(f);
    } else if !LEADING.get() {
        step(|| for_each(n, f));
    } else if n > 0 {
        team().region(n, &f);
    }
}

/// `f(i)` for every `i` in `0..n`, in order.
pub(crate) fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for_chunks(&mut out, 1, |i, slot| slot[0] = Some(f(i)));
    out.into_iter()
        .map(|r| r.expect("every index ran"))
        .collect()
}

/// `n` zeros, written by the team. A large `vec![0.0; n]` is a serial memset on the leading
/// thread (the heap keeps freed memory, heap.rs, which calloc must then clear): a prefill
/// chunk's GDN layer zeroed ~20 MB so.
pub(crate) fn zeros(n: usize) -> Vec<f32> {
    const TASK: usize = 64 << 10;
    if n <= TASK {
        return vec![0.0; n];
    }
    let mut v: Vec<f32> = Vec::with_capacity(n);
    for_chunks(&mut v.spare_capacity_mut()[..n], TASK, |_, chunk| {
        chunk.fill(std::mem::MaybeUninit::new(0.0))
    });
    // SAFETY: the region wrote all n elements.
    unsafe { v.set_len(n) };
    v
}

/// `f(i, chunk)` for the `i`th chunk of `len` (the last one shorter) of `data`.
pub(crate) fn for_chunks<T: Send>(data: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let data = Cut::new(data, len);
    // SAFETY: the team runs each index once, so no chunk is handed out twice.
    for_each(data.count, |i| f(i, unsafe { data.take(i) }));
}

/// `f(i, a_i, b_i)` for the `i`th chunks of two slices cut into the same number of chunks.
pub(crate) fn for_chunks2<A: Send, B: Send>(
    (a, a_len): (&mut [A], usize),
    (b, b_len): (&mut [B], usize),
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync,
) {
    let (a, b) = (Cut::new(a, a_len), Cut::new(b, b_len));
    assert_eq!(a.count, b.count, "chunk counts");
    // SAFETY: as in `for_chunks`.
    for_each(a.count, |i| {
        f(i, unsafe { a.take(i) }, unsafe { b.take(i) })
    });
}

/// `f(i, a_i, b_i, c_i)` for the `i`th chunks of three slices cut into the same number of chunks.
pub(crate) fn for_chunks3<A: Send, B: Send, C: Send>(
    (a, a_len): (&mut [A], usize),
    (b, b_len): (&mut [B], usize),
    (c, c_len): (&mut [C], usize),
    f: impl Fn(usize, &mut [A], &mut [B], &mut [C]) + Sync,
) {
    let (a, b, c) = (Cut::new(a, a_len), Cut::new(b, b_len), Cut::new(c, c_len));
    assert!(a.count == b.count && b.count == c.count, "chunk counts");
    // SAFETY: as in `for_chunks`.
    for_each(a.count, |i| unsafe {
        f(i, a.take(i), b.take(i), c.take(i))
    });
}

/// A mutable slice cut into chunks that tasks take by index.
struct Cut<T> {
    ptr: *mut T,
    len: usize,
    chunk: usize,
    count: usize,
}

// SAFETY: a `Cut` hands its chunks to other threads, each to one task; `T: Send` is enough.
unsafe impl<T: Send> Sync for Cut<T> {}

impl<T> Cut<T> {
    fn new(data: &mut [T], chunk: usize) -> Self {
        assert!(chunk > 0, "chunks of no elements");
        Cut {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            chunk,
            count: data.len().div_ceil(chunk),
        }
    }

    /// Chunk `i`. SAFETY: each `i` is taken at most once while the slice is borrowed.
    unsafe fn take<'a>(&self, i: usize) -> &'a mut [T] {
        let start = i * self.chunk;
        assert!(start < self.len, "chunk {i} of {}", self.count);
        // SAFETY: in bounds (above) and, by the caller's contract, not aliased.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(start), self.chunk.min(self.len - start))
        }
    }
}

/// A step's lease on the team; ends the step when dropped (returned or unwound).
struct Lead<'t> {
    team: &'t Team,
    _step: MutexGuard<'t, ()>,
    _mode: FlushSubnormals,
}

impl<'t> Lead<'t> {
    fn begin(team: &'t Team) -> Self {
        let step = team.step.lock().unwrap_or_else(|e| e.into_inner());
        team.set_stepping(true);
        LEADING.set(true);
        Lead {
            team,
            _step: step,
            _mode: FlushSubnormals::here(),
        }
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        LEADING.set(false);
        let now = self.team.born.elapsed().as_nanos() as u64;
        self.team.step_ended.store(now, Relaxed);
        self.team.set_stepping(false);
    }
}

impl Team {
    fn set_stepping(&self, on: bool) {
        let mut awake = self.awake.lock().unwrap_or_else(|e| e.into_inner());
        *awake = on;
        self.stepping.store(on, SeqCst);
        if on {
            self.wake.notify_all();
        }
    }

    /// One region, led by this thread: it opens the region, works on it, closes it and waits
    /// for every thread still inside.
    fn region(&self, n: usize, task: Task<'_>) {
        let epoch = (self.region.load(Relaxed) >> 1) + 1;
        self.task.store(&task as *const Task as *mut (), Relaxed);
        for (k, share) in self.shares.iter().enumerate() {
            share.next.store(k * n / self.threads, Relaxed);
            share.end.store((k + 1) * n / self.threads, Relaxed);
        }
        self.region.store(epoch << 1 | 1, SeqCst);
        IN_TASK.set(true);
        self.run_tasks(task, 0);
        IN_TASK.set(false);
        // The close and the threads' `busy` count are both sequentially consistent: a thread
        // that saw the region open is counted before the leader reads the count.
        self.region.store(epoch << 1, SeqCst);
        let mut spins = 0u32;
        while self.busy.load(SeqCst) != 0 {
            pause(&mut spins);
        }
        let first_panic = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = first_panic {
            panic::resume_unwind(p);
        }
    }

    /// Runs the open region's tasks from the share of `seat`, then from the others' in turn.
    fn run_tasks(&self, task: Task<'_>, seat: usize) {
        let (before, from_mine) = self.shares.split_at(seat);
        for share in from_mine.iter().chain(before) {
            while let Some(i) = share.take() {
                if let Err(p) = panic::catch_unwind(AssertUnwindSafe(|| task(i))) {
                    let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                    first.get_or_insert(p);
                }
            }
        }
    }

    /// A team thread's life: wait for a region, help with it, again.
    fn work(&self, seat: usize) {
        flush_subnormals_here();
        IN_TASK.set(true);
        let mut seen = self.region.load(Acquire);
        let mut spins = 0u32;
        loop {
            let now = self.region.load(Acquire);
            if now == seen {
                if spins.is_multiple_of(SPINS_PER_YIELD) && !self.stepping.load(Relaxed) {
                    self.sleep_if_idle();
                }
                pause(&mut spins);
                continue;
            }
            seen = now;
            spins = 0;
            if now & 1 == 1 {
                self.help(now, seat);
            }
        }
    }

    fn help(&self, open: u64, seat: usize) {
        self.busy.fetch_add(1, SeqCst);
        if self.region.load(SeqCst) == open {
            // SAFETY: the region is open and counts this thread as busy, so the leader waits in
            // `region` (where the task lives) until this thread is done with it.
            let task: Task<'_> = unsafe { *(self.task.load(Relaxed) as *const Task) };
            self.run_tasks(task, seat);
        }
        self.busy.fetch_sub(1, SeqCst);
    }

    /// Sleeps until the next step if none ran for [`LINGER`].
    fn sleep_if_idle(&self) {
        let ended = Duration::from_nanos(self.step_ended.load(Relaxed));
        if self.born.elapsed().saturating_sub(ended) < LINGER {
            return;
        }
        let mut awake = self.awake.lock().unwrap_or_else(|e| e.into_inner());
        while !*awake {
            awake = self.wake.wait(awake).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A thread's share of a region: the indices `next..end`, taken from the front. A line of its
/// own, so that threads taking from their own shares do not contend.
#[derive(Default)]
#[repr(align(128))]
struct Share {
    next: AtomicUsize,
    end: AtomicUsize,
}

impl Share {
    fn take(&self) -> Option<usize> {
        let end = self.end.load(Relaxed);
        if self.next.load(Relaxed) >= end {
            return None;
        }
        let i = self.next.fetch_add(1, Relaxed);
        (i < end).then_some(i)
    }
}

/// One turn of a wait: a spin hint, and every [`SPINS_PER_YIELD`] turns a yield.
fn pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(SPINS_PER_YIELD) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// The leader's floating-point mode for its step, restored after.
struct FlushSubnormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushSubnormals {
    fn here() -> Self {
        FlushSubnormals {
            #[cfg(target_arch = "x86_64")]
            saved: flush_subnormals_here(),
        }
    }
}

impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        set_mxcsr(self.saved);
    }
}

/// This thread's floating-point state: subnormal results and operands as zero. Returns the
/// state before.
#[cfg(target_arch = "x86_64")]
fn flush_subnormals_here() -> u32 {
    // MXCSR bit 15 (FTZ) and bit 6 (DAZ); the VEX and EVEX forms of the vector instructions obey
    // them too.
    const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
    let mut csr = 0u32;
    // SAFETY: stmxcsr writes only the 4 bytes given.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags)) };
    set_mxcsr(csr | FTZ_DAZ);
    csr
}

#[cfg(target_arch = "x86_64")]
fn set_mxcsr(csr: u32) {
    // SAFETY: ldmxcsr reads the 4 bytes given and sets this thread's MXCSR; the callers give a
    // value read from it with at most the two mode bits changed.
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags)) };
}

#[cfg(not(target_arch = "x86_64"))]
fn flush_subnormals_here() {}

#[cfg(test)]
mod tests;
