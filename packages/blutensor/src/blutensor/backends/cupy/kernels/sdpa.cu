// Flash attention, fp32 SIMT variant (strict fp32: no matrix units). Forward saves only the log-sum-exp;
// backward recomputes the probabilities. Layout: q (BH, L, HD), k/v (BH, S, HD), contiguous; o like q;
// lse (BH, L) fp32 in natural-log units. causal = query i sees keys j <= i (tril(ones(L, S))).
// HD in {32, 64, 128}: a query (or key) row is owned by G = HD/32 adjacent threads, each holding 32 of
// its dims in registers as 8 float4 chunks interleaved across the G threads (conflict-free float4 reads
// of the shared-memory K/V tiles); dot products finish with log2(G) xor-shuffles.
// Backward: preprocess D = rowsum(dO * O); dK/dV kernel (block per 64 keys, loops over query tiles) and
// a separate dQ kernel (block per 64 queries, loops over key tiles): no atomics, deterministic.
// Self-contained (no headers) so that NVRTC compiles it anywhere.

typedef unsigned short bf16_t;

#define BLU_NEG_INF (-__int_as_float(0x7f800000))
#define BLU_LOG2E 1.4426950408889634f
#define BLU_LN2 0.6931471805599453f

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }

#include "sdpa_layout.cuh"

namespace simt {

constexpr int BR = 64;  // rows owned per block
constexpr int BC = 32;  // rows per shared-memory tile

template <int G>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int off = 1; off < G; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// dims owned by thread g of a group: chunk c (0..7) -> dims 4*(g + G*c) .. +3
template <int G>
__device__ __forceinline__ void load_row(const float* __restrict__ row, int g, float* r, float mul) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        float4 v = *reinterpret_cast<const float4*>(row + 4 * (g + G * c));
        r[4 * c] = v.x * mul; r[4 * c + 1] = v.y * mul; r[4 * c + 2] = v.z * mul; r[4 * c + 3] = v.w * mul;
    }
}

template <int G>
__device__ __forceinline__ void store_row(float* __restrict__ row, int g, const float* r, float mul) {
#pragma unroll
    for (int c = 0; c < 8; ++c)
        *reinterpret_cast<float4*>(row + 4 * (g + G * c)) =
            make_float4(r[4 * c] * mul, r[4 * c + 1] * mul, r[4 * c + 2] * mul, r[4 * c + 3] * mul);
}

template <int G>
__device__ __forceinline__ float dot_row(const float* __restrict__ srow, int g, const float* r) {
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        float4 v = *reinterpret_cast<const float4*>(srow + 4 * (g + G * c));
        s += r[4 * c] * v.x + r[4 * c + 1] * v.y + r[4 * c + 2] * v.z + r[4 * c + 3] * v.w;
    }
    return s;
}

template <int G>
__device__ __forceinline__ void axpy_row(float* r, float a, const float* __restrict__ srow, int g) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        float4 v = *reinterpret_cast<const float4*>(srow + 4 * (g + G * c));
        r[4 * c] += a * v.x; r[4 * c + 1] += a * v.y; r[4 * c + 2] += a * v.z; r[4 * c + 3] += a * v.w;
    }
}

// cooperative copy of rows [r0, r0 + BC) of a (n, HD) matrix into smem (zeros past n)
template <int HD>
__device__ __forceinline__ void load_tile(float* __restrict__ dst, const float* __restrict__ src, int r0, int n, int ld) {
    constexpr int Q = HD / 4;
    for (int i = threadIdx.x; i < BC * Q; i += blockDim.x) {
        int r = i / Q, c = i % Q;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r0 + r < n) v = *reinterpret_cast<const float4*>(src + (long long)(r0 + r) * ld + 4 * c);
        *reinterpret_cast<float4*>(dst + r * HD + 4 * c) = v;
    }
}

