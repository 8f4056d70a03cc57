// Flash attention on the matrix units: fragment traits (TF32, TF32X3, BF16), tile staging, the layouts of
// strided q/k/v (struct Lay) and the shared accumulation/reduction helpers of kernels/sdpa_mma.cu, which
// includes this file once (blutensor's loader inlines it before NVRTC compiles).

typedef unsigned int u32;

#define BLU_NEG_INF (-__int_as_float(0x7f800000))
#define BLU_LOG2E 1.4426950408889634f
#define BLU_LN2 0.6931471805599453f

#include "bf16_vec.cuh"
#include "sdpa_layout.cuh"

namespace mma {

constexpr int BR = 64;  // rows of a staged tile; rows a backward block owns
// W, the warps of a block (4 or 8, per variant and kernel: MMA_ENTRIES): the forward block owns 16 W queries;
// the backward block 64 rows, W = 8 giving two warps to every 16 rows, each taking half of every streamed tile

// tf32 operand of mma (round to nearest, ties away): the 13 low bits of the result are don't-care (sm_90 emits
// an add of 0x1000 guarded against inf/nan); mma ignores them, arithmetic on the value must mask them
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
constexpr u32 TF32_MASK = 0xffffe000u;

// Fragment traits: storage type T, k per mma KS, row padding PAD, A/B fragment sizes NA/NB (registers), loaders
// of A (16 x KS, row-major X[r][k]), Bt (KS x 8, B[k][n] = X[n][k], "K-like") and B (B[k][n] = X[k][n], "V-like")
// from shared memory, mma (c += a b) and c_to_a (accumulator n-tiles -> A operand of the next product).

// ---------------------------------------------------------------- tf32: m16n8k8, fp32 storage
struct TF32 {
    typedef float T;
    static constexpr int KS = 8;    // k per mma
    static constexpr int PAD = 4;   // row padding (elements)
    static constexpr int NA = 4, NB = 2;
    // tiles are rounded to tf32 once as they are staged (prep_tile), so the loaders only move bits: 4x fewer
    // conversions than rounding every fragment load (every warp of the block reads every streamed tile)
    static constexpr bool ROUND_TILES = true;
    // raw bits of the fragments (tf32 loaders use them as they are; tf32x3 splits them)
#ifndef BLU_NO_LDMATRIX
    // ldmatrix on b16 pairs: an 8 x 4 fp32 block is an 8 x 8 b16 matrix, and lane (g, t) receives row g,
    // b16 cols 2t, 2t+1 = fp32 col t: exactly the tf32 A/B fragment element. Rows are 16-byte aligned.
    static __device__ __forceinline__ void raw_a(const float* X, int ld, int r0, int k0, u32* a, int g, int t) {
        const int lane = 4 * g + t, j = lane >> 3;  // matrices: rows +0/+8 (j & 1), cols +0/+4 (j >> 1)
        const u32 ad = (u32)__cvta_generic_to_shared(X + (r0 + (j & 1) * 8 + (lane & 7)) * ld + k0 + (j >> 1) * 4);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(ad));
    }
    static __device__ __forceinline__ void raw_bt(const float* X, int ld, int n0, int k0, u32* b, int g, int t) {
        const int lane = (4 * g + t) & 15;
        const u32 ad = (u32)__cvta_generic_to_shared(X + (n0 + (lane & 7)) * ld + k0 + (lane >> 3) * 4);
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(b[0]), "=r"(b[1]) : "r"(ad));
    }
#else
    // A (16 x 8) from row-major X[r][k] at (r0, k0)
    static __device__ __forceinline__ void raw_a(const float* X, int ld, int r0, int k0, u32* a, int g, int t) {
        a[0] = __float_as_uint(X[(r0 + g) * ld + k0 + t]);
        a[1] = __float_as_uint(X[(r0 + g + 8) * ld + k0 + t]);
        a[2] = __float_as_uint(X[(r0 + g) * ld + k0 + t + 4]);
        a[3] = __float_as_uint(X[(r0 + g + 8) * ld + k0 + t + 4]);
    }
    // B (8 x 8) with B[k][n] = X[n0 + n][k0 + k]   ("K-like": rows of X are the n index)
    static __device__ __forceinline__ void raw_bt(const float* X, int ld, int n0, int k0, u32* b, int g, int t) {
        b[0] = __float_as_uint(X[(n0 + g) * ld + k0 + t]);
        b[1] = __float_as_uint(X[(n0 + g) * ld + k0 + t + 4]);
    }
