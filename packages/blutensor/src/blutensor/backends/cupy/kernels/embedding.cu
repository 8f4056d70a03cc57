// Embedding lookup forward and deterministic backward, fp32 and bf16 storage (raw uint16 bits).
// Forward: one warp per output row, 128-bit copies when rows are 16-byte aligned. An index outside
// [0, V) yields a NaN row (device-side signal: no host sync).
// Backward (no float atomics): the host sorts the flattened indices stably (radix sort) giving
// (sorted_idx, order). Block j looks at sorted position j; only the first position of each run of
// equal indices does work: it owns that weight row and sums the gradient rows of the run in sorted
// (= original, the sort is stable) order, in fp32, then writes the row once. Rows never indexed are
// left as the caller zeroed them. Result is bitwise reproducible.
// Balanced variant (embedding.py, BLUTRAIN_EMBEDDING_BWD=pieces): a run of one index is cut into pieces of P
// sorted positions. Pass 1 (..._pieces): block j, when j - (first position of its index) is a multiple of P, sums
// the piece's gradient rows in sorted order into part[j] (fp32 scratch, (N, C)); pass 2 (..._runs): the block at
// a run's first position sums part[j], part[j + P], ... in order and writes the weight row. A token that fills
// 15% of a batch (a space in byte-level text: ~2500 rows of 16384) then costs ~80 + P serial adds, not 2500.
// Also bitwise reproducible (a fixed order), though its last bits differ from the one-pass sum.
// Shared bf16/vector helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

template <typename T>
__device__ void emb_forward(const long long* __restrict__ idx, const T* __restrict__ weight, T* __restrict__ out,
                            long long N, long long V, int C, int vec) {
    constexpr int VN = VecN<T>::N;
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    for (long long r = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); r < N; r += (long long)gridDim.x * wpb) {
        const long long i = idx[r];
        T* o = out + r * C;
        if (i < 0 || i >= V) {
            for (int c = lane; c < C; c += 32) o[c] = from_f<T>(__int_as_float(0x7fc00000));
            continue;
        }
        const T* w = weight + i * C;
        if (vec) {
            for (int c = lane * VN; c < C; c += 32 * VN)
                *reinterpret_cast<uint4*>(o + c) = *reinterpret_cast<const uint4*>(w + c);
        } else {
            for (int c = lane; c < C; c += 32) o[c] = w[c];
        }
    }
}

// Backward grids are (N, ceil(C / blockDim.x)): block (j, y) looks at sorted position j. BLU_RUN_OWNER declares j,
// the weight row v and the column c, and returns unless this block sits at the first position of a run of one
// in-range index and c < C. (A macro, not a function: its early returns stay in the kernel body in this order,
// the cheap owner test first; a bool helper lets the compiler reorder the branches and changes the default
// backward's machine code.)
#define BLU_RUN_OWNER                                                                                            \
    const long long j = blockIdx.x;                                                                              \
    const long long v = sorted_idx[j];                                                                           \
    if (j > 0 && sorted_idx[j - 1] == v) return; /* not the owner of this run */                                \
    if (v < 0 || v >= V) return;                                                                                 \
    const int c = blockIdx.y * blockDim.x + threadIdx.x;                                                         \
    if (c >= C) return

// dweight zeroed by the caller.
template <typename T>
__device__ void emb_backward(const long long* __restrict__ sorted_idx, const long long* __restrict__ order,
                             const T* __restrict__ g, T* __restrict__ dweight, long long N, long long V, int C) {
    BLU_RUN_OWNER;
    float acc = 0.f;
    for (long long k = j; k < N && sorted_idx[k] == v; ++k) acc += to_f(g[order[k] * C + c]);
    dweight[v * C + c] = from_f<T>(acc);
}

// Balanced backward, pass 1 (grid (N, ceil(C / blockDim.x))): piece sums into part (fp32, (N, C)).
template <typename T>
__device__ void emb_backward_pieces(const long long* __restrict__ sorted_idx, const long long* __restrict__ order,
                                    const T* __restrict__ g, float* __restrict__ part, long long N, long long V,
                                    int C, int P) {
    const long long j = blockIdx.x;
    const long long v = sorted_idx[j];
    if (v < 0 || v >= V) return;
    long long lo = 0, hi = j;  // first position of v: lower bound in the sorted indices
    while (lo < hi) {
        const long long mid = (lo + hi) >> 1;
        if (sorted_idx[mid] < v) lo = mid + 1; else hi = mid;
    }
    if ((j - lo) % P) return;  // not the start of a piece
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const long long end = min(N, j + P);
    float acc = 0.f;
    for (long long k = j; k < end && sorted_idx[k] == v; ++k) acc += to_f(g[order[k] * C + c]);
    part[j * C + c] = acc;
}

