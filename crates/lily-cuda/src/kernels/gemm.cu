// Y = X · Wᵀ on the tensor cores for prefill: X is f32 activations [rows, K], W a weight as stored
// (4- or 8-bit MLX affine codes, or dense f32). Both are rounded to bf16 on their way into shared
// memory (W dequantised there, w = scale·code + bias rounded once to bf16), so a bf16 copy of a
// weight never exists in global memory; products accumulate in f32 (mma m16n8k16, sm_80+).
//
// A block computes a BM × BN tile of Y with 8 warps, each a WM × 32 tile, WM = min(BM, 64): at
// WM = 64, 4 × 4 mma tiles (per 16 columns of K, 4 ldmatrix of X and 2 of W feed 16 mma); at
// WM = 16, 1 × 4. Dense: BM = BN = 128, warps 2 (rows) × 4 (columns). Grouped: BN = 256, warps
// 1 × 8, and BM the height the expert sort cut the experts' rows at, 16 or 64, one entry each. The host
// picks the height from the average rows per expert: an expert with few rows in a 64-row tile
// spends most of its mma work on padding, while one with many rows in 16-row tiles dequantises
// its weight once per tile, four times as often.
//
// K advances GEMM_BK at a time through two shared buffers: the global loads of step k+1 are
// issued into registers before the mma work of step k and converted into the other buffer after
// it, so their latency hides behind the arithmetic and one barrier per step suffices.
//
// What bounds this kernel is the SM's L1/shared data pipe (128 bytes a cycle; ncu had it 75 %
// busy at 140 TFLOP/s), which ldmatrix, the tile stores and every global load share: a warp's
// global load costs a wavefront per 128-byte line it touches, however few of its bytes it uses.
// So a warp's X load is 4 rows × 128 contiguous bytes (whole lines), and the scales and biases of
// a weight row, a line per row and array whatever their size, are loaded four groups at a time
// (8 bytes) and only when the step enters a new window of groups, not every step.
//
// 4-bit codes become bf16 without float conversions (dequant_b4x8, common.cuh); 8-bit codes
// (byte permutes into 2^23 + code) keep the f32 fmaf.
//
// Shared tiles are rows of 32 bf16 (4 chunks of 16 bytes) with chunk c of row r stored at
// c ^ ((r / 2) % 4): the 8 rows an ldmatrix reads at one logical chunk, the chunks a quarter-warp
// stores and the 8-byte halves a half-warp stores fall in distinct banks. Shared memory is
// dynamic: gemm.rs sizes it by the same formula as gemm_shared_bytes below.

#define GEMM_BK 32
#define GEMM_THREADS 256
#define GEMM_DENSE_BM 128
#define GEMM_DENSE_BN 128
#define GEMM_GROUPED_BN 256

// Dynamic shared memory of a block: two bf16 X tiles, then two bf16 W tiles.
__host__ __device__ constexpr int gemm_shared_bytes(int bm, int bn) { return 2 * (bm + bn) * GEMM_BK * 2; }

// Element offset of (row, 16-byte chunk) in a swizzled shared tile.
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * GEMM_BK + ((chunk ^ ((row >> 1) & 3)) << 3);
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// This thread's share of one X tile (BM × GEMM_BK f32, BM · 8 float4s): piece i is row
// tid/8 + 32·i, columns 4·(tid%8) .. +4 of the step. A warp's load of one piece is 4 rows × 128
// contiguous bytes: 4 whole lines, the fewest its 512 bytes can take. A tile of fewer than 32 rows
// has fewer float4s than the block has threads, so only the first BM · 8 threads (whole warps)
// own a piece; the others store no X (their rows, past BM, are never live, so they load none).
template <int BM>
struct XLoad {
    static constexpr int FLOAT4S = BM * GEMM_BK / 4;
    static constexpr int PIECES = (FLOAT4S + GEMM_THREADS - 1) / GEMM_THREADS;
    static_assert(FLOAT4S % GEMM_THREADS == 0 || (GEMM_THREADS % FLOAT4S == 0 && FLOAT4S % WARP == 0),
                  "an X tile is whole pieces for every thread, or one piece for whole warps");
    float4 v[PIECES];