#endif
    // The second product's k index (keys in forward / dQ, queries in dK/dV) is permuted inside each group of
    // 8: A column t <-> k 2t, column t + 4 <-> k 2t + 1 (any permutation shared by A and B gives the same
    // sum). Then the accumulator fragment (rows g, g+8; cols 2t, 2t+1) IS the A fragment (no shuffles), and
    // the V-like B rows 2t, 2t+1 of a tile with row stride HD + 4 hit 32 distinct banks (rows t, t+4: 2-way
    // conflicts).
    // B (8 x 8) with B[k][n] = X[k0 + perm(k)][n0 + n]   ("V-like": rows of X are the k index)
    static __device__ __forceinline__ void raw_b(const float* X, int ld, int k0, int n0, u32* b, int g, int t) {
        b[0] = __float_as_uint(X[(k0 + 2 * t) * ld + n0 + g]);      // B[t][g]
        b[1] = __float_as_uint(X[(k0 + 2 * t + 1) * ld + n0 + g]);  // B[t + 4][g]
    }
    // A operand for k-step kk (k = kk*8 .. +7, permuted as above) from accumulator n-tiles c[nt][4] (n-tile kk)
    static __device__ __forceinline__ void raw_c_to_a(const float (*c)[4], int kk, u32* a, int) {
        a[0] = __float_as_uint(c[kk][0]);  // (g,   t)     = C[g][2t]
        a[1] = __float_as_uint(c[kk][2]);  // (g+8, t)     = C[g+8][2t]
        a[2] = __float_as_uint(c[kk][1]);  // (g,   t+4)   = C[g][2t+1]
        a[3] = __float_as_uint(c[kk][3]);  // (g+8, t+4)   = C[g+8][2t+1]
    }
    template <int N> static __device__ __forceinline__ void fin(u32* r) {
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = to_tf32(__uint_as_float(r[i]));
    }
    static __device__ __forceinline__ void load_a(const float* X, int ld, int r0, int k0, u32* a, int g, int t) {
        raw_a(X, ld, r0, k0, a, g, t);
    }
    static __device__ __forceinline__ void load_bt(const float* X, int ld, int n0, int k0, u32* b, int g, int t) {
        raw_bt(X, ld, n0, k0, b, g, t);
    }
    static __device__ __forceinline__ void load_b(const float* X, int ld, int k0, int n0, u32* b, int g, int t) {
        raw_b(X, ld, k0, n0, b, g, t);
    }
    static __device__ __forceinline__ void c_to_a(const float (*c)[4], int kk, u32* a, int lane) {
        raw_c_to_a(c, kk, a, lane);
        fin<4>(a);
    }
    // A (16 x 8) from row-major X[r][k] at (r0, k0) in raw_b's permuted k order (column t <-> k 2t, t + 4 <->
    // k 2t + 1): one float2 load a row (the fused backward's dS tile, written by tile_value)
    static __device__ __forceinline__ void raw_a_perm(const float* X, int ld, int r0, int k0, u32* a, int g, int t) {
        const float2 x0 = *reinterpret_cast<const float2*>(X + (r0 + g) * ld + k0 + 2 * t);
        const float2 x1 = *reinterpret_cast<const float2*>(X + (r0 + g + 8) * ld + k0 + 2 * t);
        a[0] = __float_as_uint(x0.x);
        a[1] = __float_as_uint(x1.x);
        a[2] = __float_as_uint(x0.y);
        a[3] = __float_as_uint(x1.y);
    }
    static __device__ __forceinline__ void load_a_perm(const float* X, int ld, int r0, int k0, u32* a, int g, int t) {
        raw_a_perm(X, ld, r0, k0, a, g, t);
    }
    // a value as a staged tile holds it (ROUND_TILES: rounded to tf32 once, the loaders move bits only)
    static __device__ __forceinline__ float tile_value(float x) { return __uint_as_float(to_tf32(x)); }
    static __device__ __forceinline__ void mma1(float* c, const u32* a, const u32* b) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    static __device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) { mma1(c, a, b); }
    static __device__ __forceinline__ void mma_acc(float* c, const u32* a, const u32* b) { mma1(c, a, b); }
    static __device__ __forceinline__ float ld(const float* p) { return *p; }
    static __device__ __forceinline__ void store2(float* p, float a, float b) {
        *reinterpret_cast<float2*>(p) = make_float2(a, b);
    }
};

