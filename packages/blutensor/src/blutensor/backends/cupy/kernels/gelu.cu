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

// exp for the tanh form: accurate expf for fp32 storage (the result is checked against float64 at ~1e-7), the
// fast __expf for bf16 storage (its error is far below a bf16 ulp)
template <typename T> __device__ __forceinline__ float gexp(float x);
template <> __device__ __forceinline__ float gexp<float>(float x) { return expf(x); }
template <> __device__ __forceinline__ float gexp<bf16_t>(float x) { return __expf(x); }

// s = (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u)) and sech^2(u) = 4 s (1 - s), from one exponential E = exp(-2|u|)
// (never overflows) and r = 1 / (1 + E) in [1/2, 1]: s = r (u >= 0) or E r (u < 0), so neither s nor 1 - s
// comes from a cancellation (0.5 * (1 + tanh u) loses ~20x precision at x = -2); pointwise relative error ~2e-7
// in fp32, several times cheaper than tanhf
template <typename T>
__device__ __forceinline__ void half1p_tanh(float u, float& s, float& s2) {
    const float e = gexp<T>(-2.f * fabsf(u));
    const float r = __fdividef(1.f, 1.f + e);
    s = u >= 0.f ? r : e * r;
    s2 = 4.f * e * r * r;
}

template <typename T>
__device__ __forceinline__ float gelu_f(float x, int approx) {
    if (approx) {
        float s, s2;
        half1p_tanh<T>(BLU_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x), s, s2);
        return x * s;
    }
    return 0.5f * x * (1.f + erff(x * BLU_INV_SQRT_2));
}

template <typename T>
__device__ __forceinline__ float gelu_grad_f(float x, int approx) {
    if (approx) {
        float s, s2;
        half1p_tanh<T>(BLU_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x), s, s2);
        return s + 0.5f * x * s2 * BLU_SQRT_2_OVER_PI * (1.f + 3.f * 0.044715f * x * x);
    }
    return 0.5f * (1.f + erff(x * BLU_INV_SQRT_2)) + x * gexp<T>(-0.5f * x * x) * BLU_INV_SQRT_2PI;
}

// vectors per thread per grid-stride step: all U loads are issued before any math, so each thread keeps
// U x 16 bytes (x2 in backward) in flight; the grid is sized to the SMs by the launcher
#define GELU_U 4

// CS: streaming cache hints (ld.global.cs / st.global.cs: evict-first, the data is touched once) or plain accesses
template <typename T, bool CS>
__device__ __forceinline__ uint4 ld16(const uint4* p) { return CS ? __ldcs(p) : *p; }
template <bool CS>
__device__ __forceinline__ void st16(uint4* p, uint4 v) { if (CS) __stcs(p, v); else *p = v; }

template <typename T, bool CS>
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
                if (i < nv) u[j] = ld16<T, CS>(x4 + i);
            }
#pragma unroll
            for (int j = 0; j < GELU_U; ++j) {
                const long long i = i0 + j * nth;
                if (i < nv) {
                    float v[V];
                    unpack(u[j], v, T());
#pragma unroll
                    for (int k = 0; k < V; ++k) v[k] = gelu_f<T>(v[k], approx);
                    st16<CS>(y4 + i, pack(v, T()));
                }
            }
        }
        done = nv * V;
    }
    for (long long i = done + tid; i < n; i += nth) y[i] = from_f<T>(gelu_f<T>(to_f(x[i]), approx));
}

template <typename T, bool CS>
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
                if (i < nv) { ug[j] = ld16<T, CS>(g4 + i); ux[j] = ld16<T, CS>(x4 + i); }
            }
#pragma unroll
            for (int j = 0; j < GELU_U; ++j) {
                const long long i = i0 + j * nth;
                if (i < nv) {
                    float gv[V], xv[V];
                    unpack(ug[j], gv, T());
                    unpack(ux[j], xv, T());
#pragma unroll
                    for (int k = 0; k < V; ++k) gv[k] *= gelu_grad_f<T>(xv[k], approx);
                    st16<CS>(d4 + i, pack(gv, T()));
                }
            }
        }
        done = nv * V;
    }
    for (long long i = done + tid; i < n; i += nth) dx[i] = from_f<T>(to_f(g[i]) * gelu_grad_f<T>(to_f(x[i]), approx));
}

#define GELU_ENTRIES(SUF, TY, VAR, CS)                                                                       \
extern "C" __global__ void blu_gelu_forward##VAR##SUF(const TY* x, TY* y, long long n, int approx, int vec) {   \
    gelu_forward<TY, CS>(x, y, n, approx, vec);                                                               \
}                                                                                                            \
extern "C" __global__ void blu_gelu_backward##VAR##SUF(const TY* g, const TY* x, TY* dx, long long n,           \
                                                       int approx, int vec) {                                \
    gelu_backward<TY, CS>(g, x, dx, n, approx, vec);                                                          \
}

// blu_gelu_{forward,backward}_{f32,bf16}: streaming hints; *_plain_*: plain loads/stores
GELU_ENTRIES(f32, float, _, true)
GELU_ENTRIES(bf16, bf16_t, _, true)
GELU_ENTRIES(f32, float, _plain_, false)
GELU_ENTRIES(bf16, bf16_t, _plain_, false)
