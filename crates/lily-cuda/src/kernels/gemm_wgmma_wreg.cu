// The experts' grouped GEMMs of gemm_wgmma_x16.cu (sm_90a only, X as bf16 rows) with the
// operands swapped: Yᵀ = W · Xᵀ, the weight as wgmma's A operand dequantised straight into
// registers, the tile's tokens as its N side from shared memory.
//
// Why: there, a block dequantises its 256 W rows into a shared tile that wgmma then reads, and the
// tokens are wgmma's 64-row M side, so an expert with 32 rows (a 1K chunk's average) pays for 64.
// Here each thread dequantises the A fragments it feeds (rows 16·warp + lane/4 and + 8 of its
// warpgroup's 64, the byte lane % 4 of each code word: a code byte is one bf16 pair of the
// fragment), so nothing dequantised goes through shared memory, and the tokens go in as two
// n32 halves, the second skipped when the tile has 32 rows or fewer.
//
// A block is 128 W rows (64 a warpgroup) by one tile of up to 64 tokens. Every step (64 columns
// of K) is copied WREG_AHEAD steps ahead by cp.async: the tile's X rows (bf16, into a ring of
// swizzled 64-row tiles, the layout wgmma's B descriptor takes) and the W rows' codes and scale
// windows (into a ring of raw slots, [half][row] 16 bytes, then [row] scales and biases as in
// gemm_wgmma_x16.cu; a thread copies half a row). A step's A fragments are dequantised while the
// previous step's wgmma runs, into the second of two register sets; one block barrier a step.

#define WREG_ROWS 128
#define WREG_AHEAD 4
#define WREG_RAW_BYTES (WREG_ROWS * (32 + 8 + 8))
#define WREG_X_BYTES (GEMM_WG_GROUPED_BM * 128)

// Dynamic shared memory: WREG_AHEAD + 1 X tiles, WREG_AHEAD raw slots, 1024 bytes of alignment.
__host__ __device__ constexpr int gemm_wgmma_wreg_shared_bytes() {
    return (WREG_AHEAD + 1) * WREG_X_BYTES + WREG_AHEAD * WREG_RAW_BYTES + 1024;
}

// d += A · B for one k16 slice, A (64 × 16) from registers as mma.m16n8k16's A fragment per warp,
// B (32 × 16, K-major) at descriptor b.
__device__ __forceinline__ void wgmma_m64n32_rs(float (&d)[16], const u32 (&a)[4], unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
        "%11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)
        : "memory");
}

// The bf16 pair scale·code + bias of codes 2m, 2m+1 (byte m of `word`; `sel` = m | (4 + m) << 8),
// by dequant_b4x8's arithmetic, so the same bits.
__device__ __forceinline__ u32 wreg_pair(u32 word, u32 sel, u32 s2, u32 b2) {
    const u32 biased = (byte_perm(word, word >> 4, sel) & 0x000f000fu) | 0x43004300u;
    return fma_bf16x2(fma_bf16x2(biased, 0x3f803f80u, 0xc300c300u), s2, b2);
}

// The A fragments of step k: a[s] for k16 slice s, {row ra, row ra + 8} × {columns 2·(lane%4),
// + 8} of the slice, from raw slot `raw` (block rows ra and ra + 8). At a new window the rows'
// scales and biases are read first and kept for the steps after.
__device__ __forceinline__ void wreg_dequant(u32 raw, int ra, int k, bool window, int group_shift, u32 sel,
                                             u32 (&scales)[2][2], u32 (&biases)[2][2], u32 (&a)[4][4]) {
    u32 q[2][8];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = ra + 8 * r;
#pragma unroll
        for (int h = 0; h < 2; h++)
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(q[r][4 * h]), "=r"(q[r][4 * h + 1]), "=r"(q[r][4 * h + 2]), "=r"(q[r][4 * h + 3])
                         : "r"(raw + 16 * WREG_ROWS * h + 16 * row));
        if (window) {
            asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];"
                         : "=r"(scales[r][0]), "=r"(scales[r][1]) : "r"(raw + 32 * WREG_ROWS + 8 * row));
            asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];"
                         : "=r"(biases[r][0]), "=r"(biases[r][1]) : "r"(raw + 40 * WREG_ROWS + 8 * row));
        }
    }
    // Groups are at least 32 columns: slices 0-1 and 2-3 each lie in one group.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int sub = ((k + 32 * h) >> group_shift) & 3;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const u32 s2 = window_pair(scales[r], sub), b2 = window_pair(biases[r], sub);
#pragma unroll
            for (int s = 2 * h; s < 2 * h + 2; s++) {
                a[s][r] = wreg_pair(q[r][2 * s], sel, s2, b2);
                a[s][2 + r] = wreg_pair(q[r][2 * s + 1], sel, s2, b2);
            }
        }
    }
}

