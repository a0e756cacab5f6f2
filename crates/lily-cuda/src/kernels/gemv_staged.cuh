// Decode GEMVs with x staged in shared memory, shared by the graph step's kernels (gemv.cu, moe.cu
// through moe_decode.cuh) and the persistent step (decode.cu, where gemv_stream.cuh replaces the
// weight loads of staged_units).

// One row of a matrix as a kernel reads it.
struct RowRef {
    const void* w;       // the row's codes (or f32 values)
    const u16* scales;   // its groups' scales and biases (affine only)
    const u16* biases;
};

__device__ __forceinline__ RowRef row_ref(const Mat& m, long r, int bits) {
    long groups = m.cols / m.group;
    return RowRef{(const char*)m.w + r * (long)m.cols * bits / 8, m.scales + r * groups, m.biases + r * groups};
}

// Each block stages the input vector once in shared memory; a warp then computes R rows at a time,
// lanes striding over the rows' 16-byte chunks (a warp reads 512 contiguous bytes of a row per
// load). Staged x is padded by XS_PAD floats after every chunk's values, so the lanes' float4 reads
// of x (lanes one chunk apart) hit distinct banks, and prescaled by 2^-(BITS·p) for a code's
// position p in its 16-bit half word: a code then becomes a float with one mask-and-or and one
// subtraction, no shift (see dot_batch). The sum of each chunk's x, needed for the biases, is
// staged too.

// Widest input the staged GEMVs take (the host checks).
#define XS_COLS 8192
#define XS_PAD 4

// Codes in one 16-byte chunk (1 for dense f32, which has no chunks).
#define CHUNK_CODES(BITS) ((BITS) == 32 ? 1 : 128 / (BITS))
// Floats of a staged x of COLS inputs and of its chunk sums, and of the widest one.
#define XS_FLOATS_OF(BITS, COLS) \
    ((BITS) == 32 ? (COLS) : ((COLS) + CHUNK_CODES(BITS) - 1) / CHUNK_CODES(BITS) * (CHUNK_CODES(BITS) + XS_PAD))
#define XSUM_FLOATS_OF(BITS, COLS) ((BITS) == 32 ? 1 : ((COLS) + CHUNK_CODES(BITS) - 1) / CHUNK_CODES(BITS))
#define XS_FLOATS(BITS) XS_FLOATS_OF(BITS, XS_COLS)
#define XSUM_FLOATS(BITS) XSUM_FLOATS_OF(BITS, XS_COLS)

template <int BITS>
__device__ __forceinline__ int xs_at(int c) {
    if constexpr (BITS == 32) {
        return c;
    } else {
        constexpr int PER = 128 / BITS;
        return c / PER * (PER + XS_PAD) + c % PER;
    }
}

// 2^-(BITS·p), p the position of column c's code in its 16-bit half word.
template <int BITS>
__device__ __forceinline__ float xs_prescale(int c) {
    if constexpr (BITS == 32) {
        return 1.f;
    } else {
        return __uint_as_float((u32)(127 - BITS * (c % (16 / BITS))) << 23);
    }
}

// Loads per thread issued together by the staging loops below: staging is on every staged
// kernel's critical path, and a loop that waits for each load in turn costs microseconds.
#define STAGE_UNROLL 4

// ss + the squares of v's four values, spelled out so that every kernel that inlines it rounds
// alike (see chunk_sum).
__device__ __forceinline__ float add_squares(float ss, float4 v) {
    float q = __fmaf_rn(v.y, v.y, __fmul_rn(v.x, v.x));
    q = __fmaf_rn(v.w, v.w, __fmaf_rn(v.z, v.z, q));
    return __fadd_rn(ss, q);
}

