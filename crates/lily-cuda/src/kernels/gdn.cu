// Gated DeltaNet for one decode token in three launches of the graph step (the shared bodies are
// in gdn_decode.cuh).

// Causal depthwise conv of the q|k|v channels, then SiLU (gdn_conv_channel), a thread a channel.
extern "C" __global__ void gdn_conv(const float* proj, const float* conv_w, float* window, float* out) {
    pdl_wait();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch < CONV_DIM) out[ch] = gdn_conv_channel(ch, proj[ch], conv_w, window);
}

// One (value head, GDN_COLS columns) item per block, 4 row groups (GDN_COLS · 4 threads).
extern "C" __global__ void gdn_step(const float* conv, const float* proj, const float* a_log,
                                    const float* dt_bias, float* state, float* out) {
    pdl_wait();
    __shared__ GdnStepSmem<4> sm;
    gdn_step_cols<4>(blockIdx.x, blockIdx.y * GDN_COLS, conv, proj, a_log, dt_bias, state, out, sm);
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
