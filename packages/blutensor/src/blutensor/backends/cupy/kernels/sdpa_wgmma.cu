// Flash attention for Hopper (sm_90a), bf16 storage, fp32 accumulation and softmax, head dims 64 and 128:
// wgmma.mma_async on operands that TMA loads into 128-byte-swizzled shared memory, warp-specialised CTAs.
// blu-nvrtc-archs: 90a   (the bodies exist only when compiled for sm_90a; elsewhere the kernels trap)
// Conventions as kernels/sdpa_mma.cu: q (BH, L, HD), k/v (BH, S, HD) read through 4-D tensor maps (head dim,
// row, head, batch: dense tensors are H = 1, fused qkv views are (B, T, 3, H, HD) strides); o, dq, dk, dv written
// through struct Lay; lse (BH, L) fp32 natural log (-inf for an empty row); causal = query i sees keys j <= i.
// Every kernel: 384 threads, warpgroup 0 the producer (one thread issues the TMA loads, its registers given
// back with setmaxnreg.dec), warpgroups 1 and 2 the consumers (setmaxnreg.inc), 64 rows each. A ring of
// stages guarded by full (TMA bytes arrived) and empty (every consumer warp done) mbarriers.
// Forward: 128 queries a CTA; Q loaded once, K/V tiles of 128 keys streamed. S = Q K^T by SS wgmma; the online
// softmax (exp2, scale folded) in registers; P packed to bf16 in registers is the A operand of O += P V (RS
// wgmma, V as an MN-major B operand). Pipelined: tile i's Q K^T and tile i-1's P V are issued together, the
// softmax of tile i runs while P V is in flight, then O is rescaled. Causal: tiles past the diagonal skipped, the
// diagonal one masked; heavy (late) query blocks scheduled first. Only a row block's last key tile can need the
// mask, so the others run a softmax without it (raw-score row extreme, one FFMA an exponent, tree reductions).
// Backward (deterministic, no atomics), after the preprocess: D = rowsum(dO * O), written with lse * log2 e as
// float pairs (lse2, D) per query into ld (BH, Lp = ceil(L / 64) * 64, 2), zero past L, so that the dK/dV kernels
// take each streamed tile's 64 pairs (512 B) into its stage by one bulk copy beside the tile's Q and dO.
// dK/dV kernel: 128 keys a CTA, K and V loaded once, Q/dO tiles of 64 queries streamed; S^T = K Q^T and
// dP^T = V dO^T (SS), P^T and dS^T = P^T (dP^T - D) in registers, dV += P^T dO and dK += dS^T Q (RS).
// dQ kernel: 128 queries a CTA, Q and dO loaded once, K/V tiles of 64 keys; S = Q K^T, dP = dO V^T (SS),
// dQ += dS K (RS).
// Fused backward (dQ by fp32 reductions, not bitwise repeatable; the host's choice: sdpa.py fused_backward): the
// dK/dV kernel that also produces dQ, 5 products a (key, query) tile pair instead of 7. Each consumer warpgroup
// stores its bf16 dS^T (64 keys x 64 queries) into a 128-byte-swizzled shared tile (double-buffered), fences it for
// the async proxy, syncs its 128 threads on a named barrier, and reads it back as the MN-major A operand of an SS
// wgmma: dQ partial (64 queries x HD) = dS K_own (K as MN-major B, as the P V product reads V), issued before dV
// and dK so that its reduction into the zeroed fp32 accumulator runs while they are in flight. Head dim 64: the
// partial goes to a 16 KB shared staging tile in the accumulator's tile-fragment order (see stage_dq) and one
// thread adds the whole tile into the accumulator with a single bulk reduction (cp.reduce.async.bulk .add.f32, in
// the L2), the accumulator laid out (BH, ceil(L / 64), 64 x 64) in that order; head dim 128 (no shared memory left
// for staging) adds it with red.global.add.v2.f32 into a (BH, L, HD) accumulator. The dq_convert kernel then
// writes dq = scale * accumulator through dq's layout.
// Fragment layout (m64nN accumulators, warp w of the warpgroup, lane 4 g + t): element i of a thread is row
// 16 w + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1); the A fragment of k-step kk (16 columns) is
// registers 8 kk .. 8 kk + 7 packed in pairs (dev/emulate_sdpa_wgmma.py checks this index math on the CPU).

#include "bf16_vec.cuh"
#include "sdpa_layout.cuh"
#include "hopper.cuh"

#define BLU_NEG_INF (-__int_as_float(0x7f800000))
#define BLU_LOG2E 1.4426950408889634f
#define BLU_LN2 0.6931471805599453f

