// Mixture of experts for one decode token. Constants: NE experts, TOPK chosen per token, NORM_TOPK
// (renormalise the chosen weights). Routing stays on the device: the router logits, the chosen
// ids and their weights never visit the host. Three launches: router + top-k, gate/up, down (which
// adds into the residual stream). The first two normalise the residual stream themselves.

// A global load that skips L1: the last router block reads logits other blocks wrote in this
// launch, which its SM's L1 may hold stale from an earlier layer.
__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// logits = [router (NE) | shared-expert gate (1)]. One warp: softmax, then TOPK rounds of warp
// argmax over the probabilities held in registers (lowest id wins ties, as the CPU reference
// does), then renormalise. No block barriers.
#define PER_LANE ((NE + WARP - 1) / WARP)
__device__ void route_topk(const float* logits, int* ids, float* weights, int lane) {
    float p[PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        int e = lane + i * WARP;
        p[i] = e < NE ? load_cg(logits + e) : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        int e = lane + i * WARP;
        p[i] = e < NE ? __expf(p[i] - mx) : -1.f;
        sum += e < NE ? p[i] : 0.f;
    }
    sum = warp_sum(sum);
    float chosen[TOPK];
    int chosen_id[TOPK];
    for (int k = 0; k < TOPK; k++) {
        float v = -1.f; int id = NE;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++)
            if (p[i] > v) { v = p[i]; id = lane + i * WARP; }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, id, o);
            if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
        }
        chosen[k] = v / sum;
        chosen_id[k] = id;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++)
            if (lane + i * WARP == id) p[i] = -2.f;
    }
    if (lane == 0) {
        float total = 0.f;
        for (int k = 0; k < TOPK; k++) total += chosen[k];
        for (int k = 0; k < TOPK; k++) {
            ids[k] = chosen_id[k];
            weights[k] = NORM_TOPK ? chosen[k] / total : chosen[k];
        }
    }
}

// The router and shared-gate GEMV over RMSNorm(hidden) · norm_w, then top-k in the last block to
// finish: each block publishes its logits (fence) and counts itself in `done`; the block that
// counts last sees every logit and routes. It also resets `done`, so the next launch (next layer,
// next graph replay) starts from zero.
template <int BITS>
__device__ void route(Mat router, Mat sh_gate, const float* hidden, const float* norm_w, float eps,
                      float* logits, int* ids, float* weights, u32* done) {
    __shared__ bool last;
    gemv_staged<BITS>(router, sh_gate, Mat{}, Mat{}, hidden, norm_w, eps, logits, false);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < WARP) route_topk(logits, ids, weights, threadIdx.x);
    if (threadIdx.x == 0) *done = 0;
}

// Row pairs (gate, up) one warp computes: four rows share each staged x chunk.
#define PAIRS 2

// act = silu(gate · x) ⊙ (up · x) for the chosen experts' rows (slot-major, TOPK × inter) and
// then the shared expert's rows, x = RMSNorm(hidden) · norm_w.
template <int BITS>
__device__ void gate_up(Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids,
                        const float* hidden, const float* norm_w, float eps, float* act) {
    __shared__ __align__(16) float xs[XS_FLOATS(BITS)];
    __shared__ float xsum[XSUM_FLOATS(BITS)];
    __shared__ float scratch[32];
    long pairs = (long)TOPK * inter + sh_gate.rows;
    long units = (pairs + PAIRS - 1) / PAIRS;
    auto rows_of = [&](long u, RowRef (&rows)[2 * PAIRS], int (&xoff)[2 * PAIRS]) {
#pragma unroll
        for (int i = 0; i < PAIRS; i++) {
            long p = min(u * PAIRS + i, pairs - 1);
            if (p < (long)TOPK * inter) {
                long row = (long)ids[p / inter] * inter + p % inter;
                rows[2 * i] = row_ref(gate, row, BITS);
                rows[2 * i + 1] = row_ref(up, row, BITS);
            } else {
                long row = p - (long)TOPK * inter;
                rows[2 * i] = row_ref(sh_gate, row, BITS);
                rows[2 * i + 1] = row_ref(sh_up, row, BITS);
            }
            xoff[2 * i] = xoff[2 * i + 1] = 0;
        }
    };
    auto stage = [&]() {
        float inv = block_inv_rms(hidden, gate.cols, eps, scratch);
        stage_x<BITS>(gate.cols, hidden, norm_w, inv, xs, xsum);
    };
    auto store = [&](long u, float (&acc)[2 * PAIRS]) {
#pragma unroll
        for (int i = 0; i < PAIRS; i++) {
            float g = warp_sum(acc[2 * i]), v = warp_sum(acc[2 * i + 1]);
            if (threadIdx.x % WARP == 0 && u * PAIRS + i < pairs) act[u * PAIRS + i] = siluf(g) * v;
        }
    };
    staged_units<BITS, 2 * PAIRS, GEMV_BATCH, true, false>(units, gate.cols, gate.group, rows_of, stage, store, xs, xsum);
}

