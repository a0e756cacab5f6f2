// The choice of the next token on the device under a whole request: the constraint's mask, the
// penalties and logit_bias, temperature / top-k / min-p / top-p with the host's draw, and the
// log-probabilities, so that only the token and its top entries leave the device (pick.rs).
// The rule is the host's (lily-core sampling.rs, logprobs.rs): the same candidates in the same
// order, the same f32 arithmetic on them, so that the two agree on the token.
//
// The passes, each a launch:
//   pick_prepare   the row's log-normaliser per block; the masked copy of the choosable ids
//                  (rows with no log-probabilities, mask or penalties skip it)
//   pick_adjust    one thread per penalised id (ids are distinct, so no two threads meet)
//   pick_top       each block takes PICK_CHUNK entries and keeps its best PICK_TOP, and the
//                  block's share of the softmax denominator (a candidate list per block)
//   pick_top_raw   the same over the raw logits, for the top log-probabilities when a mask or
//                  a penalty made the two orders differ
//   pick_choose    one block merges the lists and walks the best as the host would
// They are launched plainly, after the step, once for all the step's rows that choose this way
// (a row per grid y); each waits on its predecessor all the same, as every kernel here does
// (compile.rs checks it).
// A request whose kept tokens reach past the PICK_TOP best (a flat distribution with no top-k)
// is answered "host": the host reads the row and decides, with the same draw.
#define PICK_BLOCKS 128
#define PICK_CHUNK 4096
#define PICK_TOP 64
#define PICK_LOGPROBS 20
#define PICK_CHOSEN 0
#define PICK_HOST 1

// One penalised id (lily-core penalties.rs `Adjustment`): (logit + bias - penalty), then the
// repetition factor unless it is 1.
struct Adjustment {
    u32 id;
    float bias;
    float penalty;
    float repetition;
};

struct PickOut {
    int status;
    u32 token;
    float logprob;
    int n_top;
    u32 top_id[PICK_LOGPROBS];
    float top_logprob[PICK_LOGPROBS];
};

// Every pick kernel's one parameter (pick.rs `PickArgs`; the NVRTC test checks its size).
struct PickArgs {
    const float* logits;
    float* adjusted;
    const u32* allowed;
    const Adjustment* adjustments;
    double* row_parts;
    float* top_v;
    int* top_i;
    double* mass_parts;
    float* raw_top_v;
    int* raw_top_i;
    u32* token;
    PickOut* out;
    int vocab;
    int choosable;
    int n_adjustments;
    int lists;
    float inv_t;
    int top_k;
    float top_p;
    float min_p;
    float draw;
    int logprobs;
    int raw_lists;
};

// Up to PICK_ROWS rows of a decode step choose at once, a row per grid y (pick.rs `PickRows`):
// at 8 rows a step the rows' choices one after another cost 8 × ~60 µs. Rows past the step's are
// never reached (the grid's y is the step's rows).
#define PICK_ROWS 8
struct PickRows {
    PickArgs row[PICK_ROWS];
};

// Whether a row needs pick_prepare: its log-normaliser for log-probabilities, its adjusted copy
// for a mask or penalties. A row that needs neither ranks its logits as they are (the host
// points `adjusted` at them), and its pick_prepare blocks leave at once.
__device__ __forceinline__ bool needs_prepare(const PickArgs& a) {
    return a.logprobs >= 0 || a.allowed != nullptr || a.n_adjustments > 0;
}

__device__ __forceinline__ bool allowed_id(const u32* allowed, int i) {
    return allowed == nullptr || ((allowed[i >> 5] >> (i & 31)) & 1u);
}

// The candidate order: valid ids first (id -1 is none), then larger values, then smaller ids.
// Written without short-circuits: as early returns it compiled to branches around every
// compare-exchange of the sorting networks (868 BRA and 150 convergence barriers in pick_top),
// which the lanes of a warp take apart; as one predicate it is compares and a PLOP3.
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
    return (i1 >= 0) & ((i2 < 0) | (v1 > v2) | ((v1 == v2) & (i1 < i2)));
}

