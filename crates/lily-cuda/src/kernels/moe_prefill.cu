// Mixture of experts for a prefill chunk of T tokens: routing, sorting the (token, choice) pairs
// by expert for the grouped expert GEMMs (gemm.cu), SwiGLU, and the weighted combine.
// Constants: NE experts, TOPK chosen per token, NORM_TOPK (renormalise the chosen weights).
//
// Pair p = t·TOPK + k is token t's k-th choice. The expert GEMMs work on "slots": the pairs
// sorted by expert, so each expert's rows are contiguous and cut into tiles of at most the grouped
// GEMM's height, which the host chooses per chunk (16 or 64 rows) and passes to the sort.

// A logits row: [router (NE) | shared-expert gate (1)].
#define LOGITS_STRIDE (NE + 1)
#define FULL_MASK 0xffffffffu

// logits [t, NE + 1] → ids, weights [t, TOPK]. One warp per token row (any multiple of 32
// threads a block); a warp past the last row leaves as a whole, so the shuffles stay full-warp.
extern "C" __global__ void moe_topk_rows(const float* logits, int t, int* ids, float* weights) {
    pdl_wait();
    long row = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= t) return;
    route_topk(logits + row * LOGITS_STRIDE, threadIdx.x % WARP, ids + row * TOPK, weights + row * TOPK);
}

// moe_sort_offsets runs as one block of this many threads: one thread per expert in the scans
// (NE ≤ 1,024 is checked on the host) and 32 warps for the block scan's second level.
#define SORT_THREADS 1024
static_assert(NE <= SORT_THREADS, "the sort plan scans one expert per thread");

// Exclusive prefix sum of one int per thread over the whole block; *total gets the block's sum.
// Every thread must call it; `warp_sums` holds WARP + 1 ints and is free again on return.
__device__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int incl = v;
    for (int o = 1; o < WARP; o <<= 1) {
        int n = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == WARP - 1) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int s = warp_sums[lane];
        int si = s;
        for (int o = 1; o < WARP; o <<= 1) {
            int n = __shfl_up_sync(FULL_MASK, si, o);
            if (lane >= o) si += n;
        }
        warp_sums[lane] = si - s;
        if (lane == WARP - 1) warp_sums[WARP] = si;
    }
    __syncthreads();
    int exclusive = warp_sums[warp] + incl - v;
    *total = warp_sums[WARP];
    __syncthreads();
    return exclusive;
}

// From each expert's pair count (thread e holds expert e's, threads past NE 0), every expert's
// first slot (returned to thread e) and the tile map: tiles[3i .. 3i+3] = {expert, first slot,
// rows ≤ tile_rows}, an expert's tiles consecutive and in expert order, *num_tiles = Σ_e
// ceil(count_e / tile_rows) ≤ pairs / tile_rows + NE. Every thread of a SORT_THREADS block calls
// it; it ends with the block met.
__device__ int sort_plan(int count, int tile_rows, int* tiles, int* num_tiles) {
    __shared__ int slot_start[NE + 1];  // an expert's first slot; [NE] = pairs
    __shared__ int tile_start[NE + 1];  // an expert's first tile; [NE] = the tile count
    __shared__ int warp_sums[WARP + 1];
    const int tid = threadIdx.x;
    int n_tiles = (count + tile_rows - 1) / tile_rows;
    int total_pairs, total_tiles;
    int first_slot = block_exclusive_scan(count, warp_sums, &total_pairs);
    int first_tile = block_exclusive_scan(n_tiles, warp_sums, &total_tiles);
    if (tid < NE) {
        slot_start[tid] = first_slot;
        tile_start[tid] = first_tile;
    }
    if (tid == 0) {
        slot_start[NE] = total_pairs;
        tile_start[NE] = total_tiles;
        *num_tiles = total_tiles;
    }
    __syncthreads();
    for (int i = tid; i < total_tiles; i += SORT_THREADS) {
        // The tile's expert: the first e whose tiles end past i (empty experts end where they
        // start, so they are skipped).
        int lo = 0, hi = NE - 1;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (tile_start[mid + 1] > i) hi = mid; else lo = mid + 1;
        }
        int first = slot_start[lo] + (i - tile_start[lo]) * tile_rows;
        tiles[3 * i] = lo;
        tiles[3 * i + 1] = first;
        tiles[3 * i + 2] = min(tile_rows, slot_start[lo + 1] - first);
    }
    __syncthreads();
    return first_slot;
}

// Sorts the pairs by expert (a counting sort) and cuts each expert's slots into tiles of
// tile_rows (> 0, the height of the grouped GEMM entry that reads them): gather[s] = the token of
// slot s, slot_of[p] = the slot of pair p, and the tile map of sort_plan. Block b takes pairs
// [b·SORT_GRID_PAIRS, (b + 1)·SORT_GRID_PAIRS):
//   moe_sort_count    each block's histogram, counts[b][e];
//   moe_sort_offsets  one block: the plan from the totals, and counts[b][e] becomes block b's
//                     first slot on expert e (the slots of expert e in block order);
//   moe_sort_scatter  each block places its pairs from those offsets.
// Within an expert the slot order depends on atomic timing; that is harmless, since every slot's
// GEMM row depends only on its own input and the combine reads the slots back through slot_of in
// choice order. Expert ids come from moe_topk_rows, always in [0, NE). (One block sorting a 4K
// chunk's 32,768 pairs alone took 71 µs a layer on an H100, bound by its match.any and shared
// atomics on one SM; these three take 17: docs/BENCHMARKS.md, seventeenth session.)
#define SORT_GRID_THREADS 256
#define SORT_GRID_PER_THREAD 4
#define SORT_GRID_PAIRS (SORT_GRID_THREADS * SORT_GRID_PER_THREAD)

