// Gated DeltaNet for one decode token of each sequence in a step (the bodies shared with the
// persistent step are in gdn_decode.cuh). The grid's last dimension is the row: each sequence's
// activations at its row of the step's buffers, its conv window and recurrent state from the
// row's pointer.

// The fused input projection of a row: [qkv (CONV_DIM) | z (NV·DV) | b (NV) | a (NV)].
#define GDN_PROJ (CONV_DIM + NV * DV + 2 * NV)

// The integer route's recurrence (its projection did the conv, its output projection does the
// gated norm): one (value head, GDN_COLS columns) item per block, 4 row groups (GDN_COLS · 4
// threads).
extern "C" __global__ void gdn_step(const float* conv, const float* proj, const float* a_log,
                                    const float* dt_bias, RowPtrs state, float* out) {
    __shared__ GdnStepSmem<4> sm;
    // The recurrent state is this kernel's own from the previous token, so the body reads it
    // before waiting. `blockIdx.z` is the batch row.
    gdn_step_cols<4>(blockIdx.x, blockIdx.y * GDN_COLS, conv + blockIdx.z * CONV_DIM, proj + blockIdx.z * GDN_PROJ,
                     a_log, dt_bias, (float*)state.at(blockIdx.z), out + blockIdx.z * NV * DV, sm,
                     [] { pdl_wait(); });
    STAMP_END(1)
}

// gdn_decode_step: the conv, the delta rule and the gated norm of one value head of one row, a
// block (GDN_GROUPS row groups of DV columns). As three launches (conv, step, norm) the two small
// ones cost the chain ~3.3 and ~2.2 µs a layer for work that takes a fraction of that here: the
// conv's taps and weights are read before the wait like the state, and the norm's sum is one more
// reduction in a block that already holds the head's whole output. Measured on the H100: +3.2 %
// at B = 1 where +6 % was predicted (64 KB of state in and out of each of only 32 SMs), nothing
// at B = 8 (256 blocks of 512 threads, two waves); docs/BENCHMARKS.md, twentieth session.
#define GDN_THREADS ((DV * GDN_GROUPS + WARP - 1) / WARP * WARP)
#define GDN_ROWS ((DK + GDN_GROUPS - 1) / GDN_GROUPS)   // state rows a thread holds
#define GDN_QK_ITEMS ((2 * DK + GDN_THREADS - 1) / GDN_THREADS)   // q|k channels a thread convolves

struct GdnDecodeSmem {
    float qn[DK], kn[DK];
    float part[GDN_GROUPS][DV];
    float scratch[2][WARP];
    int last;
};

// The conv of one channel from its taps (the window's CONV_K-1 inputs, oldest first) and its
// new input, then SiLU: gdn_conv_channel's arithmetic, in its order.
__device__ __forceinline__ float gdn_conv_taps(const float (&w)[CONV_K], const float (&tap)[CONV_K - 1], float cur) {
    float acc = w[CONV_K - 1] * cur;
#pragma unroll
    for (int k = 0; k < CONV_K - 1; k++) acc += w[k] * tap[k];
    return siluf(acc);
}

// A channel's window slid by one: its taps move down a row and the new input takes the last.
__device__ __forceinline__ void gdn_slide(float* window, int ch, const float (&tap)[CONV_K - 1], float cur) {
#pragma unroll
    for (int k = 0; k + 1 < CONV_K - 1; k++) window[k * CONV_DIM + ch] = tap[k + 1];
    window[(CONV_K - 2) * CONV_DIM + ch] = cur;
}

// Item m of a key head's q|k channels: q's channel m, then k's.
__device__ __forceinline__ int gdn_qk_channel(int kh, int m) {
    return m < DK ? kh * DK + m : KEY_DIM + kh * DK + (m - DK);
}

