// A decode token's MoE on the integer tensor cores (moe_imma.cuh), compiled only where
// CudaOptions::decode_kernels selects it (step.rs launches it), where the experts are 4-bit and
// the router 8-bit in groups of 64 (step.rs, moe_imma_fits). The router runs every row in one
// launch (each weight read once for all, the rows as x parts); gate/up and down take the row from
// the grid's y. Blocks of at most half an SM, as gemv_imma.cu's.
#define MOE_ROUTE_IMMA(T)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * IMMA_WARPS, 2) moe_route_imma_t##T(            \
        Mat router, Mat sh_gate, int nx, const float* hidden, const float* norm_w, float eps, float* logits, \
        int* ids, float* weights, u32* done, int split) {                                          \
        route_imma<T>(router, sh_gate, nx, hidden, norm_w, eps, logits, ids, weights, done, split); \
    }
MOE_ROUTE_IMMA(1)
MOE_ROUTE_IMMA(2)
MOE_ROUTE_IMMA(4)

extern "C" __global__ void __launch_bounds__(32 * IMMA_WARPS, 2) moe_gate_up_imma(
    Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids, const float* weights, const float* logits,
    const float* hidden, const float* norm_w, float eps, float* act, int split) {
    gate_up_imma(gate, up, sh_gate, sh_up, inter, ids + blockIdx.y * TOPK, weights + blockIdx.y * TOPK,
                 logits + blockIdx.y * (NE + 1), hidden + (long)blockIdx.y * gate.cols, norm_w, eps,
                 act + (long)blockIdx.y * (TOPK * inter + sh_gate.rows), split);
}

extern "C" __global__ void __launch_bounds__(32 * IMMA_WARPS, 2) moe_down_imma(
    Mat down, Mat sh_down, int inter, int hidden, const int* ids, const float* act, float* residual, int split) {
    down_imma(down, sh_down, inter, hidden, ids + blockIdx.y * TOPK,
              act + (long)blockIdx.y * (TOPK * inter + sh_down.cols), residual + (long)blockIdx.y * hidden, split);
}
