// The chunked (WY) route of the Gated DeltaNet prefill: the same delta rule as gdn_prefill.cu's
// gdn_scan, reorganised over chunks of GDNC_C = 64 tokens (spec §4), from the same inputs (conv
// rows, gdn_scan_prep's prep) to the same outputs. Per value head and chunk, with g = log α (clamped at −256, where α = exp(g) is 0 in f32 anyway),
// γ the inclusive cumulative sum of g (in f64: after a strong decay γ reaches the thousands, where
// an f32 sum would leave the small differences that matter only ~1e-4 accurate) and
// D_ts = exp(γ_t − γ_s) for s ≤ t (never exp of a positive number):
//   A = strictly lower (β_t k_t·k_s D_ts), T = (I + A)⁻¹, Tβ = T diag(β), W = T diag(β e^γ) K,
//   P = lower (q_t·k_s D_ts)                                         (gdn_chunk_prep, parallel)
//   V' = Tβ V − W S, O = diag(e^γ) Q S + P V', S ← e^{γ_C} S + (diag(e^{γ_C − γ}) K)ᵀ V'
//                                                           (gdn_chunk_scan, chunks in order)
// A ragged last chunk is padded with q = k = v = 0, β = 0, g = 0: no update, no decay, padded
// rows of O dropped. Everything stored is f32; products run on tensor cores as 3xTF32 (below).
// gdn_chunked.rs mirrors GDNC_C, GDNC_COLS, the scratch layout and the shared-memory sizes.

#define KEY_DIM (NK * DK)
#define CONV_DIM (2 * NK * DK + NV * DV)

#define GDNC_C 64
#define GDNC_WARPS 8
// State columns per gdn_chunk_scan block: the columns of S evolve independently, so a value
// head's DV columns split over DV / GDNC_COLS blocks (4 at DV 128: 128 blocks for 32 heads).
#define GDNC_COLS (DV % 32 == 0 ? 32 : DV % 16 == 0 ? 16 : 8)
// gdn_chunk_prep's shared row strides (floats): +4 puts the 8 rows × 4 columns of a
// fragment in 32 banks.
#define GDNC_LDK (DK + 4)
#define GDNC_LDC (GDNC_C + 4)
// Per (value head, chunk) in the scratch after prep: W [C][DK], Tβ [C][C], P [C][C] (each in
// fragment order, gdnc_frag), e^γ [C], e^{γ_C − γ} [C].
#define GDNC_W 0
#define GDNC_TB (GDNC_C * DK)
#define GDNC_P (GDNC_TB + GDNC_C * GDNC_C)
#define GDNC_EG (GDNC_P + GDNC_C * GDNC_C)
#define GDNC_EK (GDNC_EG + GDNC_C)
#define GDNC_FLOATS (GDNC_EK + GDNC_C)
// 3: each product as 3xTF32 (x = hi + lo, hi·hi + hi·lo + lo·hi), about f32 accuracy (an f64
// model of this algebra puts the error near 4e-7 relative, against 1e-3 for plain TF32 at 1).
#ifndef GDNC_TF32_PASSES
#define GDNC_TF32_PASSES 3
#endif

// The route needs DK % 16 == 0 and DV % 8 == 0 (gdn_prefill.rs refuses other shapes; the
// kernels still compile for them, as every model's kernels are built).

// x rounded to TF32 (10 mantissa bits, to nearest, ties away): two integer ops, where
// cvt.rna.tf32.f32 is a longer sequence before sm_90. (Finite inputs far below FLT_MAX only.)
__device__ __forceinline__ float tf32_round(float x) {
    return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u);
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const float (&a)[4], const float (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
          "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b[0])), "r"(__float_as_uint(b[1])));
}

