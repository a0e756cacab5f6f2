// Shared by every kernel file (prepended by the Rust side before NVRTC compiles a file).
// Model dimensions arrive as -D constants (see compile.rs), so loops over them unroll and
// register arrays have fixed sizes. No CUDA headers: NVRTC needs none of them here.

typedef unsigned int u32;
typedef unsigned short u16;

#define WARP 32
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }

// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// The KV cache element: bf16 in production (20 KiB per token), f32 when KV_F32 is set, which
// tests use to compare with the f32 CPU reference without the bf16 rounding.
#if KV_F32
typedef float kv_t;
__device__ __forceinline__ float kv_load(kv_t v) { return v; }
__device__ __forceinline__ kv_t kv_store(float f) { return f; }
#else
typedef u16 kv_t;
__device__ __forceinline__ float kv_load(kv_t v) { return bf16_to_f32(v); }
__device__ __forceinline__ kv_t kv_store(float f) { return f32_to_bf16(f); }
#endif

// Programmatic dependent launch (gpu.rs launches every kernel allowed to start before the previous
// one ends, on sm_90+). Before pdl_wait() a kernel may read only weights, which no kernel writes;
// pdl_wait() returns once the previous kernel has finished and its writes are visible, and then
// lets the next kernel be scheduled, so that kernel's blocks can request their weights while this
// one runs (one kernel ahead, never more). No-ops below sm_90 and on a normal launch.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Loads of activations through L2 only (ld.global.cg). Within the persistent decode step a buffer
// is rewritten by other SMs between two reads of it (every layer reuses the same scratch), and an
// SM's L1 may still hold the earlier lines; L2 is coherent across the GPU.
__device__ __forceinline__ float ldcg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int ldcg_int(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ldcg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

// Loads of weights, which nothing writes while a kernel runs: through the read-only path, and not
// kept in L1 (each byte is read once a step). Explicitly global, so that a pointer read from a
// table in memory (the persistent step's) still gives a global load, not a generic one.
__device__ __forceinline__ uint4 ld_weight4(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
__device__ __forceinline__ u16 ld_weight16(const u16* p) {
    u16 v;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// The loads the shared device code makes of activations and weights. In the persistent decode
// step (decode.cu, compiled with STEP_PERSISTENT) activations go through L2, since other SMs
// rewrite them within the launch, and weights, whose addresses come from a table in memory,
// through explicitly global read-only loads. In a kernel of its own both are plain loads, as
// before the persistent step existed (the graph step's SASS unchanged by it).
#if STEP_PERSISTENT
__device__ __forceinline__ float load_act(const float* p) { return ldcg(p); }
__device__ __forceinline__ float4 load_act4(const float* p) { return ldcg4(p); }
__device__ __forceinline__ int load_act_int(const int* p) { return ldcg_int(p); }
__device__ __forceinline__ uint4 load_weight4(const void* p) { return ld_weight4(p); }
__device__ __forceinline__ u16 load_weight16(const u16* p) { return ld_weight16(p); }
#else
__device__ __forceinline__ float load_act(const float* p) { return *p; }
__device__ __forceinline__ float4 load_act4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ int load_act_int(const int* p) { return *p; }
__device__ __forceinline__ uint4 load_weight4(const void* p) { return *(const uint4*)p; }
__device__ __forceinline__ u16 load_weight16(const u16* p) { return *p; }
#endif

// Asks L2 for the line holding p (weights a kernel will read after pdl_wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; `scratch` holds one float per warp. Every thread gets the result.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int i = 0; i < warps; i++) total += scratch[i];
    return total;
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = -INFINITY;
    for (int i = 0; i < warps; i++) m = fmaxf(m, scratch[i]);
    return m;
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float siluf(float x) { return x * sigmoidf(x); }

// A weight matrix [rows, cols] as stored: dense f32 (bits == 32), or MLX affine with `bits`
// (4 or 8) codes packed low-first in u32 words and a bf16 scale and bias per `group` inputs.
struct Mat {
    const void* w;
    const u16* scales;
    const u16* biases;
    int rows;
    int cols;
    int group;
};

// ---- bf16 pairs for the tensor-core kernels (gemm.cu, gemm_wgmma.cu, attention_prefill.cu) ----

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    // cvt puts its first source in the upper half; rounds to nearest even like f32_to_bf16.
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Bytes of {b, a} picked by the four selector nibbles (prmt: bytes 0-3 are a's, 4-7 b's).
__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// a · b + c on bf16 pairs, rounded once.
__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// The bf16 pair (v, v) of group sub (0-3) of a window of 4 bf16 in two words.
__device__ __forceinline__ u32 window_pair(const u32 (&win)[2], int sub) {
    return byte_perm(win[0], win[1], 0x1010u + 0x2222u * (u32)sub);
}

// The 8 4-bit codes of word q (code i in bits 4i..4i+3) as 8 bf16 scale·code + bias, one 16-byte
// chunk; s2 and b2 hold the scale and bias as bf16 pairs (v, v). No float conversions: pair m
// (codes 2m, 2m+1) is byte m of q and of q >> 4, whose low nibbles a byte permute and a masked OR
// put into the mantissas of a bf16 pair 128 + code; one bf16x2 fma subtracts 128 (exact), one
// more computes scale·code + bias with a single rounding. That is the bf16 of the f32
// fmaf(scale, code, bias) whenever the f32 result is exact, as it is for MLX's groups: the bias
// is 0 or q0·scale with 1 ≤ |q0| ≤ 15, so scale·code + bias spans at most 20 bits.
__device__ __forceinline__ uint4 dequant_b4x8(u32 q, u32 s2, u32 b2) {
    const u32 q4 = q >> 4;
    u32 out[4];
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const u32 biased = (byte_perm(q, q4, (u32)m | ((u32)(4 + m) << 8)) & 0x000f000fu) | 0x43004300u;
        const u32 code = fma_bf16x2(biased, 0x3f803f80u, 0xc300c300u);  // (128 + c)·1 − 128
        out[m] = fma_bf16x2(code, s2, b2);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// An integer code below 2^23 as a float without the quarter-rate int-to-float conversion: the
// code becomes the mantissa of 2^23 + code, and 2^23 is subtracted (exact). Dequantisation is the
// hot loop of every decode GEMV.
__device__ __forceinline__ float code_to_f32(u32 code) {
    return __uint_as_float(0x4B000000u | code) - 8388608.f;
}

// One row of a matrix as a kernel reads it.
struct RowRef {
    const void* w;       // the row's codes (or f32 values)
    const u16* scales;   // its groups' scales and biases (affine only)
    const u16* biases;
};

__device__ __forceinline__ RowRef row_ref(const Mat& m, long r, int bits) {
    long groups = m.cols / m.group;
    return RowRef{(const char*)m.w + r * (long)m.cols * bits / 8, m.scales + r * groups, m.biases + r * groups};
}

// This lane's shares of R rows · x (rows with the same columns and group), summed into acc; the
// caller reduces across the warp. Lanes stride over 16-byte chunks so a warp reads 512
// contiguous bytes of a row per step, and each x chunk, loaded once into registers, serves all
// R rows: x costs one read per R rows instead of one per row.
template <int BITS, int R>
__device__ __forceinline__ void rows_dot_lane(const RowRef (&rows)[R], int n, int cols, int group,
                                              const float* __restrict__ x, int lane, float (&acc)[R]) {
    if constexpr (BITS == 32) {
        for (int c = lane; c < cols; c += WARP) {
            float xv = x[c];
#pragma unroll
            for (int r = 0; r < R; r++)
                if (r < n) acc[r] += ((const float*)rows[r].w)[c] * xv;
        }
    } else {
        constexpr int PER = 128 / BITS;   // codes in 16 bytes
        constexpr u32 MASK = (1u << BITS) - 1u;
        for (int ch = lane; ch < cols / PER; ch += WARP) {
            float xs[PER];
            const float4* xv = (const float4*)(x + ch * PER);
#pragma unroll
            for (int i = 0; i < PER / 4; i++) {
                float4 v = xv[i];
                xs[4 * i] = v.x; xs[4 * i + 1] = v.y; xs[4 * i + 2] = v.z; xs[4 * i + 3] = v.w;
            }
            float sx = 0.f;
#pragma unroll
            for (int i = 0; i < PER; i++) sx += xs[i];
            int g = ch * PER / group;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= n) break;
                uint4 q = ((const uint4*)rows[r].w)[ch];
                u32 words[4] = {q.x, q.y, q.z, q.w};
                float dq = 0.f;
#pragma unroll
                for (int i = 0; i < PER; i++)
                    dq += code_to_f32((words[i / (32 / BITS)] >> ((i % (32 / BITS)) * BITS)) & MASK) * xs[i];
                acc[r] += bf16_to_f32(rows[r].scales[g]) * dq + bf16_to_f32(rows[r].biases[g]) * sx;
            }
        }
    }
}

// Element (r, c) of a matrix, dequantised (for gathers such as the embedding row).
template <int BITS>
__device__ __forceinline__ float mat_at(const Mat& m, long r, int c) {
    if constexpr (BITS == 32) {
        return ((const float*)m.w)[r * m.cols + c];
    } else {
        const int words_per_row = m.cols * BITS / 32;
        u32 word = ((const u32*)m.w)[r * words_per_row + c * BITS / 32];
        u32 code = (word >> ((c % (32 / BITS)) * BITS)) & ((1u << BITS) - 1u);
        long g = r * (m.cols / m.group) + c / m.group;
        return bf16_to_f32(m.scales[g]) * (float)code + bf16_to_f32(m.biases[g]);
    }
}

// ---- Decode GEMVs with x staged in shared memory (gemv.cu, moe.cu) ----
//
// Each block stages the input vector once in shared memory; a warp then computes R rows at a time,
// lanes striding over the rows' 16-byte chunks (a warp reads 512 contiguous bytes of a row per
// load). Staged x is padded by XS_PAD floats after every chunk's values, so the lanes' float4 reads
// of x (lanes one chunk apart) hit distinct banks, and prescaled by 2^-(BITS·p) for a code's
// position p in its 16-bit half word: a code then becomes a float with one mask-and-or and one
// subtraction, no shift (see dot_batch). The sum of each chunk's x, needed for the biases, is
// staged too.

// Widest input the staged GEMVs take (the host checks).
#define XS_COLS 8192
#define XS_PAD 4

// Codes in one 16-byte chunk (1 for dense f32, which has no chunks).
#define CHUNK_CODES(BITS) ((BITS) == 32 ? 1 : 128 / (BITS))
// Floats of the staged x and of its chunk sums.
#define XS_FLOATS(BITS) ((BITS) == 32 ? XS_COLS : XS_COLS / CHUNK_CODES(BITS) * (CHUNK_CODES(BITS) + XS_PAD))
#define XSUM_FLOATS(BITS) ((BITS) == 32 ? 1 : XS_COLS / CHUNK_CODES(BITS))

template <int BITS>
__device__ __forceinline__ int xs_at(int c) {
    if constexpr (BITS == 32) {
        return c;
    } else {
        constexpr int PER = 128 / BITS;
        return c / PER * (PER + XS_PAD) + c % PER;
    }
}

// 2^-(BITS·p), p the position of column c's code in its 16-bit half word.
template <int BITS>
__device__ __forceinline__ float xs_prescale(int c) {
    if constexpr (BITS == 32) {
        return 1.f;
    } else {
        return __uint_as_float((u32)(127 - BITS * (c % (16 / BITS))) << 23);
    }
}

// Loads per thread issued together by the staging loops below: staging is on every staged
// kernel's critical path, and a loop that waits for each load in turn costs microseconds.
#define STAGE_UNROLL 4

// 1 / RMS(h[0..n)) as add_rms_norm computes it. Every block of a launch gets identical bits (same
// summation order), so rows computed by different blocks see the same normalised vector.
__device__ float block_inv_rms(const float* h, int n, float eps, float* scratch) {
    float ss = 0.f;
    if (n % 4 == 0) {
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x * STAGE_UNROLL) {
            float4 v[STAGE_UNROLL];
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; u++) {
                int j = i + u * blockDim.x;
                v[u] = j < n / 4 ? load_act4(h + 4 * j) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; u++)
                ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ss += load_act(h + i) * load_act(h + i);
    }
    return rsqrtf(block_sum(ss, scratch) / n + eps);
}

// Stores float4 j (< n4; past it, only the shuffles) of a quantised matrix's staged x: prescaled
// into xs at its padded place, and the plain sum of its chunk (T = CHUNK_CODES / 4 adjacent
// threads) into xsum. Whole warps must call it together (blockDim and the loop end are multiples of
// WARP).
template <int BITS>
__device__ __forceinline__ void stage_float4(float4 v, int j, int n4, float* xs, float* xsum) {
    constexpr int T = 128 / BITS / 4;
    if (j < n4) {
        int col = 4 * j;
        *(float4*)(xs + xs_at<BITS>(col)) =
            make_float4(v.x * xs_prescale<BITS>(col), v.y * xs_prescale<BITS>(col + 1),
                        v.z * xs_prescale<BITS>(col + 2), v.w * xs_prescale<BITS>(col + 3));
    }
    float sum = v.x + v.y + v.z + v.w;
    for (int o = T / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (j < n4 && j % T == 0) xsum[j / T] = sum;
}

// Stages x[c] (or x[c] · inv · norm_w[c] with norm_w) for c in [0, cols) into xs (padded,
// prescaled) and each chunk's plain sum into xsum. Every thread of the block must call it (whole
// warps take part in the shuffles); it ends with a barrier. For quantised matrices cols is a
// multiple of CHUNK_CODES(BITS), and x and norm_w are 16-byte aligned (device buffers).
template <int BITS>
__device__ void stage_x(int cols, const float* x, const float* norm_w, float inv, float* xs, float* xsum) {
    if constexpr (BITS == 32) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x * STAGE_UNROLL) {
            float v[STAGE_UNROLL];
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; u++) {
                int j = c + u * blockDim.x;
                v[u] = j < cols ? (norm_w ? load_act(x + j) * inv * norm_w[j] : load_act(x + j)) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; u++)
                if (c + u * blockDim.x < cols) xs[c + u * blockDim.x] = v[u];
        }
    } else {
        // One float4 of x per thread and step; a chunk's values are adjacent threads' float4s.
        int n4 = cols / 4, end = (n4 + WARP - 1) / WARP * WARP;
        const float4* w4 = (const float4*)norm_w;
        for (int c = threadIdx.x; c < end; c += blockDim.x * STAGE_UNROLL) {
            float4 v[STAGE_UNROLL];
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; u++) {
                int j = c + u * blockDim.x;
                v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (j < n4) {
                    v[u] = load_act4(x + 4 * j);
                    if (norm_w) {
                        float4 w = w4[j];
                        v[u] = make_float4(v[u].x * inv * w.x, v[u].y * inv * w.y, v[u].z * inv * w.z,
                                           v[u].w * inv * w.w);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; u++) stage_float4<BITS>(v[u], c + u * blockDim.x, n4, xs, xsum);
        }
    }
    __syncthreads();
}

