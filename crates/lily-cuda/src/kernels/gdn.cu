// Gated DeltaNet for one decode token of each sequence in a step, in three launches of the graph
// step (the shared bodies are in gdn_decode.cuh). The grid's last dimension is the row: each
// sequence's activations at its row of the step's buffers, its conv window and recurrent state
// from the row's pointer.

// The fused input projection of a row: [qkv (CONV_DIM) | z (NV·DV) | b (NV) | a (NV)].
#define GDN_PROJ (CONV_DIM + NV * DV + 2 * NV)

// Causal depthwise conv of the q|k|v channels, then SiLU (gdn_conv_channel), a thread a channel.
extern "C" __global__ void gdn_conv(const float* proj, const float* conv_w, RowPtrs window, float* out) {
    pdl_wait();
    int row = blockIdx.y, ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch < CONV_DIM)
        out[row * CONV_DIM + ch] = gdn_conv_channel(ch, proj[row * GDN_PROJ + ch], conv_w, (float*)window.at(row));
}

// One (value head, GDN_COLS columns) item per block, 4 row groups (GDN_COLS · 4 threads).
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

// Gated RMSNorm per value head: normalise, scale by the plain weight, gate with silu(z).
// o, the gate z and the weight are requested together: z and the weight read after the norm's
// reduction were a second round trip to L2 on the chain.
extern "C" __global__ void gdn_gated_norm(const float* o, const float* proj, const float* w, float* y, float eps) {
    __shared__ float scratch[32];
    pdl_wait();
    int j = blockIdx.x, d = threadIdx.x, row = blockIdx.y;
    o += row * NV * DV;
    y += row * NV * DV;
    proj += row * GDN_PROJ;
    const float x = d < DV ? o[j * DV + d] : 0.f;
    const float z = d < DV ? proj[CONV_DIM + j * DV + d] : 0.f;
    const float wd = d < DV ? w[d] : 0.f;
    float inv = rsqrtf(block_sum(x * x, scratch) / DV + eps);
    if (d < DV) y[j * DV + d] = x * inv * wd * siluf(z);
}
