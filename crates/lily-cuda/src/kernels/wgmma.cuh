// The warpgroup-MMA machinery the prefill GEMMs on sm_90a share (gemm_wgmma.cu, X in f32;
// gemm_wgmma_x16.cu, X as bf16 rows): block shapes, 128-byte-swizzled shared tiles and their
// matrix descriptors, the wgmma instructions and their fences, and the accumulators' store.
// gemm_wgmma.cu's opening comment says how the tiles and descriptors are laid out.

#define GEMM_WG_BK 64
#define GEMM_WG_THREADS 256
#define GEMM_WG_BN 256
#define GEMM_WG_DENSE_BM 128
#define GEMM_WG_GROUPED_BM 64
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
// Issues one step's wgmma on the tiles at descriptors a and b, its four k16 slices 32 bytes apart,
// as one commit group: dense accumulators (128 a thread) as m64n256, grouped (64) as m64n128.
template <int N>
__device__ __forceinline__ void wgmma_step(float (&acc)[N], unsigned long long a, unsigned long long b) {
    static_assert(N == GEMM_WG_BN / 2 || N == GEMM_WG_BN / 4, "a dense or a grouped warpgroup's accumulators");
    pin_accumulators(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < GEMM_WG_BK / 16; kk++) {
        if constexpr (N == GEMM_WG_BN / 2)
            wgmma_m64n256(acc, a + 2 * kk, b + 2 * kk);
        else
            wgmma_m64n128(acc, a + 2 * kk, b + 2 * kk);
    }
    wgmma_commit();
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

// A dense block's share (grid (⌈w.rows/256⌉, ⌈m/128⌉, splits)): output columns n0 + [0, n_valid),
// rows r0 + [0, m_valid), columns [k0, k1) of its split along K.
struct WgDense {
    int n0;
    long r0;
    int k0, k1, n_valid, m_valid;
};

__device__ __forceinline__ WgDense wg_dense(const Mat& w, int m, int k_split) {
    WgDense b;
    b.n0 = blockIdx.x * GEMM_WG_BN;
    b.r0 = (long)blockIdx.y * GEMM_WG_DENSE_BM;
    b.k0 = blockIdx.z * k_split;
    b.k1 = min(b.k0 + k_split, w.cols);
    b.n_valid = min(GEMM_WG_BN, w.rows - b.n0);
    b.m_valid = (int)min((long)GEMM_WG_DENSE_BM, m - b.r0);
    return b;
}
