// The cp.async machinery of the prefill GEMMs that read X as bf16 rows (gemm_wgmma_x16.cu,
// gemm_wgmma_wreg.cu): 16- and 8-byte copies into shared memory and their groups, a thread's X
// rows of a tile and its W row's codes and scale windows, and where a window starts.

// cp.async of 16 bytes into shared memory; zeros where src_bytes is 0 (a row past the tile's).
__device__ __forceinline__ void wg_cp16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void wg_cp8(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void wg_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Whether the step at column k enters a new window of four groups (its scales and biases load).
__device__ __forceinline__ bool wg_new_window(int k, int k0, int window_shift) {
    return k == k0 || (k >> window_shift) != ((k - GEMM_WG_BK) >> window_shift);
}

// Where this thread's X chunks come from: chunk i is row tid/8 + 32·i of the tile, 16 bytes
// tid % 8 of the step's 128; rows past the tile's read nothing (zeros).
template <int BM>
struct WgX16Rows {
    static constexpr int CHUNKS = BM / 32;
    const u16* row[CHUNKS];
    int bytes[CHUNKS];
};

// This thread's W row (row tid of the block's 256): where its codes and its scale and bias
// windows start, and whether it is a row of the weight (a row past it copies zeros: w = 0).
struct WgWRow {
    const char* codes;
    const u16* scales;
    const u16* biases;
    int bytes;
};

// Row `row` of w (clamped to the last of n_valid, which must be ≥ 1) for this thread, `live` or
// not; K values a row in `groups` groups.
__device__ __forceinline__ WgWRow wg_w_row(const Mat& w, long row0, int row, int n_valid) {
    const long r = row0 + min(row, n_valid - 1);
    const long groups = w.cols / w.group;
    return WgWRow{(const char*)w.w + r * (w.cols / 2), w.scales + r * groups, w.biases + r * groups,
                  row < n_valid ? 16 : 0};
}