// The copies of step k: this thread's X chunks into X tile `xt`, and half `half` of its W row's
// codes into raw slot `raw` (row `row`), with, at a new window, the row's scales (half 0) or
// biases (half 1).
__device__ __forceinline__ void wreg_copy_step(const WgX16Rows<GEMM_WG_GROUPED_BM>& xr, const WgWRow& wr, int row,
                                               int half, int k, bool window, int window_shift, u32 xt, u32 raw) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < WgX16Rows<GEMM_WG_GROUPED_BM>::CHUNKS; i++)
        wg_cp16(xt + swizzle128(tid / 8 + 32 * i, tid % 8), xr.row[i] + k + 8 * (tid % 8), xr.bytes[i]);
    wg_cp16(raw + 16 * WREG_ROWS * half + 16 * row, wr.codes + k / 2 + 16 * half, wr.bytes);
    if (window) {
        const int g = (k >> window_shift) << 2;
        const u16* src = half ? wr.biases + g : wr.scales + g;
        wg_cp8(raw + (32 + 8 * half) * WREG_ROWS + 8 * row, src, wr.bytes / 2);
    }
}

// Y[token, row] = Σ_k X[token, k] · W[row, k] for the block's 128 W rows and the tile's `rows`
// tokens (slots slot0 + [0, rows), X row gather[slot], or the slot without a gather): acc[t][i] the warpgroup's accumulators
// of tokens 32t + [0, 32) (layout below, wreg_store). wr is this thread's copy row, block row
// tid / 2: the block's rows need not be one matrix's. K is w.cols, w gives the group.
__device__ __forceinline__ void wreg_products(const Mat& w, const WgWRow& wr, const u16* __restrict__ x,
                                              const int* __restrict__ gather, long slot0, int rows,
                                              float (&acc)[2][16]) {
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid / WARP) % 4, lane = tid % WARP;
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)gemm_wgmma_wreg_shared_bytes()) __trap();
    }
    const u32 sx = (shared_address(wg_smem) + 1023u) & ~1023u;
    const u32 sraw = sx + (WREG_AHEAD + 1) * WREG_X_BYTES;

    const int K = w.cols, groups = K / w.group;
    const unsigned long long windows = (unsigned long long)w.scales | (unsigned long long)w.biases;
    if ((w.group & (w.group - 1)) != 0 || w.group < 32 || groups % 4 != 0 || (windows & 7) != 0 ||
        K % GEMM_WG_BK != 0 || ((unsigned long long)x & 15) != 0)
        __trap();
    const int group_shift = 31 - __clz(w.group), window_shift = group_shift + 2;

    WgX16Rows<GEMM_WG_GROUPED_BM> xr;
#pragma unroll
    for (int i = 0; i < WgX16Rows<GEMM_WG_GROUPED_BM>::CHUNKS; i++) {
        const int r = tid / 8 + 32 * i;
        const long slot = slot0 + min(r, rows - 1);
        xr.row[i] = x + (gather != nullptr ? (long)gather[slot] : slot) * K;
        xr.bytes[i] = r < rows ? 16 : 0;
    }
    const int copy_row = tid / 2, copy_half = tid % 2;
    const int ra = 64 * wg + 16 * warp + lane / 4;
    const u32 sel = (u32)(lane % 4) | ((u32)(4 + lane % 4) << 8);
    // Tokens 32..63 only where the tile has them (the same for the whole block).
    const bool upper = rows > 32;

#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int i = 0; i < 16; i++) acc[t][i] = 0.f;

    const int steps = K / GEMM_WG_BK;
    auto copy = [&](int step) {
        const int k = step * GEMM_WG_BK;
        wreg_copy_step(xr, wr, copy_row, copy_half, k, wg_new_window(k, 0, window_shift), window_shift,
                       sx + (step % (WREG_AHEAD + 1)) * WREG_X_BYTES, sraw + (step % WREG_AHEAD) * WREG_RAW_BYTES);
    };
    // Copy group g holds step g's copies (empty past the last step). Steps 0 and 1 landed for
    // every thread before the barrier: step 0 is dequantised now, step 1 under step 0's wgmma.
#pragma unroll
    for (int t = 0; t < WREG_AHEAD; t++) {
        if (t < steps) copy(t);
        wg_cp_commit();
    }
    wg_cp_wait<WREG_AHEAD - 2>();
    __syncthreads();
    u32 scales[2][2], biases[2][2], a[4][4], next[4][4];
    wreg_dequant(sraw, ra, 0, true, group_shift, sel, scales, biases, a);

    for (int step = 0; step < steps; step++) {
        const u32 xt = sx + (step % (WREG_AHEAD + 1)) * WREG_X_BYTES;
        pin_accumulators(acc[0]);
        pin_accumulators(acc[1]);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; s++) {
            wgmma_m64n32_rs(acc[0], a[s], tile_descriptor(xt) + 2 * s);
            if (upper) wgmma_m64n32_rs(acc[1], a[s], tile_descriptor(xt + 32 * 128) + 2 * s);
        }
        wgmma_commit();
        // Step + AHEAD's copies go where step − 1's X tile was (its wgmma ended before the last
        // barrier) and where step's raw codes were (dequantised before it).
        if (step + WREG_AHEAD < steps) copy(step + WREG_AHEAD);
        wg_cp_commit();
        if (step + 1 < steps) {
            const int k = (step + 1) * GEMM_WG_BK;
            wreg_dequant(sraw + ((step + 1) % WREG_AHEAD) * WREG_RAW_BYTES, ra, k, wg_new_window(k, 0, window_shift),
                         group_shift, sel, scales, biases, next);
        }
        wgmma_wait_all();
        pin_accumulators(acc[0]);
        pin_accumulators(acc[1]);
        // The wgmma read its A registers until the wait: they stay live to here.
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                asm volatile("" : "+r"(a[s][i])::"memory");
                a[s][i] = next[s][i];
            }
        // Step + 2 landed for this thread; after the barrier, for all.
        wg_cp_wait<WREG_AHEAD - 2>();
        __syncthreads();
    }
}

