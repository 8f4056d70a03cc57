// Flash attention for Hopper (sm_90a), fp32 storage, tf32 products on the tensor cores (wgmma .tf32), fp32
// accumulation and softmax: variant 'tf32_wgmma' (backends/cupy/sdpa.py); forward for head dims 64 and 128, the
// deterministic backward (dK/dV kernel + dQ kernel, no atomics) for head dim 64.
// blu-nvrtc-archs: 90a   (the bodies exist only when compiled for sm_90a; elsewhere the kernels trap)
// Conventions as kernels/sdpa_wgmma.cu: q (BH, L, HD), k (BH, S, HD) read through 4-D tensor maps (head dim, row,
// head, batch: dense tensors are H = 1, fused qkv views (B, T, 3, H, HD) strides); o written through struct Lay;
// lse (BH, L) fp32 natural log (-inf for an empty row); causal = query i sees keys j <= i.
// tf32 operands: wgmma .tf32 takes only K-major shared-memory operands (no transpose), fp32 elements are 4 bytes,
// so one 128-byte swizzle row holds 32 elements: TMA boxes of 32 columns, a k-step (k8) is 32 bytes of a row, and
// kmajor() below is the bf16 kernels' descriptor arithmetic in bytes. S = Q K^T reads Q and K as they are (both
// K-major over the head dim). O += P V needs V with the keys as the K dimension: transpose_rows writes V^T
// (BH, HD, Sp) (Sp = S rounded up to 8, padding zero) into a scratch buffer, and TMA loads its (HD rows x 32 keys)
// boxes. The backward's register-A products read Q^T, dO^T (dV += P^T dO, dK += dS^T Q) and K^T (dQ += dS K) the
// same way, from scratch transposes made by the same kernel.
// P as the A operand from registers: the tf32 A fragment of a warp's 16 rows holds (row g, k t), (g + 8, t),
// (g, t + 4), (g + 8, t + 4) while the accumulator holds (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of
// each 8 columns. Instead of quad shuffles, the keys inside every group of 8 are permuted: k position p holds key
// 2p (p < 4) or 2 (p - 4) + 1 (p >= 4), so the accumulator registers ARE the A fragment (reordered), and
// transpose_rows writes the transposes' columns in the same permuted order (sdpa_mma.cu's TF32::raw_b uses the
// same permutation).
// Rounding: the tensor cores read fp32 bit patterns as tf32 (the low 13 mantissa bits ignored: truncation), so the
// operands TMA loads as stored (Q, K in S = Q K^T; V, dO in dP) are truncated; the transposes (rounded once as
// transpose_rows writes them) and P, dS (rounded in registers) are rounded to nearest, ties away
// (cvt.rna.tf32.f32), as the mma.sync 'tf32' kernels round theirs.
// Every main kernel: 384 threads, warpgroup 0 the producer (one thread issues the TMA loads, setmaxnreg.dec),
// warpgroups 1 and 2 the consumers (setmaxnreg.inc), 64 query rows each; a ring of ST stages of {K, V^T} guarded
// by full / empty mbarriers, QB Q buffers (qfull / qempty). Persistent CTAs walk (query block, head) work tiles,
// heavy (causal: late) query blocks first. Pipelined as the bf16 forward: tile i's Q K^T and tile i-1's P V are
// issued together, the softmax of tile i runs while P V is in flight, then O is rescaled.
// Tiles (fp32 doubles the bytes of bf16): forward HD 64: 128 keys a tile, 2 Q buffers, 2 stages (193 KB); HD 128:
// 64 keys a tile, 1 Q buffer, 2 stages (193 KB). Backward HD 64: one own buffer, dK/dV 2 stages (193 KB), dQ 3
// stages (209 KB).
// Backward (deterministic, after D = rowsum(dO * O), the preprocess entry): dK/dV kernel: 128 keys a CTA (K, V
// loaded once), tiles of 64 queries {Q, dO, Q^T, dO^T} streamed; S^T = K Q^T, dP^T = V dO^T (SS), P^T and
// dS^T = P^T (dP^T - D) in registers, dV += P^T dO (B = dO^T) and dK += dS^T Q (B = Q^T) (RS). dQ kernel: 128
// queries a CTA, tiles of 64 keys {K, V, K^T}; S = Q K^T, dP = dO V^T (SS), dQ += dS K (B = K^T, RS). P and dS
// overwrite the S and dP registers (fp32 takes twice bf16's registers), so a tile's RS products complete before
// the next tile's SS products are issued; the two consumer warpgroups keep the tensor cores busy in turn.
// Head dim 128 (the tiles do not fit next to their transposes in 227 KB) runs the mma.sync 'tf32' backward.
// dev/emulate_sdpa_wgmma_tf32.py checks the swizzle, descriptor, fragment and permutation index math on the CPU.