// One lane's weight loads for NB chunks of R rows (chunk lane + j·WARP from `base`), all issued
// before any arithmetic so that R·NB 16-byte loads are in flight.
template <int BITS, int R, int NB>
struct Batch {
    uint4 q[R][NB];
    u16 scale[R][NB];
    u16 bias[R][NB];
};

template <int BITS, int R, int NB>
__device__ __forceinline__ void load_batch(Batch<BITS, R, NB>& b, const RowRef (&rows)[R], int base,
                                           int chunks, int group, int lane) {
    constexpr int PER = 128 / BITS;
#pragma unroll
    for (int j = 0; j < NB; j++) {
        int ch = base + lane + j * WARP;
        if (ch < chunks) {
            int g = ch * PER / group;
#pragma unroll
            for (int r = 0; r < R; r++) {
                b.q[r][j] = load_weight4((const uint4*)rows[r].w + ch);
                b.scale[r][j] = load_weight16(rows[r].scales + g);
                b.bias[r][j] = load_weight16(rows[r].biases + g);
            }
        }
    }
}

// (v & mask) | magic as one LOP3. Written as C, ptxas emits two: a LOP3 takes one immediate, and
// both mask and magic are constants. magic comes from magic_reg() (a register), mask stays the
// immediate; that is one instruction less per code in the dequantisation loops below.
__device__ __forceinline__ u32 mask_or(u32 v, u32 mask, u32 magic) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "r"(mask), "r"(magic));
    return r;
}

