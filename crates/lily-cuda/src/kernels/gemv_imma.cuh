// Decode GEMVs of quantised weights on the integer tensor cores: y[n] = W · x[n] for the rows
// n < nx ≤ 8 of a step, W MLX affine 4- or 8-bit with groups of a multiple of 64 (gemv.cu's
// gemv_q4_* kernels, and through the same core the experts and the router of moe.cu). One mma
// m16n8k32 (u8 codes × s8 x parts, s32 sums) is 16 weight rows × 32 inputs × 8 columns of x
// parts.
//
// Why. The bf16 mma kernels these replace spent ~170 instructions a 64-input slab of 16 rows
// (docs/BENCHMARKS.md, 2.5 bytes an instruction): a code became a bf16 in three instructions, and
// every 16-row unit ended in a block barrier and a cross-warp sum. Here a word of 8 codes becomes
// the two u8 registers an mma takes in three instructions (a mask, a shift, a mask), a warp runs
// whole units alone (or a block splits K where units are too few to fill the GPU), and x is
// staged once per block for all its units: ~45 instructions a slab.
//
// Exact products, exact slab sums. x is staged per slab of 64 inputs as four s8 parts: with d the
// power of two 2^(e − 5) for the slab's largest |x| in [2^e, 2^(e+1)), u = x / d is below 64 in
// magnitude, and r0 = rint(u), r1 = rint(128 (u − r0)), r2, r3 likewise are each in [−64, 64] and
// u = r0 + r1/128 + r2/128² + r3/128³ to 2^-22 of it (28 bits against the largest |x|, more than
// an f32's 24 for every element within 16× of it). Each mma sums code · part exactly in s32, so a
// slab's Σ code · x is exact up to that representation, and only the f32 sums over slabs round,
// as in any f32 dot product: scale · d · Σ code · part per slab, bias · Σx beside it.
//
// Parts as columns. Row n's four parts are columns 4(n % 2) .. 4(n % 2) + 3 of tile n / 2, so one
// or two sequences take one mma per 32 inputs, eight take four. Lane 4g + t holds columns 2t and
// 2t + 1 of its tile: the parts 2(t % 2) and 2(t % 2) + 1 of row 2·tile + t / 2, which it joins in
// s32 (128·c_even + c_odd, below 2^23 for 4-bit codes, so exact as an f32; 8-bit codes' sums are
// converted one by one) and scales by d / 128 or d / 128³; the lanes t and t ^ 1 add their sums
// at the unit's end.
//
// Each row its own bits. A row's parts, its slab factors and sums, and every operation on its
// columns are the same whatever the other rows are (an mma's column depends only on its B column):
// row n gets the same bits alone and in any batch, and the tiles a launch compiles for (by its row
// count) do not change them.
//
// Layout. lane = 4g + t. In slab s, lane t holds the 16 codes of inputs 16t .. 16t + 15 of its
// rows g and g + 8, which mma j (inputs 16t + 8j ..) takes as u8 A registers: the codes of the
// even inputs as k = 4t .. 4t + 3, of the odd ones as k = 16 + 4t .. (4-bit: word j's low and
// high nibbles; 8-bit: a byte permute of words 2j and 2j + 1). Staged x holds, per slab, tile, column and lane t, the 16 bytes of that lane's B
// registers for both mmas, so a lane's x for a slab is one 16-byte load and a warp's 512
// contiguous bytes.
//
// Work (gemv.rs, imma_plan). With `split` 1 every warp takes whole 16-row units in turn; with
// `split` > 1 (a power of two by the matrices' shape and the GPU, never by the row count) a block
// of `split` warps shares each unit, warp s the quads (4 slabs) from s·nq / split to
// (s + 1)·nq / split, and adds their sums in shared memory in warp order. Every lane keeps a ring
// of quads of its weights in registers (imma_ring), the first ones requested before pdl_wait;
// blocks of at most IMMA_WARPS warps of at most 128 registers take half an SM, leaving room for
// the next kernel's block to sit resident and request its own first weights while this one runs.

