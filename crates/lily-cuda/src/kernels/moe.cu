// Mixture of experts for one decode token. Constants: NE experts, TOPK chosen per token, NORM_TOPK
// (renormalise the chosen weights). Routing stays on the device: the router logits, the chosen
// ids and their weights never visit the host.

// logits = [router (NE) | shared-expert gate (1)]. Softmax, then TOPK rounds of block argmax
// (lowest id wins ties, as the CPU reference does), then renormalise.
extern "C" __global__ void moe_topk(const float* logits, int* ids, float* weights) {
    __shared__ float p[NE];
    __shared__ float scratch[32];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ float chosen[TOPK];
    float mx = -INFINITY;
    for (int e = threadIdx.x; e < NE; e += blockDim.x) mx = fmaxf(mx, logits[e]);
    mx = block_max(mx, scratch);
    float sum = 0.f;
    for (int e = threadIdx.x; e < NE; e += blockDim.x) { float v = __expf(logits[e] - mx); p[e] = v; sum += v; }
    sum = block_sum(sum, scratch);
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    for (int k = 0; k < TOPK; k++) {
        float v = -1.f; int i = NE;
        for (int e = threadIdx.x; e < NE; e += blockDim.x)
            if (p[e] > v || (p[e] == v && e < i)) { v = p[e]; i = e; }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
        }
        if (lane == 0) { best_v[warp] = v; best_i[warp] = i; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bv = best_v[0]; int bi = best_i[0];
            for (int w = 1; w < warps; w++)
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) { bv = best_v[w]; bi = best_i[w]; }
            ids[k] = bi;
            chosen[k] = bv / sum;
            p[bi] = -2.f;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int k = 0; k < TOPK; k++) total += chosen[k];
        for (int k = 0; k < TOPK; k++) weights[k] = NORM_TOPK ? chosen[k] / total : chosen[k];
    }
}

// act = silu(gate · x) ⊙ (up · x) for the chosen experts' rows (slot-major, TOPK × inter) and
// then the shared expert's rows. One warp per row computes both the gate and the up dot.
template <int BITS>
__device__ void gate_up(Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids,
                        const float* __restrict__ x, float* act) {
    int lane = threadIdx.x % WARP;
    long r = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    float g, u;
    if (r < (long)TOPK * inter) {
        long row = (long)ids[r / inter] * inter + r % inter;
        g = warp_sum(row_dot_lane<BITS>(gate, row, x, lane));
        u = warp_sum(row_dot_lane<BITS>(up, row, x, lane));
    } else if (r < (long)TOPK * inter + sh_gate.rows) {
        long row = r - (long)TOPK * inter;
        g = warp_sum(row_dot_lane<BITS>(sh_gate, row, x, lane));
        u = warp_sum(row_dot_lane<BITS>(sh_up, row, x, lane));
    } else {
        return;
    }
    if (lane == 0) act[r] = siluf(g) * u;
}

// out[h] = Σ_k w_k · down_{id_k}[h] · act_k + σ(shared gate logit) · shared_down[h] · act_shared.
// The weighted combine and the gated shared expert ride in the down projection.
template <int BITS>
__device__ void down_combine(Mat down, Mat sh_down, int inter, int hidden, const int* ids,
                             const float* weights, const float* logits, const float* act, float* out) {
    int lane = threadIdx.x % WARP;
    long h = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (h >= hidden) return;
    float acc = 0.f;
    for (int k = 0; k < TOPK; k++) {
        float d = warp_sum(row_dot_lane<BITS>(down, (long)ids[k] * hidden + h, act + (long)k * inter, lane));
        acc += weights[k] * d;
    }
    float shared = warp_sum(row_dot_lane<BITS>(sh_down, h, act + (long)TOPK * inter, lane));
    if (lane == 0) out[h] = acc + sigmoidf(logits[NE]) * shared;
}

#define MOE(BITS)                                                                                 \
    extern "C" __global__ void moe_gate_up_b##BITS(Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, \
                                                   const int* ids, const float* x, float* act) {  \
        gate_up<BITS>(gate, up, sh_gate, sh_up, inter, ids, x, act);                              \
    }                                                                                             \
    extern "C" __global__ void moe_down_b##BITS(Mat down, Mat sh_down, int inter, int hidden,     \
                                                const int* ids, const float* weights,             \
                                                const float* logits, const float* act, float* out) { \
        down_combine<BITS>(down, sh_down, inter, hidden, ids, weights, logits, act, out);         \
    }
MOE(4)
MOE(8)
MOE(32)
