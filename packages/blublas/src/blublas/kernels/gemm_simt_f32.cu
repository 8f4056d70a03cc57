// BluBLAS strict FP32 GEMM on the SIMT cores (no TF32): register tiling (8x8 outputs per thread), any M/N/K
// and alignment, layouts NN/NT/TN, strided batch, split-K. Two main loops, chosen by the stage count:
//  * stages >= 3: 4-byte cp.async multi-stage shared-memory pipeline (transposing K-major tiles on the way
//    in so the inner loop reads float4 columns); 8x8 outputs as two 4x4 quadrants of a 16 x (NT/16) grid.
//    This is the GEMM main loop of gemm_mainloop.cuh with the SIMT policy (BluSimtPolicy).
//  * stages == 2 (gemm_simt_reg_body): register-staged double buffer -- 16-byte global loads of tile k+1
//    into registers while tile k is computed, then stored (transposed where needed) into the other shared
//    buffer; one barrier per k-tile. Warp tile 32 x 64 (lanes 4 x 8, each 2x2 sub-tiles of 4x4) so every
//    shared load is a conflict-free float4 (a 64-byte broadcast for A, 128 contiguous bytes for B).
// C[z] = epi(alpha * op(A) @ op(B) + beta * C[z] + bias); op(A) is M x K, op(B) is K x N, all row-major.
#include "gemm_mainloop.cuh"

// Policy of the cp.async path for blu_gemm_mainloop (gemm_mainloop.cuh): shared tiles are K-major,
// [BK][BM+4] and [BK][BN+4] (4-byte cp.async, transposing the K-contiguous operands on the way in), so each
// k-step reads float4 columns; 8x8 outputs a thread as two 4x4 quadrants of a 16 x (NT/16) grid.
template <int BM_, int BN_, int BK_, int STAGES_, bool TA, bool TB>
struct BluSimtPolicy {
  typedef float T;
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
  static constexpr int TX = BN / 8, TY = BM / 8, NT = TX * TY;
  static constexpr int SLDA = BM + 4, SLDB = BN + 4;
  static constexpr int A_STAGE = BK * SLDA, B_STAGE = BK * SLDB;
  static constexpr int A_PER = BM * BK / NT, B_PER = BN * BK / NT;
  static_assert(BM * BK % NT == 0 && BN * BK % NT == 0, "tile not divisible by thread count");
  typedef float Acc[8][8];
  struct Frags {  // the A and B values of one k-step
    float ra[8], rb[8];
  };

  int tx, ty;

  __device__ __forceinline__ explicit BluSimtPolicy(int tid) : tx(tid % TX), ty(tid / TX) {}

