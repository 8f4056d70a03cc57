// BluBLAS TF32 GEMM on the matrix units: mma.sync m16n8k8 (tf32 in, fp32 accumulate), cp.async multi-stage
// shared-memory pipeline, any M/N/K, layouts NN/NT/TN/TT, strided batch and split-K, fused epilogue.
// C[z] = epi(alpha * op(A) @ op(B) + beta * C[z] + bias); op(A) is M x K, op(B) is K x N, all row-major.
#include "gemm_mainloop.cuh"

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

// Element struct of BluMmaPolicy (gemm_mainloop.cuh): fp32 in shared memory, rounded to tf32 as fragments are
// loaded with scalar shared loads. Rows whose contiguous dim is k get +4 floats padding, rows whose contiguous
// dim is m/n get +8 floats, which makes every fragment load below bank-conflict free.
struct BluTf32Mma {
  typedef float T;
  static constexpr int KSTEP = 8, PAD_K = 4, PAD_MN = 8;

  // A fragment of the 16 x 8 tile at rows mb .. mb + 15, k .. k + 7
  template <int SLDA, bool TA>
  __device__ __forceinline__ static void load_a(unsigned* af, const float* a, int mb, int kk, const BluLane& l) {
    const int g = l.g, t = l.t;
    const int m = mb + g;
    if (TA) {
      af[0] = blu_to_tf32(a[(kk + t) * SLDA + m]);
      af[1] = blu_to_tf32(a[(kk + t) * SLDA + m + 8]);
      af[2] = blu_to_tf32(a[(kk + t + 4) * SLDA + m]);
      af[3] = blu_to_tf32(a[(kk + t + 4) * SLDA + m + 8]);
    } else {
      af[0] = blu_to_tf32(a[m * SLDA + kk + t]);
      af[1] = blu_to_tf32(a[(m + 8) * SLDA + kk + t]);
      af[2] = blu_to_tf32(a[m * SLDA + kk + t + 4]);
      af[3] = blu_to_tf32(a[(m + 8) * SLDA + kk + t + 4]);
    }
  }

  // NI B fragments (8 columns each) from column wn
  template <int NI, int SLDB, bool TB>
  __device__ __forceinline__ static void load_b(unsigned (*bfr)[2], const float* b, int wn, int kk,
                                                const BluLane& l) {
    const int g = l.g, t = l.t;
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
  }

  __device__ __forceinline__ static void mma(float* d, const unsigned* a, const unsigned* b) { blu_mma_tf32(d, a, b); }
};

// One extern "C" entry point per (config, layout): blu_gemm_tf32_<config>_<nn|nt|tn>.
#define BLU_TF32_ONE(NAME, BM, BN, BK, WM_, WN_, ST, TA, TB, SUF)                                        \
  extern "C" __global__ void __launch_bounds__(WM_ * WN_ * 32)                                           \
      blu_gemm_tf32_##NAME##_##SUF(BLU_GEMM_PARAMS) {                                                    \
    blu_gemm_mainloop<BluMmaPolicy<BluTf32Mma, BM, BN, BK, WM_, WN_, ST, TA, TB>>(BLU_GEMM_ARGS);         \
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
