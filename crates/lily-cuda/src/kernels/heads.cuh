// Attention heads before the attention, shared by attention.cu, attention_prefill.cu and decode.cu.
//
// RMSNorm (q_norm / k_norm weights `scale`) then rotate-half RoPE on the first ROT dims at `pos`
// of one head of HD values, by one warp, the same code for prefill and decode; dim lane + 32·i
// lands in y[i]. tmp: HD floats of shared memory this warp owns (the rotation reads each dim's
// partner).
#define HEAD_PER_LANE ((HD + WARP - 1) / WARP)
__device__ void head_norm_rope(const float* src, const float* scale, float eps, int pos, float* tmp, int lane,
                               float (&y)[HEAD_PER_LANE]) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++) {
        int d = lane + WARP * i;
        y[i] = d < HD ? load_act(src + d) : 0.f;
        ss += y[i] * y[i];
    }
    float inv = rsqrtf(warp_sum(ss) / HD + eps);
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++) {
        int d = lane + WARP * i;
        if (d < HD) {
            y[i] = y[i] * inv * scale[d];
            tmp[d] = y[i];
        }
    }
    __syncwarp();
    const int half = ROT / 2;
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++) {
        int d = lane + WARP * i;
        if (d < ROT) {
            int k = d < half ? d : d - half;
            float inv_freq = 1.f / powf((float)ROPE_THETA, (float)(2 * k) / (float)ROT);
            float s, co;
            sincosf((float)pos * inv_freq, &s, &co);
            y[i] = d < half ? tmp[d] * co - tmp[d + half] * s : tmp[d] * co + tmp[d - half] * s;
        }
    }
    __syncwarp();   // tmp is free again
}

// A key head's value (HD floats at v_src), dim lane + 32·i in v[i], for store_head: loaded before
// head_norm_rope, so that its round trip to L2 overlaps the head's instead of following it.
struct HeadValue {
    float v[HEAD_PER_LANE];
};

__device__ __forceinline__ HeadValue load_head_value(bool is_q, const float* v_src, int lane) {
    HeadValue h = {};
    if (!is_q)
#pragma unroll
        for (int i = 0; i < HEAD_PER_LANE; i++) {
            int d = lane + WARP * i;
            if (d < HD) h.v[i] = load_act(v_src + d);
        }
    return h;
}

// Stores a head that head_norm_rope left in y: a query into q (HD floats, global or shared), or a
// key into the cache at `pos` with its value (load_head_value's) beside it.
__device__ __forceinline__ void store_head(bool is_q, const float (&y)[HEAD_PER_LANE], int lane, float* q,
                                           kv_t* k_cache, kv_t* v_cache, long pos, int kv, const HeadValue& value) {
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++) {
        int d = lane + WARP * i;
        if (d >= HD) continue;
        if (is_q) {
            q[d] = y[i];
        } else {
            long at = (pos * NKV + kv) * HD + d;
            k_cache[at] = kv_store(y[i]);
            v_cache[at] = kv_store(value.v[i]);
        }
    }
}
