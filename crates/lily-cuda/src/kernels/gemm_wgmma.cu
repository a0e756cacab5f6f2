// Y = X · Wᵀ for prefill on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a only), for 4-bit
// weights: exactly what gemm.cu's gemm_b4 and gemm_grouped64_b4 compute, with the same arguments
// (X rounded to bf16, w = bf16(scale·code + bias) rounded once, products summed in f32); gemm.rs
// picks this file's entries on sm_90 (GemmPath). It takes weights in groups of a power of two (32 or more),
// four or more groups a row (gemm_wgmma.rs, `takes`: the model's all are), so every step of
// GEMM_WG_BK = 64 columns is whole and no load needs a column check. 8-bit and f32 weights, other
// 4-bit ones and the 16-row expert tiles keep gemm.cu.
//
// Why: gemm.cu is bound by the SM's L1/shared data pipe, which its ldmatrix operand reads share
// with the tile stores and the global loads. wgmma reads both operands from shared memory itself,
// with no ldmatrix, and a warpgroup reads a W tile once per 64 rows of X.
//
// A block is two warpgroups (256 threads) and 256 weight rows (output columns). Dense: 128 rows of
// X, warpgroup g computes rows 64g..64g+63 as m64n256 (128 f32 accumulators a thread, one block an
// SM). Grouped (moe_sort's 64-row tiles): warpgroup g computes the tile's 64 rows at columns
// 128g..128g+127 as m64n128 (64 accumulators, at most 128 registers so that two blocks share an
// SM and hide each other's barriers and load latency). A warpgroup with no live rows (dense) or
// columns (grouped) issues no wgmma.
//
// X is wgmma's A and W its B, both bf16 in shared memory and K-major: a step is 128 bytes a row,
// stored with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), so a quarter-warp's
// 16-byte stores and the tensor cores' reads hit distinct banks. The matrix descriptor (PTX ISA,
// "Matrix Descriptor Format"): start address >> 4 in bits 0-13; leading byte offset in 16-29,
// unused by swizzled K-major layouts (1 by convention); stride byte offset >> 4 in 32-45, 1024 =
// the 8 rows × 128 bytes between 8-row groups; swizzle mode 1 (128-byte) in 62-63. Tiles start at
// 1024-byte boundaries, where the swizzle pattern repeats, so the base offset is 0, and the k16
// slices of a step are 32 bytes apart in the start address (the hardware swizzles the address it
// forms).
//
// Two stages. In step s each warpgroup first issues the four k16 wgmma of step s (one commit
// group); while the tensor cores work, every thread loads step s+1 into registers and converts it
// (X rounded, W dequantised) into the other stage. One step ahead is what the registers allow (a
// dense thread's accumulators take 128 of them). The stores are generic-proxy writes that wgmma
// reads through the async proxy: each thread fences (fence.proxy.async) before the barrier that
// ends the step, and waits for its warpgroup's wgmma (wgmma.wait_group 0) before it, so the stage
// just read is free for the next step's stores.
//
// Global loads follow gemm.cu: a warp's X load is 2 rows × 256 bytes (whole lines); a W row's 32
// bytes of codes a step are one load by two lanes, and the scales and biases of a row are loaded
// four groups at a time (8 bytes) when the step enters a new window of groups.

#define GEMM_WG_BK 64
#define GEMM_WG_THREADS 256
#define GEMM_WG_BN 256
#define GEMM_WG_DENSE_BM 128
#define GEMM_WG_GROUPED_BM 64

// Dynamic shared memory of a block of BM rows: two X tiles, two W tiles (128 bytes a row), and
// 1024 bytes to align the first tile to 1024.
__host__ __device__ constexpr int gemm_wgmma_shared_bytes(int bm) { return 2 * (bm + GEMM_WG_BN) * 128 + 1024; }