// common.cuh's block_sum in f64: the softmax sums of 248K terms.
__device__ double block_sum_f64(double x, double* smem) {
    for (int o = WARP / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    __syncthreads();
    if (lane == 0) smem[warp] = x;
    __syncthreads();
    double t = 0;
    for (int w = 0; w < (int)(blockDim.x / WARP); w++) t += smem[w];
    return t;
}

extern "C" __global__ void pick_prepare(PickRows rows) {
    __shared__ float smax[32];
    __shared__ double ssum[32];
    pdl_wait();
    const PickArgs a = rows.row[blockIdx.y];
    if (!needs_prepare(a)) return;
    float m = -INFINITY;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.vocab; i += gridDim.x * blockDim.x) {
        float v = a.logits[i];
        m = fmaxf(m, v);
        if (i < a.choosable) a.adjusted[i] = allowed_id(a.allowed, i) ? v : -INFINITY;
    }
    m = block_max(m, smax);
    double s = 0;
    if (m > -INFINITY)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.vocab; i += gridDim.x * blockDim.x)
            s += exp((double)a.logits[i] - (double)m);
    s = block_sum_f64(s, ssum);
    if (threadIdx.x == 0) {
        a.row_parts[2 * blockIdx.x] = m;
        a.row_parts[2 * blockIdx.x + 1] = s;
    }
}

extern "C" __global__ void pick_adjust(PickRows rows) {
    pdl_wait();
    const PickArgs a = rows.row[blockIdx.y];
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= a.n_adjustments) return;
    Adjustment adj = a.adjustments[e];
    int id = (int)adj.id;
    if (id >= a.choosable || !allowed_id(a.allowed, id)) return;
    float v = a.logits[id] + adj.bias;
    v = v - adj.penalty;
    if (adj.repetition != 1.0f) v = v > 0.0f ? v / adj.repetition : v * adj.repetition;
    a.adjusted[id] = v;
}

// Candidate lists are made with warp-wide bitonic networks (shuffles, no block barriers: a
// block-wide sort of 4,096 entries spent 70 µs on its 78 barriers): a warp sorts 128 entries,
// then warps merge sorted lists of PICK_TOP pairwise, each merge keeping the best PICK_TOP.

// One compare-exchange of a network step on element `e`, whose partner holds (ov, oi): the lower
// of the two keeps the better entry where the run at `k` sorts best first.
__device__ __forceinline__ void exchange(float& v, int& id, float ov, int oi, int e, int j, int k) {
    bool keep_better = ((e & j) == 0) == ((e & k) == 0);
    bool take = keep_better ? better(ov, oi, v, id) : better(v, id, ov, oi);
    if (take) { v = ov; id = oi; }
}

// Sorts the warp's 128 entries best first; entry e is lane e / 4, register e % 4.
__device__ void warp_sort128(float v[4], int id[4]) {
    int lane = threadIdx.x % WARP;
#pragma unroll
    for (int k = 2; k <= 128; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            if (j >= 4) {
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    float ov = __shfl_xor_sync(0xffffffffu, v[r], j / 4);
                    int oi = __shfl_xor_sync(0xffffffffu, id[r], j / 4);
                    exchange(v[r], id[r], ov, oi, lane * 4 + r, j, k);
                }
            } else {
                float nv[4];
                int ni[4];
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    nv[r] = v[r];
                    ni[r] = id[r];
                    exchange(nv[r], ni[r], v[r ^ j], id[r ^ j], lane * 4 + r, j, k);
                }
#pragma unroll
                for (int r = 0; r < 4; r++) { v[r] = nv[r]; id[r] = ni[r]; }
            }
        }
    }
}