#include "sdpa_layout.cuh"
#include "hopper.cuh"

#define BLU_NEG_INF (-__int_as_float(0x7f800000))
#define BLU_LOG2E 1.4426950408889634f
#define BLU_LN2 0.6931471805599453f

namespace wgt {

constexpr int THREADS = 384;
constexpr int BOX = 32;  // fp32 elements of one TMA box row: 128 bytes, the swizzle span

// tf32 of x, round to nearest (ties away from zero), as an fp32 bit pattern with the low 13 bits zero
__device__ __forceinline__ unsigned rna(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
// key of permuted position p inside a group of 8 (see the header): 0 2 4 6 1 3 5 7
__device__ __forceinline__ int perm8(int p) { return (p & 4) ? 2 * (p & 3) + 1 : 2 * p; }

#if BLU_HAVE_WGMMA
// Descriptor of a K-major operand (rows of `rows_box` x 128 B per box of 32 k-elements): k-step j (8 elements)
__device__ __forceinline__ unsigned long long kmajor(unsigned base, int rows_box, int row0, int j) {
  return blu_desc(base + (unsigned)((j >> 2) * rows_box * 128 + row0 * 128 + (j & 3) * 32), 16, 1024);
}
// SS product acc (64 x N) = A (64 x HD) B^T, N rows of B (both K-major over HD); HD / 8 k-steps, the first
// overwriting acc
template <int N, int HD>
__device__ __forceinline__ void ss_product(float* acc, unsigned a, int a_rows_box, int a_row0, unsigned b,
                                           int b_rows_box) {
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
    const unsigned long long da = kmajor(a, a_rows_box, a_row0, j), db = kmajor(b, b_rows_box, 0, j);
    if constexpr (N == 128)
      blu_wgmma_ss_m64n128k8_tf32(acc, da, db, j > 0);
    else
      blu_wgmma_ss_m64n64k8_tf32(acc, da, db, j > 0);
  }
}
// RS product acc (64 x HD) += P (64 x K keys, registers p: K / 8 k-steps of 4) V, V given as the V^T tile (HD
// rows x K permuted keys, K-major, boxes of 32 keys HD rows x 128 B apart)
template <int K, int HD>
__device__ __forceinline__ void rs_product(float* acc, const unsigned* p, unsigned vt) {
#pragma unroll
  for (int kk = 0; kk < K / 8; ++kk) {
    const unsigned long long db = kmajor(vt, HD, 0, kk);
    if constexpr (HD == 128)
      blu_wgmma_rs_m64n128k8_tf32(acc, p + 4 * kk, db, 1);
    else
      blu_wgmma_rs_m64n64k8_tf32(acc, p + 4 * kk, db, 1);
  }
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// The A fragments of P from the accumulator-layout probabilities s: k-step kk's registers 4 kk .. 4 kk + 3 are
// (row g, k t) = s[4 kk] (key 2t), (g + 8, t) = s[4 kk + 2], (g, t + 4) = s[4 kk + 1] (key 2t + 1),
// (g + 8, t + 4) = s[4 kk + 3]; each rounded to tf32
template <int N>
__device__ __forceinline__ void pack_p(const float* s, unsigned* p) {
#pragma unroll
  for (int kk = 0; kk < N / 4; ++kk) {
    p[4 * kk + 0] = rna(s[4 * kk + 0]);
    p[4 * kk + 1] = rna(s[4 * kk + 2]);
    p[4 * kk + 2] = rna(s[4 * kk + 1]);
    p[4 * kk + 3] = rna(s[4 * kk + 3]);
  }
}
// pack_p on the accumulator array itself: the tf32 bit patterns of k-step kk's A fragment in s[4 kk .. 4 kk + 3]
template <int N>
__device__ __forceinline__ void pack_inplace(float* s) {
#pragma unroll
  for (int kk = 0; kk < N / 4; ++kk) {
    const float a = s[4 * kk + 1], b = s[4 * kk + 2];
    s[4 * kk + 0] = __uint_as_float(rna(s[4 * kk + 0]));
    s[4 * kk + 1] = __uint_as_float(rna(b));
    s[4 * kk + 2] = __uint_as_float(rna(a));
    s[4 * kk + 3] = __uint_as_float(rna(s[4 * kk + 3]));
  }
}
// rs_product with the A fragments held as fp32 bit patterns (pack_inplace), B the transposed tile at `bt` (HD rows x
// K permuted positions, K-major)
template <int K, int HD>
__device__ __forceinline__ void rs_product_f(float* acc, const float* p, unsigned bt) {
#pragma unroll
  for (int kk = 0; kk < K / 8; ++kk) {
    const unsigned a[4] = {__float_as_uint(p[4 * kk]), __float_as_uint(p[4 * kk + 1]), __float_as_uint(p[4 * kk + 2]),
                           __float_as_uint(p[4 * kk + 3])};
    const unsigned long long db = kmajor(bt, HD, 0, kk);
    if constexpr (HD == 128)
      blu_wgmma_rs_m64n128k8_tf32(acc, a, db, 1);
    else
      blu_wgmma_rs_m64n64k8_tf32(acc, a, db, 1);
  }
}
__device__ __forceinline__ int fcol(int i, int t) { return 8 * (i >> 2) + 2 * t + (i & 1); }
__device__ __forceinline__ bool frow8(int i) { return (i & 2) != 0; }

// store a 64 x HD accumulator block (times `mul` per row) as fp32 rows r0 (and r0 + 8), guarded by n
template <int HD>
__device__ __forceinline__ void store_rows(float* out, long long base, int st, const float* acc, int r0, int n,
                                           float mul0, float mul1, int t) {
  const int r1 = r0 + 8;
#pragma unroll
  for (int i = 0; i < HD / 2; i += 4) {
    const int c = fcol(i, t);
    if (r0 < n)
      *reinterpret_cast<float2*>(out + base + (long long)r0 * st + c) = make_float2(acc[i] * mul0, acc[i + 1] * mul0);
    if (r1 < n)
      *reinterpret_cast<float2*>(out + base + (long long)r1 * st + c) =
          make_float2(acc[i + 2] * mul1, acc[i + 3] * mul1);
  }
}
#endif

// ================================================================ forward
// smem (1024-aligned): QB Q buffers (HD / 32 boxes of 128 rows x 128 B), then ST stages of {K (HD / 32 boxes of
// BN rows x 128 B), V^T (BN / 32 boxes of HD rows x 128 B)}, then qfull[QB], qempty[QB], full[ST], empty[ST].
template <int HD, int BN, int QB, int ST>
struct Fwd {
  static constexpr int BM = 128;
  static constexpr int QTILE = BM * HD * 4, KTILE = BN * HD * 4;  // V^T tile: KTILE bytes too
  static constexpr int SMEM = 1024 + QB * QTILE + 2 * ST * KTILE + 8 * (2 * QB + 2 * ST);
  static_assert(SMEM <= 227 * 1024, "tf32 wgmma forward shared memory exceeds sm_90's opt-in limit");
};

template <int HD, int BN, int QB, int ST>
__device__ __forceinline__ void forward(const BluTmap* tmQ, const BluTmap* tmK, const BluTmap* tmVt, float* o,
                                        float* lse, int L, int S, float scale, int causal, int H, int BH, Lay lo) {
#if BLU_HAVE_WGMMA
  using F = Fwd<HD, BN, QB, ST>;
  constexpr int BM = F::BM, QTILE = F::QTILE, KTILE = F::KTILE;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = blu_smem_u32(smem_raw);
  const unsigned sQ0 = raw + ((1024u - (raw & 1023u)) & 1023u);  // Q buffer b at sQ0 + b QTILE
  const unsigned sKV = sQ0 + QB * QTILE;  // stage s: K at sKV + 2 s KTILE, V^T at + KTILE
  const unsigned qfull = sKV + 2 * ST * KTILE, qempty = qfull + 8 * QB, full = qempty + 8 * QB,
                 empty = full + 8 * ST;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wgi = warp >> 2;
  const int nmb = (L + BM - 1) / BM, total = nmb * BH;
  if (tid == 0) {
    for (int b = 0; b < QB; ++b) {
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
      blu_tma_prefetch(tmVt);
      int kv = 0, n = 0;  // K/V stages and work tiles this CTA has loaded
      for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
        const int q0 = (nmb - 1 - wt / BH) * BM, bh = wt % BH, hh = bh % H, bb = bh / H;
        const int nt = ((causal ? min(S, q0 + BM) : S) + BN - 1) / BN;
        const int qb = n % QB;
        blu_mbar_wait(qempty + 8 * qb, ((n / QB) & 1) ^ 1);
        blu_mbar_expect_tx(qfull + 8 * qb, QTILE);
#pragma unroll
        for (int b = 0; b < HD / BOX; ++b)
          blu_tma_load4(sQ0 + qb * QTILE + b * BM * 128, tmQ, b * BOX, q0, hh, bb, qfull + 8 * qb);
        for (int it = 0; it < nt; ++it, ++kv) {
          const int s = kv % ST;
          blu_mbar_wait(empty + 8 * s, ((kv / ST) & 1) ^ 1);
          blu_mbar_expect_tx(full + 8 * s, 2 * KTILE);
          const unsigned k = sKV + 2 * s * KTILE;
#pragma unroll
          for (int b = 0; b < HD / BOX; ++b) blu_tma_load4(k + b * BN * 128, tmK, b * BOX, it * BN, hh, bb, full + 8 * s);
#pragma unroll
          for (int c = 0; c < BN / BOX; ++c)
            blu_tma_load4(k + KTILE + c * HD * 128, tmVt, it * BN + c * BOX, 0, hh, bb, full + 8 * s);
        }
      }
    }
    return;
  }
  // ---- consumers: warpgroup cw owns queries q0 + 64 cw .. + 63 ----
  blu_setmaxnreg_inc<232>();
  const int cw = wgi - 1, w = warp & 3, g = lane >> 2, t = lane & 3;
  const float c = scale * BLU_LOG2E;
  int kv = 0, n = 0;
  for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
    const int q0 = (nmb - 1 - wt / BH) * BM, bh = wt % BH;
    const int nt = ((causal ? min(S, q0 + BM) : S) + BN - 1) / BN;
    const int qb = n % QB;
    const unsigned sQ = sQ0 + qb * QTILE;
    const int r0 = q0 + cw * 64 + w * 16 + g, r1 = r0 + 8;
    float oacc[HD / 2], s[BN / 2];
    unsigned p[BN / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) oacc[i] = 0.f;
    float m0 = BLU_NEG_INF, m1 = BLU_NEG_INF, l0 = 0.f, l1 = 0.f;
    blu_mbar_wait(qfull + 8 * qb, (n / QB) & 1);

    // softmax of the tile at key k0 in s (raw scores in, probabilities out); alpha and row sums out
    auto softmax = [&](int k0, float& al0, float& al1, float& rs0, float& rs1) {
      const bool mask = k0 + BN > S || (causal && k0 + BN - 1 > q0 + cw * 64);
      float mx0 = m0, mx1 = m1;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        float x = s[i] * c;
        if (mask) {
          const int key = k0 + fcol(i, t);
          if (key >= S || (causal && key > (frow8(i) ? r1 : r0))) x = BLU_NEG_INF;
        }
        s[i] = x;
        if (frow8(i)) mx1 = fmaxf(mx1, x); else mx0 = fmaxf(mx0, x);
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      const float mu0 = mx0 == BLU_NEG_INF ? 0.f : mx0, mu1 = mx1 == BLU_NEG_INF ? 0.f : mx1;
      al0 = ex2(m0 - mu0);
      al1 = ex2(m1 - mu1);
      rs0 = 0.f;
      rs1 = 0.f;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const float e = ex2(s[i] - (frow8(i) ? mu1 : mu0));
        s[i] = e;
        if (frow8(i)) rs1 += e; else rs0 += e;
      }
      m0 = mx0;
      m1 = mx1;
    };

