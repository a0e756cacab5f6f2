// Decode GEMVs on the tensor cores (gemv.cu's gemv_mma_* kernels): y[n] = W · x[n] for the rows
// n < nx ≤ 8 of a step, W 4-bit affine with groups of a multiple of 64. One mma m16n8k16 is 16
// weight rows × 16 inputs × 8 columns of x parts (the n side, below).
//
// Why: with f32 FMAs every weight costs its dequantisation and one FMA per row, and at 8 rows the
// batched step was bound by instruction issue (docs/BENCHMARKS.md). An mma does 16 · 16 · 8
// products in one instruction.
//
// Exact products. A code is an exact bf16 integer, and each staged x is split into three bf16 parts
// hi + mid + lo that sum to it exactly (each part the rounded rest of the ones before: 3 × 8 bits
// hold its 24-bit significand), so every product code · part is exact in the f32 accumulators and
// only the sums round, as in any f32 dot product. Per slab of 64 inputs (a group or a part of one)
// the mma sums Σ code · part over the slab; each part's sum is scaled and accumulated on its own
// (part += scale · that) and bias · Σ x beside them, and the unit's result is
// ((lo + mid) + hi) + bias.
//
// Parts as columns. Up to two rows, the n side of one mma holds both rows' three parts (row n
// part p at column 3n + p): a sequence alone takes one mma per 16 × 16 codes, where a part per
// mma with the rows as columns took three, 7 of their 8 columns empty. From three rows on, the
// kernels keep a part per mma (three tiles), whose lanes then hold all the parts of their rows.
//
// Each row its own bits. Column c of an mma's result depends only on column c of its B operand,
// a row's parts go through the same operations in either layout, a slab's sums are reduced
// across warps in a fixed order, and a row's norm and staging are its own: row n gets the same
// bits whatever the other rows are, and however many. The single-sequence step runs these
// kernels too, so a sequence decodes the same tokens alone as in any batch.
//
// Layout. lane = 4·g + t (the mma's group g and thread t in group). In a slab, lane t holds 16
// consecutive codes of each of its rows, inputs 16t .. 16t + 15 (one 8-byte load; a quad reads a
// row's 32 bytes of the slab). Which k of the mma a code stands for is free as long as x's fragment
// uses the same one, so codes stay where the load put them: nibbles q and q + 4 of word wd form the
// bf16 pair q of mma step 2·wd + q / 2 (a mask-and-or makes 128 + code; code_pair says where the
// 128 goes). Staged x holds, per slab, word, tile and lane, the uint4 of the four pairs of that
// lane's B fragments, so that a warp's fragment load is 512 contiguous bytes.
//
// Work. A block's warps split K: in each pass over a unit of 16 rows, warp w takes MMA_SPW
// slabs; at the unit's end each warp gathers its parts into results (mma_combine) and the warps'
// results are added in shared memory, warp 0 first. Blocks have 8 warps, or 16 where 8 would take
// more than one pass (gemv.rs, mma_warps: a choice by K alone, so a row's sums run in the same
// order in every launch): at K = 4,096 a 16-row unit was two passes of 8 warps, 128 units for
// 2,048 outputs, so one block of 8 warps an SM, each waiting out two DRAM latencies in turn.
// Every warp holds its next item's weights in registers while it computes the current one (two
// buffers, used in turn), requested as soon as the item before it is done with the buffer.

#define MMA_MAX_WARPS 16
#define MMA_SLAB 64
// Slabs a warp takes per pass: 4 covers K = 2,048 in one pass with 16 weight loads a lane in
// flight.
#define MMA_SPW 4

// Shared memory (dynamic; gemv.rs's mma_shared_bytes computes the same size): the warps' partial
// sums (two buffers), staged x, each slab's sum of x per row, norm scratch and inverse norms.
__device__ __forceinline__ int mma_red_float4s() { return 2 * MMA_MAX_WARPS * WARP; }

// Where row n's part p of x lies on the mma's n side, in one of two layouts (each row's columns
// are computed alike in both, so the layout does not change a row's bits):
// - one tile (TILES == 1, up to 2 rows): packed, row n part p at column 3n + p;
// - three tiles (TILES == 3, up to 8 rows): part p's tile, column n, as a part per mma.
template <int TILES>
__device__ __forceinline__ int mma_tile_of(int n, int p) { return TILES == 1 ? 0 : p; }
template <int TILES>
__device__ __forceinline__ int mma_column_of(int n, int p) { return TILES == 1 ? 3 * n + p : n; }