__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void st_shared_v2(u32 address, u32 a, u32 b) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(address), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ void st_shared_v4(u32 address, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// v, hidden from the optimiser here: what a step computes from it (row addresses) is recomputed
// every step instead of hoisted out of the loop into registers, which the accumulators need (the
// grouped entry spilled in its loop without it).
__device__ __forceinline__ int opaque(int v) {
    asm volatile("" : "+r"(v));
    return v;
}

__device__ __forceinline__ long opaque(long v) {
    asm volatile("" : "+l"(v));
    return v;
}

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile.
__device__ __forceinline__ u32 swizzle128(int row, int chunk) {
    return (u32)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// The descriptor of a K-major, 128-byte-swizzled tile at shared address `address` (see above).
__device__ __forceinline__ unsigned long long tile_descriptor(u32 address) {
    return (unsigned long long)((address & 0x3ffffu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Orders this thread's generic-proxy shared stores before async-proxy (wgmma) reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Pins the accumulators at this point of the program: the compiler may not move their reads or
// writes across it (they belong to in-flight wgmma between issue and wait).
template <int N>
__device__ __forceinline__ void pin_accumulators(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

#define WG_ACC8(d, i)                                                                  \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC32(d, i) WG_ACC8(d, i), WG_ACC8(d, i + 8), WG_ACC8(d, i + 16), WG_ACC8(d, i + 24)
#define WG_REGS_0_63                                                                   \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS_64_127                                                                                  \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                  \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                  \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "      \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d += A · B for one k16 slice: A 64 × 16 and B N × 16 bf16 (both K-major) at descriptors a and
// b. The scale-d predicate is set (accumulate; the accumulators start at zero); A and B are
// neither negated (1, 1) nor transposed (0, 0).
__device__ __forceinline__ void wgmma_m64n128(float (&d)[64], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS_0_63 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC32(d, 0), WG_ACC32(d, 32)
        : "l"(a), "l"(b), "r"(1)
        : "memory");
}

__device__ __forceinline__ void wgmma_m64n256(float (&d)[128], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WG_REGS_0_63 ", " WG_REGS_64_127
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC32(d, 0), WG_ACC32(d, 32), WG_ACC32(d, 64), WG_ACC32(d, 96)
        : "l"(a), "l"(b), "r"(1)
        : "memory");
}

// Where this thread's X comes from. Piece i of a step is row tid/16 + 16·i, float4 tid % 16 of the
// step's 64 columns: a warp's load of one piece is 2 rows × 256 contiguous bytes. Pieces i < live
// are rows of the block (the rest load zeros). Gathered rows keep their row index a piece (fewer
// registers than pointers); contiguous rows one pointer, piece i being 16·i rows on.
template <int BM, bool GATHER>
struct WgXRows {
    static constexpr int PIECES = BM / 16;
    const float* first;
    int index[GATHER ? PIECES : 1];
    int live;
};

// Loads this thread's live pieces at column k (its own float4 of the step). vec: x is 16-byte
// aligned, and so is every row (K % 128 == 0).
template <int BM, bool GATHER>
__device__ __forceinline__ void wg_load_x(float4 (&v)[BM / 16], const WgXRows<BM, GATHER>& rows, int k, long K,
                                          bool vec) {
    const float* src = rows.first + k;
    const long row_stride = opaque(16 * K);
#pragma unroll
    for (int i = 0; i < BM / 16; i++) {
        float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < rows.live) {
            const float* at = GATHER ? src + opaque(rows.index[i]) * K : src;
            if (vec) {
                r = *(const float4*)at;
            } else {
                r.x = at[0]; r.y = at[1]; r.z = at[2]; r.w = at[3];
            }
        }
        v[i] = r;
        if (!GATHER) src += row_stride;
    }
}

// Rounds the pieces to bf16 into an X tile at shared address `at`: piece 0 at row tid/16, half
// tid%2 of chunk (tid%16)/2; piece i 16 rows on (2,048 bytes), where rows swizzle alike. A
// half-warp stores one whole 128-byte row.
template <int BM>
__device__ __forceinline__ void wg_store_x(const float4 (&v)[BM / 16], u32 at) {
#pragma unroll
    for (int i = 0; i < BM / 16; i++)
        st_shared_v2(at + 2048 * i, pack_bf16x2(v[i].x, v[i].y), pack_bf16x2(v[i].z, v[i].w));
}

// This thread's share of a W tile (256 rows × 64 codes a step): rows tid/2 and tid/2 + 128, codes
// 32·(tid%2) .. +32 of the step, 16 bytes each, in one group. A warp's load is 16 rows × 32
// bytes. With the codes, the bf16 scales and biases of a window of four groups (one 8-byte load
// each), loaded when the codes enter a new window; `sub` is the codes' group within it. Groups are
// powers of two, so windows follow from the column by shifts, with no state carried from step to
// step.
struct WgWLoad {
    uint4 q[2];
    u32 scales[2][2], biases[2][2];
    int sub;
};

// Loads step k of rows [row0, row0 + n_valid) of w; a row past n_valid loads as zero codes,
// scales and biases (w = 0). group_shift: log2 of the group; first: the block's first step (its
// windows load).
__device__ __forceinline__ void wg_load_w(WgWLoad& r, const Mat& w, long row0, int n_valid, int k, int groups,
                                          int group_shift, bool first) {
    const int row = threadIdx.x / 2, kk = k + 32 * (threadIdx.x % 2);
    const int window_shift = group_shift + 2;
    const bool reload = first || (kk >> window_shift) != ((kk - GEMM_WG_BK) >> window_shift);
    const int base = (kk >> window_shift) << 2;
    r.sub = (kk >> group_shift) - base;
    // Row tid/2's codes at this step; row tid/2 + 128 is 128 rows on.
    const char* codes = (const char*)w.w + (opaque(row0) + row) * (w.cols / 2) + kk / 2;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int rj = row + 128 * j;
        if (rj < n_valid) {
            r.q[j] = *(const uint4*)(codes + (j == 0 ? 0 : opaque(128L * (w.cols / 2))));
            if (reload) {
                const long g = (opaque(row0) + rj) * groups + base;
                const uint2 s = *(const uint2*)(w.scales + g), b = *(const uint2*)(w.biases + g);
                r.scales[j][0] = s.x; r.scales[j][1] = s.y;
                r.biases[j][0] = b.x; r.biases[j][1] = b.y;
            }
        } else {
            r.q[j] = make_uint4(0u, 0u, 0u, 0u);
            r.scales[j][0] = r.scales[j][1] = 0u;
            r.biases[j][0] = r.biases[j][1] = 0u;
        }
    }
}

// Dequantises the two rows into the W tile at shared address `tile`. slot: this thread's first
// chunk (4·(tid%2) of row tid/2) in the tile; its chunk c is at slot ^ 16·c (the span starts at a
// multiple of 4 chunks and the swizzle is an XOR), and row tid/2 + 128 is 16 KiB on with the same
// swizzle.
__device__ __forceinline__ void wg_store_w(const WgWLoad& r, u32 tile, u32 slot) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const u32 s2 = window_pair(r.scales[j], r.sub), b2 = window_pair(r.biases[j], r.sub);
        const u32 words[4] = {r.q[j].x, r.q[j].y, r.q[j].z, r.q[j].w};
#pragma unroll
        for (int c = 0; c < 4; c++) st_shared_v4(tile + 16384 * j + (slot ^ (16 * c)), dequant_b4x8(words[c], s2, b2));
    }
}