// 0x4B000000 (the bits of 2^23) in a register the compiler cannot fold back into an immediate.
__device__ __forceinline__ u32 magic_reg() {
    u32 r;
    asm("mov.b32 %0, 0x4B000000;" : "=r"(r));
    return r;
}

// acc[r] += this lane's share of row r · x for the batch's chunks. Row r reads x from chunk
// xoff[r] on (0 for a plain GEMV; the slot's segment for the expert down projection). SHARED_X:
// every row reads the same x, loaded once per chunk.
template <int BITS, int R, int NB, bool SHARED_X>
__device__ __forceinline__ void dot_batch(const Batch<BITS, R, NB>& b, int base, int chunks,
                                          const int (&xoff)[R], const float* xs, const float* xsum,
                                          int lane, float (&acc)[R]) {
    constexpr int PER = 128 / BITS, HALF = 16 / BITS, WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const u32 magic = magic_reg();
#pragma unroll
    for (int j = 0; j < NB; j++) {
        int ch = base + lane + j * WARP;
        if (ch >= chunks) break;
        float xf[PER];
        float sx = 0.f;
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r == 0 || !SHARED_X) {
                int at = xoff[r] + ch;
                const float4* xv = (const float4*)(xs + at * (PER + XS_PAD));
#pragma unroll
                for (int i = 0; i < PER / 4; i++) {
                    float4 v = xv[i];
                    xf[4 * i] = v.x; xf[4 * i + 1] = v.y; xf[4 * i + 2] = v.z; xf[4 * i + 3] = v.w;
                }
                sx = xsum[at];
            }
            u32 words[4] = {b.q[r][j].x, b.q[r][j].y, b.q[r][j].z, b.q[r][j].w};
            float dq = 0.f;
#pragma unroll
            for (int i = 0; i < PER; i++) {
                int p = i % WORD;
                u32 v = p >= HALF ? words[i / WORD] >> 16 : words[i / WORD];
                // code · 2^(BITS·(p % HALF)), exactly; xf carries the inverse power of two.
                float code = __uint_as_float(mask_or(v, MASK << (BITS * (p % HALF)), magic)) - 8388608.f;
                dq += code * xf[i];
            }
            acc[r] += bf16_to_f32(b.scale[r][j]) * dq + bf16_to_f32(b.bias[r][j]) * sx;
        }
    }
}

