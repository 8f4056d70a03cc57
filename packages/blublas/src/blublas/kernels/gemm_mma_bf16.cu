// BluBLAS BF16 GEMM on the matrix units: mma.sync m16n8k16 (bf16 in, fp32 accumulate), ldmatrix fragment
// loads, cp.async multi-stage shared-memory pipeline, any M/N/K, layouts NN/NT/TN, strided batch and split-K,
// fused epilogue (bf16 or fp32 output). bf16 arrives as raw 16-bit storage.
// C[z] = epi(alpha * op(A) @ op(B) + beta * C[z] + bias); op(A) is M x K, op(B) is K x N, all row-major.
#include "gemm_common.cuh"

__device__ __forceinline__ void blu_ldsm_x4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(blu_smem_addr(p)));
}

__device__ __forceinline__ void blu_ldsm_x4_t(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(blu_smem_addr(p)));
}

__device__ __forceinline__ void blu_mma_bf16(float* d, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// TA: A stored K x M (op(A) = A^T); TB: B stored N x K (op(B) = B^T).
// Shared tiles keep the global layout with +8 elements (16 bytes) of row padding, which keeps cp.async and
// ldmatrix rows 16-byte aligned and the 8 row addresses of every ldmatrix on distinct banks.
// K-major tiles use ldmatrix, M/N-major tiles ldmatrix.trans.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, bool TA, bool TB>
__device__ __forceinline__ void gemm_bf16_body(BLU_GEMM_PARAMS) {
  constexpr int NT = WARPS_M * WARPS_N * 32;
  constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
  constexpr int MI = WTM / 16, NI = WTN / 8;
  static_assert(NI % 2 == 0, "warp tile n must be a multiple of 16");
  constexpr int SLDA = TA ? BM + 8 : BK + 8;
  constexpr int SLDB = TB ? BK + 8 : BN + 8;
  constexpr int A_STAGE = TA ? BK * SLDA : BM * SLDA;
  constexpr int B_STAGE = TB ? BN * SLDB : BK * SLDB;
  extern __shared__ __align__(16) unsigned char blu_smem_raw[];
  bf16_t* shA = (bf16_t*)blu_smem_raw;
  bf16_t* shB = shA + STAGES * A_STAGE;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp / WARPS_N) * WTM, wn = (warp % WARPS_N) * WTN;
  const int g = lane >> 2, t = lane & 3;
  const int lr = lane & 7, lmat = lane >> 3;
  const BluTile tile = blu_tile_coords<BM, BN>();
  const int m0 = tile.m0, n0 = tile.n0;
  const BluKRange kr = blu_k_range(K, splits, k_chunk);
  const bf16_t* gA = (const bf16_t*)A + (i64)kr.batch * sA;
  const bf16_t* gB = (const bf16_t*)B + (i64)kr.batch * sB;
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
    bf16_t* a = shA + stage * A_STAGE;
    bf16_t* b = shB + stage * B_STAGE;
    if (TA)
      blu_load_tile<bf16_t, BK, BM, SLDA, NT>(a, gA, lda, k0, m0, kr.k_end, M, tid, vec);
    else
      blu_load_tile<bf16_t, BM, BK, SLDA, NT>(a, gA, lda, m0, k0, M, kr.k_end, tid, vec);
    if (TB)
      blu_load_tile<bf16_t, BN, BK, SLDB, NT>(b, gB, ldb, n0, k0, N, kr.k_end, tid, vec);
    else
      blu_load_tile<bf16_t, BK, BN, SLDB, NT>(b, gB, ldb, k0, n0, kr.k_end, N, tid, vec);
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
    const bf16_t* a = shA + (kt % STAGES) * A_STAGE;
    const bf16_t* b = shB + (kt % STAGES) * B_STAGE;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MI][4], bfr[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        if (TA) {
          const int k = kk + lr + (lmat >> 1) * 8, m = wm + i * 16 + (lmat & 1) * 8;
          blu_ldsm_x4_t(af[i], a + k * SLDA + m);
        } else {
          const int m = wm + i * 16 + lr + (lmat & 1) * 8, k = kk + (lmat >> 1) * 8;
          blu_ldsm_x4(af[i], a + m * SLDA + k);
        }
      }
#pragma unroll
      for (int jj = 0; jj < NI / 2; ++jj) {
        unsigned r[4];
        if (TB) {
          const int n = wn + jj * 16 + lr + (lmat >> 1) * 8, k = kk + (lmat & 1) * 8;
          blu_ldsm_x4(r, b + n * SLDB + k);
        } else {
          const int k = kk + lr + (lmat & 1) * 8, n = wn + jj * 16 + (lmat >> 1) * 8;
          blu_ldsm_x4_t(r, b + k * SLDB + n);
        }
        bfr[2 * jj][0] = r[0];
        bfr[2 * jj][1] = r[1];
        bfr[2 * jj + 1][0] = r[2];
        bfr[2 * jj + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) blu_mma_bf16(acc[i][j], af[i], bfr[j]);
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

// One extern "C" entry point per (config, layout): blu_gemm_bf16_<config>_<nn|nt|tn>.
#define BLU_BF16_ONE(NAME, BM, BN, BK, WM_, WN_, ST, TA, TB, SUF)                                        \
  extern "C" __global__ void __launch_bounds__(WM_ * WN_ * 32)                                           \
      blu_gemm_bf16_##NAME##_##SUF(BLU_GEMM_PARAMS) {                                                    \
    gemm_bf16_body<BM, BN, BK, WM_, WN_, ST, TA, TB>(BLU_GEMM_ARGS);                                    \
  }
#define BLU_BF16_CONFIG(NAME, BM, BN, BK, WM_, WN_, ST)           \
  BLU_BF16_ONE(NAME, BM, BN, BK, WM_, WN_, ST, false, false, nn) \
  BLU_BF16_ONE(NAME, BM, BN, BK, WM_, WN_, ST, false, true, nt)  \
  BLU_BF16_ONE(NAME, BM, BN, BK, WM_, WN_, ST, true, false, tn)

// Config names: <BM>x<BN>x<BK>_w<warps m>x<warps n>_s<stages>; the list is mirrored in blublas/configs.py.
BLU_BF16_CONFIG(128x256x32_w2x4_s4, 128, 256, 32, 2, 4, 4)
BLU_BF16_CONFIG(128x128x32_w2x2_s4, 128, 128, 32, 2, 2, 4)
BLU_BF16_CONFIG(128x128x64_w2x2_s3, 128, 128, 64, 2, 2, 3)
BLU_BF16_CONFIG(64x128x32_w2x2_s4, 64, 128, 32, 2, 2, 4)
// sm_90 candidates (autotuner): k step 64 on the 128x256 tile (half the barriers per flop) (228 KB of smem)
BLU_BF16_CONFIG(128x256x64_w2x4_s3, 128, 256, 64, 2, 4, 3)