// One k-step (8 deep) of a warp's strip of NT 16 × 8 tiles at columns n0 + 8i: c[i] (and lo[i],
// the 3xTF32 correction terms, a second set of independent chains) += a·b(k0.., n), where af
// is the step's A fragment and b reads shared memory; tiles from column n_end on are skipped.
// Fragments (PTX m16n8k8 .tf32), g = lane/4, q = lane%4: a0 (g, q), a1 (g+8, q), a2 (g, q+4),
// a3 (g+8, q+4); b0 (q, g), b1 (q+4, g); accumulator c0 (g, 2q), c1 (g, 2q+1), c2 (g+8, 2q),
// c3 (g+8, 2q+1) (acc_row / acc_col).
template <int NT, class FB>
__device__ __forceinline__ void mma_kstep(float (&c)[NT][4], float (&lo)[NT][4], const float (&af)[4],
                                          int k0, int n0, FB b, int n_end = 1 << 30) {
    int g = (threadIdx.x % WARP) / 4, q = threadIdx.x % 4;
    float ah[4], al[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        ah[e] = tf32_round(af[e]);
        al[e] = tf32_round(af[e] - ah[e]);
    }
#pragma unroll
    for (int i = 0; i < NT; i++) {
        if (n0 + 8 * i >= n_end) continue;
        int n = n0 + 8 * i + g;
        float bf[2] = {b(k0 + q, n), b(k0 + q + 4, n)};
        float bh[2] = {tf32_round(bf[0]), tf32_round(bf[1])};
        if constexpr (GDNC_TF32_PASSES == 3) {
            float bl[2] = {tf32_round(bf[0] - bh[0]), tf32_round(bf[1] - bh[1])};
            mma_tf32(lo[i], al, bh);
            mma_tf32(lo[i], ah, bl);
        }
        mma_tf32(c[i], ah, bh);
    }
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&c)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[i][e] = 0.f;
}

template <int NT>
__device__ __forceinline__ void add_acc(float (&c)[NT][4], const float (&lo)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[i][e] += lo[i][e];
}

// A warp's strip of NT 16 × 8 tiles, rows m0.., columns n0 + 8i..: c[i] += Σ_k a(m, k)·b(k, n)
// over k < kdim (a multiple of 8), a and b reading shared memory; tiles from column n_end on
// are skipped (left as they were). One A fragment feeds the NT tiles, whose accumulators are
// independent chains.
template <int NT, class FA, class FB>
__device__ __forceinline__ void mma_strip(float (&c)[NT][4], int m0, int n0, int kdim, FA a, FB b,
                                          int n_end = 1 << 30) {
    int g = (threadIdx.x % WARP) / 4, q = threadIdx.x % 4;
    float lo[NT][4];
    zero_acc(lo);
    for (int k0 = 0; k0 < kdim; k0 += 8) {
        float af[4] = {a(m0 + g, k0 + q), a(m0 + g + 8, k0 + q), a(m0 + g, k0 + q + 4),
                       a(m0 + g + 8, k0 + q + 4)};
        mma_kstep(c, lo, af, k0, n0, b, n_end);
    }
    add_acc(c, lo);
}

// mma_strip with the strip's A fragments already in registers (a[ks]: k-step ks, 8·KS deep),
// each multiplied by `sign` (±1: exact, as is the TF32 split of a negated value).
template <int NT, int KS, class FB>
__device__ __forceinline__ void mma_regs(float (&c)[NT][4], const float (&a)[KS][4], float sign, int n0, FB b) {
    float lo[NT][4];
    zero_acc(lo);
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        float af[4] = {sign * a[ks][0], sign * a[ks][1], sign * a[ks][2], sign * a[ks][3]};
        mma_kstep(c, lo, af, 8 * ks, n0, b);
    }
    add_acc(c, lo);
}

// Where element (r, c) of a [C][ncols] matrix lies in fragment order: per 16-row strip, per
// k-step of 8 columns, per lane its four A-fragment values (a0..a3 above), so that a warp loads
// a strip's fragments from global memory as one coalesced float4 per lane and k-step. The
// scan's A operands are read this way, once per warp and chunk, straight into registers.
__device__ __forceinline__ int gdnc_frag(int r, int c, int ncols) {
    int lane = (r % 8) * 4 + c % 4, e = (r % 16) / 8 + 2 * ((c % 8) / 4);
    return (((r / 16) * (ncols / 8) + c / 8) * WARP + lane) * 4 + e;
}