// This thread's part of the sum of squares of rows r < nx of h (a row every n floats; NX bounds
// nx) into ss[r], which block_inv_rms reduces. Every row's loads of a pass are in flight together,
// and each row's sum runs in the same order whatever the other rows are.
template <int NX = 1>
__device__ __forceinline__ void thread_sumsq(const float* h, int n, int nx, float (&ss)[NX]) {
#pragma unroll
    for (int r = 0; r < NX; r++) ss[r] = 0.f;
    if (n % 4 == 0) {
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x * STAGE_UNROLL) {
            float4 v[NX][STAGE_UNROLL];
#pragma unroll
            for (int r = 0; r < NX; r++)
#pragma unroll
                for (int u = 0; u < STAGE_UNROLL; u++) {
                    int j = i + u * blockDim.x;
                    v[r][u] = r < nx && j < n / 4 ? load_act4(h + (long)r * n + 4 * j) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
            for (int r = 0; r < NX; r++)
#pragma unroll
                for (int u = 0; u < STAGE_UNROLL; u++) ss[r] = add_squares(ss[r], v[r][u]);
        }
    } else {
#pragma unroll
        for (int r = 0; r < NX; r++)
            if (r < nx)
                for (int i = threadIdx.x; i < n; i += blockDim.x) {
                    const float v = load_act(h + (long)r * n + i);
                    ss[r] = __fmaf_rn(v, v, ss[r]);
                }
    }
}

// 1 / RMS(h[0..n)) as add_rms_norm computes it. Every block of a launch gets identical bits (same
// summation order), so rows computed by different blocks see the same normalised vector.
__device__ float block_inv_rms(const float* h, int n, float eps, float* scratch) {
    float ss[1];
    thread_sumsq(h, n, 1, ss);
    return rsqrtf(block_sum(ss[0], scratch) / n + eps);
}

