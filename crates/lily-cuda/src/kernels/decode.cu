// The whole decode step of one sequence as one persistent kernel: one block per SM, every op of
// the step cut into units spread over all blocks, and a grid-wide barrier between ops whose
// inputs are another op's outputs (decode.rs builds the tables; ARCHITECTURE.md has the flow).
// Nothing returns to the host: the token comes from the state's slot, routing and the greedy
// choice stay on the device, and the step ends by writing the chosen token into the slot and
// advancing the position.
//
// Besides the model constants (compile.rs), the weight formats arrive as -D constants (decode.rs,
// StepFormats): BITS_EMBED, BITS_LM, BITS_GDN_IN, BITS_GDN_OUT, BITS_ATTN_IN, BITS_ATTN_OUT,
// BITS_ROUTER, BITS_EXPERT (4 or 8 for MLX affine codes, 32 for dense f32).
//
// Activations written by one SM and read by another are read through L2 (ldcg, cp.async.cg):
// every layer reuses the same scratch, and an SM's L1 may hold an earlier layer's lines.

#define DEC_THREADS 256
#define DEC_WARPS (DEC_THREADS / WARP)

struct DecGdn {
    Mat qkv, z, b, a, out;
    const float* conv;
    const float* a_log;
    const float* dt_bias;
    const float* norm;
};

struct DecAttn {
    Mat q, k, v, o;
    const float* q_norm;
    const float* k_norm;
};

struct DecMoe {
    Mat router, sh_gate, gate, up, down, sh_gate_proj, sh_up, sh_down;
};

// One layer's weights (decode.rs, DecLayer): the mixer not used by the layer's kind is zeroed.
struct DecLayer {
    const float* input_norm;
    const float* post_norm;
    int attention;
    int pad;
    DecGdn g;
    DecAttn a;
    DecMoe m;
};

// One layer's part of the sequence state: the GDN conv window and recurrent state, or the KV cache.
struct DecLayerState {
    float* window;
    float* recurrent;
    kv_t* k;
    kv_t* v;
};

// The weights outside the layers, in device memory beside the layer table (the kernel takes
// their matrices by address, which a kernel parameter cannot give without a local copy).
struct DecModel {
    Mat embed;
    Mat lm_head;
    const float* final_norm;
};

// The kernel's one argument (decode.rs, DecArgs; a test holds the two to the same size).
struct DecArgs {
    const DecModel* model;
    const DecLayer* layers;
    const DecLayerState* states;
    float* hidden;
    float* proj;
    float* conv_out;
    float* gdn_o;
    float* part_ml;
    float* part_acc;
    float* attn_out;
    float* router_logits;
    int* ids;
    float* weights;
    float* act;
    float* logits;
    float* arg_v;
    int* arg_i;
    u32* token;
    int* pos;
    // [0]: the grid barrier's arrivals, [1]: blocks done with the step (the last resets both).
    u32* sync;
    // Null, or one GPU timestamp (ns) per barrier and one at the end, written by block 0 as it
    // leaves each: the time of every op of the step (decode.rs, profile).
    unsigned long long* timeline;
    int nlayers;
    int choices;
    int inter;
    float eps;
};

// ---- The grid barrier ----
//
// Every block arrives once per barrier on one counter, which grows through the step; a block waits
// until all nblk blocks have arrived at this barrier. The release (after the block's barrier, so
// the whole block's writes) and the acquire order the blocks' writes before every read after it.
struct GridSync {
    u32* counter;
    u32 target;
    unsigned long long* timeline;
    int passed;
};

__device__ __forceinline__ void mark_time(GridSync& g) {
    if (g.timeline && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        g.timeline[g.passed] = t;
    }
    g.passed++;
}

__device__ __forceinline__ void grid_sync(GridSync& g, int nblk) {
    __syncthreads();
    g.target += nblk;
    if (threadIdx.x == 0) {
        // A release (fence.acq_rel, then the add), not __threadfence's sequentially consistent
        // fence: the barrier only has to publish this block's writes.
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(g.counter) : "memory");
        u32 seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(g.counter) : "memory");
        } while (seen < g.target);
    }
    __syncthreads();
    mark_time(g);
}

