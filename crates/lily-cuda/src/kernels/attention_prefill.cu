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
    pdl_wait();
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

// Flash attention on tensor cores (mma m16n8k16, bf16 inputs, f32 accumulation and softmax).
// A block takes one KV head and a tile of FA_ROWS query vectors of its group, numbered
// token-major (j = token·GROUP + head-in-group), so every K/V tile read from the cache serves
// FA_ROWS queries whatever GROUP is. Each of the four warps owns 16 query rows: S = Q·Kᵀ and the
// online softmax stay in its registers, and P (rounded to bf16) feeds P·V straight from them.
// Shared memory holds the block's queries and one tile of FA_KEYS positions, keys and then
// values in the same buffer: at HD 256 that is 32 + 16 KiB, the 48 KiB static limit.
#define FA_ROWS 64
#define FA_KEYS 32
#define FA_THREADS 128
#define FA_CHUNKS (HD / 8)   // 16-byte chunks (8 bf16) of a head row
// Chunk c of row r sits at chunk c ^ (r % FA_SWZ) of its row, so the eight rows one ldmatrix
// reads hit distinct banks (FA_SWZ: the largest power of two up to 8 dividing FA_CHUNKS).
#define FA_SWZ (FA_CHUNKS % 8 == 0 ? 8 : FA_CHUNKS % 4 == 0 ? 4 : 2)

// Byte offset of (row, chunk) in a swizzled [rows][HD] bf16 tile.
__device__ __forceinline__ u32 fa_at(int row, int chunk) {
    return (u32)(row * HD * 2 + ((chunk ^ (row % FA_SWZ)) << 4));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Cache positions k0 .. k0+FA_KEYS-1 of one KV head into a swizzled bf16 tile; positions from
// kend on become zeros (their scores are masked, and zeros keep 0 · V finite).
__device__ __forceinline__ void fa_load_tile(u16* tile, const kv_t* cache, int kv, int k0, int kend) {
    for (int i = threadIdx.x; i < FA_KEYS * FA_CHUNKS; i += FA_THREADS) {
        int r = i / FA_CHUNKS, c = i % FA_CHUNKS, p = k0 + r;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (p < kend) {
            const kv_t* src = cache + ((long)p * NKV + kv) * HD + c * 8;
#if KV_F32
            float4 a = ((const float4*)src)[0], b = ((const float4*)src)[1];
            v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                           pack_bf16x2(b.z, b.w));
#else
            v = *(const uint4*)src;
#endif
        }
        *(uint4*)((char*)tile + fa_at(r, c)) = v;
    }
}

