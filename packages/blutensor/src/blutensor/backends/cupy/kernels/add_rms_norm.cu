// Residual add fused with the pre-norm of a block: RMSNorm (Llama) and LayerNorm (GPT-2, entries blu_add_layer_norm_*,
// at the end of this file), fp32 and bf16 storage (bf16 = raw uint16 bits), math in fp32. Each tensor has its own storage type, so autocast's mix runs without casts: the sublayer output x
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
// The row templates (rms_rows_*, norm_rows_*) are norm_rows.cuh's, shared with the plain norms (rms_norm.cu,
// layer_norm.cu); bf16 helpers from bf16_vec.cuh (both inlined by the loader).

#include "norm_rows.cuh"

#define ADD_RMS_ENTRIES(SUF, TX, TH, TY, TW)                                                                       \
extern "C" __global__ void blu_add_rms_norm_forward_##SUF(const TX* x, const TH* r, const TW* w, TH* h, TY* y,     \
                                                           float* rstd, long long N, int C, float eps) {           \
    rms_rows_forward<TX, TH, TY, TW, true>(x, r, w, h, y, rstd, N, C, eps);                                        \
}                                                                                                                  \
extern "C" __global__ void blu_add_rms_norm_backward_##SUF(const TY* gy, const TH* gh, const TH* h, const TW* w,   \
                                                            const float* rstd, TH* dres, TX* dx, long long N,      \
                                                            int C) {                                               \
    rms_rows_backward<TX, TH, TY, TW, true>(gy, gh, h, w, rstd, dres, dx, N, C);                                   \
}

#define ADD_RMS_DW(SUF, TY, TH)                                                                                    \
extern "C" __global__ void blu_add_rms_norm_backward_dw_##SUF(const TY* gy, const TH* h, const float* rstd,        \
                                                               float* part, long long N, int C) {                  \
    rms_rows_backward_dw<TY, TH>(gy, h, rstd, part, N, C);                                                         \
}

#define ADD_RMS_REDUCE(SUF, TW)                                                                                    \
extern "C" __global__ void blu_add_rms_norm_backward_reduce_##SUF(const float* part, TW* dw, int S, int C) {       \
    rms_rows_backward_reduce<TW>(part, dw, S, C);                                                                  \
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

// dw (a float32 gradient buffer, whatever w's storage: the partials are float32) += the slices' sum
extern "C" __global__ void blu_add_rms_norm_backward_reduce_acc(const float* part, float* dw, int S, int C) {
    rms_rows_backward_reduce<float, true>(part, dw, S, C);
}

// ---------------------------------------------------------------------------------------------------------
// Register-resident rows, one template for both norms (LN = true: LayerNorm, GPT-2's ln_1 / ln_2 / ln_f after a
// residual add; LN = false: RMSNorm, the same without the mean and the bias: entries blu_add_rms_norm_*_r<NV>_* /
// *_s<NV>_*, used for the rows they fit, the warp-per-row kernels above for the others). Storage per tensor:
// x (the sublayer output), r and h (the residual stream), y (the normalised output, the next GEMM's input),
// w and b (weight and bias, one storage). Entry suffix: <x>_<h>_<y>_<w>, e.g. bf16_f32_bf16_f32 (autocast).
// Rows live in registers (lane l holds vectors l, l+32, ... of V = 16 / sizeof(h) elements, NV vectors a lane),
// with the arithmetic of kernels/layer_norm.cu's register-resident entries on the same vectors (exact two-pass
// mean / variance, the same expressions), so float32 results are bitwise those of add + layer_norm and bf16
// ones those of add + layer_norm + cast. Backward: dsum = rstd * (gy*w - mean(gy*w) - hhat * mean(gy*w*hhat))
// + gh, written in h's storage (dres) and, when x's differs, in x's (dx); dweight / dbias partials per block
// (each warp's sums in its own shared slice, added in warp order) in layer_norm.cu's layout, reduced by its
// blu_layer_norm_backward_reduce_* kernels (deterministic, no float atomics).

#define ADD_NORM_ENTRIES(KIND, LN, SUF, NV, TX, TH, TY, TW)                                                        \
extern "C" __global__ void __launch_bounds__(256) blu_add_##KIND##_norm_forward_r##NV##_##SUF(const TX* x,         \
        const TH* r, const TW* w, const TW* b, TH* h, TY* y, float* mean, float* rstd, long long N, int C,         \
        float eps) {                                                                                               \
    norm_rows_forward<TX, TH, TY, TW, NV, LN, NORM_RES_ADD>(x, r, w, b, h, y, mean, rstd, N, C, eps);              \
}                                                                                                                  \
extern "C" __global__ void __launch_bounds__(256) blu_add_##KIND##_norm_backward_s##NV##_##SUF(const TY* gy,       \
        const TH* gh, const TH* h, const TW* w, const float* mean, const float* rstd, TH* dres, TX* dx,            \
        float* part, long long N, int C, int need_dwdb) {                                                          \
    norm_rows_backward<TX, TH, TY, TW, NV, LN, true, true>(gy, gh, h, w, mean, rstd, dres, dx, part, N, C, 1,      \
        need_dwdb);                                                                                                \
}
#define ADD_LN_ENTRIES(SUF, NV, TX, TH, TY, TW)                                                                    \
ADD_NORM_ENTRIES(layer, true, SUF, NV, TX, TH, TY, TW) ADD_NORM_ENTRIES(rms, false, SUF, NV, TX, TH, TY, TW)

// the storage mixes: fp32 throughout, bf16 throughout, and autocast's (bf16 sublayer output, fp32 residual
// stream and weights, bf16 normalised output); NV as layer_norm.cu's (fp32 h: C <= 1024, bf16 h: C <= 1024)
#define ADD_LN_F32H(NV)                                                                                            \
ADD_LN_ENTRIES(f32_f32_f32_f32, NV, float, float, float, float)                                                    \
ADD_LN_ENTRIES(bf16_f32_bf16_f32, NV, bf16_t, float, bf16_t, float)                                                \
ADD_LN_ENTRIES(f32_f32_bf16_f32, NV, float, float, bf16_t, float)
#define ADD_LN_BF16H(NV) ADD_LN_ENTRIES(bf16_bf16_bf16_bf16, NV, bf16_t, bf16_t, bf16_t, bf16_t)

ADD_LN_F32H(1) ADD_LN_F32H(2) ADD_LN_F32H(3) ADD_LN_F32H(4) ADD_LN_F32H(6) ADD_LN_F32H(8)
ADD_LN_BF16H(1) ADD_LN_BF16H(2) ADD_LN_BF16H(3) ADD_LN_BF16H(4)