// The (row, column) of accumulator element e of a tile at (m0, n0).
__device__ __forceinline__ int acc_row(int m0, int e) { return m0 + (threadIdx.x % WARP) / 4 + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int acc_col(int n0, int e) { return n0 + 2 * (threadIdx.x % 4) + (e & 1); }

// Copies ROWS × COLS floats (COLS % 4 == 0, 16-byte aligned rows) from global `src` (row
// stride `lds`) into shared `dst` (stride `ldd`), row r scaled by scale(r); rows at or past
// `valid` become 0. The whole block (GDNC_WARPS warps) takes part. Every load is issued before
// the first store: ncu had the prep's warps stalled 15 % of their time on a load-store-load
// chain here, one global round trip per float4.
template <int ROWS, int COLS, class F>
__device__ __forceinline__ void gdnc_load(float* dst, int ldd, const float* src, long lds, int valid, F scale) {
    constexpr int PER_ROW = COLS / 4, THREADS = GDNC_WARPS * WARP;
    constexpr int EACH = (ROWS * PER_ROW + THREADS - 1) / THREADS;
    float4 x[EACH];
#pragma unroll
    for (int e = 0; e < EACH; e++) {
        int i = threadIdx.x + e * THREADS, r = i / PER_ROW, c4 = (i % PER_ROW) * 4;
        x[e] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < ROWS * PER_ROW && r < valid) {
            x[e] = *(const float4*)(src + r * lds + c4);
            float s = scale(r);
            x[e].x *= s; x[e].y *= s; x[e].z *= s; x[e].w *= s;
        }
    }
#pragma unroll
    for (int e = 0; e < EACH; e++) {
        int i = threadIdx.x + e * THREADS, r = i / PER_ROW, c4 = (i % PER_ROW) * 4;
        if (i < ROWS * PER_ROW) *(float4*)(dst + r * ldd + c4) = x[e];
    }
}

// Shared floats of gdn_chunk_prep: K and Q [C][LDK], A and T [C][LDC], γ [C] (doubles), β [C].
#define GDNC_PREP_SHARED (2 * GDNC_C * GDNC_LDK + 2 * GDNC_C * GDNC_LDC + 3 * GDNC_C)
// W's strips: 16 rows × GDNC_WNT tiles of 8 columns (a divisor of DK / 8, at most 8).
#define GDNC_WNT ((DK / 8) % 8 == 0 ? 8 : (DK / 8) % 4 == 0 ? 4 : (DK / 8) % 2 == 0 ? 2 : 1)