// IMMA_WARPS, the most warps a block has, comes from gemv.rs as a -D constant.
#define IMMA_SLAB 64
#define IMMA_QUAD 4
// Quads a lane holds in registers (RING − 1 in flight while it computes one), 18 registers each
// for 4-bit codes (34 for 8-bit): as many as leave a block of 8 warps under 128 registers with
// the sums and x of T tiles.
template <int T, int BITS>
__device__ __forceinline__ constexpr int imma_ring() { return BITS == 8 || T == 4 ? 2 : T == 2 ? 3 : 4; }

// c += a · b on one m16n8k32 tile: a the 16 × 32 u8 A fragment (four registers of four codes),
// b0 b1 the 32 × 8 s8 B fragment, s32 sums.
__device__ __forceinline__ void mma_u8s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 2^e for e in [−252, 254], as two exact factors.
__device__ __forceinline__ float pow2i(int e) {
    const int a = e / 2, b = e - e / 2;
    return __uint_as_float((u32)(127 + a) << 23) * __uint_as_float((u32)(127 + b) << 23);
}

// Staged x of a launch of T tiles (rows 0 .. 2T − 1): per slab, tile, column (8) and lane t, the
// 16 bytes of that lane's B registers; then per slab and row, for the lanes of even and odd t, the
// factor of their joined parts and the slab's Σx (the odd lanes' 0, so the bias is added once).
template <int T>
__device__ __forceinline__ int imma_xq_bytes(int slabs) { return slabs * T * 8 * 64; }
template <int T>
__device__ __forceinline__ int imma_xf_at(int s, int n, int odd) { return (s * 2 * T + n) * 2 + odd; }

// Pairs (row, slab) of staged x a warp loads at once: all of one sequence's at the model's widths
// (32 or 64 slabs over 6 to 8 warps), so a normed row is read from L2 once and its loads are one
// round trip; wider launches reload each batch after the norm.
#define IMMA_STAGE_PAIRS 6

// Quantises one (row n, slab s) of staged x (a warp, lane l its inputs 2l and 2l + 1, v).
template <int T>
__device__ __forceinline__ void imma_stage_pair(float2 v, int n, int s, unsigned char* xq, float2* xf) {
    const int lane = threadIdx.x % WARP;
    float sum = __fadd_rn(v.x, v.y), mx = fmaxf(fabsf(v.x), fabsf(v.y));
#pragma unroll
    for (int off = 1; off < WARP; off <<= 1) {
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, off));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    // The slab's exponent e (subnormals as the smallest normal's); non-finite: NaN factors.
    const int bits = (__float_as_uint(mx) >> 23) & 0xff;
    const int e = max(bits, 1) - 127;
    float f0 = pow2i(e - 12), f1 = pow2i(e - 26);
    if (bits == 0xff) f0 = f1 = __int_as_float(0x7fc00000);
    if (mx == 0.f) f0 = f1 = 0.f;
    const float up = pow2i(5 - e);
    float u[2] = {bits == 0xff ? 0.f : __fmul_rn(v.x, up), bits == 0xff ? 0.f : __fmul_rn(v.y, up)};
    u32 r[2] = {0u, 0u};
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float rq = rintf(u[h]);
            r[h] |= ((u32)(int)rq & 0xffu) << (8 * q);
            u[h] = __fmul_rn(__fsub_rn(u[h], rq), 128.f);
        }
    // Lane l's inputs go to B register e (input parity) of mma j of lane t, byte i:
    // k = 16t + 8j + 2i + e for t = l / 8, j = l / 4 % 2, i = l % 4.
    unsigned char* col = xq + ((s * T + n / 2) * 8 + (n % 2) * 4) * 64 + (lane / 8) * 16 + (lane / 4 % 2) * 8 + lane % 4;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        col[q * 64] = (unsigned char)(r[0] >> (8 * q));
        col[q * 64 + 4] = (unsigned char)(r[1] >> (8 * q));
    }
    if (lane == 0) {
        xf[imma_xf_at<T>(s, n, 0)] = make_float2(f0, sum);
        xf[imma_xf_at<T>(s, n, 1)] = make_float2(f1, 0.f);
    }
}