// ---- Shared memory ----
//
// One dynamic buffer: the streamed GEMVs' rings, then what each op lays out anew. The staged GEMVs
// take xs | xsum | scratch; the largest user is the attention split (AsSmem<DEC_WARPS> after the
// group's queries).
#define XS_MAX (XS_FLOATS(8) > XS_FLOATS(4) ? (XS_FLOATS(8) > XS_FLOATS(32) ? XS_FLOATS(8) : XS_FLOATS(32)) \
                                            : (XS_FLOATS(4) > XS_FLOATS(32) ? XS_FLOATS(4) : XS_FLOATS(32)))
#define XSUM_MAX XSUM_FLOATS(4)

struct GemvSmem {
    __align__(16) float xs[XS_MAX];
    float xsum[XSUM_MAX];
    float scratch[32];
};

// The queries of one GQA group (and the group's new key, one row more), then the split's state.
struct SplitSmem {
    __align__(16) float q[GROUP + 1][HD];
    AsSmem<DEC_WARPS> as;
};

// The warps' rings of the streamed GEMVs first (gemv_stream.cuh), then the op's own.
#define DEC_RING_BYTES (DEC_WARPS * STREAM_WARP_BYTES)

template <class T>
__device__ __forceinline__ T& op_smem() { return *reinterpret_cast<T*>(dec_smem + DEC_RING_BYTES); }

// ---- Ops ----

template <int BITS>
__device__ void embed_row(const Mat& table, long row, float* out, int blk, int nblk) {
    for (long c = (long)blk * blockDim.x + threadIdx.x; c < table.cols; c += (long)nblk * blockDim.x)
        out[c] = mat_at<BITS>(table, row, c);
}

// ---- The step's GEMVs ----
//
// Every projection of the step is one GEMV over 1 to 4 matrices that share their input: what it
// stages as x and where its rows go differ, the loop is the same. One body for all of them, so
// the kernel holds one copy of the GEMV per weight format (a copy per projection, inlined into
// one function, overflowed the registers).
enum XFrom {
    X_NORMED,   // RMSNorm(hidden) · norm
    X_GATED,    // the GDN's gated RMSNorm of gdn_o by silu(z)
    X_PLAIN,    // x as it is (attn_out)
};
enum YTo {
    Y_GDN_PROJ,    // q|k|v through the causal conv into conv_out, z, b, a into proj
    Y_ATTN_PROJ,   // q|gate, k, v into proj
    Y_RESIDUAL,    // hidden +=
    Y_ROUTER,      // router logits, the shared gate's logit after them
    Y_LOGITS,      // logits, and the block's best among the first `choices`
};

struct GemvOp {
    const Mat* ms;   // consecutive in the layer table
    int nm;
    XFrom x_from;
    YTo y_to;
    const float* x;
    const float* norm;
    const float* conv_w;   // Y_GDN_PROJ: the conv taps and the sequence's window
    float* window;
};

// The GDN's gated RMSNorm staged as x: each value head of gdn_o normalised (a warp a head, the
// inverse RMS in scratch: NV ≤ 32 is checked on the host), scaled by the norm weight, gated by
// silu(z).
template <int B>
__device__ void stage_gated(const DecArgs& A, const float* norm, GemvSmem& sm) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (int j = warp; j < NV; j += DEC_WARPS) {
        float ss = 0.f;
        for (int d = lane; d < DV; d += WARP) {
            float o = ldcg(A.gdn_o + j * DV + d);
            ss += o * o;
        }
        ss = warp_sum(ss);
        if (lane == 0) sm.scratch[j] = rsqrtf(ss / DV + A.eps);
    }
    __syncthreads();
    auto gated = [&](int i) {
        int j = i / DV, d = i % DV;
        return ldcg(A.gdn_o + i) * sm.scratch[j] * norm[d] * siluf(ldcg(A.proj + CONV_DIM + i));
    };
    const int n = NV * DV;
    if constexpr (B == 32) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sm.xs[i] = gated(i);
    } else {
        int n4 = n / 4, end = (n4 + WARP - 1) / WARP * WARP;
        for (int c = threadIdx.x; c < end; c += blockDim.x) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c < n4) v = make_float4(gated(4 * c), gated(4 * c + 1), gated(4 * c + 2), gated(4 * c + 3));
            stage_float4<B>(v, c, n4, sm.xs, sm.xsum);
        }
    }
    __syncthreads();
}