    static __device__ __forceinline__ bool owned_by(int tid) { return FLOAT4S >= GEMM_THREADS || tid < FLOAT4S; }
};

// Where this thread's X pieces come from: pieces i < live are rows of the block (the rest load
// zeros). Gathered rows keep a pointer a piece; contiguous rows one pointer, piece i being 32·i
// rows on.
template <int BM, bool GATHER>
struct XRows {
    const float* row[GATHER ? XLoad<BM>::PIECES : 1];
    int live;
};

// Loads this thread's pieces at column k (its own column of the step). vec: x rows are 16-byte
// aligned and K % 4 == 0, so a float4 lies wholly inside the row or wholly past it; otherwise
// scalar loads.
template <int BM, bool GATHER>
__device__ __forceinline__ void load_x(XLoad<BM>& r, const XRows<BM, GATHER>& rows, int k, int K, bool vec) {
#pragma unroll
    for (int i = 0; i < XLoad<BM>::PIECES; i++) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < rows.live) {
            const float* src = (GATHER ? rows.row[i] : rows.row[0] + (long)(32 * i) * K) + k;
            if (vec) {
                if (k < K) v = *(const float4*)src;
            } else {
                if (k < K) v.x = src[0];
                if (k + 1 < K) v.y = src[1];
                if (k + 2 < K) v.z = src[2];
                if (k + 3 < K) v.w = src[3];
            }
        }
        r.v[i] = v;
    }
}

// Where store_x puts piece 0 in an X tile (elements): half (tid%8)%2 of chunk (tid%8)/2 of row
// tid/8. Piece i goes 32·i rows on, which swizzle alike.
__device__ __forceinline__ int x_slot(int tid) {
    return swizzled(tid / 8, (tid % 8) / 2) + (tid % 2) * 4;
}

// Rounds this thread's pieces to bf16 into tile sx at its slot, if it owns any (owner:
// XLoad<BM>::owned_by).
template <int BM>
__device__ __forceinline__ void store_x(const XLoad<BM>& r, u16* sx, int slot, bool owner) {
    if (!owner) return;
#pragma unroll
    for (int i = 0; i < XLoad<BM>::PIECES; i++) {
        const float4 v = r.v[i];
        *(uint2*)(sx + slot + 32 * i * GEMM_BK) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    }
}

// This thread's share of one W tile (BN rows × GEMM_BK columns), as loaded from global memory:
// SPAN = BN / 8 consecutive columns of one row (dense 16, grouped 32), row tid / (32 / SPAN),
// columns (tid % (32 / SPAN))·SPAN .. +SPAN of the step. They arrive in LOADS loads of LK
// columns: 4-bit LK = SPAN (8 or 16 bytes of codes; every 4-bit group is a multiple of 32
// columns, so an aligned span of ≤ 32 lies in one group), 8-bit LK = 16 (16 bytes; groups are
// multiples of 16), f32 LK = 8 (two float4).
//
// For codes, load l also keeps the bf16 scales and biases of a window of groups of its row:
// four groups from group `base` (8-byte loads; `wide`: a row has a multiple of 4 groups and the
// arrays are 8-byte aligned), else the one group `base`. `sub` is the group of this step's load
// relative to base, `col` the load's column within its group: advancing a step adds GEMM_BK to
// col, and the window reloads only when sub leaves it.
template <int BITS, int BN>
struct WLoad {
    static constexpr int SPAN = BN * GEMM_BK / GEMM_THREADS;
    static constexpr int LK = BITS == 4 ? SPAN : BITS == 8 ? 16 : 8;
    static constexpr int LOADS = SPAN / LK;
    static constexpr int WORDS = LK * BITS / 32;
    static_assert(SPAN == 16 || SPAN == 32, "a thread's W span is 16 or 32 columns");
    static_assert(WORDS == 2 || WORDS == 4 || WORDS == 8, "loads of 8, 16 or 32 bytes");
    u32 q[LOADS][WORDS];
    u32 scales[LOADS][2], biases[LOADS][2];
    int base[LOADS], sub[LOADS], col[LOADS];
};

template <int BITS, int BN>
__device__ __forceinline__ int w_row(int tid) {
    return tid / (GEMM_BK / WLoad<BITS, BN>::SPAN);
}

