// The router's choice, shared by moe.cu, moe_prefill.cu and decode.cu.
//
// Routes one token with one warp, the same code in prefill and decode (so a token picks the same
// experts in both): softmax with probabilities in registers, TOPK rounds of warp argmax (lowest
// id wins ties, as the CPU reference), then renormalise. Lane 0 writes the TOPK ids and weights
// (global or shared memory). The logits (another kernel's or another SM's) are read through L2.
#define ROUTE_PER_LANE ((NE + WARP - 1) / WARP)
__device__ void route_topk(const float* logits, int lane, int* ids, float* weights) {
    float p[ROUTE_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) {
        int e = lane + i * WARP;
        p[i] = e < NE ? ldcg(logits + e) : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) {
        int e = lane + i * WARP;
        p[i] = e < NE ? __expf(p[i] - mx) : -1.f;
        sum += e < NE ? p[i] : 0.f;
    }
    sum = warp_sum(sum);
    // Unrolled so that chosen[] and chosen_id[] stay in registers.
    float chosen[TOPK];
    int chosen_id[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; k++) {
        float v = -1.f; int id = NE;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; i++)
            if (p[i] > v) { v = p[i]; id = lane + i * WARP; }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, id, o);
            if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
        }
        // Only NaN probabilities (a diverged model) leave no candidate; an id of NE would send
        // moe_sort's shared-memory counters and the decode expert reads out of bounds, so take a valid one and let the NaN
        // weights carry the failure to the output.
        if (id >= NE) id = k;
        chosen[k] = v / sum;
        chosen_id[k] = id;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; i++)
            if (lane + i * WARP == id) p[i] = -2.f;
    }
    if (lane == 0) {
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < TOPK; k++) total += chosen[k];
#pragma unroll
        for (int k = 0; k < TOPK; k++) {
            ids[k] = chosen_id[k];
            weights[k] = NORM_TOPK ? chosen[k] / total : chosen[k];
        }
    }
}
