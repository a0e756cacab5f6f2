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

// In-graph timestamps (CudaOptions::stamps; stamps.rs reads them): with LILY_STAMPS defined,
// thread 0 of every block that reaches a wait appends one record to the buffer the host points
// lily_stamps at (a count, then records of four words): the launch (%gridid), when the block
// reached the wait (its weights already requested), when the wait returned (the kernel before
// it done), and the block's index and SM. Without the define the waits are as they were.
#ifdef LILY_STAMPS
typedef unsigned long long u64;
#define STAMP_WORDS 4
__device__ u64* lily_stamps;
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Thread 0's record of point `point` (0: a wait, from `t0` to `t1`; else a point inside the
// kernel, at t0 = t1).
__device__ __forceinline__ void stamp_record(u32 point, u64 t0, u64 t1) {
    if (threadIdx.x != 0 || lily_stamps == nullptr) return;
    u64 grid;
    u32 sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const u64 at = atomicAdd(lily_stamps, 1ull);
    if (at >= lily_stamps[1]) return;
    u64* r = lily_stamps + 2 + STAMP_WORDS * at;
    const u64 block = blockIdx.x + (u64)gridDim.x * (blockIdx.y + (u64)gridDim.y * blockIdx.z);
    r[0] = grid;
    r[1] = t0;
    r[2] = t1;
    r[3] = block | (u64)sm << 40 | (u64)point << 56;
}
__device__ __forceinline__ void stamp_wait(u64 reached) { stamp_record(0, reached, global_ns()); }
// A point inside a kernel (1 to 255: its phase, stamps.rs names them), thread 0's time on
// reaching it; STAMP_END(k) first waits for the whole block, so it marks the block's end.
__device__ __forceinline__ void stamp_point(u32 point) {
    const u64 t = global_ns();
    stamp_record(point, t, t);
}
#define STAMP_REACHED const u64 stamp_reached = global_ns();
#define STAMP_READY stamp_wait(stamp_reached);
#define STAMP_AT(k) stamp_point(k);
#define STAMP_END(k)    \
    {                    \
        __syncthreads(); \
        stamp_point(k);  \
    }
#else
#define STAMP_REACHED
#define STAMP_READY
#define STAMP_AT(k)
#define STAMP_END(k)
#endif

// Programmatic dependent launch (gpu.rs launches every kernel allowed to start before the previous
// one ends, on sm_90+). Before pdl_wait() a kernel may read only weights, which no kernel writes;
// pdl_wait() returns once the previous kernel has finished and its writes are visible, and then
// lets the next kernel be scheduled, so that kernel's blocks can request their weights while this
// one runs (one kernel ahead, never more). No-ops below sm_90 and on a normal launch.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    STAMP_REACHED
    asm volatile("griddepcontrol.wait;" ::: "memory");
    STAMP_READY
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The wait of pdl_wait() alone: the next kernel may not start yet. For a kernel that writes what
// the next one reads before its own wait (moe_route_gate_up's choice of experts): it lets the next
// kernel start through a later pdl_wait(), once that is written.
__device__ __forceinline__ void pdl_wait_holding_next() {
#if __CUDA_ARCH__ >= 900
    STAMP_REACHED
    asm volatile("griddepcontrol.wait;" ::: "memory");
    STAMP_READY
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
__device__ __forceinline__ float2 ldcg2(const float* p) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
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
__device__ __forceinline__ float2 load_act2(const float* p) { return ldcg2(p); }
__device__ __forceinline__ float4 load_act4(const float* p) { return ldcg4(p); }
__device__ __forceinline__ int load_act_int(const int* p) { return ldcg_int(p); }
__device__ __forceinline__ uint4 load_weight4(const void* p) { return ld_weight4(p); }
__device__ __forceinline__ u16 load_weight16(const u16* p) { return ld_weight16(p); }
#else
__device__ __forceinline__ float load_act(const float* p) { return *p; }
__device__ __forceinline__ float2 load_act2(const float* p) { return *(const float2*)p; }
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

// Two sums over the whole block with one pair of barriers; scratch holds two floats per warp.
__device__ float2 block_sum_pair(float a, float b, float (*scratch)[WARP]) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) scratch[0][warp] = a, scratch[1][warp] = b;
    __syncthreads();
    float2 total = make_float2(0.f, 0.f);
    for (int i = 0; i < warps; i++) total.x += scratch[0][i], total.y += scratch[1][i];
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

// A batched decode step's per-sequence buffers and counts (gpu.rs, RowPtrs and RowInts): row
// r's is entry r. The step's activations lie row after row instead ([row][width], one buffer).
//
// Read an entry with at(r), never p[r]: indexing a kernel parameter by a runtime value makes
// ptxas copy the whole parameter into each thread's local memory first (attn_split: a 224-byte
// frame, 28 stores, and a local load at the head of its chain). Selecting among constant indices
// reads the parameter bank in place.
#define MAX_ROWS 8
template <typename T>
__device__ __forceinline__ T select_row(const T (&v)[MAX_ROWS], int r) {
    T out = v[0];
#pragma unroll
    for (int i = 1; i < MAX_ROWS; ++i) out = r == i ? v[i] : out;
    return out;
}
struct RowPtrs {
    void* p[MAX_ROWS];
    __device__ __forceinline__ void* at(int r) const { return select_row(p, r); }
};
struct RowInts {
    int n[MAX_ROWS];
    __device__ __forceinline__ int at(int r) const { return select_row(n, r); }
};

// ---- bf16 pairs for the tensor-core kernels (gemm.cu, gemm_wgmma.cu, attention_prefill.cu) ----

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    // cvt puts its first source in the upper half; rounds to nearest even like f32_to_bf16.
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += a · b on one m16n8k16 tile (sm_80+): a the 16 × 16 bf16 A fragment, b0 b1 the 16 × 8 B
// fragment, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
