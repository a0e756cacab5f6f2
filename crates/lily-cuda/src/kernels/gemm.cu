// Y = X · Wᵀ on the tensor cores for prefill: X is f32 activations [rows, K], W a weight as stored
// (4- or 8-bit MLX affine codes, or dense f32). Both are rounded to bf16 on their way into shared
// memory (W dequantised there, w = scale·code + bias in f32, then rounded), so a bf16 copy of a
// weight never exists in global memory; products accumulate in f32 (mma m16n8k16, sm_80+).
//
// A block computes a GEMM_BM × GEMM_BN tile of Y: 8 warps as 2 (rows) × 4 (columns), each
// 32 × 32 (2 × 4 mma tiles). K advances GEMM_BK at a time through two shared buffers: the global
// loads of step k+1 are issued into registers before the mma work of step k and converted into
// the other buffer after it, so their latency hides behind the arithmetic and one barrier per
// step suffices. Shared tiles are rows of 64 bf16 (8 chunks of 16 bytes) with chunk c of row r
// stored at c ^ (r % 8): the 8 rows an ldmatrix reads at one logical chunk, and the chunks a
// quarter-warp stores, fall in 8 different bank groups.

#define GEMM_BM 64
#define GEMM_BN 128
#define GEMM_BK 64
#define GEMM_THREADS 256

static_assert(GEMM_BM == MOE_TILE, "a grouped tile (MOE_TILE rows) must be one block's rows");

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    // cvt puts its first source in the upper half; rounds to nearest even like f32_to_bf16.
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Element offset of (row, 16-byte chunk) in a swizzled shared tile.
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * GEMM_BK + ((chunk ^ (row & 7)) << 3);
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

// This thread's share of one X tile (GEMM_BM × GEMM_BK f32): two chunks of 8 values, rows
// tid/8 and tid/8 + 32, columns (tid%8)·8 .. +8 of the step.
struct XLoad {
    float v[2][8];
};

// The source rows of this thread's two X chunks (null: the row is past the block's rows).
// Vector loads need 16-byte aligned rows: the caller checks x and K.
__device__ __forceinline__ void load_x(XLoad& r, const float* const (&rows)[2], int k, int K, bool vec) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
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

__device__ __forceinline__ void store_x(const XLoad& r, u16* sx, int tid) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const float* v = r.v[i];
        uint4 q = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                             pack_bf16x2(v[6], v[7]));
        *(uint4*)(sx + swizzled(tid / 8 + 32 * i, tid % 8)) = q;
    }
}

// This thread's share of one W tile (GEMM_BN rows × GEMM_BK columns), as loaded from global
// memory: 16-byte chunks of codes (or f32 values) with their group's scale and bias.
//  4-bit: 1 chunk of 32 codes: row tid/2, columns (tid%2)·32 .. +32.
//  8-bit: 2 chunks of 16 codes: chunk c = tid + 256·i is row c/4, columns (c%4)·16 .. +16.
// 32-bit: 4 pieces of 8 values: piece c = tid + 256·i is row c/8, columns (c%8)·8 .. +8.
template <int BITS>
struct WLoad {
    static constexpr int CHUNKS = BITS == 4 ? 1 : BITS == 8 ? 2 : 4;
    uint4 q[BITS == 32 ? 2 * CHUNKS : CHUNKS];
    float scale[CHUNKS], bias[CHUNKS];
};

template <int BITS>
__device__ __forceinline__ void chunk_place(int tid, int i, int& row, int& col) {
    if constexpr (BITS == 4) {
        row = tid / 2;
        col = (tid % 2) * 32;
    } else if constexpr (BITS == 8) {
        int c = tid + GEMM_THREADS * i;
        row = c / 4;
        col = (c % 4) * 16;
    } else {
        int c = tid + GEMM_THREADS * i;
        row = c / 8;
        col = (c % 8) * 8;
    }
}