namespace wg {

constexpr int THREADS = 384;
#if BLU_HAVE_WGMMA
constexpr int BOX = 64;  // head-dim elements of one TMA box: 128 bytes, the swizzle span

// Descriptor of a K-major operand (rows of `rows_box` x 128 B per box, HD / 64 boxes): k-step j (16 elements), the
// descriptor of the operand's first k-step advanced by the step's bytes (the k-steps of a product share one build)
__device__ __forceinline__ unsigned long long kmajor(unsigned base, int rows_box, int row0, int j) {
  return blu_desc_add(blu_desc(base + (unsigned)(row0 * 128), 16, 1024),
                      (unsigned)((j >> 2) * rows_box * 128 + (j & 3) * 32));
}
// Descriptor of an MN-major B operand (k rows of 128 B, the N = head dim in boxes of `rows_box` rows): k-step kk
__device__ __forceinline__ unsigned long long mnmajor(unsigned base, int rows_box, int kk) {
  return blu_desc_add(blu_desc(base, (unsigned)(rows_box * 128), 1024), (unsigned)(kk * 2048));
}

// SS product acc (64 x N) = A (64 x HD) B^T, N rows of B; HD / 16 k-steps, the first overwriting acc
template <int N, int HD>
__device__ __forceinline__ void ss_product(float* acc, unsigned a, int a_rows_box, int a_row0, unsigned b,
                                           int b_rows_box) {
#pragma unroll
  for (int j = 0; j < HD / 16; ++j) {
    const unsigned long long da = kmajor(a, a_rows_box, a_row0, j), db = kmajor(b, b_rows_box, 0, j);
    if constexpr (N == 128)
      blu_wgmma_ss_m64n128k16<0, 0>(acc, da, db, j > 0);
    else
      blu_wgmma_ss_m64n64k16<0, 0>(acc, da, db, j > 0);
  }
}
// RS product acc (64 x HD) += P (64 x K, registers p: K / 16 k-steps of 4) B, B K rows x HD (MN-major)
template <int K, int HD>
__device__ __forceinline__ void rs_product(float* acc, const unsigned* p, unsigned b, int b_rows_box) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const unsigned long long db = mnmajor(b, b_rows_box, kk);
    if constexpr (HD == 128)
      blu_wgmma_rs_m64n128k16<1>(acc, p + 4 * kk, db, 1);
    else
      blu_wgmma_rs_m64n64k16<1>(acc, p + 4 * kk, db, 1);
  }
}
// 2^x on the multi-function unit (flush-to-zero: probabilities below 2^-126 are 0, as in fp32 softmax kernels)
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
template <int N>
__device__ __forceinline__ void pack_p(const float* s, unsigned* p) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) p[i] = blu_pack_bf16x2(s[2 * i], s[2 * i + 1]);
}
// dQ partial of one 64-column chunk c of the head dim: acc (64 queries x 64) = dS K[:, 64 c ..], A = dS read
// transposed from the dS^T tile at `dst` (64 key rows of 128 B: MN-major A, one 64-element atom, k-steps of 16
// keys 2048 B apart), B = the warpgroup's own 64 keys of K (box c at k_own + c * 128 rows * 128 B, MN-major)
__device__ __forceinline__ void dq_chunk(float* acc, unsigned dst, unsigned k_own, int c) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    blu_wgmma_ss_m64n64k16<1, 1>(acc, mnmajor(dst, 64, kk), mnmajor(k_own + (unsigned)(c * 128 * 128), 128, kk),
                                 kk > 0);
}
// Store the packed bf16 dS^T (registers ds: element pair j at key row 16 w + g + 8 (j & 1), query columns
// 8 (j >> 1) + 2 t, + 1) into the 64 x 64 tile at `dst` (1024-aligned), 128-byte swizzled as TMA would write it:
// 16-byte chunk j >> 1 of row r goes to chunk (j >> 1) ^ (r & 7), and r & 7 = g. A warp's 32 stores of one j hit
// 8 rows x 16 B in 8 distinct chunks: no bank conflicts.
__device__ __forceinline__ void store_dst(unsigned dst, const unsigned* ds, int w, int g, int t) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int r = 16 * w + g + 8 * (j & 1);
    const unsigned a = dst + (unsigned)(r * 128 + (((j >> 1) ^ g) << 4) + 4 * t);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(ds[j]) : "memory");
  }
}
// Add a 64-query x 64 dQ partial (chunk c of the head dim) into the fp32 accumulator rows at `acc` (row q at
// acc + q * HD): element pair (i, i + 1) of query x0 + 16 w + g + 8 ((i >> 1) & 1), columns 64 c + fcol(i, t), + 1,
// one red.global.add.v2.f32 each (8-byte aligned); queries >= L are padding and skipped.
template <int HD>
__device__ __forceinline__ void red_dq(float* acc, const float* p, int c, int x0, int L, int w, int g, int t) {
  const int q0 = x0 + 16 * w + g, q1 = q0 + 8;
#pragma unroll
  for (int i = 0; i < 32; i += 4) {
    const int col = 64 * c + 8 * (i >> 2) + 2 * t;
    if (q0 < L)
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(acc + (long long)q0 * HD + col), "f"(p[i]),
                   "f"(p[i + 1]) : "memory");
    if (q1 < L)
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(acc + (long long)q1 * HD + col), "f"(p[i + 2]),
                   "f"(p[i + 3]) : "memory");
  }
}
// Head dim 64's dQ partial (64 queries x 64, the m64n64 accumulator p of thread th = 32 w + lane of the warpgroup)
// into the staging tile at `stg` in the accumulator's tile-fragment order: element (i4 * 128 + th) * 4 + j holds
// register 4 i4 + j, i.e. query row 16 w + g + 8 (j >> 1), column 8 i4 + 2 t + (j & 1). Each of a warp's 8 stores
// writes 512 contiguous bytes (no bank conflicts), and the tile is one contiguous 16 KB bulk reduction.
__device__ __forceinline__ void stage_dq(unsigned stg, const float* p, int th) {
#pragma unroll
  for (int i4 = 0; i4 < 8; ++i4)
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(stg + (unsigned)((i4 * 128 + th) * 16)),
                 "f"(p[4 * i4]), "f"(p[4 * i4 + 1]), "f"(p[4 * i4 + 2]), "f"(p[4 * i4 + 3]) : "memory");
}
// Rows (warp w, lane g): element i's column inside the tile and whether it is the second row (g + 8)
__device__ __forceinline__ int fcol(int i, int t) { return 8 * (i >> 2) + 2 * t + (i & 1); }
__device__ __forceinline__ bool frow8(int i) { return (i & 2) != 0; }
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
// Op over the N / 2 elements of row half R (frow8(i) == R: i = 4 k + 2 R + b) of a thread's N accumulator
// elements, as a pairwise tree: adjacent pairs first, then pairs of pairs (log2(N / 2) dependent steps)
template <int N, int R, typename Op>
__device__ __forceinline__ float row_reduce(const float* s) {
  float v[N / 2];
#pragma unroll
  for (int k = 0; k < N / 4; ++k) {
    v[2 * k] = s[4 * k + 2 * R];
    v[2 * k + 1] = s[4 * k + 2 * R + 1];
  }
#pragma unroll
  for (int w = 1; w < N / 2; w *= 2)
#pragma unroll
    for (int j = 0; j + w < N / 2; j += 2 * w) v[j] = Op()(v[j], v[j + w]);
  return v[0];
}

// The valid columns [lo, hi) of the backward's own row `row` in the streamed tile at x0 (tile coordinates), as
// (a, b) = (lo - 2 t, hi - 2 t) for the two-compare mask. dK/dV (row = key, columns = queries): a query sees the
// key if it is < L, the key < S and, causal, the query >= the key: lo = causal ? row - x0 : 0, hi = row < S ?
// L - x0 : lo. dQ (row = query, columns = keys): lo = 0, hi = row < L ? (causal ? min(S, row + 1) : S) - x0 : 0.
// The bounds leave through an opaque move, so that the compiler compares each element's constant column against
// them instead of rebuilding the column (x0 + fcol(i, t)) element by element.
template <bool DKDV>
__device__ __forceinline__ void span_of(int row, int x0, int t, int L, int S, int causal, int& a, int& b) {
  int lo, hi;
  if (DKDV) {
    lo = causal ? row - x0 : 0;
    hi = row < S ? L - x0 : lo;
  } else {
    lo = 0;
    hi = row < L ? (causal ? min(S, row + 1) : S) - x0 : 0;
  }
  asm("mov.b32 %0, %1;" : "=r"(a) : "r"(lo - 2 * t));
  asm("mov.b32 %0, %1;" : "=r"(b) : "r"(hi - 2 * t));
}