// The best PICK_TOP of two lists sorted best first (b may be absent), sorted best first; entry
// e of each is lane e / 2, register e % 2. Taking best(a[e], b[63 - e]) leaves a bitonic
// sequence holding the best 64 of both, which six half-cleaner steps sort.
__device__ void warp_merge64(const float* av, const int* ai, const float* bv, const int* bi,
                             float out_v[2], int out_i[2]) {
    int lane = threadIdx.x % WARP;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int e = lane * 2 + r;
        float v = av[e];
        int id = ai[e];
        if (bv != nullptr && better(bv[PICK_TOP - 1 - e], bi[PICK_TOP - 1 - e], v, id)) {
            v = bv[PICK_TOP - 1 - e];
            id = bi[PICK_TOP - 1 - e];
        }
        out_v[r] = v;
        out_i[r] = id;
    }
#pragma unroll
    for (int j = PICK_TOP / 2; j > 0; j >>= 1) {
        if (j >= 2) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float ov = __shfl_xor_sync(0xffffffffu, out_v[r], j / 2);
                int oi = __shfl_xor_sync(0xffffffffu, out_i[r], j / 2);
                exchange(out_v[r], out_i[r], ov, oi, lane * 2 + r, j, PICK_TOP);
            }
        } else {
            float v0 = out_v[0], v1 = out_v[1];
            int i0 = out_i[0], i1 = out_i[1];
            exchange(out_v[0], out_i[0], v1, i1, lane * 2, 1, PICK_TOP);
            exchange(out_v[1], out_i[1], v0, i0, lane * 2 + 1, 1, PICK_TOP);
        }
    }
}

// Merges `lists` sorted lists of PICK_TOP held in shared memory (slot l at l * PICK_TOP) down to
// slot 0, pairwise, a warp a pair (at most two lists a warp: pick_top's 32 of its 32 warps,
// pick_choose's 64 of its 32); every thread of the block takes part in its barriers.
__device__ void merge_slots(float* sv, int* si, int lists) {
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    while (lists > 1) {
        int pairs = (lists + 1) / 2;
        float v[2];
        int id[2];
        __syncthreads();
        if (warp < pairs) {
            bool has_b = 2 * warp + 1 < lists;
            warp_merge64(sv + 2 * warp * PICK_TOP, si + 2 * warp * PICK_TOP,
                         has_b ? sv + (2 * warp + 1) * PICK_TOP : nullptr,
                         has_b ? si + (2 * warp + 1) * PICK_TOP : nullptr, v, id);
        }
        __syncthreads();
        // Every read made: each merging warp writes its list over slot `warp`.
        if (warp < pairs)
            for (int r = 0; r < 2; r++) {
                sv[warp * PICK_TOP + lane * 2 + r] = v[r];
                si[warp * PICK_TOP + lane * 2 + r] = id[r];
            }
        lists = pairs;
    }
    __syncthreads();
}

// This block's PICK_CHUNK entries of `values`: its best PICK_TOP, sorted, into the list of the
// block; with `mass`, also the block's best value, its softmax sum at inv_t relative to that
// value, and how many valid ids it holds.
__device__ void top_of_chunk(const float* values, int n, float* top_v, int* top_i, double* mass,
                             float inv_t) {
    __shared__ float sv[(PICK_CHUNK / 128) * PICK_TOP];
    __shared__ int si[(PICK_CHUNK / 128) * PICK_TOP];
    __shared__ double ssum[32];
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int base = blockIdx.x * PICK_CHUNK + warp * 128;
    float v[4];
    int id[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int i = base + lane * 4 + r;
        float x = i < n ? values[i] : 0.0f;
        bool ok = i < n && !isnan(x);
        v[r] = ok ? x : -INFINITY;
        id[r] = ok ? i : -1;
    }
    double count = 0;
#pragma unroll
    for (int r = 0; r < 4; r++) count += id[r] >= 0;
    warp_sort128(v, id);
    // The warp's best 64 are its first 16 lanes' entries.
    if (lane < 16)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            sv[warp * PICK_TOP + lane * 4 + r] = v[r];
            si[warp * PICK_TOP + lane * 4 + r] = id[r];
        }
    merge_slots(sv, si, blockDim.x / WARP);
    for (int j = threadIdx.x; j < PICK_TOP; j += blockDim.x) {
        top_v[blockIdx.x * PICK_TOP + j] = sv[j];
        top_i[blockIdx.x * PICK_TOP + j] = si[j];
    }
    if (mass == nullptr) return;
    float best = sv[0];
    bool finite = si[0] >= 0 && best > -INFINITY;
    double s = 0;
    if (finite && inv_t > 0.0f)