// The chunk-parallel part: per (chunk, value head) W, Tβ, P, e^γ, e^{γ_C − γ} into `scratch` (above,
// [NV][chunks][GDNC_FLOATS]). Grid (chunks, NV), GDNC_WARPS·32 threads, GDNC_PREP_SHARED·4
// bytes of dynamic shared memory.
extern "C" __global__ void gdn_chunk_prep(const float* prep, int t, float* scratch) {
    pdl_wait();
    extern __shared__ float4 gdnc_shared4[];
    float* sh = (float*)gdnc_shared4;
    float* Ks = sh;
    float* Qs = Ks + GDNC_C * GDNC_LDK;
    float* As = Qs + GDNC_C * GDNC_LDK;
    float* Ts = As + GDNC_C * GDNC_LDC;
    double* gam = (double*)(Ts + GDNC_C * GDNC_LDC);   // 8-byte aligned: an even float count
    float* bet = (float*)(gam + GDNC_C);
    int chunk = blockIdx.x, j = blockIdx.y, kh = j / (NV / NK);
    int tok0 = chunk * GDNC_C, len = min(GDNC_C, t - tok0);
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float* out = scratch + ((long)j * gridDim.x + chunk) * GDNC_FLOATS;

    const float* qrow = prep + (long)tok0 * 2 * KEY_DIM + kh * DK;
    auto one = [](int) { return 1.f; };
    gdnc_load<GDNC_C, DK>(Qs, GDNC_LDK, qrow, 2 * KEY_DIM, len, one);
    gdnc_load<GDNC_C, DK>(Ks, GDNC_LDK, qrow + KEY_DIM, 2 * KEY_DIM, len, one);
    const float* gates = prep + (long)t * 2 * KEY_DIM + ((long)tok0 * NV + j) * 2;
    if (warp == 0) {
        // g per token (padding: g = 0, β = 0), then γ by a serial sum in token order (lane 0).
        for (int s = lane; s < GDNC_C; s += WARP) {
            gam[s] = s < len ? fmaxf(logf(gates[(long)s * NV * 2]), -256.f) : 0.0;
            bet[s] = s < len ? gates[(long)s * NV * 2 + 1] : 0.f;
        }
        __syncwarp();
        if (lane == 0)
            for (int s = 1; s < GDNC_C; s++) gam[s] += gam[s - 1];
    }
    __syncthreads();

    // K Kᵀ → A (warps 0-3) and Q Kᵀ → P (warps 4-7), each warp a strip of 16 rows × 64, less the
    // tiles wholly right of the diagonal (s > r throughout: masked to 0 below, so never computed).
    {
        bool is_p = warp >= 4;
        int m0 = (warp % 4) * 16;
        const float* L = is_p ? Qs : Ks;
        float c[GDNC_C / 8][4];
        zero_acc(c);
        mma_strip(c, m0, 0, DK, [&](int r, int k) { return L[r * GDNC_LDK + k]; },
                  [&](int k, int n) { return Ks[n * GDNC_LDK + k]; }, m0 + 16);
#pragma unroll
        for (int i = 0; i < GDNC_C / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = acc_row(m0, e), s = acc_col(8 * i, e);
                // Mask before exp: only s ≤ r has a non-positive exponent.
                float d = s <= r ? expf((float)(gam[r] - gam[s])) : 0.f;
                if (is_p) out[GDNC_P + gdnc_frag(r, s, GDNC_C)] = c[i][e] * d;
                else As[r * GDNC_LDC + s] = s < r ? bet[r] * c[i][e] * d : 0.f;
            }
    }
    __syncthreads();

    // T = (I + A)⁻¹ (unit lower triangular) in 16 × 16 blocks. First the diagonal blocks by
    // forward substitution, one column per thread of the first two warps: T_rc = δ_rc −
    // Σ_{c ≤ s < r} A_rs T_sc, at most 15 terms (over all 64 rows, one column per thread, this was
    // a chain of ~2,000 dependent steps on two warps while six waited at the barrier). Meanwhile
    // the other warps zero the blocks above the diagonal and scale K's rows by β e^γ for W (A no
    // longer needs K).
    if (threadIdx.x < GDNC_C) {
        int col = threadIdx.x, r0 = col / 16 * 16;
        for (int r = r0; r < col; r++) Ts[r * GDNC_LDC + col] = 0.f;
        Ts[col * GDNC_LDC + col] = 1.f;
        for (int r = col + 1; r < r0 + 16; r++) {
            float x = 0.f;
            for (int s = col; s < r; s++) x += As[r * GDNC_LDC + s] * Ts[s * GDNC_LDC + col];
            Ts[r * GDNC_LDC + col] = -x;
        }
    } else {
        for (int i = threadIdx.x - GDNC_C; i < GDNC_C * GDNC_C; i += blockDim.x - GDNC_C) {
            int r = i / GDNC_C, s = i % GDNC_C;
            if (s / 16 > r / 16) Ts[r * GDNC_LDC + s] = 0.f;
        }
        for (int i = threadIdx.x - GDNC_C; i < GDNC_C * DK; i += blockDim.x - GDNC_C) {
            int r = i / DK, k = i % DK;
            Ks[r * GDNC_LDK + k] *= bet[r] * expf((float)gam[r]);
        }
    }
    __syncthreads();
    // Then the blocks below the diagonal, one block diagonal d at a time, every thread on an
    // element: T_ij = −T_ii X_ij with X_ij = Σ_{j ≤ k < i} A_ik T_kj (from L T = I, L = I + A),
    // which reads only blocks of T nearer the diagonal. X goes where Q was (P is done with it).
    float* X = Qs;
    for (int d = 1; d < GDNC_C / 16; d++) {
        int n = (GDNC_C / 16 - d) * 256;   // elements of the blocks (jb + d, jb)
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            int jb = e / 256, r = (jb + d) * 16 + (e / 16) % 16, c = jb * 16 + e % 16;
            float x = 0.f;
            for (int s = jb * 16; s < (jb + d) * 16; s++) x += As[r * GDNC_LDC + s] * Ts[s * GDNC_LDC + c];
            X[e] = x;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            int jb = e / 256, i0 = (jb + d) * 16, r = (e / 16) % 16, c = e % 16;
            float x = 0.f;
            for (int s = 0; s <= r; s++) x += Ts[(i0 + r) * GDNC_LDC + i0 + s] * X[jb * 256 + s * 16 + c];
            Ts[(i0 + r) * GDNC_LDC + jb * 16 + c] = -x;
        }
        __syncthreads();
    }

    // W = T · (diag(β e^γ) K): strips of 16 rows × GDNC_WNT tiles, (C/16)·(DK/8)/GDNC_WNT of
    // them (8 at DK 128). T is 0 right of its diagonal, so a strip's sum stops at k = m0 + 16.
    for (int strip = warp; strip < (GDNC_C / 16) * (DK / 8) / GDNC_WNT; strip += GDNC_WARPS) {
        int m0 = (strip % (GDNC_C / 16)) * 16, n0 = (strip / (GDNC_C / 16)) * 8 * GDNC_WNT;
        float c[GDNC_WNT][4];
        zero_acc(c);
        mma_strip(c, m0, n0, m0 + 16, [&](int r, int k) { return Ts[r * GDNC_LDC + k]; },
                  [&](int k, int n) { return Ks[k * GDNC_LDK + n]; });
#pragma unroll
        for (int i = 0; i < GDNC_WNT; i++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                out[GDNC_W + gdnc_frag(acc_row(m0, e), acc_col(n0 + 8 * i, e), DK)] = c[i][e];
    }
    for (int i = threadIdx.x; i < GDNC_C * GDNC_C; i += blockDim.x) {
        int r = i / GDNC_C, s = i % GDNC_C;
        out[GDNC_TB + gdnc_frag(r, s, GDNC_C)] = Ts[r * GDNC_LDC + s] * bet[s];
    }
    for (int i = threadIdx.x; i < GDNC_C; i += blockDim.x) {
        out[GDNC_EG + i] = expf((float)gam[i]);
        out[GDNC_EK + i] = expf((float)(gam[GDNC_C - 1] - gam[i]));   // padding: g = 0, so γ_C
    }
}