// store a 64 x HD accumulator block (times `mul` per row pair) as bf16 rows row_base + r, guarded by n
template <int HD>
__device__ __forceinline__ void store_rows(bf16_t* out, long long base, int st, const float* acc, int r0, int n,
                                           float mul0, float mul1, int t) {
  const int r1 = r0 + 8;
#pragma unroll
  for (int i = 0; i < HD / 2; i += 4) {
    const int c = fcol(i, t);
    if (r0 < n)
      *reinterpret_cast<unsigned*>(out + base + (long long)r0 * st + c) =
          blu_pack_bf16x2(acc[i] * mul0, acc[i + 1] * mul0);
    if (r1 < n)
      *reinterpret_cast<unsigned*>(out + base + (long long)r1 * st + c) =
          blu_pack_bf16x2(acc[i + 2] * mul1, acc[i + 3] * mul1);
  }
}
#endif

// ================================================================ forward
// Persistent: a CTA walks work tiles t = blockIdx.x, + gridDim.x, ... (query block, head), heavy (causal: late)
// query blocks first; Q is double-buffered, so the next tile's Q and first K/V stages load while this tile runs.
// smem (1024-aligned): Q[2] (HD / 64 boxes of 128 rows x 128 B each), then ST stages of {K, V} (same shape),
// then the barriers: qfull[2], qempty[2], full[ST], empty[ST].
template <int HD, int ST>
struct Fwd {
  static constexpr int BM = 128, BN = 128;
  static constexpr int TILE = BN * HD * 2;  // bytes of one K (or V, or Q) tile
  static constexpr int SMEM = 1024 + TILE * (2 + 2 * ST) + 8 * (4 + 2 * ST);
};

