//! Weights requested into L2 by a decode launch that waits anyway, for a later launch of the step
//! to read (kernels/common.cuh, `l2_ahead`). A decode step's weights depend on no activation, so
//! the only reason a kernel reads its weights from DRAM after its inputs are ready is that nothing
//! asked for them earlier; launches that spend microseconds on a barrier or on a small recurrence
//! can. Which launch requests what is fixed by the model, so the spans are a table in device
//! memory written once with the weights, and a launch takes its slice of it.

use anyhow::Result;
use cudarc::driver::CudaSlice;

use crate::gpu::{Gpu, ptr};
use crate::mat::DeviceMat;
use crate::weights::{DeviceLayer, DeviceMixer};

/// Where in a layer's decode step weights are requested ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AheadSite {
    /// The router's blocks between their barrier's arrival and wait (kernels/moe.cu): this
    /// layer's shared expert (read after top-k), then the next layer's input projections.
    Route,
    /// The mixer's recurrence or attention (`gdn_decode_step`, `attn_prep`): its output
    /// projection.
    MixerOut,
}

/// Every layer's spans, two sites a layer, as the kernels' `struct L2Span` (pointer, bytes).
pub struct L2Ahead {
    table: CudaSlice<u64>,
    /// (first span, spans) of layer l's site s at 2 · l + s.
    sites: Vec<(usize, usize)>,
}

/// A launch's slice of the table: the `ahead` and `ahead_spans` arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AheadArgs {
    pub spans: u64,
    pub count: i32,
}

impl L2Ahead {
    pub fn build(gpu: &Gpu, layers: &[DeviceLayer]) -> Result<Self> {
        let mut words = Vec::new();
        let mut sites = Vec::with_capacity(2 * layers.len());
        for (l, layer) in layers.iter().enumerate() {
            let mut route: Vec<&DeviceMat> = layer.moe.shared.iter().collect();
            match layers.get(l + 1).map(|next| &next.mixer) {
                Some(DeviceMixer::GatedDeltaNet(g)) => route.extend(&g.proj),
                Some(DeviceMixer::Attention(a)) => route.extend(&a.proj),
                None => {}
            }
            let out = match &layer.mixer {
                DeviceMixer::GatedDeltaNet(g) => &g.out_proj,
                DeviceMixer::Attention(a) => &a.o_proj,
            };
            for mats in [route, vec![out]] {
                let first = words.len() / 2;
                // Whole 16-byte pieces (the bulk prefetch's unit): the few bytes that leaves out
                // are read as before.
                for (p, bytes) in mats.iter().flat_map(|m| m.spans(gpu)) {
                    if bytes >= 16 {
                        words.extend([p, bytes as u64 & !15]);
                    }
                }
                sites.push((first, words.len() / 2 - first));
            }
        }
        // An empty table still needs an allocation to point at.
        words.resize(words.len().max(2), 0);
        Ok(Self {
            table: gpu.upload(&words)?,
            sites,
        })
    }

    pub fn at(&self, gpu: &Gpu, layer: usize, site: AheadSite) -> AheadArgs {
        let (first, count) = self.sites[2 * layer + site as usize];
        AheadArgs {
            spans: ptr(&self.table, &gpu.stream) + 16 * first as u64,
            count: count as i32,
        }
    }
}
