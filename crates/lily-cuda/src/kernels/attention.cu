// Gated attention for one decode token of each sequence in a step. Constants: NH query heads, NKV
// KV heads, HD head dim, ROT rotary dims, ROPE_THETA, MAX_ATTN_SPLITS. The grid's last dimension
// is the row: each sequence's activations at its row of the step's buffers, its KV cache and
// position from the row's pointers. Positions come from device memory, so a captured graph
// replays unchanged from step to step.

// A row's fused projection: [q|gate per head (NH·2·HD) | k (NKV·HD) | v (NKV·HD)].
#define ATTN_PROJ (NH * 2 * HD + 2 * NKV * HD)
// Partial results a row's splits can leave (heads × splits), the row stride of part_ml / part_acc.
#define ATTN_PARTS ((long)NKV * MAX_ATTN_SPLITS * GROUP)

// Per head (one warp a block): RMSNorm and RoPE (head_norm_rope); queries go to `q_out`, keys
// and values into the cache at the current position. Blocks 0..NH-1 are query heads,
// NH..NH+NKV-1 KV heads.
extern "C" __global__ void attn_prep(const float* qkv, const float* q_norm, const float* k_norm, RowPtrs pos,
                                     float* q_out, RowPtrs k_cache, RowPtrs v_cache, float eps) {
    pdl_wait();
    __shared__ float tmp[HD];
    int head = blockIdx.x, lane = threadIdx.x, row = blockIdx.y;
    qkv += row * ATTN_PROJ;
    bool is_q = head < NH;
    int kv = head - NH;
    const float* src = is_q ? qkv + head * 2 * HD : qkv + NH * 2 * HD + kv * HD;
    int p = *(const int*)pos.at(row);
    const HeadValue value = load_head_value(is_q, qkv + NH * 2 * HD + NKV * HD + kv * HD, lane);
    float y[HEAD_PER_LANE];
    head_norm_rope(src, is_q ? q_norm : k_norm, eps, p, tmp, lane, y);
    store_head(is_q, y, lane, q_out + (row * NH + head) * HD, (kv_t*)k_cache.at(row), (kv_t*)v_cache.at(row), p, kv,
               value);
}

// One block per (KV head, split of the context); a row's split count (chosen per sequence from
// its longest context) is at most the grid's y size, the splits its current length keeps live
// (attn_live_splits) fewer still, and the blocks past them have nothing to do. Bounded to three
// blocks an SM (168 registers, no spill; unbounded, 190 fit two): a 128K context's 1,026 blocks
// then run in three waves instead of four.
extern "C" __global__ void __launch_bounds__(4 * WARP, 3)
attn_split(const float* q, RowPtrs k_cache, RowPtrs v_cache, RowPtrs pos, RowInts nsplit, float* part_ml,
           float* part_acc) {
    pdl_wait();
    __shared__ AsSmem<4> sm;
    const int row = blockIdx.z, len = *(const int*)pos.at(row) + 1, splits = attn_live_splits(len, nsplit.at(row));
    if ((int)blockIdx.y >= splits) return;
    attn_split_block<4>(q + (row * NH + blockIdx.x * GROUP) * HD, (const kv_t*)k_cache.at(row),
                        (const kv_t*)v_cache.at(row), len, blockIdx.x, blockIdx.y, splits,
                        part_ml + row * ATTN_PARTS * 2, part_acc + row * ATTN_PARTS * HD, sm);
    STAMP_END(1)
}

// Merges the splits of each query head and applies the sigmoid output gate: block h of row
// blockIdx.y, COMBINE_WARPS warps. A thread per dim walking the splits in turn (the persistent
// step's attn_combine_one) is a chain of round trips to L2 that grows with the context: the max,
// then each split's weight before its partial output can be requested, four splits at a time
// (~130 round trips at 512 live splits, a 128K context). Here thread s loads split s's (max, sum)
// and the thread of dim d its gate, all right after the wait and once each, so the merge starts
// one round trip in and the gate costs none at the end; every weight goes to shared memory; then
// each warp sums its own range of splits, a lane 8 dims (two float4 loads a split, COMBINE_UNROLL
// splits in flight), and the warps that had splits are added in warp order: a fixed order, so a
// row gets the same bits in any launch.
#define COMBINE_UNROLL 4
static_assert(HD <= 8 * WARP, "attn_combine: 8 dims a lane");
static_assert(COMBINE_WARPS * WARP >= MAX_ATTN_SPLITS, "attn_combine: a thread a split");  // compile.rs, ATTN_COMBINE_THREADS
static_assert(COMBINE_WARPS * WARP >= HD, "attn_combine: a thread a dim");

extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * WARP)
attn_combine(const float* part_ml, const float* part_acc, RowPtrs pos, RowInts nsplit, const float* qkv, float* out) {
    __shared__ float weight[MAX_ATTN_SPLITS];
    __shared__ __align__(16) float wacc[COMBINE_WARPS][HD];
    __shared__ float scratch[WARP];
    pdl_wait();
    const int h = blockIdx.x, row = blockIdx.y, kv = h / GROUP, g = h % GROUP, t = threadIdx.x;
    const int lane = t % WARP, warp = t / WARP;
    const int splits = attn_live_splits(*(const int*)pos.at(row) + 1, nsplit.at(row));
    // Split s of this head: (max, sum) at ml[s · GROUP · 2], its output at acc[s · GROUP · HD].
    const float* ml = part_ml + row * ATTN_PARTS * 2 + ((long)kv * splits * GROUP + g) * 2;
    const float* acc = part_acc + row * ATTN_PARTS * HD + ((long)kv * splits * GROUP + g) * HD;
    const float2 mine = t < splits ? load_act2(ml + (long)t * GROUP * 2) : make_float2(-INFINITY, 0.f);
    const float gate = t < HD ? load_act(qkv + row * ATTN_PROJ + h * 2 * HD + HD + t) : 0.f;
    const float mx = block_max(mine.x, scratch);
    // Each split's weight exp(max_s - max), 0 for a split with no positions.
    const float f = mine.x == -INFINITY ? 0.f : __expf(mine.x - mx);
    if (t < splits) weight[t] = f;
    const float sum = block_sum(f * mine.y, scratch);   // its barriers publish `weight` too
    const int per = (splits + COMBINE_WARPS - 1) / COMBINE_WARPS, used = (splits + per - 1) / per;
    const int s0 = min(splits, warp * per), s1 = min(splits, s0 + per);
    const int d0 = lane * 8;
    if (warp < used && d0 < HD) {
        float a[8] = {};
        // A split with no weight adds nothing, whatever its (unwritten) output holds.
        auto add = [&](float f, float4 x, float4 y) {
            const float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
#pragma unroll
            for (int j = 0; j < 8; j++) a[j] = f != 0.f ? __fmaf_rn(f, v[j], a[j]) : a[j];
        };
        int s = s0;
        for (; s + COMBINE_UNROLL <= s1; s += COMBINE_UNROLL) {
            float4 x[COMBINE_UNROLL][2];
#pragma unroll
            for (int u = 0; u < COMBINE_UNROLL; u++) {
                const float* src = acc + (long)(s + u) * GROUP * HD + d0;
                x[u][0] = load_act4(src);
                x[u][1] = load_act4(src + 4);
            }
#pragma unroll
            for (int u = 0; u < COMBINE_UNROLL; u++) add(weight[s + u], x[u][0], x[u][1]);
        }
        for (; s < s1; s++) {
            const float* src = acc + (long)s * GROUP * HD + d0;
            add(weight[s], load_act4(src), load_act4(src + 4));
        }
        *(float4*)&wacc[warp][d0] = make_float4(a[0], a[1], a[2], a[3]);
        *(float4*)&wacc[warp][d0 + 4] = make_float4(a[4], a[5], a[6], a[7]);
    }
    __syncthreads();
    if (t < HD) {
        float total = 0.f;
        for (int w = 0; w < used; w++) total += wacc[w][t];
        out[(row * NH + h) * HD + t] = total / sum * sigmoidf(gate);
    }
}