// PP (the 'pingpong' schedule): the two consumer warpgroups take turns issuing their products (named barriers
// 1 and 2: a warpgroup waits for its turn, issues, and hands the turn over before it waits for its results), so
// one warpgroup's softmax runs while the other's products keep the tensor cores busy, instead of both issuing at
// once and then both doing softmax. Both warpgroups issue at the same points of every work tile (their tiles are
// the same), so the turns stay in step; the products, and therefore the results, are those of the free schedule.
template <int HD, int ST, bool PP = false>
__device__ __forceinline__ void forward(const BluTmap* tmQ, const BluTmap* tmK, const BluTmap* tmV, bf16_t* o,
                                        float* lse, int L, int S, float scale, int causal, int H, int BH, Lay lo) {
#if BLU_HAVE_WGMMA
  using F = Fwd<HD, ST>;
  constexpr int BM = F::BM, BN = F::BN, TILE = F::TILE;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = blu_smem_u32(smem_raw);
  const unsigned sQ0 = raw + ((1024u - (raw & 1023u)) & 1023u);  // Q buffer b at sQ0 + b TILE
  const unsigned sKV = sQ0 + 2 * TILE;  // stage s: K at sKV + 2 s TILE, V at + TILE
  const unsigned qfull = sKV + 2 * ST * TILE, qempty = qfull + 16, full = qempty + 16, empty = full + 8 * ST;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wgi = warp >> 2;
  const int nmb = (L + BM - 1) / BM, total = nmb * BH;
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      blu_mbar_init(qfull + 8 * b, 1);
      blu_mbar_init(qempty + 8 * b, 8);
    }
    for (int s = 0; s < ST; ++s) {
      blu_mbar_init(full + 8 * s, 1);
      blu_mbar_init(empty + 8 * s, 8);  // one arrive per consumer warp
    }
    blu_mbar_init_fence();
  }
  __syncthreads();
  if (wgi == 0) {  // ---- producer ----
    blu_setmaxnreg_dec<40>();
    if (tid == 0) {
      blu_tma_prefetch(tmQ);
      blu_tma_prefetch(tmK);
      blu_tma_prefetch(tmV);
      int kv = 0, n = 0;  // K/V stages and work tiles this CTA has loaded
      for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
        const int q0 = (nmb - 1 - wt / BH) * BM, bh = wt % BH, hh = bh % H, bb = bh / H;
        const int nt = ((causal ? min(S, q0 + BM) : S) + BN - 1) / BN;
        const int qb = n & 1;
        blu_mbar_wait(qempty + 8 * qb, ((n >> 1) & 1) ^ 1);
        blu_mbar_expect_tx(qfull + 8 * qb, TILE);
#pragma unroll
        for (int b = 0; b < HD / BOX; ++b)
          blu_tma_load4(sQ0 + qb * TILE + b * BM * 128, tmQ, b * BOX, q0, hh, bb, qfull + 8 * qb);
        for (int it = 0; it < nt; ++it, ++kv) {
          const int s = kv % ST;
          blu_mbar_wait(empty + 8 * s, ((kv / ST) & 1) ^ 1);
          blu_mbar_expect_tx(full + 8 * s, 2 * TILE);
          const unsigned k = sKV + 2 * s * TILE;
#pragma unroll
          for (int b = 0; b < HD / BOX; ++b) {
            blu_tma_load4(k + b * BN * 128, tmK, b * BOX, it * BN, hh, bb, full + 8 * s);
            blu_tma_load4(k + TILE + b * BN * 128, tmV, b * BOX, it * BN, hh, bb, full + 8 * s);
          }
        }
      }
    }
    return;
  }
  // ---- consumers: warpgroup cw owns queries q0 + 64 cw .. + 63 ----
  blu_setmaxnreg_inc<232>();
  const int cw = wgi - 1, w = warp & 3, g = lane >> 2, t = lane & 3;
  const float c = scale * BLU_LOG2E;
  const bool neg = c < 0.f;
  // PP turns: warpgroup cw waits on barrier 1 + cw and hands over on 1 + (cw ^ 1); warpgroup 0 goes first
  auto my_turn = [&]() { if constexpr (PP) blu_named_barrier_sync(1 + cw, 256); };
  auto hand_over = [&]() { if constexpr (PP) blu_named_barrier_arrive(1 + (cw ^ 1), 256); };
  if (cw == 1) hand_over();
  int kv = 0, n = 0;
  for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
    const int q0 = (nmb - 1 - wt / BH) * BM, bh = wt % BH;
    const int nt = ((causal ? min(S, q0 + BM) : S) + BN - 1) / BN;
    const int qb = n & 1;
    const unsigned sQ = sQ0 + qb * TILE;
    const int r0 = q0 + cw * 64 + w * 16 + g, r1 = r0 + 8;
    float oacc[HD / 2], s[BN / 2];
    unsigned p[BN / 4];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) oacc[i] = 0.f;
    float m0 = BLU_NEG_INF, m1 = BLU_NEG_INF, l0 = 0.f, l1 = 0.f;
    blu_mbar_wait(qfull + 8 * qb, (n >> 1) & 1);

    // softmax of the tile at key k0 in s (raw scores in, probabilities out); alpha and row sums out. Every call
    // passes MASK as a literal, so each inlined copy keeps one branch of it. MASK: the tile holds keys past S or
    // past the diagonal (only a row block's last tile), so scores are scaled, masked and then reduced; otherwise
    // the row extreme is taken of the raw scores (max, or min for a negative scale: c times it is the scaled max,
    // the same rounded value) and each exponent is one FFMA, s c - m, with no mask logic. Row maxima and sums are
    // pairwise trees over a row's 32 elements (5 dependent steps, not 32).
    auto softmax = [&](const bool MASK, int k0, float& al0, float& al1, float& rs0, float& rs1) {
      float mx0, mx1;
      if (MASK) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
          const int key = k0 + fcol(i, t);
          s[i] = key >= S || (causal && key > (frow8(i) ? r1 : r0)) ? BLU_NEG_INF : s[i] * c;
        }
        mx0 = fmaxf(m0, row_reduce<BN / 2, 0, MaxOp>(s));
        mx1 = fmaxf(m1, row_reduce<BN / 2, 1, MaxOp>(s));
      } else {
        mx0 = fmaxf(m0, c * (neg ? row_reduce<BN / 2, 0, MinOp>(s) : row_reduce<BN / 2, 0, MaxOp>(s)));
        mx1 = fmaxf(m1, c * (neg ? row_reduce<BN / 2, 1, MinOp>(s) : row_reduce<BN / 2, 1, MaxOp>(s)));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      const float mu0 = mx0 == BLU_NEG_INF ? 0.f : mx0, mu1 = mx1 == BLU_NEG_INF ? 0.f : mx1;
      al0 = ex2(m0 - mu0);
      al1 = ex2(m1 - mu1);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const float mu = frow8(i) ? mu1 : mu0;
        s[i] = MASK ? ex2(s[i] - mu) : ex2(fmaf(s[i], c, -mu));
      }
      rs0 = row_reduce<BN / 2, 0, SumOp>(s);
      rs1 = row_reduce<BN / 2, 1, SumOp>(s);
      m0 = mx0;
      m1 = mx1;
    };
    // the tile at k0 needs the mask: keys past S, or (causal) keys past this warpgroup's first query
    auto masked = [&](int k0) { return k0 + BN > S || (causal && k0 + BN - 1 > q0 + cw * 64); };
    auto softmax_at = [&](int k0, float& al0, float& al1, float& rs0, float& rs1) {
      if (masked(k0))
        softmax(true, k0, al0, al1, rs0, rs1);
      else
        softmax(false, k0, al0, al1, rs0, rs1);
    };

    float al0, al1, rs0, rs1;
    // tile 0: S = Q K0^T, softmax
    blu_mbar_wait(full + 8 * (kv % ST), (kv / ST) & 1);
    my_turn();
    blu_wgmma_fence();
    ss_product<BN, HD>(s, sQ, BM, cw * 64, sKV + 2 * (kv % ST) * TILE, BN);
    blu_wgmma_commit();
    hand_over();
    blu_wgmma_wait<0>();
    blu_fence_f<BN / 2>(s);
    softmax_at(0, al0, al1, rs0, rs1);
    l0 = rs0;
    l1 = rs1;
    pack_p<BN / 2>(s, p);
    // one pipelined step: tile it's S issued with tile it-1's P V, tile it's softmax while P V runs
    auto step = [&](const bool mask, int it) {
      const int st = (kv + it) % ST, pst = (kv + it - 1) % ST;
      blu_mbar_wait(full + 8 * st, ((kv + it) / ST) & 1);
      my_turn();
      blu_wgmma_fence();
      ss_product<BN, HD>(s, sQ, BM, cw * 64, sKV + 2 * st * TILE, BN);  // S_i = Q K_i^T
      blu_wgmma_commit();
      rs_product<BN, HD>(oacc, p, sKV + 2 * pst * TILE + TILE, BN);  // O += P_{i-1} V_{i-1}
      blu_wgmma_commit();
      hand_over();
      blu_wgmma_wait<1>();
      blu_fence_f<BN / 2>(s);
      softmax(mask, it * BN, al0, al1, rs0, rs1);
      blu_wgmma_wait<0>();
      blu_fence_f<HD / 2>(oacc);
      blu_fence_u<BN / 4>(p);
      if (lane == 0) blu_mbar_arrive(empty + 8 * pst);
#pragma unroll
      for (int i = 0; i < HD / 2; ++i) oacc[i] *= frow8(i) ? al1 : al0;
      l0 = l0 * al0 + rs0;
      l1 = l1 * al1 + rs1;
      pack_p<BN / 2>(s, p);
    };
    // only a row block's last tile can hold keys past S or past the diagonal: the others take the unmasked step
    for (int it = 1; it < nt - 1; ++it) step(false, it);
    if (nt > 1) {
      if (masked((nt - 1) * BN))
        step(true, nt - 1);
      else
        step(false, nt - 1);
    }
    {
      const int pst = (kv + nt - 1) % ST;
      my_turn();
      blu_wgmma_fence();
      rs_product<BN, HD>(oacc, p, sKV + 2 * pst * TILE + TILE, BN);
      blu_wgmma_commit();
      hand_over();
      blu_wgmma_wait<0>();
      blu_fence_f<HD / 2>(oacc);
      blu_fence_u<BN / 4>(p);
      if (lane == 0) {
        blu_mbar_arrive(empty + 8 * pst);
        blu_mbar_arrive(qempty + 8 * qb);  // every product reading this Q buffer is done
      }
    }
    kv += nt;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
    store_rows<HD>(o, lo.base(bh), lo.st, oacc, r0, L, i0, i1, t);
    if (t == 0) {
      if (r0 < L) lse[(long long)bh * L + r0] = l0 > 0.f ? (m0 + log2f(l0)) * BLU_LN2 : BLU_NEG_INF;
      if (r1 < L) lse[(long long)bh * L + r1] = l1 > 0.f ? (m1 + log2f(l1)) * BLU_LN2 : BLU_NEG_INF;
    }
  }  // work tiles