// Requests R rows' codes into L2, a 128-byte line per lane and step.
template <int BITS, int R>
__device__ __forceinline__ void prefetch_rows(const RowRef (&rows)[R], int cols, int lane) {
    long bytes = (long)cols * BITS / 8;
#pragma unroll
    for (int r = 0; r < R; r++)
        for (long off = lane * 128L; off < bytes; off += WARP * 128L) prefetch_l2((const char*)rows[r].w + off);
}

// Units of R rows, one warp each, warp-strided over the grid (any grid size works). rows_of(u,
// rows, xoff) fills the unit's row references (clamping ragged ones to a valid row); store(u, acc)
// gets the lanes' unreduced partials. The first unit's weights are requested before x is staged
// (stage() must stage with stage_x), so the two latencies overlap. Every thread must call this.
//
// The units are spread over blocks blk of nblk (blockIdx.x of gridDim.x for a kernel of its own;
// the persistent decode step passes the blocks it gives the stage).
template <int BITS, int R, int NB, bool SHARED_X, bool ROWS_FIXED, class RowsOf, class Stage, class Store>
__device__ void staged_units(long units, int cols, int group, RowsOf rows_of, Stage stage,
                             Store store, const float* xs, const float* xsum, int blk, int nblk) {
    int lane = threadIdx.x % WARP;
    long stride = (long)nblk * (blockDim.x / WARP);
    // Block-fastest numbering: when the units do not divide evenly among the warps, the extra
    // ones (u ≥ stride) spread over every block, so over every SM, instead of piling onto the
    // first blocks' SMs.
    long u = (long)(threadIdx.x / WARP) * nblk + blk;
    RowRef rows[R];
    int xoff[R];
    if constexpr (BITS == 32) {
        pdl_wait();
        stage();
        for (; u < units; u += stride) {
            rows_of(u, rows, xoff);
            float acc[R] = {};
            for (int c = lane; c < cols; c += WARP) {
#pragma unroll
                for (int r = 0; r < R; r++) acc[r] += ((const float*)rows[r].w)[c] * xs[xoff[r] + c];
            }
            store(u, acc);
        }
    } else {
        constexpr int PER = 128 / BITS;
        int chunks = cols / PER;
        Batch<BITS, R, NB> b;
        // Rows that do not depend on earlier kernels are requested while the previous kernel
        // finishes: this warp's first unit (its first batch into registers, the rest into L2)
        // and its next. Otherwise the same requests follow the wait; the next unit goes into L2
        // either way, so DRAM streams it while this one computes.
        if constexpr (!ROWS_FIXED) pdl_wait();
        if (u < units) {
            rows_of(u, rows, xoff);
            load_batch<BITS, R, NB>(b, rows, 0, chunks, group, lane);
            if constexpr (ROWS_FIXED) prefetch_rows<BITS, R>(rows, cols, lane);
            if (u + stride < units) {
                RowRef next[R];
                int next_off[R];
                rows_of(u + stride, next, next_off);
                prefetch_rows<BITS, R>(next, cols, lane);
            }
        }
        if constexpr (ROWS_FIXED) pdl_wait();
        stage();
        for (; u < units; u += stride) {
            float acc[R] = {};
            for (int base = 0; base < chunks; base += WARP * NB) {
                if (base > 0) load_batch<BITS, R, NB>(b, rows, base, chunks, group, lane);
                dot_batch<BITS, R, NB, SHARED_X>(b, base, chunks, xoff, xs, xsum, lane, acc);
            }
            if (u + stride < units) {
                rows_of(u + stride, rows, xoff);
                load_batch<BITS, R, NB>(b, rows, 0, chunks, group, lane);
            }
            store(u, acc);
        }
    }
}