// The uint4 of slab s, word wd, tile, lane in staged x.
template <int TILES>
__device__ __forceinline__ int mma_xf_at(int s, int wd, int tile, int lane) {
    return ((s * 2 + wd) * TILES + tile) * WARP + lane;
}

// hi, mid, lo (bf16) of a and b, as pairs (a's in the low halves): a = hi + mid + lo exactly.
__device__ __forceinline__ void split_pair(float a, float b, u32 (&parts)[3]) {
#pragma unroll
    for (int p = 0; p < 3; p++) {
        parts[p] = pack_bf16x2(a, b);
        a = __fsub_rn(a, __uint_as_float(parts[p] << 16));
        b = __fsub_rn(b, __uint_as_float(parts[p] & 0xffff0000u));
    }
}

// The norm weights of the octet (8 inputs) a thread stages first, octet threadIdx.x % octets:
// loaded before the kernel's wait, since no kernel writes them. Requested after it, beside x
// (which the norm has just read), they put a round trip to L2 on the chain behind the norm's
// reduction.
struct MmaNormW {
    float4 w[2];
};

__device__ __forceinline__ MmaNormW mma_norm_w(int cols, const float* norm_w) {
    MmaNormW n = {};
    if (norm_w) {
        const int o = threadIdx.x % (cols / 8);
        n.w[0] = *(const float4*)(norm_w + 8 * o);
        n.w[1] = *(const float4*)(norm_w + 8 * o + 4);
    }
    return n;
}

// Stages rows n < nx of x (or RMSNorm(x[n]) · norm_w) as the B fragments of every slab, and the
// sums of every slab's x (zero for rows ≥ nx). One thread per 8 inputs of a row: two float4 loads,
// the four pairs (q, q + 4) in three parts, one uint4 a part. nw holds this thread's first octet's
// norm weights (mma_norm_w). Ends with a barrier.
template <int TILES>
__device__ void stage_mma_x(int cols, int nx, const float* x, const float* norm_w, const MmaNormW& nw, float eps,
                            uint4* xf, float* xsum, float* scratch, float* inv) {
    // Bounded by the rows the layout holds: the unrolled passes and reductions of rows that cannot
    // be there were most of a one-sequence launch's instructions.
    if (norm_w) rows_inv_rms<TILES == 1 ? 2 : MAX_ROWS, 2>(cols, nx, x, eps, scratch, inv);
    const int octets = cols / 8, slabs = cols / MMA_SLAB;
    // Whole warps run every pass: a slab's 8 octets are 8 adjacent threads, which add their sums.
    const int end = (nx * octets + WARP - 1) / WARP * WARP;
    for (int i = threadIdx.x; i < end; i += blockDim.x) {
        const int n = i / octets, o = i % octets;
        float v[8] = {};
        if (n < nx) {
            const float4 a = load_act4(x + (long)n * cols + 8 * o), b = load_act4(x + (long)n * cols + 8 * o + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            if (norm_w) {
                const bool first = o == threadIdx.x % octets;
                const float4 wa = first ? nw.w[0] : *(const float4*)(norm_w + 8 * o);
                const float4 wb = first ? nw.w[1] : *(const float4*)(norm_w + 8 * o + 4);
                const float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] = __fmul_rn(__fmul_rn(v[e], inv[n]), w[e]);
            }
        }
        float sum = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) sum = __fadd_rn(sum, v[e]);
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, off));
        if (n < nx) {
            const int s = o / 8, t = o % 8 / 2, wd = o % 2;
            u32 pairs[4][3];
#pragma unroll
            for (int q = 0; q < 4; q++) split_pair(v[q], v[q + 4], pairs[q]);
#pragma unroll
            for (int p = 0; p < 3; p++)
                xf[mma_xf_at<TILES>(s, wd, mma_tile_of<TILES>(n, p), 4 * mma_column_of<TILES>(n, p) + t)] =
                    make_uint4(pairs[0][p], pairs[1][p], pairs[2][p], pairs[3][p]);
            if (o % 8 == 0) xsum[s * MAX_ROWS + n] = sum;
        }
    }
    for (int i = threadIdx.x; i < slabs * MAX_ROWS; i += blockDim.x)
        if (i % MAX_ROWS >= nx) xsum[i] = 0.f;
    __syncthreads();
}

