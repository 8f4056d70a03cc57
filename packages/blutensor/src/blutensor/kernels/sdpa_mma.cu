// Flash attention on the matrix units (mma.sync, sm_80+): tf32 (fp32 storage, m16n8k8), tf32x3 (fp32 storage,
// 3xTF32: fp32-accurate, see TF32X3) and bf16 (raw uint16 storage, m16n8k16), fp32 accumulation and softmax.
// Forward saves only the log-sum-exp; backward recomputes.
// Layout: q (BH, L, HD), k/v (BH, S, HD) contiguous (or strided, struct Lay); o like q; lse (BH, L) fp32 natural
// log; HD in {64, 128}. causal = query i sees keys j <= i (tril(ones(L, S))).
// Blocks of W = 4 or 8 warps (per variant, MMA_ENTRIES): forward 16 W queries (16 rows a warp); backward 64 rows
// (keys in dK/dV, queries in dQ), with 8 warps two per 16 rows, each taking half of every streamed tile, their
// partial sums added in a fixed order. Tiles of 64 rows are staged in dynamic shared memory (row stride HD+4
// floats for tf32 / tf32x3, HD+8 halfwords for bf16, which keeps the fragment loads free of bank conflicts)
// through a two-stage cp.async pipeline; fragments are built with
// ldmatrix / shared loads. The accumulator layout of S = Q K^T is the A operand of P V in registers (tf32: k
// permuted inside groups of 8, see TF32::raw_b; bf16: packing). Backward: D = rowsum(dO*O) (sdpa.cu
// preprocess), then a dK/dV kernel and a dQ kernel, each recomputing P: no atomics, deterministic.
// Self-contained (no headers) so that NVRTC compiles it anywhere.

typedef unsigned short bf16_t;
typedef unsigned int u32;

#define BLU_NEG_INF (-__int_as_float(0x7f800000))
#define BLU_LOG2E 1.4426950408889634f
#define BLU_LN2 0.6931471805599453f

namespace mma {

constexpr int BR = 64;  // rows of a staged tile; rows a backward block owns
// W, the warps of a block (4 or 8, per variant and kernel: MMA_ENTRIES): the forward block owns 16 W queries;
// the backward block 64 rows, W = 8 giving two warps to every 16 rows, each taking half of every streamed tile

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ u32 f2bf(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));  // round to nearest even, one instruction
    return (u32)h;
#else
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
#endif
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // upper half <- hi, lower <- lo
    return r;
#else
    return f2bf(lo) | (f2bf(hi) << 16);
#endif
}
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
    static __device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) {
        mma1(c, a + 4, b);  // small * big
        mma1(c, a, b + 2);  // big * small
        mma1(c, a, b);      // big * big
    }
    // Staged (the long sums over keys / queries: acc_pv): the matrix units' fp32 accumulation truncates, and
    // summed straight into the running accumulator over 1000 keys that bias reached 1e-5 (5-10x the SIMT
    // kernel's error; H200). The three products go to a zeroed temporary, added with one rounded FADD.
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
        a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
        a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
        a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
    static __device__ __forceinline__ float ld(const bf16_t* p) { return bf2f(*p); }
    static __device__ __forceinline__ void store2(bf16_t* p, float a, float b) {
        *reinterpret_cast<u32*>(p) = pack_bf16(a, b);
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

// Strided layouts: element (b, h, row, :) of a tensor is at  b * sb + h * sh + row * st  with bh = b * H + h
// (contiguous (BH, n, HD): H = 1, sb = n * HD, st = HD). q/dq share one layout, k/v/dk/dv one, o/dO one,
// so q, k, v may be views of one fused (B, T, 3, H, HD) qkv tensor and o may be written as (B, T, H, HD).
// Rows must stay 16-byte aligned (st * sizeof(T) % 16 == 0, 16-byte aligned bases).
struct Lay {
    long long sb, sh;
    int st, H;
    __device__ __forceinline__ long long base(int bh) const { return (long long)(bh / H) * sb + (long long)(bh % H) * sh; }
};
__device__ __forceinline__ Lay dense(int n, int HD) { Lay l; l.sb = (long long)n * HD; l.sh = 0; l.st = HD; l.H = 1; return l; }
__device__ __forceinline__ Lay lay(long long sb, long long sh, int st, int H) { Lay l; l.sb = sb; l.sh = sh; l.st = st; l.H = H; return l; }

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

// ================================================================ forward
template <typename X, int HD, int W, typename T = typename X::T>
__device__ void forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                        float* __restrict__ lse, int L, int S, float scale, int causal, Lay lq, Lay lk, Lay lo) {
    constexpr int KS = X::KS, LD = HD + X::PAD, NT = BR / 8, DT = HD / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Ks = reinterpret_cast<T*>(smem_raw);
    T* Vs = Ks + BR * LD;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    constexpr int FR = 16 * W;  // queries of the block
    static_assert(W == 4 || W == 8, "4 or 8 warps");
    const int bh = blockIdx.y, q0 = blockIdx.x * FR;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;  // this thread's two query rows
    const T* qb = q + lq.base(bh);
    const T* kb = k + lk.base(bh);
    const T* vb = v + lk.base(bh);
    const float c = scale * BLU_LOG2E;

    // Q fragments of this warp's 16 rows, kept in registers (the block's Q rows staged where K0 (, V0) go)
    // (tf32x3: the split fragments would take 64 / 128 registers; the raw bits are kept, split per use)
    constexpr bool QRAW = X::NA == 8;
    u32 qa[HD / KS][QRAW ? 4 : X::NA];
#pragma unroll
    for (int j = 0; j < FR / BR; ++j) load_tile<X, HD>(Ks + j * BR * LD, qb, q0 + j * BR, L, lq.st);
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < HD / KS; ++ks) {
        if constexpr (QRAW) X::raw_a(Ks, LD, warp * 16, ks * KS, qa[ks], g, t);
        else X::load_a(Ks, LD, warp * 16, ks * KS, qa[ks], g, t);
    }
