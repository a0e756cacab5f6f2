// Mixture of experts for one decode token. Constants: NE experts, TOPK chosen per token, NORM_TOPK
// (renormalise the chosen weights). Routing stays on the device: the router logits, the chosen
// ids and their weights never visit the host. Three launches: router + top-k, gate/up, down (which
// adds into the residual stream). The first two normalise the residual stream themselves.

// Rows per warp of the router GEMV (step.rs, ROUTE_ROWS), and chunks per lane and row loaded
// together: 4 covers a 2,048-wide 8-bit row (128 chunks), so each warp's whole share arrives in
// one round trip, loaded before pdl_wait. Two rows instead of the GEMVs' four: the router is
// latency-bound (257 rows), and twice the warps halve each warp's dequantisation.
#define ROUTE_ROWS 2
#define ROUTE_BATCH 4

// The router and shared-gate GEMV over RMSNorm(hidden) · norm_w, then top-k in the last block to
// finish: each block publishes its logits (fence) and counts itself in `done`; the block that
// counts last sees every logit and routes. It also resets `done`, so the next launch (next layer,
// next graph replay) starts from zero.
template <int BITS>
__device__ void route(Mat router, Mat sh_gate, const float* hidden, const float* norm_w, float eps,
                      float* logits, int* ids, float* weights, u32* done) {
    __shared__ bool last;
    gemv_staged<BITS, ROUTE_ROWS, ROUTE_BATCH>(router, sh_gate, Mat{}, Mat{}, hidden, norm_w, eps, logits, false);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < WARP) route_topk(logits, threadIdx.x, ids, weights);
    if (threadIdx.x == 0) *done = 0;
}

// The down projection of the step's row blockIdx.y, R output rows a warp.
template <int BITS, int R>
__device__ void down_row(Mat down, Mat sh_down, int inter, int hidden, const int* ids, const float* weights,
                         const float* logits, const float* act, float* residual) {
    __shared__ DownSmem<BITS> s;
    down_combine<BITS, R>(down, sh_down, inter, hidden, ids + blockIdx.y * TOPK, weights + blockIdx.y * TOPK,
                          logits + blockIdx.y * (NE + 1), act + (long)blockIdx.y * (TOPK * inter + sh_down.cols),
                          residual + (long)blockIdx.y * hidden, s, blockIdx.x, gridDim.x);
}

// Each launch runs every row of the step: the grid's y is the row, whose hidden state, router
// logits (NE + 1 a row: the shared gate's last), choice (TOPK ids and weights) and act
// (TOPK · inter + the shared expert's width) lie at its row of the step's buffers.
#define MOE(BITS)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) moe_route_b##BITS(                          \
        Mat router, Mat sh_gate, const float* hidden, const float* norm_w, float eps, float* logits, \
        int* ids, float* weights, u32* done) {                                                    \
        route<BITS>(router, sh_gate, hidden + (long)blockIdx.y * router.cols, norm_w, eps, logits + blockIdx.y * (NE + 1), \
                    ids + blockIdx.y * TOPK, weights + blockIdx.y * TOPK, done + blockIdx.y);                          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 3) moe_gate_up_b##BITS(                     \
        Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids, const float* hidden, \
        const float* norm_w, float eps, float* act) {                                             \
        __shared__ __align__(16) float xs[XS_FLOATS(BITS)];                                       \
        __shared__ float xsum[XSUM_FLOATS(BITS)];                                                 \
        __shared__ float scratch[32];                                                             \
        gate_up<BITS>(gate, up, sh_gate, sh_up, inter, ids + blockIdx.y * TOPK, hidden + (long)blockIdx.y * gate.cols, norm_w, \
                      eps, act + (long)blockIdx.y * (TOPK * inter + sh_gate.rows), xs, xsum, scratch, blockIdx.x, \
                      gridDim.x);                                                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) moe_down_b##BITS(                           \
        Mat down, Mat sh_down, int inter, int hidden, const int* ids, const float* weights,       \
        const float* logits, const float* act, float* residual) {                                 \
        down_row<BITS, DOWN_ROWS>(down, sh_down, inter, hidden, ids, weights, logits, act, residual); \
    }
// One sequence's down projection, a row a warp (moe_decode.cuh, DOWN_ROWS).
#define MOE_DOWN_ONE(BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) moe_down_b##BITS##_r1(                      \
        Mat down, Mat sh_down, int inter, int hidden, const int* ids, const float* weights,       \
        const float* logits, const float* act, float* residual) {                                 \
        down_row<BITS, 1>(down, sh_down, inter, hidden, ids, weights, logits, act, residual);     \
    }
MOE(4)
MOE(8)
MOE(32)
MOE_DOWN_ONE(4)
MOE_DOWN_ONE(8)