#else
  asm volatile("trap;");
#endif
}

// ================================================================ backward
// Persistent like the forward: work tiles (own block, head), dK/dV: early key blocks first (most query tiles
// under causal), dQ: late query blocks first. smem (1024-aligned): two buffers of {own A, own B} (HD / 64 boxes
// of 128 rows x 128 B each: K, V for dK/dV; Q, dO for dQ), then ST stages of {X, Y} tiles of 64 rows (Q, dO for
// dK/dV; K, V for dQ), then ofull[2], oempty[2], full[ST], empty[ST], then ST slots of the stages' 64 (lse2, D)
// pairs (512 B each; dK/dV). A tile's last products (dV, dK or dQ) stay in flight while the next streamed tile is
// awaited and its S, dP issued.
// The fused kernel adds four dS^T tiles (two buffers for each consumer warpgroup, 64 x 128 B) between the stages and
// the barriers (HD 128 with two stages is 225 KB, inside sm_90's 227 KB opt-in), and at HD 64 the two 16 KB dQ
// staging tiles after them.
// Head dim 64's fused backward reduces each dQ partial in bulk from a staging tile (two of 16 KB, one a consumer
// warpgroup, after the dS^T tiles); head dim 128 has no room for them and keeps red.global.add.
template <int HD>
constexpr bool bulk_dq = HD == 64;
template <int HD, int ST>
struct Bwd {
  static constexpr int OWN = 128 * HD * 2, TILE = 64 * HD * 2, DST = 64 * 64 * 2, STAGE = 64 * 64 * 4, LDS = 64 * 8;
  static constexpr int SMEM = 1024 + 4 * OWN + 2 * ST * TILE + 8 * (4 + 2 * ST) + ST * LDS;
  static constexpr int SMEM_FUSED = SMEM + 4 * DST + (bulk_dq<HD> ? 2 * STAGE : 0);
  static_assert(SMEM_FUSED <= 227 * 1024, "fused backward shared memory exceeds sm_90's opt-in limit");
};