#pragma unroll
        for (int r = 0; r < 4; r++)
            if (id[r] >= 0) s += exp(((double)v[r] - (double)best) * (double)inv_t);
    s = block_sum_f64(s, ssum);
    count = block_sum_f64(count, ssum);
    if (threadIdx.x == 0) {
        mass[3 * blockIdx.x] = finite ? (double)best : -(double)INFINITY;
        mass[3 * blockIdx.x + 1] = s;
        mass[3 * blockIdx.x + 2] = count;
    }
}

// The grid's x is the step's most lists: a row with fewer has blocks to spare.
extern "C" __global__ void pick_top(PickRows rows) {
    pdl_wait();
    const PickArgs a = rows.row[blockIdx.y];
    if ((int)blockIdx.x >= a.lists) return;
    top_of_chunk(a.adjusted, a.choosable, a.top_v, a.top_i, a.mass_parts, a.inv_t);
}

// Launched when any row of the step needs the raw lists; the others' blocks have nothing to do.
extern "C" __global__ void pick_top_raw(PickRows rows) {
    pdl_wait();
    const PickArgs a = rows.row[blockIdx.y];
    if (!a.raw_lists || (int)blockIdx.x >= a.lists) return;
    top_of_chunk(a.logits, a.choosable, a.raw_top_v, a.raw_top_i, nullptr, 0.0f);
}

// The best `count` entries of the blocks' lists (list b at b * PICK_TOP; at most
// PICK_CHUNK / PICK_TOP lists, pick.rs checks it), merged in shared memory, into out_v / out_i.
__device__ void best_of_lists(const float* v, const int* ids, int lists, float* sv, int* si,
                              int count, float* out_v, int* out_i) {
    __syncthreads();
    for (int j = threadIdx.x; j < lists * PICK_TOP; j += blockDim.x) {
        sv[j] = v[j];
        si[j] = ids[j];
    }
    merge_slots(sv, si, lists);
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
        out_v[j] = sv[j];
        out_i[j] = si[j];
    }
    __syncthreads();
}