// Stores float4 j (< n4; past it, only the shuffles) of a quantised matrix's staged x: prescaled
// into xs at its padded place, and the plain sum of its chunk (T = CHUNK_CODES / 4 adjacent
// threads) into xsum. Whole warps must call it together (blockDim and the loop end are multiples of
// WARP).
template <int BITS>
__device__ __forceinline__ void stage_float4(float4 v, int j, int n4, float* xs, float* xsum) {
    constexpr int T = 128 / BITS / 4;
    if (j < n4) {
        int col = 4 * j;
        *(float4*)(xs + xs_at<BITS>(col)) =
            make_float4(v.x * xs_prescale<BITS>(col), v.y * xs_prescale<BITS>(col + 1),
                        v.z * xs_prescale<BITS>(col + 2), v.w * xs_prescale<BITS>(col + 3));
    }
    float sum = v.x + v.y + v.z + v.w;
    for (int o = T / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (j < n4 && j % T == 0) xsum[j / T] = sum;
}

// Stages x[c] (or x[c] · inv · norm_w[c] with norm_w) for c in [0, cols) into xs (padded,
// prescaled) and each chunk's plain sum into xsum, for rows r < nx of x (a row every cols floats,
// each with its inv[r], into xs + r · xs_n and xsum + r · xsum_n; NX bounds nx, every row's loads
// of a pass in flight together). Every thread of the block must call it (whole warps take part in
// the shuffles); no barrier (stage_x adds it). For quantised matrices cols is a multiple of
// CHUNK_CODES(BITS), and x and norm_w are 16-byte aligned (device buffers). w_first, where given,
// holds norm_w's float4s of the first pass (norm_w_first).
template <int BITS, int NX = 1>
__device__ __forceinline__ void stage_x_values(int cols, int nx, const float* x, const float* norm_w, const float* inv,
                                               float* xs, float* xsum, int xs_n, int xsum_n,
                                               const float4* w_first = nullptr) {
    if constexpr (BITS == 32) {
#pragma unroll
        for (int r = 0; r < NX; r++) {
            if (r >= nx) break;
            const float* xr = x + (long)r * cols;
            for (int c = threadIdx.x; c < cols; c += blockDim.x * STAGE_UNROLL) {
                float v[STAGE_UNROLL];
#pragma unroll
                for (int u = 0; u < STAGE_UNROLL; u++) {
                    int j = c + u * blockDim.x;
                    v[u] = j < cols ? (norm_w ? load_act(xr + j) * inv[r] * norm_w[j] : load_act(xr + j)) : 0.f;
                }
#pragma unroll
                for (int u = 0; u < STAGE_UNROLL; u++)
                    if (c + u * blockDim.x < cols) xs[r * xs_n + c + u * blockDim.x] = v[u];
            }
        }
    } else {
        // One float4 of x per thread and step; a chunk's values are adjacent threads' float4s.
        int n4 = cols / 4, end = (n4 + WARP - 1) / WARP * WARP;
        const float4* w4 = (const float4*)norm_w;
        for (int c = threadIdx.x; c < end; c += blockDim.x * STAGE_UNROLL) {
            float4 v[NX][STAGE_UNROLL];
#pragma unroll
            for (int r = 0; r < NX; r++)
#pragma unroll
                for (int u = 0; u < STAGE_UNROLL; u++) {
                    int j = c + u * blockDim.x;
                    v[r][u] = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (r < nx && j < n4) {
                        v[r][u] = load_act4(x + (long)r * cols + 4 * j);
                        if (norm_w) {
                            float4 w = w_first && c == (int)threadIdx.x ? w_first[u] : w4[j];
                            const float f = inv[r];
                            v[r][u] = make_float4(v[r][u].x * f * w.x, v[r][u].y * f * w.y, v[r][u].z * f * w.z,
                                                  v[r][u].w * f * w.w);
                        }
                    }
                }
#pragma unroll
            for (int r = 0; r < NX; r++)
                if (r < nx) {
#pragma unroll
                    for (int u = 0; u < STAGE_UNROLL; u++)
                        stage_float4<BITS>(v[r][u], c + u * blockDim.x, n4, xs + r * xs_n, xsum + r * xsum_n);
                }
        }
    }
}

// norm_w's float4s of stage_x_values' first pass (quantised x), loaded before a kernel's wait,
// since no kernel writes them: requested after it, beside x (which the norm has just read), they
// put a round trip to L2 on the chain behind the norm's reduction.
__device__ __forceinline__ void norm_w_first(int cols, const float* norm_w, float4 (&w)[STAGE_UNROLL]) {
#pragma unroll
    for (int u = 0; u < STAGE_UNROLL; u++) {
        const int j = threadIdx.x + u * blockDim.x;
        w[u] = j < cols / 4 ? ((const float4*)norm_w)[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// stage_x_values, then a barrier: x is staged for the whole block.
template <int BITS>
__device__ void stage_x(int cols, const float* x, const float* norm_w, float inv, float* xs, float* xsum) {
    stage_x_values<BITS>(cols, 1, x, norm_w, &inv, xs, xsum, 0, 0);
    __syncthreads();
}

// One lane's weight loads for NB chunks of R rows (chunk lane + j·WARP from `base`), all issued
// before any arithmetic so that R·NB 16-byte loads are in flight.
template <int BITS, int R, int NB>
struct Batch {
    uint4 q[R][NB];
    u16 scale[R][NB];
    u16 bias[R][NB];
};

template <int BITS, int R, int NB>
__device__ __forceinline__ void load_batch(Batch<BITS, R, NB>& b, const RowRef (&rows)[R], int base,
                                           int chunks, int group, int lane) {
    constexpr int PER = 128 / BITS;
#pragma unroll
    for (int j = 0; j < NB; j++) {
        int ch = base + lane + j * WARP;
        if (ch < chunks) {
            int g = ch * PER / group;
#pragma unroll
            for (int r = 0; r < R; r++) {
                b.q[r][j] = load_weight4((const uint4*)rows[r].w + ch);
                b.scale[r][j] = load_weight16(rows[r].scales + g);
                b.bias[r][j] = load_weight16(rows[r].biases + g);
            }
        }
    }
}

// (v & mask) | magic as one LOP3. Written as C, ptxas emits two: a LOP3 takes one immediate, and
// both mask and magic are constants. magic comes from magic_reg() (a register), mask stays the
// immediate; that is one instruction less per code in the dequantisation loops below.
__device__ __forceinline__ u32 mask_or(u32 v, u32 mask, u32 magic) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "r"(mask), "r"(magic));
    return r;
}

// 0x4B000000 (the bits of 2^23) in a register the compiler cannot fold back into an immediate.
__device__ __forceinline__ u32 magic_reg() {
    u32 r;
    asm("mov.b32 %0, 0x4B000000;" : "=r"(r));
    return r;
}

// Code i (of 128 / BITS) of a 16-byte chunk as a float, times 2^(BITS·(p % HALF)) for its
// position p in its word: exact, and staged x carries the inverse power of two (xs_prescale).
// magic is magic_reg()'s.
template <int BITS>
__device__ __forceinline__ float chunk_code(const u32 (&words)[4], int i, u32 magic) {
    constexpr int HALF = 16 / BITS, WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const int p = i % WORD;
    const u32 v = p >= HALF ? words[i / WORD] >> 16 : words[i / WORD];
    return __uint_as_float(mask_or(v, MASK << (BITS * (p % HALF)), magic)) - 8388608.f;
}

// A chunk's share of a row's dot product from its codes' dot product dq with x and the sum sx of
// x over the chunk: scale · dq + bias · sx. The products and sums of every GEMV are written as
// explicit fmaf / fmul, so the compiler contracts them the same way in every kernel (a · b + c · d
// could otherwise become either fma(a, b, c · d) or fma(c, d, a · b)): the batched step's GEMVs
// give each row the single-row kernel's bits.
__device__ __forceinline__ float chunk_sum(u16 scale, float dq, u16 bias, float sx) {
    return __fmaf_rn(bf16_to_f32(scale), dq, __fmul_rn(bf16_to_f32(bias), sx));
}

// acc[r] += this lane's share of row r · x for NB chunks of R rows (chunk lane + j·WARP from
// `base`), whose codes, scale and bias chunk(r, j, q, scale, bias) gives: from registers
// (dot_batch) or from shared memory (gemv_stream.cuh). Row r reads x from chunk xoff[r] on (0 for
// a plain GEMV; the slot's segment for the expert down projection). SHARED_X: every row reads the
// same x, loaded once per chunk.
template <int BITS, int R, int NB, bool SHARED_X, class Chunk>
__device__ __forceinline__ void dot_chunks(Chunk chunk, int base, int chunks, const int (&xoff)[R],
                                           const float* xs, const float* xsum, int lane, float (&acc)[R]) {
    constexpr int PER = 128 / BITS;
    const u32 magic = magic_reg();
#pragma unroll
    for (int j = 0; j < NB; j++) {
        int ch = base + lane + j * WARP;
        if (ch >= chunks) break;
        float xf[PER];
        float sx = 0.f;
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r == 0 || !SHARED_X) {
                int at = xoff[r] + ch;
                const float4* xv = (const float4*)(xs + at * (PER + XS_PAD));
#pragma unroll
                for (int i = 0; i < PER / 4; i++) {
                    float4 v = xv[i];
                    xf[4 * i] = v.x; xf[4 * i + 1] = v.y; xf[4 * i + 2] = v.z; xf[4 * i + 3] = v.w;
                }
                sx = xsum[at];
            }
            uint4 q;
            u16 scale, bias;
            chunk(r, j, q, scale, bias);
            const u32 words[4] = {q.x, q.y, q.z, q.w};
            float dq = 0.f;
#pragma unroll
            for (int i = 0; i < PER; i++) dq = __fmaf_rn(chunk_code<BITS>(words, i, magic), xf[i], dq);
            acc[r] += chunk_sum(scale, dq, bias, sx);
        }
    }
}