// One GEMV of the step; for Y_LOGITS, the block's best row among the first `choices` in best_v
// and best_i (each lane holds the best of the rows it stored; lm_head_choose reduces them).
template <int B, int ROWS, int NB>
__device__ void step_gemv(const DecArgs& A, const GemvOp& op, GemvSmem& sm, int blk, int nblk, float& best_v,
                          int& best_i) {
    auto stage = [&]() {
        if (op.x_from == X_GATED)
            stage_gated<B>(A, op.norm, sm);
        else
            stage_maybe_normed<B>(op.ms[0].cols, op.x, op.x_from == X_NORMED ? op.norm : nullptr, A.eps, sm.xs,
                                  sm.xsum, sm.scratch);
    };
    auto out = [&](int which, long row, long, float v) {
        switch (op.y_to) {
        case Y_GDN_PROJ:
            if (which == 0)
                A.conv_out[row] = gdn_conv_channel((int)row, v, op.conv_w, op.window);
            else
                A.proj[CONV_DIM + (which > 1 ? NV * DV : 0) + (which > 2 ? NV : 0) + row] = v;
            break;
        case Y_ATTN_PROJ:
            A.proj[(which > 0 ? NH * 2 * HD : 0) + (which > 1 ? NKV * HD : 0) + row] = v;
            break;
        case Y_RESIDUAL:
            add_owned(A.hidden + row, v);
            break;
        case Y_ROUTER:
            A.router_logits[which ? NE : row] = v;
            break;
        case Y_LOGITS:
            A.logits[row] = v;
            if (row < A.choices && (v > best_v || (v == best_v && row < best_i))) {
                best_v = v;
                best_i = (int)row;
            }
            break;
        }
    };
    gemv_mats<B, ROWS, NB>(op.ms, op.nm, stage, out, sm.xs, sm.xsum, blk, nblk);
}

// The formats a model's GEMVs take (one copy of the GEMV each).
#define MIX_FORMAT(b) (BITS_GDN_IN == (b) || BITS_GDN_OUT == (b) || BITS_ATTN_IN == (b) || BITS_ATTN_OUT == (b) || BITS_LM == (b))

__device__ void gemv_any(const DecArgs& A, const GemvOp& op, int bits, GemvSmem& sm, int blk, int nblk,
                         float& best_v, int& best_i) {
#if MIX_FORMAT(4)
    if (bits == 4) step_gemv<4, GEMV_ROWS, GEMV_BATCH>(A, op, sm, blk, nblk, best_v, best_i);
#endif
#if MIX_FORMAT(8)
    if (bits == 8) step_gemv<8, GEMV_ROWS, GEMV_BATCH>(A, op, sm, blk, nblk, best_v, best_i);
#endif
#if MIX_FORMAT(32)
    if (bits == 32) step_gemv<32, GEMV_ROWS, GEMV_BATCH>(A, op, sm, blk, nblk, best_v, best_i);
#endif
}

// Splits a KV head's `len` positions take: one block each, at most every block.
__device__ __forceinline__ int attn_nsplit(int len, int nblk) { return attn_live_splits(len, max(nblk / NKV, 1)); }

