// GELU forward and backward (the backward recomputes from x: no saved activation besides the input),
// fp32 and bf16 storage (bf16 = raw uint16 bits), fp32 math. approximate: 0 = 'none' (erf), 1 = 'tanh'.
// 128-bit vector loads/stores (GELU_U in flight per thread) on a grid-stride loop over a grid sized to the SMs
// when the pointers are 16-byte aligned (vec != 0);
// the scalar path covers the tail and unaligned views.
// Shared bf16/vector helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

#define BLU_SQRT_2_OVER_PI 0.7978845608028654f
#define BLU_INV_SQRT_2 0.7071067811865476f
#define BLU_INV_SQRT_2PI 0.3989422804014327f

// tanh(u) and sech^2(u) = 1 - tanh^2(u) from one fast exponential of -2|u| (never overflows, no cancellation in
// sech^2): max error vs float64 ~4e-8 (forward) and ~2e-7 (backward) relative to the largest value, about
// 4x cheaper than tanhf, which made the bf16 kernels compute-bound
__device__ __forceinline__ void tanh_sech2(float u, float& t, float& s2) {
    const float e = __expf(-2.f * fabsf(u));
    const float r = __fdividef(1.f, 1.f + e);
    t = copysignf((1.f - e) * r, u);
    s2 = 4.f * e * r * r;
}

__device__ __forceinline__ float gelu_f(float x, int approx) {
    if (approx) {
        float t, s2;
        tanh_sech2(BLU_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x), t, s2);
        return 0.5f * x * (1.f + t);
    }
    return 0.5f * x * (1.f + erff(x * BLU_INV_SQRT_2));
}

__device__ __forceinline__ float gelu_grad_f(float x, int approx) {
    if (approx) {
        float t, s2;
        tanh_sech2(BLU_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x), t, s2);
        return 0.5f * (1.f + t) + 0.5f * x * s2 * BLU_SQRT_2_OVER_PI * (1.f + 3.f * 0.044715f * x * x);
    }
    return 0.5f * (1.f + erff(x * BLU_INV_SQRT_2)) + x * __expf(-0.5f * x * x) * BLU_INV_SQRT_2PI;
}

// vectors per thread per grid-stride step: all U loads are issued before any math, so each thread keeps
// U x 16 bytes (x2 in backward) in flight; the grid is sized to the SMs by the launcher
#define GELU_U 4

template <typename T>
__device__ void gelu_forward(const T* __restrict__ x, T* __restrict__ y, long long n, int approx, int vec) {
    constexpr int V = VecN<T>::N;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long nv = n / V;
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        uint4* y4 = reinterpret_cast<uint4*>(y);
        for (long long i0 = tid; i0 < nv; i0 += GELU_U * nth) {
            uint4 u[GELU_U];
#pragma unroll
            for (int j = 0; j < GELU_U; ++j) {
                const long long i = i0 + j * nth;
                if (i < nv) u[j] = __ldcs(x4 + i);  // streamed once: evict-first
            }
#pragma unroll
            for (int j = 0; j < GELU_U; ++j) {
                const long long i = i0 + j * nth;
                if (i < nv) {
                    float v[V];
                    unpack(u[j], v, T());
#pragma unroll
                    for (int k = 0; k < V; ++k) v[k] = gelu_f(v[k], approx);
                    __stcs(y4 + i, pack(v, T()));
                }
            }
        }
        done = nv * V;
    }
    for (long long i = done + tid; i < n; i += nth) y[i] = from_f<T>(gelu_f(to_f(x[i]), approx));
}

template <typename T>
__device__ void gelu_backward(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ dx, long long n,
                              int approx, int vec) {
    constexpr int V = VecN<T>::N;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long nv = n / V;
        const uint4* g4 = reinterpret_cast<const uint4*>(g);
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        uint4* d4 = reinterpret_cast<uint4*>(dx);
        for (long long i0 = tid; i0 < nv; i0 += GELU_U * nth) {
            uint4 ug[GELU_U], ux[GELU_U];
#pragma unroll
            for (int j = 0; j < GELU_U; ++j) {
                const long long i = i0 + j * nth;
                if (i < nv) { ug[j] = __ldcs(g4 + i); ux[j] = __ldcs(x4 + i); }
            }
#pragma unroll
            for (int j = 0; j < GELU_U; ++j) {
                const long long i = i0 + j * nth;
                if (i < nv) {
                    float gv[V], xv[V];
                    unpack(ug[j], gv, T());
                    unpack(ux[j], xv, T());
#pragma unroll
                    for (int k = 0; k < V; ++k) gv[k] *= gelu_grad_f(xv[k], approx);
                    __stcs(d4 + i, pack(gv, T()));
                }
            }
        }
        done = nv * V;
    }
    for (long long i = done + tid; i < n; i += nth) dx[i] = from_f<T>(to_f(g[i]) * gelu_grad_f(to_f(x[i]), approx));
}

extern "C" __global__ void blu_gelu_forward_f32(const float* x, float* y, long long n, int approx, int vec) {
    gelu_forward<float>(x, y, n, approx, vec);
}
extern "C" __global__ void blu_gelu_forward_bf16(const bf16_t* x, bf16_t* y, long long n, int approx, int vec) {
    gelu_forward<bf16_t>(x, y, n, approx, vec);
}
extern "C" __global__ void blu_gelu_backward_f32(const float* g, const float* x, float* dx, long long n, int approx,
                                                 int vec) {
    gelu_backward<float>(g, x, dx, n, approx, vec);
}
extern "C" __global__ void blu_gelu_backward_bf16(const bf16_t* g, const bf16_t* x, bf16_t* dx, long long n,
                                                  int approx, int vec) {
    gelu_backward<bf16_t>(g, x, dx, n, approx, vec);
}
