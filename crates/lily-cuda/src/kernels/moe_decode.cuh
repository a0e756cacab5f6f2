// The expert half of a decode token's MoE, shared by the graph step's kernels (moe.cu) and the
// persistent step (decode.cu): gate/up with SwiGLU over the chosen and shared experts' rows, and
// the down projection with the weighted combine added into the residual stream. Constants: NE
// experts, TOPK chosen per token. Shared memory and the blocks that take part come from the caller.

// Row pairs (gate, up) one warp computes: four rows share each staged x chunk.
#define PAIRS 1

// act = silu(gate · x) ⊙ (up · x) for the chosen experts' rows (slot-major, TOPK × inter) and
// then the shared expert's rows, x as stage() stages it into xs and xsum (with stage_x; a no-op
// where the caller has staged x already). ids may be global or shared memory; the units spread
// over blocks blk of nblk.
template <int BITS, class Stage>
__device__ void gate_up_staged(Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids, float* act,
                               Stage stage, const float* xs, const float* xsum, int blk, int nblk) {
    long pairs = (long)TOPK * inter + sh_gate.rows;
    long units = (pairs + PAIRS - 1) / PAIRS;
    auto rows_of = [&](long u, RowRef (&rows)[2 * PAIRS], int (&xoff)[2 * PAIRS]) {
#pragma unroll
        for (int i = 0; i < PAIRS; i++) {
            // 32-bit (a step's pairs fit): a 64-bit division is a call, with its registers saved.
            const int p = (int)min(u * PAIRS + i, pairs - 1);
            if (p < TOPK * inter) {
                const int slot = p / inter;
                long row = (long)ids[slot] * inter + (p - slot * inter);
                rows[2 * i] = row_ref(gate, row, BITS);
                rows[2 * i + 1] = row_ref(up, row, BITS);
            } else {
                long row = p - (long)TOPK * inter;
                rows[2 * i] = row_ref(sh_gate, row, BITS);
                rows[2 * i + 1] = row_ref(sh_up, row, BITS);
            }
            xoff[2 * i] = xoff[2 * i + 1] = 0;
        }
    };
    auto store = [&](long u, float (&acc)[2 * PAIRS]) {
#pragma unroll
        for (int i = 0; i < PAIRS; i++) {
            float g = warp_sum(acc[2 * i]), v = warp_sum(acc[2 * i + 1]);
            if (threadIdx.x % WARP == i && u * PAIRS + i < pairs) act[u * PAIRS + i] = siluf(g) * v;
        }
    };
    staged_units<BITS, 2 * PAIRS, GEMV_BATCH, true, false>(units, gate.cols, gate.group, rows_of, stage, store,
                                                     xs, xsum, blk, nblk);
}

// gate_up_staged with x = RMSNorm(hidden) · norm_w, staged by the blocks themselves. xs, xsum,
// scratch: XS_FLOATS(BITS), XSUM_FLOATS(BITS) and 32 floats of shared memory.
template <int BITS>
__device__ void gate_up(Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids,
                        const float* hidden, const float* norm_w, float eps, float* act, float* xs,
                        float* xsum, float* scratch, int blk, int nblk) {
    auto stage = [&]() { stage_maybe_normed<BITS>(gate.cols, hidden, norm_w, eps, xs, xsum, scratch); };
    gate_up_staged<BITS>(gate, up, sh_gate, sh_up, inter, ids, act, stage, xs, xsum, blk, nblk);
}

