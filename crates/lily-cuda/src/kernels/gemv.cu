// y = W · x for one token, W quantised or dense (gemv_staged in gemv_staged.cuh: x staged in shared
// memory, four rows per warp). Up to four matrices that read the same x (q|k|v, qkv|z|b|a) run as
// one launch, their outputs laid end to end in y. Three forms, so that decode needs no separate
// norm or residual-add launches:
//   gemv_b*       y = W · x
//   gemv_norm_b*  y = W · (RMSNorm(hidden) · norm_w): the layer's input norm, the final norm
//   gemv_add_b*   y += W · x: the mixer output projection adding into the residual stream
#define GEMV(BITS)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) gemv_b##BITS(Mat m0, Mat m1, Mat m2, Mat m3, \
                                                                   const float* x, float* y) {    \
        gemv_staged<BITS>(m0, m1, m2, m3, x, nullptr, 0.f, y, false);                             \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) gemv_norm_b##BITS(                          \
        Mat m0, Mat m1, Mat m2, Mat m3, const float* hidden, const float* norm_w, float eps, float* y) { \
        gemv_staged<BITS>(m0, m1, m2, m3, hidden, norm_w, eps, y, false);                         \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) gemv_add_b##BITS(Mat m0, Mat m1, Mat m2, Mat m3, \
                                                                       const float* x, float* y) { \
        gemv_staged<BITS>(m0, m1, m2, m3, x, nullptr, 0.f, y, true);                              \
    }
GEMV(4)
GEMV(8)
GEMV(32)

// The same for the rows of a batched step (gemv_rows.cuh), NX a bound on their count nx: x and y
// hold a row per sequence, end to end. One kernel per format, form and bound (2, 4 or 8 rows).
#define GEMV_ROWS_NX(BITS, NX)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) gemv_rows_norm_b##BITS##_x##NX(                \
        Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* hidden, const float* norm_w, float eps, float* y) { \
        gemv_rows<BITS, NX>(m0, m1, m2, m3, nx, hidden, norm_w, eps, y, false);                      \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) gemv_rows_add_b##BITS##_x##NX(                 \
        Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* x, float* y) {                          \
        gemv_rows<BITS, NX>(m0, m1, m2, m3, nx, x, nullptr, 0.f, y, true);                           \
    }
#define GEMV_ROWS_ALL(BITS) GEMV_ROWS_NX(BITS, 2) GEMV_ROWS_NX(BITS, 4) GEMV_ROWS_NX(BITS, 8)
GEMV_ROWS_ALL(4)
GEMV_ROWS_ALL(8)
GEMV_ROWS_ALL(32)

// The same for 1 to 8 rows on the tensor cores (gemv_mma.cuh): 4-bit weights in groups of a
// multiple of 64, compiled for one tile of x parts (up to 2 rows) and three (up to 8). A row's
// result is its own whatever the others are and whichever layout runs it, so the single-sequence
// step runs these too.
#define GEMV_MMA(TILES)                                                                           \
    extern "C" __global__ void __launch_bounds__(512, 1) gemv_mma_norm_b4_t##TILES(              \
        Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* hidden, const float* norm_w, float eps, float* y) { \
        gemv_mma<TILES>(m0, m1, m2, m3, nx, hidden, norm_w, eps, y, false);                         \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(512, 1) gemv_mma_add_b4_t##TILES(               \
        Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* x, float* y) {                       \
        gemv_mma<TILES>(m0, m1, m2, m3, nx, x, nullptr, 0.f, y, true);                           \
    }
GEMV_MMA(1)
GEMV_MMA(3)

// The embedding rows of tokens[0..gridDim.x), dequantised: one block per token (a prefill chunk).
// embed_rows_b*: the same for a decode step, row r's token in its sequence's slot.
template <int BITS>
__device__ __forceinline__ void embed_row(const Mat& table, long r, float* out) {
    for (int c = threadIdx.x; c < table.cols; c += blockDim.x) out[c] = mat_at<BITS>(table, r, c);
}
#define EMBED(BITS)                                                                              \
    extern "C" __global__ void embed_b##BITS(Mat table, const u32* tokens, float* out) {         \
        pdl_wait();                                                                              \
        embed_row<BITS>(table, tokens[blockIdx.x], out + (long)blockIdx.x * table.cols);         \
    }                                                                                            \
    extern "C" __global__ void embed_rows_b##BITS(Mat table, RowPtrs tokens, float* out) {       \
        pdl_wait();                                                                              \
        embed_row<BITS>(table, *(const u32*)tokens.at(blockIdx.x), out + (long)blockIdx.x * table.cols); \
    }
EMBED(4)
EMBED(8)
EMBED(32)
