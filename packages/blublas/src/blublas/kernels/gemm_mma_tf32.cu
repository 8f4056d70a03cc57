// BluBLAS TF32 GEMM on the matrix units: mma.sync m16n8k8 (tf32 in, fp32 accumulate), cp.async multi-stage
// shared-memory pipeline, any M/N/K, layouts NN/NT/TN/TT, strided batch and split-K, fused epilogue.
// C[z] = epi(alpha * op(A) @ op(B) + beta * C[z] + bias); op(A) is M x K, op(B) is K x N, all row-major.
#include "gemm_common.cuh"

__device__ __forceinline__ unsigned blu_to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void blu_mma_tf32(float* d, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// TA: A stored K x M (op(A) = A^T); TB: B stored N x K (op(B) = B^T).
// Shared tiles keep the global layout; rows whose contiguous dim is k get +4 floats padding, rows whose
// contiguous dim is m/n get +8 floats, which makes every fragment load below bank-conflict free.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, bool TA, bool TB>
__device__ __forceinline__ void gemm_tf32_body(BLU_GEMM_PARAMS) {
  constexpr int NT = WARPS_M * WARPS_N * 32;
  constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
  constexpr int MI = WTM / 16, NI = WTN / 8;
  constexpr int SLDA = TA ? BM + 8 : BK + 4;
  constexpr int SLDB = TB ? BK + 4 : BN + 8;
  constexpr int A_STAGE = TA ? BK * SLDA : BM * SLDA;
  constexpr int B_STAGE = TB ? BN * SLDB : BK * SLDB;
  extern __shared__ __align__(16) unsigned char blu_smem_raw[];
  float* shA = (float*)blu_smem_raw;
  float* shB = shA + STAGES * A_STAGE;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp / WARPS_N) * WTM, wn = (warp % WARPS_N) * WTN;
  const int g = lane >> 2, t = lane & 3;
  const BluTile tile = blu_tile_coords<BM, BN>();
  const int m0 = tile.m0, n0 = tile.n0;
  const BluKRange kr = blu_k_range(K, splits, k_chunk);
  const float* gA = (const float*)A + (i64)kr.batch * sA;
  const float* gB = (const float*)B + (i64)kr.batch * sB;
  const int klen = kr.k_end > kr.k_begin ? kr.k_end - kr.k_begin : 0;
  const int ktiles = (klen + BK - 1) / BK;
  const bool vec = (flags & BLU_F_VEC) != 0;

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  auto load_stage = [&](int stage, int kt) {
    const int k0 = kr.k_begin + kt * BK;
    float* a = shA + stage * A_STAGE;
    float* b = shB + stage * B_STAGE;
    if (TA)
      blu_load_tile<float, BK, BM, SLDA, NT>(a, gA, lda, k0, m0, kr.k_end, M, tid, vec);
    else
      blu_load_tile<float, BM, BK, SLDA, NT>(a, gA, lda, m0, k0, M, kr.k_end, tid, vec);
    if (TB)
      blu_load_tile<float, BN, BK, SLDB, NT>(b, gB, ldb, n0, k0, N, kr.k_end, tid, vec);
    else
      blu_load_tile<float, BK, BN, SLDB, NT>(b, gB, ldb, k0, n0, kr.k_end, N, tid, vec);
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
    for (int kk = 0; kk < BK; kk += 8) {
      unsigned af[MI][4], bfr[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int m = wm + i * 16 + g;
        if (TA) {
          af[i][0] = blu_to_tf32(a[(kk + t) * SLDA + m]);
          af[i][1] = blu_to_tf32(a[(kk + t) * SLDA + m + 8]);
          af[i][2] = blu_to_tf32(a[(kk + t + 4) * SLDA + m]);
          af[i][3] = blu_to_tf32(a[(kk + t + 4) * SLDA + m + 8]);
        } else {
          af[i][0] = blu_to_tf32(a[m * SLDA + kk + t]);
          af[i][1] = blu_to_tf32(a[(m + 8) * SLDA + kk + t]);
          af[i][2] = blu_to_tf32(a[m * SLDA + kk + t + 4]);
          af[i][3] = blu_to_tf32(a[(m + 8) * SLDA + kk + t + 4]);
        }
      }
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const int n = wn + j * 8 + g;
        if (TB) {
          bfr[j][0] = blu_to_tf32(b[n * SLDB + kk + t]);
          bfr[j][1] = blu_to_tf32(b[n * SLDB + kk + t + 4]);
        } else {
          bfr[j][0] = blu_to_tf32(b[(kk + t) * SLDB + n]);
          bfr[j][1] = blu_to_tf32(b[(kk + t + 4) * SLDB + n]);
        }
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) blu_mma_tf32(acc[i][j], af[i], bfr[j]);
    }
  }
  blu_cp_async_wait<0>();

  const BluEpi e = blu_make_epi(C, bias, P, ldc, ldp, sC, sP, alpha, beta, flags, M, N, blockIdx.z);
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j) {
      const int r = m0 + wm + i * 16 + g, c = n0 + wn + j * 8 + 2 * t;
      blu_epi_store2(e, r, c, acc[i][j][0], acc[i][j][1]);
      blu_epi_store2(e, r + 8, c, acc[i][j][2], acc[i][j][3]);
    }
}

// One extern "C" entry point per (config, layout): blu_gemm_tf32_<config>_<nn|nt|tn>.
#define BLU_TF32_ONE(NAME, BM, BN, BK, WM_, WN_, ST, TA, TB, SUF)                                        \
  extern "C" __global__ void __launch_bounds__(WM_ * WN_ * 32)                                           \
      blu_gemm_tf32_##NAME##_##SUF(BLU_GEMM_PARAMS) {                                                    \
    gemm_tf32_body<BM, BN, BK, WM_, WN_, ST, TA, TB>(BLU_GEMM_ARGS);                                    \
  }
#define BLU_TF32_CONFIG(NAME, BM, BN, BK, WM_, WN_, ST)           \
  BLU_TF32_ONE(NAME, BM, BN, BK, WM_, WN_, ST, false, false, nn) \
  BLU_TF32_ONE(NAME, BM, BN, BK, WM_, WN_, ST, false, true, nt)  \
  BLU_TF32_ONE(NAME, BM, BN, BK, WM_, WN_, ST, true, false, tn)

// Config names: <BM>x<BN>x<BK>_w<warps m>x<warps n>_s<stages>; the list is mirrored in blublas/configs.py.
BLU_TF32_CONFIG(128x128x32_w2x2_s3, 128, 128, 32, 2, 2, 3)
BLU_TF32_CONFIG(128x128x16_w2x4_s4, 128, 128, 16, 2, 4, 4)
BLU_TF32_CONFIG(128x64x32_w2x2_s3, 128, 64, 32, 2, 2, 3)
BLU_TF32_CONFIG(64x64x32_w2x2_s4, 64, 64, 32, 2, 2, 4)
// sm_90 candidates (autotuner): 8 warps of 64x64 warp tiles for 16384-row GEMMs (228 KB of smem)
BLU_TF32_CONFIG(128x256x32_w2x4_s3, 128, 256, 32, 2, 4, 3)