    float al0, al1, rs0, rs1;
    // tile 0: S = Q K0^T, softmax
    blu_mbar_wait(full + 8 * (kv % ST), (kv / ST) & 1);
    blu_wgmma_fence();
    ss_product<BN, HD>(s, sQ, BM, cw * 64, sKV + 2 * (kv % ST) * KTILE, BN);
    blu_wgmma_commit();
    blu_wgmma_wait<0>();
    blu_fence_f<BN / 2>(s);
    softmax(0, al0, al1, rs0, rs1);
    l0 = rs0;
    l1 = rs1;
    pack_p<BN / 2>(s, p);
    for (int it = 1; it < nt; ++it) {
      const int st = (kv + it) % ST, pst = (kv + it - 1) % ST;
      blu_mbar_wait(full + 8 * st, ((kv + it) / ST) & 1);
      blu_wgmma_fence();
      ss_product<BN, HD>(s, sQ, BM, cw * 64, sKV + 2 * st * KTILE, BN);  // S_i = Q K_i^T
      blu_wgmma_commit();
      rs_product<BN, HD>(oacc, p, sKV + 2 * pst * KTILE + KTILE);  // O += P_{i-1} V_{i-1}
      blu_wgmma_commit();
      blu_wgmma_wait<1>();
      blu_fence_f<BN / 2>(s);
      softmax(it * BN, al0, al1, rs0, rs1);
      blu_wgmma_wait<0>();
      blu_fence_f<HD / 2>(oacc);
      blu_fence_u<BN / 2>(p);
      if (lane == 0) blu_mbar_arrive(empty + 8 * pst);
#pragma unroll
      for (int i = 0; i < HD / 2; ++i) oacc[i] *= frow8(i) ? al1 : al0;
      l0 = l0 * al0 + rs0;
      l1 = l1 * al1 + rs1;
      pack_p<BN / 2>(s, p);
    }
    {
      const int pst = (kv + nt - 1) % ST;
      blu_wgmma_fence();
      rs_product<BN, HD>(oacc, p, sKV + 2 * pst * KTILE + KTILE);
      blu_wgmma_commit();
      blu_wgmma_wait<0>();
      blu_fence_f<HD / 2>(oacc);
      blu_fence_u<BN / 2>(p);
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
// Persistent like the forward: work tiles (own block, head), dK/dV: early key blocks first (most query tiles under
// causal), dQ: late query blocks first. smem (1024-aligned): one own buffer {A, B} (HD / 32 boxes of 128 rows x
// 128 B each: K, V for dK/dV; Q, dO for dQ), then ST stages of NT tiles of 64 streamed rows: X, Y (HD / 32 boxes of
// 64 rows x 128 B: Q, dO or K, V) and the transposes XT (, YT) (2 boxes of 32 positions x HD rows x 128 B: Q^T,
// dO^T or K^T), then ofull, oempty, full[ST], empty[ST].
template <int HD, int ST, bool DKDV>
struct Bwd {
  static constexpr int NT = DKDV ? 4 : 3;  // streamed tiles a stage
  static constexpr int OWN = 128 * HD * 4, TILE = 64 * HD * 4;
  static constexpr int SMEM = 1024 + 2 * OWN + ST * NT * TILE + 8 * (2 + 2 * ST);
  static_assert(SMEM <= 227 * 1024, "tf32 wgmma backward shared memory exceeds sm_90's opt-in limit");
};

// DKDV true: dK/dV kernel (own = 128 keys, streamed = query tiles: tmX Q, tmY dO, tmXT Q^T, tmYT dO^T); false:
// dQ kernel (own = 128 queries Q, dO; streamed key tiles: tmX K, tmY V, tmXT K^T; tmYT unused).
template <int HD, int ST, bool DKDV>
__device__ __forceinline__ void backward(const BluTmap* tmA, const BluTmap* tmB, const BluTmap* tmX,
                                         const BluTmap* tmY, const BluTmap* tmXT, const BluTmap* tmYT,
                                         const float* __restrict__ lse, const float* __restrict__ Dv, float* out0,
                                         float* out1, int L, int S, float scale, int causal, int H, int BH,
                                         Lay lout) {
#if BLU_HAVE_WGMMA
  using B = Bwd<HD, ST, DKDV>;
  constexpr int OWN = B::OWN, TILE = B::TILE, NT = B::NT, NB = HD / BOX;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = blu_smem_u32(smem_raw);
  const unsigned sA = raw + ((1024u - (raw & 1023u)) & 1023u), sB = sA + OWN;
  const unsigned sX = sA + 2 * OWN;  // stage s: X at sX + s NT TILE, Y at + TILE, XT at + 2 TILE, YT at + 3 TILE
  const unsigned ofull = sX + ST * NT * TILE, oempty = ofull + 8, full = oempty + 8, empty = full + 8 * ST;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wgi = warp >> 2;
  const int nob = ((DKDV ? S : L) + 127) / 128, total = nob * BH;
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
    blu_mbar_init(ofull, 1);
    blu_mbar_init(oempty, 8);
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
      blu_tma_prefetch(tmXT);
      if (DKDV) blu_tma_prefetch(tmYT);
      int kv = 0, n = 0;
      for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
        int own0, bh, first, nt;
        decode(wt, own0, bh, first, nt);
        const int hh = bh % H, bb = bh / H;
        blu_mbar_wait(oempty, (n & 1) ^ 1);
        blu_mbar_expect_tx(ofull, 2 * OWN);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          blu_tma_load4(sA + b * 128 * 128, tmA, b * BOX, own0, hh, bb, ofull);
          blu_tma_load4(sB + b * 128 * 128, tmB, b * BOX, own0, hh, bb, ofull);
        }
        for (int it = 0; it < nt; ++it, ++kv) {
          const int s = kv % ST, x0 = first + it * 64;
          blu_mbar_wait(empty + 8 * s, ((kv / ST) & 1) ^ 1);
          blu_mbar_expect_tx(full + 8 * s, NT * TILE);
          const unsigned x = sX + s * NT * TILE;
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            blu_tma_load4(x + b * 64 * 128, tmX, b * BOX, x0, hh, bb, full + 8 * s);
            blu_tma_load4(x + TILE + b * 64 * 128, tmY, b * BOX, x0, hh, bb, full + 8 * s);
          }
#pragma unroll
          for (int c = 0; c < 64 / BOX; ++c) {
            blu_tma_load4(x + 2 * TILE + c * HD * 128, tmXT, x0 + c * BOX, 0, hh, bb, full + 8 * s);
            if (DKDV) blu_tma_load4(x + 3 * TILE + c * HD * 128, tmYT, x0 + c * BOX, 0, hh, bb, full + 8 * s);
          }
        }
      }
    }
    return;
  }
  // ---- consumers: warpgroup cw owns rows own0 + 64 cw .. + 63 ----
  blu_setmaxnreg_inc<232>();
  const int cw = wgi - 1, w = warp & 3, g = lane >> 2, t = lane & 3;
  const float c = scale * BLU_LOG2E;
  int kv = 0, n = 0;
  for (int wt = blockIdx.x; wt < total; wt += gridDim.x, ++n) {
    int own0, bh, first, nt;
    decode(wt, own0, bh, first, nt);
    const int r0 = own0 + cw * 64 + w * 16 + g, r1 = r0 + 8;  // own rows (keys for dK/dV, queries for dQ)
    const long long rowoff = (long long)bh * L;
    float acc0[HD / 2], acc1[HD / 2];  // dK/dV: dK, dV; dQ: dQ (acc1 unused)
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) acc0[i] = acc1[i] = 0.f;
    float sv[32], dp[32];  // S (then P) and dP (then dS), 64 x 64 accumulators
    float lq0 = 0.f, lq1 = 0.f, dq0 = 0.f, dq1 = 0.f;  // dQ: this thread's two rows' lse * log2 e and D
    if (!DKDV) {
      if (r0 < L) lq0 = lse[rowoff + r0] * BLU_LOG2E, dq0 = Dv[rowoff + r0];
      if (r1 < L) lq1 = lse[rowoff + r1] * BLU_LOG2E, dq1 = Dv[rowoff + r1];
    }
    blu_mbar_wait(ofull, n & 1);
    int pending = -1;  // stage whose RS products are still in flight
    for (int it = 0; it < nt; ++it) {
      const int st = (kv + it) % ST;
      const int x0 = first + it * 64;
      const unsigned x = sX + st * NT * TILE, y = x + TILE, xt = x + 2 * TILE, yt = x + 3 * TILE;
      const bool skip = causal && (DKDV ? x0 + 63 < own0 + cw * 64 : x0 > own0 + cw * 64 + 63);
      if (pending >= 0) {  // the previous tile's RS products read sv / dp: done before they are rewritten
        blu_wgmma_wait<0>();
        blu_fence_f<HD / 2>(acc0);
        if (DKDV) blu_fence_f<HD / 2>(acc1);
        blu_fence_f<32>(sv);
        blu_fence_f<32>(dp);
        if (lane == 0) blu_mbar_arrive(empty + 8 * pending);
        pending = -1;
      }
      blu_mbar_wait(full + 8 * st, ((kv + it) / ST) & 1);
      if (skip) {
        if (lane == 0) blu_mbar_arrive(empty + 8 * st);
        continue;
      }
      blu_wgmma_fence();
      ss_product<64, HD>(sv, sA, 128, cw * 64, x, 64);  // dK/dV: S^T = K Q^T; dQ: S = Q K^T
      ss_product<64, HD>(dp, sB, 128, cw * 64, y, 64);  // dK/dV: dP^T = V dO^T; dQ: dP = dO V^T
      blu_wgmma_commit();
      // dK/dV: the streamed queries' lse and D for this thread's columns, loaded while the products run
      float lc[16], dc[16];
      if (DKDV) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int q = x0 + 8 * (j >> 1) + 2 * t + (j & 1);
          lc[j] = q < L ? lse[rowoff + q] * BLU_LOG2E : 0.f;
          dc[j] = q < L ? Dv[rowoff + q] : 0.f;
        }
      }
      blu_wgmma_wait<0>();
      blu_fence_f<32>(sv);
      blu_fence_f<32>(dp);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int col = x0 + fcol(i, t), row = frow8(i) ? r1 : r0;
        float pv, dsv;
        if (DKDV) {  // row = key, col = query
          const int j = 2 * (i >> 2) + (i & 1);
          pv = ex2(sv[i] * c - lc[j]);
          if (col >= L || row >= S || (causal && row > col)) pv = 0.f;
          dsv = pv * (dp[i] - dc[j]);
        } else {  // row = query, col = key
          pv = ex2(sv[i] * c - (frow8(i) ? lq1 : lq0));
          if (row >= L || col >= S || (causal && col > row)) pv = 0.f;
          dsv = pv * (dp[i] - (frow8(i) ? dq1 : dq0));
        }
        sv[i] = pv;
        dp[i] = dsv;
      }
      pack_inplace<32>(sv);  // A fragments of P (P^T), dS (dS^T), rounded
      pack_inplace<32>(dp);
      blu_wgmma_fence();
      if (DKDV) {
        rs_product_f<64, HD>(acc1, sv, yt);  // dV += P^T dO
        rs_product_f<64, HD>(acc0, dp, xt);  // dK += dS^T Q
      } else {
        rs_product_f<64, HD>(acc0, dp, xt);  // dQ += dS K
      }
      blu_wgmma_commit();
      pending = st;
    }
    blu_wgmma_wait<0>();
    blu_fence_f<HD / 2>(acc0);
    if (DKDV) blu_fence_f<HD / 2>(acc1);
    blu_fence_f<32>(sv);
    blu_fence_f<32>(dp);
    if (lane == 0) {
      if (pending >= 0) blu_mbar_arrive(empty + 8 * pending);
      blu_mbar_arrive(oempty);  // the own buffer is free
    }
    kv += nt;
    const int rows = DKDV ? S : L;
    store_rows<HD>(out0, lout.base(bh), lout.st, acc0, r0, rows, scale, scale, t);
    if (DKDV) store_rows<HD>(out1, lout.base(bh), lout.st, acc1, r0, rows, 1.f, 1.f, t);
  }
