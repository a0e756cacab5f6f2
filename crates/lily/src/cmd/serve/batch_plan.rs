//! The memory plan of `lily serve`'s batch, checked at start: `--max-batch` sequences may each
//! fill the whole `--max-seq` context at once, and the snapshot cache may fill its budget, so
//! both must fit in the memory left after the weights. When they do not, the refusal says with
//! the numbers what would fit.

use anyhow::{Result, bail};
use lily_core::backend::Backend;
use lily_core::plan::BatchNeed;

use crate::backends::AnyBackend;
use crate::device::available_memory;

/// What was checked, for the start-up log.
pub struct BatchPlan {
    need: BatchNeed,
    snapshot_bytes: u64,
    /// Free memory after the weights, where known (the host's; the GPU checks each state as it
    /// allocates it).
    available: Option<u64>,
}

impl BatchPlan {
    pub fn check(
        backend: &AnyBackend,
        max_seq: usize,
        max_batch: usize,
        snapshot_bytes: u64,
    ) -> Result<Self> {
        let (kv_bytes, available) = match backend {
            // The CPU keeps f32 keys and values and grows each cache as its sequence does.
            AnyBackend::Cpu(_) => (4, available_memory()),
            AnyBackend::Cuda(_) => (lily_cuda::CudaOptions::from_env()?.kv.bytes(), None),
        };
        let plan = BatchPlan {
            need: backend.config().batch_need(kv_bytes, max_seq, max_batch),
            snapshot_bytes,
            available,
        };
        if let Some(available) = available {
            plan.refuse_beyond(available)?;
        }
        Ok(plan)
    }

    fn refuse_beyond(&self, available: u64) -> Result<()> {
        let need = &self.need;
        if need.total + self.snapshot_bytes <= available {
            return Ok(());
        }
        let for_batch = available.saturating_sub(self.snapshot_bytes);
        bail!(
            "{} generations (--max-batch) of {} tokens (--max-seq) need {} each ({} of KV \
             cache, {} of Gated DeltaNet state), {} in all, plus the {} snapshot cache \
             (--snapshot-cache-mb), but {} are free after the weights: at this context {} \
             generations fit; {} at once fit {} tokens each",
            need.sequences,
            need.max_seq,
            gb(need.per_sequence()),
            gb(need.kv_per_sequence),
            gb(need.state_per_sequence),
            gb(need.total),
            gb(self.snapshot_bytes),
            gb(available),
            need.sequences_fitting(for_batch),
            need.sequences,
            need.context_fitting(for_batch),
        );
    }

    /// One line: the batch, what it needs, and what is free.
    pub fn summary(&self) -> String {
        let need = &self.need;
        let free = match self.available {
            Some(bytes) => format!("{} free", gb(bytes)),
            None => "the GPU checks each state as it allocates it".to_string(),
        };
        format!(
            "up to {} generations at once, {} tokens each: {} of sequence state at most \
             ({} each), {} of snapshots; {free}",
            need.sequences,
            need.max_seq,
            gb(need.total),
            gb(need.per_sequence()),
            gb(self.snapshot_bytes)
        )
    }
}

fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

#[cfg(test)]
mod tests {
    use lily_core::config::{ModelConfig, QWEN36_35B_A3B_CONFIG};

    use super::*;

    #[test]
    fn a_batch_beyond_the_free_memory_is_refused_with_what_fits() {
        let config = ModelConfig::from_json(QWEN36_35B_A3B_CONFIG).unwrap();
        let need = config.batch_need(4, 32768, 8);
        let plan = BatchPlan {
            need,
            snapshot_bytes: 1 << 30,
            available: Some(need.total / 2 + (1 << 30)),
        };
        assert!(plan.refuse_beyond(need.total + (1 << 30)).is_ok());
        let refusal = plan.refuse_beyond(need.total / 2 + (1 << 30)).unwrap_err();
        let fitting = need.context_fitting(need.total / 2);
        let message = refusal.to_string();
        assert!(
            message.contains("at this context 4 generations fit")
                && message.contains(&format!("8 at once fit {fitting} tokens each")),
            "{message}"
        );
        assert!(plan.summary().contains("up to 8 generations at once"));
    }
}