template <int HD>
__device__ void forward(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                        float* __restrict__ o, float* __restrict__ lse, int L, int S, float scale, int causal,
                        Lay lq, Lay lk, Lay lo) {
    constexpr int G = HD / 32;
    __shared__ __align__(16) float Ks[BC * HD];
    __shared__ __align__(16) float Vs[BC * HD];
    const int bh = blockIdx.y;
    const int r = threadIdx.x / G, g = threadIdx.x % G;
    const int qi = blockIdx.x * BR + r;
    const float* kb = k + lk.base(bh);
    const float* vb = v + lk.base(bh);
    const float c = scale * BLU_LOG2E;
    float qr[32], acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) { qr[i] = 0.f; acc[i] = 0.f; }
    if (qi < L) load_row<G>(q + lq.base(bh) + (long long)qi * lq.st, g, qr, c);
    float m = BLU_NEG_INF, l = 0.f;
    int kend = S;
    if (causal) { int e = (blockIdx.x + 1) * BR; kend = e < S ? e : S; }
    for (int k0 = 0; k0 < kend; k0 += BC) {
        __syncthreads();
        load_tile<HD>(Ks, kb, k0, S, lk.st);
        load_tile<HD>(Vs, vb, k0, S, lk.st);
        __syncthreads();
        float s[BC];
        float mt = BLU_NEG_INF;
#pragma unroll
        for (int j = 0; j < BC; ++j) {
            float x = group_sum<G>(dot_row<G>(Ks + j * HD, g, qr));
            const int kj = k0 + j;
            if (kj >= S || (causal && kj > qi)) x = BLU_NEG_INF;
            s[j] = x;
            mt = fmaxf(mt, x);
        }
        const float mn = fmaxf(m, mt);
        if (mn == BLU_NEG_INF) continue;
        const float alpha = exp2f(m - mn);
        l *= alpha;
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] *= alpha;
#pragma unroll
        for (int j = 0; j < BC; ++j) {
            const float p = exp2f(s[j] - mn);
            l += p;
            axpy_row<G>(acc, p, Vs + j * HD, g);
        }
        m = mn;
    }
    if (qi < L) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        store_row<G>(o + lo.base(bh) + (long long)qi * lo.st, g, acc, inv);
        if (g == 0) lse[(long long)bh * L + qi] = l > 0.f ? (m + log2f(l)) * BLU_LN2 : BLU_NEG_INF;
    }
}

// dK, dV for 64 keys per block; loops over query tiles. D = rowsum(dO * O).
template <int HD>
__device__ void backward_dkdv(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                              const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ D,
                              float* __restrict__ dk, float* __restrict__ dv, int L, int S, float scale, int causal,
                              Lay lq, Lay lk, Lay lo) {
    constexpr int G = HD / 32;
    __shared__ __align__(16) float Qs[BC * HD];
    __shared__ __align__(16) float Os[BC * HD];
    __shared__ float Ls[BC], Ds[BC];
    const int bh = blockIdx.y;
    const int r = threadIdx.x / G, g = threadIdx.x % G;
    const int kj = blockIdx.x * BR + r;
    const float c = scale * BLU_LOG2E;
    float kr[32], vr[32], dkr[32], dvr[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) { kr[i] = 0.f; vr[i] = 0.f; dkr[i] = 0.f; dvr[i] = 0.f; }
    if (kj < S) {
        load_row<G>(k + lk.base(bh) + (long long)kj * lk.st, g, kr, c);  // k pre-scaled by scale*log2(e)
        load_row<G>(v + lk.base(bh) + (long long)kj * lk.st, g, vr, 1.f);
    }
    const float* qb = q + lq.base(bh);
    const float* ob = dout + lo.base(bh);
    int q0 = 0;
    if (causal) q0 = (blockIdx.x * BR / BC) * BC;
    for (; q0 < L; q0 += BC) {
        __syncthreads();
        load_tile<HD>(Qs, qb, q0, L, lq.st);
        load_tile<HD>(Os, ob, q0, L, lo.st);
        for (int i = threadIdx.x; i < BC; i += blockDim.x) {
            const bool ok = q0 + i < L;
            Ls[i] = ok ? lse[(long long)bh * L + q0 + i] * BLU_LOG2E : 0.f;
            Ds[i] = ok ? D[(long long)bh * L + q0 + i] : 0.f;
        }
        __syncthreads();
#pragma unroll 2
        for (int i = 0; i < BC; ++i) {
            const int qi = q0 + i;
            const float s = group_sum<G>(dot_row<G>(Qs + i * HD, g, kr));
            float p = exp2f(s - Ls[i]);
            if (qi >= L || kj >= S || (causal && kj > qi)) p = 0.f;
            axpy_row<G>(dvr, p, Os + i * HD, g);
            const float dp = group_sum<G>(dot_row<G>(Os + i * HD, g, vr));
            const float ds = p * (dp - Ds[i]);
            axpy_row<G>(dkr, ds, Qs + i * HD, g);
        }
    }
    if (kj < S) {
        store_row<G>(dk + lk.base(bh) + (long long)kj * lk.st, g, dkr, scale);
        store_row<G>(dv + lk.base(bh) + (long long)kj * lk.st, g, dvr, 1.f);
    }
}