// Rows nx .. 2T − 1 of staged x, which hold no sequence: zero parts (four columns of 64 bytes a
// slab) and factors.
template <int T>
__device__ __forceinline__ void imma_zero_rows(int nx, int slabs, unsigned char* xq, float2* xf) {
    for (int i = threadIdx.x; i < (2 * T - nx) * slabs * 16; i += blockDim.x) {
        const int n = nx + i / (slabs * 16), s = i / 16 % slabs;
        ((uint4*)(xq + ((s * T + n / 2) * 8 + (n % 2) * 4) * 64))[i % 16] = make_uint4(0u, 0u, 0u, 0u);
        if (i % 16 < 2) xf[imma_xf_at<T>(s, n, i % 16)] = make_float2(0.f, 0.f);
    }
}

// Stages rows n < nx of x (or RMSNorm(x[n]) · norm_w); rows nx .. 2T − 1 as zeros. Warp w takes
// the pairs p = n · slabs + s ≡ w (mod warps) and sums each row's squares over them in order: for
// row n, the slabs of one class s ≡ w − n · slabs, in the order the row alone sums that class.
// The classes' sums are then added in the alone order, so a row's norm has the same bits in any
// batch. Ends with a barrier.
template <int T>
__device__ void imma_stage_x(int cols, int nx, const float* x, const float* norm_w, float eps, unsigned char* xq,
                           float2* xf, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const int slabs = cols / IMMA_SLAB, pairs = nx * slabs;
    imma_zero_rows<T>(nx, slabs, xq, xf);
    auto load = [&](int p, float2& v, float2& w) {
        const int n = p / slabs, k = (p - n * slabs) * IMMA_SLAB + 2 * lane;
        v = load_act2(x + (long)n * cols + k);
        if (norm_w) w = *(const float2*)(norm_w + k);
    };
    float2 v[IMMA_STAGE_PAIRS], w[IMMA_STAGE_PAIRS];
    // The batch of pairs from p0, a warp apart.
    auto load_batch = [&](int p0) {
#pragma unroll
        for (int i = 0; i < IMMA_STAGE_PAIRS; i++)
            if (p0 + i * warps < pairs) load(p0 + i * warps, v[i], w[i]);
    };
    const bool kept = pairs <= warps * IMMA_STAGE_PAIRS;
    float inv[2 * T];
    if (norm_w) {
        float ss[2 * T] = {};
        for (int p0 = warp; p0 < pairs; p0 += warps * IMMA_STAGE_PAIRS) {
            load_batch(p0);
#pragma unroll
            for (int i = 0; i < IMMA_STAGE_PAIRS; i++) {
                const int p = p0 + i * warps;
                if (p >= pairs) break;
                const float sq = __fmaf_rn(v[i].y, v[i].y, __fmul_rn(v[i].x, v[i].x));
                const int row = p / slabs;
                // Every row's sum takes an add (of 0 but for the pair's row): a guarded add
                // becomes an indexed one, which puts the sums in local memory.
#pragma unroll
                for (int n = 0; n < 2 * T; n++) ss[n] = __fadd_rn(ss[n], row == n ? sq : 0.f);
            }
        }
#pragma unroll
        for (int n = 0; n < 2 * T; n++) {
            const float t = warp_sum(ss[n]);
            if (lane == 0) scratch[n * IMMA_WARPS + warp] = t;
        }
        __syncthreads();
#pragma unroll
        for (int n = 0; n < 2 * T; n++) {
            float total = 0.f;
            // Row n's slab s went to warp (n·slabs + s) mod warps: summed from the warp that
            // holds its slabs ≡ 0, as the row alone (n = 0) sums them, whatever its place.
            for (int c = 0; c < warps; c++)
                total = __fadd_rn(total, scratch[n * IMMA_WARPS + (c + n * slabs) % warps]);
            inv[n] = rsqrtf(total / cols + eps);
        }
    }
    for (int p0 = warp; p0 < pairs; p0 += warps * IMMA_STAGE_PAIRS) {
        if (!(norm_w && kept)) load_batch(p0);
#pragma unroll
        for (int i = 0; i < IMMA_STAGE_PAIRS; i++) {
            const int p = p0 + i * warps;
            if (p >= pairs) break;
            const int n = p / slabs;
            float2 u = v[i];
            if (norm_w) {
                float in = inv[0];
#pragma unroll
                for (int r = 1; r < 2 * T; r++) in = n == r ? inv[r] : in;
                u = make_float2(__fmul_rn(__fmul_rn(u.x, in), w[i].x), __fmul_rn(__fmul_rn(u.y, in), w[i].y));
            }
            imma_stage_pair<T>(u, n, p - n * slabs, xq, xf);
        }
    }
    __syncthreads();
}

