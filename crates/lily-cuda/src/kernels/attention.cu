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
    int p = *(const int*)pos.p[row];
    const HeadValue value = load_head_value(is_q, qkv + NH * 2 * HD + NKV * HD + kv * HD, lane);
    float y[HEAD_PER_LANE];
    head_norm_rope(src, is_q ? q_norm : k_norm, eps, p, tmp, lane, y);
    store_head(is_q, y, lane, q_out + (row * NH + head) * HD, (kv_t*)k_cache.p[row], (kv_t*)v_cache.p[row], p, kv,
               value);
}

// One block per (KV head, split of the context); a row's split count (chosen per sequence from
// its longest context) is at most the grid's y size, the splits its current length keeps live
// (attn_live_splits) fewer still, and the blocks past them have nothing to do.
extern "C" __global__ void __launch_bounds__(4 * WARP)
attn_split(const float* q, RowPtrs k_cache, RowPtrs v_cache, RowPtrs pos, RowInts nsplit, float* part_ml,
           float* part_acc) {
    pdl_wait();
    __shared__ AsSmem<4> sm;
    const int row = blockIdx.z, len = *(const int*)pos.p[row] + 1, splits = attn_live_splits(len, nsplit.n[row]);
    if ((int)blockIdx.y >= splits) return;
    attn_split_block<4>(q + (row * NH + blockIdx.x * GROUP) * HD, (const kv_t*)k_cache.p[row],
                        (const kv_t*)v_cache.p[row], len, blockIdx.x, blockIdx.y, splits,
                        part_ml + row * ATTN_PARTS * 2, part_acc + row * ATTN_PARTS * HD, sm);
    STAMP_END(1)
}

// Merges the splits of each query head and applies the sigmoid output gate: block h, thread d.
extern "C" __global__ void attn_combine(const float* part_ml, const float* part_acc, RowPtrs pos, RowInts nsplit,
                                        const float* qkv, float* out) {
    pdl_wait();
    int h = blockIdx.x, d = threadIdx.x, row = blockIdx.y;
    if (d >= HD) return;
    const int splits = attn_live_splits(*(const int*)pos.p[row] + 1, nsplit.n[row]);
    out[(row * NH + h) * HD + d] = attn_combine_one(h, d, part_ml + row * ATTN_PARTS * 2,
                                                    part_acc + row * ATTN_PARTS * HD, splits,
                                                    qkv + row * ATTN_PROJ);
}