// Rows one warp of the staged GEMV computes: x chunks loaded from shared memory serve all four.
#define GEMV_ROWS 4
// Chunks per lane per row whose loads are issued together (2 covers a 2,048-wide 4-bit row).
#define GEMV_BATCH 2

// Rows [ms[0] | ... | ms[nm - 1]] · x, ROWS rows per warp and unit, NB chunks per lane and row
// loaded together, over blocks blk of nblk; all the matrices share x (so their columns). ms may
// point into global memory (the persistent step's weight table): each unit reads its matrix's
// fields from there instead of the kernel holding every matrix in registers; a kernel of its own
// passes its parameters as an array (Mat[4]), which stays in registers. stage() stages x
// with stage_x into xs / xsum (after the first rows are requested); out(which, row, at, v) takes row
// `row` of matrix `which` (at = row plus the rows of the matrices before it: its place when the
// outputs lie end to end), once, from lane 0 of the warp that computed it.
template <int BITS, int ROWS, int NB, class Mats, class Stage, class Out>
__device__ void gemv_mats(const Mats& ms, int nm, Stage stage, Out out, const float* xs, const float* xsum, int blk,
                          int nblk) {
    long units = 0;
    for (int i = 0; i < nm; i++) units += (ms[i].rows + ROWS - 1) / ROWS;
    // Unit u → its matrix, first row and the offset of that matrix's rows in y (the rows of the
    // matrices before it). Each matrix gets whole units.
    auto locate = [&](long u, int& which, long& r0, long& base) {
        base = 0;
        which = nm - 1;
        for (int i = 0; i < nm; i++) {
            long n = (ms[i].rows + ROWS - 1) / ROWS;
            if (u < n) { which = i; break; }
            u -= n;
            base += ms[i].rows;
        }
        r0 = u * ROWS;
    };
    auto rows_of = [&](long u, RowRef (&rows)[ROWS], int (&xoff)[ROWS]) {
        int which; long r0, base;
        locate(u, which, r0, base);
        const Mat& m = ms[which];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            rows[r] = row_ref(m, min(r0 + r, (long)m.rows - 1), BITS);
            xoff[r] = 0;
        }
    };
    auto store = [&](long u, float (&acc)[ROWS]) {
        int which; long r0, base;
        locate(u, which, r0, base);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float v = warp_sum(acc[r]);
            if (threadIdx.x % WARP == 0 && r0 + r < ms[which].rows) out(which, r0 + r, base + r0 + r, v);
        }
    };
    staged_units<BITS, ROWS, NB, true, true>(units, ms[0].cols, ms[0].group, rows_of, stage, store, xs, xsum,
                                              blk, nblk);
}