// A lane's weights of one quad: per slab its 16 codes of rows g and g + 8, and of each row one of
// the quad's four words of bf16 scales and biases (two slabs a word, slab 2i in the low half):
// lane t holds the scales of slabs 2t, 2t + 1 (t < 2) or the biases of slabs 2t − 4, 2t − 3, and
// the quad's compute gathers them from the four lanes of its group. A word each instead of all
// four saves 6 registers a quad, which buy the ring a quad more in flight.
template <int BITS>
struct ImmaStage {
    u32 q[IMMA_QUAD][2][BITS / 2];
    u32 sb[2];
};

// What follows from the launch's format (its matrices share columns and groups), worked out once.
struct ImmaFormat {
    int slabs, quads, groups;
    // Groups of one slab and whole quads a row (every matrix of the real model): a row's four
    // scales are one 8-byte load, and so are its biases.
    bool packed;
};

__device__ __forceinline__ ImmaFormat imma_format(const Mat& m) {
    const int slabs = m.cols / IMMA_SLAB;
    return ImmaFormat{slabs, (slabs + IMMA_QUAD - 1) / IMMA_QUAD, m.cols / m.group, m.group == IMMA_SLAB && slabs % IMMA_QUAD == 0};
}

// Where a warp is in its work: unit u (units past the last: done), quad q of its part of the row.
struct ImmaCursor {
    int u, q, r0, base, which;
};

__device__ __forceinline__ u32 ld_pair(const void* p) { return *(const u32*)p; }

// The lane's codes of quad q of a row whose codes start at `row` (BITS / 2 words a slab); the
// slabs past the row's `slabs` are not read (FULL: there are none).
template <int BITS, bool FULL>
__device__ __forceinline__ void imma_load_codes(ImmaStage<BITS>& st, int h, const char* row, int q, int slabs, int lane) {
    const char* w = row + (q * IMMA_QUAD * IMMA_SLAB + 16 * (lane % 4)) * BITS / 8;
#pragma unroll
    for (int i = 0; i < IMMA_QUAD; i++) {
        if (!FULL && q * IMMA_QUAD + i >= slabs) break;
        const char* at = w + i * IMMA_SLAB * BITS / 8;
        if constexpr (BITS == 4) {
            const uint2 v = *(const uint2*)at;
            st.q[i][h][0] = v.x, st.q[i][h][1] = v.y;
        } else {
            const uint4 v = *(const uint4*)at;
            st.q[i][h][0] = v.x, st.q[i][h][1] = v.y, st.q[i][h][2] = v.z, st.q[i][h][3] = v.w;
        }
    }
}

// Requests quad c.q of the 16 rows of unit c (a ragged unit's last rows repeat its matrix's last).
template <int BITS>
__device__ __forceinline__ void imma_load(ImmaStage<BITS>& st, const Mat& m, const ImmaFormat& f, const ImmaCursor& c, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long row = min(c.r0 + g + 8 * h, m.rows - 1);
        const char* codes = (const char*)m.w + row * m.cols * BITS / 8;
        if (f.packed)
            imma_load_codes<BITS, true>(st, h, codes, c.q, f.slabs, lane);
        else
            imma_load_codes<BITS, false>(st, h, codes, c.q, f.slabs, lane);
        const u16* sb = t < 2 ? m.scales : m.biases;
        const int s0 = c.q * IMMA_QUAD + 2 * (t % 2);
        if (f.packed) {
            st.sb[h] = *(const u32*)(sb + row * f.groups + s0);
        } else {
            u32 word = 0u;
#pragma unroll
            for (int e = 0; e < 2; e++)
                if (s0 + e < f.slabs) word |= (u32)sb[row * f.groups + (s0 + e) * IMMA_SLAB / m.group] << (16 * e);
            st.sb[h] = word;
        }
    }
}

