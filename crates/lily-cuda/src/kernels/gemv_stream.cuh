// The persistent decode step's GEMV units (decode.cu only, STEP_PERSISTENT): weights stream
// through a ring of shared-memory stages per warp by cp.async, several slabs ahead of the math.
//
// Why: the persistent step runs one block of 8 warps an SM. Loading weights into registers, a
// warp has one batch in flight (4 KB) and then computes, about 4 MB over the GPU against the
// ~6 MB that 4.8 TB/s × ~1.3 µs of DRAM latency needs in flight; and the batch's registers
// spilled in the one kernel that holds every op. cp.async holds no registers while in flight, so
// a warp keeps STREAM_STAGES − 1 slabs requested (10 KB of codes at 18 KB a warp) while it
// computes one, and an op's first slabs are requested before x is staged.
//
// Each lane copies exactly the bytes it later reads (its own 16-byte chunks and the 4-byte
// words holding their scale and bias), so the wait is per thread (cp.async.wait_group) and no
// warp or block barrier guards the ring. The ring of warp w lies at dec_smem + w ·
// STREAM_WARP_BYTES (a -D constant, decode.rs: the device's shared memory decides it); the
// caller's other shared memory lies after all warps' rings.

#ifndef STREAM_WARP_BYTES
#error "STREAM_WARP_BYTES: the shared-memory ring of one warp, in bytes (decode.rs)"
#endif

extern __shared__ __align__(16) unsigned char dec_smem[];