// Balanced backward, pass 2 (same grid): the run's first block adds its pieces in order -> the weight row.
template <typename T>
__device__ void emb_backward_runs(const long long* __restrict__ sorted_idx, const float* __restrict__ part,
                                  T* __restrict__ dweight, long long N, long long V, int C, int P) {
    BLU_RUN_OWNER;
    float acc = 0.f;
    for (long long k = j; k < N && sorted_idx[k] == v; k += P) acc += part[k * C + c];
    dweight[v * C + c] = from_f<T>(acc);
}

extern "C" __global__ void blu_embedding_forward_f32(const long long* idx, const float* w, float* out, long long N,
                                                     long long V, int C, int vec) {
    emb_forward<float>(idx, w, out, N, V, C, vec);
}
extern "C" __global__ void blu_embedding_forward_bf16(const long long* idx, const bf16_t* w, bf16_t* out, long long N,
                                                      long long V, int C, int vec) {
    emb_forward<bf16_t>(idx, w, out, N, V, C, vec);
}
extern "C" __global__ void blu_embedding_backward_f32(const long long* sorted_idx, const long long* order,
                                                      const float* g, float* dw, long long N, long long V, int C) {
    emb_backward<float>(sorted_idx, order, g, dw, N, V, C);
}
extern "C" __global__ void blu_embedding_backward_bf16(const long long* sorted_idx, const long long* order,
                                                       const bf16_t* g, bf16_t* dw, long long N, long long V, int C) {
    emb_backward<bf16_t>(sorted_idx, order, g, dw, N, V, C);
}
extern "C" __global__ void blu_embedding_backward_pieces_f32(const long long* sorted_idx, const long long* order,
                                                             const float* g, float* part, long long N, long long V,
                                                             int C, int P) {
    emb_backward_pieces<float>(sorted_idx, order, g, part, N, V, C, P);
}
extern "C" __global__ void blu_embedding_backward_pieces_bf16(const long long* sorted_idx, const long long* order,
                                                              const bf16_t* g, float* part, long long N, long long V,
                                                              int C, int P) {
    emb_backward_pieces<bf16_t>(sorted_idx, order, g, part, N, V, C, P);
}
extern "C" __global__ void blu_embedding_backward_runs_f32(const long long* sorted_idx, const float* part, float* dw,
                                                           long long N, long long V, int C, int P) {
    emb_backward_runs<float>(sorted_idx, part, dw, N, V, C, P);
}
extern "C" __global__ void blu_embedding_backward_runs_bf16(const long long* sorted_idx, const float* part,
                                                            bf16_t* dw, long long N, long long V, int C, int P) {
    emb_backward_runs<bf16_t>(sorted_idx, part, dw, N, V, C, P);
}

// ---------------------------------------------------------------------------------------------------------
// Segmented backward (the default, BLUTRAIN_EMBEDDING_BWD=segments): the sorted positions are cut into fixed
// pieces of EMB_SEG_P (piece p = positions [p*P, p*P + P)), one block per piece, threads over columns. Pass 1
// (..._seg) walks its piece in sorted order, summing the gradient rows of each segment (equal indices) in fp32 from
// 0; a segment that is a whole run (its index neither continues from the previous piece nor into the next) is
// added into its weight row at once: dweight[v] = dweight[v] + sum. Of the segments that touch a piece boundary,
// the piece keeps two partial sums in part ((pieces, 2, C) fp32): slot 0 the first segment when it continues from
// the previous piece, slot 1 the last segment when it continues into the next one and starts in this piece (the
// piece that owns the run). Pass 2 (..._seg_runs): each owner adds its slot 1 and then slot 0 of the following
// pieces, in piece order, for as long as the run lasts, and adds that into the weight row. A fixed order
// throughout: bitwise reproducible, and a token that fills much of the batch costs ~P + run/P serial adds, not run;
// the owner finds the run's end once (binary search), so those adds are loads independent of each other. Pass 2's
// grid is (pieces, column groups): a long run's columns are summed by several blocks on several SMs at once (one
// block walking a 5000-row run over all 768 columns was 0.3 ms), each column still in piece order.
// dweight is the caller's buffer: zeroed, or a gradient that already holds other contributions (the tied lm_head's
// weight gradient), accumulated into. Gradient rows are loaded EMB_SEG_P at a time (independent loads in flight).
#define EMB_SEG_P 16