// The bf16 of slab i of a quad's pair of words, as an f32.
__device__ __forceinline__ float imma_half(const u32 (&w)[2], int i) {
    const u32 v = w[i / 2];
    return __uint_as_float(i % 2 ? v & 0xffff0000u : v << 16);
}

// A lane's sums over its unit so far: per tile, rows g and g + 8 of its columns' row.
template <int T>
struct ImmaAcc {
    float v[T][2];
};

// acc += quad q of the lane's rows (the slabs of it below the row's end; FULL: all four are, so the
// slabs' work can interleave).
template <int T, bool FULL, int BITS>
__device__ __forceinline__ void imma_quad(const ImmaStage<BITS>& st, int q, int slabs, const uint4* xq, const float2* xf,
                                        int lane, ImmaAcc<T>& acc) {
    const int g = lane / 4, t = lane % 4;
    // Row h's scale words (slabs 0-1, 2-3) and bias words, from lanes 4g .. 4g + 3.
    u32 sw[2][2], bw[2][2];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            sw[h][e] = __shfl_sync(0xffffffffu, st.sb[h], 4 * g + e);
            bw[h][e] = __shfl_sync(0xffffffffu, st.sb[h], 4 * g + 2 + e);
        }
#pragma unroll
    for (int i = 0; i < IMMA_QUAD; i++) {
        const int s = q * IMMA_QUAD + i;
        if (!FULL && s >= slabs) break;
        // Per mma j and row h, the codes of the even inputs (lo) and of the odd ones (hi).
        u32 lo[2][2], hi[2][2];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                if constexpr (BITS == 4) {
                    lo[j][h] = st.q[i][h][j] & 0x0f0f0f0fu;
                    hi[j][h] = (st.q[i][h][j] >> 4) & 0x0f0f0f0fu;
                } else {
                    lo[j][h] = byte_perm(st.q[i][h][2 * j], st.q[i][h][2 * j + 1], 0x6420u);
                    hi[j][h] = byte_perm(st.q[i][h][2 * j], st.q[i][h][2 * j + 1], 0x7531u);
                }
            }
        float scale[2], bias[2];
#pragma unroll
        for (int h = 0; h < 2; h++) scale[h] = imma_half(sw[h], i), bias[h] = imma_half(bw[h], i);
#pragma unroll
        for (int tile = 0; tile < T; tile++) {
            const uint4 xb = xq[((s * T + tile) * 8 + g) * 4 + t];
            int c[4] = {0, 0, 0, 0};
            mma_u8s8(c, lo[0][0], lo[0][1], hi[0][0], hi[0][1], xb.x, xb.y);
            mma_u8s8(c, lo[1][0], lo[1][1], hi[1][0], hi[1][1], xb.z, xb.w);
            const float2 f = xf[imma_xf_at<T>(s, 2 * tile + t / 2, t % 2)];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float sf = __fmul_rn(scale[h], f.x);
                if constexpr (BITS == 4) {
                    acc.v[tile][h] = __fmaf_rn(sf, (float)(c[2 * h] * 128 + c[2 * h + 1]), acc.v[tile][h]);
                } else {
                    // Sums of 8-bit codes reach 2^20: joined they would not be exact in an f32.
                    acc.v[tile][h] = __fmaf_rn(__fmul_rn(sf, 128.f), (float)c[2 * h], acc.v[tile][h]);
                    acc.v[tile][h] = __fmaf_rn(sf, (float)c[2 * h + 1], acc.v[tile][h]);
                }
                acc.v[tile][h] = __fmaf_rn(bias[h], f.y, acc.v[tile][h]);
            }
        }
    }
}

// Shared memory of a q4 launch (dynamic; gemv.rs's imma_shared_bytes computes the same size):
// staged x, its slab factors and sums, the split's partial sums (two buffers a warp), the norm's
// scratch.
template <int T>
__device__ __forceinline__ int imma_red_float2s() { return 2 * IMMA_WARPS * T * WARP; }

