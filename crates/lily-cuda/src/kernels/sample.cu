// Greedy token choice on the device, in two stages over the vocabulary: per-block maxima, then
// one block picks the winner (lowest id on ties), writes it into the next step's input slot and
// advances the position. The host reads the token whenever it needs it.
#define ARGMAX_BLOCKS 128
static_assert(ARGMAX_BLOCKS % WARP == 0, "argmax_final: whole partials a lane");

// Whether (v1, i1) comes before (v2, i2): the larger value, the lower id on ties. The partials
// hold no NaN (a NaN logit never beats -inf above), so this is a total order and any order of
// comparisons finds the same winner.
__device__ __forceinline__ bool argmax_before(float v1, int i1, float v2, int i2) {
    return (v1 > v2) | ((v1 == v2) & (i1 < i2));
}

// Row blockIdx.y's logits (a row every `stride` floats), its choice among the first n[row], into
// that row's ARGMAX_BLOCKS partials.
extern "C" __global__ void argmax_partial(const float* logits, int stride, RowInts choices, float* part_v,
                                          int* part_i) {
    pdl_wait();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int row = blockIdx.y, n = choices.at(row);
    logits += (long)row * stride;
    float v = -INFINITY; int i = n;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x)
        if (logits[e] > v) { v = logits[e]; i = e; }
    for (int o = WARP / 2; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / WARP; w++)
            if (argmax_before(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
        part_v[row * ARGMAX_BLOCKS + blockIdx.x] = v; part_i[row * ARGMAX_BLOCKS + blockIdx.x] = i;
    }
}

// Block r (one warp) picks row r's token: into the row's slot and chosen[r] (all of a step's
// tokens in one place for the host), and advances the row's position. NaN logits leave no
// candidate: token 0, so that the next step still embeds a valid row. Each lane takes every
// WARP-th partial, all its loads issued together, then the warp reduces: thread 0 alone walking
// the 128 partials was a chain of L2 round trips, 11 µs of the step (stamps, 2026-12-06).
extern "C" __global__ void argmax_final(const float* part_v, const int* part_i, RowInts choices, RowPtrs token,
                                        RowPtrs pos, u32* chosen) {
    pdl_wait();
    const int row = blockIdx.x, lane = threadIdx.x;
    part_v += row * ARGMAX_BLOCKS;
    part_i += row * ARGMAX_BLOCKS;
    constexpr int PER = ARGMAX_BLOCKS / WARP;
    float pv[PER];
    int pi[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) {
        pv[k] = part_v[lane + k * WARP];
        pi[k] = part_i[lane + k * WARP];
    }
    float v = pv[0];
    int i = pi[0];
#pragma unroll
    for (int k = 1; k < PER; k++)
        if (argmax_before(pv[k], pi[k], v, i)) { v = pv[k]; i = pi[k]; }
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    if (lane != 0) return;
    if (i >= choices.at(row)) i = 0;
    *(u32*)token.at(row) = (u32)i;
    chosen[row] = (u32)i;
    *(int*)pos.at(row) += 1;
}
