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
    // A probability as a key: its bits + 1 (the order of non-negative floats), 0 for a taken or
    // absent expert. Each round is then two single-instruction warp reductions (the largest key,
    // then the lowest id holding it) instead of five rounds of two shuffles and compares.
    u32 key[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) key[i] = lane + i * WARP < NE ? __float_as_uint(p[i]) + 1u : 0u;
    // Round k's choice stays on lane k (TOPK ≤ WARP). The rounds are a loop, not unrolled: each
    // launch runs this code once per block, cold in the instruction cache, so its length is paid
    // in instruction fetches (eight unrolled rounds were ~570 instructions, 9 KB of SASS).
    float mine = 0.f;
    int mine_id = 0;
#pragma unroll 1
    for (int k = 0; k < TOPK; k++) {
        u32 v = 0u, id = NE;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; i++)
            if (key[i] > v) { v = key[i]; id = lane + i * WARP; }
        const u32 best = __reduce_max_sync(0xffffffffu, v);
        u32 at = __reduce_min_sync(0xffffffffu, v == best ? id : (u32)NE);
        // Only a warp with no keys left (fewer experts than TOPK) finds none; an id of NE would
        // send the sort's shared-memory counters and the decode expert reads out of bounds, so
        // take a valid one. NaN probabilities (a diverged model) are chosen like any other and
        // carry the failure to the output through their weights.
        if (best == 0u) at = k;
        if (lane == k) {
            mine = best == 0u ? 0.f : __uint_as_float(best - 1u) / sum;
            mine_id = (int)at;
        }
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; i++)
            if (lane + i * WARP == (int)at) key[i] = 0u;
    }
    // The total in round order, as the CPU reference adds it.
    float total = 0.f;
#pragma unroll 1
    for (int k = 0; k < TOPK; k++) total += __shfl_sync(0xffffffffu, mine, k);
    if (lane < TOPK) {
        ids[lane] = mine_id;
        weights[lane] = NORM_TOPK ? mine / total : mine;
    }
}
