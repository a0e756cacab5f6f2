// Gated attention for a prefill chunk of T tokens at positions pos0 .. pos0+T-1; earlier chunks'
// keys and values are already in the cache. Constants as attention.cu: NH query heads, NKV KV
// heads, HD head dim (a multiple of 16, at most 256), ROT rotary dims, ROPE_THETA.

#define GROUP (NH / NKV)

// Per (head, token), one warp a block: RMSNorm and RoPE at position pos0 + token
// (head_norm_rope, as attn_prep does for one token). Blocks x 0..NH-1 are query heads,
// NH..NH+NKV-1 KV heads; block y is the token. qkv rows (stride ld) are
// [q|gate per head (NH·2·HD) | k (NKV·HD) | v (NKV·HD)]; queries go to q_out [T, NH·HD].
extern "C" __global__ void attn_prep_rows(const float* qkv, int ld, const float* q_norm,
                                          const float* k_norm, int pos0, float* q_out,
                                          kv_t* k_cache, kv_t* v_cache, float eps) {
    pdl_wait();
    __shared__ float tmp[HD];
    int head = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    bool is_q = head < NH;
    int kv = head - NH;
    const float* in = qkv + (long)row * ld;
    const float* src = is_q ? in + head * 2 * HD : in + NH * 2 * HD + kv * HD;
    int pos = pos0 + row;
    const HeadValue value = load_head_value(is_q, in + NH * 2 * HD + NKV * HD + kv * HD, lane);
    float y[HEAD_PER_LANE];
    head_norm_rope(src, is_q ? q_norm : k_norm, eps, pos, tmp, lane, y);
    store_head(is_q, y, lane, q_out + ((long)row * NH + head) * HD, k_cache, v_cache, pos, kv, value);
}

// Flash attention on tensor cores (mma m16n8k16, bf16 inputs, f32 accumulation and softmax).
// A block takes one KV head and ROWS query vectors of its group, numbered token-major
// (j = token·GROUP + head-in-group), so every K/V tile read from the cache serves ROWS queries
// whatever GROUP is. Each warp owns 16 query rows: S = Q·Kᵀ and the online softmax stay in its
// registers, and P (rounded to bf16) feeds P·V straight from them. O is 16 × HD f32 a warp
// (128 registers a lane at HD 256), which is what caps a warp at 16 rows.
//
// What bounds it: per tile of FA_KEYS positions a warp reads (16 + 2·FA_KEYS)·HD·2 bytes
// through ldmatrix (its Q rows, the whole K and V tiles) for 16·FA_KEYS·HD·4 flops; with 8 warps
// an SM the shared-memory reads (576 KiB a tile at HD 256, ~4,600 cycles at 128 B a cycle) take
// about as long as the 2,048 mma.sync, so neither may wait on anything else. Hence:
// - K and V arrive by cp.async into a ring of SLOTS buffers of one K or one V tile each ("half
//   tiles", consumed in the order K0 V0 K1 V1 …), each requested SLOTS − 1 phases before its
//   use, a phase being the S product on a K tile or the P·V product on a V tile. One barrier a
//   phase both publishes the half tile it consumes and frees the slot of the one before, which
//   is refilled right after it: the loads overlap the mma work.
// - 64-key tiles: per key, half the barriers, softmax bookkeeping and O rescales of 32.
// - 64 or 128 query rows (4 or 8 warps) a block. 128 rows read each K/V tile from L2 once per
//   16 tokens instead of 8, but on the H200 64-row blocks, two an SM, measured 1–3 % faster at
//   every context: the co-resident block fills the other's barrier and softmax gaps
//   (attention_prefill.rs orders the shapes by that measurement).
// - ldmatrix addresses are a lane's base plus compile-time offsets (the swizzle's XOR touches
//   only the low 3 bits of a chunk index), so the inner loops are LDSM and HMMA only.
// - The softmax works in log2 units with the scale folded in (one FFMA and one MUFU.EX2 a
//   score), masks only tiles that reach past a row's last position, and rescales O only when
//   a row's running max moved (skipped for the whole warp when none did).
// Tiles past the block's last query are never loaded; a warp skips tiles past its last row.
//
// Rounding (mirrored by the CPU's flash mode, which must follow FA_KEYS): scores s = q·k in
// f32 from bf16 q and k; per row a running max m of fl(s·c), c = log2(e)/√HD, updated once per
// tile of FA_KEYS positions (64; it was 32 before the cp.async ring); p = 2^(s·c − m) with s·c
// − m by one FMA and 2^x by ex2.approx; the row sum l adds the f32 p; p is rounded to bf16
// (nearest even) for P·V; when m moves, O and l are multiplied by 2^(m_old − m_new) (by nothing
// when it stays).
#define FA_KEYS 64
#define FA_CHUNKS (HD / 8)   // 16-byte chunks (8 bf16) of a head row
#define FA_ROW_BYTES (HD * 2)
#define FA_HALF_BYTES (FA_KEYS * FA_ROW_BYTES)   // one K or V tile
// Chunk c of row r sits at chunk c ^ (r % FA_SWZ) of its row, so the eight rows one ldmatrix
// reads hit distinct banks (FA_SWZ: the largest power of two up to 8 dividing FA_CHUNKS).
#define FA_SWZ (FA_CHUNKS % 8 == 0 ? 8 : FA_CHUNKS % 4 == 0 ? 4 : 2)

