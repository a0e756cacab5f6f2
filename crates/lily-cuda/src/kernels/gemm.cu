// Y = X · Wᵀ on the tensor cores for prefill: X is f32 activations [rows, K], W a weight as stored
// (4- or 8-bit MLX affine codes, or dense f32). Both are rounded to bf16 on their way into shared
// memory (W dequantised there, w = scale·code + bias in f32, then rounded), so a bf16 copy of a
// weight never exists in global memory; products accumulate in f32 (mma m16n8k16, sm_80+).
//
// A block computes a BM × BN tile of Y with 8 warps, each a 64 × 32 tile (4 × 4 mma tiles: per
// 16 columns of K, 4 ldmatrix of X and 2 of W feed 16 mma). Dense: BM = BN = 128, warps 2 (rows)
// × 4 (columns). Grouped: BM = MOE_TILE = 64 (routing cuts tiles of 64 rows), BN = 256, warps
// 1 × 8. K advances GEMM_BK at a time through two shared buffers: the global loads of step k+1
// are issued into registers before the mma work of step k and converted into the other buffer
// after it, so their latency hides behind the arithmetic and one barrier per step suffices.
// Shared tiles are rows of 32 bf16 (4 chunks of 16 bytes) with chunk c of row r stored at
// c ^ ((r / 2) % 4): the 8 rows an ldmatrix reads at one logical chunk, and the chunks a
// quarter-warp stores, fall in 8 different bank groups.

#define GEMM_BK 32
#define GEMM_THREADS 256
#define GEMM_DENSE_BM 128
#define GEMM_DENSE_BN 128
#define GEMM_GROUPED_BM 64
#define GEMM_GROUPED_BN 256

static_assert(GEMM_GROUPED_BM == MOE_TILE, "a grouped tile (MOE_TILE rows) must be one block's rows");

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    // cvt puts its first source in the upper half; rounds to nearest even like f32_to_bf16.
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Element offset of (row, 16-byte chunk) in a swizzled shared tile.
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * GEMM_BK + ((chunk ^ ((row >> 1) & 3)) << 3);
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// This thread's share of one X tile (BM × GEMM_BK f32): BM / 64 pieces of 8 values; piece
// c = tid + 256·i is row c/4, columns (c%4)·8 .. +8 of the step.
template <int BM>
struct XLoad {
    static constexpr int PIECES = BM * GEMM_BK / 8 / GEMM_THREADS;
    float v[PIECES][8];
};

// The source rows of this thread's X pieces (null: the row is past the block's rows).
// Vector loads need 16-byte aligned rows: the caller checks x and K.
template <int BM>
__device__ __forceinline__ void load_x(XLoad<BM>& r, const float* const (&rows)[XLoad<BM>::PIECES], int k, int K,
                                       bool vec) {
#pragma unroll
    for (int i = 0; i < XLoad<BM>::PIECES; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int kk = k + 4 * h;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (rows[i] != nullptr) {
                if (vec) {
                    // K % 4 == 0 here, so a float4 is wholly inside the row or wholly past it.
                    if (kk < K) v = *(const float4*)(rows[i] + kk);
                } else {
                    if (kk < K) v.x = rows[i][kk];
                    if (kk + 1 < K) v.y = rows[i][kk + 1];
                    if (kk + 2 < K) v.z = rows[i][kk + 2];
                    if (kk + 3 < K) v.w = rows[i][kk + 3];
                }
            }
            r.v[i][4 * h] = v.x;
            r.v[i][4 * h + 1] = v.y;
            r.v[i][4 * h + 2] = v.z;
            r.v[i][4 * h + 3] = v.w;
        }
    }
}

template <int BM>
__device__ __forceinline__ void store_x(const XLoad<BM>& r, u16* sx, int tid) {
#pragma unroll
    for (int i = 0; i < XLoad<BM>::PIECES; i++) {
        const float* v = r.v[i];
        uint4 q = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                             pack_bf16x2(v[6], v[7]));
        int c = tid + GEMM_THREADS * i;
        *(uint4*)(sx + swizzled(c / 4, c % 4)) = q;
    }
}

