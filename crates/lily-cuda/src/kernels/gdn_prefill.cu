// Gated DeltaNet over a prefill chunk of t tokens (decode's gdn.cu, token-batched). The input
// `proj` is [t, ld], each row the fused projection [qkv (CONV_DIM) | z (NV·DV) | b (NV) | a (NV)].
// Carried across chunks, in decode's layouts: the conv window (the previous CONV_K-1 pre-conv qkv
// rows, oldest first) and the fp32 state S[NV][DK][DV]. After a chunk both hold what t decode
// steps would have left.

#define KEY_DIM (NK * DK)
#define CONV_DIM (2 * NK * DK + NV * DV)

// Tokens per conv thread: each thread re-reads CONV_K-1 rows before its tile, so longer tiles
// read proj closer to once. At least CONV_K-1, so only the first tile reaches into the window.
#define CONV_TT 16

// The window after the chunk's first `n` rows, channel `ch`: row m is the input at position
// n-(CONV_K-1)+m, a chunk row, or for n < CONV_K-1 old window row m+n (`old`: the window before
// the chunk, in registers, constant indices so no local memory).
__device__ __forceinline__ void conv_window_at(const float* proj, int ld, int n, int ch,
                                               const float (&old)[CONV_K - 1], float* window) {
#pragma unroll
    for (int m = 0; m < CONV_K - 1; m++) {
        int p = n - (CONV_K - 1) + m;
        float v = 0.f;
        if (p >= 0) {
            v = proj[(long)p * ld + ch];
        } else {
#pragma unroll
            for (int j = 0; j < CONV_K - 1; j++)
                if (j == m + n) v = old[j];
        }
        window[m * CONV_DIM + ch] = v;
    }
}

// Causal depthwise conv + SiLU over the chunk, continuing from `window`; then the window becomes
// the chunk's last CONV_K-1 inputs (old window rows mixed in when t < CONV_K-1). With a
// `fork_window`, that one gets the window after the first `fork_at` rows (0 < fork_at < t): a
// fork of the state inside the chunk.
// Grid (ceil(CONV_DIM / blockDim), ceil(t / CONV_TT)); a thread is one channel of one token tile.
extern "C" __global__ void gdn_conv_rows(const float* proj, int ld, int t, const float* conv_w,
                                         float* window, float* out, float* fork_window,
                                         int fork_at) {
    pdl_wait();
    static_assert(CONV_TT >= CONV_K - 1, "a conv tile must cover the window");
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= CONV_DIM) return;
    int t0 = blockIdx.y * CONV_TT;
    int t1 = min(t0 + CONV_TT, t);
    float w[CONV_K];
#pragma unroll
    for (int j = 0; j < CONV_K; j++) w[j] = conv_w[ch * CONV_K + j];
    // hist[j]: the input at position t0-(CONV_K-1)+j; negative positions are the window's rows.
    // Only the first tile reads the window, and only its thread of this channel rewrites it
    // (after reading), so tiles never race on it.
    float hist[CONV_K], old[CONV_K - 1];
#pragma unroll
    for (int j = 0; j < CONV_K - 1; j++) {
        int p = t0 - (CONV_K - 1) + j;
        hist[j] = p >= 0 ? proj[(long)p * ld + ch] : window[(p + CONV_K - 1) * CONV_DIM + ch];
        old[j] = hist[j];
    }
    for (int tok = t0; tok < t1; tok++) {
        hist[CONV_K - 1] = proj[(long)tok * ld + ch];
        // The CPU reference's order: oldest tap first.
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < CONV_K; j++) acc += w[j] * hist[j];
        out[(long)tok * CONV_DIM + ch] = siluf(acc);
#pragma unroll
        for (int j = 0; j < CONV_K - 1; j++) hist[j] = hist[j + 1];
    }
    if (blockIdx.y != 0) return;
    // `old` is valid here: this is tile 0.
    if (fork_window) conv_window_at(proj, ld, fork_at, ch, old, fork_window);
    conv_window_at(proj, ld, t, ch, old, window);
}

