// Mixture of experts for one decode token. Constants: NE experts, TOPK chosen per token, NORM_TOPK
// (renormalise the chosen weights), HIDDEN the residual stream's width. Routing stays on the
// device: the router logits, the chosen ids and their weights never visit the host. Two
// launches: the router, top-k and gate/up in one, then down (which adds into the residual stream).

// Chunks per lane of a router row loaded together: 4 covers a 2,048-wide 8-bit row (128 chunks),
// so each warp's row arrives in one round trip, requested before pdl_wait.
#define ROUTE_BATCH 4

// The matrices' shapes are the model's, compile-time constants (fixed_shape; the host checks
// that the launch's are the same): each row's chunk loop then has a known trip count and no
// reload path, and the divisions by the widths fold. With top-k's rounds as a loop (route.cuh),
// moe_route_gate_up_b4_r8 went from 5,296 SASS instructions, 80 registers and 52 / 44 bytes
// spilled to 3,536, 72 and none; moe_down_b4_r1 from 2,928 and 94 registers to 1,768 and 72.
// A row's act: the chosen experts' slots, then the shared one.
#define MOE_ACT (TOPK * MOE_INTER + SHARED_INTER)
__device__ __forceinline__ Mat fixed_shape(Mat m, int rows, int cols) {
    m.rows = rows;
    m.cols = cols;
    return m;
}

// A barrier over the blocks of one launch's row (grid y), once a launch, in two halves so that a
// block can work between its arrival and its wait. *sync counts the blocks that have arrived and
// starts every launch at zero: moe_down sets it back, and moe_down ends only after every block of
// this launch has passed (its pdl_wait waits for this grid to finish). So the count to wait for
// is known, and an arrival needs no answer: a fire-and-forget add, after which the last block to
// arrive waits one round trip to L2 (its first poll), where an atomic whose return it waited for
// and then a generation that it moved on cost it two. The arrival's release and the waits'
// acquire order every block's writes before its arrival (its logits) before every read after the
// wait. Every block of the launch must be resident at once (the host launches at most one wave).
__device__ __forceinline__ void route_arrive(u32* sync) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync) : "memory");
}

// The wait for all `blocks` blocks to have arrived (thread 0 polls).
__device__ __forceinline__ void route_wait(const u32* sync, u32 blocks) {
    if (threadIdx.x == 0) {
        u32 seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(sync) : "memory");
        } while (seen < blocks);
    }
    __syncthreads();
}