// Writes a warpgroup's accumulators: Y[y_row0 + i, y_col0 + j] for the tile's rows i < m_valid
// and columns j < n_valid.
template <int BM>
__device__ __forceinline__ void wg_store_acc(const float (&acc)[BM == GEMM_WG_DENSE_BM ? GEMM_WG_BN / 2 : GEMM_WG_BN / 4],
                                             float* __restrict__ y, long y_row0, long ldy, long y_col0, int m_valid,
                                             int n_valid) {
    constexpr bool DENSE = BM == GEMM_WG_DENSE_BM;
    constexpr int WN = DENSE ? GEMM_WG_BN : GEMM_WG_BN / 2;
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid / WARP) % 4, lane = tid % WARP;
    // Accumulator 4j + 2h + e of a lane: row 16·warp + lane/4 + 8h of its warpgroup's rows, column
    // 8j + 2·(lane%4) + e of its columns. Pairs go out as one 8-byte store where aligned.
    const int row0 = (DENSE ? 64 * wg : 0) + 16 * warp + lane / 4;
    const int col_base = (DENSE ? 0 : WN * wg) + 2 * (lane % 4);
    // Every column of the warpgroup live and 8-byte-aligned pairs: unchecked pair stores.
    const bool fast = ((unsigned long long)(y + y_row0 * ldy + y_col0) & 7) == 0 && ldy % 2 == 0 &&
                      (DENSE ? 0 : WN * wg) + WN <= n_valid;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = row0 + 8 * h;
        if (row >= m_valid) continue;
        float* out = y + (y_row0 + row) * ldy + y_col0 + col_base;
        if (fast) {
#pragma unroll
            for (int j = 0; j < WN / 8; j++)
                *(float2*)(out + 8 * j) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        } else {
#pragma unroll
            for (int j = 0; j < WN / 8; j++) {
                const int col = col_base + 8 * j;
                if (col < n_valid) out[8 * j] = acc[4 * j + 2 * h];
                if (col + 1 < n_valid) out[8 * j + 1] = acc[4 * j + 2 * h + 1];
            }
        }
    }
}

