// BluBLAS strict FP32 GEMM on the SIMT cores (no TF32): register tiling (8x8 outputs per thread as two 4x4
// quadrants), 4-byte cp.async multi-stage shared-memory pipeline (transposing K-major tiles on the way in so
// the inner loop reads float4 columns), any M/N/K and alignment, layouts NN/NT/TN, strided batch, split-K.
// C[z] = epi(alpha * op(A) @ op(B) + beta * C[z] + bias); op(A) is M x K, op(B) is K x N, all row-major.
#include "gemm_common.cuh"

template <int BM, int BN, int BK, int STAGES, bool TA, bool TB>
__device__ __forceinline__ void gemm_simt_body(BLU_GEMM_PARAMS) {
  constexpr int TX = BN / 8, TY = BM / 8, NT = TX * TY;
  constexpr int SLDA = BM + 4, SLDB = BN + 4;  // shared tiles are [BK][BM+4] and [BK][BN+4]
  constexpr int A_STAGE = BK * SLDA, B_STAGE = BK * SLDB;
  constexpr int A_PER = BM * BK / NT, B_PER = BN * BK / NT;
  static_assert(BM * BK % NT == 0 && BN * BK % NT == 0, "tile not divisible by thread count");
  extern __shared__ __align__(16) unsigned char blu_smem_raw[];
  float* shA = (float*)blu_smem_raw;
  float* shB = shA + STAGES * A_STAGE;

  const int tid = threadIdx.x;
  const int tx = tid % TX, ty = tid / TX;
  const BluTile tile = blu_tile_coords<BM, BN>();
  const int m0 = tile.m0, n0 = tile.n0;
  const BluKRange kr = blu_k_range(K, splits, k_chunk);
  const float* gA = (const float*)A + (i64)kr.batch * sA;
  const float* gB = (const float*)B + (i64)kr.batch * sB;
  const int klen = kr.k_end > kr.k_begin ? kr.k_end - kr.k_begin : 0;
  const int ktiles = (klen + BK - 1) / BK;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

  auto load_stage = [&](int stage, int kt) {
    const int k0 = kr.k_begin + kt * BK;
    float* a = shA + stage * A_STAGE;
    float* b = shB + stage * B_STAGE;
#pragma unroll
    for (int p = 0; p < A_PER; ++p) {
      const int i = tid + p * NT;
      int m, k;
      if (TA) {  // global (k, m), m contiguous
        m = i % BM;
        k = i / BM;
      } else {  // global (m, k), k contiguous
        k = i % BK;
        m = i / BK;
      }
      const int gm = m0 + m, gk = k0 + k;
      const bool ok = gm < M && gk < kr.k_end;
      const float* src = ok ? (TA ? gA + (i64)gk * lda + gm : gA + (i64)gm * lda + gk) : gA;
      blu_cp_async4(a + k * SLDA + m, src, ok ? 4 : 0);
    }
#pragma unroll
    for (int p = 0; p < B_PER; ++p) {
      const int i = tid + p * NT;
      int n, k;
      if (TB) {  // global (n, k), k contiguous
        k = i % BK;
        n = i / BK;
      } else {  // global (k, n), n contiguous
        n = i % BN;
        k = i / BN;
      }
      const int gn = n0 + n, gk = k0 + k;
      const bool ok = gn < N && gk < kr.k_end;
      const float* src = ok ? (TB ? gB + (i64)gn * ldb + gk : gB + (i64)gk * ldb + gn) : gB;
      blu_cp_async4(b + k * SLDB + n, src, ok ? 4 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    blu_cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    blu_cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nk = kt + STAGES - 1;
      if (nk < ktiles) load_stage(nk % STAGES, nk);
      blu_cp_async_commit();
    }
    const float* a = shA + (kt % STAGES) * A_STAGE;
    const float* b = shB + (kt % STAGES) * B_STAGE;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float ra[8], rb[8];
      const float4 a0 = *(const float4*)(a + k * SLDA + ty * 4);
      const float4 a1 = *(const float4*)(a + k * SLDA + BM / 2 + ty * 4);
      const float4 b0 = *(const float4*)(b + k * SLDB + tx * 4);
      const float4 b1 = *(const float4*)(b + k * SLDB + BN / 2 + tx * 4);
      ra[0] = a0.x; ra[1] = a0.y; ra[2] = a0.z; ra[3] = a0.w;
      ra[4] = a1.x; ra[5] = a1.y; ra[6] = a1.z; ra[7] = a1.w;
      rb[0] = b0.x; rb[1] = b0.y; rb[2] = b0.z; rb[3] = b0.w;
      rb[4] = b1.x; rb[5] = b1.y; rb[6] = b1.z; rb[7] = b1.w;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
    }
  }
  blu_cp_async_wait<0>();

  const BluEpi e = blu_make_epi(C, bias, P, ldc, ldp, sC, sP, alpha, beta, flags, M, N, blockIdx.z);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = m0 + (i < 4 ? ty * 4 + i : BM / 2 + ty * 4 + i - 4);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const int c = n0 + (j < 4 ? tx * 4 + j : BN / 2 + tx * 4 + j - 4);
      blu_epi_store2(e, r, c, acc[i][j], acc[i][j + 1]);
    }
  }
}

// One extern "C" entry point per (config, layout): blu_gemm_simt_<config>_<nn|nt|tn>.
#define BLU_SIMT_ONE(NAME, BM, BN, BK, ST, TA, TB, SUF)                                               \
  extern "C" __global__ void __launch_bounds__((BM / 8) * (BN / 8))                                   \
      blu_gemm_simt_##NAME##_##SUF(BLU_GEMM_PARAMS) {                                                 \
    gemm_simt_body<BM, BN, BK, ST, TA, TB>(BLU_GEMM_ARGS);                                           \
  }
#define BLU_SIMT_CONFIG(NAME, BM, BN, BK, ST)           \
  BLU_SIMT_ONE(NAME, BM, BN, BK, ST, false, false, nn) \
  BLU_SIMT_ONE(NAME, BM, BN, BK, ST, false, true, nt)  \
  BLU_SIMT_ONE(NAME, BM, BN, BK, ST, true, false, tn)

// Config names: <BM>x<BN>x<BK>_s<stages>; the list is mirrored in blublas/configs.py.
BLU_SIMT_CONFIG(128x128x8_s4, 128, 128, 8, 4)
BLU_SIMT_CONFIG(128x128x16_s3, 128, 128, 16, 3)
BLU_SIMT_CONFIG(128x64x8_s4, 128, 64, 8, 4)
BLU_SIMT_CONFIG(64x64x8_s4, 64, 64, 8, 4)
// sm_90 candidates (autotuner): 512-thread 128x256 tile, and a deeper pipeline
BLU_SIMT_CONFIG(128x256x8_s4, 128, 256, 8, 4)
BLU_SIMT_CONFIG(128x128x8_s6, 128, 128, 8, 6)
