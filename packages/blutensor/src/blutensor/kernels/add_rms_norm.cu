// Residual add fused with RMSNorm (the pre-norm of a Llama block), fp32 and bf16 storage (bf16 = raw uint16 bits),
// math in fp32. Each tensor has its own storage type, so autocast's mix runs without casts: the sublayer output x
// (bf16 from a bf16 GEMM), the residual stream r and its new value h (fp32), the normalised output y (bf16, the
// next GEMM's input) and the weight w (fp32 master). Entry suffix: <x>_<h>_<y>_<w> storage, e.g. bf16_f32_bf16_f32.
//
// Forward, one warp per row (grid-stride):  h = x + r  (rounded to h's storage; y is computed from that value, the
//   one backward reads), rstd = 1 / sqrt(mean(h^2) + eps), y = h * rstd * w (w may be null); rstd saved (fp32).
// Backward, one warp per row:  dsum = rstd * (gy*w - hhat * mean(gy*w*hhat)) + gh,  hhat = h * rstd, where gy is the
//   gradient of y and gh the gradient reaching h directly (either may be null: no such gradient). dsum is the
//   gradient of both x and r: written once in h's storage (dres) and, when x's storage differs, also in x's (dx).
// dw deterministically in two passes, no float atomics: *_dw_<y>_<h> sums its slice of rows per column into
//   part[slice][C] (fp32), *_reduce_<w> adds the slices in a fixed order.
// Shared bf16 helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

template <typename TX, typename TH, typename TY, typename TW>
__device__ void add_rms_forward(const TX* __restrict__ x, const TH* __restrict__ r, const TW* __restrict__ w,
                                TH* __restrict__ h, TY* __restrict__ y, float* __restrict__ rstd_out, long long N,
                                int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const TX* xr = x + row * C;
        const TH* rr = r + row * C;
        TH* hr = h + row * C;
        float ss = 0.f;
        for (int c = lane; c < C; c += 32) {
            const TH hv = from_f<TH>(to_f(xr[c]) + to_f(rr[c]));
            hr[c] = hv;
            const float v = to_f(hv);
            ss += v * v;
        }
        ss = warp_sum(ss);
        const float rs = rsqrtf(ss / (float)C + eps);
        if (lane == 0) rstd_out[row] = rs;
        TY* yr = y + row * C;
        for (int c = lane; c < C; c += 32) yr[c] = from_f<TY>(to_f(hr[c]) * rs * (w ? to_f(w[c]) : 1.f));
    }
}

template <typename TX, typename TH, typename TY, typename TW>
__device__ void add_rms_backward(const TY* __restrict__ gy, const TH* __restrict__ gh, const TH* __restrict__ h,
                                 const TW* __restrict__ w, const float* __restrict__ rstd, TH* __restrict__ dres,
                                 TX* __restrict__ dx, long long N, int C) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const TH* hr = h + row * C;
        const float rs = rstd[row];
        float m = 0.f;
        if (gy) {
            const TY* gr = gy + row * C;
            float dot = 0.f;
            for (int c = lane; c < C; c += 32) dot += to_f(gr[c]) * (w ? to_f(w[c]) : 1.f) * to_f(hr[c]) * rs;
            m = warp_sum(dot) / (float)C;
        }
        TH* dr = dres + row * C;
        for (int c = lane; c < C; c += 32) {
            float d = gh ? to_f(gh[row * C + c]) : 0.f;
            if (gy) d += rs * (to_f(gy[row * C + c]) * (w ? to_f(w[c]) : 1.f) - to_f(hr[c]) * rs * m);
            dr[c] = from_f<TH>(d);
            if (dx) dx[row * C + c] = from_f<TX>(d);
        }
    }
}

// part[s][c] = sum over rows r in slice s (rows s, s + S, ...) of gy[r][c] * h[r][c] * rstd[r];
// grid (ceil(C / blockDim.x), S): adjacent threads read adjacent columns (coalesced)
template <typename TY, typename TH>
__device__ void add_rms_backward_dw(const TY* __restrict__ gy, const TH* __restrict__ h,
                                    const float* __restrict__ rstd, float* __restrict__ part, long long N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y, S = gridDim.y;
    if (c >= C) return;
    float acc = 0.f;
    for (long long r = s; r < N; r += S) acc += to_f(gy[r * C + c]) * to_f(h[r * C + c]) * rstd[r];
    part[(long long)s * C + c] = acc;
}

template <typename TW>
__device__ void add_rms_backward_reduce(const float* __restrict__ part, TW* __restrict__ dw, int S, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc += part[(long long)s * C + c];
    dw[c] = from_f<TW>(acc);
}

#define ADD_RMS_ENTRIES(SUF, TX, TH, TY, TW)                                                                       \
extern "C" __global__ void blu_add_rms_norm_forward_##SUF(const TX* x, const TH* r, const TW* w, TH* h, TY* y,   \
                                                           float* rstd, long long N, int C, float eps) {         \
    add_rms_forward<TX, TH, TY, TW>(x, r, w, h, y, rstd, N, C, eps);                                              \
}                                                                                                                  \
extern "C" __global__ void blu_add_rms_norm_backward_##SUF(const TY* gy, const TH* gh, const TH* h, const TW* w, \
                                                            const float* rstd, TH* dres, TX* dx, long long N,    \
                                                            int C) {                                             \
    add_rms_backward<TX, TH, TY, TW>(gy, gh, h, w, rstd, dres, dx, N, C);                                         \
}

#define ADD_RMS_DW(SUF, TY, TH)                                                                                    \
extern "C" __global__ void blu_add_rms_norm_backward_dw_##SUF(const TY* gy, const TH* h, const float* rstd,      \
                                                               float* part, long long N, int C) {                \
    add_rms_backward_dw<TY, TH>(gy, h, rstd, part, N, C);                                                         \
}

#define ADD_RMS_REDUCE(SUF, TW)                                                                                    \
extern "C" __global__ void blu_add_rms_norm_backward_reduce_##SUF(const float* part, TW* dw, int S, int C) {    \
    add_rms_backward_reduce<TW>(part, dw, S, C);                                                                  \
}

#define ADD_RMS_W(SX, TX, SH, TH, SY, TY)                                                                          \
ADD_RMS_ENTRIES(SX##_##SH##_##SY##_f32, TX, TH, TY, float)                                                         \
ADD_RMS_ENTRIES(SX##_##SH##_##SY##_bf16, TX, TH, TY, bf16_t)

ADD_RMS_W(f32, float, f32, float, f32, float)
ADD_RMS_W(f32, float, f32, float, bf16, bf16_t)
ADD_RMS_W(bf16, bf16_t, f32, float, f32, float)
ADD_RMS_W(bf16, bf16_t, f32, float, bf16, bf16_t)
ADD_RMS_W(f32, float, bf16, bf16_t, f32, float)
ADD_RMS_W(f32, float, bf16, bf16_t, bf16, bf16_t)
ADD_RMS_W(bf16, bf16_t, bf16, bf16_t, f32, float)
ADD_RMS_W(bf16, bf16_t, bf16, bf16_t, bf16, bf16_t)

ADD_RMS_DW(f32_f32, float, float)
ADD_RMS_DW(f32_bf16, float, bf16_t)
ADD_RMS_DW(bf16_f32, bf16_t, float)
ADD_RMS_DW(bf16_bf16, bf16_t, bf16_t)

ADD_RMS_REDUCE(f32, float)
ADD_RMS_REDUCE(bf16, bf16_t)
