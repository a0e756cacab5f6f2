// y = W · x for one token, W quantised or dense. One warp per output row; up to four matrices
// that read the same x (q|k|v, qkv|z|b|a, router|shared gate) run as one launch, their outputs
// laid end to end in y, so the step has fewer launches and the tail blocks of one matrix overlap
// the next.

template <int BITS>
__device__ void gemv_rows(Mat m0, Mat m1, Mat m2, Mat m3, const float* __restrict__ x, float* __restrict__ y) {
    int lane = threadIdx.x % WARP;
    long r = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    long base = 0;
    Mat m = m0;
    if (r >= m0.rows) { r -= m0.rows; base += m0.rows; m = m1;
        if (r >= m1.rows) { r -= m1.rows; base += m1.rows; m = m2;
            if (r >= m2.rows) { r -= m2.rows; base += m2.rows; m = m3;
                if (r >= m3.rows) return; } } }
    float acc = warp_sum(row_dot_lane<BITS>(m, r, x, lane));
    if (lane == 0) y[base + r] = acc;
}

#define GEMV(BITS)                                                                              \
    extern "C" __global__ void gemv_b##BITS(Mat m0, Mat m1, Mat m2, Mat m3, const float* x, float* y) { \
        gemv_rows<BITS>(m0, m1, m2, m3, x, y);                                                  \
    }
GEMV(4)
GEMV(8)
GEMV(32)

// Row `token` of the embedding table, dequantised.
#define EMBED(BITS)                                                                             \
    extern "C" __global__ void embed_b##BITS(Mat table, const u32* token, float* out) {         \
        long r = token[0];                                                                      \
        for (int c = threadIdx.x; c < table.cols; c += blockDim.x) out[c] = mat_at<BITS>(table, r, c); \
    }
EMBED(4)
EMBED(8)
EMBED(32)