// Stages x, or RMSNorm(x) · norm_w when norm_w is given (x being the residual stream, normalised
// by every block while staging: identical bits in every block).
template <int BITS>
__device__ void stage_maybe_normed(int cols, const float* x, const float* norm_w, float eps, float* xs,
                                   float* xsum, float* scratch) {
    float inv = norm_w ? block_inv_rms(x, cols, eps, scratch) : 1.f;
    stage_x<BITS>(cols, x, norm_w, inv, xs, xsum);
}

// y = [m0 | m1 | m2 | m3] · x, outputs end to end. With norm_w, x is the residual stream and the
// rows see RMSNorm(x) · norm_w. With add, y += W · x (the residual add of the mixer output and
// expert projections, each element owned by one lane: no race).
template <int BITS, int ROWS = GEMV_ROWS, int NB = GEMV_BATCH>
__device__ void gemv_staged(Mat m0, Mat m1, Mat m2, Mat m3, const float* x, const float* norm_w,
                            float eps, float* y, bool add) {
    __shared__ __align__(16) float xs[XS_FLOATS(BITS)];
    __shared__ float xsum[XSUM_FLOATS(BITS)];
    __shared__ float scratch[32];
    const Mat ms[4] = {m0, m1, m2, m3};
    auto stage = [&]() { stage_maybe_normed<BITS>(m0.cols, x, norm_w, eps, xs, xsum, scratch); };
    auto out = [&](int, long, long at, float v) { y[at] = add ? y[at] + v : v; };
    gemv_mats<BITS, ROWS, NB>(ms, 4, stage, out, xs, xsum, blockIdx.x, gridDim.x);
}