// One lane's weights of a pass: per slab, the 16 codes of its rows g and g + 8 and their groups'
// scales and biases. scale and bias hold two slabs' bf16 values a word (slab 2j in the low half),
// as they lie in memory: half the registers of one a slab.
struct MmaLoad {
    uint2 q[MMA_SPW][2];
    u32 scale[MMA_SPW / 2][2], bias[MMA_SPW / 2][2];
};

// The bf16 of slab i in a pair of words as an f32.
__device__ __forceinline__ float slab_value(const u32 (&w)[MMA_SPW / 2][2], int i, int h) {
    const u32 v = w[i / 2][h];
    return __uint_as_float(i % 2 ? v & 0xffff0000u : v << 16);
}

// The launch's matrices share their columns and groups (gemv.rs): what follows from them is
// worked out once a launch, not once an item (a division by the group size cost ~20 instructions).
struct MmaFormat {
    int slabs, groups;
    // Groups of one slab and whole sets of MMA_SPW slabs a row (every matrix of the real model):
    // a row's 4 scales are one 8-byte load and so are its biases; the separate 2-byte loads, 8
    // lines a warp each, outnumbered the codes'.
    bool packed;
};

__device__ __forceinline__ MmaFormat mma_format(const Mat& m) {
    const int slabs = m.cols / MMA_SLAB;
    return MmaFormat{slabs, m.cols / m.group, m.group == MMA_SLAB && slabs % MMA_SPW == 0};
}

// Requests slabs s0 .. s0 + MMA_SPW (those below f.slabs) of the 16 rows from r0 of m (a ragged
// unit's last rows repeat the matrix's last row).
__device__ __forceinline__ void mma_load(MmaLoad& l, const Mat& m, const MmaFormat& f, long r0, int s0, int lane) {
    const int g = lane / 4, t = lane % 4, slabs = f.slabs;
    const long groups = f.groups;
    const bool packed = f.packed;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long row = min(r0 + g + 8 * h, (long)m.rows - 1);
        const char* w = (const char*)m.w + row * (m.cols / 2) + 8 * t;
#pragma unroll
        for (int i = 0; i < MMA_SPW; i++)
            if (s0 + i < slabs) l.q[i][h] = *(const uint2*)(w + (s0 + i) * 32);
        if (packed) {
            if (s0 < slabs) {
                const uint2 sc = *(const uint2*)(m.scales + row * groups + s0);
                const uint2 bi = *(const uint2*)(m.biases + row * groups + s0);
                l.scale[0][h] = sc.x;
                l.scale[1][h] = sc.y;
                l.bias[0][h] = bi.x;
                l.bias[1][h] = bi.y;
            }
        } else {
#pragma unroll
            for (int j = 0; j < MMA_SPW / 2; j++) {
                u32 sc = 0, bi = 0;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int s = s0 + 2 * j + e;
                    if (s < slabs) {
                        const long gi = row * groups + s * MMA_SLAB / m.group;
                        sc |= (u32)load_weight16(m.scales + gi) << (16 * e);
                        bi |= (u32)load_weight16(m.biases + gi) << (16 * e);
                    }
                }
                l.scale[j][h] = sc;
                l.bias[j][h] = bi;
            }
        }
    }
}

// The bf16 pair (128 + code q, 128 + code q + 4) of word v, exact bf16 integers (magic holds
// 0x43004300, 128 with the code in the low mantissa bits). The 128s are not taken off here, a
// bf16x2 fma a pair (16 of a slab's ~70 instructions), but once a slab through its bias:
// Σ (128 + c)·x · scale + (bias − 128·scale)·Σx = Σ c·x · scale + bias·Σx. The products stay
// exact; the f32 sums grow ~16× for the same result, so they round ~4 bits coarser against it.
__device__ __forceinline__ u32 code_pair(u32 v, int q, u32 magic) {
    return mask_or(v >> (4 * q), 0x000f000fu, magic);
}

// A lane's sums over its unit so far. The C fragment of tile τ holds, for rows g and g + 8, the
// columns 2t and 2t + 1 of the tile (part[τ][0..1] row g, part[τ][2..3] row g + 8); each column
// is one part of one x row, scaled slab by slab. bias[2h + i] is bias · Σx of row g + 8h and x
// row 2t + i, as the kernel's output is laid out.
template <int TILES>
struct MmaAcc {
    float part[TILES][4];
    float bias[4];
};