// The NV / NK value heads of a key head all convolve its q and k channels, so none may slide
// that window before the others have read it, and the blocks of one launch run in no set order.
// Each block arrives on its (row, key head) word once its taps are used; the last to arrive
// slides the window and puts the word back to zero for the next launch. A release add: an
// acquire would hold thread 0, and the block behind it, for the add's round trip to L2; the last
// block takes its acquire with a fence once it knows it is last.
__device__ __forceinline__ u32 gdn_arrive(u32* word) {
    u32 before;
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(word) : "memory");
    return before;
}

// gdn_decode_step's body for the row's value head j; it waits through `wait` once it has
// requested what no kernel before it in the step writes.
template <class Wait>
__device__ __forceinline__ void gdn_decode_head(const float* proj, const float* conv_w, RowPtrs windows,
                                                const float* a_log, const float* dt_bias, RowPtrs states,
                                                const float* norm_w, u32* arrivals, float* y, float eps,
                                                GdnDecodeSmem& sm, Wait wait) {
    const int j = blockIdx.x, row = blockIdx.y, kh = j / (NV / NK), t = threadIdx.x;
    const int c = t % DV, rg = t / DV;
    const bool active = rg < GDN_GROUPS;
    proj += row * GDN_PROJ;
    float* window = (float*)windows.at(row);
    float* S = (float*)states.at(row) + (long)j * DK * DV;

    // Before the wait: weights, and this layer's own state and window, which only its step of
    // the previous token wrote.
    float s[GDN_ROWS];
#pragma unroll
    for (int e = 0; e < GDN_ROWS; e++) {
        const int i = rg + e * GDN_GROUPS;
        s[e] = (active && i < DK) ? S[i * DV + c] : 0.f;
    }
    float qk_w[GDN_QK_ITEMS][CONV_K], qk_tap[GDN_QK_ITEMS][CONV_K - 1];
#pragma unroll
    for (int it = 0; it < GDN_QK_ITEMS; it++) {
        const int m = t + it * GDN_THREADS, ch = gdn_qk_channel(kh, m < 2 * DK ? m : 0);
#pragma unroll
        for (int k = 0; k < CONV_K; k++) qk_w[it][k] = m < 2 * DK ? conv_w[ch * CONV_K + k] : 0.f;
#pragma unroll
        for (int k = 0; k < CONV_K - 1; k++) qk_tap[it][k] = m < 2 * DK ? window[k * CONV_DIM + ch] : 0.f;
    }
    const int vch = 2 * KEY_DIM + j * DV + c;
    float v_w[CONV_K], v_tap[CONV_K - 1];
#pragma unroll
    for (int k = 0; k < CONV_K; k++) v_w[k] = active ? conv_w[vch * CONV_K + k] : 0.f;
#pragma unroll
    for (int k = 0; k < CONV_K - 1; k++) v_tap[k] = active ? window[k * CONV_DIM + vch] : 0.f;
    const float a_log_j = a_log[j], dt_bias_j = dt_bias[j], w_c = active ? norm_w[c] : 0.f;

    wait();
    const float b = load_act(proj + CONV_DIM + NV * DV + j);
    const float a = load_act(proj + CONV_DIM + NV * DV + NV + j);
    const float z = active ? load_act(proj + CONV_DIM + j * DV + c) : 0.f;
    const float v_cur = active ? load_act(proj + vch) : 0.f;
    float qk_cur[GDN_QK_ITEMS], qk[GDN_QK_ITEMS];
    float q_ss = 0.f, k_ss = 0.f;
#pragma unroll
    for (int it = 0; it < GDN_QK_ITEMS; it++) {
        const int m = t + it * GDN_THREADS;
        qk_cur[it] = m < 2 * DK ? load_act(proj + gdn_qk_channel(kh, m)) : 0.f;
        qk[it] = gdn_conv_taps(qk_w[it], qk_tap[it], qk_cur[it]);
        if (m < DK) q_ss += qk[it] * qk[it];
        else if (m < 2 * DK) k_ss += qk[it] * qk[it];
    }
    const float v = gdn_conv_taps(v_w, v_tap, v_cur);
    // L2 norms of q and k (eps inside the root), q also scaled by 1/sqrt(DK). The taps feed
    // these sums, so past the pair's barriers every thread has read its window.
    const float2 ss = block_sum_pair(q_ss, k_ss, sm.scratch);
    u32 arrived = 0;
    if (t == 0) arrived = gdn_arrive(arrivals + row * NK + kh);
    const float q_inv = rsqrtf(ss.x + 1e-6f) * rsqrtf((float)DK), k_inv = rsqrtf(ss.y + 1e-6f);
#pragma unroll
    for (int it = 0; it < GDN_QK_ITEMS; it++) {
        const int m = t + it * GDN_THREADS;
        if (m < DK) sm.qn[m] = qk[it] * q_inv;
        else if (m < 2 * DK) sm.kn[m - DK] = qk[it] * k_inv;
    }
    // v's window columns are this block's alone.
    if (active && rg == 0) gdn_slide(window, vch, v_tap, v_cur);
    __syncthreads();

    const float beta = sigmoidf(b);
    float sp = a + dt_bias_j;
    sp = sp > 20.f ? sp : log1pf(expf(sp));
    const float alpha = expf(-expf(a_log_j) * sp);
    float r = 0.f;
#pragma unroll
    for (int e = 0; e < GDN_ROWS; e++) {
        const int i = rg + e * GDN_GROUPS;
        if (i < DK) r += s[e] * sm.kn[i];
    }
    if (active) sm.part[rg][c] = r;
    __syncthreads();
    float pred = 0.f;
    if (active) {
#pragma unroll
        for (int g = 0; g < GDN_GROUPS; g++) pred += sm.part[g][c];
    }
    const float delta = beta * (v - alpha * pred);
    float o = 0.f;
#pragma unroll
    for (int e = 0; e < GDN_ROWS; e++) {
        const int i = rg + e * GDN_GROUPS;
        if (i < DK) {
            s[e] = alpha * s[e] + sm.kn[i] * delta;
            o += s[e] * sm.qn[i];
            if (active) S[i * DV + c] = s[e];
        }
    }
    __syncthreads();   // every column has read its pred from part
    if (active) sm.part[rg][c] = o;
    if (t == 0) {
        sm.last = arrived == NV / NK - 1;
        if (sm.last) asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
    // Gated RMSNorm of the head: normalise, scale by the plain weight, gate with silu(z).
    float oc = 0.f;
    if (active && rg == 0) {
#pragma unroll
        for (int g = 0; g < GDN_GROUPS; g++) oc += sm.part[g][c];
    }
    const float inv = rsqrtf(block_sum(oc * oc, sm.scratch[0]) / DV + eps);
    if (active && rg == 0) y[row * NV * DV + j * DV + c] = oc * inv * w_c * siluf(z);
    if (sm.last) {
#pragma unroll
        for (int it = 0; it < GDN_QK_ITEMS; it++) {
            const int m = t + it * GDN_THREADS;
            if (m < 2 * DK) gdn_slide(window, gdn_qk_channel(kh, m), qk_tap[it], qk_cur[it]);
        }
        if (t == 0) arrivals[row * NK + kh] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    gdn_decode_step(const float* proj, const float* conv_w, RowPtrs windows, const float* a_log, const float* dt_bias,
                    RowPtrs states, const float* norm_w, u32* arrivals, float* y, float eps) {
    __shared__ GdnDecodeSmem sm;
    // The state, the conv window and the weights are read before the wait: the first two only
    // this layer's step of the previous token wrote.
    gdn_decode_head(proj, conv_w, windows, a_log, dt_bias, states, norm_w, arrivals, y, eps, sm,
                    [] { pdl_wait(); });
    STAMP_END(1)
}