#else
  asm volatile("trap;");
#endif
}

// ================================================================ backward preprocess
// D[row] = sum_d dO[row, d] * O[row, d] (fp32), row = bh * L + i: HD / 4 adjacent threads a row, 16-byte loads of 4
// floats, a shuffle reduction inside the group (plain CUDA).
template <int HD>
__device__ __forceinline__ void preprocess(const float* __restrict__ dout, const float* __restrict__ o,
                                           float* __restrict__ D, long long rows, int L, Lay lo) {
  constexpr int G = HD / 4;  // threads per row
  const long long nthr = (long long)gridDim.x * blockDim.x;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < rows * G; idx += nthr) {
    const long long row = idx / G;
    const int part = (int)(idx % G);
    const long long off = lo.base((int)(row / L)) + (row % L) * lo.st + part * 4;
    const float4 a = *reinterpret_cast<const float4*>(dout + off);
    const float4 b = *reinterpret_cast<const float4*>(o + off);
    float sum = a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
#pragma unroll
    for (int m = G / 2; m > 0; m >>= 1) sum += __shfl_xor_sync(__activemask(), sum, m);  // whole groups
    if (part == 0) D[row] = sum;
  }
}

// ================================================================ transposed scratch
// vt[bh, d, p] = tf32(v[bh, key(p), d]) for p < Sp, key(p) = 8 (p >> 3) + perm8(p & 7), zero where key(p) >= S
// (Sp: S rounded up to 8): V^T of the forward, Q^T / dO^T / K^T of the backward. Blocks of 32 x 8 threads
// transpose 32 rows x 32 head-dim columns through shared memory (coalesced reads of v's rows and writes of vt's
// rows); grid (ceil(Sp / 32), HD / 32, BH). Plain CUDA.
__device__ __forceinline__ void transpose_rows(const float* __restrict__ v, float* __restrict__ vt, int S, int Sp,
                                               int HD, Lay lv) {
  __shared__ float tile[32][33];
  const int bh = blockIdx.z, k0 = blockIdx.x * 32, d0 = blockIdx.y * 32, tx = threadIdx.x, ty = threadIdx.y;
  const float* src = v + lv.base(bh);
#pragma unroll
  for (int r = ty; r < 32; r += 8) {  // row r of the tile: key k0 + r, head-dim column d0 + tx
    const int key = k0 + r;
    tile[r][tx] = key < S ? __uint_as_float(rna(src[(long long)key * lv.st + d0 + tx])) : 0.f;
  }
  __syncthreads();
  float* dst = vt + (long long)bh * HD * Sp;
  const int p = k0 + tx;
  if (p < Sp) {
    const int kl = 8 * (tx >> 3) + perm8(tx & 7);  // the tile row (key) that position p holds
#pragma unroll
    for (int r = ty; r < 32; r += 8) dst[(long long)(d0 + r) * Sp + p] = tile[kl][r];
  }
}

}  // namespace wgt