// acc += this warp's slabs s0 .. of its unit. Lanes whose column g of a tile is no row's part feed
// zeros. A slab's code pairs are made once and serve every tile.
template <int TILES>
__device__ __forceinline__ void mma_slabs(const MmaLoad& l, int s0, int slabs, const uint4* xf, const float* xsum,
                                          int nx, int lane, MmaAcc<TILES>& acc) {
    const int g = lane / 4, t = lane % 4;
    u32 magic;
    asm("mov.b32 %0, 0x43004300;" : "=r"(magic));
#pragma unroll
    for (int i = 0; i < MMA_SPW; i++) {
        const int s = s0 + i;
        if (s >= slabs) break;
        float c[TILES][4] = {};
#pragma unroll
        for (int wd = 0; wd < 2; wd++) {
            uint4 xv[TILES];
#pragma unroll
            for (int tile = 0; tile < TILES; tile++)
                xv[tile] = g < (TILES == 1 ? 3 * nx : nx) ? xf[mma_xf_at<TILES>(s, wd, tile, lane)]
                                                           : make_uint4(0u, 0u, 0u, 0u);
            const u32 rg = wd ? l.q[i][0].y : l.q[i][0].x, rh = wd ? l.q[i][1].y : l.q[i][1].x;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const u32 a[4] = {code_pair(rg, 2 * half, magic), code_pair(rh, 2 * half, magic),
                                  code_pair(rg, 2 * half + 1, magic), code_pair(rh, 2 * half + 1, magic)};
#pragma unroll
                for (int tile = 0; tile < TILES; tile++)
                    mma_bf16(c[tile], a, half ? xv[tile].z : xv[tile].x, half ? xv[tile].w : xv[tile].y);
            }
        }
        const float2 sx = *(const float2*)(xsum + s * MAX_ROWS + 2 * t);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float scale = slab_value(l.scale, i, h);
            // Exact where scale and bias lie within 2^16 of each other, as a group's do.
            const float bias = __fmaf_rn(-128.f, scale, slab_value(l.bias, i, h));
#pragma unroll
            for (int tile = 0; tile < TILES; tile++)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; e++) acc.part[tile][e] = __fmaf_rn(scale, c[tile][e], acc.part[tile][e]);
            acc.bias[2 * h] = __fmaf_rn(bias, sx.x, acc.bias[2 * h]);
            acc.bias[2 * h + 1] = __fmaf_rn(bias, sx.y, acc.bias[2 * h + 1]);
        }
    }
}

// The lane's four outputs of its warp's sums: for row g + 8h and x row 2t + i, at v[2h + i],
// ((lo + mid) + hi) + bias. With three tiles the lane holds all three parts of its x rows. With
// one, x rows 0 and 1 (lane t = 0's) have their parts at columns 0-2 and 3-5, held by lanes
// t = 0, 1 and 1, 2: four shuffles a matrix row.
template <int TILES>
__device__ __forceinline__ void mma_combine(const MmaAcc<TILES>& acc, float (&v)[4]) {
    float parts[3][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int e0 = 2 * h, e1 = 2 * h + 1;
        if (TILES == 1) {
            const float even = acc.part[0][e0], odd = acc.part[0][e1];
            const float c2 = __shfl_down_sync(0xffffffffu, even, 1), c3 = __shfl_down_sync(0xffffffffu, odd, 1);
            const float c4 = __shfl_down_sync(0xffffffffu, even, 2), c5 = __shfl_down_sync(0xffffffffu, odd, 2);
            parts[0][e0] = even, parts[1][e0] = odd, parts[2][e0] = c2;
            parts[0][e1] = c3, parts[1][e1] = c4, parts[2][e1] = c5;
        } else {
#pragma unroll
            for (int p = 0; p < 3; p++) parts[p][e0] = acc.part[p][e0], parts[p][e1] = acc.part[p][e1];
        }
    }
#pragma unroll
    for (int e = 0; e < 4; e++)
        v[e] = __fadd_rn(__fadd_rn(__fadd_rn(parts[2][e], parts[1][e]), parts[0][e]), acc.bias[e]);
}