#ifndef BLU_SYNC_TILES
    __syncthreads();  // every warp has its Q fragments: stage 0 may be overwritten
    // two stages (K0, V0 | K1, V1) at Ks + stage * 2 * BR * LD: tile i+1 streams in (cp.async) while tile i
    // is computed
    constexpr int STAGE = 2 * BR * LD;
#endif

    float acc[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
    float m0 = BLU_NEG_INF, m1 = BLU_NEG_INF, l0 = 0.f, l1 = 0.f;
    int kend = S;
    if (causal) kend = min(S, q0 + FR);
#ifndef BLU_SYNC_TILES
    if (kend > 0) {
        load_tile_async<X, HD>(Ks, kb, 0, S, lk.st);
        load_tile_async<X, HD>(Vs, vb, 0, S, lk.st);
        cp_async_commit();
    }
#endif
    for (int k0 = 0; k0 < kend; k0 += BR) {
#ifndef BLU_SYNC_TILES
        const int stage = (k0 / BR) & 1;
        if (k0 + BR < kend) {
            load_tile_async<X, HD>(Ks + (stage ^ 1) * STAGE, kb, k0 + BR, S, lk.st);
            load_tile_async<X, HD>(Vs + (stage ^ 1) * STAGE, vb, k0 + BR, S, lk.st);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        prep_tile<X, HD>(Ks + stage * STAGE);
        prep_tile<X, HD>(Vs + stage * STAGE);
        __syncthreads();
        const T* Kt = Ks + stage * STAGE;
        const T* Vt = Vs + stage * STAGE;
#else
        __syncthreads();
        load_tile<X, HD>(Ks, kb, k0, S, lk.st);
        load_tile<X, HD>(Vs, vb, k0, S, lk.st);
        __syncthreads();
        const T* Kt = Ks;
        const T* Vt = Vs;
#endif
        // causal: a warp whose 16 rows all precede the tile skips it (every score masked: no change)
        if (!causal || k0 <= q0 + warp * 16 + 15) {
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < HD / KS; ++ks) {
                u32 qs[QRAW ? X::NA : 1];
                const u32* a = qa[ks];
                if constexpr (QRAW) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        qs[i] = qa[ks][i];
                        asm volatile("" : "+r"(qs[i]));  // opaque: the split is not hoisted out of the key loop
                    }
                    X::template split<4>(qs);
                    a = qs;
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    u32 b[X::NB];
                    X::load_bt(Kt, LD, n * 8, ks * KS, b, g, t);
                    X::mma(s[n], a, b);
                }
            }
            float mx0 = BLU_NEG_INF, mx1 = BLU_NEG_INF;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + n * 8 + 2 * t + (e & 1);
                    const int row = (e < 2) ? row0 : row1;
                    float x = s[n][e] * c;
                    if (key >= S || (causal && key > row)) x = BLU_NEG_INF;
                    s[n][e] = x;
                    if (e < 2) mx0 = fmaxf(mx0, x); else mx1 = fmaxf(mx1, x);
                }
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float mu0 = mn0 == BLU_NEG_INF ? 0.f : mn0, mu1 = mn1 == BLU_NEG_INF ? 0.f : mn1;
            const float al0 = exp2f(m0 - mu0), al1 = exp2f(m1 - mu1);
            l0 *= al0;
            l1 *= al1;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                s[n][0] = exp2f(s[n][0] - mu0);
                s[n][1] = exp2f(s[n][1] - mu0);
                s[n][2] = exp2f(s[n][2] - mu1);
                s[n][3] = exp2f(s[n][3] - mu1);
                l0 += s[n][0] + s[n][1];
                l1 += s[n][2] + s[n][3];
            }
            acc_pv<X, DT, BR / KS, true>(acc, s, Vt, LD, 0, al0, al1, g, t, lane);  // O = O * alpha + P V
            m0 = mn0;
            m1 = mn1;
        }