// Causal attention: query row i (position pos0 + i) sees cache positions 0..=pos0+i; softmax
// scale 1/sqrt(HD); the output is multiplied by sigmoid(gate) from qkv. q: [T, NH·HD] from
// attn_prep_rows; out: [T, NH·HD]. Grid (NKV, ceil(T·GROUP / FA_ROWS)), FA_THREADS threads.
extern "C" __global__ void __launch_bounds__(FA_THREADS)
attn_prefill(const float* q, const kv_t* k_cache, const kv_t* v_cache, int pos0, int t,
             const float* qkv, int ld, float* out) {
    pdl_wait();
    __shared__ __align__(128) u16 qs[FA_ROWS * HD];
    __shared__ __align__(128) u16 kvs[FA_KEYS * HD];
    const u32 qs_at = (u32)__cvta_generic_to_shared(qs), kvs_at = (u32)__cvta_generic_to_shared(kvs);
    int kv = blockIdx.x;
    // The longest tiles (latest queries) first, so the short ones fill in at the end.
    int j0 = (gridDim.y - 1 - blockIdx.y) * FA_ROWS;
    int rows = t * GROUP;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int gid = lane / 4, tig = lane % 4;   // the mma fragments' row group and column pair

    for (int i = threadIdx.x; i < FA_ROWS * FA_CHUNKS; i += FA_THREADS) {
        int r = i / FA_CHUNKS, c = i % FA_CHUNKS, j = j0 + r;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (j < rows) {
            const float4* src = (const float4*)(q + ((long)(j / GROUP) * NH + kv * GROUP + j % GROUP) * HD + c * 8);
            float4 a = src[0], b = src[1];
            v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                           pack_bf16x2(b.z, b.w));
        }
        *(uint4*)((char*)qs + fa_at(r, c)) = v;
    }
    // Keys the block's last query sees.
    int kend = pos0 + (min(j0 + FA_ROWS, rows) - 1) / GROUP + 1;
    // This lane's two rows (gid and gid + 8 of the warp's 16) and the last position each sees.
    // Padding rows past the chunk attend as its first token would: finite, never written.
    int wrow = j0 + warp * 16;
    int ja = wrow + gid, jb = ja + 8;
    int lim_a = pos0 + (ja < rows ? ja / GROUP : 0), lim_b = pos0 + (jb < rows ? jb / GROUP : 0);
    // The warp skips tiles past its last row's position (all of them if it has no rows).
    int warp_lim = wrow < rows ? pos0 + (min(wrow + 16, rows) - 1) / GROUP : -1;
    // ldmatrix address roles: lane l gives row l % 8 of matrix l / 8.
    int mi = lane / 8, ri = lane % 8;

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
    const float scale = rsqrtf((float)HD);

    for (int k0 = 0; k0 < kend; k0 += FA_KEYS) {
        bool active = k0 <= warp_lim;
        __syncthreads();   // the previous tile's values are consumed (and qs is written)
        fa_load_tile(kvs, k_cache, kv, k0, kend);
        __syncthreads();
        float s[FA_KEYS / 8][4];
        if (active) {
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 a[4];
                // Q rows 0-15 of the warp, dims 16kk..: matrices (rows 0-7 | 8-15) × (dims lo | hi).
                ldmatrix_x4(a, qs_at + fa_at(warp * 16 + lane % 16, 2 * kk + lane / 16));
#pragma unroll
                for (int n = 0; n < FA_KEYS / 16; n++) {
                    u32 b[4];
                    // Keys 16n.. as B (k = dim, n = key): (keys 0-7 | 8-15) × (dims lo | hi).
                    ldmatrix_x4(b, kvs_at + fa_at(16 * n + ri + 8 * (mi >> 1), 2 * kk + (mi & 1)));
                    mma_bf16(s[2 * n], a, b[0], b[1]);
                    mma_bf16(s[2 * n + 1], a, b[2], b[3]);
                }
            }
            // Scale, causal mask, online softmax. A row's 32 scores spread over the 4 lanes of
            // a quad (same gid): c0,c1 are row gid, c2,c3 row gid + 8, columns 8n + 2tig + e.
            float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int p = k0 + 8 * n + 2 * tig + e;
                    s[n][e] = p <= lim_a ? s[n][e] * scale : -INFINITY;
                    s[n][2 + e] = p <= lim_b ? s[n][2 + e] * scale : -INFINITY;
                    mx_a = fmaxf(mx_a, s[n][e]);
                    mx_b = fmaxf(mx_b, s[n][2 + e]);
                }
#pragma unroll
            for (int x = 1; x < 4; x <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
            }
            // Position 0 is in the first tile and visible to every row, so the new maxima are
            // finite from the first tile on; later tiles may mask a row entirely (corr 1, p 0).
            float na = fmaxf(m_a, mx_a), nb = fmaxf(m_b, mx_b);
            float ca = __expf(m_a - na), cb = __expf(m_b - nb);
            m_a = na;
            m_b = nb;
            // l: this lane's columns only; the quad's shares are summed at the end.
            l_a *= ca;
            l_b *= cb;
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    s[n][e] = __expf(s[n][e] - na);
                    s[n][2 + e] = __expf(s[n][2 + e] - nb);
                    l_a += s[n][e];
                    l_b += s[n][2 + e];
                }
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                o[n][0] *= ca; o[n][1] *= ca;
                o[n][2] *= cb; o[n][3] *= cb;
            }
        }
        __syncthreads();   // every warp is done with the keys
        fa_load_tile(kvs, v_cache, kv, k0, kend);
        __syncthreads();
        if (active) {
#pragma unroll
            for (int kk = 0; kk < FA_KEYS / 16; kk++) {
                // P's accumulator layout for keys 16kk.. is the A operand's layout.
                u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                            pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int n = 0; n < HD / 16; n++) {
                    u32 b[4];
                    // V rows (keys) 16kk.. as B (k = key, n = dim), transposed on load:
                    // (keys 0-7 | 8-15) × (dims 16n.. | 16n+8..).
                    ldmatrix_x4_trans(b, kvs_at + fa_at(16 * kk + ri + 8 * (mi & 1), 2 * n + (mi >> 1)));
                    mma_bf16(o[2 * n], a, b[0], b[1]);
                    mma_bf16(o[2 * n + 1], a, b[2], b[3]);
                }
            }
        }
    }
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, x);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int j = half ? jb : ja;
        if (j >= rows) continue;
        int row = j / GROUP, head = kv * GROUP + j % GROUP;
        float inv_l = 1.f / (half ? l_b : l_a);
        const float* gate = qkv + (long)row * ld + head * 2 * HD + HD;
        float* dst = out + ((long)row * NH + head) * HD;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            int d = 8 * n + 2 * tig;
            float2 v;
            v.x = o[n][2 * half] * inv_l * sigmoidf(gate[d]);
            v.y = o[n][2 * half + 1] * inv_l * sigmoidf(gate[d + 1]);
            *(float2*)(dst + d) = v;
        }
    }
}