// y[n · ystride + at] (= or +=) the rows of [m0 | m1 | m2 | m3] · x[n] for n < nx ≤ 8, outputs end
// to end in each row of y; with norm_w, x[n] is a residual stream and its rows see
// RMSNorm(x[n]) · norm_w. Every matrix has 4-bit codes, K = m0.cols (a multiple of 64) and groups of
// a multiple of 64 inputs. Any grid size works; blocks stride over the 16-row units.
template <int TILES>
__device__ void gemv_mma(Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* x, const float* norm_w, float eps,
                         float* y, bool add) {
    extern __shared__ __align__(16) float mma_smem[];
    const int cols = m0.cols, slabs = cols / MMA_SLAB, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float4* red = (float4*)mma_smem;
    uint4* xf = (uint4*)(red + mma_red_float4s());
    float* xsum = (float*)(xf + mma_xf_at<TILES>(slabs, 0, 0, 0));
    float* scratch = xsum + slabs * MAX_ROWS;
    float* inv = scratch + MAX_ROWS * WARP;
    const Mat ms[4] = {m0, m1, m2, m3};
    const MatUnits<16, Mat[4]> mu{ms, 4};
    const long units = mu.count(), ystride = (long)m0.rows + m1.rows + m2.rows + m3.rows;
    const int warps = blockDim.x / WARP, per_pass = warps * MMA_SPW, passes = (slabs + per_pass - 1) / per_pass;
    // The block's work, unit by unit (blockIdx.x, then every gridDim.x-th) and pass by pass.
    // Items advance by counting, never dividing: 64-bit divisions per item cost as much as its
    // mma work.
    // 32-bit fields (a launch's rows fit): three items live at once, and 64-bit ones spilled.
    struct Item {
        int u, r0, base, pass, which;
    };
    auto at_unit = [&](Item& it, long u) {
        it.u = (int)min(u, units);
        it.pass = 0;
        if (u < units) {
            long r0, base;
            mu.locate(u, it.which, r0, base);
            it.r0 = (int)r0;
            it.base = (int)base;
        }
    };
    auto advance = [&](Item& it) {
        if (++it.pass == passes) at_unit(it, (long)it.u + gridDim.x);
    };
    auto s0_of = [&](const Item& it) { return it.pass * per_pass + warp * MMA_SPW; };
    const MmaFormat format = mma_format(m0);
    auto load = [&](MmaLoad& l, const Item& it) {
        if (it.u < units) mma_load(l, mat_of(ms, it.which), format, it.r0, s0_of(it), lane);
    };
    MmaAcc<TILES> acc = {};
    int buf = 0;
    // Item `it` from cur, which then takes the item after next (`after`): a warp always has the
    // next item's loads in flight, requested a whole item earlier, and no copy between the two
    // buffers (a register move would wait for the loads it moves).
    Item it, next, after;
    auto step = [&](MmaLoad& cur) {
        mma_slabs(cur, s0_of(it), slabs, xf, xsum, nx, lane, acc);
        load(cur, after);
        if (it.pass == passes - 1) {
            float4* mine = red + buf * MMA_MAX_WARPS * WARP;
            float sum[4];
            mma_combine(acc, sum);
            mine[warp * WARP + lane] = make_float4(sum[0], sum[1], sum[2], sum[3]);
            __syncthreads();
            if (warp == 0) {
                float4 v = mine[lane];
#pragma unroll
                for (int w = 1; w < warps; w++) {
                    const float4 o = mine[w * WARP + lane];
                    v = make_float4(__fadd_rn(v.x, o.x), __fadd_rn(v.y, o.y), __fadd_rn(v.z, o.z), __fadd_rn(v.w, o.w));
                }
                const long rows = mat_of(ms, it.which).rows;
                const int g = lane / 4, t = lane % 4;
                const float out[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const long r = it.r0 + g + 8 * (e / 2);
                    const int n = 2 * t + e % 2;
                    if (n < nx && r < rows) {
                        float* at = y + n * ystride + it.base + r;
                        *at = add ? __fadd_rn(*at, out[e]) : out[e];
                    }
                }
            }
            buf ^= 1;
            acc = {};
        }
        it = next;
        next = after;
        advance(after);
    };
    MmaLoad a, b;
    at_unit(it, blockIdx.x);
    next = it;
    advance(next);
    after = next;
    advance(after);
    // The weights depend on no kernel: the first two items and the norm's weights are requested
    // before the wait.
    load(a, it);
    load(b, next);
    const MmaNormW nw = mma_norm_w(cols, norm_w);
    pdl_wait();
    stage_mma_x<TILES>(cols, nx, x, norm_w, nw, eps, xf, xsum, scratch, inv);
    STAMP_AT(1)
    while (it.u < units) {
        step(a);
        if (it.u >= units) break;
        step(b);
    }
    STAMP_END(2)
}