// ---------------------------------------------------------------- tf32x3: fp32 on the matrix units
// 3xTF32 (CUTLASS OpMultiplyAddFastF32, what PyTorch's fp32 SDPA runs on sm_80+): x = big + small with
// big = tf32(x), small = tf32(x - big) (x - big is exact); c += a_small b_big + a_big b_small + a_big b_big,
// small products first, small*small dropped. Fragments: registers [0, N) = big, [N, 2N) = small.
struct TF32X3 : TF32 {
    static constexpr int NA = 8, NB = 4;
    static constexpr bool ROUND_TILES = false;  // tiles stay fp32: split at every fragment load
    template <int N> static __device__ __forceinline__ void split(u32* r) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            // big = x rounded to nearest tf32 (ties away) as an integer add + mask, an exact tf32 value so that
            // x - big is exact. No inf/nan guard (cvt's): inf stays inf; a nan x may give any big, but then
            // small = x - big is nan and cvt keeps it nan, so nan still propagates.
            const float x = __uint_as_float(r[i]);
            const u32 big = (r[i] + 0x1000u) & TF32_MASK;
            r[i] = big;
            r[i + N] = to_tf32(x - __uint_as_float(big));
        }
    }
    static __device__ __forceinline__ void load_a(const float* X, int ld, int r0, int k0, u32* a, int g, int t) {
        raw_a(X, ld, r0, k0, a, g, t);
        split<4>(a);
    }
    static __device__ __forceinline__ void load_bt(const float* X, int ld, int n0, int k0, u32* b, int g, int t) {
        raw_bt(X, ld, n0, k0, b, g, t);
        split<2>(b);
    }
    static __device__ __forceinline__ void load_b(const float* X, int ld, int k0, int n0, u32* b, int g, int t) {
        raw_b(X, ld, k0, n0, b, g, t);
        split<2>(b);
    }
    static __device__ __forceinline__ void c_to_a(const float (*c)[4], int kk, u32* a, int lane) {
        raw_c_to_a(c, kk, a, lane);
        split<4>(a);
    }
    static __device__ __forceinline__ void load_a_perm(const float* X, int ld, int r0, int k0, u32* a, int g, int t) {
        raw_a_perm(X, ld, r0, k0, a, g, t);
        split<4>(a);
    }
    static __device__ __forceinline__ float tile_value(float x) { return x; }  // tiles stay fp32
    static __device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) {
        mma1(c, a + 4, b);  // small * big
        mma1(c, a, b + 2);  // big * small
        mma1(c, a, b);      // big * big
    }
    // Staged (the long sums over keys / queries: acc_pv): the matrix units' fp32 accumulation truncates, and
    // summed straight into the running accumulator over 1000 keys that bias grew to several times the SIMT
    // kernel's error. The three products go to a zeroed temporary, added with one rounded FADD.
    static __device__ __forceinline__ void mma_acc(float* c, const u32* a, const u32* b) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        mma1(t, a + 4, b);  // small * big
        mma1(t, a, b + 2);  // big * small
        mma1(t, a, b);      // big * big
        c[0] += t[0];
        c[1] += t[1];
        c[2] += t[2];
        c[3] += t[3];
    }
};

