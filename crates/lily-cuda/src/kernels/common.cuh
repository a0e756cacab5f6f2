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

// This lane's share of row `r` · x; the caller sums across the warp. Lanes stride over 16-byte
// chunks so a warp reads 512 contiguous bytes per step.
template <int BITS>
__device__ __forceinline__ float row_dot_lane(const Mat& m, long r, const float* __restrict__ x, int lane) {
    float acc = 0.f;
    if constexpr (BITS == 32) {
        const float* row = (const float*)m.w + r * m.cols;
        for (int c = lane; c < m.cols; c += WARP) acc += row[c] * x[c];
        return acc;
    } else {
    const int per_chunk = 128 / BITS;               // codes in 16 bytes
    const int words_per_row = m.cols * BITS / 32;
    const uint4* row = (const uint4*)((const u32*)m.w + r * words_per_row);
    const u16* sc = m.scales + r * (m.cols / m.group);
    const u16* bi = m.biases + r * (m.cols / m.group);
    const u32 mask = (1u << BITS) - 1u;
    for (int ch = lane; ch < m.cols / per_chunk; ch += WARP) {
        uint4 q = row[ch];
        int c0 = ch * per_chunk;
        const float4* xv = (const float4*)(x + c0);
        float dq = 0.f, sx = 0.f;
        u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int wi = 0; wi < 4; wi++) {
#pragma unroll
            for (int j = 0; j < 32 / BITS; j += 4) {
                float4 xx = xv[(wi * (32 / BITS) + j) / 4];
                u32 w = words[wi] >> (j * BITS);
                dq += (float)(w & mask) * xx.x + (float)((w >> BITS) & mask) * xx.y
                    + (float)((w >> (2 * BITS)) & mask) * xx.z + (float)((w >> (3 * BITS)) & mask) * xx.w;
                sx += xx.x + xx.y + xx.z + xx.w;
            }
        }
        int g = c0 / m.group;
        acc += bf16_to_f32(sc[g]) * dq + bf16_to_f32(bi[g]) * sx;
    }
    return acc;
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