__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Byte offset of (row, chunk) in a swizzled [rows][HD] bf16 tile. Since FA_SWZ divides 8,
// fa_at(r, 8a + b) = fa_at(r, b) + 128·a for b < 8: the lanes keep four offsets (b = 2x + hi)
// and the rest are immediates.
__device__ __forceinline__ u32 fa_at(int row, int chunk) {
    return (u32)(row * FA_ROW_BYTES + ((chunk ^ (row % FA_SWZ)) << 4));
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

__device__ __forceinline__ void fa_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fa_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Half tile `half` (K of tile half/2 if even, else its V) into the swizzled slot at shared
// address `dst`; positions from kend on become zeros (their scores are masked, and zeros keep
// 0 · V finite) and are not read: the cache may end at kend.
template <int THREADS>
__device__ __forceinline__ void fa_load_half(u32 dst, int half, const kv_t* k_cache, const kv_t* v_cache,
                                             int kv, int kend) {
    const kv_t* cache = (half & 1) ? v_cache : k_cache;
    int k0 = (half >> 1) * FA_KEYS;
    constexpr int ITEMS = FA_KEYS * FA_CHUNKS;
#pragma unroll
    for (int u = 0; u < (ITEMS + THREADS - 1) / THREADS; u++) {
        int i = (int)threadIdx.x + u * THREADS;
        if (ITEMS % THREADS != 0 && i >= ITEMS) break;
        int r = i / FA_CHUNKS, c = i % FA_CHUNKS, p = k0 + r;
        bool ok = p < kend;
        const kv_t* src = cache + ((long)(ok ? p : 0) * NKV + kv) * HD + c * 8;
        u32 at = dst + fa_at(r, c);
#if KV_F32
        // The f32 test cache is rounded to bf16 on the way, so it cannot be copied as it is.
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (ok) {
            float4 a = ((const float4*)src)[0], b = ((const float4*)src)[1];
            v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                           pack_bf16x2(b.z, b.w));
        }
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
#else
        // src-size 0 reads nothing and fills the 16 bytes with zeros.
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(src), "r"(ok ? 16 : 0)
                     : "memory");
#endif
    }
}

// The start of phase `half`: its half tile has landed and is visible to the block, every warp
// is done with the previous phase, and the slot that phase used is refilled SLOTS − 1 halves
// ahead. Groups are committed even when empty, so wait_group counts stay uniform.
template <int THREADS, int SLOTS>
__device__ __forceinline__ void fa_phase(int half, int halves, u32 slots_at, const kv_t* k_cache,
                                         const kv_t* v_cache, int kv, int kend) {
    fa_wait<SLOTS - 2>();
    __syncthreads();
    int next = half + SLOTS - 1;
    if (next < halves)
        fa_load_half<THREADS>(slots_at + (next % SLOTS) * FA_HALF_BYTES, next, k_cache, v_cache, kv, kend);
    fa_commit();
}

