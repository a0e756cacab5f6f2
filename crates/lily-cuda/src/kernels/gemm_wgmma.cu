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
// SM). Grouped (the sort's 64-row tiles): warpgroup g computes the tile's 64 rows at columns
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

// Dynamic shared memory of a block of BM rows: two X tiles, two W tiles (128 bytes a row), and
// 1024 bytes to align the first tile to 1024.
__host__ __device__ constexpr int gemm_wgmma_shared_bytes(int bm) { return 2 * (bm + GEMM_WG_BN) * 128 + 1024; }
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
        // Descriptor units are 16 bytes: a stage is X_BYTES (W_BYTES) on.
        if (live) wgmma_step(acc, a_desc + stage * (X_BYTES >> 4), b_desc + stage * (W_BYTES >> 4));
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

// Dense, 4-bit: as gemm.cu's gemm_b4 (same arguments and grid shape, with 128 × 256 output tiles:
// grid (⌈w.rows/256⌉, ⌈m/128⌉, splits); k_split a multiple of GEMM_WG_BK).
extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 1)
    gemm_wgmma_b4(Mat w, const float* x, int m, float* y, int ldy, int col0, int k_split) {
    pdl_wait();
    const WgDense b = wg_dense(w, m, k_split);
    wgmma_tile<GEMM_WG_DENSE_BM, false>(w, b.n0, b.n_valid, x, nullptr, b.r0, b.m_valid, y + (long)blockIdx.z * m * ldy,
                                        b.r0, ldy, (long)col0 + b.n0, b.k0, b.k1);
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
