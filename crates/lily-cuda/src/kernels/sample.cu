// Greedy token choice on the device, in two stages over the vocabulary: per-block maxima, then
// one block picks the winner (lowest id on ties), writes it into the next step's input slot and
// advances the position. The host reads the token whenever it needs it.
#define ARGMAX_BLOCKS 128

extern "C" __global__ void argmax_partial(const float* logits, int n, float* part_v, int* part_i) {
    pdl_wait();
    __shared__ float sv[32];
    __shared__ int si[32];
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
        part_v[blockIdx.x] = v; part_i[blockIdx.x] = i;
    }
}

extern "C" __global__ void argmax_final(const float* part_v, const int* part_i, u32* token, int* pos) {
    pdl_wait();
    if (threadIdx.x != 0) return;
    float v = part_v[0]; int i = part_i[0];
    for (int b = 1; b < ARGMAX_BLOCKS; b++)
        if (part_v[b] > v || (part_v[b] == v && part_i[b] < i)) { v = part_v[b]; i = part_i[b]; }
    token[0] = (u32)i;
    pos[0] += 1;
}

// Advances the position without choosing a token (prefill steps and host-sampled steps).
extern "C" __global__ void advance(int* pos) {
    pdl_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) pos[0] += 1;
}