  __device__ __forceinline__ static void load_stage(float* a, float* b, const float* gA, const float* gB, i64 lda,
                                                    i64 ldb, int k0, int m0, int n0, int M, int N, int k_end, int tid,
                                                    bool) {
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
      const bool ok = gm < M && gk < k_end;
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
      const bool ok = gn < N && gk < k_end;
      const float* src = ok ? (TB ? gB + (i64)gn * ldb + gk : gB + (i64)gk * ldb + gn) : gB;
      blu_cp_async4(b + k * SLDB + n, src, ok ? 4 : 0);
    }
  }

  __device__ __forceinline__ static void zero(Acc& acc) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  }

  __device__ __forceinline__ void compute(Acc& acc, Frags& fr, const float* a, const float* b) const {
    float(&ra)[8] = fr.ra;
    float(&rb)[8] = fr.rb;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
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

  __device__ __forceinline__ void store(const BluEpi& e, const Acc& acc, int m0, int n0) const {
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
};

// One operand tile of the register-staged path: ROWS x BK (A: ROWS = BM, B: ROWS = BN), stored in shared
// memory K-major as [BK][ROWS + 4]. KCONTIG: the operand's K index is contiguous in global memory (A in
// NN/NT, B in NT); otherwise the M/N index is. Each thread owns up to VECS 4-element runs along the
// contiguous axis (with more threads than runs, the threads past RUNS load nothing). Only the row bound is
// checked in the main loop: a partial k-tile is computed first (load_tail, in the prologue).
template <int ROWS, int BK, int NT, bool KCONTIG>
struct BluSimtStage {
  static constexpr int RUNS = ROWS * BK / 4;
  static constexpr int VECS = (RUNS + NT - 1) / NT;
  static constexpr bool EVEN = RUNS % NT == 0;
  static constexpr int SLD = ROWS + 4;
  // run p sits PROW rows (KCONTIG) or PK k-steps (else) after run 0: one pointer and bound per thread
  static constexpr int PROW = KCONTIG ? NT / (BK / 4) : 0, PK = KCONTIG ? 0 : NT / (ROWS / 4);
  static_assert(BK % 4 == 0 && ROWS % 4 == 0 && (EVEN || VECS == 1), "tile not divisible into float4 runs");
  static_assert(VECS == 1 || (KCONTIG ? NT % (BK / 4) == 0 : NT % (ROWS / 4) == 0), "runs not a fixed stride");
  const float* ptr0;  // first element of run 0 in the current k-tile
  int rrem0;          // rows left from run 0's (first) row: valid rows are those with offset < rrem
  i64 pstep;          // elements from run p to run p + 1
  int soff0;          // shared offset of run 0's first element in a stage; run p is p * SOFFP further
  static constexpr int SOFFP = KCONTIG ? PROW : PK * SLD;
  float v[VECS][4];

  __device__ __forceinline__ const float* ptr(int p) const { return ptr0 + p * pstep; }
  __device__ __forceinline__ int rrem(int p) const { return rrem0 - p * PROW; }

  __device__ __forceinline__ static bool active(int tid) { return EVEN || tid < RUNS; }
  // (row within the tile, k within the tile) of run p's first element
  __device__ __forceinline__ static int row_of(int tid, int p) {
    const int i = tid + p * NT;
    return KCONTIG ? i / (BK / 4) : (i % (ROWS / 4)) * 4;
  }
  __device__ __forceinline__ static int k_of(int tid, int p) {
    const int i = tid + p * NT;
    return KCONTIG ? (i % (BK / 4)) * 4 : i / (ROWS / 4);
  }

  __device__ __forceinline__ void init(const float* g, i64 ld, int row0, int rows_lim, int k_begin, int tid) {
    const int r = row_of(active(tid) ? tid : 0, 0), kk = k_of(active(tid) ? tid : 0, 0);
    rrem0 = rows_lim - row0 - r;
    ptr0 = KCONTIG ? g + (i64)(row0 + r) * ld + k_begin + kk : g + (i64)(k_begin + kk) * ld + row0 + r;
    pstep = (i64)(KCONTIG ? PROW : PK) * ld;
    soff0 = kk * SLD + r;
  }

  // Global -> registers: run p of a full k-tile. CHECK == false: the caller knows every run is in range and
  // 16-byte aligned (an interior CTA): one 16-byte load; else element-wise loads, rows past the bound read
  // as zero (edge CTAs, unaligned operands).
  template <bool CHECK = true>
  __device__ __forceinline__ void load_run(int p, int tid) {
    if (!active(tid)) return;
    if (!CHECK) {
      const float4 t = __ldg((const float4*)ptr(p));
      v[p][0] = t.x;
      v[p][1] = t.y;
      v[p][2] = t.z;
      v[p][3] = t.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[p][j] = rrem(p) > (KCONTIG ? 0 : j) ? __ldg(ptr(p) + j) : 0.f;
    }
  }

  template <bool CHECK = true>
  __device__ __forceinline__ void load_full(int tid) {
#pragma unroll
    for (int p = 0; p < VECS; ++p) load_run<CHECK>(p, tid);
  }

  // The partial k-tile at `base_step` elements past the current one, with kvalid (< BK) valid k.
  __device__ __forceinline__ void load_tail(i64 base_step, int kvalid, int tid) {
    if (!active(tid)) return;
#pragma unroll
    for (int p = 0; p < VECS; ++p) {
      const int kk = k_of(tid, p);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool ok = KCONTIG ? (rrem(p) > 0 && kk + j < kvalid) : (rrem(p) > j && kk < kvalid);
        v[p][j] = ok ? __ldg(ptr(p) + base_step + j) : 0.f;
      }
    }
  }

  __device__ __forceinline__ void advance(i64 step) { ptr0 += step; }

  __device__ __forceinline__ void store_run(float* s, int p, int tid) const {
    if (!active(tid)) return;
    float* d = s + soff0 + p * SOFFP;
    if (KCONTIG) {
#pragma unroll
      for (int j = 0; j < 4; ++j) d[j * SLD] = v[p][j];
    } else {
      *(float4*)d = make_float4(v[p][0], v[p][1], v[p][2], v[p][3]);
    }
  }

  __device__ __forceinline__ void store(float* s, int tid) const {
#pragma unroll
    for (int p = 0; p < VECS; ++p) store_run(s, p, tid);
  }
};