template <typename TG, typename TO>
__device__ void emb_backward_seg(const long long* __restrict__ sorted_idx, const long long* __restrict__ order,
                                 const TG* __restrict__ g, TO* __restrict__ dweight, float* __restrict__ part,
                                 long long N, long long V, int C) {
    __shared__ long long keys[EMB_SEG_P];
    __shared__ long long rows[EMB_SEG_P];
    const long long s = (long long)blockIdx.x * EMB_SEG_P;
    const int n = (int)min((long long)EMB_SEG_P, N - s);
    if (threadIdx.x < n) {
        keys[threadIdx.x] = sorted_idx[s + threadIdx.x];
        rows[threadIdx.x] = order[s + threadIdx.x];
    }
    __syncthreads();
    const long long prev_key = s > 0 ? sorted_idx[s - 1] : -1;
    const long long next_key = s + n < N ? sorted_idx[s + n] : -1;
    float* pp = part + (size_t)blockIdx.x * 2 * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float vals[EMB_SEG_P];
#pragma unroll
        for (int k = 0; k < EMB_SEG_P; ++k) {
            vals[k] = 0.f;
            if (k < n) vals[k] = to_f(g[rows[k] * C + c]);
        }
        float acc = 0.f;
        int k0 = 0;
#pragma unroll
        for (int k = 0; k < EMB_SEG_P; ++k) {
            if (k >= n) break;
            acc += vals[k];
            const long long v = keys[k];
            if (k + 1 < n && keys[k + 1] == v) continue;
            const bool open_left = k0 == 0 && prev_key == v;
            const bool open_right = k + 1 == n && next_key == v;
            if (open_left) pp[c] = acc;
            else if (open_right) pp[C + c] = acc;
            else if (v >= 0 && v < V) dweight[v * C + c] = from_f<TO>(to_f(dweight[v * C + c]) + acc);
            acc = 0.f;
            k0 = k + 1;
        }
    }
}

template <typename TO>
__device__ void emb_backward_seg_runs(const long long* __restrict__ sorted_idx, TO* __restrict__ dweight,
                                      const float* __restrict__ part, long long N, long long V, int C) {
    __shared__ long long run_end;
    const long long s = (long long)blockIdx.x * EMB_SEG_P;
    const long long e = min(s + EMB_SEG_P, N);
    if (e >= N) return;  // the last piece continues into nothing
    const long long v = sorted_idx[e - 1];
    if (sorted_idx[e] != v) return;  // the last segment ends here: pass 1 wrote it
    long long k0 = e - 1;  // the last segment's first position in this piece
    while (k0 > s && sorted_idx[k0 - 1] == v) --k0;
    if (k0 == s && s > 0 && sorted_idx[s - 1] == v) return;  // the run started in an earlier piece: not the owner
    if (v < 0 || v >= V) return;
    // The run's end, once per block: the first position past e whose index differs (binary search in the sorted
    // indices: ~log2 N loads instead of one dependent load per piece of the run, repeated for every column).
    if (threadIdx.x == 0) {
        long long lo = e, hi = N;
        while (lo < hi) {
            const long long mid = lo + (hi - lo) / 2;
            if (sorted_idx[mid] == v) lo = mid + 1; else hi = mid;
        }
        run_end = lo;
    }
    __syncthreads();
    // pieces blockIdx.x + 1 .. last hold the run's later partial sums (slot 0), added in piece order as before
    const long long first = blockIdx.x + 1, last = (run_end - 1) / EMB_SEG_P;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < C; c += gridDim.y * blockDim.x) {
        float acc = part[(size_t)blockIdx.x * 2 * C + C + c];
        const float* pq = part + (size_t)first * 2 * C + c;
#pragma unroll 8
        for (long long q = first; q <= last; ++q, pq += 2 * C) acc += *pq;  // independent loads, one order
        dweight[v * C + c] = from_f<TO>(to_f(dweight[v * C + c]) + acc);
    }
}

#define EMB_SEG_ENTRIES(SG, TG, SO, TO)                                                                       \
extern "C" __global__ void blu_embedding_backward_seg_##SG##_##SO(const long long* sorted_idx,              \
        const long long* order, const TG* g, TO* dw, float* part, long long N, long long V, int C) {           \
    emb_backward_seg<TG, TO>(sorted_idx, order, g, dw, part, N, V, C);                                        \
}
EMB_SEG_ENTRIES(f32, float, f32, float)
EMB_SEG_ENTRIES(bf16, bf16_t, f32, float)
EMB_SEG_ENTRIES(bf16, bf16_t, bf16, bf16_t)

extern "C" __global__ void blu_embedding_backward_seg_runs_f32(const long long* sorted_idx, float* dw,
                                                               const float* part, long long N, long long V, int C) {
    emb_backward_seg_runs<float>(sorted_idx, dw, part, N, V, C);
}
extern "C" __global__ void blu_embedding_backward_seg_runs_bf16(const long long* sorted_idx, bf16_t* dw,
                                                                const float* part, long long N, long long V,
                                                                int C) {
    emb_backward_seg_runs<bf16_t>(sorted_idx, dw, part, N, V, C);
}