template <int BITS, int BN>
__device__ __forceinline__ int w_col(int tid) {
    return (tid % (GEMM_BK / WLoad<BITS, BN>::SPAN)) * WLoad<BITS, BN>::SPAN;
}

// The group windows at the block's first step, column k0 (the only integer divisions, once per
// block).
template <int BITS, int BN>
__device__ __forceinline__ void init_groups(WLoad<BITS, BN>& r, int group, bool wide, int tid, int k0) {
    using L = WLoad<BITS, BN>;
#pragma unroll
    for (int l = 0; l < L::LOADS; l++) {
        const int kk = k0 + w_col<BITS, BN>(tid) + l * L::LK;
        const int g = kk / group;
        r.col[l] = kk % group;
        r.base[l] = wide ? g & ~3 : g;
        r.sub[l] = g - r.base[l];
    }
}

// Moves the windows' positions on by a step: sub past the window (≥ 4 wide, ≥ 1 otherwise) makes
// load_w reload.
template <int BITS, int BN>
__device__ __forceinline__ void next_groups(WLoad<BITS, BN>& r, int group) {
    using L = WLoad<BITS, BN>;
#pragma unroll
    for (int l = 0; l < L::LOADS; l++) {
        r.col[l] += GEMM_BK;
        // A group has at least 16 columns (32 at 4 bits), so a step crosses at most 2 (1) ends.
#pragma unroll
        for (int t = 0; t < (BITS == 4 ? 1 : 2); t++) {
            if (r.col[l] >= group) {
                r.col[l] -= group;
                r.sub[l]++;
            }
        }
    }
}

// Rows [row0, row0 + n_valid) of w feed this block; rows past n_valid and columns past K load
// as zero (codes, scales and biases all zero: w = 0). For codes, K is a multiple of the group
// (≥ 32 for 4-bit, ≥ 16 for 8-bit, checked by the launcher), so a load never straddles a group or
// the end of a row. groups: a row's groups (K / group). first: the windows load (step 0).
template <int BITS, int BN>
__device__ __forceinline__ void load_w(WLoad<BITS, BN>& r, const Mat& w, long row0, int n_valid, int k, bool vec,
                                       bool wide, int groups, int tid, bool first) {
    using L = WLoad<BITS, BN>;
    const int K = w.cols;
    const int row = w_row<BITS, BN>(tid);
    const int col = w_col<BITS, BN>(tid);
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
            if (live) {
                const char* codes = (const char*)w.w + wr * K * BITS / 8 + (long)kk * BITS / 8;
                if constexpr (L::WORDS == 4) {
                    uint4 q = *(const uint4*)codes;
                    r.q[l][0] = q.x; r.q[l][1] = q.y; r.q[l][2] = q.z; r.q[l][3] = q.w;
                } else {
                    uint2 q = *(const uint2*)codes;
                    r.q[l][0] = q.x; r.q[l][1] = q.y;
                }
                // The window moves by whole windows: 4 groups wide, 1 otherwise.
                const int move = r.sub[l] & (wide ? ~3 : ~0);
                if (first || move != 0) {
                    r.base[l] += move;
                    r.sub[l] -= move;
                    const long g = wr * groups + r.base[l];
                    if (wide) {
                        const uint2 s = *(const uint2*)(w.scales + g), b = *(const uint2*)(w.biases + g);
                        r.scales[l][0] = s.x; r.scales[l][1] = s.y;
                        r.biases[l][0] = b.x; r.biases[l][1] = b.y;
                    } else {
                        r.scales[l][0] = w.scales[g]; r.scales[l][1] = 0u;
                        r.biases[l][0] = w.biases[g]; r.biases[l][1] = 0u;
                    }
                }
            } else {
                r.scales[l][0] = r.scales[l][1] = 0u;
                r.biases[l][0] = r.biases[l][1] = 0u;
            }
        }
    }
}

