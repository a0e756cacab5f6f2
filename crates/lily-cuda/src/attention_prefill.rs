//! Launchers for kernels/attention_prefill.cu (being written).