// CHECK == false: an interior CTA (whole BM x BN tile in range) with 16-byte loads allowed; the main loop
// then has no bound checks at all (the dispatcher picks the instance per CTA).
template <int BM, int BN, int BK, bool TA, bool TB, bool CHECK>
__device__ __forceinline__ void gemm_simt_reg_body(BLU_GEMM_PARAMS) {
  constexpr int NT = (BM / 8) * (BN / 8);
  constexpr int WARPS_M = BM / 32;
  static_assert(BM % 32 == 0 && BN % 64 == 0 && NT == 32 * WARPS_M * (BN / 64), "warp tiling is 32 x 64");
  typedef BluSimtStage<BM, BK, NT, !TA> StA;
  typedef BluSimtStage<BN, BK, NT, TB> StB;
  constexpr int SLDA = StA::SLD, SLDB = StB::SLD;
  constexpr int A_STAGE = BK * SLDA, B_STAGE = BK * SLDB;
  extern __shared__ __align__(16) unsigned char blu_smem_raw[];
  float* shA = (float*)blu_smem_raw;
  float* shB = shA + 2 * A_STAGE;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp % WARPS_M, wn = warp / WARPS_M;
  const int lm = lane / 8, ln = lane % 8;
  const int am = wm * 32 + lm * 4;  // this thread's rows: am + {0..3} and am + 16 + {0..3}
  const int bn = wn * 64 + ln * 4;  // this thread's cols: bn + {0..3} and bn + 32 + {0..3}
  const BluTile tile = blu_tile_coords<BM, BN>();
  const int m0 = tile.m0, n0 = tile.n0;
  const BluKRange kr = blu_k_range(K, splits, k_chunk);
  const float* gA = (const float*)A + (i64)kr.batch * sA;
  const float* gB = (const float*)B + (i64)kr.batch * sB;
  const int klen = kr.k_end > kr.k_begin ? kr.k_end - kr.k_begin : 0;
  const int nfull = klen / BK, tail = klen % BK;
  const int ktiles = nfull + (tail > 0);
  const i64 stepA = TA ? (i64)BK * lda : (i64)BK;
  const i64 stepB = TB ? (i64)BK : (i64)BK * ldb;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

  StA sta;
  StB stb;
  sta.init(gA, lda, m0, M, kr.k_begin, tid);
  stb.init(gB, ldb, n0, N, kr.k_begin, tid);
  if (tail > 0) {  // the partial k-tile first (summation order is free), so the loop only checks rows
    sta.load_tail(nfull * stepA, tail, tid);
    stb.load_tail(nfull * stepB, tail, tid);
  } else if (ktiles > 0) {
    sta.template load_full<CHECK>(tid);
    stb.template load_full<CHECK>(tid);
    sta.advance(stepA);
    stb.advance(stepB);
  }
  if (ktiles > 0) {
    sta.store(shA, tid);
    stb.store(shB, tid);
  }
  __syncthreads();

  // The next full k-tile is fetched run by run: run p of an operand is loaded at k-step p * SEG and stored
  // into the other buffer after step p * SEG + SEG - 1 (that buffer was last read in iteration kt-1, which
  // every thread has left), so only one run per operand is held in registers at a time.
  constexpr int SEGA = BK / StA::VECS, SEGB = BK / StB::VECS;
  static_assert(BK % StA::VECS == 0 && BK % StB::VECS == 0, "runs must split the k-tile evenly");
  for (int kt = 0; kt < ktiles; ++kt) {
    const bool more = kt + 1 < ktiles;
    const float* a = shA + (kt & 1) * A_STAGE;
    const float* b = shB + (kt & 1) * B_STAGE;
    float* na = shA + ((kt + 1) & 1) * A_STAGE;
    float* nb = shB + ((kt + 1) & 1) * B_STAGE;
#pragma unroll
    for (int k = 0; k < BK; ++k) {  // fully unrolled: ptxas hoists the next step's shared loads itself
      if (more && k % SEGA == 0) sta.template load_run<CHECK>(k / SEGA, tid);
      if (more && k % SEGB == 0) stb.template load_run<CHECK>(k / SEGB, tid);
      const float4 a0 = *(const float4*)(a + k * SLDA + am), a1 = *(const float4*)(a + k * SLDA + am + 16);
      const float4 b0 = *(const float4*)(b + k * SLDB + bn), b1 = *(const float4*)(b + k * SLDB + bn + 32);
      const float ra[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float rb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
      if (more && k % SEGA == SEGA - 1) sta.store_run(na, k / SEGA, tid);
      if (more && k % SEGB == SEGB - 1) stb.store_run(nb, k / SEGB, tid);
    }
    if (more) {
      sta.advance(stepA);
      stb.advance(stepB);
    }
    __syncthreads();
  }

  const BluEpi e = blu_make_epi(C, bias, P, ldc, ldp, sC, sP, alpha, beta, flags, M, N, blockIdx.z);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = m0 + am + (i < 4 ? i : 16 + i - 4);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const int c = n0 + bn + (j < 4 ? j : 32 + j - 4);
      blu_epi_store2(e, r, c, acc[i][j], acc[i][j + 1]);
    }
  }
}