// One (KV head, split) item a block: the group's queries normalised and rotated into shared
// memory by every item of the group (a few KB from L2), the new key and value written into the
// cache at `pos` by the last split (the one whose positions end there), then the split itself.
__device__ void attn_split_op(const DecArgs& A, const DecLayer& L, const DecLayerState& S, SplitSmem& sm,
                              int pos, int blk, int nblk) {
    const int nsplit = attn_nsplit(pos + 1, nblk);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (int item = blk; item < NKV * nsplit; item += nblk) {
        const int kv = item / nsplit, split = item % nsplit;
        const bool last = split == nsplit - 1;
        for (int h = warp; h <= GROUP; h += DEC_WARPS) {
            if (h == GROUP && !last) continue;
            const bool is_q = h < GROUP;
            const float* src = is_q ? A.proj + (kv * GROUP + h) * 2 * HD : A.proj + NH * 2 * HD + kv * HD;
            const HeadValue value = load_head_value(is_q, A.proj + NH * 2 * HD + NKV * HD + kv * HD, lane);
            float y[HEAD_PER_LANE];
            head_norm_rope(src, is_q ? L.a.q_norm : L.a.k_norm, A.eps, pos, sm.q[h], lane, y);
            store_head(is_q, y, lane, sm.q[h], S.k, S.v, pos, kv, value);
        }
        // The new key and value reach the split's cp.async reads below, the queries its loads.
        __threadfence();
        __syncthreads();
        attn_split_block<DEC_WARPS>(&sm.q[0][0], S.k, S.v, (long)pos + 1, kv, split, nsplit, A.part_ml, A.part_acc,
                                    sm.as);
        __syncthreads();
    }
}

// The splits merged and gated, a thread per (head, dim), into attn_out.
__device__ void attn_combine_op(const DecArgs& A, int pos, int blk, int nblk) {
    const int nsplit = attn_nsplit(pos + 1, nblk);
    for (int i = blk * blockDim.x + threadIdx.x; i < NH * HD; i += nblk * blockDim.x)
        A.attn_out[i] = attn_combine_one(i / HD, i % HD, A.part_ml, A.part_acc, nsplit, A.proj);
}

// Rows per warp of the router GEMV and chunks per lane loaded together (as moe.cu's ROUTE_ROWS
// and ROUTE_BATCH: the router is latency-bound, 257 rows).
#define DEC_ROUTE_ROWS 2
#define DEC_ROUTE_BATCH 4

// Every block routes for itself (one warp, identical bits in every block); block 0 also
// publishes the choice for the down projection. Then gate/up of the chosen and shared experts.
__device__ void moe_gate_up(const DecArgs& A, const DecLayer& L, GemvSmem& sm, int* ids, float* weights,
                            int blk, int nblk) {
    if (threadIdx.x < WARP) route_topk(A.router_logits, threadIdx.x, ids, weights);
    __syncthreads();
    if (blk == 0 && threadIdx.x < TOPK) {
        A.ids[threadIdx.x] = ids[threadIdx.x];
        A.weights[threadIdx.x] = weights[threadIdx.x];
    }
    gate_up<BITS_EXPERT>(L.m.gate, L.m.up, L.m.sh_gate_proj, L.m.sh_up, A.inter, ids, A.hidden, L.post_norm, A.eps,
                         A.act, sm.xs, sm.xsum, sm.scratch, blk, nblk);
}

