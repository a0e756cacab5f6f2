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

// The router's logits go from its rows to every block's top-k as words of 8 bytes, the logit in
// the low half and the launch's epoch in the high: a 64-bit store reaches L2 whole, so a reader
// that sees the epoch sees the logit. No barrier, no fence: the barrier this replaced (an
// arrival's release, an add, a poll, then the logits' read) was four trips to L2 in a row
// after the last router row (docs/BENCHMARKS.md, 2026-12-07, twenty-second session); now a
// block's reader polls the logits themselves. The epoch is the row's word `epoch` plus one,
// which moe_down advances once every block of this launch has finished, so a word left by an
// earlier launch (this layer's buffer is every layer's) never carries the current epoch. Every
// block of the launch must be resident at once (the host launches at most one wave).
__device__ __forceinline__ void tagged_store(u64* at, float v, u32 epoch) {
    const u64 w = (u64)epoch << 32 | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(at), "l"(w) : "memory");
}
__device__ __forceinline__ u64 tagged_load(const u64* at) {
    u64 w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(at) : "memory");
    return w;
}
__device__ __forceinline__ bool tag_is(u64 w, u32 epoch) { return (u32)(w >> 32) == epoch; }

// Waits for the launch's NE logits, then routes (route_choose): one warp.
__device__ void route_topk_tagged(const u64* tagged, u32 epoch, int lane, int* ids, float* weights) {
    u64 w[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) {
        const int e = lane + i * WARP;
        w[i] = e < NE ? tagged_load(tagged + e) : (u64)epoch << 32 | __float_as_uint(-INFINITY);
    }
    for (;;) {
        bool ready = true;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; i++) ready &= tag_is(w[i], epoch);
        if (__all_sync(0xffffffffu, ready)) break;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; i++)
            if (!tag_is(w[i], epoch)) w[i] = tagged_load(tagged + lane + i * WARP);
    }
    float p[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) p[i] = __uint_as_float((u32)w[i]);
    route_choose(p, lane, ids, weights);
}

// The router, top-k and the experts' gate/up of one row, in one launch. Why one: routed as a
// launch of its own, the router (0.56 MB) cost a step ~9.8 µs a layer (docs/BENCHMARKS.md,
// 2026-12-03), a chain of its own end, gate/up's start, and a read of the choice back; here the
// blocks that run gate/up compute the router's rows first (a row a warp), meet at a barrier, and
// each routes for itself from the logits (tagged with the launch's epoch, above).
//
// x = RMSNorm(hidden) · norm_w is staged once a block for both (twice where the router's format
// differs from the experts': a code's prescale and a chunk's width depend on its bits; the
// experts' copy is staged after the router's rows while the block's last warp waits for the
// logits: at HIDDEN 2,048 the staging takes 16 of 24 warps). Each router row is the same
// expression as in a staged GEMV of its own (one lane's chunks in order, then warp_sum), so every
// block sees the same logits and routes alike. Block 0 publishes the choice (ids, weights, and
// the shared gate's logit, logits[NE]) for moe_down, which reads it before its pdl_wait: so no
// block lets the next kernel start until that is written (pdl_wait_holding_next, then gate/up's
// pdl_wait).
template <int BITS, int RBITS>
__device__ void route_gate_up(Mat router, Mat shared_logit, Mat gate, Mat up, Mat shared_gate, Mat shared_up,
                              const float* hidden, const float* norm_w, float eps, float* logits, u64* tagged,
                              int* ids, float* weights, const u32* epoch_word, float* act) {
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
    const u32 epoch = (u32)ldcg_int((const int*)epoch_word) + 1u;
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
        if (lane == 0) tagged_store(tagged + (u < router.rows ? u : NE + (u - router.rows)), v, epoch);
    }
    STAMP_AT(2)
    // The last warp routes while the others stage; it stages its own part (if any) after.
    const bool routing = threadIdx.x / WARP == blockDim.x / WARP - 1;
    if (routing) {
        route_topk_tagged(tagged, epoch, lane, sid, sw);
        if (blockIdx.x == 0) {
            if (lane < TOPK) {
                ids[lane] = sid[lane];
                weights[lane] = sw[lane];
            }
            if (lane == 0) {
                u64 w;
                do w = tagged_load(tagged + NE); while (!tag_is(w, epoch));
                logits[NE] = __uint_as_float((u32)w);
            }
            __threadfence();
        }
    }
    if constexpr (OWN) stage_x_values<BITS>(cols, 1, hidden, norm_w, &inv, xs, xsum, 0, 0);
    __syncthreads();
    STAMP_AT(3)
    gate_up_staged<BITS>(gate, up, shared_gate, shared_up, MOE_INTER, sid, act, [] {}, xs, xsum, blockIdx.x,
                         gridDim.x);
    STAMP_END(4)
}