// residual[h] += Σ_k w_k · down_{id_k}[h] · act_k + σ(shared gate logit) · shared_down[h] · act_shared,
// dense (f32) weights: act staged once per block, one warp per output row.
__device__ void down_combine_dense(Mat down, Mat sh_down, int inter, int hidden, const int* ids,
                                   const float* weights, const float* logits, const float* act,
                                   float* residual, float* xs, float* xsum, int blk, int nblk) {
    pdl_wait();
    stage_x<32>(TOPK * inter + sh_down.cols, act, nullptr, 1.f, xs, xsum);
    int lane = threadIdx.x % WARP;
    long stride = (long)nblk * (blockDim.x / WARP);
    float shared_gate = sigmoidf(load_act(logits + NE));
    int id[TOPK];
    float wk[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; k++) {
        id[k] = load_act_int(ids + k);
        wk[k] = load_act(weights + k);
    }
    for (long h = (long)blk * (blockDim.x / WARP) + threadIdx.x / WARP; h < hidden; h += stride) {
        const float* rows[TOPK];
#pragma unroll
        for (int k = 0; k < TOPK; k++) rows[k] = (const float*)down.w + ((long)id[k] * hidden + h) * down.cols;
        const float* srow = (const float*)sh_down.w + h * sh_down.cols;
        float acc[TOPK] = {}, sacc = 0.f;
        for (int c = lane; c < max(inter, sh_down.cols); c += WARP) {
#pragma unroll
            for (int k = 0; k < TOPK; k++)
                if (c < inter) acc[k] += rows[k][c] * xs[k * inter + c];
            if (c < sh_down.cols) sacc += srow[c] * xs[TOPK * inter + c];
        }
        // Lanes sum the weighted slots first and reduce once: fewer shuffles per row.
        float total = shared_gate * sacc;
#pragma unroll
        for (int k = 0; k < TOPK; k++) total += wk[k] * acc[k];
        total = warp_sum(total);
        if (lane == 0) residual[h] = load_act(residual + h) + total;
    }
}

// Output rows one warp of moe_down_b4/b8 computes (step.rs, DOWN_ROWS): each staged x chunk
// serves both. One sequence takes moe_down_b*_r1 instead, a row a warp: with two, its 2,048
// outputs were 1,024 units, one block of 8 warps an SM (0.48 of a wave, ~0.57 TB/s); several
// sequences fill the GPU through the grid's y, where two rows a warp measured 6 % faster. A row's
// sum is the same expression either way, so it gets the same bits alone as in a batch.
#define DOWN_ROWS 2
// Chunks per lane and row whose loads are issued together: 5 covers the 144 chunks of a
// production output row (8 routed rows of 512 4-bit codes + the shared row, 32 codes a chunk)
// in one batch, so a warp has 2 × 5 16-byte loads in flight per lane.
#define DOWN_BATCH 5
// act loads per thread issued together while staging: 5 stage a production act (4,608 floats)
// in one round trip with 256 threads.
#define DOWN_STAGE_UNROLL 5

// Output row h of the down projection as one "virtual row" of TOPK·rch + sch chunks: the chosen
// experts' down rows (expert id_k, row h) one after another, then the shared expert's row h, in
// the order act lays out its slots, so chunk ch multiplies staged x chunk ch.
struct DownChunk {
    const uint4* q;       // the chunk's codes in row h0
    const u16* scales;    // its group's scale and bias in row h0
    const u16* biases;
    u32 vecs, groups;     // chunks and groups a row of its matrix (row h0 + r is r of them on)
};

template <int BITS>
__device__ __forceinline__ DownChunk down_chunk(const Mat& down, const Mat& sh, const int* sid, long h0,
                                                int hidden, int rch, int ch) {
    constexpr int PER = 128 / BITS;
    u32 seg = min((u32)ch / (u32)rch, (u32)TOPK);
    u32 within = (u32)ch - seg * (u32)rch;
    // Field by field: selecting a whole Mat by reference puts both in local memory.
    bool routed = seg < TOPK;
    const uint4* w = (const uint4*)(routed ? down.w : sh.w);
    const u16* sc = routed ? down.scales : sh.scales;
    const u16* bi = routed ? down.biases : sh.biases;
    u32 cols = routed ? down.cols : sh.cols, group = routed ? down.group : sh.group;
    long row0 = routed ? (long)sid[routed ? seg : 0] * hidden + h0 : h0;
    u32 vecs = cols / PER, groups = cols / group;
    long gi = row0 * groups + within * PER / group;
    return DownChunk{w + row0 * vecs + within, sc + gi, bi + gi, vecs, groups};
}