// One block's tile: Y[y_row0 + i, y_col0 + j] = Σ_k X[row i] · W[w_row0 + j] for i < m_valid,
// j < n_valid, k in [k0, k1) (whole steps). X row i is x_row0 + i, or gather[x_row0 + i] when
// GATHER and gather is given; X rows have K = w.cols values; m_valid ≤ BM. BM 128: dense
// (warpgroups split the rows); BM 64: grouped (warpgroups split the columns).
template <int BM, bool GATHER>
__device__ __forceinline__ void wgmma_tile(const Mat& w, long w_row0, int n_valid, const float* __restrict__ x,
                                           const int* __restrict__ gather, long x_row0, int m_valid,
                                           float* __restrict__ y, long y_row0, long ldy, long y_col0, int k0,
                                           int k1) {
    static_assert(BM == GEMM_WG_DENSE_BM || BM == GEMM_WG_GROUPED_BM, "dense or grouped tiles");
    constexpr bool DENSE = BM == GEMM_WG_DENSE_BM;
    constexpr int WN = DENSE ? GEMM_WG_BN : GEMM_WG_BN / 2;  // a warpgroup's columns
    constexpr u32 X_BYTES = BM * 128, W_BYTES = GEMM_WG_BN * 128;
    extern __shared__ __align__(1024) unsigned char wg_smem[];

    const int tid = threadIdx.x, wg = tid / 128, warp = (tid / WARP) % 4, lane = tid % WARP;
    {
        // The launcher must give the block gemm_wgmma_shared_bytes(BM): trap rather than overrun.
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)gemm_wgmma_shared_bytes(BM)) __trap();
    }
    // [X stage 0][X stage 1][W stage 0][W stage 1], from the first 1024-byte boundary.
    const u32 sx = (shared_address(wg_smem) + 1023u) & ~1023u;
    const u32 sw = sx + 2 * X_BYTES;

    const int K = w.cols;
    const bool x_vec = ((unsigned long long)x & 15) == 0;
    const int groups = K / w.group;
    // The weights the launcher sends here (gemm_wgmma.rs, `takes`): groups a power of two and a
    // multiple of 4 of them a row (so K % 128 == 0 and every step is whole), 8-byte-aligned scales
    // and biases (the windows' loads); a block's columns whole steps.
    const unsigned long long windows = (unsigned long long)w.scales | (unsigned long long)w.biases;
    if ((w.group & (w.group - 1)) != 0 || w.group < 32 || groups % 4 != 0 || (windows & 7) != 0 ||
        (k1 - k0) % GEMM_WG_BK != 0)
        __trap();
    const int group_shift = 31 - __clz(w.group);

    constexpr int XP = BM / 16;
    WgXRows<BM, GATHER> x_rows;
    x_rows.first = GATHER ? x : x + (x_row0 + tid / 16) * K;
    x_rows.live = 0;
#pragma unroll
    for (int i = 0; i < XP; i++) {
        const int r = tid / 16 + 16 * i;
        if (r < m_valid) x_rows.live = i + 1;
        // Without a gather (the down projection reads the SwiGLU rows in slot order) slot s is
        // row s, as in gemm.cu.
        const long slot = x_row0 + min(r, m_valid - 1);
        if (GATHER) x_rows.index[i] = gather != nullptr ? gather[slot] : (int)slot;
    }
    const int x_col = 4 * (tid % 16);
    const u32 xs = swizzle128(tid / 16, (tid % 16) / 2) + 8 * (tid % 2);
    const u32 ws = swizzle128(tid / 2, 4 * (tid % 2));

    // Whether this warpgroup's rows (dense) or columns (grouped) hold anything to compute.
    const bool live = DENSE ? 64 * wg < m_valid : WN * wg < n_valid;
    const unsigned long long a_desc = tile_descriptor(sx + (DENSE ? wg * 64 * 128 : 0));
    const unsigned long long b_desc = tile_descriptor(sw + (DENSE ? 0 : wg * WN * 128));

    float acc[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; i++) acc[i] = 0.f;

    float4 xl[XP];
    WgWLoad wl;
    const int steps = (k1 - k0) / GEMM_WG_BK;
    wg_load_x<BM, GATHER>(xl, x_rows, k0 + x_col, K, x_vec);
    wg_load_w(wl, w, w_row0, n_valid, k0, groups, group_shift, true);
    wg_store_x<BM>(xl, sx + xs);
    wg_store_w(wl, sw, ws);
    fence_async_shared();
    __syncthreads();

    for (int step = 0; step < steps; step++) {
        const int stage = step & 1;
        const bool more = step + 1 < steps;
        if (live) {
            // Descriptor units are 16 bytes: a stage is X_BYTES (W_BYTES) on, a k16 slice 32 bytes.
            const unsigned long long a = a_desc + stage * (X_BYTES >> 4), b = b_desc + stage * (W_BYTES >> 4);
            pin_accumulators(acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < GEMM_WG_BK / 16; kk++) {
                if constexpr (DENSE)
                    wgmma_m64n256(acc, a + 2 * kk, b + 2 * kk);
                else
                    wgmma_m64n128(acc, a + 2 * kk, b + 2 * kk);
            }
            wgmma_commit();
        }
        if (more) {
            const int k = k0 + (step + 1) * GEMM_WG_BK;
            wg_load_x<BM, GATHER>(xl, x_rows, k + x_col, K, x_vec);
            wg_load_w(wl, w, w_row0, n_valid, k, groups, group_shift, false);
            // The other stage was last read by step − 1's wgmma, complete before its barrier.
            wg_store_x<BM>(xl, sx + (stage ^ 1) * X_BYTES + xs);
            wg_store_w(wl, sw + (stage ^ 1) * W_BYTES, ws);
            fence_async_shared();
        }
        wgmma_wait_all();
        pin_accumulators(acc);
        __syncthreads();
    }
    if (!live) return;
    wg_store_acc<BM>(acc, y, y_row0, ldy, y_col0, m_valid, n_valid);
}