// The work of a launch: `units` units of 16 rows, each over every quad of K, against x staged in
// shared memory. The launch says what x and a unit are through four callbacks:
//   stage(xq, xf, scratch)       stages x (after pdl_wait; imma_stage_x, or another staging that
//       leaves the same layout), ending with a barrier;
//   locate(ImmaCursor& c)          fills c.r0, c.base, c.which for unit c.u (< units);
//   load(ImmaStage&, const ImmaCursor&)  requests quad c.q of the lane's rows g and g + 8 of unit c.u;
//   store(const ImmaCursor&, float (&v)[T][2])  called by the lanes of even t of the warp that holds
//       the unit's result: v[tile][h] is row g + 8h against x row 2·tile + t / 2.
// With split 1 every warp takes whole units in turn; with split > 1 the block is the `split`
// warps that share each unit, warp s the quads s·nq / split .. (s + 1)·nq / split, and warp 0
// adds the others' sums in order. The first quads are requested before pdl_wait: a launch whose
// rows depend on another kernel's output waits before calling this.
template <int T, int BITS, int RING = imma_ring<T, BITS>(), class Stage, class Locate, class Load, class Store>
__device__ void imma_units(int units, const ImmaFormat& f, int split, Stage stage, Locate locate, Load load, Store store) {
    extern __shared__ __align__(16) unsigned char imma_smem[];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    unsigned char* xq = imma_smem;
    float2* xf = (float2*)(xq + imma_xq_bytes<T>(f.slabs));
    float2* red = xf + f.slabs * 2 * T * 2;
    float* scratch = (float*)(red + imma_red_float2s<T>());
    const int per_block = split > 1 ? 1 : blockDim.x / WARP, groups = gridDim.x * per_block;
    const int group = blockIdx.x * per_block + (split > 1 ? 0 : warp), s = split > 1 ? warp : 0;
    const int q_begin = s * f.quads / split, q_end = (s + 1) * f.quads / split;
    auto at_unit = [&](ImmaCursor& c, int u) {
        c.u = u;
        c.q = q_begin;
        if (u < units) locate(c);
    };
    auto advance = [&](ImmaCursor& c) {
        if (++c.q == q_end) at_unit(c, c.u + groups);
    };
    ImmaAcc<T> acc = {};
    int buf = 0;
    // The unit's result: lanes t and t ^ 1 join their parts; a split's warps add theirs in warp
    // order; then the lanes of even t store.
    auto finish = [&](const ImmaCursor& c) {
        float v[T][2];
#pragma unroll
        for (int tile = 0; tile < T; tile++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float other = __shfl_xor_sync(0xffffffffu, acc.v[tile][h], 1);
                v[tile][h] = lane % 2 ? __fadd_rn(other, acc.v[tile][h]) : __fadd_rn(acc.v[tile][h], other);
            }
        acc = {};
        if (split > 1) {
            float2* mine = red + buf * IMMA_WARPS * T * WARP;
#pragma unroll
            for (int tile = 0; tile < T; tile++) mine[(warp * T + tile) * WARP + lane] = make_float2(v[tile][0], v[tile][1]);
            __syncthreads();
            buf ^= 1;
            if (s != 0) return;
#pragma unroll
            for (int tile = 0; tile < T; tile++)
                for (int w = 1; w < split; w++) {
                    const float2 o = mine[(w * T + tile) * WARP + lane];
                    v[tile][0] = __fadd_rn(v[tile][0], o.x);
                    v[tile][1] = __fadd_rn(v[tile][1], o.y);
                }
        }
        if (lane % 2 == 0) store(c, v);
    };
    const uint4* xq4 = (const uint4*)xq;
    // A quad from ring slot st, which then takes the quad RING ahead: each lane has the next
    // RING − 1 quads in flight while it computes one, and no copies between slots.
    ImmaCursor c, ahead;
    auto step = [&](ImmaStage<BITS>& st) {
        if (f.packed)
            imma_quad<T, true>(st, c.q, f.slabs, xq4, xf, lane, acc);
        else
            imma_quad<T, false>(st, c.q, f.slabs, xq4, xf, lane, acc);
        if (ahead.u < units) load(st, ahead);
        advance(ahead);
        if (c.q == q_end - 1) finish(c);
        advance(c);
    };
    ImmaStage<BITS> ring[RING];
    at_unit(c, group);
    ahead = c;
#pragma unroll
    for (int i = 0; i < RING; i++) {
        if (ahead.u < units) load(ring[i], ahead);
        advance(ahead);
    }
    pdl_wait();
    stage(xq, xf, scratch);
    while (c.u < units) {
#pragma unroll
        for (int i = 0; i < RING; i++)
            if (c.u < units) step(ring[i]);
    }
}

