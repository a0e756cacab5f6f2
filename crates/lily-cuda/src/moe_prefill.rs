//! Launchers for kernels/moe_prefill.cu (being written).