#ifndef BLU_SYNC_TILES
        __syncthreads();  // this stage is refilled by the next iteration's prefetch
#endif
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
    T* ob = o + lo.base(bh);
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        if (row0 < L) X::store2(ob + (long long)row0 * lo.st + d * 8 + 2 * t, acc[d][0] * i0, acc[d][1] * i0);
        if (row1 < L) X::store2(ob + (long long)row1 * lo.st + d * 8 + 2 * t, acc[d][2] * i1, acc[d][3] * i1);
    }
    if (t == 0) {
        if (row0 < L) lse[(long long)bh * L + row0] = l0 > 0.f ? (m0 + log2f(l0)) * BLU_LN2 : BLU_NEG_INF;
        if (row1 < L) lse[(long long)bh * L + row1] = l1 > 0.f ? (m1 + log2f(l1)) * BLU_LN2 : BLU_NEG_INF;
    }
}

// ================================================================ backward: dK, dV (block owns 64 keys)
// smem: Ks, Vs (own keys), two stages of {Qs, Os (=dO)} tiles of 64 queries, then Ls[2][64] (lse * log2 e),
// Ds[2][64]; the next query tile streams in (cp.async) while the current one is used
template <typename X, int HD, int W, typename T = typename X::T>
__device__ void backward_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ D,
                              T* __restrict__ dk, T* __restrict__ dv, int L, int S, float scale, int causal,
                              Lay lq, Lay lk, Lay lo) {
    constexpr int KS = X::KS, LD = HD + X::PAD, DT = HD / 8;
    constexpr int QSUB = BR / 2, NT = QSUB / 8;  // queries per warp and tile: warps 4-7 take the second half
    static_assert(W == 4 || 2 * DT * 4 * 128 * sizeof(float) <= 4 * BR * LD * sizeof(T), "reduction space");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Ks = reinterpret_cast<T*>(smem_raw);
    T* Vs = Ks + BR * LD;
    T* Q0 = Vs + BR * LD;  // stage s: Q at Q0 + s * 2 * BR * LD, dO right after it
    float* L0 = reinterpret_cast<float*>(Q0 + 4 * BR * LD);  // stage s: Ls at L0 + s * 2 * BR, Ds after it
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wr = warp & 3, half = warp >> 2;  // key rows wr * 16 .. +15; W = 8: queries half * QSUB .. +QSUB-1
    const int bh = blockIdx.y, kb0 = blockIdx.x * BR;
    const int key0 = kb0 + wr * 16 + g, key1 = key0 + 8;
    const T* qb = q + lq.base(bh);
    const T* ob = dout + lo.base(bh);
    const float c = scale * BLU_LOG2E;
    load_tile<X, HD>(Ks, k + lk.base(bh), kb0, S, lk.st);
    load_tile<X, HD>(Vs, v + lk.base(bh), kb0, S, lk.st);
    // the warp's own K and V A-fragments stay in registers where they fit (else reloaded per use)
    constexpr bool KEEP = OwnInRegs<X, HD, W == 4 ? 32 : 0>::value;
    u32 kreg[KEEP ? HD / KS : 1][X::NA], vreg[KEEP ? HD / KS : 1][X::NA];
    if constexpr (KEEP) {
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < HD / KS; ++ks) {
            X::load_a(Ks, LD, wr * 16, ks * KS, kreg[ks], g, t);
            X::load_a(Vs, LD, wr * 16, ks * KS, vreg[ks], g, t);
        }
    }
    float dka[DT][4], dva[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) { dka[d][e] = 0.f; dva[d][e] = 0.f; }
    const int qstart = causal ? kb0 : 0;
    auto stats = [&](int q0, int st) {  // lse * log2(e) and D of query tile q0 into stage st
        float* Lw = L0 + st * 2 * BR;
        for (int i = threadIdx.x; i < BR; i += blockDim.x) {
            const bool ok = q0 + i < L;
            Lw[i] = ok ? lse[(long long)bh * L + q0 + i] * BLU_LOG2E : 0.f;
            Lw[BR + i] = ok ? D[(long long)bh * L + q0 + i] : 0.f;
        }
    };