// DKDV true: dK/dV kernel (own = 128 keys, streamed = query tiles); false: dQ kernel (own = 128 queries).
// FUSED (with DKDV): the dK/dV kernel that also adds each tile's dS K into the zeroed fp32 accumulator dqa (BH, L, HD).
template <int HD, int ST, bool DKDV, bool FUSED = false>
__device__ __forceinline__ void backward(const BluTmap* tmA, const BluTmap* tmB, const BluTmap* tmX,
                                         const BluTmap* tmY, const float* __restrict__ ld, bf16_t* out0, bf16_t* out1,
                                         float* __restrict__ dqa, int L, int S, float scale, int causal, int H,
                                         int BH, Lay lout) {
#if BLU_HAVE_WGMMA
  static_assert(DKDV || !FUSED, "the fused backward is the dK/dV kernel plus dQ");
  using B = Bwd<HD, ST>;
  constexpr int OWN = B::OWN, TILE = B::TILE, NB = HD / BOX;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = blu_smem_u32(smem_raw);
  const unsigned sO = raw + ((1024u - (raw & 1023u)) & 1023u);  // own buffer b: A at sO + 2 b OWN, B at + OWN
  const unsigned sX = sO + 4 * OWN;
  const unsigned sDS = sX + 2 * ST * TILE;  // FUSED: dS^T tile b of warpgroup cw at sDS + (2 cw + b) DST
  constexpr bool BULK = FUSED && bulk_dq<HD>;
  const unsigned sStage = sDS + 4 * B::DST;  // BULK: warpgroup cw's dQ staging tile at sStage + cw STAGE
  const unsigned ofull = sDS + (FUSED ? 4 * B::DST + (BULK ? 2 * B::STAGE : 0) : 0), oempty = ofull + 16,
                 full = oempty + 16, empty = full + 8 * ST;
  const unsigned sLD = empty + 8 * ST;  // the (lse2, D) slot of stage s at sLD + s LDS (16-byte aligned)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wgi = warp >> 2;
  const int nob = ((DKDV ? S : L) + 127) / 128, total = nob * BH, nqb = (L + 63) / 64, Lp = 64 * nqb;
  // work tile wt: own rows own0 .. own0 + 127 of head bh; streamed rows [first, end) in tiles of 64
  auto decode = [&](int wt, int& own0, int& bh, int& first, int& nt) {
    const int blk = DKDV ? wt / BH : nob - 1 - wt / BH;
    own0 = blk * 128;
    bh = wt % BH;
    int end;
    first = 0;
    if (DKDV) {
      first = causal ? own0 : 0;
      end = L;
    } else {
      end = causal ? min(S, own0 + 128) : S;
    }
    nt = end > first ? (end - first + 63) / 64 : 0;
  };
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      blu_mbar_init(ofull + 8 * b, 1);
      blu_mbar_init(oempty + 8 * b, 8);
    }
    for (int s = 0; s < ST; ++s) {
      blu_mbar_init(full + 8 * s, 1);
      blu_mbar_init(empty + 8 * s, 8);
    }
    blu_mbar_init_fence();
  }
  __syncthreads();
  if (wgi == 0) {  // ---- producer ----
    blu_setmaxnreg_dec<40>();
    if (tid == 0) {
      blu_tma_prefetch(tmA);
      blu_tma_prefetch(tmB);
      blu_tma_prefetch(tmX);
      blu_tma_prefetch(tmY);
      int kv = 0, n = 0;
      for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
        int own0, bh, first, nt;
        decode(wt, own0, bh, first, nt);
        const int hh = bh % H, bb = bh / H, ob = n & 1;
        const unsigned a = sO + 2 * ob * OWN;
        blu_mbar_wait(oempty + 8 * ob, ((n >> 1) & 1) ^ 1);
        blu_mbar_expect_tx(ofull + 8 * ob, 2 * OWN);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          blu_tma_load4(a + b * 128 * 128, tmA, b * BOX, own0, hh, bb, ofull + 8 * ob);
          blu_tma_load4(a + OWN + b * 128 * 128, tmB, b * BOX, own0, hh, bb, ofull + 8 * ob);
        }
        for (int it = 0; it < nt; ++it, ++kv) {
          const int s = kv % ST;
          blu_mbar_wait(empty + 8 * s, ((kv / ST) & 1) ^ 1);
          blu_mbar_expect_tx(full + 8 * s, 2 * TILE + (DKDV ? B::LDS : 0));
          const unsigned x = sX + 2 * s * TILE;
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            blu_tma_load4(x + b * 64 * 128, tmX, b * BOX, first + it * 64, hh, bb, full + 8 * s);
            blu_tma_load4(x + TILE + b * 64 * 128, tmY, b * BOX, first + it * 64, hh, bb, full + 8 * s);
          }
          if (DKDV)
            blu_bulk_load(sLD + s * B::LDS, ld + 2 * ((long long)bh * Lp + first + it * 64), B::LDS, full + 8 * s);
        }
      }
    }
    return;
  }
  // ---- consumers: warpgroup cw owns rows own0 + 64 cw .. + 63 ----
  blu_setmaxnreg_inc<232>();
  const int cw = wgi - 1, w = warp & 3, g = lane >> 2, t = lane & 3;
  const float c = scale * BLU_LOG2E;
  int kv = 0, n = 0, nds = 0;  // nds (FUSED): dS^T tiles this warpgroup has stored (the buffer's parity)
  for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
    int own0, bh, first, nt;
    decode(wt, own0, bh, first, nt);
    const int ob = n & 1;
    const unsigned sA = sO + 2 * ob * OWN, sB = sA + OWN;
    const int r0 = own0 + cw * 64 + w * 16 + g, r1 = r0 + 8;  // own rows (keys for dK/dV, queries for dQ)
    const long long rowoff = (long long)bh * Lp;  // this head's first (lse2, D) pair
    float acc0[HD / 2], acc1[HD / 2];  // dK/dV: dK, dV; dQ: dQ (acc1 unused)
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) acc0[i] = acc1[i] = 0.f;
    float sv[32], dp[32];
    unsigned pp[16], ds[16];
    float lq0 = 0.f, lq1 = 0.f, dq0 = 0.f, dq1 = 0.f;  // dQ: this thread's two rows' lse * log2 e and D
    float dqp[32];  // FUSED: one 64-column chunk of this tile's dQ partial
    if (!DKDV) {
      if (r0 < L) lq0 = ld[2 * (rowoff + r0)], dq0 = ld[2 * (rowoff + r0) + 1];
      if (r1 < L) lq1 = ld[2 * (rowoff + r1)], dq1 = ld[2 * (rowoff + r1) + 1];
    }
    blu_mbar_wait(ofull + 8 * ob, (n >> 1) & 1);
    int pending = -1;  // stage whose last products are still in flight
    for (int it = 0; it < nt; ++it) {
      const int st = (kv + it) % ST;
      const int x0 = first + it * 64;  // first streamed row of the tile
      const unsigned x = sX + 2 * st * TILE, y = x + TILE;
      // tiles this warpgroup's rows cannot see under causal: no work (dK/dV: all queries before its first key;
      // dQ: all keys after its last query)
      const bool skip = causal && (DKDV ? x0 + 63 < own0 + cw * 64 : x0 > own0 + cw * 64 + 63);
      blu_mbar_wait(full + 8 * st, ((kv + it) / ST) & 1);
      if (skip) {
        if (lane == 0) blu_mbar_arrive(empty + 8 * st);
        continue;
      }
      // dK/dV: the streamed queries' (lse2, D) for this thread's columns 8 k + 2 t, + 1 from the stage's slot:
      // one 16-byte load a column pair (the 4 t lanes of a row read 64 contiguous bytes, the 8 g lanes the same)
      float lc[16], dc[16];
      if (DKDV) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const unsigned a = sLD + st * B::LDS + (unsigned)((8 * k + 2 * t) * 8);
          asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                       : "=f"(lc[2 * k]), "=f"(dc[2 * k]), "=f"(lc[2 * k + 1]), "=f"(dc[2 * k + 1])
                       : "r"(a));
        }
      }
      blu_wgmma_fence();
      ss_product<64, HD>(sv, sA, 128, cw * 64, x, 64);  // dK/dV: S^T = K Q^T; dQ: S = Q K^T
      ss_product<64, HD>(dp, sB, 128, cw * 64, y, 64);  // dK/dV: dP^T = V dO^T; dQ: dP = dO V^T
      blu_wgmma_commit();
      if (pending >= 0) {  // the previous tile's products: done before their operands are rewritten
        blu_wgmma_wait<1>();
        blu_fence_f<HD / 2>(acc0);
        if (DKDV) blu_fence_f<HD / 2>(acc1);
        blu_fence_u<16>(pp);
        blu_fence_u<16>(ds);
        if (lane == 0) blu_mbar_arrive(empty + 8 * pending);
      }
      blu_wgmma_wait<0>();
      blu_fence_f<32>(sv);
      blu_fence_f<32>(dp);
      // The mask as two compares of a constant an element: element i's column in the tile is fcol(i, 0) + 2 t (the
      // first term a constant once unrolled) and a row's valid columns are [lo, hi) (span_of), so the element is
      // valid iff lo - 2 t <= fcol(i, 0) < hi - 2 t.
      int a0, b0, a1, b1;
      span_of<DKDV>(r0, x0, t, L, S, causal, a0, b0);
      span_of<DKDV>(r1, x0, t, L, S, causal, a1, b1);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int ci = fcol(i, 0);
        const bool valid = frow8(i) ? ci >= a1 && ci < b1 : ci >= a0 && ci < b0;
        float pv, dsv;
        if (DKDV) {  // row = key, col = query
          const int j = 2 * (i >> 2) + (i & 1);
          pv = ex2(sv[i] * c - lc[j]);
          if (!valid) pv = 0.f;  // padded keys: no dS for dQ either
          dsv = pv * (dp[i] - dc[j]);
        } else {  // row = query, col = key
          pv = ex2(sv[i] * c - (frow8(i) ? lq1 : lq0));
          if (!valid) pv = 0.f;
          dsv = pv * (dp[i] - (frow8(i) ? dq1 : dq0));
        }
        sv[i] = pv;
        dp[i] = dsv;
      }
      pack_p<32>(sv, pp);
      pack_p<32>(dp, ds);
      if constexpr (FUSED) {
        // dS^T to shared memory, visible to the tensor cores (async proxy) once every thread of the warpgroup has
        // stored and fenced: the named barrier of this warpgroup only (id 1 + cw), so the two warpgroups never
        // wait for each other. Two buffers: the one written here was last read by the dQ product two tiles ago,
        // which every warp of the warpgroup saw complete before the previous tile's barrier.
        const unsigned dst = sDS + (unsigned)((2 * cw + (nds & 1)) * B::DST), k_own = sA + cw * 64 * 128;
        ++nds;
        store_dst(dst, ds, w, g, t);
        blu_fence_proxy_async();
        // BULK: the previous tile's reduction has read the staging tile before the barrier lets anyone rewrite it
        if constexpr (BULK) if ((tid & 127) == 0) blu_bulk_wait_read<0>();
        blu_named_barrier_sync(1 + cw, 128);
        blu_wgmma_fence();
        dq_chunk(dqp, dst, k_own, 0);
        blu_wgmma_commit();
        rs_product<64, HD>(acc1, pp, y, 64);  // dV += P^T dO
        rs_product<64, HD>(acc0, ds, x, 64);  // dK += dS^T Q
        blu_wgmma_commit();
        // The partials of the two warpgroups (their own 64 keys, the same 64 queries) are added separately, not
        // summed in shared memory first: that would take a 256-thread barrier every tile, locking the warpgroups
        // together (their causal skips differ, and one's softmax is meant to overlap the other's products), and
        // at HD 128 another 32 KB of shared memory that does not fit. red is fire-and-forget, resolved in L2.
        blu_wgmma_wait<1>();  // the dQ chunk is done; dV, dK still in flight
        blu_fence_f<32>(dqp);
        if constexpr (BULK) {  // one 16 KB bulk reduction of the warpgroup's whole partial
          const unsigned stg = sStage + (unsigned)(cw * B::STAGE);
          stage_dq(stg, dqp, tid & 127);
          blu_fence_proxy_async();
          blu_named_barrier_sync(1 + cw, 128);
          if ((tid & 127) == 0) {
            blu_bulk_reduce_add_f32(dqa + ((long long)bh * nqb + x0 / 64) * 4096, stg, B::STAGE);
            blu_bulk_commit();
          }
        } else {
          const long long arow = (long long)bh * L * HD;
          red_dq<HD>(dqa + arow, dqp, 0, x0, L, w, g, t);
#pragma unroll
          for (int cc = 1; cc < NB; ++cc) {  // HD 128: the second chunk in the same 32 registers
            blu_wgmma_fence();
            dq_chunk(dqp, dst, k_own, cc);
            blu_wgmma_commit();
            blu_wgmma_wait<0>();
            blu_fence_f<32>(dqp);
            red_dq<HD>(dqa + arow, dqp, cc, x0, L, w, g, t);
          }
        }
        pending = st;
        continue;
      }
      blu_wgmma_fence();
      if (DKDV) {
        rs_product<64, HD>(acc1, pp, y, 64);  // dV += P^T dO
        rs_product<64, HD>(acc0, ds, x, 64);  // dK += dS^T Q
      } else {
        rs_product<64, HD>(acc0, ds, x, 64);  // dQ += dS K
      }
      blu_wgmma_commit();
      pending = st;
    }
    blu_wgmma_wait<0>();
    blu_fence_f<HD / 2>(acc0);
    if (DKDV) blu_fence_f<HD / 2>(acc1);
    blu_fence_u<16>(pp);
    blu_fence_u<16>(ds);
    if (lane == 0) {
      if (pending >= 0) blu_mbar_arrive(empty + 8 * pending);
      blu_mbar_arrive(oempty + 8 * ob);  // this own buffer is free
    }
    kv += nt;
    const int rows = DKDV ? S : L;
    store_rows<HD>(out0, lout.base(bh), lout.st, acc0, r0, rows, scale, scale, t);
    if (DKDV) store_rows<HD>(out1, lout.base(bh), lout.st, acc1, r0, rows, 1.f, 1.f, t);
  }
  if constexpr (BULK) if ((tid & 127) == 0) blu_bulk_wait<0>();  // the staging tiles outlive every reduction
