// What a decode step built of launches could reach: a step's weight reads, layer by layer and
// launch by launch as the graph step issues them (B = 1, synthetic:qwen3.6-35b-a3b's shapes),
// done by kernels that only stream their bytes (no arithmetic), captured in a CUDA graph and
// replayed. It answers two questions the engine's own kernels cannot:
//   - how much of a step the chain of ~320 dependent launches costs by itself (with and without
//     programmatic launch), against one kernel reading the same bytes;
//   - what the experts cost when each step reads a different 8 of 256 (new pages every step,
//     spread over 18 GB) instead of the same 8.
// Run on the GPU machine (nvcc is there, not here):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stream_floor tools/stream_floor.cu && /tmp/stream_floor
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                            \
    do {                                                                                    \
        cudaError_t e = (x);                                                                \
        if (e != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

typedef unsigned long long u64;

constexpr int THREADS = 256;
constexpr int UNROLL = 4;       // 16-byte loads a thread keeps in flight
constexpr int MAX_SEGS = 9;     // a MoE launch reads 8 chosen experts and the shared one
constexpr int NE = 256, TOPK = 8, LAYERS = 40;
constexpr u64 MB = 1ull << 20;

// One contiguous read: offset and length in 16-byte units into the weight buffer.
struct Seg {
    u64 at, n;
};

// A launch: its own segments (fixed), or, for the experts, the chosen experts' of `table` at
// `slot` (which changes every step: the counter advances once a replay).
struct Op {
    Seg segs[MAX_SEGS];
    int nseg;
    int expert_kind;   // -1 fixed; 0 gate/up rows; 1 down rows
    int layer;
    int family;        // Family, for the leave-one-out rows
};

enum Family { EMBED, MIXER_IN, GDN_SMALL, GDN_STEP, ATTENTION, MIXER_OUT, ROUTER, GATE_UP, DOWN, LM_HEAD, FAMILIES };
static const char* FAMILY_NAMES[FAMILIES] = {
    "embedding", "mixer input GEMVs", "GDN conv + gated norm", "GDN recurrence",
    "attention prep, split, combine", "mixer output GEMVs", "router", "experts gate/up", "experts down", "lm_head"};

__device__ __forceinline__ void pdl_wait(bool pdl) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
}

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

struct Tables {
    const int* chosen;   // [steps][LAYERS][TOPK] expert ids
    int steps;
    u64 gate_up_at, down_at;   // where the expert stacks start, 16-byte units
    u64 gate_up_n, down_n;     // one expert's rows, 16-byte units
    u64 shared_gate_up_at, shared_down_at;
};

// Reads blockIdx.y's segment of the op with the grid's x blocks; one value a block is stored only
// if the bytes xor to a pattern they never do, so the loads cannot be dropped.
__global__ void __launch_bounds__(THREADS) stream(const uint4* w, Op op, Tables t, const unsigned* step,
                                                  unsigned* sink, bool pdl, bool early) {
    Seg s = op.segs[blockIdx.y];
    if (op.expert_kind >= 0) {
        // The chosen experts are known only once the router ahead has run.
        pdl_wait(pdl);
        int k = blockIdx.y;
        bool gate_up = op.expert_kind == 0;
        u64 n = gate_up ? t.gate_up_n : t.down_n;
        if (k < TOPK) {
            int e = t.chosen[((*step % t.steps) * LAYERS + op.layer) * TOPK + k];
            u64 base = gate_up ? t.gate_up_at : t.down_at;
            s = Seg{base + ((u64)op.layer * NE + e) * n, n};
        } else {
            s = Seg{(gate_up ? t.shared_gate_up_at : t.shared_down_at) + (u64)op.layer * n, n};
        }
    }
    const uint4* p = w + s.at;
    u64 i = (u64)blockIdx.x * THREADS + threadIdx.x, stride = (u64)gridDim.x * THREADS;
    uint4 v[UNROLL];
    if (op.expert_kind < 0 && !early) pdl_wait(pdl);
#pragma unroll
    for (int u = 0; u < UNROLL; u++) v[u] = i + u * stride < s.n ? ld_stream(p + i + u * stride) : make_uint4(0, 0, 0, 0);
    if (op.expert_kind < 0 && early) pdl_wait(pdl);
    unsigned acc = 0;
    for (;;) {
#pragma unroll
        for (int u = 0; u < UNROLL; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        i += UNROLL * stride;
        if (i >= s.n) break;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) v[u] = i + u * stride < s.n ? ld_stream(p + i + u * stride) : make_uint4(0, 0, 0, 0);
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.y * gridDim.x + blockIdx.x] = acc;
}

__global__ void advance(unsigned* step) { *step += 1; }

__global__ void fill(uint4* w, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        w[i] = make_uint4((unsigned)i, (unsigned)(i >> 32) ^ 0x5bd1e995u, (unsigned)i * 2654435761u, 7u);
}

static u64 units(double mb) { return (u64)(mb * MB) / 16; }

struct Plan {
    std::vector<Op> ops;
    u64 fixed_n = 0;   // 16-byte units of the non-expert weights, laid out first
    u64 bytes_per_step = 0;
};

// The graph step's launches, in order, with each one's bytes (MB, 4-bit codes with bf16 scales
// and biases; docs/BENCHMARKS.md's tables): 30 Gated DeltaNet layers and 10 attention layers.
static Plan plan(bool empty) {
    Plan p;
    auto fixed = [&](double mb, int layer, Family f) {
        Op op{};
        op.family = f;
        op.nseg = 1;
        op.expert_kind = -1;
        op.layer = layer;
        u64 n = empty ? units(0.0625) : std::max<u64>(units(mb), 1);
        op.segs[0] = Seg{p.fixed_n, n};
        p.fixed_n += n;
        p.bytes_per_step += n * 16;
        p.ops.push_back(op);
    };
    auto experts = [&](int kind, int layer, double mb_each) {
        Op op{};
        op.family = kind == 0 ? GATE_UP : DOWN;
        op.nseg = MAX_SEGS;
        op.expert_kind = empty ? -1 : kind;
        op.layer = layer;
        if (empty) {
            op.nseg = 1;
            op.segs[0] = Seg{p.fixed_n, units(0.0625)};
            p.fixed_n += units(0.0625);
            p.bytes_per_step += units(0.0625) * 16;
        } else {
            p.bytes_per_step += MAX_SEGS * units(mb_each) * 16;
        }
        p.ops.push_back(op);
    };
    fixed(0.0625, 0, EMBED);   // embedding row
    for (int l = 0; l < LAYERS; l++) {
        if (l % 4 == 3) {
            fixed(10.6, l, MIXER_IN);   // q (with its gate), k, v
            fixed(0.0625, l, ATTENTION); // q/k norm + RoPE + cache write
            fixed(0.5, l, ATTENTION);    // attention splits at a 256-token context (bf16 K and V)
            fixed(0.0625, l, ATTENTION); // combine
        } else {
            fixed(14.0, l, MIXER_IN);   // qkvz, b, a
            fixed(0.125, l, GDN_SMALL);  // causal conv
            fixed(2.0, l, GDN_STEP);    // the recurrent state (32 heads, 128 x 128 f32)
            fixed(0.0625, l, GDN_SMALL); // gated norm
        }
        fixed(4.7, l, MIXER_OUT);        // output projection + residual
        fixed(0.56, l, ROUTER);       // router (8-bit) + shared gate
        experts(0, l, 1.18);  // gate and up rows of 8 experts + the shared one
        experts(1, l, 0.59);  // down rows, combine into the residual
    }
    fixed(290.0, LAYERS, LM_HEAD);     // final norm + lm_head
    return p;
}

struct Run {
    const char* name;
    bool pdl, empty, random_experts;
    bool early = true;   // weights requested before the wait (where they do not need the router)
    int skip = -1;       // a family left out
};

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int cap = sms * 4;   // one wave: 4 blocks of 256 an SM

    // The weight buffer: the non-expert weights, then the expert stacks of every layer.
    Plan full = plan(false);
    u64 gu_n = units(1.18), dn_n = units(0.59);
    u64 gate_up_at = full.fixed_n, down_at = gate_up_at + (u64)LAYERS * NE * gu_n;
    u64 shared_gu_at = down_at + (u64)LAYERS * NE * dn_n, shared_dn_at = shared_gu_at + LAYERS * gu_n;
    u64 total_n = shared_dn_at + LAYERS * dn_n;
    printf("weights %.2f GB, a step reads %.3f GB in %zu launches, %d SMs\n", total_n * 16.0 / 1e9,
           full.bytes_per_step / 1e9, full.ops.size() + 1, sms);
    uint4* w;
    CHECK(cudaMalloc(&w, total_n * 16));
    fill<<<sms * 8, 256>>>(w, total_n);
    unsigned *sink, *step;
    CHECK(cudaMalloc(&sink, 1 << 20));
    CHECK(cudaMalloc(&step, 4));
    CHECK(cudaMemset(step, 0, 4));

    // 64 steps' choices: distinct experts a layer, from a fixed-seed generator.
    const int steps = 64;
    std::vector<int> chosen((size_t)steps * LAYERS * TOPK);
    u64 rng = 0x243f6a8885a308d3ull;
    for (int s = 0; s < steps; s++)
        for (int l = 0; l < LAYERS; l++)
            for (int k = 0; k < TOPK;) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                int e = (int)(rng >> 33) % NE;
                bool seen = false;
                for (int j = 0; j < k; j++) seen |= chosen[((size_t)s * LAYERS + l) * TOPK + j] == e;
                if (!seen) chosen[((size_t)s * LAYERS + l) * TOPK + k++] = e;
            }
    int *chosen_d, *fixed_d;
    CHECK(cudaMalloc(&chosen_d, chosen.size() * 4));
    CHECK(cudaMemcpy(chosen_d, chosen.data(), chosen.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&fixed_d, chosen.size() * 4));
    std::vector<int> same(chosen.size());
    for (size_t i = 0; i < same.size(); i++) same[i] = chosen[i % (LAYERS * TOPK)];
    CHECK(cudaMemcpy(fixed_d, same.data(), same.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaDeviceSynchronize());

    cudaStream_t stream_;
    CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));

    auto launch = [&](const Op& op, const Tables& t, bool pdl, bool early) {
        u64 longest = 0;
        for (int s = 0; s < op.nseg; s++) longest = std::max(longest, op.segs[s].n);
        if (op.expert_kind >= 0) longest = op.expert_kind == 0 ? gu_n : dn_n;
        u64 want = (longest + THREADS * UNROLL - 1) / (THREADS * UNROLL);
        unsigned x = (unsigned)std::max<u64>(1, std::min<u64>(want, cap / op.nseg));
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(x, op.nseg);
        cfg.blockDim = dim3(THREADS);
        cfg.stream = stream_;
        cudaLaunchAttribute attr{};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = pdl ? 1 : 0;
        CHECK(cudaLaunchKernelEx(&cfg, stream, (const uint4*)w, op, t, (const unsigned*)step, sink, pdl, early));
    };

    auto time_graph = [&](const Run& r) -> double {
        Plan p = plan(r.empty);
        Tables t{r.random_experts ? chosen_d : fixed_d, steps, gate_up_at, down_at, gu_n, dn_n, shared_gu_at, shared_dn_at};
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
        size_t launches = 1;
        u64 bytes = 0;
        for (const Op& op : p.ops) {
            if (op.family == r.skip) continue;
            launch(op, t, r.pdl, r.early);
            launches++;
            bytes += op.expert_kind < 0 ? op.segs[0].n * 16 : MAX_SEGS * (op.expert_kind == 0 ? gu_n : dn_n) * 16;
        }
        advance<<<1, 1, 0, stream_>>>(step);
        CHECK(cudaStreamEndCapture(stream_, &g));
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        for (int i = 0; i < 5; i++) CHECK(cudaGraphLaunch(ge, stream_));
        const int reps = 50;
        CHECK(cudaEventRecord(t0, stream_));
        for (int i = 0; i < reps; i++) CHECK(cudaGraphLaunch(ge, stream_));
        CHECK(cudaEventRecord(t1, stream_));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        double us = ms * 1000.0 / reps;
        printf("| %-44s | %5zu | %8.1f | %8.1f | %6.0f |\n", r.name, launches, us, 1e6 / us,
               bytes / (us * 1e-6) / 1e9);
        CHECK(cudaGraphExecDestroy(ge));
        CHECK(cudaGraphDestroy(g));
        return us;
    };

    printf("| %-44s | %5s | %8s | %8s | %6s |\n", "variant", "launches", "us/step", "steps/s", "GB/s");
    printf("|---|---:|---:|---:|---:|\n");
    // The ceiling: one launch over as many contiguous bytes as a step reads.
    {
        Op op{};
        op.nseg = 1;
        op.expert_kind = -1;
        op.segs[0] = Seg{0, full.bytes_per_step / 16};
        Tables t{fixed_d, steps, gate_up_at, down_at, gu_n, dn_n, shared_gu_at, shared_dn_at};
        for (int i = 0; i < 3; i++) launch(op, t, false, true);
        const int reps = 20;
        CHECK(cudaEventRecord(t0, stream_));
        for (int i = 0; i < reps; i++) launch(op, t, false, true);
        CHECK(cudaEventRecord(t1, stream_));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        double us = ms * 1000.0 / reps;
        printf("| %-44s | %5d | %8.1f | %8.1f | %6.0f |\n", "one kernel, the step's bytes contiguous", 1, us,
               1e6 / us, full.bytes_per_step / (us * 1e-6) / 1e9);
    }
    const Run runs[] = {
        {"graph, no PDL, same experts every step", false, false, false},
        {"graph, PDL, same experts every step", true, false, false},
        {"graph, PDL, new experts every step", true, false, true},
        {"graph, no PDL, new experts every step", false, false, true},
        {"graph, PDL, 64 KB a launch (the chain alone)", true, true, false},
        {"graph, no PDL, 64 KB a launch", false, true, false},
        {"graph, PDL, no weight requested before the wait", true, false, false, false},
    };
    for (const Run& r : runs) time_graph(r);
    // What each family costs the ideal step: the step without it, against the step (PDL, same
    // experts), as docs/BENCHMARKS.md's leave-one-out table does for the engine's kernels.
    const double whole = time_graph(Run{"graph, PDL (the step, again)", true, false, false});
    double cost[FAMILIES];
    for (int f = 0; f < FAMILIES; f++) cost[f] = whole - time_graph(Run{FAMILY_NAMES[f], true, false, false, true, f});
    printf("\n| left out | us a step it costs |\n|---|---:|\n");
    for (int f = 0; f < FAMILIES; f++) printf("| %s | %.1f |\n", FAMILY_NAMES[f], cost[f]);
    CHECK(cudaDeviceSynchronize());
    return 0;
}