#ifndef BLU_SYNC_TILES
    if (qstart < L) {
        load_tile_async<X, HD>(Q0, qb, qstart, L, lq.st);
        load_tile_async<X, HD>(Q0 + BR * LD, ob, qstart, L, lo.st);
        cp_async_commit();
        stats(qstart, 0);
    }
#endif
    for (int q0 = qstart; q0 < L; q0 += BR) {
#ifndef BLU_SYNC_TILES
        const int stage = ((q0 - qstart) / BR) & 1;
        if (q0 + BR < L) {
            T* nq = Q0 + (stage ^ 1) * 2 * BR * LD;
            load_tile_async<X, HD>(nq, qb, q0 + BR, L, lq.st);
            load_tile_async<X, HD>(nq + BR * LD, ob, q0 + BR, L, lo.st);
            cp_async_commit();
            stats(q0 + BR, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        prep_tile<X, HD>(Q0 + stage * 2 * BR * LD);
        prep_tile<X, HD>(Q0 + stage * 2 * BR * LD + BR * LD);
#else
        const int stage = 0;
        __syncthreads();
        load_tile<X, HD>(Q0, qb, q0, L, lq.st);
        load_tile<X, HD>(Q0 + BR * LD, ob, q0, L, lo.st);
        stats(q0, 0);
#endif
        __syncthreads();
        const T* Qs = Q0 + stage * 2 * BR * LD;
        const T* Os = Qs + BR * LD;
        const float* Ls = L0 + stage * 2 * BR;
        const float* Ds = Ls + BR;
#pragma unroll 1
        for (int sub = half; sub < 2; sub += W / 4) {  // W = 8: this warp's half; W = 4: both halves
            const int qs0 = sub * QSUB;  // offset of the queries inside the tile
            float st[NT][4], dpt[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) { st[n][e] = 0.f; dpt[n][e] = 0.f; }
#pragma unroll
            for (int ks = 0; ks < HD / KS; ++ks) {
                u32 akt[X::NA], avt[X::NA];
                const u32* ak = akt;
                const u32* av = avt;
                if constexpr (KEEP) {
                    ak = kreg[ks];
                    av = vreg[ks];
                } else {
                    X::load_a(Ks, LD, wr * 16, ks * KS, akt, g, t);
                    X::load_a(Vs, LD, wr * 16, ks * KS, avt, g, t);
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    u32 b[X::NB];
                    X::load_bt(Qs, LD, qs0 + n * 8, ks * KS, b, g, t);
                    X::mma(st[n], ak, b);   // S^T = K Q^T
                    X::load_bt(Os, LD, qs0 + n * 8, ks * KS, b, g, t);
                    X::mma(dpt[n], av, b);  // dP^T = V dO^T
                }
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qi = qs0 + n * 8 + 2 * t + (e & 1);  // index inside the tile
                    const int qg = q0 + qi;
                    const int key = (e < 2) ? key0 : key1;
                    float p = exp2f(st[n][e] * c - Ls[qi]);
                    if (qg >= L || key >= S || (causal && key > qg)) p = 0.f;
                    st[n][e] = p;
                    dpt[n][e] = p * (dpt[n][e] - Ds[qi]);
                }
            }
            acc_pv<X, DT, QSUB / KS, false>(dva, st, Os, LD, qs0, 1.f, 1.f, g, t, lane);   // dV += P^T dO
            acc_pv<X, DT, QSUB / KS, false>(dka, dpt, Qs, LD, qs0, 1.f, 1.f, g, t, lane);  // dK += dS^T Q
        }
#ifndef BLU_SYNC_TILES
        __syncthreads();  // this stage is refilled by the next iteration's prefetch
#endif
    }
    // W = 8: warps 4-7 hand their partial dK, dV to warps 0-3 (same keys) through the free stage area; the sum
    // has a fixed order: deterministic
    if constexpr (W == 8) reduce_halves<DT, 2>(reinterpret_cast<float*>(Q0), dka, dva, half);
    if (half) return;
    T* dkb = dk + lk.base(bh);
    T* dvb = dv + lk.base(bh);
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        if (key0 < S) {
            X::store2(dkb + (long long)key0 * lk.st + d * 8 + 2 * t, dka[d][0] * scale, dka[d][1] * scale);
            X::store2(dvb + (long long)key0 * lk.st + d * 8 + 2 * t, dva[d][0], dva[d][1]);
        }
        if (key1 < S) {
            X::store2(dkb + (long long)key1 * lk.st + d * 8 + 2 * t, dka[d][2] * scale, dka[d][3] * scale);
            X::store2(dvb + (long long)key1 * lk.st + d * 8 + 2 * t, dva[d][2], dva[d][3]);
        }
    }
}