// ---------------------------------------------------------------- bf16: m16n8k16, raw uint16 storage
struct BF16 {
    typedef bf16_t T;
    static constexpr int KS = 16;
    static constexpr int PAD = 8;
    static constexpr int NA = 4, NB = 2;
    static constexpr bool ROUND_TILES = false;
#ifndef BLU_NO_LDMATRIX
    // ldmatrix: lane i gives the address of row (i % 8) of 8x8 matrix (i / 8); lane (g, t) receives row g,
    // cols 2t, 2t+1 of each matrix (.trans: row 2t, 2t+1, col g). Rows are 16-byte aligned (LD*2 = 16*k).
    static __device__ __forceinline__ u32 saddr(const bf16_t* p) { return (u32)__cvta_generic_to_shared(p); }
    static __device__ __forceinline__ void load_a(const bf16_t* X, int ld, int r0, int k0, u32* a, int g, int t) {
        const int lane = 4 * g + t, j = lane >> 3;
        const u32 ad = saddr(X + (r0 + (j & 1) * 8 + (lane & 7)) * ld + k0 + (j >> 1) * 8);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(ad));
    }
    // B[k][n] = X[n0 + n][k0 + k]: matrices X[n0.., k0..] and X[n0.., k0+8..]
    static __device__ __forceinline__ void load_bt(const bf16_t* X, int ld, int n0, int k0, u32* b, int g, int t) {
        const int lane = (4 * g + t) & 15;
        const u32 ad = saddr(X + (n0 + (lane & 7)) * ld + k0 + (lane >> 3) * 8);
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(b[0]), "=r"(b[1]) : "r"(ad));
    }
    // B[k][n] = X[k0 + k][n0 + n]: transposed matrices X[k0.., n0..] and X[k0+8.., n0..]
    static __device__ __forceinline__ void load_b(const bf16_t* X, int ld, int k0, int n0, u32* b, int g, int t) {
        const int lane = (4 * g + t) & 15;
        const u32 ad = saddr(X + (k0 + lane) * ld + n0);
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                     : "=r"(b[0]), "=r"(b[1]) : "r"(ad));
    }
#else
    static __device__ __forceinline__ u32 ld2(const bf16_t* p) { return *reinterpret_cast<const u32*>(p); }
    static __device__ __forceinline__ void load_a(const bf16_t* X, int ld, int r0, int k0, u32* a, int g, int t) {
        a[0] = ld2(X + (r0 + g) * ld + k0 + 2 * t);
        a[1] = ld2(X + (r0 + g + 8) * ld + k0 + 2 * t);
        a[2] = ld2(X + (r0 + g) * ld + k0 + 2 * t + 8);
        a[3] = ld2(X + (r0 + g + 8) * ld + k0 + 2 * t + 8);
    }
    static __device__ __forceinline__ void load_bt(const bf16_t* X, int ld, int n0, int k0, u32* b, int g, int t) {
        b[0] = ld2(X + (n0 + g) * ld + k0 + 2 * t);
        b[1] = ld2(X + (n0 + g) * ld + k0 + 2 * t + 8);
    }
    static __device__ __forceinline__ void load_b(const bf16_t* X, int ld, int k0, int n0, u32* b, int g, int t) {
        b[0] = (u32)X[(k0 + 2 * t) * ld + n0 + g] | ((u32)X[(k0 + 2 * t + 1) * ld + n0 + g] << 16);
        b[1] = (u32)X[(k0 + 2 * t + 8) * ld + n0 + g] | ((u32)X[(k0 + 2 * t + 9) * ld + n0 + g] << 16);
    }
#endif
    static __device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    static __device__ __forceinline__ void mma_acc(float* c, const u32* a, const u32* b) { mma(c, a, b); }
    // A operand for k-step kk (keys kk*16 .. +15) = accumulator n-tiles 2kk, 2kk+1
    static __device__ __forceinline__ void c_to_a(const float (*c)[4], int kk, u32* a, int) {
        a[0] = pack2(c[2 * kk][0], c[2 * kk][1]);
        a[1] = pack2(c[2 * kk][2], c[2 * kk][3]);
        a[2] = pack2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[3] = pack2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
    static __device__ __forceinline__ float ld(const bf16_t* p) { return to_f(*p); }
    static __device__ __forceinline__ void store2(bf16_t* p, float a, float b) {
        *reinterpret_cast<u32*>(p) = pack2(a, b);
    }
};