// Accumulator 4j + 2h + e of acc[t] of a lane: W row 16·warp + lane/4 + 8h of its warpgroup's
// 64, token 32t + 8j + 2·(lane%4) + e of the tile.
__device__ __forceinline__ int wreg_token(int t, int j, int e) {
    return 32 * t + 8 * j + 2 * (threadIdx.x % 4) + e;
}

extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 2)
    gemm_wgmma_grouped64_wreg_b4_x16(Mat w, int n, const u16* x, const int* gather, const int* tiles,
                                     const int* num_tiles, float* y) {
    pdl_wait();
    const int t = blockIdx.y;
    if (t >= *num_tiles) return;
    const int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], GEMM_WG_GROUPED_BM);
    const int n0 = blockIdx.x * WREG_ROWS;
    if (expert < 0 || (long)(expert + 1) * n > w.rows || rows <= 0) return;
    const int n_valid = min(WREG_ROWS, n - n0);
    float acc[2][16];
    wreg_products(w, wg_w_row(w, (long)expert * n + n0, threadIdx.x / 2, n_valid), x, gather, slot0, rows, acc);
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid / WARP) % 4, lane = tid % WARP;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = 64 * wg + 16 * warp + lane / 4 + 8 * h;
        if (row >= n_valid) continue;
#pragma unroll
        for (int tt = 0; tt < 2; tt++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int token = wreg_token(tt, j, e);
                    if (token < rows) y[(long)(slot0 + token) * n + n0 + row] = acc[tt][4 * j + 2 * h + e];
                }
    }
}

// The experts' gate and up projections and the SwiGLU in one launch, as
// gemm_wgmma_gate_up64_b4_x16 (the same arguments, act and act16 the same bits): a block takes
// 64 of an expert's gate rows (warpgroup 0) and the same 64 up rows (warpgroup 1); warpgroup 1
// hands its accumulators to warpgroup 0 through shared memory, where the same lane holds the
// matching gate product. Grid (⌈n/64⌉, max tiles).
extern "C" __global__ void __launch_bounds__(GEMM_WG_THREADS, 2)
    gemm_wgmma_gate_up64_wreg_b4_x16(Mat gate, Mat up, int n, const u16* x, const int* gather, const int* tiles,
                                     const int* num_tiles, float* act, u16* act16) {
    pdl_wait();
    const int t = blockIdx.y;
    if (t >= *num_tiles) return;
    const int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], GEMM_WG_GROUPED_BM);
    constexpr int HALF = WREG_ROWS / 2;
    const int n0 = blockIdx.x * HALF;
    if (expert < 0 || (long)(expert + 1) * n > gate.rows || (long)(expert + 1) * n > up.rows || rows <= 0 ||
        gate.cols != up.cols || gate.group != up.group)
        return;
    const int n_valid = min(HALF, n - n0);
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid / WARP) % 4, lane = tid % WARP;
    // The copy row tid / 2: block rows 0-63 are gate's, 64-127 up's.
    const int copy_row = tid / 2;
    const bool copies_up = copy_row >= HALF;
    const Mat half_w = {copies_up ? up.w : gate.w, copies_up ? up.scales : gate.scales,
                        copies_up ? up.biases : gate.biases, gate.rows, gate.cols, gate.group};
    float acc[2][16];
    wreg_products(gate, wg_w_row(half_w, (long)expert * n + n0, copy_row % HALF, n_valid), x, gather, slot0, rows,
                  acc);
    // The rings are free after the last step's barrier. Thread t of warpgroup 1 writes its
    // accumulator i at word t − 128 + 128·i.
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    float* ups = (float*)(wg_smem + ((1024u - (shared_address(wg_smem) & 1023u)) & 1023u));
    if (wg == 1) {
#pragma unroll
        for (int i = 0; i < 32; i++) ups[tid - 128 + 128 * i] = acc[i / 16][i % 16];
    }
    __syncthreads();
    if (wg == 1) return;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = 16 * warp + lane / 4 + 8 * h;
        if (row >= n_valid) continue;
#pragma unroll
        for (int tt = 0; tt < 2; tt++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int token = wreg_token(tt, j, e);
                    if (token >= rows) continue;
                    const int i = 4 * j + 2 * h + e;
                    const float v = siluf(acc[tt][i]) * ups[tid + 128 * (16 * tt + i)];
                    const long at = (long)(slot0 + token) * n + n0 + row;
                    if (act) act[at] = v;
                    act16[at] = (u16)pack_bf16x2(v, 0.f);
                }
    }
}