// The tile map of one dense "expert" over a chunk's t rows in order, for a launch of the grouped
// GEMMs on rows that are not routed (the shared expert through the fused gate/up launch):
// tiles[3i .. 3i+3] = {0, tile_rows·i, min(tile_rows, t − tile_rows·i)}, *num_tiles = ⌈t / tile_rows⌉.
extern "C" __global__ void moe_dense_tiles(int t, int tile_rows, int* tiles, int* num_tiles) {
    pdl_wait();
    const int n = (t + tile_rows - 1) / tile_rows;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        tiles[3 * i] = 0;
        tiles[3 * i + 1] = tile_rows * i;
        tiles[3 * i + 2] = min(tile_rows, t - tile_rows * i);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *num_tiles = n;
}

extern "C" __global__ void __launch_bounds__(SORT_GRID_THREADS)
moe_sort_count(const int* ids, int pairs, int* counts) {
    pdl_wait();
    __shared__ int hist[NE];
    for (int e = threadIdx.x; e < NE; e += SORT_GRID_THREADS) hist[e] = 0;
    __syncthreads();
    int e[SORT_GRID_PER_THREAD];
#pragma unroll
    for (int i = 0; i < SORT_GRID_PER_THREAD; i++) {
        const int p = blockIdx.x * SORT_GRID_PAIRS + i * SORT_GRID_THREADS + threadIdx.x;
        e[i] = p < pairs ? ids[p] : -1;
    }
#pragma unroll
    for (int i = 0; i < SORT_GRID_PER_THREAD; i++)
        if (e[i] >= 0) atomicAdd(&hist[e[i]], 1);
    __syncthreads();
    for (int x = threadIdx.x; x < NE; x += SORT_GRID_THREADS) counts[(long)blockIdx.x * NE + x] = hist[x];
}

// counts [blocks][NE] from moe_sort_count → each block's first slot per expert, in place; the
// tile map of sort_plan. One block of SORT_THREADS.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
moe_sort_offsets(int* counts, int blocks, int tile_rows, int* tiles, int* num_tiles) {
    pdl_wait();
    const int tid = threadIdx.x;
    int total = 0;
    if (tid < NE)
        for (int b = 0; b < blocks; b++) {
            const int c = counts[(long)b * NE + tid];
            counts[(long)b * NE + tid] = total;
            total += c;
        }
    const int first_slot = sort_plan(total, tile_rows, tiles, num_tiles);
    if (tid < NE)
        for (int b = 0; b < blocks; b++) counts[(long)b * NE + tid] += first_slot;
}

// Block b's pairs into their slots from offsets[b][e] (moe_sort_offsets). Same grid as
// moe_sort_count.
extern "C" __global__ void __launch_bounds__(SORT_GRID_THREADS)
moe_sort_scatter(const int* ids, int pairs, const int* offsets, int* gather, int* slot_of) {
    pdl_wait();
    __shared__ int cursor[NE];
    for (int x = threadIdx.x; x < NE; x += SORT_GRID_THREADS) cursor[x] = offsets[(long)blockIdx.x * NE + x];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < SORT_GRID_PER_THREAD; i++) {
        const int p = blockIdx.x * SORT_GRID_PAIRS + i * SORT_GRID_THREADS + threadIdx.x;
        if (p >= pairs) continue;
        const int s = atomicAdd(&cursor[ids[p]], 1);
        gather[s] = p / TOPK;
        slot_of[p] = s;
    }
}

// act[i] = silu(gate[i]) · up[i] for i < n, grid-stride.
// act = silu(gate) · up, and the same rounded to bf16 into act16 when given (the down
// projection's X on the wgmma path; rounded as the GEMMs round f32 X).
extern "C" __global__ void moe_swiglu(const float* gate, const float* up, int n, float* act, u16* act16) {
    pdl_wait();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float v = siluf(gate[i]) * up[i];
        act[i] = v;
        if (act16) act16[i] = (u16)pack_bf16x2(v, 0.f);
    }
}

// out[t, :] = Σ_k weights[t·TOPK + k] · down[slot_of[t·TOPK + k], :] + σ(shared gate logit) ·
// shared[t, :]. One block per token t; threads stride over the h columns. The residual add is
// the caller's (the next norm adds it).
extern "C" __global__ void moe_combine(const float* down, const int* slot_of, const float* weights,
                                       const float* logits, const float* shared, int shared_parts,
                                       int shared_stride, int h, float* out) {
    pdl_wait();
    long t = blockIdx.x;
    long row[TOPK];
    float w[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; k++) {
        row[k] = (long)slot_of[t * TOPK + k] * h;
        w[k] = weights[t * TOPK + k];
    }
    float gate = sigmoidf(logits[t * LOGITS_STRIDE + NE]);
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < TOPK; k++) acc += w[k] * down[row[k] + i];
        // The shared expert's row from its down projection's split-K parts, added in order
        // from 0 as gemm_reduce adds them (one part read as it is: see add_rms_norm).
        float sh = shared[t * h + i];
        if (shared_parts > 1) {
            sh = 0.f;
            for (int s = 0; s < shared_parts; s++) sh += shared[(long)s * shared_stride + t * h + i];
        }
        out[t * h + i] = acc + gate * sh;
    }
}