// gdn_chunk_scan keeps in shared memory only what every warp reads: the state S and the chunk's
// V and V' (B operands, [k][COLS] with row stride GDNC_LDB: +8 puts a B fragment's 4 rows × 8
// columns in 32 banks). Each A operand (W, Tβ, P, Q, Kᵀ) is read by one warp once per chunk, so
// it goes from global memory straight into that warp's registers, a phase ahead of its use.
#define GDNC_LDB (GDNC_COLS + 8)
// Shared floats of gdn_chunk_scan: S [DK][LDB]; V, V', diag(e^{γ_C − γ}) V' [C][LDB].
#define GDNC_SCAN_SHARED ((DK + 3 * GDNC_C) * GDNC_LDB)
// Tiles of 8 columns in a strip: every strip (of V', O or S) spans the block's COLS columns.
#define GDNC_NT (GDNC_COLS / 8)
// k-steps of 8 over DK (DK % 16 == 0 on the route; rounded up so other shapes still compile).
#define GDNC_KSK ((DK + 7) / 8)
// State strips (16 rows of S) per warp: 1 up to DK = 16·GDNC_WARPS (warps past DK/16 have none).
#define GDNC_SSTRIPS ((DK + 16 * GDNC_WARPS - 1) / (16 * GDNC_WARPS))
// float4s of the chunk's V tile (C × COLS) per thread.
#define GDNC_VPT ((GDNC_C * GDNC_COLS / 4 + GDNC_WARPS * WARP - 1) / (GDNC_WARPS * WARP))