// Causal attention: query row i (position pos0 + i) sees cache positions 0..=pos0+i; softmax
// scale 1/sqrt(HD); the output is multiplied by sigmoid(gate) from qkv. q: [T, NH·HD] from
// attn_prep_rows; out: [T, NH·HD], and the same rounded to bf16 into out16 when given (the output
// projection's X on the wgmma path, rounded as the GEMMs round f32 X). Grid (NKV, ceil(T·GROUP / ROWS)), 2·ROWS threads, dynamic
// shared memory (ROWS + SLOTS·FA_KEYS)·HD·2 bytes: the block's queries, then the ring.
template <int ROWS, int SLOTS>
__device__ __forceinline__ void attn_prefill_rows(const float* q, const kv_t* k_cache, const kv_t* v_cache,
                                                  int pos0, int t, const float* qkv, int ld, float* out,
                                                  u16* out16) {
    constexpr int THREADS = 2 * ROWS;
    static_assert(ROWS % 16 == 0 && SLOTS >= 2, "16 rows a warp, at least two slots");
    extern __shared__ __align__(128) u16 fa_smem[];
    const u32 qs_at = (u32)__cvta_generic_to_shared(fa_smem);
    const u32 slots_at = qs_at + ROWS * FA_ROW_BYTES;
    int kv = blockIdx.x;
    // The longest tiles (latest queries) first, so the short ones fill in at the end.
    int j0 = (gridDim.y - 1 - blockIdx.y) * ROWS;
    int rows = t * GROUP;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int gid = lane / 4, tig = lane % 4;   // the mma fragments' row group and column pair

    // Keys the block's last query sees, in whole tiles of K then V.
    int kend = pos0 + (min(j0 + ROWS, rows) - 1) / GROUP + 1;
    int halves = 2 * ((kend + FA_KEYS - 1) / FA_KEYS);
#pragma unroll
    for (int h = 0; h < SLOTS - 1; h++) {
        if (h < halves) fa_load_half<THREADS>(slots_at + h * FA_HALF_BYTES, h, k_cache, v_cache, kv, kend);
        fa_commit();
    }
    // The queries, rounded to bf16, while the first half tiles are in flight (published by the
    // first phase's barrier). Loads are issued in batches before any store: loop iterations
    // that each load and store went out one round trip at a time.
    constexpr int Q_PER = HD / 16;   // 16-byte chunks a thread: ROWS·HD/8 over 2·ROWS threads
    constexpr int Q_BATCH = Q_PER < 8 ? Q_PER : 8;
#pragma unroll
    for (int u0 = 0; u0 < Q_PER; u0 += Q_BATCH) {
        float4 x[Q_BATCH][2];
#pragma unroll
        for (int u = 0; u < Q_BATCH; u++) {
            int i = (int)threadIdx.x + (u0 + u) * THREADS, j = j0 + i / FA_CHUNKS;
            x[u][0] = x[u][1] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (u0 + u < Q_PER && j < rows) {
                const float4* src =
                    (const float4*)(q + ((long)(j / GROUP) * NH + kv * GROUP + j % GROUP) * HD + i % FA_CHUNKS * 8);
                x[u][0] = src[0];
                x[u][1] = src[1];
            }
        }
#pragma unroll
        for (int u = 0; u < Q_BATCH; u++) {
            int i = (int)threadIdx.x + (u0 + u) * THREADS;
            if (u0 + u < Q_PER) {
                uint4 v = make_uint4(pack_bf16x2(x[u][0].x, x[u][0].y), pack_bf16x2(x[u][0].z, x[u][0].w),
                                     pack_bf16x2(x[u][1].x, x[u][1].y), pack_bf16x2(x[u][1].z, x[u][1].w));
                *(uint4*)((char*)fa_smem + fa_at(i / FA_CHUNKS, i % FA_CHUNKS)) = v;
            }
        }
    }

    // This lane's two rows (gid and gid + 8 of the warp's 16) and the last position each sees.
    // Padding rows past the chunk attend as its first token would: finite, never written.
    int wrow = j0 + warp * 16;
    int ja = wrow + gid, jb = ja + 8;
    int lim_a = pos0 + (ja < rows ? ja / GROUP : 0), lim_b = pos0 + (jb < rows ? jb / GROUP : 0);
    // The warp skips tiles past its last row's position (all of them if it has no rows), and
    // masks only tiles reaching past the smallest last position of its rows.
    int warp_lim = wrow < rows ? pos0 + (min(wrow + 16, rows) - 1) / GROUP : -1;
    int warp_min_lim = wrow + 16 <= rows ? pos0 + wrow / GROUP : pos0;
    // ldmatrix address roles: lane l gives row l % 8 of matrix l / 8. Per lane, the four chunk
    // offsets (fa_at) of: Q (rows 0-15 of the warp × dims lo | hi), K as B (keys 0-7 | 8-15 ×
    // dims lo | hi), V as B transposed (keys 0-7 | 8-15 × dims 16n.. | 16n+8..).
    int mi = lane / 8, ri = lane % 8;
    u32 q_lane[4], k_lane[4], v_lane[4];
#pragma unroll
    for (int x = 0; x < 4; x++) {
        q_lane[x] = qs_at + fa_at(warp * 16 + lane % 16, 2 * x + lane / 16);
        k_lane[x] = fa_at(ri + 8 * (mi >> 1), 2 * x + (mi & 1));
        v_lane[x] = fa_at(ri + 8 * (mi & 1), 2 * x + (mi >> 1));
    }

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    // Running maxima of s·c (log2 units) and this lane's shares of the row sums.
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
    const float log2_scale = rsqrtf((float)HD) * 1.4426950408889634f;

    for (int phase = 0; phase < halves; phase += 2) {
        int k0 = (phase >> 1) * FA_KEYS;
        bool active = k0 <= warp_lim;
        u32 pf[FA_KEYS / 16][4];   // P as the A operand of P·V, per 16 keys

        fa_phase<THREADS, SLOTS>(phase, halves, slots_at, k_cache, v_cache, kv, kend);
        if (active) {
            const u32 k_at = slots_at + (phase % SLOTS) * FA_HALF_BYTES;
            float s[FA_KEYS / 8][4];
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 a[4];
                ldmatrix_x4(a, q_lane[kk % 4] + (kk / 4) * 128);
#pragma unroll
                for (int n = 0; n < FA_KEYS / 16; n++) {
                    u32 b[4];
                    ldmatrix_x4(b, k_at + k_lane[kk % 4] + (kk / 4) * 128 + n * 16 * FA_ROW_BYTES);
                    mma_bf16(s[2 * n], a, b[0], b[1]);
                    mma_bf16(s[2 * n + 1], a, b[2], b[3]);
                }
            }
            // A row's scores spread over the 4 lanes of a quad (same gid): c0,c1 are row gid,
            // c2,c3 row gid + 8, columns 8n + 2tig + e. Keys from kend on are zeros, but past
            // every row's limit, so the mask covers them.
            if (k0 + FA_KEYS - 1 > warp_min_lim) {
#pragma unroll
                for (int n = 0; n < FA_KEYS / 8; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        int p = k0 + 8 * n + 2 * tig + e;
                        if (p > lim_a) s[n][e] = -INFINITY;
                        if (p > lim_b) s[n][2 + e] = -INFINITY;
                    }
            }
            float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; n++) {
                mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
            }
#pragma unroll
            for (int x = 1; x < 4; x <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
            }
            // Position 0 is in the first tile and visible to every row, so the maxima are
            // finite from the first tile on; a later tile may mask a row entirely (it keeps m).
            float na = fmaxf(m_a, mx_a * log2_scale), nb = fmaxf(m_b, mx_b * log2_scale);
            float ca = na == m_a ? 1.f : fa_exp2(m_a - na), cb = nb == m_b ? 1.f : fa_exp2(m_b - nb);
            m_a = na;
            m_b = nb;
            l_a *= ca;
            l_b *= cb;
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    s[n][e] = fa_exp2(fmaf(s[n][e], log2_scale, -na));
                    s[n][2 + e] = fa_exp2(fmaf(s[n][2 + e], log2_scale, -nb));
                    l_a += s[n][e];
                    l_b += s[n][2 + e];
                }
            // P's accumulator layout for keys 16kk.. is the A operand's layout.
