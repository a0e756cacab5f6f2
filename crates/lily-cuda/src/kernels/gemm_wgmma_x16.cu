// The prefill GEMMs of gemm_wgmma.cu (sm_90a only) with X given as bf16 rows: the same products
// to the bit, every operand copied by cp.async steps ahead of its wgmma. wgmma.cuh holds the
// machinery both files share.
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
        if (live) wgmma_step(acc, a_desc + (step % (D + 1)) * (X_BYTES >> 4), b_desc + (step & 1) * (W_BYTES >> 4));
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

// The entries above with X as bf16 rows (x16): dense 3 steps ahead, one block an SM (165 KiB);
// grouped 2 steps ahead, the most that leaves two blocks an SM (113 KiB each, the SM's 228 KiB).
#define GEMM_WG_DENSE_AHEAD 3
#define GEMM_WG_GROUPED_AHEAD 2

// This thread's W row of a stack of weights m0..m3 (rows one after another, empty ones 0 rows;
// the host checks they share K, the group and the format): row n0 + tid of the stack, clamped to
// its last (whose copies are then zeros). The fields are selected one by one, so the parameters
// stay in place (an indexed Mat array would be copied to the stack frame).
__device__ __forceinline__ WgWRow wg_stack_row(const Mat& m0, const Mat& m1, const Mat& m2, const Mat& m3, int n0,
                                               int n_valid) {
    const int tid = threadIdx.x, g = n0 + min(tid, n_valid - 1);
    const int e1 = m0.rows, e2 = e1 + m1.rows, e3 = e2 + m2.rows;
    const int which = (g >= e1) + (g >= e2) + (g >= e3);
    const Mat w = {which == 0 ? m0.w : which == 1 ? m1.w : which == 2 ? m2.w : m3.w,
                   which == 0 ? m0.scales : which == 1 ? m1.scales : which == 2 ? m2.scales : m3.scales,
                   which == 0 ? m0.biases : which == 1 ? m1.biases : which == 2 ? m2.biases : m3.biases,
                   m0.rows, m0.cols, m0.group};
    const int start = which == 0 ? 0 : which == 1 ? e1 : which == 2 ? e2 : e3;
    WgWRow r = wg_w_row(w, g - start, 0, 1);
    r.bytes = tid < n_valid ? 16 : 0;
    return r;
}

// The dense product of a stack of up to four weights that share X (a mixer's input projections),
// in one launch: output column j is row j of the stack (m0's rows, then m1's, ...), so the
// launch fills whole waves where the small ones alone would not (the GDN's b and a, 32 rows
// each, took split-K launches and reductions of their own). Grid (⌈stack rows/256⌉, ⌈m/128⌉, splits).
extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 1)
    gemm_wgmma_b4_x16(Mat m0, Mat m1, Mat m2, Mat m3, const u16* x, int m, float* y, int ldy, int col0,
                      int k_split) {
    pdl_wait();
    Mat stack = m0;
    stack.rows = m0.rows + m1.rows + m2.rows + m3.rows;
    const WgDense b = wg_dense(stack, m, k_split);
    float acc[GEMM_WG_BN / 2];
    const bool live = 64 * (threadIdx.x / 128) < b.m_valid;
    wgmma_products_x16<GEMM_WG_DENSE_BM, false, GEMM_WG_DENSE_AHEAD>(
        m0, wg_stack_row(m0, m1, m2, m3, b.n0, b.n_valid), live, x, nullptr, b.r0, b.m_valid, b.k0, b.k1, acc);
    if (live)
        wg_store_acc<GEMM_WG_DENSE_BM>(acc, y + (long)blockIdx.z * m * ldy, b.r0, ldy, (long)col0 + b.n0, b.m_valid,
                                       b.n_valid);
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
