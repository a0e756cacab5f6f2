// The graph decode step's dense 4-bit GEMVs on the integer tensor cores (gemv_imma.cuh), compiled
// only where CudaOptions::decode_kernels selects them (gemv_imma.rs launches them).

// y = W · x (gemv_q4_norm: of RMSNorm(hidden) · norm_w; gemv_q4_add: y += ...) for 1 to 8 rows,
// 4-bit weights in groups of a multiple of 64, compiled for 1, 2 and 4 tiles of x parts (up to 2,
// 4 and 8 rows). A row's
// result is its own whatever the others are and whichever tiles run it, so the single-sequence
// step runs these too. At most half an SM's registers a block (gemv.rs sizes blocks to 8 warps):
// the next kernel's block fits beside it.
#define GEMV_Q4(T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * IMMA_WARPS, 2) gemv_q4_norm_t##T(                \
        Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* hidden, const float* norm_w, float eps, float* y, \
        int split) {                                                                                 \
        gemv_imma<T, 4>(m0, m1, m2, m3, nx, hidden, norm_w, eps, y, false, split);                     \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * IMMA_WARPS, 2) gemv_q4_add_t##T(                 \
        Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* x, float* y, int split) {               \
        gemv_imma<T, 4>(m0, m1, m2, m3, nx, x, nullptr, 0.f, y, true, split);                          \
    }
GEMV_Q4(1)
GEMV_Q4(2)
GEMV_Q4(4)

// y += W · (RMSNorm(o) · w · silu(z)): the Gated DeltaNet's output projection with its gated
// norm (per value head, z from the proj rows) staged in place of x, one launch instead of
// gdn_gated_norm's and the projection's.
#define GEMV_Q4_GATED(T)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * IMMA_WARPS, 2) gemv_q4_gated_t##T(               \
        Mat m, int nx, const float* o, const float* proj, const float* norm_w, float eps, float* y, int split) { \
        gemv_imma_gated<T>(m, nx, o, proj, norm_w, eps, y, split);                                   \
    }
GEMV_Q4_GATED(1)
GEMV_Q4_GATED(2)
GEMV_Q4_GATED(4)

// The Gated DeltaNet's input projection with the causal conv fused into its stores: one launch
// instead of the projection's and gdn_conv's.
#define GEMV_Q4_GDN(T)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * IMMA_WARPS, 2) gemv_q4_gdn_t##T(                 \
        Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* hidden, const float* norm_w, float eps, float* proj, \
        const float* conv_w, RowPtrs window, float* conv, int split) {                               \
        gemv_imma_gdn_in<T>(m0, m1, m2, m3, nx, hidden, norm_w, eps, proj, conv_w, window, conv, split); \
    }
GEMV_Q4_GDN(1)
GEMV_Q4_GDN(2)
GEMV_Q4_GDN(4)