// ---- X given as bf16 rows (the _x16 entries): every operand by cp.async, D steps ahead ----
//
// Why: with X in f32 a step's loads pass through registers, and the accumulators leave room for
// one step's only, so every step waits out a global round trip (W's codes from DRAM, X from L2)
// beside a few hundred cycles of tensor work; and every column block reads X from L2 at four
// bytes a value (a dense block: 32 KB of X against 8 KB of codes a step). When the producer
// writes X rounded to bf16 (the same round to nearest even that wg_store_x applies), X needs no
// conversion: its 16-byte chunks go by cp.async straight into the swizzled wgmma tile, into a
// ring of D + 1 tiles, D steps ahead of the wgmma that reads them. W's codes and scale windows go
// by cp.async into a ring of D raw slots, D steps ahead of their dequantisation, which stays in
// registers (a thread dequantises the W row it copied, row tid of the block's 256, so it waits
// for its own copies only: cp.async.wait_group, no barrier). cp.async holds no registers while
// in flight. A raw slot is the codes as two 16-byte halves, [half][row], then the window's four
// bf16 scales [row] and biases [row]: consecutive threads touch consecutive 16 or 8 bytes.
#define GEMM_WG_RAW_BYTES (GEMM_WG_BN * (32 + 8 + 8))

// Dynamic shared memory of an _x16 block of BM rows, D steps ahead: D + 1 X tiles, two W tiles,
// D raw slots, 1024 bytes of alignment.
__host__ __device__ constexpr int gemm_wgmma_x16_shared_bytes(int bm, int d) {
    return (d + 1) * bm * 128 + 2 * GEMM_WG_BN * 128 + d * GEMM_WG_RAW_BYTES + 1024;
}

// cp.async of 16 bytes into shared memory; zeros where src_bytes is 0 (a row past the tile's).
__device__ __forceinline__ void wg_cp16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void wg_cp8(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void wg_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Whether the step at column k enters a new window of four groups (its scales and biases load).
__device__ __forceinline__ bool wg_new_window(int k, int k0, int window_shift) {
    return k == k0 || (k >> window_shift) != ((k - GEMM_WG_BK) >> window_shift);
}

// Where this thread's X chunks come from: chunk i is row tid/8 + 32·i of the tile, 16 bytes
// tid % 8 of the step's 128; rows past the tile's read nothing (zeros).
template <int BM>
struct WgX16Rows {
    static constexpr int CHUNKS = BM / 32;
    const u16* row[CHUNKS];
    int bytes[CHUNKS];
};

// This thread's W row (row tid of the block's 256): where its codes and its scale and bias
// windows start, and whether it is a row of the weight (a row past it copies zeros: w = 0).
struct WgWRow {
    const char* codes;
    const u16* scales;
    const u16* biases;
    int bytes;
};

// Row `row` of w (clamped to the last of n_valid, which must be ≥ 1) for this thread, `live` or
// not; K values a row in `groups` groups.
__device__ __forceinline__ WgWRow wg_w_row(const Mat& w, long row0, int row, int n_valid) {
    const long r = row0 + min(row, n_valid - 1);
    const long groups = w.cols / w.group;
    return WgWRow{(const char*)w.w + r * (w.cols / 2), w.scales + r * groups, w.biases + r * groups,
                  row < n_valid ? 16 : 0};
}

// The copies of step k into X tile `xt`, raw slot `raw`: this thread's X chunks, its W row's
// codes, and at a new window the row's four scales and biases.
template <int BM>
__device__ __forceinline__ void wg_copy_step(const WgX16Rows<BM>& xr, const WgWRow& wr, int k, bool window,
                                             int window_shift, u32 xt, u32 raw) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < WgX16Rows<BM>::CHUNKS; i++)
        wg_cp16(xt + swizzle128(tid / 8 + 32 * i, tid % 8), xr.row[i] + k + 8 * (tid % 8), xr.bytes[i]);
    const char* codes = wr.codes + k / 2;
    wg_cp16(raw + 16 * tid, codes, wr.bytes);
    wg_cp16(raw + 16 * GEMM_WG_BN + 16 * tid, codes + 16, wr.bytes);
    if (window) {
        const int g = (k >> window_shift) << 2;
        wg_cp8(raw + 32 * GEMM_WG_BN + 8 * tid, wr.scales + g, wr.bytes / 2);
        wg_cp8(raw + 40 * GEMM_WG_BN + 8 * tid, wr.biases + g, wr.bytes / 2);
    }
}

