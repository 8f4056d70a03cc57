// BluBLAS GEMM main loop, written once for every element type: the CTA's output tile (grouped order), its
// split-K range and batch offsets, a STAGES-deep cp.async shared-memory pipeline (prologue of STAGES - 1 tiles,
// then per k-tile: wait for the oldest group, one barrier, prefetch tile kt + STAGES - 1 into the stage read
// at kt - 1, compute tile kt), and the hand-off of the accumulators to the fused epilogue.
//
// What differs between element types is a policy (a struct, one instance per thread):
//   T                       element type in global and shared memory
//   BM, BN, BK, STAGES, NT  CTA tile, k-tile, pipeline depth, threads
//   A_STAGE, B_STAGE        elements of one stage of the A and B tiles (shared layout and padding: the policy's)
//   Acc                     the thread's accumulator array type
//   Policy(tid)             the thread's coordinates (warp tile, lane roles)
//   load_stage(...)         global -> shared copy of one k-tile of A and B (cp.async, zero fill past the bounds)
//   zero(acc)               clear the accumulators
//   Frags                   per-k-step register scratch (fragments) of compute
//   compute(acc, fr, a, b)  one k-tile from the shared stage: fragment loads and MMA or FMA steps
//   store(e, acc, m0, n0)   accumulators -> epilogue (blu_epi_store2 on the thread's output pairs)
// Users: gemm_mma_bf16.cu and gemm_mma_tf32.cu (BluMmaPolicy below, with an element struct: ldmatrix vs.
// scalar shared loads, m16n8k16 vs. m16n8k8, row padding) and gemm_simt_f32.cu's cp.async path (FMA on an
// 8x8 register tile). The SIMT register-staged path (stages == 2) is a different loop: no cp.async, the next
// k-tile goes through registers while the current one is computed, one barrier per k-tile, the partial k-tile
// first so the loop checks only row bounds, and interior CTAs without any bound check. It keeps its own loop
// (gemm_simt_reg_body) and shares gemm_common.cuh's tile order, k range and epilogue with this one.
//
// The loop's machine code is the same as when each kernel spelled it out (dev/sass_diff.py compares the SASS).
// That depends on the order of the thread's local arrays: arrays declared inside an inlined callee are placed
// before the caller's, which reorders the accumulators' registers, so per-k-step scratch (Frags) is declared
// here at the point of use and the policies' compute declares no arrays of its own.
#pragma once
#include "gemm_common.cuh"

// Lane roles in a warp: MMA fragment row group g and thread-in-group t; ldmatrix row lr and matrix lmat.
struct BluLane {
  int g, t, lr, lmat;
};

template <class Policy>
__device__ __forceinline__ void blu_gemm_mainloop(BLU_GEMM_PARAMS) {
  typedef typename Policy::T T;
  constexpr int BK = Policy::BK, STAGES = Policy::STAGES, A_STAGE = Policy::A_STAGE, B_STAGE = Policy::B_STAGE;
  extern __shared__ __align__(16) unsigned char blu_smem_raw[];
  T* shA = (T*)blu_smem_raw;
  T* shB = shA + STAGES * A_STAGE;

  const int tid = threadIdx.x;
  const Policy th(tid);
  const BluTile tile = blu_tile_coords<Policy::BM, Policy::BN>();
  const int m0 = tile.m0, n0 = tile.n0;
  const BluKRange kr = blu_k_range(K, splits, k_chunk);
  const T* gA = (const T*)A + (i64)kr.batch * sA;
  const T* gB = (const T*)B + (i64)kr.batch * sB;
  const int klen = kr.k_end > kr.k_begin ? kr.k_end - kr.k_begin : 0;
  const int ktiles = (klen + BK - 1) / BK;
  const bool vec = (flags & BLU_F_VEC) != 0;

  typename Policy::Acc acc;
  Policy::zero(acc);

  auto load_stage = [&](int stage, int kt) {
    const int k0 = kr.k_begin + kt * BK;
    Policy::load_stage(shA + stage * A_STAGE, shB + stage * B_STAGE, gA, gB, lda, ldb, k0, m0, n0, M, N, kr.k_end,
                  tid, vec);
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
    typename Policy::Frags fr;  // declared here, not inside compute: see the note above
    th.compute(acc, fr, shA + (kt % STAGES) * A_STAGE, shB + (kt % STAGES) * B_STAGE);
  }
  blu_cp_async_wait<0>();

  const BluEpi e = blu_make_epi(C, bias, P, ldc, ldp, sC, sP, alpha, beta, flags, M, N, blockIdx.z);
  th.store(e, acc, m0, n0);
}