// A strip's A fragments (rows m0.., KS k-steps) of a matrix in fragment order (gdnc_frag).
template <int KS>
__device__ __forceinline__ void frag_load(float (&a)[KS][4], const float* m, int m0) {
    const float4* src = (const float4*)m + (m0 / 16) * KS * WARP + threadIdx.x % WARP;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        float4 x = src[ks * WARP];
        a[ks][0] = x.x; a[ks][1] = x.y; a[ks][2] = x.z; a[ks][3] = x.w;
    }
}

// A strip's A fragments (rows m0.., KS·8 columns) of a chunk's rows of the row-major `m` (row
// stride ld); rows at or past `len` (padding) are 0 and not read.
template <int KS>
__device__ __forceinline__ void frag_load_rows(float (&a)[KS][4], const float* m, long ld, int m0, int len) {
    int g = (threadIdx.x % WARP) / 4, q = threadIdx.x % 4;
    bool ok0 = m0 + g < len, ok1 = m0 + g + 8 < len;
    const float* r0 = m + (m0 + g) * ld;
    const float* r1 = r0 + 8 * ld;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        a[ks][0] = ok0 ? r0[8 * ks + q] : 0.f;
        a[ks][1] = ok1 ? r1[8 * ks + q] : 0.f;
        a[ks][2] = ok0 ? r0[8 * ks + q + 4] : 0.f;
        a[ks][3] = ok1 ? r1[8 * ks + q + 4] : 0.f;
    }
}

// The same for the transpose: A(i, s) = m[s][i] for rows i = m0.. and KS·8 tokens s; tokens at
// or past `len` are 0 and not read.
template <int KS>
__device__ __forceinline__ void frag_load_cols(float (&a)[KS][4], const float* m, long ld, int m0, int len) {
    int g = (threadIdx.x % WARP) / 4, q = threadIdx.x % 4;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        int s0 = 8 * ks + q, s1 = s0 + 4;
        const float* c0 = m + s0 * ld + m0 + g;
        const float* c1 = m + s1 * ld + m0 + g;
        a[ks][0] = s0 < len ? c0[0] : 0.f;
        a[ks][1] = s0 < len ? c0[8] : 0.f;
        a[ks][2] = s1 < len ? c1[0] : 0.f;
        a[ks][3] = s1 < len ? c1[8] : 0.f;
    }
}

