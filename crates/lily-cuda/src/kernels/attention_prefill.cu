// Gated attention for a prefill chunk of T tokens at positions pos0 .. pos0+T-1; earlier chunks'
// keys and values are already in the cache. Constants as attention.cu: NH query heads, NKV KV
// heads, HD head dim (a multiple of 16, at most 256), ROT rotary dims, ROPE_THETA.

#define GROUP (NH / NKV)

// Per (head, token): RMSNorm (q_norm / k_norm) and rotate-half RoPE on the first ROT dims at
// position pos0 + token, as attn_prep does for one token. Blocks x 0..NH-1 are query heads,
// NH..NH+NKV-1 KV heads; block y is the token. qkv rows (stride ld) are
// [q|gate per head (NH·2·HD) | k (NKV·HD) | v (NKV·HD)]; queries go to q_out [T, NH·HD].
extern "C" __global__ void attn_prep_rows(const float* qkv, int ld, const float* q_norm,
                                          const float* k_norm, int pos0, float* q_out,
                                          kv_t* k_cache, kv_t* v_cache, float eps) {
    __shared__ float scratch[32];
    __shared__ float normed[HD];
    int d = threadIdx.x;
    int head = blockIdx.x, row = blockIdx.y;
    bool is_q = head < NH;
    int kv = head - NH;
    const float* in = qkv + (long)row * ld;
    const float* src = is_q ? in + head * 2 * HD : in + NH * 2 * HD + kv * HD;
    const float* scale = is_q ? q_norm : k_norm;
    float x = d < HD ? src[d] : 0.f;
    float inv = rsqrtf(block_sum(x * x, scratch) / HD + eps);
    if (d < HD) normed[d] = x * inv * scale[d];
    __syncthreads();
    if (d >= HD) return;
    int pos = pos0 + row;
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
        q_out[((long)row * NH + head) * HD + d] = y;
    } else {
        long at = ((long)pos * NKV + kv) * HD + d;
        k_cache[at] = kv_store(y);
        v_cache[at] = kv_store(in[NH * 2 * HD + NKV * HD + kv * HD + d]);
    }
}

// Flash attention on CUDA cores. A block takes one KV head and a tile of PF_Q query vectors of
// its group, numbered token-major (j = token·GROUP + head-in-group), so every K/V tile read
// from the cache serves PF_Q queries whatever GROUP is. Four warps own four queries each.
// Shared memory holds the tile's queries and one K-or-V tile of PF_K positions (keys, then
// values in the same buffer: 48 KiB does not fit the queries and both at HD 256 in f32).
#define PF_Q 16
#define PF_K 16
#define PF_THREADS 128
// Row pitch of the K/V tile: 4 floats of padding put the 16-byte reads of the score loop,
// one row per lane, in distinct banks.
#define PF_PITCH (HD + 4)
#define PF_CHUNKS (HD / 4)                              // float4s in a head
#define PF_CPL ((PF_CHUNKS + WARP - 1) / WARP)          // float4s per lane in the P·V loop

