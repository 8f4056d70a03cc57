// BluBLAS BF16 GEMM on the matrix units: mma.sync m16n8k16 (bf16 in, fp32 accumulate), ldmatrix fragment
// loads, cp.async multi-stage shared-memory pipeline, any M/N/K, layouts NN/NT/TN, strided batch and split-K,
// fused epilogue (bf16 or fp32 output). bf16 arrives as raw 16-bit storage.
// C[z] = epi(alpha * op(A) @ op(B) + beta * C[z] + bias); op(A) is M x K, op(B) is K x N, all row-major.
#include "gemm_mainloop.cuh"

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

// Element struct of BluMmaPolicy (gemm_mainloop.cuh). Shared tiles get +8 elements (16 bytes) of row padding
// either way, which keeps cp.async and ldmatrix rows 16-byte aligned and the 8 row addresses of every ldmatrix
// on distinct banks. K-major tiles use ldmatrix, M/N-major tiles ldmatrix.trans.
struct BluBf16Mma {
  typedef bf16_t T;
  static constexpr int KSTEP = 16, PAD_K = 8, PAD_MN = 8;

  // A fragment of the 16 x 16 tile at rows m .. m + 15, k .. k + 15 (one ldmatrix.x4)
  template <int SLDA, bool TA>
  __device__ __forceinline__ static void load_a(unsigned* af, const bf16_t* a, int mb, int kk, const BluLane& l) {
    if (TA) {
      const int k = kk + l.lr + (l.lmat >> 1) * 8, m = mb + (l.lmat & 1) * 8;
      blu_ldsm_x4_t(af, a + k * SLDA + m);
    } else {
      const int m = mb + l.lr + (l.lmat & 1) * 8, k = kk + (l.lmat >> 1) * 8;
      blu_ldsm_x4(af, a + m * SLDA + k);
    }
  }

  // NI B fragments (8 columns each) from column wn, two per ldmatrix.x4
  template <int NI, int SLDB, bool TB>
  __device__ __forceinline__ static void load_b(unsigned (*bfr)[2], const bf16_t* b, int wn, int kk,
                                                const BluLane& l) {
    static_assert(NI % 2 == 0, "warp tile n must be a multiple of 16");
#pragma unroll
    for (int jj = 0; jj < NI / 2; ++jj) {
      unsigned r[4];
      if (TB) {
        const int n = wn + jj * 16 + l.lr + (l.lmat >> 1) * 8, k = kk + (l.lmat & 1) * 8;
        blu_ldsm_x4(r, b + n * SLDB + k);
      } else {
        const int k = kk + l.lr + (l.lmat & 1) * 8, n = wn + jj * 16 + (l.lmat >> 1) * 8;
        blu_ldsm_x4_t(r, b + k * SLDB + n);
      }
      bfr[2 * jj][0] = r[0];
      bfr[2 * jj][1] = r[1];
      bfr[2 * jj + 1][0] = r[2];
      bfr[2 * jj + 1][1] = r[3];
    }
  }

  __device__ __forceinline__ static void mma(float* d, const unsigned* a, const unsigned* b) { blu_mma_bf16(d, a, b); }
};

// One extern "C" entry point per (config, layout): blu_gemm_bf16_<config>_<nn|nt|tn>.
#define BLU_BF16_ONE(NAME, BM, BN, BK, WM_, WN_, ST, TA, TB, SUF)                                        \
  extern "C" __global__ void __launch_bounds__(WM_ * WN_ * 32)                                           \
      blu_gemm_bf16_##NAME##_##SUF(BLU_GEMM_PARAMS) {                                                    \
    blu_gemm_mainloop<BluMmaPolicy<BluBf16Mma, BM, BN, BK, WM_, WN_, ST, TA, TB>>(BLU_GEMM_ARGS);         \
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
