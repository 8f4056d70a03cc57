// BluBLAS stand-alone epilogues: the split-K reduction (sums fp32 partial products, then applies the fused
// epilogue) and an in-place epilogue for vendor GEMM results whose epilogue could not be fused.
#include "gemm_common.cuh"

// W holds splits x batch fp32 partial products, laid out [batch][split][M][N] (row stride N).
// C[b] = epi(alpha * sum_s W[b][s] + beta * C[b] + bias).
extern "C" __global__ void blu_gemm_splitk_reduce(const float* __restrict__ W, void* C, const void* bias,
                                                  void* P, int M, int N, int batch, int splits, i64 ldc,
                                                  i64 ldp, i64 sC, i64 sP, float alpha, float beta,
                                                  int flags) {
  const i64 mn = (i64)M * N;
  const i64 total = mn * batch;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const int b = (int)(idx / mn);
    const i64 rc = idx - (i64)b * mn;
    const int r = (int)(rc / N), c = (int)(rc - (i64)r * N);
    const float* w = W + (i64)b * splits * mn + rc;
    float s = 0.f;
    for (int k = 0; k < splits; ++k) s += w[(i64)k * mn];
    const BluEpi e = blu_make_epi(C, bias, P, ldc, ldp, sC, sP, alpha, beta, flags, M, N, b);
    blu_epi_store(e, r, c, s);
  }
}

// The same with 4 consecutive columns per thread (N % 4 == 0, W 16-byte aligned: float4 loads of the partials)
// and no 64-bit division per element: blockIdx.y walks the batch x M rows, x the column quads of a row.
extern "C" __global__ void blu_gemm_splitk_reduce_v4(const float* __restrict__ W, void* C, const void* bias,
                                                     void* P, int M, int N, int batch, int splits, i64 ldc,
                                                     i64 ldp, i64 sC, i64 sP, float alpha, float beta,
                                                     int flags) {
  const i64 mn = (i64)M * N;
  const int c4 = blockIdx.x * blockDim.x + threadIdx.x, n4 = N >> 2;
  if (c4 >= n4) return;
  for (int rb = blockIdx.y; rb < batch * M; rb += gridDim.y) {
    const int b = rb / M, r = rb - b * M;
    const float* w = W + (i64)b * splits * mn + (i64)r * N + 4 * c4;
    float4 s = *(const float4*)w;
    for (int k = 1; k < splits; ++k) {
      const float4 t = *(const float4*)(w + (i64)k * mn);
      s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
    }
    const BluEpi e = blu_make_epi(C, bias, P, ldc, ldp, sC, sP, alpha, beta, flags, M, N, b);
    blu_epi_store2(e, r, 4 * c4, s.x, s.y);
    blu_epi_store2(e, r, 4 * c4 + 2, s.z, s.w);
  }
}

// In place on C (already alpha*AB + beta*C_old): C = epi(C) with alpha=1, beta=0 semantics, i.e. bias and
// gelu (saving the pre-activation into P when asked). Used by the cuBLAS provider's fallback path.
extern "C" __global__ void blu_gemm_epilogue_apply(void* C, const void* bias, void* P, int M, int N,
                                                   int batch, i64 ldc, i64 ldp, i64 sC, i64 sP, int flags) {
  const i64 mn = (i64)M * N;
  const i64 total = mn * batch;
  const bool obf = (flags & BLU_F_OUT_BF16) != 0;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const int b = (int)(idx / mn);
    const i64 rc = idx - (i64)b * mn;
    const int r = (int)(rc / N), c = (int)(rc - (i64)r * N);
    const BluEpi e = blu_make_epi(C, bias, P, ldc, ldp, sC, sP, 1.0f, 0.0f, flags & ~BLU_F_BETA, M, N, b);
    const i64 off = (i64)r * ldc + c;
    const float v = obf ? blu_bf16_to_f32(((const bf16_t*)e.C)[off]) : ((const float*)e.C)[off];
    blu_epi_store(e, r, c, v);
  }
}