// Causal attention: query row i (position pos0 + i) sees cache positions 0..=pos0+i; softmax
// scale 1/sqrt(HD); the output is multiplied by sigmoid(gate) from qkv. q: [T, NH·HD] from
// attn_prep_rows; out: [T, NH·HD]. Grid (NKV, ceil(T·GROUP / PF_Q)), PF_THREADS threads.
extern "C" __global__ void __launch_bounds__(PF_THREADS)
attn_prefill(const float* q, const kv_t* k_cache, const kv_t* v_cache, int pos0, int t,
             const float* qkv, int ld, float* out) {
    __shared__ __align__(16) float qs[PF_Q][HD];
    __shared__ __align__(16) float kvs[PF_K][PF_PITCH];
    __shared__ float probs[PF_Q][PF_K];
    __shared__ float corr_s[PF_Q], l_s[PF_Q];
    int kv = blockIdx.x;
    // The longest tiles (latest queries) first, so the short ones fill in at the end.
    int tile = gridDim.y - 1 - blockIdx.y;
    int j0 = tile * PF_Q;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;

    for (int i = threadIdx.x; i < PF_Q * HD; i += PF_THREADS) {
        int jq = i / HD, d = i % HD;
        int j = j0 + jq, row = j / GROUP, head = kv * GROUP + j % GROUP;
        qs[jq][d] = row < t ? q[((long)row * NH + head) * HD + d] : 0.f;
    }
    // Keys the tile's last query sees (queries past the chunk's end are padding).
    int last_row = min(j0 + PF_Q - 1, t * GROUP - 1) / GROUP;
    int kend = pos0 + last_row + 1;

    // Score stage: lane → key (lane % 16) and two queries of the warp (lane / 16 picks the pair).
    int key = lane % PF_K;
    int qa = warp * 4 + (lane / PF_K) * 2;
    // Padding queries attend as the chunk's first token would: finite, and never written.
    int row_a = (j0 + qa) / GROUP, row_b = (j0 + qa + 1) / GROUP;
    int lim_a = pos0 + (row_a < t ? row_a : 0), lim_b = pos0 + (row_b < t ? row_b : 0);
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
    const float scale = rsqrtf((float)HD);

    float acc[4][PF_CPL][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int e = 0; e < PF_CPL; e++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][e][c] = 0.f;

    for (int k0 = 0; k0 < kend; k0 += PF_K) {
        __syncthreads();   // the previous tile's values are consumed (and qs is written)
        for (int i = threadIdx.x; i < PF_K * HD; i += PF_THREADS) {
            int kk = i / HD, d = i % HD, p = k0 + kk;
            kvs[kk][d] = p < kend ? kv_load(k_cache[((long)p * NKV + kv) * HD + d]) : 0.f;
        }
        __syncthreads();
        float sa = 0.f, sb = 0.f;
#pragma unroll 8
        for (int c = 0; c < PF_CHUNKS; c++) {
            float4 kk = *(const float4*)&kvs[key][4 * c];
            float4 x = *(const float4*)&qs[qa][4 * c];
            float4 y = *(const float4*)&qs[qa + 1][4 * c];
            sa += x.x * kk.x + x.y * kk.y + x.z * kk.z + x.w * kk.w;
            sb += y.x * kk.x + y.y * kk.y + y.z * kk.z + y.w * kk.w;
        }
        int p = k0 + key;
        sa = p <= lim_a ? sa * scale : -INFINITY;
        sb = p <= lim_b ? sb * scale : -INFINITY;
        // Max and sum over the 16 lanes that hold a query's keys. Position 0 is visible to
        // every query, so the running max is finite from the first tile on.
        float ta = sa, tb = sb;
#pragma unroll
        for (int o = PF_K / 2; o > 0; o >>= 1) {
            ta = fmaxf(ta, __shfl_xor_sync(0xffffffffu, ta, o));
            tb = fmaxf(tb, __shfl_xor_sync(0xffffffffu, tb, o));
        }
        float na = fmaxf(m_a, ta), nb = fmaxf(m_b, tb);
        float ca = __expf(m_a - na), cb = __expf(m_b - nb);
        float pa = __expf(sa - na), pb = __expf(sb - nb);
        m_a = na; m_b = nb;
        float ra = pa, rb = pb;
#pragma unroll
        for (int o = PF_K / 2; o > 0; o >>= 1) {
            ra += __shfl_xor_sync(0xffffffffu, ra, o);
            rb += __shfl_xor_sync(0xffffffffu, rb, o);
        }
        l_a = l_a * ca + ra;
        l_b = l_b * cb + rb;
        probs[qa][key] = pa;
        probs[qa + 1][key] = pb;
        if (key == 0) { corr_s[qa] = ca; corr_s[qa + 1] = cb; }
        __syncthreads();   // every warp is done with the keys
        for (int i = threadIdx.x; i < PF_K * HD; i += PF_THREADS) {
            int kk = i / HD, d = i % HD, p = k0 + kk;
            kvs[kk][d] = p < kend ? kv_load(v_cache[((long)p * NKV + kv) * HD + d]) : 0.f;
        }
        __syncthreads();
        // P·V stage: lane → float4 chunks of the head, all four of the warp's queries.
#pragma unroll
        for (int a = 0; a < 4; a++) {
            float cr = corr_s[warp * 4 + a];
#pragma unroll
            for (int e = 0; e < PF_CPL; e++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[a][e][c] *= cr;
        }
#pragma unroll 4
        for (int kk = 0; kk < PF_K; kk++) {
            float pr[4];
#pragma unroll
            for (int a = 0; a < 4; a++) pr[a] = probs[warp * 4 + a][kk];
#pragma unroll
            for (int e = 0; e < PF_CPL; e++) {
                int c = lane + e * WARP;
                if (c < PF_CHUNKS) {
                    float4 v = *(const float4*)&kvs[kk][4 * c];
#pragma unroll
                    for (int a = 0; a < 4; a++) {
                        acc[a][e][0] += pr[a] * v.x;
                        acc[a][e][1] += pr[a] * v.y;
                        acc[a][e][2] += pr[a] * v.z;
                        acc[a][e][3] += pr[a] * v.w;
                    }
                }
            }
        }
    }
    if (key == 0) { l_s[qa] = l_a; l_s[qa + 1] = l_b; }
    __syncwarp();
#pragma unroll
    for (int a = 0; a < 4; a++) {
        int j = j0 + warp * 4 + a, row = j / GROUP, head = kv * GROUP + j % GROUP;
        if (row >= t) continue;
        float inv_l = 1.f / l_s[warp * 4 + a];
        const float* gate = qkv + (long)row * ld + head * 2 * HD + HD;
        float* o = out + ((long)row * NH + head) * HD;
#pragma unroll
        for (int e = 0; e < PF_CPL; e++) {
            int c = lane + e * WARP;
            if (c >= PF_CHUNKS) continue;
#pragma unroll
            for (int i = 0; i < 4; i++) o[4 * c + i] = acc[a][e][i] * inv_l * sigmoidf(gate[4 * c + i]);
        }
    }
}
