// Decode attention over one split of the context, shared by the graph step (attention.cu) and
// the persistent step (decode.cu). Constants: NH query heads, NKV KV heads, HD head dim.

#define GROUP (NH / NKV)

// ---- Decode attention over one split of the context ----
//
// Each warp streams its own positions. Lanes own head dims, 8 each (a key or value row is LPR
// lanes, 16 bytes of bf16 a lane, so a warp reads rows whole and contiguous), and hold the
// group's queries for their dims in registers. A batch is AS_P positions per row of lanes: a lane
// computes its partial dot products for every (position, head) pair of the batch, then one
// reduce-scatter across the row's lanes (each step sends half of the values still held and keeps
// the other half) leaves every lane with one full score, about one shuffle per score instead of
// log2(LPR). The lane owning a score does its exponential; probabilities and rescale factors go
// through a per-warp scratch in shared memory to the lanes that accumulate P·V for their dims.
// K/V rows travel by cp.async into a per-lane staging ring (each lane reads back only the bytes it
// copied itself), AS_STAGES - 1 batches ahead of use. A GQA group wider than AS_GP heads takes
// several passes over the split.

__host__ __device__ constexpr int as_pow2_at_least(int x) { return x <= 1 ? 1 : 2 * as_pow2_at_least((x + 1) / 2); }
__host__ __device__ constexpr int as_log2(int x) { return x <= 1 ? 0 : 1 + as_log2(x / 2); }

constexpr int AS_GP = as_pow2_at_least(GROUP < 8 ? GROUP : 8);   // head slots of one pass
constexpr int AS_PASSES = (GROUP + AS_GP - 1) / AS_GP;
constexpr int AS_LPR = as_pow2_at_least(HD / 8) > AS_GP ? as_pow2_at_least(HD / 8) : AS_GP;   // lanes per row
constexpr int AS_RPW = WARP / AS_LPR;                                  // rows (sub-streams) per warp
constexpr int AS_P = AS_LPR / AS_GP < 2 ? AS_LPR / AS_GP : 2;         // positions per row per batch
constexpr int AS_N = AS_P * AS_GP;                                     // scores per row per batch
constexpr int AS_SH = as_log2(AS_LPR / AS_N);   // a lane's score index is (lane in row) >> AS_SH
constexpr int AS_CH = 8 * (int)sizeof(kv_t) / 16;                      // 16-byte chunks per lane per row
constexpr int AS_STAGES = 8 / (AS_P * AS_CH) > 1 ? 8 / (AS_P * AS_CH) : 1;   // 32 KiB of staging
constexpr int AS_BATCH = AS_RPW * AS_P;                                // positions per warp per batch
static_assert(HD % 8 == 0 && HD <= 256, "attn_split: head dim a multiple of 8, at most 256");
static_assert(AS_N <= AS_LPR, "attn_split: one score per lane at most");

__device__ __forceinline__ void as_cp_async16(void* dst, const void* src, bool ok) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    // src-size 0 reads nothing and fills the 16 bytes with zeros.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void as_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void as_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// The 8 values of a lane's row chunk(s) in staging (chunk c at src[c · WARP]).
__device__ __forceinline__ void as_unpack(const uint4* src, float (&f)[8]) {
#if KV_F32
    uint4 a = src[0], b = src[WARP];
    f[0] = __uint_as_float(a.x); f[1] = __uint_as_float(a.y); f[2] = __uint_as_float(a.z); f[3] = __uint_as_float(a.w);
    f[4] = __uint_as_float(b.x); f[5] = __uint_as_float(b.y); f[6] = __uint_as_float(b.z); f[7] = __uint_as_float(b.w);
#else
    uint4 a = src[0];
    u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
#endif
}