// dot_chunks over a batch loaded into registers (load_batch, load_down).
template <int BITS, int R, int NB, bool SHARED_X>
__device__ __forceinline__ void dot_batch(const Batch<BITS, R, NB>& b, int base, int chunks,
                                          const int (&xoff)[R], const float* xs, const float* xsum,
                                          int lane, float (&acc)[R]) {
    auto chunk = [&](int r, int j, uint4& q, u16& scale, u16& bias) {
        q = b.q[r][j];
        scale = b.scale[r][j];
        bias = b.bias[r][j];
    };
    dot_chunks<BITS, R, NB, SHARED_X>(chunk, base, chunks, xoff, xs, xsum, lane, acc);
}

// Requests R rows' codes into L2, a 128-byte line per lane and step.
template <int BITS, int R>
__device__ __forceinline__ void prefetch_rows(const RowRef (&rows)[R], int cols, int lane) {
    long bytes = (long)cols * BITS / 8;
#pragma unroll
    for (int r = 0; r < R; r++)
        for (long off = lane * 128L; off < bytes; off += WARP * 128L) prefetch_l2((const char*)rows[r].w + off);
}

#if STEP_PERSISTENT
// The persistent step's units, whose weights stream through shared memory (gemv_stream.cuh).
template <int BITS, int R, class RowsOf, class Stage, class Store>
__device__ void stream_rows(long units, int cols, int group, RowsOf rows_of, Stage stage, Store store,
                            const float* xs, const float* xsum, int blk, int nblk);
#endif