// The down projection of the step's row blockIdx.y, R output rows a warp. Past down_combine's
// pdl_wait, moe_route_gate_up has finished, so the row's epoch moves on for the next launch
// (tagged_store).
template <int BITS, int R>
__device__ void down_row(Mat down, Mat sh_down, const int* ids, const float* weights, const float* logits,
                         const float* act, float* residual, u32* epoch) {
    __shared__ DownSmem<BITS> s;
    down_combine<BITS, R>(fixed_shape(down, NE * HIDDEN, MOE_INTER), fixed_shape(sh_down, HIDDEN, SHARED_INTER),
                          MOE_INTER, HIDDEN, ids + blockIdx.y * TOPK, weights + blockIdx.y * TOPK,
                          logits + blockIdx.y * (NE + 1), act + (long)blockIdx.y * MOE_ACT,
                          residual + (long)blockIdx.y * HIDDEN, s, blockIdx.x, gridDim.x);
    if (blockIdx.x == 0 && threadIdx.x == 0) epoch[blockIdx.y] += 1;
    STAMP_END(2)
}

// Each launch runs every row of the step: the grid's y is the row, whose hidden state, router
// logits (NE + 1 a row: the shared gate's last; as f32 only the shared gate's, for moe_down; all
// of them tagged, NE + 1 words of 8 bytes), choice (TOPK ids and weights), epoch (a word) and act
// (MOE_ACT) lie at its row of the step's buffers. The router's bits (RBITS) and the experts' may
// differ.
//
// moe_route_gate_up's block: one an SM (step.rs, ROUTE_WARPS). As three blocks of 8 warps, an SM
// staged x three times, and every step of the route's chain (the barrier's arrivals and polls, each
// block's read of the logits for its top-k) went three times over to the same L2 lines.
#define ROUTE_THREADS (24 * WARP)
#define MOE_ROUTE_GATE_UP(BITS, RBITS)                                                            \
    extern "C" __global__ void __launch_bounds__(ROUTE_THREADS, 1) moe_route_gate_up_b##BITS##_r##RBITS( \
        Mat router, Mat shared_logit, Mat gate, Mat up, Mat shared_gate, Mat shared_up,           \
        const float* hidden, const float* norm_w, float eps, float* logits, u64* tagged, int* ids, \
        float* weights, const u32* epoch, float* act) {                                           \
        route_gate_up<BITS, RBITS>(router, shared_logit, gate, up, shared_gate, shared_up,        \
                                   hidden + (long)blockIdx.y * HIDDEN, norm_w, eps,               \
                                   logits + blockIdx.y * (NE + 1), tagged + blockIdx.y * (NE + 1), \
                                   ids + blockIdx.y * TOPK, weights + blockIdx.y * TOPK,          \
                                   epoch + blockIdx.y, act + (long)blockIdx.y * MOE_ACT);         \
    }
#define MOE(BITS)                                                                                 \
    MOE_ROUTE_GATE_UP(BITS, 4)                                                                    \
    MOE_ROUTE_GATE_UP(BITS, 8)                                                                    \
    MOE_ROUTE_GATE_UP(BITS, 32)                                                                   \
    extern "C" __global__ void __launch_bounds__(256) moe_down_b##BITS(                           \
        Mat down, Mat sh_down, const int* ids, const float* weights, const float* logits,         \
        const float* act, float* residual, u32* epoch) {                                          \
        down_row<BITS, DOWN_ROWS>(down, sh_down, ids, weights, logits, act, residual, epoch);     \
    }
// One sequence's down projection, a row a warp (moe_decode.cuh, DOWN_ROWS).
#define MOE_DOWN_ONE(BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) moe_down_b##BITS##_r1(                      \
        Mat down, Mat sh_down, const int* ids, const float* weights, const float* logits,         \
        const float* act, float* residual, u32* epoch) {                                          \
        down_row<BITS, 1>(down, sh_down, ids, weights, logits, act, residual, epoch);             \
    }
MOE(4)
MOE(8)
MOE(32)
MOE_DOWN_ONE(4)
MOE_DOWN_ONE(8)