// Sums v[i] over the row's lanes (xor offsets below O) while scattering: each step with N > 1
// values keeps half of them (the upper half on lanes with bit O set) and adds the partner's copy
// of that half. Afterwards v[0] on lane li is the full sum of value li >> AS_SH.
template <int O, int N>
__device__ __forceinline__ void as_reduce_scatter(float (&v)[AS_N], int li) {
    if constexpr (O >= 1) {
        if constexpr (N > 1) {
            bool upper = (li & O) != 0;
#pragma unroll
            for (int i = 0; i < N / 2; i++) {
                float send = upper ? v[i] : v[i + N / 2];
                float keep = upper ? v[i + N / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
            }
            as_reduce_scatter<O / 2, N / 2>(v, li);
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
            as_reduce_scatter<O / 2, 1>(v, li);
        }
    }
}

// The shared memory of one split taken by W warps: the staging ring while streaming, the
// sub-streams' outputs (wacc) when merging, and each warp's scores and rescale factors.
template <int W>
struct AsSmem {
    static constexpr int NSUB = W * AS_RPW;   // sub-streams merged at the end
    static constexpr int STAGE_U4 = AS_STAGES * W * 2 * AS_P * AS_CH * WARP;
    static constexpr int WACC_U4 = NSUB * AS_GP * HD / 4;
    __align__(16) uint4 smem[STAGE_U4 > WACC_U4 ? STAGE_U4 : WACC_U4];
    __align__(16) float sprob[W][AS_RPW][AS_N];
    __align__(16) float scorr[W][AS_RPW][AS_GP];
    float wm[NSUB][AS_GP], wl[NSUB][AS_GP];
};

// Split `split` of `nsplit` of the `len` cached positions of KV head kv, by the block's W warps
// (blockDim.x == W · 32). Writes per (kv, split, head-in-group) the running max, the sum of
// exponentials and the unnormalised output, as attn_combine reads them; a split with no
// positions writes max -inf, sum 0. q: the group's GROUP queries, in global or shared memory.
template <int W>
__device__ void attn_split_block(const float* q, const kv_t* k_cache, const kv_t* v_cache, long len, int kv,
                                 int split, int nsplit, float* part_ml, float* part_acc, AsSmem<W>& sm) {
    constexpr int AS_WARPS = W, AS_NSUB = AsSmem<W>::NSUB;
    auto stage = reinterpret_cast<uint4(*)[AS_WARPS][2][AS_P][AS_CH][WARP]>(sm.smem);
    auto wacc = reinterpret_cast<float(*)[AS_GP][HD]>(sm.smem);
    auto& sprob = sm.sprob;
    auto& scorr = sm.scorr;
    auto& wm = sm.wm;
    auto& wl = sm.wl;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int li = lane % AS_LPR, row = lane / AS_LPR, sub = warp * AS_RPW + row;
    const int d0 = li * 8;
    const bool dim_ok = d0 < HD;
    const int start = (int)(split * len / nsplit), end = (int)((split + 1) * len / nsplit);
    const int nbatch = (end - start + AS_WARPS * AS_BATCH - 1) / (AS_WARPS * AS_BATCH);
    const float scale = rsqrtf((float)HD);
    // The score this lane owns after the reduce-scatter: position my_p of its row, head my_g.
    const int my_idx = li >> AS_SH, my_p = my_idx / AS_GP, my_g = my_idx % AS_GP;
    const bool canon = (li & ((1 << AS_SH) - 1)) == 0;   // first of the lanes holding that score
    // First position of this lane's row in batch t.
    auto row_pos = [&](int t) { return start + (t * AS_WARPS + warp) * AS_BATCH + row * AS_P; };

    for (int pass = 0; pass < AS_PASSES; pass++) {
        const int g0 = pass * AS_GP;
        float qr[AS_GP][8];
#pragma unroll
        for (int g = 0; g < AS_GP; g++) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
            if (dim_ok && g0 + g < GROUP) {
                const float4* src = (const float4*)(q + (g0 + g) * HD + d0);
                a = src[0];
                b = src[1];
            }
            qr[g][0] = a.x; qr[g][1] = a.y; qr[g][2] = a.z; qr[g][3] = a.w;
            qr[g][4] = b.x; qr[g][5] = b.y; qr[g][6] = b.z; qr[g][7] = b.w;
        }
        // Batch t's rows into staging slot t % AS_STAGES (zeros past the split's end).
        auto issue = [&](int t) {
            const int slot = t % AS_STAGES, p0 = row_pos(t);
#pragma unroll
            for (int p = 0; p < AS_P; p++) {
                const bool ok = dim_ok && p0 + p < end;
                const long at = ok ? ((long)(p0 + p) * NKV + kv) * HD + d0 : 0;
#pragma unroll
                for (int c = 0; c < AS_CH; c++) {
                    as_cp_async16(&stage[slot][warp][0][p][c][lane], k_cache + at + c * (16 / (int)sizeof(kv_t)), ok);
                    as_cp_async16(&stage[slot][warp][1][p][c][lane], v_cache + at + c * (16 / (int)sizeof(kv_t)), ok);
                }
            }
            as_cp_commit();
        };
#pragma unroll
        for (int t = 0; t < AS_STAGES - 1; t++) issue(t);

        float m_own = -INFINITY, l_own = 0.f;   // for head my_g (l: this lane's positions only)
        float acc[AS_GP][8];
#pragma unroll
        for (int g = 0; g < AS_GP; g++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] = 0.f;

        for (int t = 0; t < nbatch; t++) {
            // The slot written here was last read (by this same lane) in batch t - 1.
            issue(t + AS_STAGES - 1);
            as_cp_wait<AS_STAGES - 1>();
            const int slot = t % AS_STAGES;
            float sc[AS_N];   // partial scores, index p · AS_GP + g
#pragma unroll
            for (int p = 0; p < AS_P; p++) {
                float kf[8];
                as_unpack(&stage[slot][warp][0][p][0][lane], kf);
#pragma unroll
                for (int g = 0; g < AS_GP; g++) {
                    float s = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; e++) s += qr[g][e] * kf[e];
                    sc[p * AS_GP + g] = s;
                }
            }
            as_reduce_scatter<AS_LPR / 2, AS_N>(sc, li);
            float s = row_pos(t) + my_p < end ? sc[0] * scale : -INFINITY;
            // The batch's max for head my_g: the lanes owning the same head's other positions.
            float bm = s;
#pragma unroll
            for (int o = AS_LPR / AS_P; o < AS_LPR; o <<= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
            const float mn = fmaxf(m_own, bm);
            const float corr = mn == -INFINITY ? 1.f : __expf(m_own - mn);
            const float prob = s == -INFINITY ? 0.f : __expf(s - mn);
            l_own = l_own * corr + prob;
            m_own = mn;
            __syncwarp();   // the previous batch's reads of sprob and scorr are done
            if (canon) sprob[warp][row][my_idx] = prob;
            if (canon && my_p == 0) scorr[warp][row][my_g] = corr;
            __syncwarp();
            float cr[AS_GP];
#pragma unroll
            for (int g = 0; g < AS_GP; g++) cr[g] = scorr[warp][row][g];
#pragma unroll
            for (int g = 0; g < AS_GP; g++) {
                if (cr[g] != 1.f) {
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[g][e] *= cr[g];
                }
            }
#pragma unroll
            for (int p = 0; p < AS_P; p++) {
                float vf[8], pr[AS_GP];
                as_unpack(&stage[slot][warp][1][p][0][lane], vf);
#pragma unroll
                for (int g = 0; g < AS_GP; g++) pr[g] = sprob[warp][row][p * AS_GP + g];
#pragma unroll
                for (int g = 0; g < AS_GP; g++)
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[g][e] += pr[g] * vf[e];
            }
        }

        // l over the row's positions (the lanes owning head my_g).
#pragma unroll
        for (int o = AS_LPR / AS_P; o < AS_LPR; o <<= 1) l_own += __shfl_xor_sync(0xffffffffu, l_own, o);
        as_cp_wait<0>();   // the trailing (empty) copies have landed: staging is free
        __syncthreads();   // every warp is done with staging, which wacc reuses
        if (canon && my_p == 0) { wm[sub][my_g] = m_own; wl[sub][my_g] = l_own; }
        if (dim_ok) {
#pragma unroll
            for (int g = 0; g < AS_GP; g++) {
                float4* dst = (float4*)&wacc[sub][g][d0];
                dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
                dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
            }
        }
        __syncthreads();
        const long part = (long)kv * nsplit + split;
        for (int i = threadIdx.x; i < AS_GP * HD; i += blockDim.x) {
            const int g = i / HD, d = i % HD;
            if (g0 + g >= GROUP) continue;
            float mx = -INFINITY;
            for (int w = 0; w < AS_NSUB; w++) mx = fmaxf(mx, wm[w][g]);
            float a = 0.f, sum = 0.f;
            if (mx != -INFINITY) {
                for (int w = 0; w < AS_NSUB; w++) {
                    float f = __expf(wm[w][g] - mx);
                    a += f * wacc[w][g][d];
                    sum += f * wl[w][g];
                }
            }
            const long h = part * GROUP + g0 + g;
            part_acc[h * HD + d] = a;
            if (d == 0) { part_ml[h * 2] = mx; part_ml[h * 2 + 1] = sum; }
        }
        __syncthreads();   // the next pass stages into the buffer just read
    }
}

