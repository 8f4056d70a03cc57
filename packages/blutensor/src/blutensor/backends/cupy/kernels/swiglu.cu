// SwiGLU, y = silu(gate) * up, forward and backward for fp32 and bf16 storage; math in fp32.
// The backward recomputes sigmoid(gate) (only gate and up are saved):
//   dgate = dy * up * s * (1 + gate * (1 - s)),  dup = dy * gate * s,  s = sigmoid(gate).
// Grid-stride elementwise loops, vectorised. Shared bf16 helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

__device__ __forceinline__ float sigmoid_f(float v) { return 1.f / (1.f + expf(-v)); }

// vec: gate, up and the outputs start on 16-byte boundaries, so each thread moves 16 bytes of every tensor per
// iteration (8 bf16 / 4 fp32 elements: the kernels are bandwidth-bound); a scalar loop takes the tail.
__device__ __forceinline__ float swiglu_f(float g, float u) { return g * sigmoid_f(g) * u; }

template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, long long n,
                           int vec) {
    constexpr int V = VecN<T>::N;
    blu_elementwise<V>(n, vec, [=](long long i) {
        float g[V], u[V];
        load_vec(gate + i, g);
        load_vec(up + i, u);
#pragma unroll
        for (int k = 0; k < V; ++k) g[k] = swiglu_f(g[k], u[k]);
        store_vec(y + i, g);
    }, [=](long long i) { y[i] = from_f<T>(swiglu_f(to_f(gate[i]), to_f(up[i]))); });
}

template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ dy, const T* __restrict__ gate, const T* __restrict__ up,
                           T* __restrict__ dgate, T* __restrict__ dup, long long n, int vec) {
    constexpr int V = VecN<T>::N;
    blu_elementwise<V>(n, vec, [=](long long i) {
        float g[V], u[V], d[V], dg[V], du[V];
        load_vec(gate + i, g);
        load_vec(up + i, u);
        load_vec(dy + i, d);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float s = sigmoid_f(g[k]);
            dg[k] = d[k] * u[k] * s * (1.f + g[k] * (1.f - s));
            du[k] = d[k] * g[k] * s;
        }
        if (dgate) store_vec(dgate + i, dg);
        if (dup) store_vec(dup + i, du);
    }, [=](long long i) {
        const float g = to_f(gate[i]), u = to_f(up[i]), d = to_f(dy[i]);
        const float s = sigmoid_f(g);
        if (dgate) dgate[i] = from_f<T>(d * u * s * (1.f + g * (1.f - s)));
        if (dup) dup[i] = from_f<T>(d * g * s);
    });
}

#define SWIGLU_ENTRIES(SUF, TY)                                                                                    \
extern "C" __global__ void blu_swiglu_forward_##SUF(const TY* gate, const TY* up, TY* y, long long n, int vec) { \
    swiglu_fwd<TY>(gate, up, y, n, vec);                                                                          \
}                                                                                                                  \
extern "C" __global__ void blu_swiglu_backward_##SUF(const TY* dy, const TY* gate, const TY* up, TY* dgate,      \
                                                      TY* dup, long long n, int vec) {                           \
    swiglu_bwd<TY>(dy, gate, up, dgate, dup, n, vec);                                                             \
}

SWIGLU_ENTRIES(f32, float)
SWIGLU_ENTRIES(bf16, bf16_t)
