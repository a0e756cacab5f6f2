//! Where the kernel families of a decode step or a prefill chunk begin and end, for `lily
//! bench`'s breakdowns.

use anyhow::{Result, bail};
use cudarc::driver::CudaEvent;
use cudarc::driver::sys::CUevent_flags;

use crate::gpu::Gpu;

/// The marks between kernel families: events on the GPU's timeline between them (launched one
/// by one), or, for a step captured as a graph, how many kernels had been launched at each mark
/// (stamps.rs).
#[derive(Default)]
pub struct Timeline {
    marks: Vec<(&'static str, Mark)>,
    by_launch: bool,
}

enum Mark {
    Event(CudaEvent),
    Launches(usize),
}

impl Timeline {
    /// A timeline of launch counts (nothing enqueued, so a graph capture may record it).
    pub fn by_launch() -> Self {
        Timeline {
            marks: Vec::new(),
            by_launch: true,
        }
    }

    /// Records that the work enqueued since the previous mark belongs to `family`.
    pub(crate) fn mark(&mut self, gpu: &Gpu, family: &'static str) -> Result<()> {
        let mark = if self.by_launch {
            Mark::Launches(gpu.launches_logged())
        } else {
            let event = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            event.record(&gpu.stream)?;
            Mark::Event(event)
        };
        self.marks.push((family, mark));
        Ok(())
    }

    /// Milliseconds per family, summed over every step recorded (waits for the GPU).
    pub fn totals(&self) -> Result<Vec<(&'static str, f64)>> {
        let mut totals: Vec<(&'static str, f64)> = Vec::new();
        for pair in self.marks.windows(2) {
            let (Mark::Event(a), Mark::Event(b)) = (&pair[0].1, &pair[1].1) else {
                bail!("a timeline of launch counts has no times");
            };
            let ms = a.elapsed_ms(b)? as f64;
            match totals.iter_mut().find(|(f, _)| *f == pair[1].0) {
                Some((_, t)) => *t += ms,
                None => totals.push((pair[1].0, ms)),
            }
        }
        Ok(totals)
    }

    /// The family of each launch, in order: a launch belongs to the first mark after it.
    pub fn launch_families(&self) -> Result<Vec<&'static str>> {
        let mut families = Vec::new();
        for (family, mark) in &self.marks {
            let Mark::Launches(n) = mark else {
                bail!("a timeline of events has no launch counts");
            };
            families.resize(*n, *family);
        }
        Ok(families)
    }
}
