// Embedding lookup forward and deterministic backward, fp32 and bf16 storage (raw uint16 bits).
// Forward: one warp per output row, 128-bit copies when rows are 16-byte aligned. An index outside
// [0, V) yields a NaN row (device-side signal: no host sync).
// Backward (no float atomics): the host sorts the flattened indices stably (radix sort) giving
// (sorted_idx, order). Block j looks at sorted position j; only the first position of each run of
// equal indices does work: it owns that weight row and sums the gradient rows of the run in sorted
// (= original, the sort is stable) order, in fp32, then writes the row once. Rows never indexed are
// left as the caller zeroed them. Result is bitwise reproducible.
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

// grid: (N, ceil(C / blockDim.x)); dweight zeroed by the caller.
template <typename T>
__device__ void emb_backward(const long long* __restrict__ sorted_idx, const long long* __restrict__ order,
                             const T* __restrict__ g, T* __restrict__ dweight, long long N, long long V, int C) {
    const long long j = blockIdx.x;
    const long long v = sorted_idx[j];
    if (j > 0 && sorted_idx[j - 1] == v) return;  // not the owner of this run
    if (v < 0 || v >= V) return;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.f;
    for (long long k = j; k < N && sorted_idx[k] == v; ++k) acc += to_f(g[order[k] * C + c]);
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