// 16 bytes into shared memory through L2 only (a weight byte is read once a step).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
// 4 bytes (cp.async.cg takes only 16).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// *p += v for an element only this thread adds to within the op, as one reduction at L2: no
// round trip, where a load, add and store wait for the load (the residual adds of the step's
// output projections and expert down projection). The sum is the same fl(*p + v), except that
// red.add.f32 flushes subnormal operands and results to zero.
__device__ __forceinline__ void add_owned(float* p, float v) {
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// One stage of a warp's ring: R rows × NB chunks per lane, lane-major so that the lanes' 16-byte
// reads of one (r, j) are 512 contiguous bytes (no bank conflicts). A scale or bias arrives as
// the aligned 4-byte word holding it; `halves` says which half (bit r·NB + j for the scale, 16 +
// r·NB + j for the bias).
template <int R, int NB>
struct StreamSlab {
    uint4 codes[R][NB][WARP];
    u32 scales[R][NB][WARP];
    u32 biases[R][NB][WARP];
    u32 halves[WARP];
};

// Chunks per lane per row of a slab: R · NB = 4 row-chunks a lane, 2 KB of codes a warp.
template <int R>
__host__ __device__ constexpr int stream_nb() { return R >= 4 ? 1 : 4 / R; }

template <int R>
__host__ __device__ constexpr int stream_stages() {
    constexpr int n = STREAM_WARP_BYTES / (int)sizeof(StreamSlab<R, stream_nb<R>()>);
    return n > 8 ? 8 : n;
}

// Requests chunk (r, j) of the lane's slab: 16 bytes of codes, the words of its scale and bias.
template <int R, int NB>
__device__ __forceinline__ void stream_chunk(StreamSlab<R, NB>& s, int r, int j, int lane, const void* codes,
                                             const u16* scale, const u16* bias, u32& halves) {
    static_assert(R * NB <= 16, "StreamSlab::halves holds 16 chunks' bits a field");
    const size_t sa = (size_t)scale, ba = (size_t)bias;
    cp_async16(&s.codes[r][j][lane], codes);
    cp_async4(&s.scales[r][j][lane], (const void*)(sa & ~(size_t)3));
    cp_async4(&s.biases[r][j][lane], (const void*)(ba & ~(size_t)3));
    halves |= ((sa & 2) ? 1u : 0u) << (r * NB + j);
    halves |= ((ba & 2) ? 1u : 0u) << (16 + r * NB + j);
}

// Units of R rows, one warp each, numbered as staged_units numbers them (block-fastest, any grid
// size): issue(u, base, slab, lane) requests the lane's chunks base + lane + j·WARP (< chunks) of
// unit u's rows with stream_chunk and returns the halves bits; store(u, acc) gets the lanes'
// unreduced partials once all of u's chunks are summed. Every thread must call this (stage()
// stages x for the whole block, after the first slabs are requested).
template <int BITS, int R, class Issue, class Stage, class Store>
__device__ void stream_units(long units, int chunks, Issue issue, Stage stage, Store store, const float* xs,
                             const float* xsum, int blk, int nblk) {
    constexpr int NB = stream_nb<R>(), S = stream_stages<R>(), SLAB = WARP * NB;
    static_assert(S >= 2, "STREAM_WARP_BYTES holds fewer than two stages");
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    auto* ring = reinterpret_cast<StreamSlab<R, NB>*>(dec_smem + warp * STREAM_WARP_BYTES);
    const long stride = (long)nblk * (blockDim.x / WARP);
    // The slabs this warp computes, in order: unit u0, u0 + stride, …, each cut at SLAB chunks.
    // The issue and compute sides walk them with their own cursors (no divisions in the loop).
    struct Cursor {
        long u;
        int base;
        int stage;
    };
    Cursor in{(long)warp * nblk + blk, 0, 0}, out = in;
    auto advance = [&](Cursor& c) {
        c.base += SLAB;
        if (c.base >= chunks) {
            c.base = 0;
            c.u += stride;
        }
        c.stage = c.stage + 1 == S ? 0 : c.stage + 1;
    };
    // One commit per slab, empty past the end, so that wait<S − 2> always means "the oldest of the
    // slabs in flight has arrived".
    auto request = [&]() {
        if (in.u < units) {
            ring[in.stage].halves[lane] = issue(in.u, in.base, ring[in.stage], lane);
            advance(in);
        }
        cp_commit();
    };
#pragma unroll
    for (int s = 0; s < S - 1; s++) request();
    stage();
    const int xoff[R] = {};
    float acc[R] = {};
    while (out.u < units) {
        cp_wait<S - 2>();
        const StreamSlab<R, NB>& slab = ring[out.stage];
        const u32 halves = slab.halves[lane];
        auto chunk = [&](int r, int j, uint4& q, u16& scale, u16& bias) {
            q = slab.codes[r][j][lane];
            scale = (u16)(slab.scales[r][j][lane] >> ((halves >> (r * NB + j)) & 1u) * 16);
            bias = (u16)(slab.biases[r][j][lane] >> ((halves >> (16 + r * NB + j)) & 1u) * 16);
        };
        dot_chunks<BITS, R, NB, true>(chunk, out.base, chunks, xoff, xs, xsum, lane, acc);
        // The stage just read is the one refilled next time round: the slab S − 1 ahead.
        request();
        const long u = out.u;
        advance(out);
        if (out.u != u) {
            store(u, acc);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] = 0.f;
        }
    }
    cp_wait<0>();
}

// stream_units over units of R rows that rows_of(u, rows, xoff) names (staged_units's
// contract; the rows must share x, so xoff is ignored).
template <int BITS, int R, class RowsOf, class Stage, class Store>
__device__ void stream_rows(long units, int cols, int group, RowsOf rows_of, Stage stage, Store store,
                            const float* xs, const float* xsum, int blk, int nblk) {
    constexpr int PER = 128 / BITS, NB = stream_nb<R>();
    const int chunks = cols / PER;
    auto issue = [&](long u, int base, StreamSlab<R, NB>& slab, int lane) {
        RowRef rows[R];
        int xoff[R];
        rows_of(u, rows, xoff);
        u32 halves = 0;
#pragma unroll
        for (int j = 0; j < NB; j++) {
            const int ch = base + lane + j * WARP;
            if (ch >= chunks) break;
            const int g = ch * PER / group;
#pragma unroll
            for (int r = 0; r < R; r++)
                stream_chunk(slab, r, j, lane, (const uint4*)rows[r].w + ch, rows[r].scales + g, rows[r].biases + g,
                             halves);
        }
        return halves;
    };
    stream_units<BITS, R>(units, chunks, issue, stage, store, xs, xsum, blk, nblk);
}