// The router, top-k and the experts' gate/up of one row, in one launch. Why one: routed as a
// launch of its own, the router (0.56 MB) cost a step ~9.8 µs a layer (docs/BENCHMARKS.md,
// 2026-12-03), a chain of its own end, gate/up's start, and a read of the choice back; here the
// blocks that run gate/up compute the router's rows first (a row a warp), meet at a barrier, and
// each routes for itself from the logits.
//
// x = RMSNorm(hidden) · norm_w is staged once a block for both (twice where the router's format
// differs from the experts': a code's prescale and a chunk's width depend on its bits; the
// experts' copy is then staged between the block's arrival at the barrier and its wait). Each
// router row is the same expression as in a staged GEMV of its own (one lane's chunks in order,
// then warp_sum), so every block sees the same logits and routes alike. Block 0 publishes the
// choice (ids, weights) for moe_down, which reads it before its pdl_wait: so no block lets the
// next kernel start until that is written (pdl_wait_holding_next, then gate/up's pdl_wait).
template <int BITS, int RBITS>
__device__ void route_gate_up(Mat router, Mat shared_logit, Mat gate, Mat up, Mat shared_gate, Mat shared_up,
                              const float* hidden, const float* norm_w, float eps, float* logits, int* ids,
                              float* weights, u32* sync, float* act) {
    constexpr bool OWN = RBITS != BITS;
    router = fixed_shape(router, NE, HIDDEN);
    shared_logit = fixed_shape(shared_logit, 1, HIDDEN);
    gate = fixed_shape(gate, NE * MOE_INTER, HIDDEN);
    up = fixed_shape(up, NE * MOE_INTER, HIDDEN);
    shared_gate = fixed_shape(shared_gate, SHARED_INTER, HIDDEN);
    shared_up = fixed_shape(shared_up, SHARED_INTER, HIDDEN);
    __shared__ __align__(16) float xs[XS_FLOATS_OF(BITS, HIDDEN)];
    __shared__ float xsum[XSUM_FLOATS_OF(BITS, HIDDEN)];
    __shared__ __align__(16) float rxs_own[OWN ? XS_FLOATS_OF(RBITS, HIDDEN) : 1];
    __shared__ float rxsum_own[OWN ? XSUM_FLOATS_OF(RBITS, HIDDEN) : 1];
    __shared__ float scratch[32];
    __shared__ int sid[TOPK];
    __shared__ float sw[TOPK];
    const float* rxs = OWN ? rxs_own : xs;
    const float* rxsum = OWN ? rxsum_own : xsum;
    const int cols = HIDDEN, lane = threadIdx.x % WARP;
    const long rows = (long)router.rows + shared_logit.rows;
    const long stride = (long)gridDim.x * (blockDim.x / WARP);
    // Block-fastest, as staged_units numbers units: the rows spread over every SM.
    long u = (long)(threadIdx.x / WARP) * gridDim.x + blockIdx.x;
    auto row_of = [&](long r) {
        return r < router.rows ? row_ref(router, r, RBITS) : row_ref(shared_logit, r - router.rows, RBITS);
    };
    constexpr int NB = ROUTE_BATCH;
    const int chunks = RBITS == 32 ? 0 : cols / (128 / RBITS);
    Batch<RBITS == 32 ? 8 : RBITS, 1, NB> b;
    RowRef row[1];
    if constexpr (RBITS != 32) {
        if (u < rows) {
            row[0] = row_of(u);
            load_batch<RBITS, 1, NB>(b, row, 0, chunks, router.group, lane);
        }
    }
    float4 nw[STAGE_UNROLL];
    norm_w_first(cols, norm_w, nw);
    pdl_wait_holding_next();
    const float inv = block_inv_rms(hidden, cols, eps, scratch);
    if constexpr (OWN)
        stage_x_values<RBITS>(cols, 1, hidden, norm_w, &inv, rxs_own, rxsum_own, 0, 0, nw);
    else
        stage_x_values<BITS>(cols, 1, hidden, norm_w, &inv, xs, xsum, 0, 0, nw);
    __syncthreads();
    STAMP_AT(1)
    for (; u < rows; u += stride) {
        float acc[1] = {0.f};
        if constexpr (RBITS == 32) {
            const float* w = (const float*)row_of(u).w;
            for (int c = lane; c < cols; c += WARP) acc[0] = __fmaf_rn(w[c], rxs[c], acc[0]);
        } else {
            const int xoff[1] = {0};
            for (int base = 0; base < chunks; base += WARP * NB) {
                if (base > 0) load_batch<RBITS, 1, NB>(b, row, base, chunks, router.group, lane);
                dot_batch<RBITS, 1, NB, true>(b, base, chunks, xoff, rxs, rxsum, lane, acc);
            }
            if (u + stride < rows) {
                row[0] = row_of(u + stride);
                load_batch<RBITS, 1, NB>(b, row, 0, chunks, router.group, lane);
            }
        }
        const float v = warp_sum(acc[0]);
        if (lane == 0) logits[u < router.rows ? u : NE + (u - router.rows)] = v;
    }
    // The experts' x in their own format is staged between the block's arrival and its wait, off
    // the chain from the last router row to top-k.
    STAMP_AT(2)
    route_arrive(sync);
    if constexpr (OWN) stage_x_values<BITS>(cols, 1, hidden, norm_w, &inv, xs, xsum, 0, 0);
    route_wait(sync, gridDim.x);
    STAMP_AT(3)
    if (threadIdx.x < WARP) route_topk(logits, lane, sid, sw);
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x < TOPK) {
        ids[threadIdx.x] = sid[threadIdx.x];
        weights[threadIdx.x] = sw[threadIdx.x];
        __threadfence();
    }
    __syncthreads();
    STAMP_AT(4)
    gate_up_staged<BITS>(gate, up, shared_gate, shared_up, MOE_INTER, sid, act, [] {}, xs, xsum, blockIdx.x,
                         gridDim.x);
    STAMP_END(5)
}