// This thread's share of one W tile (BN rows × GEMM_BK columns), as loaded from global memory:
// SPAN = BN / 8 consecutive columns of one row (dense 16, grouped 32), row tid / (32 / SPAN),
// columns (tid % (32 / SPAN))·SPAN .. +SPAN of the step. They arrive in LOADS loads of LK
// columns, each with its group's scale and bias: 4-bit LK = SPAN (8 or 16 bytes of codes; every
// 4-bit group is a multiple of 32 columns, so an aligned span of ≤ 32 lies in one group), 8-bit
// LK = 16 (16 bytes; groups are multiples of 16), f32 LK = 8 (two float4).
template <int BITS, int BN>
struct WLoad {
    static constexpr int SPAN = BN * GEMM_BK / GEMM_THREADS;
    static constexpr int LK = BITS == 4 ? SPAN : BITS == 8 ? 16 : 8;
    static constexpr int LOADS = SPAN / LK;
    static constexpr int WORDS = LK * BITS / 32;
    static_assert(SPAN == 16 || SPAN == 32, "a thread's W span is 16 or 32 columns");
    static_assert(WORDS == 2 || WORDS == 4 || WORDS == 8, "loads of 8, 16 or 32 bytes");
    u32 q[LOADS][WORDS];
    float scale[LOADS], bias[LOADS];
};

