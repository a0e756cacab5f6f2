// A decode token's MoE on the integer tensor cores (moe.cu's moe_*_imma kernels), through the
// core of gemv_imma.cuh: the router (8-bit, with top-k in the last block), gate/up of the chosen
// and the shared experts with SwiGLU, and the down projection with the combine. The graph step
// takes them where every expert matrix is 4-bit in groups of 64 and every K a whole number of
// quads (step.rs, `moe_imma_fits`): the real model. Constants: NE experts, TOPK chosen per token.
//
// The routing weights ride in act: gate/up writes w_k · silu(gate) · up for a chosen slot k and
// σ(shared gate logit) · silu(gate) · up for the shared expert, so that the down projection is
// one dot product an output row over the concatenated slots, as the CPU's combine
// Σ_k w_k · down_k(act_k) up to the order of two multiplications.

// The lane's codes and scale-or-bias word of quad q of row `row` of a 4-bit matrix in groups of
// 64 whose rows are whole quads (the word: imma_load's, without the ragged cases).
__device__ __forceinline__ void imma_load_row4(ImmaStage<4>& st, int h, const Mat& m, long row, int q, int lane) {
    const int t = lane % 4, groups = m.cols / IMMA_SLAB;
    imma_load_codes<4, true>(st, h, (const char*)m.w + row * (m.cols / 2), q, groups, lane);
    st.sb[h] = *(const u32*)((t < 2 ? m.scales : m.biases) + row * groups + q * IMMA_QUAD + 2 * (t % 2));
}

// A matrix chosen by a flag, field by field: a select of whole Mats goes through local memory.
__device__ __forceinline__ Mat pick_mat(bool first, const Mat& a, const Mat& b) {
    return Mat{first ? a.w : b.w, first ? a.scales : b.scales, first ? a.biases : b.biases,
               first ? a.rows : b.rows, first ? a.cols : b.cols, first ? a.group : b.group};
}

// The router's and shared gate's logits for rows n < nx (8-bit), then softmax, top-k and the
// renormalised weights in the last block to finish, which also resets `done` for the next launch.
template <int T>
__device__ void route_imma(Mat router, Mat sh_gate, int nx, const float* hidden, const float* norm_w, float eps,
                           float* logits, int* ids, float* weights, u32* done, int split) {
    __shared__ bool last;
    gemv_imma<T, 8>(router, sh_gate, Mat{}, Mat{}, nx, hidden, norm_w, eps, logits, false, split);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int n = threadIdx.x / WARP; n < nx; n += blockDim.x / WARP)
        route_topk(logits + n * (NE + 1), threadIdx.x % WARP, ids + n * TOPK, weights + n * TOPK);
    if (threadIdx.x == 0) *done = 0;
}

// act = w · silu(gate · x) ⊙ (up · x) for the chosen experts' rows (slot-major, TOPK × inter)
// and then the shared expert's, x = RMSNorm(hidden) · norm_w, for one sequence. A unit is 8 gate
// rows (the mma's rows g) and the same 8 rows of up (g + 8), so a lane holds both sums of its
// output. The choice comes from the kernel just before: the weights are requested after it.
__device__ void gate_up_imma(Mat gate, Mat up, Mat sh_gate, Mat sh_up, int inter, const int* ids,
                             const float* weights, const float* logits, const float* hidden, const float* norm_w,
                             float eps, float* act, int split) {
    __shared__ int sid[TOPK];
    __shared__ float sw[TOPK + 1];
    pdl_wait();
    if (threadIdx.x < TOPK) {
        sid[threadIdx.x] = ldcg_int(ids + threadIdx.x);
        sw[threadIdx.x] = ldcg(weights + threadIdx.x);
    } else if (threadIdx.x == TOPK) {
        sw[TOPK] = sigmoidf(ldcg(logits + NE));
    }
    __syncthreads();
    const int lane = threadIdx.x % WARP, per = inter / 8;
    const int units = TOPK * per + sh_gate.rows / 8;
    auto locate = [&](ImmaCursor& c) {
        c.which = min(c.u / per, TOPK);
        c.r0 = (c.u - c.which * per) * 8;
    };
    auto load = [&](ImmaStage<4>& st, const ImmaCursor& c) {
        const bool routed = c.which < TOPK;
        const long row = (routed ? (long)sid[c.which] * inter : 0) + c.r0 + lane / 4;
        imma_load_row4(st, 0, pick_mat(routed, gate, sh_gate), row, c.q, lane);
        imma_load_row4(st, 1, pick_mat(routed, up, sh_up), row, c.q, lane);
    };
    auto store = [&](const ImmaCursor& c, const float (&v)[1][2]) {
        if (lane % 4 == 0) act[c.which * inter + c.r0 + lane / 4] = sw[c.which] * (siluf(v[0][0]) * v[0][1]);
    };
    // A ring of three: the two rows' addresses of a quad (gate and up, routed or shared) take the
    // registers of a fourth.
    const ImmaFormat f = imma_format(gate);
    auto stage = [&](unsigned char* xq, float2* xf, float* scratch) {
        imma_stage_x<1>(f.slabs * IMMA_SLAB, 1, hidden, norm_w, eps, xq, xf, scratch);
    };
    imma_units<1, 4, 3>(units, f, split, stage, locate, load, store);
}

// residual[h] += Σ_k down_{id_k}[h] · act_k + shared_down[h] · act_shared for one sequence (act
// already weighted): an output row is one virtual row of TOPK · inter + shared inputs, whose
// quads come from the chosen experts' down rows in slot order, then the shared expert's. The
// choice is two launches back: it and the first weights are read before pdl_wait.
__device__ void down_imma(Mat down, Mat sh_down, int inter, int hidden, const int* ids, const float* act,
                          float* residual, int split) {
    __shared__ int sid[TOPK];
    if (threadIdx.x < TOPK) sid[threadIdx.x] = ldcg_int(ids + threadIdx.x);
    __syncthreads();
    const int lane = threadIdx.x % WARP, per = inter / (IMMA_QUAD * IMMA_SLAB);
    const int cols = TOPK * inter + sh_down.cols;
    const ImmaFormat f{cols / IMMA_SLAB, cols / (IMMA_QUAD * IMMA_SLAB), 0, true};
    auto locate = [&](ImmaCursor& c) { c.r0 = c.u * 16; };
    auto load = [&](ImmaStage<4>& st, const ImmaCursor& c) {
        const int seg = min(c.q / per, TOPK);
        const bool routed = seg < TOPK;
        const Mat m = pick_mat(routed, down, sh_down);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const long row = (routed ? (long)sid[seg] * hidden : 0) + c.r0 + lane / 4 + 8 * h;
            imma_load_row4(st, h, m, row, c.q - seg * per, lane);
        }
    };
    auto store = [&](const ImmaCursor& c, const float (&v)[1][2]) {
        if (lane % 4 != 0) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float* o = residual + c.r0 + lane / 4 + 8 * h;
            *o = __fadd_rn(*o, v[0][h]);
        }
    };
    auto stage = [&](unsigned char* xq, float2* xf, float* scratch) {
        imma_stage_x<1>(cols, 1, act, nullptr, 0.f, xq, xf, scratch);
    };
    imma_units<1, 4>(hidden / 16, f, split, stage, locate, load, store);
}