// Rows [row0, row0 + n_valid) of w feed this block; rows past n_valid and columns past K load
// as zero. For codes, K is a multiple of the group (≥ 32 for 4-bit, ≥ 16 for 8-bit, checked by
// the launcher), so a chunk never straddles a group or the end of a row.
template <int BITS>
__device__ __forceinline__ void load_w(WLoad<BITS>& r, const Mat& w, long row0, int n_valid, int k, bool vec,
                                       int tid) {
    const int K = w.cols;
#pragma unroll
    for (int i = 0; i < WLoad<BITS>::CHUNKS; i++) {
        int row, col;
        chunk_place<BITS>(tid, i, row, col);
        int kk = k + col;
        bool live = row < n_valid && kk < K;
        long wr = row0 + row;
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
            r.q[2 * i] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                                    __float_as_uint(v[3]));
            r.q[2 * i + 1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                                        __float_as_uint(v[7]));
        } else {
            r.q[i] = make_uint4(0u, 0u, 0u, 0u);
            r.scale[i] = 0.f;
            r.bias[i] = 0.f;
            if (live) {
                const char* codes = (const char*)w.w + wr * K * BITS / 8;
                r.q[i] = *(const uint4*)(codes + (long)kk * BITS / 8);
                long g = wr * (K / w.group) + kk / w.group;
                r.scale[i] = bf16_to_f32(w.scales[g]);
                r.bias[i] = bf16_to_f32(w.biases[g]);
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

template <int BITS>
__device__ __forceinline__ void store_w(const WLoad<BITS>& r, u16* sw, int tid) {
#pragma unroll
    for (int i = 0; i < WLoad<BITS>::CHUNKS; i++) {
        int row, col;
        chunk_place<BITS>(tid, i, row, col);
        if constexpr (BITS == 32) {
            // A piece of 8 values (two f32 float4s) becomes one 16-byte bf16 chunk.
            const uint4 a = r.q[2 * i], b = r.q[2 * i + 1];
            uint4 out = make_uint4(pack_bf16x2(__uint_as_float(a.x), __uint_as_float(a.y)),
                                   pack_bf16x2(__uint_as_float(a.z), __uint_as_float(a.w)),
                                   pack_bf16x2(__uint_as_float(b.x), __uint_as_float(b.y)),
                                   pack_bf16x2(__uint_as_float(b.z), __uint_as_float(b.w)));
            *(uint4*)(sw + swizzled(row, col / 8)) = out;
        } else {
            const u32 words[4] = {r.q[i].x, r.q[i].y, r.q[i].z, r.q[i].w};
            const float s = r.scale[i], b = r.bias[i];
            if constexpr (BITS == 4) {
                // A word holds 8 codes: one 16-byte chunk of bf16.
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    uint4 out = make_uint4(dequant_pair<4>(words[j], 0, s, b), dequant_pair<4>(words[j], 2, s, b),
                                           dequant_pair<4>(words[j], 4, s, b), dequant_pair<4>(words[j], 6, s, b));
                    *(uint4*)(sw + swizzled(row, col / 8 + j)) = out;
                }
            } else {
                // Two words hold 8 codes: one chunk.
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    uint4 out = make_uint4(dequant_pair<8>(words[2 * j], 0, s, b), dequant_pair<8>(words[2 * j], 2, s, b),
                                           dequant_pair<8>(words[2 * j + 1], 0, s, b),
                                           dequant_pair<8>(words[2 * j + 1], 2, s, b));
                    *(uint4*)(sw + swizzled(row, col / 8 + j)) = out;
                }
            }
        }
    }
}