// The down projection of the step's row blockIdx.y, R output rows a warp. Past down_combine's
// pdl_wait, moe_route_gate_up has finished, so its barrier's count goes back to zero for the next
// launch (route_arrive).
template <int BITS, int R>
__device__ void down_row(Mat down, Mat sh_down, const int* ids, const float* weights, const float* logits,
                         const float* act, float* residual, u32* sync) {
    __shared__ DownSmem<BITS> s;
    down_combine<BITS, R>(fixed_shape(down, NE * HIDDEN, MOE_INTER), fixed_shape(sh_down, HIDDEN, SHARED_INTER),
                          MOE_INTER, HIDDEN, ids + blockIdx.y * TOPK, weights + blockIdx.y * TOPK,
                          logits + blockIdx.y * (NE + 1), act + (long)blockIdx.y * MOE_ACT,
                          residual + (long)blockIdx.y * HIDDEN, s, blockIdx.x, gridDim.x);
    if (blockIdx.x == 0 && threadIdx.x == 0) sync[blockIdx.y] = 0;
    STAMP_END(2)
}

// Each launch runs every row of the step: the grid's y is the row, whose hidden state, router
// logits (NE + 1 a row: the shared gate's last), choice (TOPK ids and weights), barrier count
// (a word) and act (MOE_ACT) lie at its row of the step's buffers. The router's bits (RBITS) and
// the experts' may differ.
#define MOE_ROUTE_GATE_UP(BITS, RBITS)                                                            \
    extern "C" __global__ void __launch_bounds__(256, 3) moe_route_gate_up_b##BITS##_r##RBITS(    \
        Mat router, Mat shared_logit, Mat gate, Mat up, Mat shared_gate, Mat shared_up,           \
        const float* hidden, const float* norm_w, float eps, float* logits, int* ids, float* weights, \
        u32* sync, float* act) {                                                                  \
        route_gate_up<BITS, RBITS>(router, shared_logit, gate, up, shared_gate, shared_up,        \
                                   hidden + (long)blockIdx.y * HIDDEN, norm_w, eps,               \
                                   logits + blockIdx.y * (NE + 1), ids + blockIdx.y * TOPK,       \
                                   weights + blockIdx.y * TOPK, sync + blockIdx.y,            \
                                   act + (long)blockIdx.y * MOE_ACT);                             \
    }
#define MOE(BITS)                                                                                 \
    MOE_ROUTE_GATE_UP(BITS, 4)                                                                    \
    MOE_ROUTE_GATE_UP(BITS, 8)                                                                    \
    MOE_ROUTE_GATE_UP(BITS, 32)                                                                   \
    extern "C" __global__ void __launch_bounds__(256) moe_down_b##BITS(                           \
        Mat down, Mat sh_down, const int* ids, const float* weights, const float* logits,         \
        const float* act, float* residual, u32* sync) {                                           \
        down_row<BITS, DOWN_ROWS>(down, sh_down, ids, weights, logits, act, residual, sync);      \
    }
// One sequence's down projection, a row a warp (moe_decode.cuh, DOWN_ROWS).
#define MOE_DOWN_ONE(BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) moe_down_b##BITS##_r1(                      \
        Mat down, Mat sh_down, const int* ids, const float* weights, const float* logits,         \
        const float* act, float* residual, u32* sync) {                                           \
        down_row<BITS, 1>(down, sh_down, ids, weights, logits, act, residual, sync);              \
    }
MOE(4)
MOE(8)
MOE(32)
MOE_DOWN_ONE(4)
MOE_DOWN_ONE(8)
