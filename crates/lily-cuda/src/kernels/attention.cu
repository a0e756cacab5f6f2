// Gated attention for one decode token. Constants: NH query heads, NKV KV heads, HD head dim,
// ROT rotary dims, ROPE_THETA. The position comes from device memory, so a
// captured graph replays unchanged from step to step.


// Per head (one warp a block): RMSNorm and RoPE (head_norm_rope); queries go to `q_out`, keys
// and values into the cache at the current position. Blocks 0..NH-1 are query heads,
// NH..NH+NKV-1 KV heads. qkv = [q|gate per head (NH·2·HD) | k (NKV·HD) | v].
extern "C" __global__ void attn_prep(const float* qkv, const float* q_norm, const float* k_norm,
                                     const int* pos_ptr, float* q_out, kv_t* k_cache, kv_t* v_cache,
                                     float eps) {
    pdl_wait();
    __shared__ float tmp[HD];
    int head = blockIdx.x, lane = threadIdx.x;
    bool is_q = head < NH;
    int kv = head - NH;
    const float* src = is_q ? qkv + head * 2 * HD : qkv + NH * 2 * HD + kv * HD;
    int pos = pos_ptr[0];
    float y[HEAD_PER_LANE];
    head_norm_rope(src, is_q ? q_norm : k_norm, eps, pos, tmp, lane, y);
    store_head(is_q, y, lane, q_out + head * HD, k_cache, v_cache, pos, kv, qkv + NH * 2 * HD + NKV * HD + kv * HD);
}

// One block per (KV head, split of the context); the split count is the grid's y size, chosen
// per sequence from its longest context.
extern "C" __global__ void __launch_bounds__(4 * WARP)
attn_split(const float* q, const kv_t* k_cache, const kv_t* v_cache, const int* pos_ptr,
           float* part_ml, float* part_acc) {
    pdl_wait();
    __shared__ AsSmem<4> sm;
    attn_split_block<4>(q + blockIdx.x * GROUP * HD, k_cache, v_cache, pos_ptr[0] + 1, blockIdx.x, blockIdx.y, gridDim.y, part_ml,
                        part_acc, sm);
}

// Merges the splits of each query head and applies the sigmoid output gate: block h, thread d.
extern "C" __global__ void attn_combine(const float* part_ml, const float* part_acc, int nsplit,
                                        const float* qkv, float* out) {
    pdl_wait();
    int h = blockIdx.x, d = threadIdx.x;
    if (d >= HD) return;
    out[h * HD + d] = attn_combine_one(h, d, part_ml, part_acc, nsplit, qkv);
}