// What the scan reads per token, computed once rather than by each of the scan's warps: prep is
// [t, 2·KEY_DIM] (q L2-normalised and scaled by 1/sqrt(DK) | k L2-normalised), followed by
// [t, NV, 2] (α = exp(g), β). Total t·(2·NK·DK + 2·NV) floats.
// Grid (t); any multiple of 32 threads (one warp per q or k head at a time).
extern "C" __global__ void gdn_scan_prep(const float* conv, const float* proj, int ld, int t,
                                         const float* a_log, const float* dt_bias, float* prep) {
    pdl_wait();
    int tok = blockIdx.x;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const float* row = conv + (long)tok * CONV_DIM;
    float* qk = prep + (long)tok * 2 * KEY_DIM;
    // Heads 0..NK-1 are q, NK..2NK-1 are k: the same order as the conv row's first 2·KEY_DIM.
    for (int h = warp; h < 2 * NK; h += warps) {
        const float* x = row + h * DK;
        float ss = 0.f;
        for (int i = lane; i < DK; i += WARP) ss += x[i] * x[i];
        // eps inside the root; q also scaled by 1/sqrt(DK) (decode's gdn_step does the same).
        float inv = rsqrtf(warp_sum(ss) + 1e-6f);
        if (h < NK) inv *= rsqrtf((float)DK);
        for (int i = lane; i < DK; i += WARP) qk[h * DK + i] = x[i] * inv;
    }
    float* gates = prep + (long)t * 2 * KEY_DIM + (long)tok * 2 * NV;
    const float* ba = proj + (long)tok * ld + CONV_DIM + NV * DV;
    for (int j = threadIdx.x; j < NV; j += blockDim.x) {
        float sp = ba[NV + j] + dt_bias[j];
        sp = sp > 20.f ? sp : log1pf(expf(sp));
        gates[2 * j] = expf(-expf(a_log[j]) * sp);
        gates[2 * j + 1] = 1.f / (1.f + expf(-ba[j]));
    }
}

// The scan's layout. Each state column S[:, col] of a value head evolves on its own given q, k,
// α, β, so a column is one group of SCAN_LPC lanes, each lane holding SCAN_RPL consecutive rows
// in registers; the group reduces with xor shuffles (offsets below SCAN_LPC stay inside it). A
// narrower group than the warp halves the shuffle rounds per column: 16 lanes × 8 rows at DK 128.
// gdn_prefill.rs mirrors these to size the grid.
#define SCAN_LPC (DK >= 16 ? 16 : DK >= 8 ? 8 : DK >= 4 ? 4 : DK >= 2 ? 2 : 1)
#define SCAN_RPL ((DK + SCAN_LPC - 1) / SCAN_LPC)
#define SCAN_CPW (WARP / SCAN_LPC)             // columns per warp
#define SCAN_WARPS 4                           // warps per block, all on one value head
#define SCAN_VEC (DK % (4 * SCAN_LPC) == 0)    // rows per lane a multiple of 4: float4 loads

__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = SCAN_LPC / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One token's inputs for one lane: its rows of q and k, its column's v, the head's gates.
struct ScanIn {
    float q[SCAN_RPL], k[SCAN_RPL];
    float v, alpha, beta;
};

__device__ __forceinline__ void scan_load(ScanIn& in, const float* conv, const float* prep, int t,
                                          int tok, int j, int kh, int row0, int col, bool active) {
    const float* qrow = prep + (long)tok * 2 * KEY_DIM + kh * DK + row0;
    const float* krow = qrow + KEY_DIM;
    if constexpr (SCAN_VEC) {
#pragma unroll
        for (int e = 0; e < SCAN_RPL; e += 4) {
            float4 q4 = *(const float4*)(qrow + e), k4 = *(const float4*)(krow + e);
            in.q[e] = q4.x; in.q[e + 1] = q4.y; in.q[e + 2] = q4.z; in.q[e + 3] = q4.w;
            in.k[e] = k4.x; in.k[e + 1] = k4.y; in.k[e + 2] = k4.z; in.k[e + 3] = k4.w;
        }
    } else {
        // Rows past DK (DK not a multiple of SCAN_LPC) read as 0 and so add nothing.
#pragma unroll
        for (int e = 0; e < SCAN_RPL; e++) {
            bool in_range = row0 + e < DK;
            in.q[e] = in_range ? qrow[e] : 0.f;
            in.k[e] = in_range ? krow[e] : 0.f;
        }
    }
    in.v = active ? conv[(long)tok * CONV_DIM + 2 * KEY_DIM + j * DV + col] : 0.f;
    float2 g = *(const float2*)(prep + (long)t * 2 * KEY_DIM + ((long)tok * NV + j) * 2);
    in.alpha = g.x;
    in.beta = g.y;
}

// One token of one column: δ = β(v − α·(S·k)), S ← αS + kδ, o = S·q (the CPU's S ← αS,
// δ = β(v − S·k), in another order). Writes o from the group's first lane.
__device__ __forceinline__ void scan_step(float (&s)[SCAN_RPL], const ScanIn& in, float* o_dst, bool store) {
    float p0 = 0.f, p1 = 0.f;                 // two chains halve the dependent FMAs
#pragma unroll
    for (int e = 0; e < SCAN_RPL; e += 2) {
        p0 += s[e] * in.k[e];
        if (e + 1 < SCAN_RPL) p1 += s[e + 1] * in.k[e + 1];
    }
    float pred = group_sum(p0 + p1);
    float delta = in.beta * (in.v - in.alpha * pred);
    float o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int e = 0; e < SCAN_RPL; e++) {
        s[e] = in.alpha * s[e] + in.k[e] * delta;
        if (e % 2 == 0) o0 += s[e] * in.q[e]; else o1 += s[e] * in.q[e];
    }
    float o = group_sum(o0 + o1);
    if (store) *o_dst = o;
}