// The rows h0 … h0 + R − 1 of a unit (ragged ones repeat the last row, uniform across the warp;
// their sums are not stored), as offsets from h0.
template <int R>
__device__ __forceinline__ void down_rows(long h0, int hidden, int (&dr)[R]) {
#pragma unroll
    for (int r = 0; r < R; r++) dr[r] = (int)min((long)r, hidden - 1 - h0);
}

// Fills the batch with the chunks base + lane + j·WARP of rows h0 … h0 + R − 1.
template <int BITS, int R, int NB>
__device__ __forceinline__ void load_down(Batch<BITS, R, NB>& b, const Mat& down, const Mat& sh,
                                          const int* sid, long h0, int hidden, int rch,
                                          int chunks, int base, int lane) {
    int dr[R];
    down_rows<R>(h0, hidden, dr);
#pragma unroll
    for (int j = 0; j < NB; j++) {
        int ch = base + lane + j * WARP;
        if (ch < chunks) {
            const DownChunk c = down_chunk<BITS>(down, sh, sid, h0, hidden, rch, ch);
#pragma unroll
            for (int r = 0; r < R; r++) {
                b.q[r][j] = load_weight4(c.q + dr[r] * c.vecs);
                b.scale[r][j] = load_weight16(c.scales + dr[r] * c.groups);
                b.bias[r][j] = load_weight16(c.biases + dr[r] * c.groups);
            }
        }
    }
}

// residual[h] += Σ_k w_k · down_{id_k}[h] · act_k + σ(shared gate logit) · shared_down[h] · act_shared
// for 4- and 8-bit weights. The weighted combine rides in the staging: act is staged with each
// slot scaled by its weight (w_k, or the shared expert's gate), so every output row is one dot
// product over its virtual row (load_down): all 32 lanes busy, one reduction per row.
//
// The routing (ids, weights, the shared gate logit) is written before this kernel can start:
// moe_route_gate_up lets it be launched only once every block has passed its router barrier and
// block 0 has written (and fenced) the choice (kernels/moe.cu). So the routing (read through L2,
// never a stale L1 line) and the first rows' weights are read before pdl_wait, while gate/up
// still runs; only act (and the residual stream) wait for it. In the persistent step a grid
// barrier orders them.
template <int BITS, int R>
__device__ void down_combine_q(Mat down, Mat sh_down, int inter, int hidden, const int* ids,
                               const float* weights, const float* logits, const float* act,
                               float* residual, float* xs, float* xsum, int* sid, float* segw, int blk,
                               int nblk) {
    constexpr int PER = 128 / BITS;
    if (threadIdx.x < TOPK) {
        sid[threadIdx.x] = ldcg_int(ids + threadIdx.x);
        segw[threadIdx.x] = ldcg(weights + threadIdx.x);
    } else if (threadIdx.x == TOPK) {
        segw[TOPK] = sigmoidf(ldcg(logits + NE));
    }
    __syncthreads();
    int lane = threadIdx.x % WARP;
    int rch = inter / PER, chunks = TOPK * rch + sh_down.cols / PER;
    long units = (hidden + R - 1) / R;
    // Stage act · slot weight, as stage_x does (padded, prescaled, chunk sums); a float4 and a
    // chunk never straddle two slots (inter and the shared width are multiples of PER).
    auto stage = [&]() {
        int n4 = (TOPK * inter + sh_down.cols) / 4, end = (n4 + WARP - 1) / WARP * WARP;
        for (int c = threadIdx.x; c < end; c += blockDim.x * DOWN_STAGE_UNROLL) {
            float4 v[DOWN_STAGE_UNROLL];
#pragma unroll
            for (int k = 0; k < DOWN_STAGE_UNROLL; k++) {
                int j = c + k * blockDim.x;
                v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (j < n4) {
                    float f = segw[min((u32)(4 * j) / (u32)inter, (u32)TOPK)];
                    v[k] = load_act4(act + 4 * j);
                    v[k] = make_float4(v[k].x * f, v[k].y * f, v[k].z * f, v[k].w * f);
                }
            }
#pragma unroll
            for (int k = 0; k < DOWN_STAGE_UNROLL; k++) stage_float4<BITS>(v[k], c + k * blockDim.x, n4, xs, xsum);
        }
        __syncthreads();
    };
    // Every lane holds each row's sum after warp_sum; lane r adds row r, so the rows' adds
    // (each a round trip in the graph step) go out together.
    auto store = [&](long u, float (&acc)[R]) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = warp_sum(acc[r]);
            if (lane == r && u * R + r < hidden) {
#if STEP_PERSISTENT
                add_owned(residual + u * R + r, v);
#else
                residual[u * R + r] = load_act(residual + u * R + r) + v;
#endif
            }
        }
    };
