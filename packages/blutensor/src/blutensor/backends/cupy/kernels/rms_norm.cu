// RMSNorm forward and backward for fp32 and bf16 storage (bf16 = raw uint16 bits); math in fp32.
// y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row of C elements (w may be null).
// Forward: one warp per row (grid-stride over rows), the row's rstd saved (fp32) for backward.
// Backward: dx per row (one warp per row): dx = rstd * (g*w - xhat * mean(g*w*xhat)), xhat = x * rstd;
// dw deterministically in two passes, no float atomics: blu_rms_norm_backward_dw_* sums its slice of rows for each
// column into part[slice][C] (fp32), blu_rms_norm_backward_reduce_* adds the slices in a fixed order.
// Shared bf16 helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

template <typename T>
__device__ void rms_forward(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                            float* __restrict__ rstd_out, long long N, int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const T* xr = x + row * C;
        float ss = 0.f;
        for (int c = lane; c < C; c += 32) { const float v = to_f(xr[c]); ss += v * v; }
        ss = warp_sum(ss);
        const float rs = rsqrtf(ss / (float)C + eps);
        if (lane == 0) rstd_out[row] = rs;
        T* yr = y + row * C;
        for (int c = lane; c < C; c += 32) yr[c] = from_f<T>(to_f(xr[c]) * rs * (w ? to_f(w[c]) : 1.f));
    }
}

template <typename T>
__device__ void rms_backward_dx(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                                const float* __restrict__ rstd, T* __restrict__ dx, long long N, int C) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const T* gr = g + row * C;
        const T* xr = x + row * C;
        const float rs = rstd[row];
        float dot = 0.f;
        for (int c = lane; c < C; c += 32) dot += to_f(gr[c]) * (w ? to_f(w[c]) : 1.f) * to_f(xr[c]) * rs;
        const float m = warp_sum(dot) / (float)C;
        T* dr = dx + row * C;
        for (int c = lane; c < C; c += 32) {
            const float gw = to_f(gr[c]) * (w ? to_f(w[c]) : 1.f);
            dr[c] = from_f<T>(rs * (gw - to_f(xr[c]) * rs * m));
        }
    }
}

// part[s][c] = sum over rows r in slice s (rows s, s + S, s + 2S, ...) of g[r][c] * x[r][c] * rstd[r];
// grid (ceil(C / blockDim.x), S): adjacent threads read adjacent columns (coalesced)
template <typename T>
__device__ void rms_backward_dw(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ rstd,
                                float* __restrict__ part, long long N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y, S = gridDim.y;
    if (c >= C) return;
    float acc = 0.f;
    for (long long r = s; r < N; r += S) acc += to_f(g[r * C + c]) * to_f(x[r * C + c]) * rstd[r];
    part[(long long)s * C + c] = acc;
}

template <typename T>
__device__ void rms_backward_reduce(const float* __restrict__ part, T* __restrict__ dw, int S, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc += part[(long long)s * C + c];
    dw[c] = from_f<T>(acc);
}

#define RMS_ENTRIES(SUF, TY)                                                                                       \
extern "C" __global__ void blu_rms_norm_forward_##SUF(const TY* x, const TY* w, TY* y, float* rstd, long long N, \
                                                       int C, float eps) {                                       \
    rms_forward<TY>(x, w, y, rstd, N, C, eps);                                                                    \
}                                                                                                                  \
extern "C" __global__ void blu_rms_norm_backward_##SUF(const TY* g, const TY* x, const TY* w, const float* rstd, \
                                                        TY* dx, long long N, int C) {                            \
    rms_backward_dx<TY>(g, x, w, rstd, dx, N, C);                                                                 \
}                                                                                                                  \
extern "C" __global__ void blu_rms_norm_backward_dw_##SUF(const TY* g, const TY* x, const float* rstd,           \
                                                           float* part, long long N, int C) {                    \
    rms_backward_dw<TY>(g, x, rstd, part, N, C);                                                                  \
}                                                                                                                  \
extern "C" __global__ void blu_rms_norm_backward_reduce_##SUF(const float* part, TY* dw, int S, int C) {        \
    rms_backward_reduce<TY>(part, dw, S, C);                                                                      \
}

RMS_ENTRIES(f32, float)
RMS_ENTRIES(bf16, bf16_t)
