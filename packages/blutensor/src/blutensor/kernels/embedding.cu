// Embedding lookup forward and deterministic backward, fp32 and bf16 storage (raw uint16 bits).
// Forward: one warp per output row, 128-bit copies when rows are 16-byte aligned. An index outside
// [0, V) yields a NaN row (device-side signal: no host sync).
// Backward (no float atomics): the host sorts the flattened indices stably (radix sort) giving
// (sorted_idx, order). Block j looks at sorted position j; only the first position of each run of
// equal indices does work: it owns that weight row and sums the gradient rows of the run in sorted
// (= original, the sort is stable) order, in fp32, then writes the row once. Rows never indexed are
// left as the caller zeroed them. Result is bitwise reproducible.
// Self-contained (no headers) so that NVRTC compiles it anywhere.

typedef unsigned short bf16_t;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));  // round to nearest even, one instruction
    return (bf16_t)h;
#else
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
#endif
}

template <typename T> struct VecN { static constexpr int N = 16 / sizeof(T); };

__device__ __forceinline__ void unpack(const uint4& u, float* o, float) {
    o[0] = __uint_as_float(u.x); o[1] = __uint_as_float(u.y);
    o[2] = __uint_as_float(u.z); o[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(const uint4& u, float* o, bf16_t) {
    o[0] = __uint_as_float(u.x << 16); o[1] = __uint_as_float(u.x & 0xffff0000u);
    o[2] = __uint_as_float(u.y << 16); o[3] = __uint_as_float(u.y & 0xffff0000u);
    o[4] = __uint_as_float(u.z << 16); o[5] = __uint_as_float(u.z & 0xffff0000u);
    o[6] = __uint_as_float(u.w << 16); o[7] = __uint_as_float(u.w & 0xffff0000u);
}
__device__ __forceinline__ uint4 pack(const float* v, float) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}
__device__ __forceinline__ unsigned int pack2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));  // upper half <- b, lower half <- a
    return r;
#else
    return (unsigned int)from_f<bf16_t>(a) | ((unsigned int)from_f<bf16_t>(b) << 16);
#endif
}
__device__ __forceinline__ uint4 pack(const float* v, bf16_t) {
    return make_uint4(pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7]));
}
template <typename T> __device__ __forceinline__ void load_vec(const T* p, float* o) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    unpack(u, o, T());
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float* v) {
    *reinterpret_cast<uint4*>(p) = pack(v, T());
}

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