// Entries per head dim: the forward (tensor maps of q and k: boxes of 32 head-dim elements x 128 query rows / BN
// key rows; of V^T: 32 keys x HD rows; H heads; o's layout (sb, sh, st)), the transpose into a scratch (the
// source's layout) and the preprocess (o's layout). BN / QB / ST: keys of a tile, Q buffers, stages of the ring
// (sdpa_wgmma_tf32.py's FWD_TILES). Head dim 64 also: the backward's dK/dV and dQ kernels (own maps of 128 rows,
// streamed maps of 64 rows, transposes' maps 32 positions x HD rows; dK and dV share one layout).
#define BLU_TM const __grid_constant__ BluTmap
#define WGMMA_TF32_ENTRIES(HD, BN, QB, ST)                                                                           \
  extern "C" __global__ void __launch_bounds__(wgt::THREADS, 1) blu_sdpa_wgmma_tf32_hd##HD##_fwd(                  \
      BLU_TM tmQ, BLU_TM tmK, BLU_TM tmVt, float* o, float* lse, int L, int S, float scale, int causal, int H,       \
      int BH, long long o_sb, long long o_sh, int o_st) {                                                            \
    wgt::forward<HD, BN, QB, ST>(&tmQ, &tmK, &tmVt, o, lse, L, S, scale, causal, H, BH, lay(o_sb, o_sh, o_st, H));  \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) blu_sdpa_wgmma_tf32_hd##HD##_transpose(                       \
      const float* v, float* vt, int S, int Sp, int H, long long v_sb, long long v_sh, int v_st) {                  \
    wgt::transpose_rows(v, vt, S, Sp, HD, lay(v_sb, v_sh, v_st, H));                                                 \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) blu_sdpa_wgmma_tf32_hd##HD##_preprocess(                      \
      const float* dout, const float* o, float* D, long long rows, int L, int H, long long o_sb, long long o_sh,    \
      int o_st) {                                                                                                    \
    wgt::preprocess<HD>(dout, o, D, rows, L, lay(o_sb, o_sh, o_st, H));                                              \
  }