// put(n, at, v) for every output `at` of the rows of [m0 | m1 | m2 | m3] (end to end) against
// x[n], n < nx ≤ 2T, x[n] being what `stage` stages (imma_units); each output is put by one lane.
// Every matrix has BITS-bit codes, K = m0.cols (a multiple of 64) and groups of a multiple of 64
// inputs. Returns the matrices' units (every thread).
template <int T, int BITS, class Stage, class Put>
__device__ int gemv_imma_put(Mat m0, Mat m1, Mat m2, Mat m3, int nx, Stage stage, Put put, int split) {
    const ImmaFormat f = imma_format(m0);
    const int lane = threadIdx.x % WARP;
    const Mat ms[4] = {m0, m1, m2, m3};
    const MatUnits<16, Mat[4]> mu{ms, 4};
    const int units = (int)mu.count();
    auto locate = [&](ImmaCursor& c) {
        long r0, base;
        mu.locate(c.u, c.which, r0, base);
        c.r0 = (int)r0;
        c.base = (int)base;
    };
    auto load = [&](ImmaStage<BITS>& st, const ImmaCursor& c) { imma_load<BITS>(st, mat_of(ms, c.which), f, c, lane); };
    auto store = [&](const ImmaCursor& c, const float (&v)[T][2]) {
        const int g = lane / 4, t = lane % 4, rows = mat_of(ms, c.which).rows;
#pragma unroll
        for (int tile = 0; tile < T; tile++) {
            const int n = 2 * tile + t / 2;
            if (n >= nx) continue;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = c.r0 + g + 8 * h;
                if (r < rows) put(n, c.base + r, v[tile][h]);
            }
        }
    };
    imma_units<T, BITS>(units, f, split, stage, locate, load, store);
    return units;
}

// y[n · ystride + at] (= or +=) the outputs of gemv_imma_put, ystride being all the matrices' rows.
template <int T, int BITS, class Stage>
__device__ int gemv_imma_staged(Mat m0, Mat m1, Mat m2, Mat m3, int nx, Stage stage, float* y, bool add, int split) {
    const int ystride = m0.rows + m1.rows + m2.rows + m3.rows;
    auto put = [&](int n, int at, float v) {
        float* o = y + (long)n * ystride + at;
        *o = add ? __fadd_rn(*o, v) : v;
    };
    return gemv_imma_put<T, BITS>(m0, m1, m2, m3, nx, stage, put, split);
}

// The same over x[n] (or RMSNorm(x[n]) · norm_w, x[n] being a residual stream).
template <int T, int BITS>
__device__ int gemv_imma(Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* x, const float* norm_w, float eps,
                         float* y, bool add, int split) {
    auto stage = [&](unsigned char* xq, float2* xf, float* scratch) {
        imma_stage_x<T>(m0.cols, nx, x, norm_w, eps, xq, xf, scratch);
    };
    return gemv_imma_staged<T, BITS>(m0, m1, m2, m3, nx, stage, y, add, split);
}

// Heads of the Gated DeltaNet's output a warp stages at once: all of one sequence's (32 value
// heads over 8 warps) in one round trip.
#define IMMA_GATED_HEADS 4