// backward: the block's own two tiles (K, V in dK/dV; Q, dO in dQ) as A fragments in registers when they take
// at most MAXREG registers a thread, else loaded per use. 4 warps: dK/dV 32, dQ 64; 8 warps: dK/dV never, dQ
// 32 (the HD 64 kernels must stay within 128 registers: two blocks of 256 threads a multiprocessor)
template <typename X, int HD, int MAXREG> struct OwnInRegs {
    static constexpr bool value = 2 * (HD / X::KS) * X::NA <= MAXREG;
};

__device__ __forceinline__ uint4 round4(uint4 v) {
    return make_uint4(to_tf32(__uint_as_float(v.x)), to_tf32(__uint_as_float(v.y)), to_tf32(__uint_as_float(v.z)),
                      to_tf32(__uint_as_float(v.w)));
}

// acc[d] (x al first, RESCALE) += sum over k-steps kk < NK of A(kk) B(kk, d) for the DT n-tiles d: A from the
// accumulator tiles c (c_to_a), B the V-like operand rows k0 + kk * KS .. of Bs (P V, P^T dO, dS^T Q, dS K)
template <typename X, int DT, int NK, bool RESCALE, typename T = typename X::T>
__device__ __forceinline__ void acc_pv(float (*acc)[4], const float (*c)[4], const T* Bs, int ld, int k0, float al0,
                                       float al1, int g, int t, int lane) {
    if constexpr (RESCALE) {
#pragma unroll
        for (int d = 0; d < DT; ++d) { acc[d][0] *= al0; acc[d][1] *= al0; acc[d][2] *= al1; acc[d][3] *= al1; }
    }
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
        u32 a[X::NA];
        X::c_to_a(c, kk, a, lane);
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            u32 b[X::NB];
            X::load_b(Bs, ld, k0 + kk * X::KS, d * 8, b, g, t);
            // staged accumulation (tf32x3) up to HD 64; at HD 128 its temporaries spill (400+ bytes): unstaged
            if constexpr (DT <= 8) X::mma_acc(acc[d], a, b);
            else X::mma(acc[d], a, b);
        }
    }
}

// Fused backward (sdpa_mma.cu backward_dkdv<FDQ>): the staged dS tile's row stride in floats; 64 + 8 keeps
// raw_a_perm's float2 loads free of bank conflicts
constexpr int SLD = BR + 8;

// two fp32 atomic adds at p, p + 1 (8-byte aligned): one vector reduction on sm_90
__device__ __forceinline__ void atomic_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// Fused backward: dq rows q0 + lr .. +15 (lr: the warp's first row in the tile), head-dim columns part * HD /
// (W / 4) .. += scale * (dS K) over the block's 64 keys: dS from Ss ([query][key], stride SLD), K the block's
// own key tile (row stride ld); a zeroed accumulator per tile (staged like acc_pv), then fp32 atomics
template <typename X, int HD, int W>
__device__ __forceinline__ void dq_atomic(const float* Ss, const float* Ks, int ld, float* dqb, int st, int lr,
                                          int q0, int part, int L, float scale, int g, int t) {
    constexpr int DW = HD / (W / 4), NDT = DW / 8;
    float acc[NDT][4];
#pragma unroll
    for (int n = 0; n < NDT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BR / X::KS; ++kk) {
        u32 a[X::NA];
        X::load_a_perm(Ss, SLD, lr, kk * X::KS, a, g, t);
#pragma unroll
        for (int n = 0; n < NDT; ++n) {
            u32 b[X::NB];
            X::load_b(Ks, ld, kk * X::KS, part * DW + n * 8, b, g, t);
            X::mma_acc(acc[n], a, b);
        }
    }
    const int row0 = q0 + lr + g, row1 = row0 + 8;
#pragma unroll
    for (int n = 0; n < NDT; ++n) {
        const int col = part * DW + n * 8 + 2 * t;
        if (row0 < L) atomic_add2(dqb + (long long)row0 * st + col, acc[n][0] * scale, acc[n][1] * scale);
        if (row1 < L) atomic_add2(dqb + (long long)row1 * st + col, acc[n][2] * scale, acc[n][3] * scale);
    }
}