// Rows [row0, row0 + n_valid) of w feed this block; rows past n_valid and columns past K load
// as zero. For codes, K is a multiple of the group (≥ 32 for 4-bit, ≥ 16 for 8-bit, checked by
// the launcher), so a load never straddles a group or the end of a row.
template <int BITS, int BN>
__device__ __forceinline__ void load_w(WLoad<BITS, BN>& r, const Mat& w, long row0, int n_valid, int k, bool vec,
                                       int tid) {
    using L = WLoad<BITS, BN>;
    const int K = w.cols;
    const int row = tid / (GEMM_BK / L::SPAN);
    const int col = (tid % (GEMM_BK / L::SPAN)) * L::SPAN;
    const long wr = row0 + row;
#pragma unroll
    for (int l = 0; l < L::LOADS; l++) {
        int kk = k + col + l * L::LK;
        bool live = row < n_valid && kk < K;
        if constexpr (BITS == 32) {
            const float* src = (const float*)w.w + wr * K;
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = 0.f;
            if (live) {
                if (vec) {
                    // K % 4 == 0: each float4 lies wholly inside the row or wholly past it.
                    float4 a = *(const float4*)(src + kk);
                    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
                    if (kk + 4 < K) {
                        float4 b = *(const float4*)(src + kk + 4);
                        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        if (kk + j < K) v[j] = src[kk + j];
                }
            }
#pragma unroll
            for (int j = 0; j < 8; j++) r.q[l][j] = __float_as_uint(v[j]);
        } else {
#pragma unroll
            for (int j = 0; j < L::WORDS; j++) r.q[l][j] = 0u;
            r.scale[l] = 0.f;
            r.bias[l] = 0.f;
            if (live) {
                const char* codes = (const char*)w.w + wr * K * BITS / 8 + (long)kk * BITS / 8;
                if constexpr (L::WORDS == 4) {
                    uint4 q = *(const uint4*)codes;
                    r.q[l][0] = q.x; r.q[l][1] = q.y; r.q[l][2] = q.z; r.q[l][3] = q.w;
                } else {
                    uint2 q = *(const uint2*)codes;
                    r.q[l][0] = q.x; r.q[l][1] = q.y;
                }
                long g = wr * (K / w.group) + kk / w.group;
                r.scale[l] = bf16_to_f32(w.scales[g]);
                r.bias[l] = bf16_to_f32(w.biases[g]);
            }
        }
    }
}

// Two codes of a word (fields lo and lo + 1) dequantised and packed as bf16.
template <int BITS>
__device__ __forceinline__ u32 dequant_pair(u32 word, int lo, float s, float b) {
    constexpr u32 MASK = (1u << BITS) - 1u;
    float w0 = __fmaf_rn(s, code_to_f32((word >> (lo * BITS)) & MASK), b);
    float w1 = __fmaf_rn(s, code_to_f32((word >> ((lo + 1) * BITS)) & MASK), b);
    return pack_bf16x2(w0, w1);
}

template <int BITS, int BN>
__device__ __forceinline__ void store_w(const WLoad<BITS, BN>& r, u16* sw, int tid) {
    using L = WLoad<BITS, BN>;
    const int row = tid / (GEMM_BK / L::SPAN);
    const int chunk0 = (tid % (GEMM_BK / L::SPAN)) * L::SPAN / 8;
#pragma unroll
    for (int l = 0; l < L::LOADS; l++) {
        const u32* words = r.q[l];
        const int chunk = chunk0 + l * L::LK / 8;
        if constexpr (BITS == 32) {
            // 8 values (as f32 bits) become one 16-byte bf16 chunk.
            uint4 out = make_uint4(pack_bf16x2(__uint_as_float(words[0]), __uint_as_float(words[1])),
                                   pack_bf16x2(__uint_as_float(words[2]), __uint_as_float(words[3])),
                                   pack_bf16x2(__uint_as_float(words[4]), __uint_as_float(words[5])),
                                   pack_bf16x2(__uint_as_float(words[6]), __uint_as_float(words[7])));
            *(uint4*)(sw + swizzled(row, chunk)) = out;
        } else {
            const float s = r.scale[l], b = r.bias[l];
            if constexpr (BITS == 4) {
                // A word holds 8 codes: one 16-byte chunk of bf16.
#pragma unroll
                for (int j = 0; j < L::WORDS; j++) {
                    uint4 out = make_uint4(dequant_pair<4>(words[j], 0, s, b), dequant_pair<4>(words[j], 2, s, b),
                                           dequant_pair<4>(words[j], 4, s, b), dequant_pair<4>(words[j], 6, s, b));
                    *(uint4*)(sw + swizzled(row, chunk + j)) = out;
                }
            } else {
                // Two words hold 8 codes: one chunk.
#pragma unroll
                for (int j = 0; j < L::WORDS / 2; j++) {
                    uint4 out = make_uint4(dequant_pair<8>(words[2 * j], 0, s, b), dequant_pair<8>(words[2 * j], 2, s, b),
                                           dequant_pair<8>(words[2 * j + 1], 0, s, b),
                                           dequant_pair<8>(words[2 * j + 1], 2, s, b));
                    *(uint4*)(sw + swizzled(row, chunk + j)) = out;
                }
            }
        }
    }
}

// One block's tile: Y[y_row0 + i, y_col0 + j] = Σ_k X[row i] · W[w_row0 + j] for i < m_valid,
// j < n_valid. X row i is x_row0 + i, or gather[x_row0 + i] when gather is given; X rows have K
// values (K = w.cols). Warps are laid out (BM / 64) × (BN / 32), each computing 64 × 32.
template <int BITS, int BM, int BN>
__device__ __forceinline__ void gemm_tile(const Mat& w, long w_row0, int n_valid, const float* __restrict__ x,
                                          const int* __restrict__ gather, long x_row0, int m_valid,
                                          float* __restrict__ y, long y_row0, long ldy, long y_col0) {
    static_assert((BM / 64) * (BN / 32) * WARP == GEMM_THREADS, "one 64 x 32 warp tile per warp");
    __shared__ __align__(16) u16 sx[2][BM * GEMM_BK];
    __shared__ __align__(16) u16 sw[2][BN * GEMM_BK];

    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int K = w.cols;
    const bool x_vec = ((unsigned long long)x & 15) == 0 && K % 4 == 0;
    const bool w_vec = ((unsigned long long)w.w & 15) == 0 && K % 4 == 0;

    constexpr int XP = XLoad<BM>::PIECES;
    const float* x_rows[XP];
#pragma unroll
    for (int i = 0; i < XP; i++) {
        int r = (tid + GEMM_THREADS * i) / 4;
        long src = gather != nullptr ? (long)gather[x_row0 + min(r, m_valid - 1)] : x_row0 + r;
        x_rows[i] = r < m_valid ? x + src * K : nullptr;
    }
    const int x_col = (tid % 4) * 8;

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

    XLoad<BM> xl;
    WLoad<BITS, BN> wl;
    const int steps = (K + GEMM_BK - 1) / GEMM_BK;
    load_x<BM>(xl, x_rows, x_col, K, x_vec);
    load_w<BITS, BN>(wl, w, w_row0, n_valid, 0, w_vec, tid);
    store_x<BM>(xl, sx[0], tid);
    store_w<BITS, BN>(wl, sw[0], tid);
    __syncthreads();

    const int wm = (warp / (BN / 32)) * 64, wn = (warp % (BN / 32)) * 32;
    for (int step = 0; step < steps; step++) {
        const int buf = step & 1;
        const bool more = step + 1 < steps;
        if (more) {
            int k = (step + 1) * GEMM_BK;
            load_x<BM>(xl, x_rows, k + x_col, K, x_vec);
            load_w<BITS, BN>(wl, w, w_row0, n_valid, k, w_vec, tid);
        }
        const u16* tx = sx[buf];
        const u16* tw = sw[buf];
#pragma unroll
        for (int ks = 0; ks < GEMM_BK / 16; ks++) {
            u32 a[4][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                // Matrices: rows 0-7 / 8-15 at k 0-7, then the same at k 8-15 (a0..a3).
                int row = wm + 16 * i + (lane % 8) + ((lane / 8) % 2) * 8;
                ldmatrix_x4(a[i], tx + swizzled(row, 2 * ks + lane / 16));
            }
#pragma unroll
            for (int j = 0; j < 2; j++) {
                // Matrices: n 0-7 at k 0-7 / k 8-15 (b0, b1 of one n8 tile), then n 8-15.
                int row = wn + 16 * j + (lane % 8) + (lane / 16) * 8;
                u32 r[4];
                ldmatrix_x4(r, tw + swizzled(row, 2 * ks + (lane / 8) % 2));
                b[2 * j][0] = r[0];
                b[2 * j][1] = r[1];
                b[2 * j + 1][0] = r[2];
                b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16(acc[i][j], a[i], b[j][0], b[j][1]);
        }
        if (more) {
            // The other buffer was last read in the previous step, before its closing barrier.
            store_x<BM>(xl, sx[buf ^ 1], tid);
            store_w<BITS, BN>(wl, sw[buf ^ 1], tid);
        }
        __syncthreads();
    }

    // Accumulator c of mma tile (i, j): row lane/4 (+8 for c ≥ 2), column 2·(lane%4) + c%2.
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = wm + 16 * i + lane / 4 + 8 * h;
            if (row >= m_valid) continue;
            float* out = y + (y_row0 + row) * ldy + y_col0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int col = wn + 8 * j + 2 * (lane % 4);
                if (col < n_valid) out[col] = acc[i][j][2 * h];
                if (col + 1 < n_valid) out[col + 1] = acc[i][j][2 * h + 1];
            }
        }
    }
}

