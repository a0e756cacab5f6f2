// Mixture of experts for one decode token. Constants: NE experts, TOPK chosen per token, NORM_TOPK
// (renormalise the chosen weights). Routing stays on the device: the router logits, the chosen
// ids and their weights never visit the host.

// logits = [router (NE) | shared-expert gate (1)]. One warp: softmax, then TOPK rounds of warp
// argmax over the probabilities held in registers (lowest id wins ties, as the CPU reference
// does), then renormalise. No block barriers: this sits on every layer's critical path.
#define PER_LANE ((NE + WARP - 1) / WARP)
extern "C" __global__ void moe_topk(const float* logits, int* ids, float* weights) {
    int lane = threadIdx.x;
    float p[PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        int e = lane + i * WARP;
        p[i] = e < NE ? logits[e] : -INFINITY;
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

// act = silu(gate · x) ⊙ (up · x) for the chosen experts' rows (slot-major, TOPK × inter) and
// then the shared expert's rows. One warp per row computes both the gate and the up dot.
template <int BITS>
__device__ void gate_up(Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids,
                        const float* __restrict__ x, float* act) {
    int lane = threadIdx.x % WARP;
    long r = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    RowRef rows[2];
    if (r < (long)TOPK * inter) {
        long row = (long)ids[r / inter] * inter + r % inter;
        rows[0] = row_ref(gate, row, BITS);
        rows[1] = row_ref(up, row, BITS);
    } else if (r < (long)TOPK * inter + sh_gate.rows) {
        long row = r - (long)TOPK * inter;
        rows[0] = row_ref(sh_gate, row, BITS);
        rows[1] = row_ref(sh_up, row, BITS);
    } else {
        return;
    }
    float acc[2] = {};
    rows_dot_lane<BITS, 2>(rows, 2, gate.cols, gate.group, x, lane, acc);
    float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
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
    // Lanes sum the weighted slots first and reduce once: fewer shuffles per row.
    float acc = 0.f;
    for (int k = 0; k < TOPK; k++) {
        RowRef row[1] = {row_ref(down, (long)ids[k] * hidden + h, BITS)};
        float part[1] = {0.f};
        rows_dot_lane<BITS, 1>(row, 1, down.cols, down.group, act + (long)k * inter, lane, part);
        acc += weights[k] * part[0];
    }
    RowRef row[1] = {row_ref(sh_down, h, BITS)};
    float part[1] = {0.f};
    rows_dot_lane<BITS, 1>(row, 1, sh_down.cols, sh_down.group, act + (long)TOPK * inter, lane, part);
    acc = warp_sum(acc + sigmoidf(logits[NE]) * part[0]);
    if (lane == 0) out[h] = acc;
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