// Where store_w puts this thread's first chunk in a W tile (elements). Its chunk t is at
// slot ^ 8·t: a span of 2 or 4 chunks starts at a multiple of its size, so chunk0 + t =
// chunk0 ^ t, and the swizzle is an XOR too.
template <int BITS, int BN>
__device__ __forceinline__ int w_slot(int tid) {
    return swizzled(w_row<BITS, BN>(tid), w_col<BITS, BN>(tid) / 8);
}

template <int BITS, int BN>
__device__ __forceinline__ void store_w(const WLoad<BITS, BN>& r, u16* sw, int slot) {
    using L = WLoad<BITS, BN>;
#pragma unroll
    for (int l = 0; l < L::LOADS; l++) {
        const u32* words = r.q[l];
        const int chunk = l * L::LK / 8;  // relative to the span's first
        if constexpr (BITS == 32) {
            // 8 values (as f32 bits) become one 16-byte bf16 chunk.
            uint4 out = make_uint4(pack_bf16x2(__uint_as_float(words[0]), __uint_as_float(words[1])),
                                   pack_bf16x2(__uint_as_float(words[2]), __uint_as_float(words[3])),
                                   pack_bf16x2(__uint_as_float(words[4]), __uint_as_float(words[5])),
                                   pack_bf16x2(__uint_as_float(words[6]), __uint_as_float(words[7])));
            *(uint4*)(sw + (slot ^ (8 * chunk))) = out;
        } else if constexpr (BITS == 4) {
            const u32 s2 = window_pair(r.scales[l], r.sub[l]), b2 = window_pair(r.biases[l], r.sub[l]);
            // A word holds 8 codes: one 16-byte chunk of bf16.
#pragma unroll
            for (int j = 0; j < L::WORDS; j++)
                *(uint4*)(sw + (slot ^ (8 * (chunk + j)))) = dequant_b4x8(words[j], s2, b2);
        } else {
            const float s = __uint_as_float(window_pair(r.scales[l], r.sub[l]) & 0xffff0000u);
            const float b = __uint_as_float(window_pair(r.biases[l], r.sub[l]) & 0xffff0000u);
            // Two words hold 8 codes: one chunk. Code i of a word, as 2^23 + code in f32, is its
            // byte i under 0x4B; subtracting 2^23 is exact.
#pragma unroll
            for (int j = 0; j < L::WORDS / 2; j++) {
                u32 out[4];
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    const u32 word = words[2 * j + m / 2];
                    const float c0 = __uint_as_float(byte_perm(word, 0x4b000000u, 0x7540u + 2 * (m % 2))) - 8388608.f;
                    const float c1 = __uint_as_float(byte_perm(word, 0x4b000000u, 0x7541u + 2 * (m % 2))) - 8388608.f;
                    out[m] = pack_bf16x2(__fmaf_rn(s, c0, b), __fmaf_rn(s, c1, b));
                }
                *(uint4*)(sw + (slot ^ (8 * (chunk + j)))) = make_uint4(out[0], out[1], out[2], out[3]);
            }
        }
    }
}

