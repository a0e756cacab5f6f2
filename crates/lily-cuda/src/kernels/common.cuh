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
