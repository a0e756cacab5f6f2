// Synthetic weights made on the device (synthetic.rs): the bytes lily_core::synthetic makes on
// the host, bit for bit, so a synthetic model needs no host copy and no upload. The formula is in
// that module's docs; the hash is integer arithmetic, and every float step below is one rounded
// IEEE operation, written as an intrinsic so that the compiler cannot fuse it into an FMA.

typedef unsigned long long u64;

// rng.rs mix64 (the splitmix64 finaliser).
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Element `index` of the stream `key` (rng.rs uniform_at and synthetic.rs code_word hash alike).
__device__ __forceinline__ u64 stream_bits(u64 key, u64 index) {
    return mix64(key ^ mix64(index + 0x9e3779b97f4a7c15ull));
}

// rng.rs uniform_at: the 24 high bits over 2^24, times 2, minus 1. Each step is exact in f32 (a
// 24-bit integer, a power-of-two scale, a difference that fits the mantissa), as on the host.
__device__ __forceinline__ float uniform_at(u64 key, u64 index) {
    float f = __uint2float_rn((u32)(stream_bits(key, index) >> 40));
    return __fsub_rn(__fmul_rn(__fdiv_rn(f, 16777216.f), 2.f), 1.f);
}

// One quantised module, experts stacked (indices run over the whole stack): code word i for every
// i < words, and the scale and bias of group i for i < groups (never more groups than words).
// `c` is QuantStream::scale, computed on the host; `bits` is 4 or 8.
extern "C" __global__ void synthetic_quant(u32* __restrict__ w, u16* __restrict__ scales,
                                           u16* __restrict__ biases, int words, int groups,
                                           u64 code_key, u64 scale_key, float c, int bits) {
    pdl_wait();
    // (2^bits - 1) / 2: 7.5 or 127.5, exact.
    float middle = __fmul_rn((float)((1u << bits) - 1u), 0.5f);
    long stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        w[i] = (u32)(stream_bits(code_key, (u64)i) >> 32);
        if (i < groups) {
            float u = uniform_at(scale_key, (u64)i);
            u16 s = f32_to_bf16(__fmul_rn(c, __fadd_rn(1.f, __fmul_rn(0.25f, u))));
            scales[i] = s;
            biases[i] = f32_to_bf16(__fmul_rn(-bf16_to_f32(s), middle));
        }
    }
}
