// hidden += delta (when given), then out = RMSNorm(hidden) · scale, and the same rounded to bf16
// into out16 when given (the prefill GEMMs on the wgmma path read that copy: half the bytes, and
// no conversion on every load; pack_bf16x2 rounds as those GEMMs round f32 X). The residual add
// rides along with the norm that needs its result, saving a pass over the hidden state. One
// block per row of n values: a decode step launches one, a prefill chunk one per token.
// delta may come in `parts` parts `part_stride` floats apart (a GEMM's split-K partial sums),
// added in order from 0 as gemm_reduce adds them: the same bits, without its launch and its pass.
// One part is read as it is (a loop over a count of one cost a 4K chunk's norms 3 %).
extern "C" __global__ void add_rms_norm(float* hidden, const float* delta, int parts, int part_stride,
                                        const float* scale, float* out, u16* out16, int n, float eps) {
    pdl_wait();
    __shared__ float scratch[32];
    long row = (long)blockIdx.x * n;
    hidden += row;
    out += row;
    if (delta) delta += row;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float h = hidden[i];
        if (delta) {
            float d = delta[i];
            if (parts > 1) {
                d = 0.f;
                for (int s = 0; s < parts; s++) d += delta[(long)s * part_stride + i];
            }
            h += d;
            hidden[i] = h;
        }
        ss += h * h;
    }
    float inv = rsqrtf(block_sum(ss, scratch) / n + eps);
    if (out16) out16 += row;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = hidden[i] * inv * scale[i];
        out[i] = v;
        if (out16) out16[i] = (u16)pack_bf16x2(v, 0.f);
    }
}