// rows [r0, r0 + 64) of a (n, HD) matrix -> smem tile with row stride HD + PAD (zeros past n); 16-byte copies,
// rounded to tf32 where the loaders expect it (X::ROUND_TILES)
template <typename X, int HD, typename T = typename X::T>
__device__ __forceinline__ void load_tile(T* dst, const T* __restrict__ src, int r0, int n, int ld) {
    constexpr int LD = HD + X::PAD;
    constexpr int E = 16 / sizeof(T);  // elements per 16 bytes
    constexpr int Q = HD / E;
    for (int i = threadIdx.x; i < BR * Q; i += blockDim.x) {
        const int r = i / Q, c = i % Q;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < n) v = *reinterpret_cast<const uint4*>(src + (long long)(r0 + r) * ld + c * E);
        if constexpr (X::ROUND_TILES) v = round4(v);
        *reinterpret_cast<uint4*>(dst + r * LD + c * E) = v;
    }
}

// asynchronous version of load_tile (cp.async, 16 bytes, zero-fill past n); completes on commit/wait groups
template <typename X, int HD, typename T = typename X::T>
__device__ __forceinline__ void load_tile_async(T* dst, const T* __restrict__ src, int r0, int n, int ld) {
    constexpr int LD = HD + X::PAD;
    constexpr int E = 16 / sizeof(T);
    constexpr int Q = HD / E;
    for (int i = threadIdx.x; i < BR * Q; i += blockDim.x) {
        const int r = i / Q, c = i % Q;
        const bool ok = r0 + r < n;
        const T* g = ok ? src + (long long)(r0 + r) * ld + c * E : src;
        const u32 sa = (u32)__cvta_generic_to_shared(dst + r * LD + c * E);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(g), "r"(ok ? 16 : 0));
    }
}
// X::ROUND_TILES: round a tile staged by load_tile_async to tf32 in place, once its group has completed. Each
// thread converts the 16-byte pieces it copied itself (visible to it after cp.async.wait_group), so no barrier
// is needed before; the caller's __syncthreads publishes the result.
template <typename X, int HD, typename T = typename X::T>
__device__ __forceinline__ void prep_tile(T* dst) {
    if constexpr (X::ROUND_TILES) {
        constexpr int LD = HD + X::PAD;
        constexpr int E = 16 / sizeof(T);
        constexpr int Q = HD / E;
        for (int i = threadIdx.x; i < BR * Q; i += blockDim.x) {
            uint4* p = reinterpret_cast<uint4*>(dst + (i / Q) * LD + (i % Q) * E);
            *p = round4(*p);
        }
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// backward, 8 warps: warps 4-7 hand their partial sums a[DT][4] (and b, NACC = 2) to warps 0-3 (same rows)
// through red (free shared memory, 128 * 4 * DT * NACC floats); those add them after their own: fixed order
template <int DT, int NACC>
__device__ __forceinline__ void reduce_halves(float* red, float (*a)[4], float (*b)[4], int half) {
    __syncthreads();  // every warp is done with the stage area
    const int rt = threadIdx.x & 127;
    if (half) {
#pragma unroll
        for (int d = 0; d < DT; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                red[(NACC * (d * 4 + e)) * 128 + rt] = a[d][e];
                if constexpr (NACC == 2) red[(2 * (d * 4 + e) + 1) * 128 + rt] = b[d][e];
            }
    }
    __syncthreads();
    if (!half) {
#pragma unroll
        for (int d = 0; d < DT; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                a[d][e] += red[(NACC * (d * 4 + e)) * 128 + rt];
                if constexpr (NACC == 2) b[d][e] += red[(2 * (d * 4 + e) + 1) * 128 + rt];
            }
    }
}

}  // namespace mma
