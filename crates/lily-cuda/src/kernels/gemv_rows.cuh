// Decode GEMVs of a batched step: y[n] = W · x[n] for the rows n < nx of up to NX sequences, each
// weight chunk read and dequantised once for all of them (gemv.cu's gemv_rows_* kernels).
//
// A row's result is bit for bit what gemv_staged gives it alone, at the same block size: its x is
// staged by the same code, its norm reduced in the same order, every chunk's dot product summed
// in the same order, and its lanes' partials reduced by the same warp_sum. The rows differ only in
// which registers and which part of shared memory hold them. So a sequence decodes the same
// tokens in a batch as alone.
//
// Shared memory (dynamic; gemv.rs, rows_shared_bytes, computes the same size): NX staged rows of
// xs_row_floats(cols) floats, NX rows of chunk sums, then NX × 32 floats of norm scratch and NX
// inverse norms.

// Floats of one staged row and of its chunk sums.
template <int BITS>
__device__ __forceinline__ int xs_row_floats(int cols) {
    return BITS == 32 ? cols : cols / CHUNK_CODES(BITS) * (CHUNK_CODES(BITS) + XS_PAD);
}
template <int BITS>
__device__ __forceinline__ int xsum_row_floats(int cols) {
    return BITS == 32 ? 1 : cols / CHUNK_CODES(BITS);
}

// inv[n] = 1 / RMS(x[n]) for the rows n < nx of x (a row every `cols` floats), as block_inv_rms
// computes it for one: every row's partial sums first, then one reduction for all of them in
// block_sum's order. PASS rows' loads are in flight together (fewer registers than all NX).
// scratch holds NX × WARP floats. Ends with a barrier.
template <int NX, int PASS = NX>
__device__ void rows_inv_rms(int cols, int nx, const float* x, float eps, float* scratch, float* inv) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    float ss[NX];
#pragma unroll
    for (int r0 = 0; r0 < NX; r0 += PASS) {
        float part[PASS];
        thread_sumsq<PASS>(x + (long)r0 * cols, cols, nx - r0, part);
#pragma unroll
        for (int r = 0; r < PASS; r++) ss[r0 + r] = part[r];
    }
#pragma unroll
    for (int n = 0; n < NX; n++) ss[n] = warp_sum(ss[n]);
    if (lane == 0) {
#pragma unroll
        for (int n = 0; n < NX; n++) scratch[n * WARP + warp] = ss[n];
    }
    __syncthreads();
    if (threadIdx.x < nx) {
        float total = 0.f;
        for (int i = 0; i < warps; i++) total += scratch[threadIdx.x * WARP + i];
        inv[threadIdx.x] = rsqrtf(total / cols + eps);
    }
    __syncthreads();
}

// Stages rows n < nx of x (a row every `cols` floats), each normalised as block_inv_rms does it
// when norm_w is given.
template <int BITS, int NX>
__device__ void stage_rows(int cols, int nx, const float* x, const float* norm_w, float eps, float* xs, float* xsum,
                           float* scratch, float* inv) {
    if (norm_w) rows_inv_rms<NX>(cols, nx, x, eps, scratch, inv);
    stage_x_values<BITS, NX>(cols, nx, x, norm_w, inv, xs, xsum, xs_row_floats<BITS>(cols), xsum_row_floats<BITS>(cols));
    __syncthreads();
}