// Dequantises this thread's W row of step k from raw slot `raw` into W tile `wt` (row tid, its
// 16-byte chunk c at swizzle128(tid, c): a quarter-warp's eight rows hit distinct banks). The
// window (scales, biases) is kept from step to step and replaced at a new one. A step of 64
// columns lies in one window; with groups of 32 its halves are two groups of it.
__device__ __forceinline__ void wg_dequant_step(u32 raw, u32 wt, int k, bool window, int group_shift,
                                                u32 (&scales)[2], u32 (&biases)[2]) {
    const int tid = threadIdx.x;
    uint4 q[2];
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(q[0].x), "=r"(q[0].y), "=r"(q[0].z), "=r"(q[0].w) : "r"(raw + 16 * tid));
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(q[1].x), "=r"(q[1].y), "=r"(q[1].z), "=r"(q[1].w) : "r"(raw + 16 * GEMM_WG_BN + 16 * tid));
    if (window) {
        asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(scales[0]), "=r"(scales[1]) : "r"(raw + 32 * GEMM_WG_BN + 8 * tid));
        asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(biases[0]), "=r"(biases[1]) : "r"(raw + 40 * GEMM_WG_BN + 8 * tid));
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int sub = ((k + 32 * h) >> group_shift) & 3;
        const u32 s2 = window_pair(scales, sub), b2 = window_pair(biases, sub);
        const u32 words[4] = {q[h].x, q[h].y, q[h].z, q[h].w};
#pragma unroll
        for (int c = 0; c < 4; c++) st_shared_v4(wt + swizzle128(tid, 4 * h + c), dequant_b4x8(words[c], s2, b2));
    }
}

// wgmma_tile's products with X as bf16 rows (x: K values a row, 16-byte aligned), D steps
// ahead, into the warpgroup's accumulators (their layout: wg_store_acc). wr is this thread's W
// row (wg_w_row): the block's W rows need not be one matrix's. live: whether this warpgroup
// has rows (dense) or columns (grouped) to compute; every thread copies and dequantises either
// way.
template <int BM, bool GATHER, int D>
__device__ __forceinline__ void wgmma_products_x16(const Mat& w, const WgWRow& wr, bool live, const u16* __restrict__ x,
                                                   const int* __restrict__ gather, long x_row0, int m_valid, int k0,
                                                   int k1,
                                                   float (&acc)[BM == GEMM_WG_DENSE_BM ? GEMM_WG_BN / 2 : GEMM_WG_BN / 4]) {
    static_assert(BM == GEMM_WG_DENSE_BM || BM == GEMM_WG_GROUPED_BM, "dense or grouped tiles");
    static_assert(D >= 1, "at least one step ahead");
    constexpr bool DENSE = BM == GEMM_WG_DENSE_BM;
    constexpr int WN = DENSE ? GEMM_WG_BN : GEMM_WG_BN / 2;
    constexpr u32 X_BYTES = BM * 128, W_BYTES = GEMM_WG_BN * 128;
    extern __shared__ __align__(1024) unsigned char wg_smem[];

    const int tid = threadIdx.x, wg = tid / 128;
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)gemm_wgmma_x16_shared_bytes(BM, D)) __trap();
    }
    // [X tiles 0..D][W tiles 0, 1][raw slots 0..D-1], from the first 1024-byte boundary.
    const u32 sx = (shared_address(wg_smem) + 1023u) & ~1023u;
    const u32 sw = sx + (D + 1) * X_BYTES;
    const u32 sraw = sw + 2 * W_BYTES;

    const int K = w.cols;
    const int groups = K / w.group;
    const unsigned long long windows = (unsigned long long)w.scales | (unsigned long long)w.biases;
    if ((w.group & (w.group - 1)) != 0 || w.group < 32 || groups % 4 != 0 || (windows & 7) != 0 ||
        (k1 - k0) % GEMM_WG_BK != 0 || ((unsigned long long)x & 15) != 0)
        __trap();
    const int group_shift = 31 - __clz(w.group), window_shift = group_shift + 2;

    WgX16Rows<BM> xr;
#pragma unroll
    for (int i = 0; i < WgX16Rows<BM>::CHUNKS; i++) {
        const int r = tid / 8 + 32 * i;
        const long slot = x_row0 + min(r, m_valid - 1);
        const long row = GATHER && gather != nullptr ? (long)gather[slot] : slot;
        xr.row[i] = x + row * K;
        xr.bytes[i] = r < m_valid ? 16 : 0;
    }

    const unsigned long long a_desc = tile_descriptor(sx + (DENSE ? wg * 64 * 128 : 0));
    const unsigned long long b_desc = tile_descriptor(sw + (DENSE ? 0 : wg * WN * 128));

#pragma unroll
    for (int i = 0; i < WN / 2; i++) acc[i] = 0.f;

    const int steps = (k1 - k0) / GEMM_WG_BK;
    // Copy group g holds step g's copies (empty past the last step), so waiting for step s + 1
    // with the copies of s + 2 .. s + D in flight is wait_group(D - 1).