// One block's tile: Y[y_row0 + i, y_col0 + j] = Σ_k X[row i] · W[w_row0 + j] for i < m_valid,
// j < n_valid, k in [k0, k1) (k0 a multiple of GEMM_BK; the whole row, 0 and K, unless split).
// X row i is x_row0 + i, or gather[x_row0 + i] when gather is given; X rows have K values
// (K = w.cols); m_valid ≤ BM. Warps are laid out (BM / WM) × (BN / 32), each computing WM × 32
// as MI × 4 mma tiles.
template <int BITS, int BM, int BN, bool GATHER>
__device__ __forceinline__ void gemm_tile(const Mat& w, long w_row0, int n_valid, const float* __restrict__ x,
                                          const int* __restrict__ gather, long x_row0, int m_valid,
                                          float* __restrict__ y, long y_row0, long ldy, long y_col0, int k0,
                                          int k1) {
    constexpr int WM = BM < 64 ? BM : 64, MI = WM / 16;
    static_assert(WM % 16 == 0 && BM % WM == 0, "warp tiles of whole mma tiles cover the block's rows");
    static_assert((BM / WM) * (BN / 32) * WARP == GEMM_THREADS, "one WM x 32 warp tile per warp");
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    u16* sx = (u16*)gemm_smem;      // [2][BM * GEMM_BK]
    u16* sw = sx + 2 * BM * GEMM_BK;  // [2][BN * GEMM_BK]

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
    // Windows of 4 groups: a row's groups are a multiple of 4 and both arrays 8-byte aligned.
    const int groups = BITS == 32 ? 0 : K / w.group;
    const bool wide = BITS != 32 && groups % 4 == 0 && ((unsigned long long)w.scales & 7) == 0 &&
                      ((unsigned long long)w.biases & 7) == 0;

    constexpr int XP = XLoad<BM>::PIECES;
    XRows<BM, GATHER> x_rows;
    x_rows.live = 0;
#pragma unroll
    for (int i = 0; i < XP; i++) {
        int r = tid / 8 + 32 * i;
        if (r < m_valid) x_rows.live = i + 1;
        if (GATHER || i == 0) {
            long src = gather != nullptr ? (long)gather[x_row0 + min(r, m_valid - 1)] : x_row0 + r;
            x_rows.row[GATHER ? i : 0] = x + src * K;
        }
    }
    const int x_col = (tid % 8) * 4;
    const bool x_owner = XLoad<BM>::owned_by(tid);

    float acc[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

    XLoad<BM> xl;
    WLoad<BITS, BN> wl;
    if constexpr (BITS != 32) init_groups<BITS, BN>(wl, w.group, wide, tid, k0);
    const int steps = (k1 - k0 + GEMM_BK - 1) / GEMM_BK;
    load_x<BM, GATHER>(xl, x_rows, k0 + x_col, K, x_vec);
    load_w<BITS, BN>(wl, w, w_row0, n_valid, k0, w_vec, wide, groups, tid, true);
    const int xs = x_slot(tid), ws = w_slot<BITS, BN>(tid);
    store_x<BM>(xl, sx, xs, x_owner);
    store_w<BITS, BN>(wl, sw, ws);
    __syncthreads();

    // This lane's ldmatrix offsets (bytes) in an X and a W tile at ks = 0. Rows 16 apart swizzle
    // alike (the swizzle reads row bits 1-2), so mma tile i (j) is 16·i rows on; ks = 1 flips bit
    // 1 of the chunk (byte offset bit 5).
    const int wm = (warp / (BN / 32)) * WM, wn = (warp % (BN / 32)) * 32;
    const u32 sx_addr = shared_address(sx), sw_addr = shared_address(sw);
    const u32 a_off = 2 * swizzled(wm + (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);
    const u32 b_off = 2 * swizzled(wn + (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
    for (int step = 0; step < steps; step++) {
        const int buf = step & 1;
        const bool more = step + 1 < steps;
        if (more) {
            const int k = k0 + (step + 1) * GEMM_BK;
            load_x<BM, GATHER>(xl, x_rows, k + x_col, K, x_vec);
            if constexpr (BITS != 32) next_groups<BITS, BN>(wl, w.group);
            load_w<BITS, BN>(wl, w, w_row0, n_valid, k, w_vec, wide, groups, tid, false);
        }
#pragma unroll
        for (int ks = 0; ks < GEMM_BK / 16; ks++) {
            const u32 ta = sx_addr + buf * BM * GEMM_BK * 2 + (a_off ^ (ks * 32));
            const u32 tb = sw_addr + buf * BN * GEMM_BK * 2 + (b_off ^ (ks * 32));
            u32 b[4][2];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                // Matrices: n 0-7 at k 0-7 / k 8-15 (b0, b1 of one n8 tile), then n 8-15.
                u32 r[4];
                ldmatrix_x4(r, tb + j * 16 * GEMM_BK * 2);
                b[2 * j][0] = r[0];
                b[2 * j][1] = r[1];
                b[2 * j + 1][0] = r[2];
                b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MI; i++) {
                // Matrices: rows 0-7 / 8-15 at k 0-7, then the same at k 8-15 (a0..a3).
                u32 a[4];
                ldmatrix_x4(a, ta + i * 16 * GEMM_BK * 2);
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16(acc[i][j], a, b[j][0], b[j][1]);
            }
        }
        if (more) {
            // The other buffers were last read in the previous step, before its closing barrier.
            store_x<BM>(xl, sx + (buf ^ 1) * BM * GEMM_BK, xs, x_owner);
            store_w<BITS, BN>(wl, sw + (buf ^ 1) * BN * GEMM_BK, ws);
        }
        __syncthreads();
    }

    // Accumulator c of mma tile (i, j): row lane/4 (+8 for c ≥ 2), column 2·(lane%4) + c%2.
#pragma unroll
    for (int i = 0; i < MI; i++) {
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

// Dense: Y[r, col0 + n] = Σ_k X[r, k] · W[n, k] for r < m, n < w.rows. Grid (⌈w.rows/128⌉,
// ⌈m/128⌉, splits). Split along K (splits > 1, k_split columns each, a multiple of GEMM_BK), a
// block writes its partial sums to y as [splits, m, w.rows] from col0 = 0, and gemm_reduce adds
// them up: so that few output tiles (small m, narrow w) still fill the GPU.
#define GEMM_DENSE(BITS)                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)                                     \
        gemm_b##BITS(Mat w, const float* x, int m, float* y, int ldy, int col0, int k_split) {       \
        pdl_wait();                                                                                  \
        int n0 = blockIdx.x * GEMM_DENSE_BN;                                                         \
        long r0 = (long)blockIdx.y * GEMM_DENSE_BM;                                                  \
        int k0 = blockIdx.z * k_split;                                                               \
        float* out = y + (long)blockIdx.z * m * ldy;                                                 \
        gemm_tile<BITS, GEMM_DENSE_BM, GEMM_DENSE_BN, false>(w, n0, min(GEMM_DENSE_BN, w.rows - n0), x, nullptr, r0, \
                                                      (int)min((long)GEMM_DENSE_BM, m - r0), out, r0, ldy,    \
                                                      (long)col0 + n0, k0, min(k0 + k_split, w.cols));        \
    }

// y[r, col0 + c] = Σ_s part[s, r, c] over the splits in order (the same sum whatever the launch),
// for r < m, c < n. One thread per output.
extern "C" __global__ void gemm_reduce(const float* part, int splits, int m, int n, float* y, int ldy, int col0) {
    pdl_wait();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)m * n) return;
    long r = i / n, c = i % n;
    float sum = 0.f;
    for (int s = 0; s < splits; s++) sum += part[(long)s * m * n + i];
    y[r * ldy + col0 + c] = sum;
}

// Grouped (MoE experts): w stacks experts of n rows each. Tile t = tiles[3t..3t+3] = {expert,
// first sorted slot, rows}, cut by the sort at this entry's height BM (the host launches the entry
// of the height it sorted with); blocks past *num_tiles return (the host sizes the grid for the
// worst case). Slot s reads X row gather[s] (or s) and writes y[s, 0..n). Grid (⌈n/256⌉, max tiles).
#define GEMM_GROUPED(BM, BITS)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)                                     \
        gemm_grouped##BM##_b##BITS(Mat w, int n, const float* x, const int* gather, const int* tiles, \
                                   const int* num_tiles, float* y) {                                 \
        pdl_wait();                                                                                  \
        int t = blockIdx.y;                                                                          \
        if (t >= *num_tiles) return;                                                                 \
        int expert = tiles[3 * t], slot0 = tiles[3 * t + 1], rows = min(tiles[3 * t + 2], BM);      \
        int n0 = blockIdx.x * GEMM_GROUPED_BN;                                                       \
        /* A tile naming an expert past the stack would read beyond the weight. */                  \
        if (expert < 0 || (long)(expert + 1) * n > w.rows || rows <= 0) return;                      \
        gemm_tile<BITS, BM, GEMM_GROUPED_BN, true>(w, (long)expert * n + n0, min(GEMM_GROUPED_BN, n - n0), x, \
                                                   gather, slot0, rows, y, slot0, n, n0, 0, w.cols);  \
    }

GEMM_DENSE(4)
GEMM_DENSE(8)
GEMM_DENSE(32)
GEMM_GROUPED(16, 4)
GEMM_GROUPED(16, 8)
GEMM_GROUPED(16, 32)
GEMM_GROUPED(64, 4)
GEMM_GROUPED(64, 8)
GEMM_GROUPED(64, 32)