// The delta rule over the chunk, token by token, from gdn_scan_prep's output; writes o[t, NV·DV]
// (before the gated norm) and leaves the final state in `state`.
// Grid (ceil(DV / (SCAN_WARPS·SCAN_CPW)), NV), SCAN_WARPS·32 threads. No __syncthreads: warps
// are independent, so a warp whose columns all lie past DV leaves at once.
extern "C" __global__ void gdn_scan(const float* conv, const float* prep, int t, float* state, float* out) {
    pdl_wait();
    int j = blockIdx.y;                       // value head
    int kh = j / (NV / NK);
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int warp_col0 = (blockIdx.x * SCAN_WARPS + warp) * SCAN_CPW;
    if (warp_col0 >= DV) return;
    int col = warp_col0 + lane / SCAN_LPC;
    int row0 = (lane % SCAN_LPC) * SCAN_RPL;
    bool active = col < DV;                  // inactive lanes still shuffle, with zeros
    bool store = active && lane % SCAN_LPC == 0;
    float* S = state + (long)j * DK * DV;
    float s[SCAN_RPL];
#pragma unroll
    for (int e = 0; e < SCAN_RPL; e++) s[e] = (active && row0 + e < DK) ? S[(row0 + e) * DV + col] : 0.f;

    // Two tokens' inputs in flight: each load is issued a whole token step before its use, in
    // its own register set, so the compiler cannot fold it into the step that needs it. (Past
    // the end the loads repeat the last token, which is harmless.)
    float* o = out + j * DV + col;
    ScanIn a, b;
    scan_load(a, conv, prep, t, 0, j, kh, row0, col, active);
    scan_load(b, conv, prep, t, min(1, t - 1), j, kh, row0, col, active);
    for (int tok = 0; tok < t; tok += 2) {
        scan_step(s, a, o + (long)tok * NV * DV, store);
        scan_load(a, conv, prep, t, min(tok + 2, t - 1), j, kh, row0, col, active);
        if (tok + 1 < t) scan_step(s, b, o + (long)(tok + 1) * NV * DV, store);
        scan_load(b, conv, prep, t, min(tok + 3, t - 1), j, kh, row0, col, active);
    }
#pragma unroll
    for (int e = 0; e < SCAN_RPL; e++)
        if (active && row0 + e < DK) S[(row0 + e) * DV + col] = s[e];
}

// Gated RMSNorm per (token, value head): y = rms_norm(o)·w ⊙ silu(z), z from the token's proj row,
// into y (f32) and y16 (rounded to bf16, the output projection's X on the wgmma path), each where
// not null. One warp per (token, head), GATED_NORM_WARPS a block: a block per (head, token)
// with a block-wide sum took 160 µs a layer at a 4K chunk on an H100 for 50 µs of bytes (ncu).
#define GATED_NORM_WARPS 8
#define GATED_NORM_PER_LANE ((DV + WARP - 1) / WARP)
extern "C" __global__ void __launch_bounds__(GATED_NORM_WARPS * WARP)
gdn_gated_norm_rows(const float* o, const float* proj, int ld, int t, const float* w, float* y, u16* y16, float eps) {
    pdl_wait();
    const long i = (long)blockIdx.x * GATED_NORM_WARPS + threadIdx.x / WARP;   // tok·NV + head
    if (i >= (long)t * NV) return;
    const int lane = threadIdx.x % WARP, j = (int)(i % NV);
    const float* x = o + i * DV;
    const float* z = proj + (i / NV) * ld + CONV_DIM + j * DV;
    float xs[GATED_NORM_PER_LANE], zs[GATED_NORM_PER_LANE];
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < GATED_NORM_PER_LANE; e++) {
        const int d = lane + e * WARP;
        xs[e] = d < DV ? x[d] : 0.f;
        zs[e] = d < DV ? z[d] : 0.f;
    }
#pragma unroll
    for (int e = 0; e < GATED_NORM_PER_LANE; e++) ss += xs[e] * xs[e];
    const float inv = rsqrtf(warp_sum(ss) / DV + eps);
#pragma unroll
    for (int e = 0; e < GATED_NORM_PER_LANE; e++) {
        const int d = lane + e * WARP;
        if (d >= DV) break;
        const float v = xs[e] * inv * w[d] * siluf(zs[e]);
        if (y) y[i * DV + d] = v;
        if (y16) y16[i * DV + d] = (u16)pack_bf16x2(v, 0.f);
    }
}