#else
  asm volatile("trap;");
#endif
}

// ================================================================ backward preprocess
// ld[row] = (lse[bh, i] * log2 e, D = sum_d dO[bh, i, d] * O[bh, i, d]) (fp32 pairs), row = bh * Lp + i, Lp =
// ceil(L / 64) * 64, (0, 0) for i >= L: HD / 8 adjacent threads a row, 16-byte loads of 8 bf16 each, a shuffle
// reduction inside the group (plain CUDA: runs on any architecture).
template <int HD>
__device__ __forceinline__ void preprocess(const bf16_t* __restrict__ dout, const bf16_t* __restrict__ o,
                                           const float* __restrict__ lse, float2* __restrict__ ld, int BH, int L,
                                           Lay lo) {
  constexpr int G = HD / 8;  // threads per row
  const int Lp = (L + 63) / 64 * 64;
  const long long rows = (long long)BH * Lp, nthr = (long long)gridDim.x * blockDim.x;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < rows * G; idx += nthr) {
    const long long row = idx / G;
    const int part = (int)(idx % G), bh = (int)(row / Lp), i = (int)(row % Lp);
    if (i >= L) {  // padding: a whole group takes this branch together
      if (part == 0) ld[row] = make_float2(0.f, 0.f);
      continue;
    }
    const long long off = lo.base(bh) + (long long)i * lo.st + part * 8;
    float a[8], b[8];
    load_vec(dout + off, a);
    load_vec(o + off, b);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += a[j] * b[j];
#pragma unroll
    for (int m = G / 2; m > 0; m >>= 1) sum += __shfl_xor_sync(__activemask(), sum, m);  // whole groups
    if (part == 0) ld[row] = make_float2(lse[(long long)bh * L + i] * BLU_LOG2E, sum);
  }
}

