//! Launchers for kernels/gemm.cu (being written).