// Positions a split takes at least (16 a warp of four): at short contexts a split's fixed cost
// (its queries, the ring's first requests) outweighs its positions, and every split more is one
// more partial for the combine to read (at 256 positions 64 splits of 4 made the combine 10 µs).
#define ATTN_SPLIT_POSITIONS 64

// The splits that `len` positions take when up to `most` are there: the split kernel and the
// combine both count them so, from the position on the device, so a graph captured for `most`
// splits still merges only the live ones.
__device__ __forceinline__ int attn_live_splits(int len, int most) {
    return max(1, min(most, (len + ATTN_SPLIT_POSITIONS - 1) / ATTN_SPLIT_POSITIONS));
}

// Dim d of query head h, its splits merged, times the sigmoid output gate from qkv
// ([q|gate per head ...]): the persistent step's merge, a thread a dim (the graph step's
// attn_combine merges with every warp of a block).
__device__ float attn_combine_one(int h, int d, const float* part_ml, const float* part_acc, int nsplit,
                                  const float* qkv) {
    int kv = h / GROUP, g = h % GROUP;
    float mx = -INFINITY;
    for (int s = 0; s < nsplit; s++) mx = fmaxf(mx, load_act(part_ml + (((long)kv * nsplit + s) * GROUP + g) * 2));
    float a = 0.f, sum = 0.f;
    for (int s = 0; s < nsplit; s++) {
        long part = ((long)kv * nsplit + s) * GROUP + g;
        float ms = load_act(part_ml + part * 2);
        if (ms == -INFINITY) continue;
        float f = __expf(ms - mx);
        a += f * load_act(part_acc + part * HD + d);
        sum += f * load_act(part_ml + part * 2 + 1);
    }
    float gate = load_act(qkv + h * 2 * HD + HD + d);
    return a / sum * sigmoidf(gate);
}