#if STEP_PERSISTENT
    constexpr int SNB = stream_nb<R>();
    auto issue = [&](long u, int base, StreamSlab<R, SNB>& slab, int lane) {
        int dr[R];
        down_rows<R>(u * R, hidden, dr);
        u32 halves = 0;
#pragma unroll
        for (int j = 0; j < SNB; j++) {
            const int ch = base + lane + j * WARP;
            if (ch >= chunks) break;
            const DownChunk c = down_chunk<BITS>(down, sh_down, sid, u * R, hidden, rch, ch);
#pragma unroll
            for (int r = 0; r < R; r++)
                stream_chunk(slab, r, j, lane, c.q + dr[r] * c.vecs, c.scales + dr[r] * c.groups,
                             c.biases + dr[r] * c.groups, halves);
        }
        return halves;
    };
    stream_units<BITS, R>(units, chunks, issue, stage, store, xs, xsum, blk, nblk);
#else
    constexpr int NB = DOWN_BATCH;
    long stride = (long)nblk * (blockDim.x / WARP);
    long u = (long)(threadIdx.x / WARP) * nblk + blk;   // as staged_units numbers them
    Batch<BITS, R, NB> b;
    if (u < units) load_down<BITS, R, NB>(b, down, sh_down, sid, u * R, hidden, rch, chunks, 0, lane);
    pdl_wait();
    stage();
    STAMP_AT(1)
    const int xoff[R] = {};
    for (; u < units; u += stride) {
        float acc[R] = {};
        for (int base = 0; base < chunks; base += WARP * NB) {
            if (base > 0) load_down<BITS, R, NB>(b, down, sh_down, sid, u * R, hidden, rch, chunks, base, lane);
            dot_batch<BITS, R, NB, true>(b, base, chunks, xoff, xs, xsum, lane, acc);
        }
        if (u + stride < units)
            load_down<BITS, R, NB>(b, down, sh_down, sid, (u + stride) * R, hidden, rch, chunks, 0, lane);
        store(u, acc);
    }
#endif
}

// The shared memory of down_combine: staged act and its chunk sums, the routing.
template <int BITS>
struct DownSmem {
    __align__(16) float xs[XS_FLOATS(BITS)];
    float xsum[XSUM_FLOATS(BITS)];
    int sid[TOPK];
    float segw[TOPK + 1];
};

// R output rows a warp (quantised weights; DOWN_ROWS unless the launch says otherwise).
template <int BITS, int R = DOWN_ROWS>
__device__ void down_combine(Mat down, Mat sh_down, int inter, int hidden, const int* ids,
                             const float* weights, const float* logits, const float* act, float* residual,
                             DownSmem<BITS>& s, int blk, int nblk) {
    if constexpr (BITS == 32)
        down_combine_dense(down, sh_down, inter, hidden, ids, weights, logits, act, residual, s.xs, s.xsum,
                           blk, nblk);
    else
        down_combine_q<BITS, R>(down, sh_down, inter, hidden, ids, weights, logits, act, residual, s.xs, s.xsum,
                             s.sid, s.segw, blk, nblk);
}