// Units of R rows, one warp each, warp-strided over the grid (any grid size works). rows_of(u,
// rows, xoff) fills the unit's row references (clamping ragged ones to a valid row); store(u, acc)
// gets the lanes' unreduced partials. The first unit's weights are requested before x is staged
// (stage() must stage with stage_x), so the two latencies overlap. Every thread must call this.
//
// The units are spread over blocks blk of nblk (blockIdx.x of gridDim.x for a kernel of its own;
// the persistent decode step passes the blocks it gives the stage). In the persistent step the
// quantised units stream their weights instead (stream_rows).
template <int BITS, int R, int NB, bool SHARED_X, bool ROWS_FIXED, class RowsOf, class Stage, class Store>
__device__ void staged_units(long units, int cols, int group, RowsOf rows_of, Stage stage,
                             Store store, const float* xs, const float* xsum, int blk, int nblk) {
    int lane = threadIdx.x % WARP;
    long stride = (long)nblk * (blockDim.x / WARP);
    // Block-fastest numbering: when the units do not divide evenly among the warps, the extra
    // ones (u ≥ stride) spread over every block, so over every SM, instead of piling onto the
    // first blocks' SMs.
    long u = (long)(threadIdx.x / WARP) * nblk + blk;
    RowRef rows[R];
    int xoff[R];
    if constexpr (BITS == 32) {
        pdl_wait();
        stage();
        for (; u < units; u += stride) {
            rows_of(u, rows, xoff);
            float acc[R] = {};
            for (int c = lane; c < cols; c += WARP) {
#pragma unroll
                for (int r = 0; r < R; r++) acc[r] = __fmaf_rn(((const float*)rows[r].w)[c], xs[xoff[r] + c], acc[r]);
            }
            store(u, acc);
        }
    } else {
#if STEP_PERSISTENT
        static_assert(SHARED_X, "the streamed units take one x for all rows");
        stream_rows<BITS, R>(units, cols, group, rows_of, stage, store, xs, xsum, blk, nblk);
#else
        constexpr int PER = 128 / BITS;
        int chunks = cols / PER;
        Batch<BITS, R, NB> b;
        // Rows that do not depend on earlier kernels are requested while the previous kernel
        // finishes: this warp's first unit (its first batch into registers, the rest into L2)
        // and its next. Otherwise the same requests follow the wait; the next unit goes into L2
        // either way, so DRAM streams it while this one computes.
        if constexpr (!ROWS_FIXED) pdl_wait();
        if (u < units) {
            rows_of(u, rows, xoff);
            load_batch<BITS, R, NB>(b, rows, 0, chunks, group, lane);
            if constexpr (ROWS_FIXED) prefetch_rows<BITS, R>(rows, cols, lane);
            if (u + stride < units) {
                RowRef next[R];
                int next_off[R];
                rows_of(u + stride, next, next_off);
                prefetch_rows<BITS, R>(next, cols, lane);
            }
        }
        if constexpr (ROWS_FIXED) pdl_wait();
        stage();
        for (; u < units; u += stride) {
            float acc[R] = {};
            for (int base = 0; base < chunks; base += WARP * NB) {
                if (base > 0) load_batch<BITS, R, NB>(b, rows, base, chunks, group, lane);
                dot_batch<BITS, R, NB, SHARED_X>(b, base, chunks, xoff, xs, xsum, lane, acc);
            }
            if (u + stride < units) {
                rows_of(u + stride, rows, xoff);
                load_batch<BITS, R, NB>(b, rows, 0, chunks, group, lane);
            }
            store(u, acc);
        }
#endif
    }
}

// Rows one warp of the staged GEMV computes: x chunks loaded from shared memory serve all four.
#define GEMV_ROWS 4
// Chunks per lane per row whose loads are issued together (2 covers a 2,048-wide 4-bit row).
#define GEMV_BATCH 2

// Matrix `which` of four by selects: a runtime index into the kernel's parameters would copy them
// into a stack frame.
__device__ __forceinline__ Mat mat_of(const Mat (&ms)[4], int which) {
    Mat m = ms[0];
#pragma unroll
    for (int i = 1; i < 4; i++)
        if (which == i) m = ms[i];
    return m;
}

// The units of ROWS rows of matrices [ms[0] | ... | ms[nm - 1]], whose outputs lie end to end.
template <int ROWS, class Mats>
struct MatUnits {
    const Mats& ms;
    int nm;

    __device__ long count() const {
        long units = 0;
        for (int i = 0; i < nm; i++) units += (ms[i].rows + ROWS - 1) / ROWS;
        return units;
    }