// ================================================================ backward: dQ (block owns 64 queries)
// smem: Qs, Os (=dO) of own queries, two stages of {Ks, Vs} tiles of 64 keys, then Ls[64], Ds[64] of own queries
template <typename X, int HD, int W, typename T = typename X::T>
__device__ void backward_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                            const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ D,
                            T* __restrict__ dq, int L, int S, float scale, int causal, Lay lq, Lay lk, Lay lo) {
    constexpr int KS = X::KS, LD = HD + X::PAD, DT = HD / 8;
    constexpr int KSUB = BR / 2, NT = KSUB / 8;  // keys per warp and tile: warps 4-7 take the second half
    static_assert(W == 4 || DT * 4 * 128 * sizeof(float) <= 4 * BR * LD * sizeof(T), "reduction space");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Qs = reinterpret_cast<T*>(smem_raw);
    T* Os = Qs + BR * LD;
    T* K0 = Os + BR * LD;  // stage s: K at K0 + s * 2 * BR * LD, V right after it
    float* Ls = reinterpret_cast<float*>(K0 + 4 * BR * LD);
    float* Ds = Ls + BR;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wr = warp & 3, half = warp >> 2;  // query rows wr * 16 .. +15; W = 8: keys half * KSUB .. +KSUB-1
    const int bh = blockIdx.y, q0 = blockIdx.x * BR;
    const int r0 = wr * 16 + g, r1 = r0 + 8;  // rows inside the block
    const T* kb = k + lk.base(bh);
    const T* vb = v + lk.base(bh);
    const float c = scale * BLU_LOG2E;
    load_tile<X, HD>(Qs, q + lq.base(bh), q0, L, lq.st);
    load_tile<X, HD>(Os, dout + lo.base(bh), q0, L, lo.st);
    for (int i = threadIdx.x; i < BR; i += blockDim.x) {
        const bool ok = q0 + i < L;
        Ls[i] = ok ? lse[(long long)bh * L + q0 + i] * BLU_LOG2E : 0.f;
        Ds[i] = ok ? D[(long long)bh * L + q0 + i] : 0.f;
    }
    // the warp's own Q and dO A-fragments stay in registers where they fit (else reloaded per use)
    constexpr bool KEEP = OwnInRegs<X, HD, W == 4 ? 64 : 32>::value;
    u32 qreg[KEEP ? HD / KS : 1][X::NA], oreg[KEEP ? HD / KS : 1][X::NA];
    if constexpr (KEEP) {
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < HD / KS; ++ks) {
            X::load_a(Qs, LD, wr * 16, ks * KS, qreg[ks], g, t);
            X::load_a(Os, LD, wr * 16, ks * KS, oreg[ks], g, t);
        }
    }
    float dqa[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) dqa[d][0] = dqa[d][1] = dqa[d][2] = dqa[d][3] = 0.f;
    int kend = S;
    if (causal) kend = min(S, q0 + BR);
