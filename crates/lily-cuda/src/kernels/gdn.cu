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

// gdn_decode_step: the conv, the delta rule and the gated norm of one row's value head j,
// GDN_COLS columns of it a block (4 row groups, as gdn_step). As three launches (conv, step,
// norm) the two small ones cost the chain ~3.3 and ~2.2 µs a layer on the H100 for a fraction of
// that in work: here the conv's taps and weights are read before the wait like the state. The
// first form, a block a whole value head (the norm's sum inside it), put 64 KB of state in and
// out of each of 32 SMs at B = 1 and needed two waves at B = 8: +3.2 % where this was to be +6 %.
// A head's column blocks meet at the norm instead: each leaves its columns' o and sum of squares,
// and the last to arrive normalises the head.
#define GDN_CG ((DV + GDN_COLS - 1) / GDN_COLS)                          // column blocks a value head
#define GDN_THREADS ((GDN_COLS * 4 + WARP - 1) / WARP * WARP)
#define GDN_ROWS (DK / 4 + (DK % 4 != 0))                                // state rows a thread holds
#define GDN_QK_ITEMS ((2 * DK + GDN_THREADS - 1) / GDN_THREADS)          // q|k channels a thread convolves
#define GDN_HEAD_ITEMS ((DV + GDN_THREADS - 1) / GDN_THREADS)            // head columns a thread normalises

struct GdnDecodeSmem {
    float qn[DK], kn[DK];
    float part[4][GDN_COLS];
    float scratch[2][WARP];
    int last_key, last_head;
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

// Blocks of one launch run in no set order, so where several share something, each arrives on
// a word once its part is done (gdn_arrive) and the last to arrive (gdn_was_last) does what needs
// them all, then puts the word back to zero for the next launch. A release add: an acquire would
// hold the thread for the add's round trip to L2 where it is issued, and the key head's arrival
// is only looked at at the block's end; the last takes its acquire with a fence.
__device__ __forceinline__ u32 gdn_arrive(u32* word) {
    u32 before;
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(word) : "memory");
    return before;
}

__device__ __forceinline__ bool gdn_was_last(u32 before, u32* word, u32 arrivals) {
    const bool last = before == arrivals - 1;
    if (last) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        *word = 0;
    }
    return last;
}