template <int HD>
__device__ void backward_dq(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                            const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ D,
                            float* __restrict__ dq, int L, int S, float scale, int causal, Lay lq, Lay lk, Lay lo) {
    constexpr int G = HD / 32;
    __shared__ __align__(16) float Ks[BC * HD];
    __shared__ __align__(16) float Vs[BC * HD];
    const int bh = blockIdx.y;
    const int r = threadIdx.x / G, g = threadIdx.x % G;
    const int qi = blockIdx.x * BR + r;
    const float c = scale * BLU_LOG2E;
    float qr[32], dor[32], dqr[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) { qr[i] = 0.f; dor[i] = 0.f; dqr[i] = 0.f; }
    float li = 0.f, di = 0.f;
    if (qi < L) {
        load_row<G>(q + lq.base(bh) + (long long)qi * lq.st, g, qr, c);
        load_row<G>(dout + lo.base(bh) + (long long)qi * lo.st, g, dor, 1.f);
        li = lse[(long long)bh * L + qi] * BLU_LOG2E;
        di = D[(long long)bh * L + qi];
    }
    const float* kb = k + lk.base(bh);
    const float* vb = v + lk.base(bh);
    int kend = S;
    if (causal) { int e = (blockIdx.x + 1) * BR; kend = e < S ? e : S; }
    for (int k0 = 0; k0 < kend; k0 += BC) {
        __syncthreads();
        load_tile<HD>(Ks, kb, k0, S, lk.st);
        load_tile<HD>(Vs, vb, k0, S, lk.st);
        __syncthreads();
#pragma unroll 2
        for (int j = 0; j < BC; ++j) {
            const int kj = k0 + j;
            const float s = group_sum<G>(dot_row<G>(Ks + j * HD, g, qr));
            float p = exp2f(s - li);
            if (qi >= L || kj >= S || (causal && kj > qi)) p = 0.f;
            const float dp = group_sum<G>(dot_row<G>(Vs + j * HD, g, dor));
            axpy_row<G>(dqr, p * (dp - di), Ks + j * HD, g);
        }
    }
    if (qi < L) store_row<G>(dq + lq.base(bh) + (long long)qi * lq.st, g, dqr, scale);
}

}  // namespace simt

// D[row] = sum_d dO[row, d] * O[row, d]; one warp per row; fp32 or bf16 storage. n_rows = BH * L.
template <typename T>
__device__ void sdpa_preprocess(const T* __restrict__ dout, const T* __restrict__ o, float* __restrict__ D,
                                long long n_rows, int HD, int L, Lay lo) {
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < n_rows; row += (long long)gridDim.x * wpb) {
        float s = 0.f;
        const long long off = lo.base((int)(row / L)) + (row % L) * lo.st;  // D stays (BH, L) contiguous
        for (int d = lane; d < HD; d += 32) s += to_f(dout[off + d]) * to_f(o[off + d]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) D[row] = s;
    }
}

extern "C" __global__ void blu_sdpa_backward_preprocess_f32(const float* dout, const float* o, float* D,
                                                            long long n_rows, int HD) {
    sdpa_preprocess<float>(dout, o, D, n_rows, HD, 1, dense(1, HD));
}
extern "C" __global__ void blu_sdpa_backward_preprocess_bf16(const bf16_t* dout, const bf16_t* o, float* D,
                                                             long long n_rows, int HD) {
    sdpa_preprocess<bf16_t>(dout, o, D, n_rows, HD, 1, dense(1, HD));
}
// o / dO in a strided layout (H heads, L rows per head): D row r = (bh = r / L, i = r % L)
extern "C" __global__ void blu_sdpa_backward_preprocess_strided_f32(const float* dout, const float* o, float* D,
                                                                    long long n_rows, int HD, int L, int H,
                                                                    long long o_sb, long long o_sh, int o_st) {
    sdpa_preprocess<float>(dout, o, D, n_rows, HD, L, lay(o_sb, o_sh, o_st, H));
}
extern "C" __global__ void blu_sdpa_backward_preprocess_strided_bf16(const bf16_t* dout, const bf16_t* o, float* D,
                                                                     long long n_rows, int HD, int L, int H,
                                                                     long long o_sb, long long o_sh, int o_st) {
    sdpa_preprocess<bf16_t>(dout, o, D, n_rows, HD, L, lay(o_sb, o_sh, o_st, H));
}