// One block's tile: Y[y_row0 + i, y_col0 + j] = Σ_k X[row i] · W[w_row0 + j] for i < m_valid,
// j < n_valid. X row i is x_row0 + i, or gather[x_row0 + i] when gather is given; X rows have K
// values (K = w.cols).
template <int BITS>
__device__ __forceinline__ void gemm_tile(const Mat& w, long w_row0, int n_valid, const float* __restrict__ x,
                                          const int* __restrict__ gather, long x_row0, int m_valid,
                                          float* __restrict__ y, long y_row0, long ldy, long y_col0) {
    __shared__ __align__(16) u16 sx[2][GEMM_BM * GEMM_BK];
    __shared__ __align__(16) u16 sw[2][GEMM_BN * GEMM_BK];

    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int K = w.cols;
    const bool x_vec = ((unsigned long long)x & 15) == 0 && K % 4 == 0;
    const bool w_vec = ((unsigned long long)w.w & 15) == 0 && K % 4 == 0;

    const float* x_rows[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = tid / 8 + 32 * i;
        long src = gather != nullptr ? (long)gather[x_row0 + min(r, m_valid - 1)] : x_row0 + r;
        x_rows[i] = r < m_valid ? x + src * K : nullptr;
    }

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

    XLoad xl;
    WLoad<BITS> wl;
    const int steps = (K + GEMM_BK - 1) / GEMM_BK;
    load_x(xl, x_rows, (tid % 8) * 8, K, x_vec);
    load_w<BITS>(wl, w, w_row0, n_valid, 0, w_vec, tid);
    store_x(xl, sx[0], tid);
    store_w<BITS>(wl, sw[0], tid);
    __syncthreads();

    const int wm = (warp / 4) * 32, wn = (warp % 4) * 32;
    for (int step = 0; step < steps; step++) {
        const int buf = step & 1;
        const bool more = step + 1 < steps;
        if (more) {
            int k = (step + 1) * GEMM_BK;
            load_x(xl, x_rows, k + (tid % 8) * 8, K, x_vec);
            load_w<BITS>(wl, w, w_row0, n_valid, k, w_vec, tid);
        }
        const u16* tx = sx[buf];
        const u16* tw = sw[buf];
#pragma unroll
        for (int ks = 0; ks < GEMM_BK / 16; ks++) {
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
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
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16(acc[i][j], a[i], b[j][0], b[j][1]);
        }
        if (more) {
            // The other buffer was last read in the previous step, before its closing barrier.
            store_x(xl, sx[buf ^ 1], tid);
            store_w<BITS>(wl, sw[buf ^ 1], tid);
        }
        __syncthreads();
    }

    // Accumulator c of mma tile (i, j): row lane/4 (+8 for c ≥ 2), column 2·(lane%4) + c%2.
#pragma unroll
    for (int i = 0; i < 2; i++) {
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

// Dense: Y[r, col0 + n] = Σ_k X[r, k] · W[n, k] for r < m, n < w.rows. Grid (⌈w.rows/BN⌉, ⌈m/BM⌉).
#define GEMM_DENSE(BITS)                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                       \
        gemm_b##BITS(Mat w, const float* x, int m, float* y, int ldy, int col0) {                    \
        pdl_wait();                                                                                  \
        int n0 = blockIdx.x * GEMM_BN;                                                               \
        long r0 = (long)blockIdx.y * GEMM_BM;                                                        \
        gemm_tile<BITS>(w, n0, min(GEMM_BN, w.rows - n0), x, nullptr, r0, (int)min((long)GEMM_BM, m - r0), y, \
                        r0, ldy, (long)col0 + n0);                                                   \
    }

// Grouped (MoE experts): w stacks experts of n rows each. Tile t = tiles[3t..3t+3] = {expert,
// first sorted slot, rows}; blocks past *num_tiles return (the host sizes the grid for the worst
// case). Slot s reads X row gather[s] (or s) and writes y[s, 0..n). Grid (⌈n/BN⌉, max tiles).
#define GEMM_GROUPED(BITS)                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                       \
        gemm_grouped_b##BITS(Mat w, int n, const float* x, const int* gather, const int* tiles,      \
                             const int* num_tiles, float* y) {                                       \
        pdl_wait();                                                                                  \
        int t = blockIdx.y;                                                                          \
        if (t >= *num_tiles) return;                                                                 \
        int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], GEMM_BM);  \
        int n0 = blockIdx.x * GEMM_BN;                                                               \
        /* A tile naming an expert past the stack would read beyond the weight. */                  \
        if (expert < 0 || (long)(expert + 1) * n > w.rows || rows <= 0) return;                      \
        gemm_tile<BITS>(w, (long)expert * n + n0, min(GEMM_BN, n - n0), x, gather, slot0, rows, y, slot0, n, n0); \
    }

GEMM_DENSE(4)
GEMM_DENSE(8)
GEMM_DENSE(32)
GEMM_GROUPED(4)
GEMM_GROUPED(8)
GEMM_GROUPED(32)
