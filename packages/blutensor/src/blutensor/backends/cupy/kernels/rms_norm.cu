// RMSNorm forward and backward for fp32 and bf16 storage (bf16 = raw uint16 bits); math in fp32.
// y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row of C elements (w may be null).
// Forward: one warp per row (grid-stride over rows), the row's rstd saved (fp32) for backward.
// Backward: dx per row (one warp per row): dx = rstd * (g*w - xhat * mean(g*w*xhat)), xhat = x * rstd;
// dw deterministically in two passes, no float atomics: blu_rms_norm_backward_dw_* sums its slice of rows for each
// column into part[slice][C] (fp32), blu_rms_norm_backward_reduce_* adds the slices in a fixed order.
// The kernels are norm_rows.cuh's RMSNorm row templates without the residual add (rms_rows_*, shared with
// add_rms_norm.cu's fused add + RMSNorm; inlined by the loader, with bf16_vec.cuh's helpers).

#include "norm_rows.cuh"

#define RMS_ENTRIES(SUF, TY)                                                                                     \
extern "C" __global__ void blu_rms_norm_forward_##SUF(const TY* x, const TY* w, TY* y, float* rstd, long long N, \
                                                       int C, float eps) {                                       \
    rms_rows_forward<TY, TY, TY, TY, false>(x, nullptr, w, nullptr, y, rstd, N, C, eps);                         \
}                                                                                                                \
extern "C" __global__ void blu_rms_norm_backward_##SUF(const TY* g, const TY* x, const TY* w, const float* rstd, \
                                                        TY* dx, long long N, int C) {                            \
    rms_rows_backward<TY, TY, TY, TY, false>(g, nullptr, x, w, rstd, dx, nullptr, N, C);                         \
}                                                                                                                \
extern "C" __global__ void blu_rms_norm_backward_dw_##SUF(const TY* g, const TY* x, const float* rstd,           \
                                                           float* part, long long N, int C) {                    \
    rms_rows_backward_dw<TY, TY>(g, x, rstd, part, N, C);                                                        \
}                                                                                                                \
extern "C" __global__ void blu_rms_norm_backward_reduce_##SUF(const float* part, TY* dw, int S, int C) {         \
    rms_rows_backward_reduce<TY>(part, dw, S, C);                                                                \
}

RMS_ENTRIES(f32, float)
RMS_ENTRIES(bf16, bf16_t)

// dw (a float32 gradient buffer, for f32 and bf16 RMSNorm alike: the partials are float32) += the slices' sum
extern "C" __global__ void blu_rms_norm_backward_reduce_acc(const float* part, float* dw, int S, int C) {
    rms_rows_backward_reduce<float, true>(part, dw, S, C);
}