// acc[r][n] += this lane's share of row r · x[n] for NB chunks of R rows, as dot_chunks sums a
// single x: each code is dequantised once and multiplied with every row's x.
template <int BITS, int R, int NB, int NX>
__device__ __forceinline__ void dot_batch_rows(const Batch<BITS, R, NB>& b, int base, int chunks, const float* xs,
                                               const float* xsum, int xs_n, int xsum_n, int lane,
                                               float (&acc)[R][NX]) {
    constexpr int PER = 128 / BITS;
    const u32 magic = magic_reg();
#pragma unroll
    for (int j = 0; j < NB; j++) {
        int ch = base + lane + j * WARP;
        if (ch >= chunks) break;
        float dq[R][NX] = {};
#pragma unroll
        for (int i4 = 0; i4 < PER / 4; i4++) {
            float4 xv[NX];
#pragma unroll
            for (int n = 0; n < NX; n++) xv[n] = ((const float4*)(xs + n * xs_n + ch * (PER + XS_PAD)))[i4];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const u32 words[4] = {b.q[r][j].x, b.q[r][j].y, b.q[r][j].z, b.q[r][j].w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float code = chunk_code<BITS>(words, 4 * i4 + e, magic);
#pragma unroll
                    for (int n = 0; n < NX; n++) {
                        const float xi = e == 0 ? xv[n].x : e == 1 ? xv[n].y : e == 2 ? xv[n].z : xv[n].w;
                        dq[r][n] = __fmaf_rn(code, xi, dq[r][n]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int n = 0; n < NX; n++)
                acc[r][n] += chunk_sum(b.scale[r][j], dq[r][n], b.bias[r][j], xsum[n * xsum_n + ch]);
    }
}

// y[n · ystride + at] (= or +=) the rows of [m0 | m1 | m2 | m3] · x[n] for n < nx (2 ≤ nx ≤ NX),
// outputs end to end in each row of y; with norm_w, x[n] is a residual stream and its rows see
// RMSNorm(x[n]) · norm_w. Units and their weight loads as in staged_units.
template <int BITS, int NX, int ROWS = GEMV_ROWS, int NB = GEMV_BATCH>
__device__ void gemv_rows(Mat m0, Mat m1, Mat m2, Mat m3, int nx, const float* x, const float* norm_w, float eps,
                          float* y, bool add) {
    extern __shared__ __align__(16) float rows_smem[];
    const int cols = m0.cols, lane = threadIdx.x % WARP;
    const int xs_n = xs_row_floats<BITS>(cols), xsum_n = xsum_row_floats<BITS>(cols);
    float* xs = rows_smem;
    float* xsum = xs + NX * xs_n;
    float* scratch = xsum + NX * xsum_n;
    float* inv = scratch + NX * WARP;
    const Mat ms[4] = {m0, m1, m2, m3};
    const MatUnits<ROWS, Mat[4]> mu{ms, 4};
    const long units = mu.count(), ystride = (long)m0.rows + m1.rows + m2.rows + m3.rows;
    const long stride = (long)gridDim.x * (blockDim.x / WARP);
    long u = (long)(threadIdx.x / WARP) * gridDim.x + blockIdx.x;   // as staged_units numbers them
    RowRef rows[ROWS];
    int xoff[ROWS];
    auto store = [&](long u, float (&acc)[ROWS][NX]) {
        int which; long r0, base;
        mu.locate(u, which, r0, base);
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int n = 0; n < NX; n++) {
                float v = warp_sum(acc[r][n]);
                if (lane == (r * NX + n) % WARP && n < nx && r0 + r < ms[which].rows) {
                    float* at = y + n * ystride + base + r0 + r;
                    *at = add ? *at + v : v;
                }
            }
    };
    auto stage = [&]() { stage_rows<BITS, NX>(cols, nx, x, norm_w, eps, xs, xsum, scratch, inv); };
    if constexpr (BITS == 32) {
        pdl_wait();
        stage();
        for (; u < units; u += stride) {
            mu.template rows_of<BITS>(u, rows, xoff);
            float acc[ROWS][NX] = {};
            for (int c = lane; c < cols; c += WARP) {
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    const float w = ((const float*)rows[r].w)[c];
#pragma unroll
                    for (int n = 0; n < NX; n++) acc[r][n] = __fmaf_rn(w, xs[n * xs_n + c], acc[r][n]);
                }
            }
            store(u, acc);
        }
    } else {
        constexpr int PER = 128 / BITS;
        const int chunks = cols / PER;
        Batch<BITS, ROWS, NB> b;
        // The weights depend on no kernel: this warp's first unit is requested before the wait.
        if (u < units) {
            mu.template rows_of<BITS>(u, rows, xoff);
            load_batch<BITS, ROWS, NB>(b, rows, 0, chunks, m0.group, lane);
            prefetch_rows<BITS, ROWS>(rows, cols, lane);
            if (u + stride < units) {
                RowRef next[ROWS];
                int next_off[ROWS];
                mu.template rows_of<BITS>(u + stride, next, next_off);
                prefetch_rows<BITS, ROWS>(next, cols, lane);
            }
        }
        pdl_wait();
        stage();
        for (; u < units; u += stride) {
            float acc[ROWS][NX] = {};
            for (int base = 0; base < chunks; base += WARP * NB) {
                if (base > 0) load_batch<BITS, ROWS, NB>(b, rows, base, chunks, m0.group, lane);
                dot_batch_rows<BITS, ROWS, NB, NX>(b, base, chunks, xs, xsum, xs_n, xsum_n, lane, acc);
            }
            if (u + stride < units) {
                mu.template rows_of<BITS>(u + stride, rows, xoff);
                load_batch<BITS, ROWS, NB>(b, rows, 0, chunks, m0.group, lane);
            }
            store(u, acc);
        }
    }
}