template <int BM, int BN, int BK, int ST, bool TA, bool TB>
__device__ __forceinline__ void gemm_simt_dispatch(BLU_GEMM_PARAMS) {
  if constexpr (ST == 2) {
    const BluTile t = blu_tile_coords<BM, BN>();
    if ((flags & BLU_F_VEC) && t.m0 + BM <= M && t.n0 + BN <= N)
      gemm_simt_reg_body<BM, BN, BK, TA, TB, false>(BLU_GEMM_ARGS);
    else
      gemm_simt_reg_body<BM, BN, BK, TA, TB, true>(BLU_GEMM_ARGS);
  } else
    blu_gemm_mainloop<BluSimtPolicy<BM, BN, BK, ST, TA, TB>>(BLU_GEMM_ARGS);
}

// One extern "C" entry point per (config, layout): blu_gemm_simt_<config>_<nn|nt|tn>.
// Stage count 2 selects the register-staged main loop, capped at 128 registers (2 CTAs of 256 threads or
// 1 of 512 per SM); 3 or more the cp.async pipeline.
#define BLU_SIMT_ONE(NAME, BM, BN, BK, ST, TA, TB, SUF)                                               \
  extern "C" __global__ void __launch_bounds__((BM / 8) * (BN / 8),                                   \
                                               ST == 2 ? 512 / ((BM / 8) * (BN / 8)) : 1)             \
      blu_gemm_simt_##NAME##_##SUF(BLU_GEMM_PARAMS) {                                                 \
    gemm_simt_dispatch<BM, BN, BK, ST, TA, TB>(BLU_GEMM_ARGS);                                       \
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
// register-staged double buffer (stages == 2), warp tile 32 x 64: the sm_90 choice (benchmarks/results/blublas_simt_h200.json)
BLU_SIMT_CONFIG(128x128x8_s2, 128, 128, 8, 2)