// Stages rows n < nx of the Gated DeltaNet's gated norm, RMSNorm(o[n] head by head) · w ·
// silu(z[n]) with z the proj row's z part (the graph step's gdn_gated_norm, fused into the output
// projection's staging): a warp per (row, head), its DV / 64 slabs. Ends with a barrier.
template <int T>
__device__ void imma_stage_gated(int nx, const float* o, const float* proj, const float* w, float eps,
                                 unsigned char* xq, float2* xf) {
    // Slabs a head (gemv.rs, gated_fits: DV a multiple of 64; at least one, so that models the
    // fused path does not take still compile).
    constexpr int HS = DV / IMMA_SLAB > 0 ? DV / IMMA_SLAB : 1;
    constexpr long CONV = 2 * NK * DK + NV * DV, PROJ = CONV + NV * DV + 2 * NV;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const int heads = nx * NV;
    imma_zero_rows<T>(nx, NV * HS, xq, xf);
    for (int p0 = warp; p0 < heads; p0 += warps * IMMA_GATED_HEADS) {
        float2 v[IMMA_GATED_HEADS][HS], z[IMMA_GATED_HEADS][HS];
#pragma unroll
        for (int i = 0; i < IMMA_GATED_HEADS; i++) {
            const int p = p0 + i * warps, n = p / NV, j = p % NV;
            if (p < heads)
#pragma unroll
                for (int hs = 0; hs < HS; hs++) {
                    const int k = j * DV + hs * IMMA_SLAB + 2 * lane;
                    v[i][hs] = load_act2(o + (long)n * NV * DV + k);
                    z[i][hs] = load_act2(proj + n * PROJ + CONV + k);
                }
        }
#pragma unroll
        for (int i = 0; i < IMMA_GATED_HEADS; i++) {
            const int p = p0 + i * warps, n = p / NV, j = p % NV;
            if (p >= heads) break;
            float ss = 0.f;
#pragma unroll
            for (int hs = 0; hs < HS; hs++) ss = __fmaf_rn(v[i][hs].y, v[i][hs].y, __fmaf_rn(v[i][hs].x, v[i][hs].x, ss));
            const float inv = rsqrtf(warp_sum(ss) / DV + eps);
#pragma unroll
            for (int hs = 0; hs < HS; hs++) {
                const int d = hs * IMMA_SLAB + 2 * lane;
                const float2 y = make_float2(v[i][hs].x * inv * w[d] * siluf(z[i][hs].x),
                                             v[i][hs].y * inv * w[d + 1] * siluf(z[i][hs].y));
                imma_stage_pair<T>(y, n, j * HS + hs, xq, xf);
            }
        }
    }
    __syncthreads();
}

// y[n] += W · (RMSNorm(o[n]) · w · silu(z[n])) per value head: the Gated DeltaNet's output
// projection with its gated norm staged as x (4-bit W).
template <int T>
__device__ void gemv_imma_gated(Mat m, int nx, const float* o, const float* proj, const float* norm_w, float eps,
                                float* y, int split) {
    auto stage = [&](unsigned char* xq, float2* xf, float*) { imma_stage_gated<T>(nx, o, proj, norm_w, eps, xq, xf); };
    gemv_imma_staged<T, 4>(m, Mat{}, Mat{}, Mat{}, nx, stage, y, true, split);
}

// The Gated DeltaNet's input projection, proj[n] = [qkv | z | b | a] · RMSNorm(hidden[n]) · norm_w,
// with the causal conv fused into the outputs' stores (the graph step's gdn_conv): a q|k|v
// channel goes through the conv and SiLU (gdn_conv_channel) by the lane that computed it, which
// slides that channel's window, into conv[n]; z, b and a go into proj[n].
template <int T>
__device__ void gemv_imma_gdn_in(Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* hidden, const float* norm_w,
                                 float eps, float* proj, const float* conv_w, RowPtrs window, float* conv, int split) {
    auto stage = [&](unsigned char* xq, float2* xf, float* scratch) {
        imma_stage_x<T>(m0.cols, nx, hidden, norm_w, eps, xq, xf, scratch);
    };
    const int ystride = m0.rows + m1.rows + m2.rows + m3.rows;
    auto put = [&](int n, int at, float v) {
        if (at < CONV_DIM)
            conv[n * CONV_DIM + at] = gdn_conv_channel(at, v, conv_w, (float*)window.at(n));
        else
            proj[(long)n * ystride + at] = v;
    };
    gemv_imma_put<T, 4>(m0, m1, m2, m3, nx, stage, put, split);
}
