// y = W · x for one token, W quantised or dense. One warp per output row; up to four matrices
// that read the same x (q|k|v, qkv|z|b|a, router|shared gate) run as one launch, their outputs
// laid end to end in y, so the step has fewer launches and the tail blocks of one matrix overlap
// the next.

// Rows handled by one warp: their x chunks are shared, and R independent 16-byte loads per lane
// are in flight at once.
#define GEMV_ROWS 4

template <int BITS>
__device__ void gemv_rows(Mat m0, Mat m1, Mat m2, Mat m3, const float* __restrict__ x, float* __restrict__ y) {
    int lane = threadIdx.x % WARP;
    long warp = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    // Each matrix gets whole warps, so a warp's rows never straddle two matrices.
    Mat ms[4] = {m0, m1, m2, m3};
    long base = 0;
    int which = -1;
    for (int i = 0; i < 4; i++) {
        long warps = (ms[i].rows + GEMV_ROWS - 1) / GEMV_ROWS;
        if (warp < warps) { which = i; break; }
        warp -= warps;
        base += ms[i].rows;
    }
    if (which < 0) return;
    Mat m = ms[which];
    long r0 = warp * GEMV_ROWS;
    int n = (int)min((long)GEMV_ROWS, m.rows - r0);
    RowRef rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) rows[r] = row_ref(m, r0 + min(r, n - 1), BITS);
    float acc[GEMV_ROWS] = {};
    rows_dot_lane<BITS, GEMV_ROWS>(rows, n, m.cols, m.group, x, lane, acc);
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0 && r < n) y[base + r0 + r] = v;
    }
}

#define GEMV(BITS)                                                                              \
    extern "C" __global__ void gemv_b##BITS(Mat m0, Mat m1, Mat m2, Mat m3, const float* x, float* y) { \
        gemv_rows<BITS>(m0, m1, m2, m3, x, y);                                                  \
    }
GEMV(4)
GEMV(8)
GEMV(32)

// The embedding rows of tokens[0..gridDim.x), dequantised: one block per token.
#define EMBED(BITS)                                                                             \
    extern "C" __global__ void embed_b##BITS(Mat table, const u32* tokens, float* out) {        \
        long r = tokens[blockIdx.x];                                                            \
        out += (long)blockIdx.x * table.cols;                                                   \
        for (int c = threadIdx.x; c < table.cols; c += blockDim.x) out[c] = mat_at<BITS>(table, r, c); \
    }
EMBED(4)
EMBED(8)
EMBED(32)