// Policy of the mma.sync GEMMs. E, the element struct, provides T, the k per MMA (KSTEP), the row padding of
// k-contiguous (PAD_K) and m/n-contiguous (PAD_MN) shared tiles, load_a (one 16 x KSTEP A fragment),
// load_b (the warp's NI 8-column B fragments of one k-step) and mma (c += a b, fp32 accumulate).
// TA: A stored K x M (op(A) = A^T); TB: B stored N x K (op(B) = B^T). Shared tiles keep the global layout.
// Warp tiles of (BM / WARPS_M) x (BN / WARPS_N), MI x NI MMA tiles of 16 x 8 each.
template <class E, int BM_, int BN_, int BK_, int WARPS_M, int WARPS_N, int STAGES_, bool TA, bool TB>
struct BluMmaPolicy {
  typedef typename E::T T;
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
  static constexpr int NT = WARPS_M * WARPS_N * 32;
  static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
  static constexpr int MI = WTM / 16, NI = WTN / 8;
  static constexpr int SLDA = TA ? BM + E::PAD_MN : BK + E::PAD_K;
  static constexpr int SLDB = TB ? BK + E::PAD_K : BN + E::PAD_MN;
  static constexpr int A_STAGE = TA ? BK * SLDA : BM * SLDA;
  static constexpr int B_STAGE = TB ? BN * SLDB : BK * SLDB;
  typedef float Acc[MI][NI][4];

  int wm, wn;  // warp tile origin in the CTA tile
  BluLane ln;  // lane roles: MMA fragment (g, t), ldmatrix row/matrix (lr, lmat)

  __device__ __forceinline__ explicit BluMmaPolicy(int tid) {
    const int lane = tid & 31, warp = tid >> 5;
    wm = (warp / WARPS_N) * WTM;
    wn = (warp % WARPS_N) * WTN;
    ln.g = lane >> 2;
    ln.t = lane & 3;
    ln.lr = lane & 7;
    ln.lmat = lane >> 3;
  }

  __device__ __forceinline__ static void load_stage(T* a, T* b, const T* gA, const T* gB, i64 lda, i64 ldb, int k0,
                                                    int m0, int n0, int M, int N, int k_end, int tid, bool vec) {
    if (TA)
      blu_load_tile<T, BK, BM, SLDA, NT>(a, gA, lda, k0, m0, k_end, M, tid, vec);
    else
      blu_load_tile<T, BM, BK, SLDA, NT>(a, gA, lda, m0, k0, M, k_end, tid, vec);
    if (TB)
      blu_load_tile<T, BN, BK, SLDB, NT>(b, gB, ldb, n0, k0, N, k_end, tid, vec);
    else
      blu_load_tile<T, BK, BN, SLDB, NT>(b, gB, ldb, k0, n0, k_end, N, tid, vec);
  }

  __device__ __forceinline__ static void zero(Acc& acc) {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;
  }

  struct Frags {  // fragments of one k-step
    unsigned af[MI][4], bfr[NI][2];
  };

  __device__ __forceinline__ void compute(Acc& acc, Frags& fr, const T* a, const T* b) const {
#pragma unroll
    for (int kk = 0; kk < BK; kk += E::KSTEP) {
      unsigned(&af)[MI][4] = fr.af;
      unsigned(&bfr)[NI][2] = fr.bfr;
#pragma unroll
      for (int i = 0; i < MI; ++i) E::template load_a<SLDA, TA>(af[i], a, wm + i * 16, kk, ln);
      E::template load_b<NI, SLDB, TB>(bfr, b, wn, kk, ln);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) E::mma(acc[i][j], af[i], bfr[j]);
    }
  }

  // accumulator (i, j): rows g and g + 8, columns 2t and 2t + 1 of the 16 x 8 tile at (wm + 16 i, wn + 8 j)
  __device__ __forceinline__ void store(const BluEpi& e, const Acc& acc, int m0, int n0) const {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const int r = m0 + wm + i * 16 + ln.g, c = n0 + wn + j * 8 + 2 * ln.t;
        blu_epi_store2(e, r, c, acc[i][j][0], acc[i][j][1]);
        blu_epi_store2(e, r + 8, c, acc[i][j][2], acc[i][j][3]);
      }
  }
};