// residual[h] += Σ_k w_k · down_{id_k}[h] · act_k + σ(shared gate logit) · shared_down[h] · act_shared.
// The weighted combine, the gated shared expert and the residual add ride in the down projection.
// act (TOPK·inter + shared inter floats) is staged once per block; one warp per output row, its
// TOPK routed rows and the shared row loaded together.
template <int BITS>
__device__ void down_combine(Mat down, Mat sh_down, int inter, int hidden, const int* ids,
                             const float* weights, const float* logits, const float* act, float* residual) {
    __shared__ __align__(16) float xs[XS_FLOATS(BITS)];
    __shared__ float xsum[XSUM_FLOATS(BITS)];
    constexpr int PER = CHUNK_CODES(BITS);
    pdl_wait();
    stage_x<BITS>(TOPK * inter + sh_down.cols, act, nullptr, 1.f, xs, xsum);
    int lane = threadIdx.x % WARP;
    long stride = (long)gridDim.x * (blockDim.x / WARP);
    float shared_gate = sigmoidf(logits[NE]);
    for (long h = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP; h < hidden; h += stride) {
        RowRef rows[TOPK], srow[1] = {row_ref(sh_down, h, BITS)};
        int xoff[TOPK], soff[1] = {TOPK * inter / PER};
#pragma unroll
        for (int k = 0; k < TOPK; k++) {
            rows[k] = row_ref(down, (long)ids[k] * hidden + h, BITS);
            xoff[k] = k * inter / PER;
        }
        float acc[TOPK] = {}, sacc[1] = {};
        if constexpr (BITS == 32) {
            for (int c = lane; c < max(inter, sh_down.cols); c += WARP) {
#pragma unroll
                for (int k = 0; k < TOPK; k++)
                    if (c < inter) acc[k] += ((const float*)rows[k].w)[c] * xs[xoff[k] + c];
                if (c < sh_down.cols) sacc[0] += ((const float*)srow[0].w)[c] * xs[soff[0] + c];
            }
        } else {
            int rch = inter / PER, sch = sh_down.cols / PER;
            for (int base = 0; base < max(rch, sch); base += WARP) {
                Batch<BITS, TOPK, 1> br;
                Batch<BITS, 1, 1> bs;
                load_batch<BITS, TOPK, 1>(br, rows, base, rch, down.group, lane);
                load_batch<BITS, 1, 1>(bs, srow, base, sch, sh_down.group, lane);
                dot_batch<BITS, TOPK, 1, false>(br, base, rch, xoff, xs, xsum, lane, acc);
                dot_batch<BITS, 1, 1, false>(bs, base, sch, soff, xs, xsum, lane, sacc);
            }
        }
        // Lanes sum the weighted slots first and reduce once: fewer shuffles per row.
        float total = shared_gate * sacc[0];
#pragma unroll
        for (int k = 0; k < TOPK; k++) total += weights[k] * acc[k];
        total = warp_sum(total);
        if (lane == 0) residual[h] += total;
    }
}

#define MOE(BITS)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) moe_route_b##BITS(                          \
        Mat router, Mat sh_gate, const float* hidden, const float* norm_w, float eps, float* logits, \
        int* ids, float* weights, u32* done) {                                                    \
        route<BITS>(router, sh_gate, hidden, norm_w, eps, logits, ids, weights, done);            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_b##BITS(                        \
        Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids, const float* hidden, \
        const float* norm_w, float eps, float* act) {                                             \
        gate_up<BITS>(gate, up, sh_gate, sh_up, inter, ids, hidden, norm_w, eps, act);            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) moe_down_b##BITS(                           \
        Mat down, Mat sh_down, int inter, int hidden, const int* ids, const float* weights,       \
        const float* logits, const float* act, float* residual) {                                 \
        down_combine<BITS>(down, sh_down, inter, hidden, ids, weights, logits, act, residual);    \
    }
MOE(4)
MOE(8)
MOE(32)