__device__ double block_max_f64(double x, double* smem) {
    for (int o = WARP / 2; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    __syncthreads();
    if (lane == 0) smem[warp] = x;
    __syncthreads();
    double t = -(double)INFINITY;
    for (int w = 0; w < (int)(blockDim.x / WARP); w++) t = fmax(t, smem[w]);
    return t;
}

// sv / si hold every list's entries (lists * PICK_TOP <= PICK_CHUNK).
extern "C" __global__ void pick_choose(PickRows rows) {
    __shared__ float sv[PICK_CHUNK], cv[PICK_TOP], lv[PICK_LOGPROBS];
    __shared__ int si[PICK_CHUNK], ci[PICK_TOP], li[PICK_LOGPROBS];
    __shared__ double red[32];
    pdl_wait();
    const PickArgs a = rows.row[blockIdx.y];
    best_of_lists(a.top_v, a.top_i, a.lists, sv, si, PICK_TOP, cv, ci);
    if (a.logprobs > 0 && a.raw_lists)
        best_of_lists(a.raw_top_v, a.raw_top_i, a.lists, sv, si, PICK_LOGPROBS, lv, li);
    // The sums over the lists and over the row's blocks, by every thread: how many valid ids,
    // the softmax denominator of the whole row at inv_t, and the row's log-normaliser.
    float top = cv[0];
    double valid = 0, whole = 0;
    for (int b = threadIdx.x; b < a.lists; b += blockDim.x) {
        valid += a.mass_parts[3 * b + 2];
        double mb = a.mass_parts[3 * b];
        if (a.inv_t > 0.0f && ci[0] >= 0 && mb > -(double)INFINITY)
            whole += a.mass_parts[3 * b + 1] * exp((mb - (double)top) * (double)a.inv_t);
    }
    valid = block_sum_f64(valid, red);
    whole = block_sum_f64(whole, red);
    // The row's log-normaliser, from pick_prepare's blocks, where log-probabilities are asked.
    double row_max = -(double)INFINITY, row_sum = 0;
    if (a.logprobs >= 0) {
        for (int b = threadIdx.x; b < PICK_BLOCKS; b += blockDim.x) row_max = fmax(row_max, a.row_parts[2 * b]);
        row_max = block_max_f64(row_max, red);
        for (int b = threadIdx.x; b < PICK_BLOCKS; b += blockDim.x)
            if (a.row_parts[2 * b] > -(double)INFINITY)
                row_sum += a.row_parts[2 * b + 1] * exp(a.row_parts[2 * b] - row_max);
        row_sum = block_sum_f64(row_sum, red);
    }
    if (threadIdx.x != 0) return;
    PickOut* o = a.out;
    o->status = PICK_HOST;
    int n = 0;
    while (n < PICK_TOP && ci[n] >= 0) n++;
    if (n == 0) return;
    int token = ci[0];
    if (a.inv_t > 0.0f) {
        // Every valid id is a candidate when the lists ran dry before PICK_TOP.
        long long k = a.top_k == 0 ? (long long)valid : min((long long)a.top_k, (long long)valid);
        // `len` candidates are in the top-k set; `extends`: the set goes on past them.
        int len = (int)min(k, (long long)n);
        bool extends = k > n;
        if (extends && k < (long long)valid) return;  // a top-k beyond the candidates
        double total = extends ? whole : 0;
        if (!extends)
            for (int j = 0; j < len; j++) total += (double)expf((cv[j] - top) * a.inv_t);
        float total_f = (float)total;
        float p[PICK_TOP];
        for (int j = 0; j < len; j++) p[j] = expf((cv[j] - top) * a.inv_t) / total_f;
        int keep = len;
        if (a.min_p > 0.0f) {
            float floor = a.min_p * p[0];
            int c = 0;
            while (c < len && p[c] >= floor) c++;
            if (c < len || !extends) { keep = max(c, 1); extends = false; }
        }
        if (a.top_p < 1.0f) {
            float cumulative = 0.0f;
            int c = 0;
            bool reached = false;
            while (c < keep) {
                cumulative += p[c];
                c++;
                if (cumulative >= a.top_p) { reached = true; break; }
            }
            if (reached || !extends) { keep = max(c, 1); extends = false; }
        }
        // Past the candidates only the whole row is kept, whose mass is its normalised sum.
        if (extends && (a.min_p > 0.0f || a.top_p < 1.0f)) return;
        double mass_d = 0;
        if (extends) mass_d = total / (double)total_f;
        else for (int j = 0; j < keep; j++) mass_d += (double)p[j];
        float r = a.draw * (float)mass_d;
        int chosen = -1, last_positive = 0;
        for (int j = 0; j < keep; j++) {
            if (p[j] > 0.0f) last_positive = j;
            r -= p[j];
            if (r < 0.0f) { chosen = j; break; }
        }
        if (chosen < 0) {
            if (extends) return;
            chosen = last_positive;
        }
        token = ci[chosen];
    }
    o->status = PICK_CHOSEN;
    o->token = (u32)token;
    *a.token = (u32)token;
    if (a.logprobs < 0) return;
    double lse = row_max + log(row_sum);
    o->logprob = (float)((double)a.logits[token] - lse);
    const float* tv = a.raw_lists ? lv : cv;
    const int* ti = a.raw_lists ? li : ci;
    int shown = 0;
    while (shown < a.logprobs && shown < PICK_LOGPROBS && ti[shown] >= 0) {
        o->top_id[shown] = (u32)ti[shown];
        o->top_logprob[shown] = (float)((double)tv[shown] - lse);
        shown++;
    }
    o->n_top = shown;
}
