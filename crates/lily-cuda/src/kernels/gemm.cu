// Y = X · Wᵀ on the tensor cores for prefill: X is f32 activations [rows, K], W a weight as stored
// (4- or 8-bit MLX affine codes, or dense f32). Both are rounded to bf16 on their way into shared
// memory (W dequantised there, w = scale·code + bias in f32, then rounded), so a bf16 copy of a
// weight never exists in global memory; products accumulate in f32 (mma m16n8k16, sm_80+).
//
// A block computes a BM × BN tile of Y with 8 warps, each a 64 × 32 tile (4 × 4 mma tiles: per
// 16 columns of K, 4 ldmatrix of X and 2 of W feed 16 mma). Dense: BM = BN = 128, warps 2 (rows)
// × 4 (columns). Grouped: BM = MOE_TILE = 64 (routing cuts tiles of 64 rows), BN = 256, warps
// 1 × 8. K advances GEMM_BK at a time.
//
// X (f32) streams in by cp.async through a ring of GEMM_XS stages in shared memory, GEMM_XS − 1
// steps ahead of the mma work, costing no registers while in flight. Each thread copies and later
// converts the same pieces (8 values of one row), so a ring slot is private to its thread: the
// thread's own cp.async.wait_group makes it readable, with no barrier. The thread rounds its
// pieces to bf16 into the block's X tile. W (codes, 4-8 bits a value) is loaded into registers one
// step ahead and dequantised into the W tile. The bf16 tiles are double-buffered: step k's mma
// work reads one while the threads fill the other for step k+1, so one barrier per step suffices.
// Shared tiles are rows of 32 bf16 (4 chunks of 16 bytes) with chunk c of row r stored at
// c ^ ((r / 2) % 4): the 8 rows an ldmatrix reads at one logical chunk, and the chunks a
// quarter-warp stores, fall in 8 different bank groups. Shared memory is dynamic (more than the
// 48 KiB static limit): gemm.rs sizes it by the same formula as gemm_shared_bytes below.

#define GEMM_BK 32
#define GEMM_THREADS 256
#define GEMM_DENSE_BM 128
#define GEMM_DENSE_BN 128
#define GEMM_GROUPED_BM 64
#define GEMM_GROUPED_BN 256
#define GEMM_XS 3

// Dynamic shared memory of a block: the X ring (f32) then two bf16 X tiles and two bf16 W tiles.
__host__ __device__ constexpr int gemm_shared_bytes(int bm, int bn) {
    return GEMM_XS * bm * GEMM_BK * 4 + 2 * (bm + bn) * GEMM_BK * 2;
}

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

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int bytes) {
    // Bytes past `bytes` (16 or 0) are written as zeros; src is not read when bytes is 0.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// This thread's share of one X tile (BM × GEMM_BK f32): BM / 64 pieces of 8 values; piece
// c = tid + 256·i is row c/4, columns (c%4)·8 .. +8 of the step. In a ring slot, half h (4 values)
// of piece i is float4 number (2·i + h)·256 + tid: a quarter-warp's 16-byte accesses are
// contiguous, so neither the copies nor the reads conflict.
template <int BM>
struct XPieces {
    static constexpr int PIECES = BM * GEMM_BK / 8 / GEMM_THREADS;
    static constexpr int SLOT_FLOATS = BM * GEMM_BK;
};

// Issues the copies of this thread's pieces of the X step at column k into ring slot `slot`
// (f32). rows[i] is the source row of piece i (null past the block's rows: zeros). Columns past K
// are zeros (their copies name `x`, any valid global address, and read nothing). vec: x rows and K allow 16-byte copies (K % 4 == 0, so a float4 is wholly inside
// the row or wholly past it); otherwise 4-byte copies (x rows are only 4-byte aligned).
template <int BM>
__device__ __forceinline__ void copy_x(float* slot, const float* const (&rows)[XPieces<BM>::PIECES], const float* x,
                                       int k, int K, bool vec, int tid) {
#pragma unroll
    for (int i = 0; i < XPieces<BM>::PIECES; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int kk = k + 4 * h;
            float* dst = slot + ((2 * i + h) * GEMM_THREADS + tid) * 4;
            const float* src = rows[i] != nullptr ? rows[i] + kk : nullptr;
            if (vec) {
                bool live = src != nullptr && kk < K;
                cp_async_16(shared_address(dst), live ? src : x, live ? 16 : 0);
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    bool live = src != nullptr && kk + j < K;
                    cp_async_4(shared_address(dst + j), live ? src + j : x, live ? 4 : 0);
                }
            }
        }
    }
}