#pragma unroll
    for (int t = 0; t < D; t++) {
        const int k = k0 + t * GEMM_WG_BK;
        if (t < steps)
            wg_copy_step<BM>(xr, wr, k, wg_new_window(k, k0, window_shift), window_shift, sx + t * X_BYTES,
                             sraw + t * GEMM_WG_RAW_BYTES);
        wg_cp_commit();
    }
    u32 scales[2] = {0u, 0u}, biases[2] = {0u, 0u};
    wg_cp_wait<D - 1>();
    wg_dequant_step(sraw, sw, k0, true, group_shift, scales, biases);
    fence_async_shared();
    __syncthreads();

    for (int step = 0; step < steps; step++) {
        if (live) {
            const int xs = step % (D + 1);
            const unsigned long long a = a_desc + xs * (X_BYTES >> 4), b = b_desc + (step & 1) * (W_BYTES >> 4);
            pin_accumulators(acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < GEMM_WG_BK / 16; kk++) {
                if constexpr (DENSE)
                    wgmma_m64n256(acc, a + 2 * kk, b + 2 * kk);
                else
                    wgmma_m64n128(acc, a + 2 * kk, b + 2 * kk);
            }
            wgmma_commit();
        }
        // Step + D's copies go where step − 1's X tile was (its wgmma ended before the last
        // barrier) and where step's raw codes were (dequantised before it).
        const int ahead = step + D;
        if (ahead < steps) {
            const int k = k0 + ahead * GEMM_WG_BK;
            wg_copy_step<BM>(xr, wr, k, wg_new_window(k, k0, window_shift), window_shift,
                             sx + (ahead % (D + 1)) * X_BYTES, sraw + (ahead % D) * GEMM_WG_RAW_BYTES);
        }
        wg_cp_commit();
        if (step + 1 < steps) {
            const int next = step + 1, k = k0 + next * GEMM_WG_BK;
            wg_cp_wait<D - 1>();
            // The other W tile was last read by step − 1's wgmma, complete before its barrier.
            wg_dequant_step(sraw + (next % D) * GEMM_WG_RAW_BYTES, sw + (next & 1) * W_BYTES, k,
                            wg_new_window(k, k0, window_shift), group_shift, scales, biases);
            // Orders the dequantised stores and the landed copies before the async proxy's reads.
            fence_async_shared();
        }
        wgmma_wait_all();
        pin_accumulators(acc);
        __syncthreads();
    }
}

// Dense, 4-bit: as gemm.cu's gemm_b4 (same arguments and grid shape, with 128 × 256 output tiles:
// grid (⌈w.rows/256⌉, ⌈m/128⌉, splits); k_split a multiple of GEMM_WG_BK).
extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 1)
    gemm_wgmma_b4(Mat w, const float* x, int m, float* y, int ldy, int col0, int k_split) {
    pdl_wait();
    const int n0 = blockIdx.x * GEMM_WG_BN;
    const long r0 = (long)blockIdx.y * GEMM_WG_DENSE_BM;
    const int k0 = blockIdx.z * k_split;
    float* out = y + (long)blockIdx.z * m * ldy;
    wgmma_tile<GEMM_WG_DENSE_BM, false>(w, n0, min(GEMM_WG_BN, w.rows - n0), x, nullptr, r0,
                                        (int)min((long)GEMM_WG_DENSE_BM, m - r0), out, r0, ldy, (long)col0 + n0, k0,
                                        min(k0 + k_split, w.cols));
}

// Grouped, 4-bit, 64-row tiles: as gemm.cu's gemm_grouped64_b4 (same arguments; grid
// (⌈n/256⌉, max tiles)).
extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 2)
    gemm_wgmma_grouped64_b4(Mat w, int n, const float* x, const int* gather, const int* tiles,
                            const int* num_tiles, float* y) {
    pdl_wait();
    const int t = blockIdx.y;
    if (t >= *num_tiles) return;
    const int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], GEMM_WG_GROUPED_BM);
    const int n0 = blockIdx.x * GEMM_WG_BN;
    // A tile naming an expert past the stack would read beyond the weight.
    if (expert < 0 || (long)(expert + 1) * n > w.rows || rows <= 0) return;
    wgmma_tile<GEMM_WG_GROUPED_BM, true>(w, (long)expert * n + n0, min(GEMM_WG_BN, n - n0), x, gather, slot0, rows,
                                         y, slot0, n, n0, 0, w.cols);
}

// The entries above with X as bf16 rows (x16): dense 3 steps ahead, one block an SM (165 KiB);
// grouped 2 steps ahead, the most that leaves two blocks an SM (113 KiB each, the SM's 228 KiB).
#define GEMM_WG_DENSE_AHEAD 3
#define GEMM_WG_GROUPED_AHEAD 2

extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 1)
    gemm_wgmma_b4_x16(Mat w, const u16* x, int m, float* y, int ldy, int col0, int k_split) {
    pdl_wait();
    const int n0 = blockIdx.x * GEMM_WG_BN;
    const long r0 = (long)blockIdx.y * GEMM_WG_DENSE_BM;
    const int k0 = blockIdx.z * k_split;
    const int n_valid = min(GEMM_WG_BN, w.rows - n0), m_valid = (int)min((long)GEMM_WG_DENSE_BM, m - r0);
    float acc[GEMM_WG_BN / 2];
    const bool live = 64 * (threadIdx.x / 128) < m_valid;
    wgmma_products_x16<GEMM_WG_DENSE_BM, false, GEMM_WG_DENSE_AHEAD>(
        w, wg_w_row(w, n0, threadIdx.x, n_valid), live, x, nullptr, r0, m_valid, k0, min(k0 + k_split, w.cols), acc);
    if (live)
        wg_store_acc<GEMM_WG_DENSE_BM>(acc, y + (long)blockIdx.z * m * ldy, r0, ldy, (long)col0 + n0, m_valid,
                                       n_valid);
}

extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 2)
    gemm_wgmma_grouped64_b4_x16(Mat w, int n, const u16* x, const int* gather, const int* tiles,
                                const int* num_tiles, float* y) {
    pdl_wait();
    const int t = blockIdx.y;
    if (t >= *num_tiles) return;
    const int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], GEMM_WG_GROUPED_BM);
    const int n0 = blockIdx.x * GEMM_WG_BN;
    if (expert < 0 || (long)(expert + 1) * n > w.rows || rows <= 0) return;
    const int n_valid = min(GEMM_WG_BN, n - n0);
    float acc[GEMM_WG_BN / 4];
    const bool live = GEMM_WG_BN / 2 * (threadIdx.x / 128) < n_valid;
    wgmma_products_x16<GEMM_WG_GROUPED_BM, true, GEMM_WG_GROUPED_AHEAD>(
        w, wg_w_row(w, (long)expert * n + n0, threadIdx.x, n_valid), live, x, gather, slot0, rows, 0, w.cols, acc);
    if (live) wg_store_acc<GEMM_WG_GROUPED_BM>(acc, y, slot0, n, n0, rows, n_valid);
}

// The experts' gate and up projections and the SwiGLU in one launch (X as bf16 rows): a block
// takes 128 of an expert's gate rows (warpgroup 0) and the same 128 up rows (warpgroup 1), so
// each act[s, j] = silu(gate[s, j]) · up[s, j] meets in one block, where warpgroup 1 hands its
// accumulators to warpgroup 0 through shared memory (the tiles are free by then: a thread's
// value goes where the same lane of warpgroup 0 holds the matching gate product). act (f32, when
// not null) and act16 (bf16, rounded as moe_swiglu rounds) are [slots, n]; the same bits as
// gemm_wgmma_grouped64_b4 gate and up followed by moe_swiglu. Grid (⌈n/128⌉, max tiles).
extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 2)
    gemm_wgmma_gate_up64_b4_x16(Mat gate, Mat up, int n, const u16* x, const int* gather, const int* tiles,
                                const int* num_tiles, float* act, u16* act16) {
    pdl_wait();
    const int t = blockIdx.y;
    if (t >= *num_tiles) return;
    const int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], GEMM_WG_GROUPED_BM);
    constexpr int HALF = GEMM_WG_BN / 2;
    const int n0 = blockIdx.x * HALF;
    if (expert < 0 || (long)(expert + 1) * n > gate.rows || (long)(expert + 1) * n > up.rows || rows <= 0 ||
        gate.cols != up.cols || gate.group != up.group)
        return;
    const int n_valid = min(HALF, n - n0);
    const int tid = threadIdx.x, wg = tid / 128;
    // Gate's row or up's: the fields selected one by one, so the parameters stay in place.
    const Mat half_w = {wg ? up.w : gate.w, wg ? up.scales : gate.scales, wg ? up.biases : gate.biases,
                        gate.rows, gate.cols, gate.group};
    float acc[GEMM_WG_BN / 4];
    wgmma_products_x16<GEMM_WG_GROUPED_BM, true, GEMM_WG_GROUPED_AHEAD>(
        gate, wg_w_row(half_w, (long)expert * n + n0, tid % 128, n_valid), true, x, gather, slot0, rows, 0,
        gate.cols, acc);
    // Every wgmma has been waited for and the block has met after the last step: the tiles are
    // free. Thread t of warpgroup 1 writes its accumulator i at word t − 128 + 128·i.
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    float* ups = (float*)(wg_smem + ((1024u - (shared_address(wg_smem) & 1023u)) & 1023u));
    if (wg == 1) {
#pragma unroll
        for (int i = 0; i < GEMM_WG_BN / 4; i++) ups[tid - 128 + 128 * i] = acc[i];
    }
    __syncthreads();
    if (wg == 1) return;
    const int warp = tid / WARP, lane = tid % WARP;
    const int row0 = 16 * warp + lane / 4, col_base = 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = row0 + 8 * h;
        if (row >= rows) continue;
        const long at = (long)(slot0 + row) * n + n0;
#pragma unroll
        for (int j = 0; j < HALF / 8; j++) {
            const int col = col_base + 8 * j;
            float v[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = 4 * j + 2 * h + e;
                v[e] = siluf(acc[i]) * ups[tid + 128 * i];
            }
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (col + e >= n_valid) continue;
                if (act) act[at + col + e] = v[e];
                act16[at + col + e] = (u16)pack_bf16x2(v[e], 0.f);
            }
        }
    }
}