// gdn_decode_step's body for column block cg of the row's value head j; it waits through `wait`
// once it has requested what no kernel before it in the step writes.
template <class Wait>
__device__ __forceinline__ void gdn_decode_cols(const float* proj, const float* conv_w, RowPtrs windows,
                                                const float* a_log, const float* dt_bias, RowPtrs states,
                                                const float* norm_w, u32* arrivals, float* o_rows, float* sumsq,
                                                float* y, float eps, GdnDecodeSmem& sm, Wait wait) {
    const int j = blockIdx.x, cg = blockIdx.y, row = blockIdx.z, kh = j / (NV / NK), t = threadIdx.x;
    const int c = t % GDN_COLS, rg = t / GDN_COLS, col = cg * GDN_COLS + c;
    const bool active = rg < 4 && col < DV;
    proj += row * GDN_PROJ;
    float* window = (float*)windows.at(row);
    float* S = (float*)states.at(row) + (long)j * DK * DV;

    // Before the wait: weights, and this layer's own state and window, which only its step of
    // the previous token wrote.
    float s[GDN_ROWS];
#pragma unroll
    for (int e = 0; e < GDN_ROWS; e++) {
        const int i = rg + e * 4;
        s[e] = (active && i < DK) ? S[i * DV + col] : 0.f;
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
    const int vch = 2 * KEY_DIM + j * DV + col;
    float v_w[CONV_K], v_tap[CONV_K - 1];
#pragma unroll
    for (int k = 0; k < CONV_K; k++) v_w[k] = active ? conv_w[vch * CONV_K + k] : 0.f;
#pragma unroll
    for (int k = 0; k < CONV_K - 1; k++) v_tap[k] = active ? window[k * CONV_DIM + vch] : 0.f;
    float head_w[GDN_HEAD_ITEMS];
#pragma unroll
    for (int it = 0; it < GDN_HEAD_ITEMS; it++) {
        const int d = t + it * GDN_THREADS;
        head_w[it] = d < DV ? norm_w[d] : 0.f;
    }
    const float a_log_j = a_log[j], dt_bias_j = dt_bias[j];

    wait();
    // Every input of the block requested at once: each asked for where it is used is one more
    // round trip to L2 on the chain. z of the whole head, for whichever block normalises it.
    const float b = load_act(proj + CONV_DIM + NV * DV + j);
    const float a = load_act(proj + CONV_DIM + NV * DV + NV + j);
    const float v_cur = active ? load_act(proj + vch) : 0.f;
    float z[GDN_HEAD_ITEMS];
#pragma unroll
    for (int it = 0; it < GDN_HEAD_ITEMS; it++) {
        const int d = t + it * GDN_THREADS;
        z[it] = d < DV ? load_act(proj + CONV_DIM + j * DV + d) : 0.f;
    }
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
    u32* key_word = arrivals + row * (NK + NV) + kh;
    u32 key_before = 0;
    if (t == 0) key_before = gdn_arrive(key_word);
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
        const int i = rg + e * 4;
        if (i < DK) r += s[e] * sm.kn[i];
    }
    if (rg < 4) sm.part[rg][c] = r;
    __syncthreads();
    float pred = 0.f;
    if (rg < 4) {
#pragma unroll
        for (int g = 0; g < 4; g++) pred += sm.part[g][c];
    }
    const float delta = beta * (v - alpha * pred);
    float o = 0.f;
#pragma unroll
    for (int e = 0; e < GDN_ROWS; e++) {
        const int i = rg + e * 4;
        if (i < DK) {
            s[e] = alpha * s[e] + sm.kn[i] * delta;
            o += s[e] * sm.qn[i];
            if (active) S[i * DV + col] = s[e];
        }
    }
    __syncthreads();   // every column has read its pred from part
    if (rg < 4) sm.part[rg][c] = o;
    if (t == 0) sm.last_key = gdn_was_last(key_before, key_word, (NV / NK) * GDN_CG);
    __syncthreads();
    float oc = 0.f;
    if (rg == 0) {
#pragma unroll
        for (int g = 0; g < 4; g++) oc += sm.part[g][c];
    }
    // Gated RMSNorm of the head: normalise, scale by the plain weight, gate with silu(z).
    y += row * NV * DV + j * DV;
#if GDN_CG == 1
    const float inv = rsqrtf(block_sum(active && rg == 0 ? oc * oc : 0.f, sm.scratch[0]) / DV + eps);
    if (active && rg == 0) y[col] = oc * inv * head_w[0] * siluf(z[0]);
#else
    // GDN_COLS is a whole warp here (DV > 32): warp 0 holds the block's columns.
    o_rows += row * NV * DV + j * DV;
    if (rg == 0) {
        const float part_ss = warp_sum(active ? oc * oc : 0.f);
        if (active) o_rows[col] = oc;
        if (c == 0) sumsq[(row * NV + j) * GDN_CG + cg] = part_ss;
        __threadfence();
        __syncwarp();
        if (c == 0) {
            u32* head_word = arrivals + row * (NK + NV) + NK + j;
            sm.last_head = gdn_was_last(gdn_arrive(head_word), head_word, GDN_CG);
        }
    }
    __syncthreads();
    if (sm.last_head) {
        float total = 0.f;
        for (int g = 0; g < GDN_CG; g++) total += load_act(sumsq + (row * NV + j) * GDN_CG + g);
        const float inv = rsqrtf(total / DV + eps);
#pragma unroll
        for (int it = 0; it < GDN_HEAD_ITEMS; it++) {
            const int d = t + it * GDN_THREADS;
            if (d < DV) y[d] = load_act(o_rows + d) * inv * head_w[it] * siluf(z[it]);
        }
    }
#endif
    if (sm.last_key) {
#pragma unroll
        for (int it = 0; it < GDN_QK_ITEMS; it++) {
            const int m = t + it * GDN_THREADS;
            if (m < 2 * DK) gdn_slide(window, gdn_qk_channel(kh, m), qk_tap[it], qk_cur[it]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    gdn_decode_step(const float* proj, const float* conv_w, RowPtrs windows, const float* a_log, const float* dt_bias,
                    RowPtrs states, const float* norm_w, u32* arrivals, float* o, float* sumsq, float* y,
                    float eps, const L2Span* ahead, int ahead_spans) {
    __shared__ GdnDecodeSmem sm;
    // The state, the conv window and the weights are read before the wait: the first two only
    // this layer's step of the previous token wrote.
    // arrivals: NK words a row (the key head's q|k window: every column block of its value heads
    // convolves it, none may slide it before all have read it), then NV (the value head's norm).
    // o and sumsq: a row's NV·DV columns of o and NV·GDN_CG partial sums of squares.
    // Past the wait the DRAM has only the states to move: the output projection's weights
    // (`ahead`) are requested into L2 then.
    const L2Span ahead_span = l2_span_of(ahead, ahead_spans);
    gdn_decode_cols(proj, conv_w, windows, a_log, dt_bias, states, norm_w, arrivals, o, sumsq, y, eps, sm, [&] {
        pdl_wait();
        l2_ahead(ahead_span, (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x,
                 gridDim.x * gridDim.y * gridDim.z);
    });
    STAMP_END(1)
}
