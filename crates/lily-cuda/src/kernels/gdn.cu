// Gated DeltaNet for one decode token. Constants: NK key heads, NV value heads, DK, DV head
// dims, CONV_K conv taps. The input `proj` is the fused projection [qkv (CONV_DIM) | z (NV·DV)
// | b (NV) | a (NV)].

#define KEY_DIM (NK * DK)
#define CONV_DIM (2 * NK * DK + NV * DV)
#define COLS (DV < 32 ? DV : 32)                 // state columns per block
#define ROW_GROUPS 4                            // threads sharing one column
#define ROWS_PER_THREAD ((DK + ROW_GROUPS - 1) / ROW_GROUPS)

// Causal depthwise conv over the q|k|v channels with the cached window, then SiLU. The window
// holds the previous CONV_K-1 pre-conv rows, oldest first, and slides by one.
extern "C" __global__ void gdn_conv(const float* proj, const float* conv_w, float* window, float* out) {
    pdl_wait();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= CONV_DIM) return;
    float cur = proj[ch];
    const float* w = conv_w + ch * CONV_K;
    float acc = w[CONV_K - 1] * cur;
#pragma unroll
    for (int j = 0; j < CONV_K - 1; j++) acc += w[j] * window[j * CONV_DIM + ch];
#pragma unroll
    for (int j = 0; j < CONV_K - 2; j++) window[j * CONV_DIM + ch] = window[(j + 1) * CONV_DIM + ch];
    window[(CONV_K - 2) * CONV_DIM + ch] = cur;
    out[ch] = siluf(acc);
}

// The delta rule for one value head and COLS columns of its state S[DK][DV] (fp32). Each column
// is held by ROW_GROUPS threads, each with a slice of the rows in registers; S is read and
// written exactly once. q and k are L2-normalised here (every block of a key head redoes that
// small work rather than adding a launch).
extern "C" __global__ void gdn_step(const float* conv, const float* proj, const float* a_log,
                                    const float* dt_bias, float* state, float* out) {
    pdl_wait();
    __shared__ float qn[DK], kn[DK];
    __shared__ float scratch[32];
    __shared__ float part[ROW_GROUPS][COLS];
    int j = blockIdx.x;                       // value head
    int col0 = blockIdx.y * COLS;
    int kh = j / (NV / NK);
    int t = threadIdx.x;
    // L2 norms of q and k (eps inside the root), q also scaled by 1/sqrt(DK).
    float qv = 0.f, kv = 0.f;
    for (int i = t; i < DK; i += blockDim.x) { qv += conv[kh * DK + i] * conv[kh * DK + i]; kv += conv[KEY_DIM + kh * DK + i] * conv[KEY_DIM + kh * DK + i]; }
    float q_inv = rsqrtf(block_sum(qv, scratch) + 1e-6f) * rsqrtf((float)DK);
    float k_inv = rsqrtf(block_sum(kv, scratch) + 1e-6f);
    for (int i = t; i < DK; i += blockDim.x) { qn[i] = conv[kh * DK + i] * q_inv; kn[i] = conv[KEY_DIM + kh * DK + i] * k_inv; }
    __syncthreads();

    float b = proj[CONV_DIM + NV * DV + j];
    float a = proj[CONV_DIM + NV * DV + NV + j];
    float beta = sigmoidf(b);
    float sp = a + dt_bias[j];
    sp = sp > 20.f ? sp : log1pf(expf(sp));
    float alpha = expf(-expf(a_log[j]) * sp);

    int c = t % COLS, rg = t / COLS;
    int col = col0 + c;
    bool active = rg < ROW_GROUPS && col < DV;
    float* S = state + (long)j * DK * DV;
    float s[ROWS_PER_THREAD];
    float r = 0.f;
#pragma unroll
    for (int e = 0; e < ROWS_PER_THREAD; e++) {
        int i = rg + e * ROW_GROUPS;
        s[e] = (active && i < DK) ? S[i * DV + col] : 0.f;
        if (i < DK) r += s[e] * kn[i];
    }
    if (rg < ROW_GROUPS) part[rg][c] = r;
    __syncthreads();
    float pred = 0.f;
#pragma unroll
    for (int g = 0; g < ROW_GROUPS; g++) pred += part[g][c];
    float v = active ? conv[2 * KEY_DIM + j * DV + col] : 0.f;
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
    if (rg < ROW_GROUPS) part[rg][c] = o;
    __syncthreads();
    if (active && rg == 0) {
        float sum = 0.f;
#pragma unroll
        for (int g = 0; g < ROW_GROUPS; g++) sum += part[g][c];
        out[j * DV + col] = sum;
    }
}

// Gated RMSNorm per value head: normalise, scale by the plain weight, gate with silu(z).
extern "C" __global__ void gdn_gated_norm(const float* o, const float* proj, const float* w, float* y, float eps) {
    pdl_wait();
    __shared__ float scratch[32];
    int j = blockIdx.x, d = threadIdx.x;
    float x = d < DV ? o[j * DV + d] : 0.f;
    float inv = rsqrtf(block_sum(x * x, scratch) / DV + eps);
    if (d < DV) y[j * DV + d] = x * inv * w[d] * siluf(proj[CONV_DIM + j * DV + d]);
}