#ifndef BLU_SYNC_TILES
    if (kend > 0) {
        load_tile_async<X, HD>(K0, kb, 0, S, lk.st);
        load_tile_async<X, HD>(K0 + BR * LD, vb, 0, S, lk.st);
        cp_async_commit();
    }
#endif
    for (int k0 = 0; k0 < kend; k0 += BR) {
#ifndef BLU_SYNC_TILES
        const int stage = (k0 / BR) & 1;
        if (k0 + BR < kend) {
            T* nk = K0 + (stage ^ 1) * 2 * BR * LD;
            load_tile_async<X, HD>(nk, kb, k0 + BR, S, lk.st);
            load_tile_async<X, HD>(nk + BR * LD, vb, k0 + BR, S, lk.st);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        prep_tile<X, HD>(K0 + stage * 2 * BR * LD);
        prep_tile<X, HD>(K0 + stage * 2 * BR * LD + BR * LD);
#else
        const int stage = 0;
        __syncthreads();
        load_tile<X, HD>(K0, kb, k0, S, lk.st);
        load_tile<X, HD>(K0 + BR * LD, vb, k0, S, lk.st);
#endif
        __syncthreads();
        const T* Ks = K0 + stage * 2 * BR * LD;
        const T* Vs = Ks + BR * LD;
        const float l0 = Ls[r0], l1 = Ls[r1], d0 = Ds[r0], d1 = Ds[r1];
#pragma unroll 1
        for (int sub = half; sub < 2; sub += W / 4) {  // W = 8: this warp's half; W = 4: both halves
            const int ks0 = sub * KSUB;  // offset of the keys inside the tile
            float s[NT][4], dp[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) { s[n][e] = 0.f; dp[n][e] = 0.f; }
#pragma unroll
            for (int ks = 0; ks < HD / KS; ++ks) {
                u32 aqt[X::NA], aot[X::NA];
                const u32* aq = aqt;
                const u32* ao = aot;
                if constexpr (KEEP) {
                    aq = qreg[ks];
                    ao = oreg[ks];
                } else {
                    X::load_a(Qs, LD, wr * 16, ks * KS, aqt, g, t);
                    X::load_a(Os, LD, wr * 16, ks * KS, aot, g, t);
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    u32 b[X::NB];
                    X::load_bt(Ks, LD, ks0 + n * 8, ks * KS, b, g, t);
                    X::mma(s[n], aq, b);   // S = Q K^T
                    X::load_bt(Vs, LD, ks0 + n * 8, ks * KS, b, g, t);
                    X::mma(dp[n], ao, b);  // dP = dO V^T
                }
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + ks0 + n * 8 + 2 * t + (e & 1);
                    const int row = q0 + ((e < 2) ? r0 : r1);
                    float p = exp2f(s[n][e] * c - ((e < 2) ? l0 : l1));
                    if (row >= L || key >= S || (causal && key > row)) p = 0.f;
                    dp[n][e] = p * (dp[n][e] - ((e < 2) ? d0 : d1));
                }
            }
            acc_pv<X, DT, KSUB / KS, false>(dqa, dp, Ks, LD, ks0, 1.f, 1.f, g, t, lane);  // dQ += dS K
        }
#ifndef BLU_SYNC_TILES
        __syncthreads();  // this stage is refilled by the next iteration's prefetch
#endif
    }
    // W = 8: warps 4-7 hand their partial dQ to warps 0-3 (same rows) through the free stage area: fixed order
    if constexpr (W == 8) reduce_halves<DT, 1>(reinterpret_cast<float*>(K0), dqa, dqa, half);
    if (half) return;
    T* dqb = dq + lq.base(bh);
    const int row0 = q0 + r0, row1 = q0 + r1;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        if (row0 < L) X::store2(dqb + (long long)row0 * lq.st + d * 8 + 2 * t, dqa[d][0] * scale, dqa[d][1] * scale);
        if (row1 < L) X::store2(dqb + (long long)row1 * lq.st + d * 8 + 2 * t, dqa[d][2] * scale, dqa[d][3] * scale);
    }
}

}  // namespace mma