// dq = scale * acc (the fused backward's fp32 accumulator) as bf16 through dq's layout: HD / 8 threads a row, one
// 16-byte store of 8 elements each (plain CUDA: any architecture). Head dim 128: acc (BH, L, HD) dense, two 16-byte
// loads; head dim 64: acc (BH, ceil(L / 64), 64 x 64) in stage_dq's tile-fragment order, where columns 8 i4 .. + 7
// of query row r of a tile are the pairs at (i4 * 128 + 32 (r / 16) + 4 (r % 8) + t) * 4 + 2 ((r / 8) % 2), t < 4.
template <int HD>
__device__ __forceinline__ void dq_convert(const float* __restrict__ acc, bf16_t* __restrict__ dq, long long rows,
                                           int L, float scale, Lay lq) {
  constexpr int G = HD / 8;
  const long long nthr = (long long)gridDim.x * blockDim.x;
  const int nqb = (L + 63) / 64;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < rows * G; idx += nthr) {
    const long long row = idx / G;
    const int part = (int)(idx % G);
    float v[8];
    if constexpr (bulk_dq<HD>) {
      const int q = (int)(row % L), r = q % 64;
      const float* tile = acc + ((row / L) * nqb + q / 64) * 4096;
      const int e0 = (part * 128 + 32 * (r / 16) + 4 * (r % 8)) * 4 + 2 * ((r / 8) % 2);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float2 a = *reinterpret_cast<const float2*>(tile + e0 + 4 * t);
        v[2 * t] = a.x * scale;
        v[2 * t + 1] = a.y * scale;
      }
    } else {
      const float4 a = *reinterpret_cast<const float4*>(acc + row * HD + part * 8);
      const float4 b = *reinterpret_cast<const float4*>(acc + row * HD + part * 8 + 4);
      v[0] = a.x * scale, v[1] = a.y * scale, v[2] = a.z * scale, v[3] = a.w * scale;
      v[4] = b.x * scale, v[5] = b.y * scale, v[6] = b.z * scale, v[7] = b.w * scale;
    }
    store_vec(dq + lq.base((int)(row / L)) + (row % L) * lq.st + part * 8, v);
  }
}

}  // namespace wg

// Entries per head dim: forward (free and pingpong schedules), dK/dV and dQ, the fused backward (dK/dV's arguments plus the fp32 dQ accumulator)
// and its dq conversion, the preprocess. Tensor maps (blutensor/backends/cupy/tma.py, 4-D: head dim, row,
// head, batch; boxes of 64 elements x 128 rows, the dK/dV kernel's Q/dO and the dQ kernel's K/V maps 64 rows);
// H heads; the output layouts as (sb, sh, st) (dK and dV share one). FST / BST: stages of the ring.
#define BLU_TM const __grid_constant__ BluTmap
#define WGMMA_ENTRIES(HD, FST, BST)                                                                                  \
  extern "C" __global__ void __launch_bounds__(wg::THREADS, 1) blu_sdpa_wgmma_bf16_hd##HD##_fwd(                    \
      BLU_TM tmQ, BLU_TM tmK, BLU_TM tmV, bf16_t* o, float* lse, int L, int S, float scale, int causal, int H,        \
      int BH, long long o_sb, long long o_sh, int o_st) {                                                            \
    wg::forward<HD, FST>(&tmQ, &tmK, &tmV, o, lse, L, S, scale, causal, H, BH, lay(o_sb, o_sh, o_st, H));           \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(wg::THREADS, 1) blu_sdpa_wgmma_bf16_hd##HD##_fwd_pp(                 \
      BLU_TM tmQ, BLU_TM tmK, BLU_TM tmV, bf16_t* o, float* lse, int L, int S, float scale, int causal, int H,        \
      int BH, long long o_sb, long long o_sh, int o_st) {                                                            \
    wg::forward<HD, FST, true>(&tmQ, &tmK, &tmV, o, lse, L, S, scale, causal, H, BH, lay(o_sb, o_sh, o_st, H));     \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(wg::THREADS, 1) blu_sdpa_wgmma_bf16_hd##HD##_bwd_dkdv(              \
      BLU_TM tmK, BLU_TM tmV, BLU_TM tmQ, BLU_TM tmO, const float* ld, bf16_t* dk, bf16_t* dv, int L, int S,         \
      float scale, int causal, int H, int BH, long long k_sb, long long k_sh, int k_st) {                            \
    wg::backward<HD, BST, true>(&tmK, &tmV, &tmQ, &tmO, ld, dk, dv, nullptr, L, S, scale, causal, H, BH,            \
                                lay(k_sb, k_sh, k_st, H));                                                           \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(wg::THREADS, 1) blu_sdpa_wgmma_bf16_hd##HD##_bwd_dq(                \
      BLU_TM tmQ, BLU_TM tmO, BLU_TM tmK, BLU_TM tmV, const float* ld, bf16_t* dq, int L, int S, float scale,       \
      int causal, int H, int BH, long long q_sb, long long q_sh, int q_st) {                                         \
    wg::backward<HD, BST, false>(&tmQ, &tmO, &tmK, &tmV, ld, dq, dq, nullptr, L, S, scale, causal, H, BH,           \
                                 lay(q_sb, q_sh, q_st, H));                                                          \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(wg::THREADS, 1) blu_sdpa_wgmma_bf16_hd##HD##_bwd_fused(             \
      BLU_TM tmK, BLU_TM tmV, BLU_TM tmQ, BLU_TM tmO, const float* ld, bf16_t* dk, bf16_t* dv, float* dqa, int L,   \
      int S, float scale, int causal, int H, int BH, long long k_sb, long long k_sh, int k_st) {                     \
    wg::backward<HD, BST, true, true>(&tmK, &tmV, &tmQ, &tmO, ld, dk, dv, dqa, L, S, scale, causal, H, BH,          \
                                      lay(k_sb, k_sh, k_st, H));                                                     \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) blu_sdpa_wgmma_bf16_hd##HD##_bwd_dq_convert(                 \
      const float* acc, bf16_t* dq, long long rows, int L, float scale, int H, long long q_sb, long long q_sh,       \
      int q_st) {                                                                                                    \
    wg::dq_convert<HD>(acc, dq, rows, L, scale, lay(q_sb, q_sh, q_st, H));                                          \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) blu_sdpa_wgmma_bf16_hd##HD##_preprocess(                     \
      const bf16_t* dout, const bf16_t* o, const float* lse, float2* ld, int BH, int L, int H, long long o_sb,      \
      long long o_sh, int o_st) {                                                                                    \
    wg::preprocess<HD>(dout, o, lse, ld, BH, L, lay(o_sb, o_sh, o_st, H));                                          \
  }

WGMMA_ENTRIES(64, 3, 3)
WGMMA_ENTRIES(128, 2, 2)
