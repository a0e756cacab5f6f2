// Greedy token choice on the device, in two stages over the vocabulary: per-block maxima, then
// one block picks the winner (lowest id on ties), writes it into the next step's input slot and
// advances the position. The host reads the token whenever it needs it.
#define ARGMAX_BLOCKS 128

// Row blockIdx.y's logits (a row every `stride` floats), its choice among the first n[row], into
// that row's ARGMAX_BLOCKS partials.
extern "C" __global__ void argmax_partial(const float* logits, int stride, RowInts choices, float* part_v,
                                          int* part_i) {
    pdl_wait();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int row = blockIdx.y, n = choices.n[row];
    logits += (long)row * stride;
    float v = -INFINITY; int i = n;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x)
        if (logits[e] > v) { v = logits[e]; i = e; }
    for (int o = WARP / 2; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / WARP; w++)
            if (sv[w] > v || (sv[w] == v && si[w] < i)) { v = sv[w]; i = si[w]; }
        part_v[row * ARGMAX_BLOCKS + blockIdx.x] = v; part_i[row * ARGMAX_BLOCKS + blockIdx.x] = i;
    }
}

// Block r picks row r's token: into the row's slot and chosen[r] (all of a step's tokens in one
// place for the host), and advances the row's position. NaN logits leave no candidate: token 0,
// so that the next step still embeds a valid row.
extern "C" __global__ void argmax_final(const float* part_v, const int* part_i, RowInts choices, RowPtrs token,
                                        RowPtrs pos, u32* chosen) {
    pdl_wait();
    if (threadIdx.x != 0) return;
    const int row = blockIdx.x;
    part_v += row * ARGMAX_BLOCKS;
    part_i += row * ARGMAX_BLOCKS;
    float v = part_v[0]; int i = part_i[0];
    for (int b = 1; b < ARGMAX_BLOCKS; b++)
        if (part_v[b] > v || (part_v[b] == v && part_i[b] < i)) { v = part_v[b]; i = part_i[b]; }
    if (i >= choices.n[row]) i = 0;
    *(u32*)token.p[row] = (u32)i;
    chosen[row] = (u32)i;
    *(int*)pos.p[row] += 1;
}