// strided entries: the three layouts as (sb, sh, st) triples and the head count H (see struct Lay)
#define BLU_LAY_PARAMS                                                                                         \
    int H, long long q_sb, long long q_sh, int q_st, long long k_sb, long long k_sh, int k_st, long long o_sb, \
        long long o_sh, int o_st
#define BLU_LAYS                                                                                               \
    mma::lay(q_sb, q_sh, q_st, H), mma::lay(k_sb, k_sh, k_st, H), mma::lay(o_sb, o_sh, o_st, H)

// Entries of one variant and head dim. FW / BW: warps of a forward / backward block (4 or 8; sdpa.py's MMA_WARPS
// mirrors them); FMIN / BMIN: blocks a multiprocessor the kernels are built for (2 with 8 warps: at most 128
// registers; 1: as many registers as they take). H200, GPT-2 layer fwd+bwd: 8 warps for all (tf32 1.92 -> 1.61
// ms; bf16 0.87 with 8 and with 4 warps in separate runs, 0.92-0.95 in others: noise).
#define MMA_ENTRIES(NAME, X, T, HD, FW, FMIN, BW, BMIN)                                                                \
extern "C" __global__ void __launch_bounds__(FW * 32, FMIN)                                                            \
blu_sdpa_forward_##NAME##_hd##HD(const T* q, const T* k, const T* v, T* o, float* lse, int L, int S,                   \
                                 float scale, int causal) {                                                            \
    mma::forward<mma::X, HD, FW>(q, k, v, o, lse, L, S, scale, causal, mma::dense(L, HD), mma::dense(S, HD),           \
                                 mma::dense(L, HD));                                                                   \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_dkdv_##NAME##_hd##HD(const T* q, const T* k, const T* v, const T* dout, const float* lse,            \
                                       const float* D, T* dk, T* dv, int L, int S, float scale, int causal) {          \
    mma::backward_dkdv<mma::X, HD, BW>(q, k, v, dout, lse, D, dk, dv, L, S, scale, causal, mma::dense(L, HD),          \
                                       mma::dense(S, HD), mma::dense(L, HD));                                          \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_dq_##NAME##_hd##HD(const T* q, const T* k, const T* v, const T* dout, const float* lse,              \
                                     const float* D, T* dq, int L, int S, float scale, int causal) {                   \
    mma::backward_dq<mma::X, HD, BW>(q, k, v, dout, lse, D, dq, L, S, scale, causal, mma::dense(L, HD),                \
                                     mma::dense(S, HD), mma::dense(L, HD));                                            \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(FW * 32, FMIN)                                                            \
blu_sdpa_forward_strided_##NAME##_hd##HD(const T* q, const T* k, const T* v, T* o, float* lse, int L, int S,           \
                                         float scale, int causal, BLU_LAY_PARAMS) {                                    \
    mma::forward<mma::X, HD, FW>(q, k, v, o, lse, L, S, scale, causal, BLU_LAYS);                                      \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_dkdv_strided_##NAME##_hd##HD(const T* q, const T* k, const T* v, const T* dout,                      \
                                               const float* lse, const float* D, T* dk, T* dv, int L, int S,           \
                                               float scale, int causal, BLU_LAY_PARAMS) {                              \
    mma::backward_dkdv<mma::X, HD, BW>(q, k, v, dout, lse, D, dk, dv, L, S, scale, causal, BLU_LAYS);                  \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_dq_strided_##NAME##_hd##HD(const T* q, const T* k, const T* v, const T* dout,                        \
                                             const float* lse, const float* D, T* dq, int L, int S,                    \
                                             float scale, int causal, BLU_LAY_PARAMS) {                                \
    mma::backward_dq<mma::X, HD, BW>(q, k, v, dout, lse, D, dq, L, S, scale, causal, BLU_LAYS);                        \
}

MMA_ENTRIES(tf32, TF32, float, 64, 8, 2, 8, 2)
MMA_ENTRIES(tf32, TF32, float, 128, 8, 1, 8, 1)
MMA_ENTRIES(tf32x3, TF32X3, float, 64, 8, 1, 8, 1)
MMA_ENTRIES(tf32x3, TF32X3, float, 128, 8, 1, 8, 1)
MMA_ENTRIES(bf16, BF16, bf16_t, 64, 8, 2, 8, 2)
MMA_ENTRIES(bf16, BF16, bf16_t, 128, 8, 1, 8, 1)