    // Unit u → its matrix, first row and the offset of that matrix's rows in y (the rows of the
    // matrices before it). Each matrix gets whole units.
    __device__ void locate(long u, int& which, long& r0, long& base) const {
        base = 0;
        which = nm - 1;
        for (int i = 0; i < nm; i++) {
            long n = (ms[i].rows + ROWS - 1) / ROWS;
            if (u < n) { which = i; break; }
            u -= n;
            base += ms[i].rows;
        }
        r0 = u * ROWS;
    }

    // The unit's rows, a ragged unit's last ones repeating its matrix's last row.
    template <int BITS>
    __device__ void rows_of(long u, RowRef (&rows)[ROWS], int (&xoff)[ROWS]) const {
        int which; long r0, base;
        locate(u, which, r0, base);
        const Mat& m = ms[which];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            rows[r] = row_ref(m, min(r0 + r, (long)m.rows - 1), BITS);
            xoff[r] = 0;
        }
    }
};

// Rows [ms[0] | ... | ms[nm - 1]] · x, ROWS rows per warp and unit, NB chunks per lane and row
// loaded together, over blocks blk of nblk; all the matrices share x (so their columns). ms may
// point into global memory (the persistent step's weight table): each unit reads its matrix's
// fields from there instead of the kernel holding every matrix in registers; a kernel of its own
// passes its parameters as an array (Mat[4]), which stays in registers. stage() stages x
// with stage_x into xs / xsum (after the first rows are requested); out(which, row, at, v) takes row
// `row` of matrix `which` (at = row plus the rows of the matrices before it: its place when the
// outputs lie end to end), once, from lane 0 of the warp that computed it.
template <int BITS, int ROWS, int NB, class Mats, class Stage, class Out>
__device__ void gemv_mats(const Mats& ms, int nm, Stage stage, Out out, const float* xs, const float* xsum, int blk,
                          int nblk) {
    const MatUnits<ROWS, Mats> mu{ms, nm};
    auto rows_of = [&](long u, RowRef (&rows)[ROWS], int (&xoff)[ROWS]) { mu.template rows_of<BITS>(u, rows, xoff); };
    auto store = [&](long u, float (&acc)[ROWS]) {
        int which; long r0, base;
        mu.locate(u, which, r0, base);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            // Every lane holds the sum (warp_sum); lane r stores row r, so that stores which
            // wait on a load (the GDN conv's window, a residual) go out together.
            float v = warp_sum(acc[r]);
            if (threadIdx.x % WARP == r && r0 + r < ms[which].rows) out(which, r0 + r, base + r0 + r, v);
        }
    };
    staged_units<BITS, ROWS, NB, true, true>(mu.count(), ms[0].cols, ms[0].group, rows_of, stage, store, xs, xsum,
                                              blk, nblk);
}

// Stages x, or RMSNorm(x) · norm_w when norm_w is given (x being the residual stream, normalised
// by every block while staging: identical bits in every block).
template <int BITS>
__device__ void stage_maybe_normed(int cols, const float* x, const float* norm_w, float eps, float* xs,
                                   float* xsum, float* scratch) {
    float inv = norm_w ? block_inv_rms(x, cols, eps, scratch) : 1.f;
    stage_x<BITS>(cols, x, norm_w, inv, xs, xsum);
}

// y = [m0 | m1 | m2 | m3] · x, outputs end to end. With norm_w, x is the residual stream and the
// rows see RMSNorm(x) · norm_w. With add, y += W · x (the residual add of the mixer output and
// expert projections, each element owned by one lane: no race).
template <int BITS, int ROWS = GEMV_ROWS, int NB = GEMV_BATCH>
__device__ void gemv_staged(Mat m0, Mat m1, Mat m2, Mat m3, const float* x, const float* norm_w,
                            float eps, float* y, bool add) {
    __shared__ __align__(16) float xs[XS_FLOATS(BITS)];
    __shared__ float xsum[XSUM_FLOATS(BITS)];
    __shared__ float scratch[32];
    const Mat ms[4] = {m0, m1, m2, m3};
    auto stage = [&]() { stage_maybe_normed<BITS>(m0.cols, x, norm_w, eps, xs, xsum, scratch); };
    auto out = [&](int, long, long at, float v) { y[at] = add ? y[at] + v : v; };
    gemv_mats<BITS, ROWS, NB>(ms, 4, stage, out, xs, xsum, blockIdx.x, gridDim.x);
}