#define BLU_LAY_PARAMS                                                                                         \
    int H, long long q_sb, long long q_sh, int q_st, long long k_sb, long long k_sh, int k_st, long long o_sb, \
        long long o_sh, int o_st
#define BLU_LAYS lay(q_sb, q_sh, q_st, H), lay(k_sb, k_sh, k_st, H), lay(o_sb, o_sh, o_st, H)

#define SIMT_ENTRIES(HD)                                                                                       \
extern "C" __global__ void __launch_bounds__(64 * (HD / 32))                                                   \
blu_sdpa_forward_simt_hd##HD(const float* q, const float* k, const float* v, float* o, float* lse, int L,      \
                             int S, float scale, int causal) {                                                 \
    simt::forward<HD>(q, k, v, o, lse, L, S, scale, causal, dense(L, HD), dense(S, HD), dense(L, HD));         \
}                                                                                                              \
extern "C" __global__ void __launch_bounds__(64 * (HD / 32))                                                   \
blu_sdpa_backward_dkdv_simt_hd##HD(const float* q, const float* k, const float* v, const float* dout,          \
                                   const float* lse, const float* D, float* dk, float* dv, int L, int S,       \
                                   float scale, int causal) {                                                  \
    simt::backward_dkdv<HD>(q, k, v, dout, lse, D, dk, dv, L, S, scale, causal, dense(L, HD), dense(S, HD),    \
                            dense(L, HD));                                                                     \
}                                                                                                              \
extern "C" __global__ void __launch_bounds__(64 * (HD / 32))                                                   \
blu_sdpa_backward_dq_simt_hd##HD(const float* q, const float* k, const float* v, const float* dout,            \
                                 const float* lse, const float* D, float* dq, int L, int S, float scale,       \
                                 int causal) {                                                                 \
    simt::backward_dq<HD>(q, k, v, dout, lse, D, dq, L, S, scale, causal, dense(L, HD), dense(S, HD),          \
                          dense(L, HD));                                                                       \
}                                                                                                              \
extern "C" __global__ void __launch_bounds__(64 * (HD / 32))                                                   \
blu_sdpa_forward_strided_simt_hd##HD(const float* q, const float* k, const float* v, float* o, float* lse,     \
                                     int L, int S, float scale, int causal, BLU_LAY_PARAMS) {                  \
    simt::forward<HD>(q, k, v, o, lse, L, S, scale, causal, BLU_LAYS);                                         \
}                                                                                                              \
extern "C" __global__ void __launch_bounds__(64 * (HD / 32))                                                   \
blu_sdpa_backward_dkdv_strided_simt_hd##HD(const float* q, const float* k, const float* v, const float* dout,  \
                                           const float* lse, const float* D, float* dk, float* dv, int L,      \
                                           int S, float scale, int causal, BLU_LAY_PARAMS) {                   \
    simt::backward_dkdv<HD>(q, k, v, dout, lse, D, dk, dv, L, S, scale, causal, BLU_LAYS);                     \
}                                                                                                              \
extern "C" __global__ void __launch_bounds__(64 * (HD / 32))                                                   \
blu_sdpa_backward_dq_strided_simt_hd##HD(const float* q, const float* k, const float* v, const float* dout,    \
                                         const float* lse, const float* D, float* dq, int L, int S,            \
                                         float scale, int causal, BLU_LAY_PARAMS) {                            \
    simt::backward_dq<HD>(q, k, v, dout, lse, D, dq, L, S, scale, causal, BLU_LAYS);                           \
}

SIMT_ENTRIES(32)
SIMT_ENTRIES(64)
SIMT_ENTRIES(128)