#pragma unroll
            for (int kk = 0; kk < FA_KEYS / 16; kk++) {
                pf[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
                pf[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
                pf[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pf[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
            if (__any_sync(0xffffffffu, ca != 1.f || cb != 1.f)) {
#pragma unroll
                for (int n = 0; n < HD / 8; n++) {
                    o[n][0] *= ca; o[n][1] *= ca;
                    o[n][2] *= cb; o[n][3] *= cb;
                }
            }
        }

        fa_phase<THREADS, SLOTS>(phase + 1, halves, slots_at, k_cache, v_cache, kv, kend);
        if (active) {
            const u32 v_at = slots_at + ((phase + 1) % SLOTS) * FA_HALF_BYTES;
#pragma unroll
            for (int kk = 0; kk < FA_KEYS / 16; kk++)
#pragma unroll
                for (int n = 0; n < HD / 16; n++) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, v_at + v_lane[n % 4] + (n / 4) * 128 + kk * 16 * FA_ROW_BYTES);
                    mma_bf16(o[2 * n], pf[kk], b[0], b[1]);
                    mma_bf16(o[2 * n + 1], pf[kk], b[2], b[3]);
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
            if (out16) *(u32*)(out16 + ((long)row * NH + head) * HD + d) = pack_bf16x2(v.x, v.y);
        }
    }
}

// The block shapes attention_prefill.rs chooses from by the device's shared memory (at HD 256:
// 192, 128 and 96 KiB). Fewer slots only shorten how far ahead the loads run, and fewer rows
// only make more blocks: every shape rounds alike.
#define ATTN_PREFILL(ROWS, SLOTS)                                                                  \
    extern "C" __global__ void __launch_bounds__(2 * ROWS)                                        \
        attn_prefill_r##ROWS##_s##SLOTS(const float* q, const kv_t* k_cache, const kv_t* v_cache, \
                                        int pos0, int t, const float* qkv, int ld, float* out,    \
                                        u16* out16) {                                              \
        pdl_wait();                                                                                \
        attn_prefill_rows<ROWS, SLOTS>(q, k_cache, v_cache, pos0, t, qkv, ld, out, out16);        \
    }

ATTN_PREFILL(128, 4)
ATTN_PREFILL(128, 2)
ATTN_PREFILL(64, 2)
