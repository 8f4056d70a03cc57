// SwiGLU, y = silu(gate) * up, forward and backward for fp32 and bf16 storage; math in fp32.
// The backward recomputes sigmoid(gate) (only gate and up are saved):
//   dgate = dy * up * s * (1 + gate * (1 - s)),  dup = dy * gate * s,  s = sigmoid(gate).
// Grid-stride elementwise loops. Shared bf16 helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

__device__ __forceinline__ float sigmoid_f(float v) { return 1.f / (1.f + expf(-v)); }

template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, long long n) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nth) {
        const float g = to_f(gate[i]);
        y[i] = from_f<T>(g * sigmoid_f(g) * to_f(up[i]));
    }
}

template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ dy, const T* __restrict__ gate, const T* __restrict__ up,
                           T* __restrict__ dgate, T* __restrict__ dup, long long n) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nth) {
        const float g = to_f(gate[i]), u = to_f(up[i]), d = to_f(dy[i]);
        const float s = sigmoid_f(g);
        if (dgate) dgate[i] = from_f<T>(d * u * s * (1.f + g * (1.f - s)));
        if (dup) dup[i] = from_f<T>(d * g * s);
    }
}

#define SWIGLU_ENTRIES(SUF, TY)                                                                                    \
extern "C" __global__ void blu_swiglu_forward_##SUF(const TY* gate, const TY* up, TY* y, long long n) {         \
    swiglu_fwd<TY>(gate, up, y, n);                                                                               \
}                                                                                                                  \
extern "C" __global__ void blu_swiglu_backward_##SUF(const TY* dy, const TY* gate, const TY* up, TY* dgate,      \
                                                      TY* dup, long long n) {                                    \
    swiglu_bwd<TY>(dy, gate, up, dgate, dup, n);                                                                  \
}

SWIGLU_ENTRIES(f32, float)
SWIGLU_ENTRIES(bf16, bf16_t)
