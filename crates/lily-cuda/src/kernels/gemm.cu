// gemm: being written.
__device__ int gemm_placeholder;
