// The Gated DeltaNet recurrence for one decode token, shared by the graph step (gdn.cu) and the
// persistent step (decode.cu). Constants: NK key heads, NV value heads, DK, DV head dims, CONV_K
// conv taps. The fused projection `proj` is [qkv (CONV_DIM) | z (NV·DV) | b (NV) | a (NV)].

#define KEY_DIM (NK * DK)
#define CONV_DIM (2 * NK * DK + NV * DV)
#define GDN_COLS (DV < 32 ? DV : 32)                 // state columns per item

// The causal depthwise conv of channel ch (a q|k|v channel) with the cached window, then SiLU:
// `cur` is the channel's new pre-conv value. The window holds the previous CONV_K-1 pre-conv
// rows, oldest first, and slides by one; only the caller for ch touches its column.
__device__ __forceinline__ float gdn_conv_channel(int ch, float cur, const float* conv_w, float* window) {
    const float* w = conv_w + ch * CONV_K;
    float acc = w[CONV_K - 1] * cur;
#pragma unroll
    for (int j = 0; j < CONV_K - 1; j++) acc += w[j] * window[j * CONV_DIM + ch];
#pragma unroll
    for (int j = 0; j < CONV_K - 2; j++) window[j * CONV_DIM + ch] = window[(j + 1) * CONV_DIM + ch];
    window[(CONV_K - 2) * CONV_DIM + ch] = cur;
    return siluf(acc);
}

template <int ROW_GROUPS>
struct GdnStepSmem {
    float qn[DK], kn[DK];
    float scratch[32];
    float part[ROW_GROUPS][GDN_COLS];
};

// The delta rule for value head j and GDN_COLS columns of its state S[DK][DV] (fp32) from col0,
// by GDN_COLS · ROW_GROUPS threads (the block's first ones; the rest only join the barriers).
// Each column is held by ROW_GROUPS threads, each with a slice of the rows in registers; S is
// read and written exactly once. q and k are L2-normalised here (every item of a key head redoes
// that small work rather than adding a step).
//
// The state is read before wait() (pdl_wait in the graph step): it is this layer's own, last
// written by the previous token's step, never by the kernels just before this one, so its
// DRAM round trip overlaps them instead of following the q and k norms. So are the gates'
// weights (a_log, dt_bias), which nothing writes.
template <int ROW_GROUPS, class Wait>
__device__ void gdn_step_cols(int j, int col0, const float* conv, const float* proj, const float* a_log,
                              const float* dt_bias, float* state, float* out, GdnStepSmem<ROW_GROUPS>& sm,
                              Wait wait) {
    constexpr int ROWS_PER_THREAD = (DK + ROW_GROUPS - 1) / ROW_GROUPS;
    float* qn = sm.qn;
    float* kn = sm.kn;
    int kh = j / (NV / NK);
    int t = threadIdx.x;
    int c = t % GDN_COLS, rg = t / GDN_COLS;
    int col = col0 + c;
    bool active = rg < ROW_GROUPS && col < DV;
    float* S = state + (long)j * DK * DV;
    float s[ROWS_PER_THREAD];
#pragma unroll
    for (int e = 0; e < ROWS_PER_THREAD; e++) {
        int i = rg + e * ROW_GROUPS;
        s[e] = (active && i < DK) ? S[i * DV + col] : 0.f;
    }
    const float a_log_j = a_log[j], dt_bias_j = dt_bias[j];
    wait();
    // The gates' inputs and this thread's v are requested with q and k, right after the wait:
    // asked for where they are used, behind the norms' barriers, they were two more round trips
    // to L2 on the chain.
    const float b = load_act(proj + CONV_DIM + NV * DV + j);
    const float a = load_act(proj + CONV_DIM + NV * DV + NV + j);
    const float v = active ? load_act(conv + 2 * KEY_DIM + j * DV + col) : 0.f;
    // L2 norms of q and k (eps inside the root), q also scaled by 1/sqrt(DK).
    float qv = 0.f, kv = 0.f;
    for (int i = t; i < DK; i += blockDim.x) {
        float q = load_act(conv + kh * DK + i), k = load_act(conv + KEY_DIM + kh * DK + i);
        qv += q * q;
        kv += k * k;
    }
    float q_inv = rsqrtf(block_sum(qv, sm.scratch) + 1e-6f) * rsqrtf((float)DK);
    float k_inv = rsqrtf(block_sum(kv, sm.scratch) + 1e-6f);
    for (int i = t; i < DK; i += blockDim.x) {
        qn[i] = load_act(conv + kh * DK + i) * q_inv;
        kn[i] = load_act(conv + KEY_DIM + kh * DK + i) * k_inv;
    }
    __syncthreads();

    float beta = sigmoidf(b);
    float sp = a + dt_bias_j;
    sp = sp > 20.f ? sp : log1pf(expf(sp));
    float alpha = expf(-expf(a_log_j) * sp);

    float r = 0.f;
#pragma unroll
    for (int e = 0; e < ROWS_PER_THREAD; e++) {
        int i = rg + e * ROW_GROUPS;
        if (i < DK) r += s[e] * kn[i];
    }
    if (rg < ROW_GROUPS) sm.part[rg][c] = r;
    __syncthreads();
    float pred = 0.f;
#pragma unroll
    for (int g = 0; g < ROW_GROUPS; g++) pred += sm.part[g][c];
    float delta = beta * (v - alpha * pred);
    float o = 0.f;
#pragma unroll
    for (int e = 0; e < ROWS_PER_THREAD; e++) {
        int i = rg + e * ROW_GROUPS;
        if (i < DK) {
            s[e] = alpha * s[e] + kn[i] * delta;
            o += s[e] * qn[i];
            if (active) S[i * DV + col] = s[e];
        }
    }
    __syncthreads();
    if (rg < ROW_GROUPS) sm.part[rg][c] = o;
    __syncthreads();
    if (active && rg == 0) {
        float sum = 0.f;
#pragma unroll
        for (int g = 0; g < ROW_GROUPS; g++) sum += sm.part[g][c];
        out[j * DV + col] = sum;
    }
    __syncthreads();   // sm is free for the caller's next item
}
