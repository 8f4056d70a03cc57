// BluBLAS TF32 GEMM for sm_90a (Hopper): TMA + mbarrier pipeline, warp-specialized persistent CTAs,
// wgmma.mma_async m64n128k8 / m64n256k8 (tf32 in, fp32 accumulate) from 128-byte-swizzled shared memory
// (gemm_wgmma.cuh). wgmma reads tf32 operands K-major only, so only the NT layout (A stored M x K, B stored
// N x K: a Linear layer's forward) is provided; launch.py serves NN/TN by transposing the M/N-major operand
// into a workspace first, or the mma.sync kernels do. The tensor cores read fp32 bits as tf32 (low mantissa
// bits ignored). Needs 16-byte aligned operands (launch.tma_ok).
// blu-nvrtc-archs: 90a   (the body exists only when compiled for sm_90a; other archs get a trapping stub)
#include "gemm_wgmma.cuh"

// Entry points: blu_gemm_wgmma_tf32_<config>_nt (NT layout only).
#define BLU_WGMMA_TF32_CONFIG(NAME, BM, BN, BK, ST, PP)                                                      \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                       \
      blu_gemm_wgmma_tf32_##NAME##_nt(BLU_GEMM_PARAMS, BLU_TMA_PARAMS) {                                     \
    gemm_tma_body<true, BN, ST, false, true, PP>(BLU_GEMM_ARGS, BLU_TMA_ARGS);                               \
  }

// Config names: <BM>x<BN>x<BK>_<ws|pp>_s<stages> (pp: ping-pong, last argument 1); mirrored in configs.py.
BLU_WGMMA_TF32_CONFIG(128x256x32_ws_s4, 128, 256, 32, 4, 0)
BLU_WGMMA_TF32_CONFIG(128x128x32_ws_s6, 128, 128, 32, 6, 0)
BLU_WGMMA_TF32_CONFIG(128x128x32_pp_s6, 128, 128, 32, 6, 1)