// After the lm_head GEMV: each block's best row (best_v, best_i on each lane) among the
// first `choices`; the last block to finish picks the token (lowest id on ties, as the host's
// argmax), writes it into the slot, advances the position and resets the counters.
__device__ void lm_head_choose(const DecArgs& A, float best_v, int best_i, int blk, int nblk) {
    __shared__ float wv[DEC_WARPS];
    __shared__ int wi[DEC_WARPS];
    __shared__ bool last;
    auto better = [](float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); };
    // The lanes' bests, then the warps'.
    for (int o = WARP / 2; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
        int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (better(ov, oi, best_v, best_i)) {
            best_v = ov;
            best_i = oi;
        }
    }
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) {
        wv[warp] = best_v;
        wi[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 0; w < DEC_WARPS; w++)
            if (better(wv[w], wi[w], best_v, best_i)) {
                best_v = wv[w];
                best_i = wi[w];
            }
        A.arg_v[blk] = best_v;
        A.arg_i[blk] = best_i;
        __threadfence();
        last = atomicAdd(A.sync + 1, 1u) == (u32)nblk - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int b = 0; b < nblk; b++) {
        float bv = ldcg(A.arg_v + b);
        int bi = ldcg_int(A.arg_i + b);
        if (better(bv, bi, v, i)) {
            v = bv;
            i = bi;
        }
    }
    // NaN logits leave no candidate: token 0, so the next step still reads a valid row.
    A.token[0] = (u32)(i < A.choices ? i : 0);
    A.pos[0] += 1;
    A.sync[0] = 0;
    A.sync[1] = 0;
}

// The recurrence of one GDN layer, a (value head, GDN_COLS columns) item a block at a time.
__device__ void gdn_recur(const DecArgs& A, const DecLayer& L, const DecLayerState& S, int blk,
                                       int nblk) {
    auto& sm = op_smem<GdnStepSmem<DEC_THREADS / GDN_COLS>>();
    const int col_groups = (DV + GDN_COLS - 1) / GDN_COLS;
    for (int item = blk; item < NV * col_groups; item += nblk)
        gdn_step_cols<DEC_THREADS / GDN_COLS>(item / col_groups, item % col_groups * GDN_COLS, A.conv_out, A.proj,
                                              L.g.a_log, L.g.dt_bias, S.recurrent, A.gdn_o, sm, [] {});
}

// hidden += the chosen experts' and the shared expert's down projections, weighted.
__device__ void moe_down(const DecArgs& A, const DecLayer& L, int blk, int nblk) {
    down_combine<BITS_EXPERT>(L.m.down, L.m.sh_down, A.inter, A.model->embed.cols, A.ids, A.weights, A.router_logits,
                              A.act, A.hidden, op_smem<DownSmem<BITS_EXPERT>>(), blk, nblk);
}

// The ops of a layer in order, a grid barrier after each (every op reads what the one before it
// wrote, from every block).
enum OpKind { OP_GEMV, OP_ROUTER, OP_GDN_RECUR, OP_ATTN_SPLIT, OP_ATTN_COMBINE, OP_GATE_UP, OP_DOWN, OP_NONE };

__device__ OpKind layer_op(bool attention, int phase) {
    const OpKind gdn[6] = {OP_GEMV, OP_GDN_RECUR, OP_GEMV, OP_ROUTER, OP_GATE_UP, OP_DOWN};
    const OpKind attn[7] = {OP_GEMV, OP_ATTN_SPLIT, OP_ATTN_COMBINE, OP_GEMV, OP_ROUTER, OP_GATE_UP, OP_DOWN};
    if (attention) return phase < 7 ? attn[phase] : OP_NONE;
    return phase < 6 ? gdn[phase] : OP_NONE;
}

