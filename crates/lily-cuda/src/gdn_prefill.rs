//! Launchers for kernels/gdn_prefill.cu (being written).
