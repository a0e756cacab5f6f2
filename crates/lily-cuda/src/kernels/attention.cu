// Gated attention for one decode token. Constants: NH query heads, NKV KV heads, HD head dim,
// ROT rotary dims, ROPE_THETA. The position comes from device memory, so a
// captured graph replays unchanged from step to step.

#define GROUP (NH / NKV)

#define EPL ((HD + WARP - 1) / WARP)   // head elements per lane

// Per head: RMSNorm (q_norm / k_norm), rotate-half RoPE on the first ROT dims; queries go to
// `q_out`, keys and values into the bf16 cache at the current position. Blocks 0..NH-1 are
// query heads, NH..NH+NKV-1 KV heads. qkv = [q|gate per head (NH·2·HD) | k (NKV·HD) | v].
extern "C" __global__ void attn_prep(const float* qkv, const float* q_norm, const float* k_norm,
                                     const int* pos_ptr, float* q_out, kv_t* k_cache, kv_t* v_cache,
                                     float eps) {
    __shared__ float scratch[32];
    __shared__ float normed[HD];
    int d = threadIdx.x;
    int head = blockIdx.x;
    bool is_q = head < NH;
    int kv = head - NH;
    const float* src = is_q ? qkv + head * 2 * HD : qkv + NH * 2 * HD + kv * HD;
    const float* scale = is_q ? q_norm : k_norm;
    float x = d < HD ? src[d] : 0.f;
    float inv = rsqrtf(block_sum(x * x, scratch) / HD + eps);
    if (d < HD) normed[d] = x * inv * scale[d];
    __syncthreads();
    if (d >= HD) return;
    int pos = pos_ptr[0];
    float y = normed[d];
    const int half = ROT / 2;
    if (d < ROT) {
        int i = d < half ? d : d - half;
        float inv_freq = 1.f / powf((float)ROPE_THETA, (float)(2 * i) / (float)ROT);
        float s, c;
        sincosf((float)pos * inv_freq, &s, &c);
        y = d < half ? normed[d] * c - normed[d + half] * s : normed[d] * c + normed[d - half] * s;
    }
    if (is_q) {
        q_out[head * HD + d] = y;
    } else {
        long at = ((long)pos * NKV + kv) * HD + d;
        k_cache[at] = kv_store(y);
        v_cache[at] = kv_store(qkv[NH * 2 * HD + NKV * HD + kv * HD + d]);
    }
}

// One block per (KV head, split of the context); the split count is the grid's y size, chosen
// per sequence from its longest context, so long contexts get enough blocks to fill the GPU: every query head of the group is scored
// against each key as it is loaded (GQA packing: one K/V read serves GROUP heads). Each warp
// walks its share of positions with an online softmax; the warps then merge. Writes per
// (kv, split, head-in-group) the running max, the sum of exponentials and the unnormalised
// output.
extern "C" __global__ void attn_split(const float* q, const kv_t* k_cache, const kv_t* v_cache,
                                      const int* pos_ptr, float* part_ml, float* part_acc) {
    __shared__ float qs[GROUP][HD];
    __shared__ float wm[4][GROUP], wl[4][GROUP];
    __shared__ float wacc[4][GROUP][HD];
    int kv = blockIdx.x, split = blockIdx.y;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (int i = threadIdx.x; i < GROUP * HD; i += blockDim.x) qs[i / HD][i % HD] = q[(kv * GROUP) * HD + i];
    __syncthreads();
    long len = pos_ptr[0] + 1;
    int nsplit = gridDim.y;
    int start = (int)(split * len / nsplit), end = (int)((split + 1) * len / nsplit);
    const float scale = rsqrtf((float)HD);
    float m[GROUP], l[GROUP], acc[GROUP][EPL];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        m[g] = -INFINITY; l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; e++) acc[g][e] = 0.f;
    }
    for (int p = start + warp; p < end; p += 4) {
        const kv_t* kr = k_cache + ((long)p * NKV + kv) * HD;
        const kv_t* vr = v_cache + ((long)p * NKV + kv) * HD;
        float kf[EPL], vf[EPL];
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            int d = lane + e * WARP;
            kf[e] = d < HD ? kv_load(kr[d]) : 0.f;
            vf[e] = d < HD ? kv_load(vr[d]) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < EPL; e++) {
                int d = lane + e * WARP;
                if (d < HD) s += qs[g][d] * kf[e];
            }
            s = warp_sum(s) * scale;
            float nm = fmaxf(m[g], s);
            float corr = __expf(m[g] - nm), p_ = __expf(s - nm);
            l[g] = l[g] * corr + p_;
#pragma unroll
            for (int e = 0; e < EPL; e++) acc[g][e] = acc[g][e] * corr + p_ * vf[e];
            m[g] = nm;
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        if (lane == 0) { wm[warp][g] = m[g]; wl[warp][g] = l[g]; }
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            int d = lane + e * WARP;
            if (d < HD) wacc[warp][g][d] = acc[g][e];
        }
    }
    __syncthreads();
    long part = (long)kv * nsplit + split;
    for (int i = threadIdx.x; i < GROUP * HD; i += blockDim.x) {
        int g = i / HD, d = i % HD;
        float mx = fmaxf(fmaxf(wm[0][g], wm[1][g]), fmaxf(wm[2][g], wm[3][g]));
        float a = 0.f, sum = 0.f;
        if (mx != -INFINITY) {
            for (int w = 0; w < 4; w++) {
                float f = __expf(wm[w][g] - mx);
                a += f * wacc[w][g][d];
                sum += f * wl[w][g];
            }
        }
        part_acc[(part * GROUP + g) * HD + d] = a;
        if (d == 0) { part_ml[(part * GROUP + g) * 2] = mx; part_ml[(part * GROUP + g) * 2 + 1] = sum; }
    }
}

// Merges the splits of each query head and applies the sigmoid output gate.
extern "C" __global__ void attn_combine(const float* part_ml, const float* part_acc, int nsplit,
                                        const float* qkv, float* out) {
    int h = blockIdx.x, d = threadIdx.x;
    if (d >= HD) return;
    int kv = h / GROUP, g = h % GROUP;
    float mx = -INFINITY;
    for (int s = 0; s < nsplit; s++) mx = fmaxf(mx, part_ml[(((long)kv * nsplit + s) * GROUP + g) * 2]);
    float a = 0.f, sum = 0.f;
    for (int s = 0; s < nsplit; s++) {
        long part = ((long)kv * nsplit + s) * GROUP + g;
        float ms = part_ml[part * 2];
        if (ms == -INFINITY) continue;
        float f = __expf(ms - mx);
        a += f * part_acc[part * HD + d];
        sum += f * part_ml[part * 2 + 1];
    }
    float gate = qkv[h * 2 * HD + HD + d];
    out[h * HD + d] = a / sum * sigmoidf(gate);
}
