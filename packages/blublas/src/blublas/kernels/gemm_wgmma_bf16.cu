// BluBLAS BF16 GEMM for sm_90a (Hopper): TMA + mbarrier pipeline, warp-specialized persistent CTAs,
// wgmma.mma_async m64n128k16 / m64n256k16 (bf16 in, fp32 accumulate) from 128-byte-swizzled shared memory
// (gemm_wgmma.cuh). Layouts NN/NT/TN (K-major operands: trans 0, M/N-major: trans 1), strided batch,
// split-K, the common fused epilogue. Needs 16-byte aligned operands with 16-byte multiple leading
// dimensions and batch strides (launch.tma_ok); other problems use the mma.sync kernels.
// blu-nvrtc-archs: 90a   (the body exists only when compiled for sm_90a; other archs get a trapping stub)
#include "gemm_wgmma.cuh"

// One extern "C" entry point per (config, layout): blu_gemm_wgmma_<config>_<nn|nt|tn>.
#define BLU_WGMMA_ONE(NAME, BN, ST, PP, TA, TB, SUF)                                        \
  extern "C" __global__ void __launch_bounds__(384, 1)                                      \
      blu_gemm_wgmma_##NAME##_##SUF(BLU_GEMM_PARAMS, BLU_TMA_PARAMS) {                      \
    gemm_tma_body<false, BN, ST, TA, TB, PP>(BLU_GEMM_ARGS, BLU_TMA_ARGS);                  \
  }
#define BLU_WGMMA_CONFIG(NAME, BM, BN, BK, ST, PP)   \
  BLU_WGMMA_ONE(NAME, BN, ST, PP, false, false, nn) \
  BLU_WGMMA_ONE(NAME, BN, ST, PP, false, true, nt)  \
  BLU_WGMMA_ONE(NAME, BN, ST, PP, true, false, tn)

// Config names: <BM>x<BN>x<BK>_<ws|pp>_s<stages> (ws: warp-specialized cooperative, pp: ping-pong, last
// macro argument 1); mirrored in blublas/configs.py.
BLU_WGMMA_CONFIG(128x256x64_ws_s4, 128, 256, 64, 4, 0)
BLU_WGMMA_CONFIG(128x128x64_ws_s6, 128, 128, 64, 6, 0)
BLU_WGMMA_CONFIG(128x128x64_pp_s6, 128, 128, 64, 6, 1)

// Smoke test of the TMA path alone (tests/test_gpu_sweep.py): one thread loads one box at (c0, c1, c2)
// through the tensor map into 1024-byte aligned shared memory, waits on the mbarrier, and the block copies
// the raw (swizzled) bytes to `out` so the host can compare them with the NumPy swizzle model.
// blu_tma_smoke: the map as a __grid_constant__ parameter; blu_tma_smoke_gmem: the map in global memory.
__device__ __forceinline__ void blu_tma_smoke_body(const BluTmap* tm, unsigned char* out, int box_bytes, int c0,
                                                   int c1, int c2) {
#if BLU_HAVE_WGMMA
  extern __shared__ __align__(1024) unsigned char blu_smoke_smem[];
  const unsigned raw = blu_smem_addr(blu_smoke_smem);
  const unsigned pad = (1024u - (raw & 1023u)) & 1023u;
  const unsigned dst = raw + pad;
  const unsigned bar = dst + box_bytes;
  if (threadIdx.x == 0) {
    blu_mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    blu_mbar_expect_tx(bar, box_bytes);
    blu_tma_load3(dst, tm, c0, c1, c2, bar);
  }
  blu_mbar_wait(bar, 0);
  for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) out[i] = blu_smoke_smem[pad + i];
#else
  asm volatile("trap;");
#endif
}

extern "C" __global__ void __launch_bounds__(128, 1)
    blu_tma_smoke(const __grid_constant__ BluTmap tm, unsigned char* out, int box_bytes, int c0, int c1, int c2) {
  blu_tma_smoke_body(&tm, out, box_bytes, c0, c1, c2);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    blu_tma_smoke_gmem(const BluTmap* tm, unsigned char* out, int box_bytes, int c0, int c1, int c2) {
  blu_tma_smoke_body(tm, out, box_bytes, c0, c1, c2);
}