// Dense: Y[r, col0 + n] = Σ_k X[r, k] · W[n, k] for r < m, n < w.rows. Grid (⌈w.rows/128⌉, ⌈m/128⌉).
#define GEMM_DENSE(BITS)                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)                                     \
        gemm_b##BITS(Mat w, const float* x, int m, float* y, int ldy, int col0) {                    \
        int n0 = blockIdx.x * GEMM_DENSE_BN;                                                         \
        long r0 = (long)blockIdx.y * GEMM_DENSE_BM;                                                  \
        gemm_tile<BITS, GEMM_DENSE_BM, GEMM_DENSE_BN>(w, n0, min(GEMM_DENSE_BN, w.rows - n0), x, nullptr, r0, \
                                                      (int)min((long)GEMM_DENSE_BM, m - r0), y, r0, ldy,      \
                                                      (long)col0 + n0);                                       \
    }

// Grouped (MoE experts): w stacks experts of n rows each. Tile t = tiles[3t..3t+3] = {expert,
// first sorted slot, rows}; blocks past *num_tiles return (the host sizes the grid for the worst
// case). Slot s reads X row gather[s] (or s) and writes y[s, 0..n). Grid (⌈n/256⌉, max tiles).
#define GEMM_GROUPED(BITS)                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)                                     \
        gemm_grouped_b##BITS(Mat w, int n, const float* x, const int* gather, const int* tiles,      \
                             const int* num_tiles, float* y) {                                       \
        int t = blockIdx.y;                                                                          \
        if (t >= *num_tiles) return;                                                                 \
        int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], GEMM_GROUPED_BM); \
        int n0 = blockIdx.x * GEMM_GROUPED_BN;                                                       \
        /* A tile naming an expert past the stack would read beyond the weight. */                  \
        if (expert < 0 || (long)(expert + 1) * n > w.rows || rows <= 0) return;                      \
        gemm_tile<BITS, GEMM_GROUPED_BM, GEMM_GROUPED_BN>(w, (long)expert * n + n0, min(GEMM_GROUPED_BN, n - n0), x, \
                                                          gather, slot0, rows, y, slot0, n, n0);               \
    }

GEMM_DENSE(4)
GEMM_DENSE(8)
GEMM_DENSE(32)
GEMM_GROUPED(4)
GEMM_GROUPED(8)
GEMM_GROUPED(32)