#define WGMMA_TF32_BWD_ENTRIES(HD, DKDV_ST, DQ_ST)                                                                   \
  extern "C" __global__ void __launch_bounds__(wgt::THREADS, 1) blu_sdpa_wgmma_tf32_hd##HD##_bwd_dkdv(             \
      BLU_TM tmK, BLU_TM tmV, BLU_TM tmQ, BLU_TM tmO, BLU_TM tmQt, BLU_TM tmOt, const float* lse, const float* D,    \
      float* dk, float* dv, int L, int S, float scale, int causal, int H, int BH, long long k_sb, long long k_sh,    \
      int k_st) {                                                                                                    \
    wgt::backward<HD, DKDV_ST, true>(&tmK, &tmV, &tmQ, &tmO, &tmQt, &tmOt, lse, D, dk, dv, L, S, scale, causal, H,  \
                                     BH, lay(k_sb, k_sh, k_st, H));                                                  \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(wgt::THREADS, 1) blu_sdpa_wgmma_tf32_hd##HD##_bwd_dq(               \
      BLU_TM tmQ, BLU_TM tmO, BLU_TM tmK, BLU_TM tmV, BLU_TM tmKt, const float* lse, const float* D, float* dq,      \
      int L, int S, float scale, int causal, int H, int BH, long long q_sb, long long q_sh, int q_st) {             \
    wgt::backward<HD, DQ_ST, false>(&tmQ, &tmO, &tmK, &tmV, &tmKt, &tmKt, lse, D, dq, dq, L, S, scale, causal, H,   \
                                    BH, lay(q_sb, q_sh, q_st, H));                                                   \
  }

WGMMA_TF32_ENTRIES(64, 128, 2, 2)
WGMMA_TF32_ENTRIES(128, 64, 1, 2)
WGMMA_TF32_BWD_ENTRIES(64, 2, 3)