// A GEMV of layer L and its format: which 0 the mixer's input projections, 1 its output
// projection, 2 the router.
__device__ GemvOp layer_gemv(const DecArgs& A, const DecLayer& L, const DecLayerState& S, int which, int& bits) {
    if (which == 2) {
        bits = BITS_ROUTER;
        return GemvOp{&L.m.router, 2, X_NORMED, Y_ROUTER, A.hidden, L.post_norm, nullptr, nullptr};
    }
    if (L.attention) {
        if (which == 0) {
            bits = BITS_ATTN_IN;
            return GemvOp{&L.a.q, 3, X_NORMED, Y_ATTN_PROJ, A.hidden, L.input_norm, nullptr, nullptr};
        }
        bits = BITS_ATTN_OUT;
        return GemvOp{&L.a.o, 1, X_PLAIN, Y_RESIDUAL, A.attn_out, nullptr, nullptr, nullptr};
    }
    if (which == 0) {
        bits = BITS_GDN_IN;
        return GemvOp{&L.g.qkv, 4, X_NORMED, Y_GDN_PROJ, A.hidden, L.input_norm, L.g.conv, S.window};
    }
    bits = BITS_GDN_OUT;
    return GemvOp{&L.g.out, 1, X_GATED, Y_RESIDUAL, nullptr, L.g.norm, nullptr, nullptr};
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) decode_step(const DecArgs A) {
    const int blk = blockIdx.x, nblk = gridDim.x;
    GemvSmem& gsm = op_smem<GemvSmem>();
    __shared__ int ids[TOPK];
    __shared__ float weights[TOPK];
    GridSync sync{A.sync, 0, A.timeline, 0};
    mark_time(sync);
    const int pos = ldcg_int(A.pos);
    float best_v = -INFINITY;
    int best_i = 0x7fffffff;

    embed_row<BITS_EMBED>(A.model->embed, (long)ldcg_int((const int*)A.token), A.hidden, blk, nblk);
    grid_sync(sync, nblk);
    // Each op's code appears once in the loop (see step_gemv).
    for (int l = 0; l < A.nlayers; l++) {
        const DecLayer& L = A.layers[l];
        const DecLayerState& S = A.states[l];
        for (int phase = 0;; phase++) {
            const OpKind kind = layer_op(L.attention, phase);
            if (kind == OP_NONE) break;
            switch (kind) {
            case OP_GEMV: {
                int bits;
                const GemvOp op = layer_gemv(A, L, S, phase == 0 ? 0 : 1, bits);
                gemv_any(A, op, bits, gsm, blk, nblk, best_v, best_i);
                break;
            }
            case OP_ROUTER: {
                int bits;
                const GemvOp op = layer_gemv(A, L, S, 2, bits);
                step_gemv<BITS_ROUTER, DEC_ROUTE_ROWS, DEC_ROUTE_BATCH>(A, op, gsm, blk, nblk, best_v, best_i);
                break;
            }
            case OP_GDN_RECUR: gdn_recur(A, L, S, blk, nblk); break;
            case OP_ATTN_SPLIT:
                attn_split_op(A, L, S, op_smem<SplitSmem>(), pos, blk, nblk);
                break;
            case OP_ATTN_COMBINE: attn_combine_op(A, pos, blk, nblk); break;
            case OP_GATE_UP: moe_gate_up(A, L, gsm, ids, weights, blk, nblk); break;
            case OP_DOWN: moe_down(A, L, blk, nblk); break;
            default: break;
            }
            grid_sync(sync, nblk);
        }
    }
    int bits = BITS_LM;
    const GemvOp head{&A.model->lm_head, 1, X_NORMED, Y_LOGITS, A.hidden, A.model->final_norm, nullptr, nullptr};
    gemv_any(A, head, bits, gsm, blk, nblk, best_v, best_i);
    lm_head_choose(A, best_v, best_i, blk, nblk);
    mark_time(sync);
}

// The dynamic shared memory decode_step needs, the sizes of the structs decode.rs mirrors, and
// the block size it is written for
// (read once at start: a mirror that drifted is refused before the first step).
extern "C" __global__ void decode_layout(u32* out) {
    size_t smem = sizeof(GemvSmem);
    smem = smem > sizeof(SplitSmem) ? smem : sizeof(SplitSmem);
    smem = smem > sizeof(GdnStepSmem<DEC_THREADS / GDN_COLS>) ? smem : sizeof(GdnStepSmem<DEC_THREADS / GDN_COLS>);
    smem = smem > sizeof(DownSmem<BITS_EXPERT>) ? smem : sizeof(DownSmem<BITS_EXPERT>);
    out[0] = (u32)(DEC_RING_BYTES + smem);
    out[1] = (u32)sizeof(DecArgs);
    out[2] = (u32)sizeof(DecLayer);
    out[3] = (u32)sizeof(DecLayerState);
    out[4] = (u32)sizeof(DecModel);
    out[5] = DEC_THREADS;
}