// A chunk's V tile (C × COLS from `src`, row stride CONV_DIM; rows at or past `len` 0) into
// registers, GDNC_VPT float4s per thread, and from there into shared V.
__device__ __forceinline__ void v_load(float4 (&v)[GDNC_VPT], const float* src, int len) {
#pragma unroll
    for (int p = 0; p < GDNC_VPT; p++) {
        int i = threadIdx.x + p * GDNC_WARPS * WARP;
        int r = i / (GDNC_COLS / 4), c4 = (i % (GDNC_COLS / 4)) * 4;
        bool ok = i < GDNC_C * GDNC_COLS / 4 && r < len;
        v[p] = ok ? *(const float4*)(src + (long)r * CONV_DIM + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

__device__ __forceinline__ void v_store(float* Vs, const float4 (&v)[GDNC_VPT]) {
#pragma unroll
    for (int p = 0; p < GDNC_VPT; p++) {
        int i = threadIdx.x + p * GDNC_WARPS * WARP;
        int r = i / (GDNC_COLS / 4), c4 = (i % (GDNC_COLS / 4)) * 4;
        if (i < GDNC_C * GDNC_COLS / 4) *(float4*)(Vs + r * GDNC_LDB + c4) = v[p];
    }
}

// The sequential part: GDNC_COLS state columns of one value head through every chunk in order,
// from gdn_chunk_prep's scratch and the q, k, v it started from; writes o[t, NV·DV] (before the
// gated norm) and the final state. Grid (DV / GDNC_COLS, NV), GDNC_WARPS·32 threads,
// GDNC_SCAN_SHARED·4 bytes of dynamic shared memory.
//
// Per chunk, two phases between barriers. Phase 1: warps 0-3 make rows m0.. of V' = Tβ V − W S
// (into shared, also scaled by e^{γ_C − γ} for the state update), warps 4-7 the same rows of
// e^γ ⊙ (Q S), kept in registers. Phase 2: warps 4-7 add P V' and store O; every warp updates its
// strip of S ← e^{γ_C} S + Kᵀ (e^{γ_C − γ} ⊙ V'). Each A operand is loaded for the next chunk as
// soon as its last use in this one is issued, so its latency hides behind the other phase (a
// block is alone on its SM, with no other warps to hide it); the next V likewise goes through
// registers during phase 2. The state-independent loads thus never wait inside the chunk chain.
extern "C" __global__ void __launch_bounds__(GDNC_WARPS * WARP, 1)
gdn_chunk_scan(const float* conv, const float* prep, const float* scratch, int t, float* state, float* out) {
    pdl_wait();
    static_assert(2 * GDNC_C / 16 == GDNC_WARPS, "one strip of V' or O per warp");
    extern __shared__ float4 gdnc_shared4[];
    float* Ss = (float*)gdnc_shared4;
    float* Vs = Ss + DK * GDNC_LDB;
    float* Vp = Vs + GDNC_C * GDNC_LDB;
    float* Vk = Vp + GDNC_C * GDNC_LDB;
    int j = blockIdx.y, kh = j / (NV / NK), col0 = blockIdx.x * GDNC_COLS;
    int warp = threadIdx.x / WARP, g = (threadIdx.x % WARP) / 4;
    int chunks = (t + GDNC_C - 1) / GDNC_C;
    bool vw = warp < GDNC_WARPS / 2;          // a V' warp (else an O warp)
    int m0 = (warp % (GDNC_WARPS / 2)) * 16;  // its strip's first row (token) in the chunk
    float* S = state + (long)j * DK * DV + col0;
    const float* heads = scratch + (long)j * chunks * GDNC_FLOATS;   // chunk c at c·GDNC_FLOATS
    const float* vsrc = conv + 2 * KEY_DIM + j * DV + col0;
    const float* qsrc = prep + kh * DK;       // token rows of 2·KEY_DIM floats, k at + KEY_DIM
    auto len_of = [&](int c) { return min(GDNC_C, t - c * GDNC_C); };

    // a1: −W (V' warps, negated in the product) or Q (O warps), rows m0.. × DK; a2: Tβ or P,
    // rows m0.. × C; kt: Kᵀ, the warp's strips of S rows × C tokens; sc0, sc1: e^{γ_C − γ} (V')
    // or e^γ (O) of rows m0 + g and m0 + g + 8; decay: e^{γ_C}.
    float a1[GDNC_KSK][4], a2[GDNC_C / 8][4], kt[GDNC_SSTRIPS][GDNC_C / 8][4];
    float sc0, sc1, decay;
    float4 v[GDNC_VPT];
    auto load_a1 = [&](int c) {
        if (vw) frag_load(a1, heads + (long)c * GDNC_FLOATS + GDNC_W, m0);
        else frag_load_rows(a1, qsrc + (long)c * GDNC_C * 2 * KEY_DIM, 2 * KEY_DIM, m0, len_of(c));
    };
    auto load_a2 = [&](int c) { frag_load(a2, heads + (long)c * GDNC_FLOATS + (vw ? GDNC_TB : GDNC_P), m0); };
    auto load_kt = [&](int c) {
#pragma unroll
        for (int i = 0; i < GDNC_SSTRIPS; i++) {
            int r0 = (warp + i * GDNC_WARPS) * 16;
            if (r0 < DK)
                frag_load_cols(kt[i], qsrc + KEY_DIM + (long)c * GDNC_C * 2 * KEY_DIM, 2 * KEY_DIM, r0, len_of(c));
        }
    };
    auto load_scales = [&](int c) {
        const float* in = heads + (long)c * GDNC_FLOATS;
        const float* e = in + (vw ? GDNC_EK : GDNC_EG);
        sc0 = e[m0 + g];
        sc1 = e[m0 + g + 8];
        decay = in[GDNC_EG + GDNC_C - 1];
    };

    gdnc_load<DK, GDNC_COLS>(Ss, GDNC_LDB, S, DV, DK, [](int) { return 1.f; });
    v_load(v, vsrc, len_of(0));
    v_store(Vs, v);
    load_a1(0);
    load_a2(0);
    load_kt(0);
    load_scales(0);
    __syncthreads();

    auto from = [](const float* m) { return [m](int k, int n) { return m[k * GDNC_LDB + n]; }; };
    for (int c = 0; c < chunks; c++) {
        // The last chunk's loads for "next" repeat it (harmless, and never out of bounds).
        int tok0 = c * GDNC_C, len = len_of(c), next = min(c + 1, chunks - 1);
        float acc[GDNC_NT][4];
        zero_acc(acc);
        mma_regs(acc, a1, vw ? -1.f : 1.f, 0, from(Ss));
        load_a1(next);
        if (vw) {
            mma_regs(acc, a2, 1.f, 0, from(Vs));
            load_a2(next);
#pragma unroll
            for (int i = 0; i < GDNC_NT; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int at = acc_row(m0, e) * GDNC_LDB + acc_col(8 * i, e);
                    Vp[at] = acc[i][e];
                    Vk[at] = acc[i][e] * (e < 2 ? sc0 : sc1);
                }
        } else {
#pragma unroll
            for (int i = 0; i < GDNC_NT; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][e] *= e < 2 ? sc0 : sc1;
        }
        __syncthreads();

        v_load(v, vsrc + (long)next * GDNC_C * CONV_DIM, len_of(next));
        if (!vw) {
            mma_regs(acc, a2, 1.f, 0, from(Vp));
            load_a2(next);
#pragma unroll
            for (int i = 0; i < GDNC_NT; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int r = acc_row(m0, e);
                    if (r < len) out[(long)(tok0 + r) * NV * DV + j * DV + col0 + acc_col(8 * i, e)] = acc[i][e];
                }
        }
        // Each warp reads and rewrites only its own rows of S (every other read of S was in
        // phase 1, behind the barrier).
#pragma unroll
        for (int i = 0; i < GDNC_SSTRIPS; i++) {
            int r0 = (warp + i * GDNC_WARPS) * 16;
            if (r0 >= DK) break;
            float s[GDNC_NT][4];
#pragma unroll
            for (int n = 0; n < GDNC_NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[n][e] = decay * Ss[acc_row(r0, e) * GDNC_LDB + acc_col(8 * n, e)];
            mma_regs(s, kt[i], 1.f, 0, from(Vk));
#pragma unroll
            for (int n = 0; n < GDNC_NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) Ss[acc_row(r0, e) * GDNC_LDB + acc_col(8 * n, e)] = s[n][e];
        }
        load_kt(next);
        load_scales(next);
        v_store(Vs, v);   // phase 1 was V's only reader
        __syncthreads();
    }
    for (int i = threadIdx.x; i < DK * GDNC_COLS; i += blockDim.x) {
        int r = i / GDNC_COLS, c = i % GDNC_COLS;
        S[(long)r * DV + c] = Ss[r * GDNC_LDB + c];
    }
}