// Rounds this thread's pieces of ring slot `slot` (its own copies, complete) to bf16 in sx.
template <int BM>
__device__ __forceinline__ void convert_x(const float* slot, u16* sx, int tid) {
#pragma unroll
    for (int i = 0; i < XPieces<BM>::PIECES; i++) {
        const float4 p = *(const float4*)(slot + ((2 * i) * GEMM_THREADS + tid) * 4);
        const float4 q = *(const float4*)(slot + ((2 * i + 1) * GEMM_THREADS + tid) * 4);
        uint4 out = make_uint4(pack_bf16x2(p.x, p.y), pack_bf16x2(p.z, p.w), pack_bf16x2(q.x, q.y),
                               pack_bf16x2(q.z, q.w));
        int c = tid + GEMM_THREADS * i;
        *(uint4*)(sx + swizzled(c / 4, c % 4)) = out;
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
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    float* ring = (float*)gemm_smem;
    u16* sx = (u16*)(ring + GEMM_XS * XPieces<BM>::SLOT_FLOATS);  // [2][BM * GEMM_BK]
    u16* sw = sx + 2 * BM * GEMM_BK;                                // [2][BN * GEMM_BK]

    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    {
        // The launcher must give the block gemm_shared_bytes(BM, BN): trap rather than overrun.
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)gemm_shared_bytes(BM, BN)) __trap();
    }
    const int K = w.cols;
    const bool x_vec = ((unsigned long long)x & 15) == 0 && K % 4 == 0;
    const bool w_vec = ((unsigned long long)w.w & 15) == 0 && K % 4 == 0;

    constexpr int XP = XPieces<BM>::PIECES;
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

    WLoad<BITS, BN> wl;
    const int steps = (K + GEMM_BK - 1) / GEMM_BK;
    // Prologue: X steps 0 .. XS-2 in flight (one commit group each, empty past the last step).
#pragma unroll
    for (int s = 0; s < GEMM_XS - 1; s++) {
        if (s < steps) copy_x<BM>(ring + s * XPieces<BM>::SLOT_FLOATS, x_rows, x, s * GEMM_BK + x_col, K, x_vec, tid);
        cp_async_commit();
    }
    load_w<BITS, BN>(wl, w, w_row0, n_valid, 0, w_vec, tid);
    cp_async_wait<GEMM_XS - 2>();  // step 0's group is complete
    convert_x<BM>(ring, sx, tid);
    store_w<BITS, BN>(wl, sw, tid);
    __syncthreads();

    const int wm = (warp / (BN / 32)) * 64, wn = (warp % (BN / 32)) * 32;
    for (int step = 0; step < steps; step++) {
        const int buf = step & 1;
        const bool more = step + 1 < steps;
        {
            // X step + XS − 1 into the slot of step − 1, which this thread converted in the
            // previous iteration (slots are private to their thread: no barrier is needed).
            const int s = step + GEMM_XS - 1;
            if (s < steps)
                copy_x<BM>(ring + (s % GEMM_XS) * XPieces<BM>::SLOT_FLOATS, x_rows, x, s * GEMM_BK + x_col, K, x_vec,
                           tid);
            cp_async_commit();
        }
        if (more) load_w<BITS, BN>(wl, w, w_row0, n_valid, (step + 1) * GEMM_BK, w_vec, tid);
        const u16* tx = sx + buf * BM * GEMM_BK;
        const u16* tw = sw + buf * BN * GEMM_BK;
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
            // Groups committed: steps 0 .. step + XS − 1; step + 1's is complete when at most
            // XS − 2 are pending. The other bf16 buffers were last read in the previous step,
            // before its closing barrier.
            cp_async_wait<GEMM_XS - 2>();
            convert_x<BM>(ring + ((step + 1) % GEMM_XS) * XPieces<BM>::SLOT_FLOATS, sx + (buf ^ 1) * BM * GEMM_BK,
                          tid);
            store_w<BITS, BN>(wl, sw + (buf ^ 1) * BN * GEMM_BK, tid);
        }
        __syncthreads();
    }
    cp_async_wait<0>();  // no copy may land after the block's shared memory is reused

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
