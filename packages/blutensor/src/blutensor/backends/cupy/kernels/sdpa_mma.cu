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
// preprocess), then either a dK/dV kernel and a dQ kernel, each recomputing P (5 + 2 products a key/query
// tile pair: no atomics, deterministic), or (fp32 storage: tf32, tf32x3) the fused kernel, the dK/dV kernel
// that also stages dS in shared memory and adds its block's dS K into a zeroed dQ with fp32 atomics (5
// products: ~30% less work; the order of the atomic adds varies, so dQ's last bits vary run to run).
// Fragment traits (TF32, TF32X3, BF16), tile staging and shared helpers: sdpa_mma_frag.cuh (inlined by the
// loader, so NVRTC still compiles one self-contained text).

#include "sdpa_mma_frag.cuh"

namespace mma {

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

// ================================================================ backward: the stanzas both kernels share
// Both backward kernels own 64 rows (dK/dV: keys, dQ: queries), keep two tiles of them (K, V / Q, dO) and stream
// the other side's tile pairs (Q, dO / K, V) through two shared stages, recompute P and dP per streamed tile and
// turn them into dS; only the roles of rows and columns differ (dK/dV works on the transposes).
// The helpers declare no local arrays: arrays declared in an inlined callee are placed before the caller's,
// which reorders registers and changes the machine code; their scratch comes from the caller, declared where
// the stanza used to declare it (dev/sass_diff.py shows the SASS unchanged).

// lse * log2(e) and D of query rows q0 .. q0 + 63 into Ls[0 .. 63] and Ls[64 .. 127] (0 past L): the dK/dV
// kernel's per-tile statistics (the dQ kernel loads its own once, into separate arrays)
__device__ __forceinline__ void load_stats(float* Ls, const float* lse, const float* D, int bh, int L, int q0) {
    for (int i = threadIdx.x; i < BR; i += blockDim.x) {
        const bool ok = q0 + i < L;
        Ls[i] = ok ? lse[(long long)bh * L + q0 + i] * BLU_LOG2E : 0.f;
        Ls[BR + i] = ok ? D[(long long)bh * L + q0 + i] : 0.f;
    }
}

// the warp's A fragments (rows r0 .. r0 + 15) of the block's own tiles A0, A1 into registers (KEEP, see
// OwnInRegs; after a barrier that publishes the tiles); without KEEP recompute loads them per use
template <typename X, int HD, bool KEEP, typename T>
__device__ __forceinline__ void keep_own(u32 (*f0)[X::NA], u32 (*f1)[X::NA], const T* A0, const T* A1, int r0, int g,
                                         int t) {
    constexpr int KS = X::KS, LD = HD + X::PAD;
    if constexpr (KEEP) {
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < HD / KS; ++ks) {
            X::load_a(A0, LD, r0, ks * KS, f0[ks], g, t);
            X::load_a(A1, LD, r0, ks * KS, f1[ks], g, t);
        }
    }
}

// Two shared stages of a streamed tile pair: stage s holds rows of a at S0 + s * 2 * BR * LD and the same rows
// of b right after; rows past n read as zero. The next pair streams in (cp.async) while the current one is used
// (BLU_SYNC_TILES: synchronous loads into stage 0). hook(r, s) runs once per pair as it is requested (the dK/dV
// kernel stages the query statistics with it).
// Before the loop over r = r0, r0 + 64, .. < end: request the first pair.
template <typename X, int HD, typename T, typename F>
__device__ __forceinline__ void stream_start(T* S0, const T* a, const T* b, int n, int sta, int stb, int r0, int end,
                                             F&& hook) {
    constexpr int LD = HD + X::PAD;
#ifndef BLU_SYNC_TILES
    if (r0 < end) {
        load_tile_async<X, HD>(S0, a, r0, n, sta);
        load_tile_async<X, HD>(S0 + BR * LD, b, r0, n, stb);
        cp_async_commit();
        hook(r0, 0);
    }
#endif
}

// At the top of iteration r: request pair r + 64 (if < end), wait for pair r, round it where the loaders expect
// tf32 (prep_tile); returns its stage. The caller's barrier publishes it.
template <typename X, int HD, typename T, typename F>
__device__ __forceinline__ int stream_next(T* S0, const T* a, const T* b, int n, int sta, int stb, int r, int r0,
                                           int end, F&& hook) {
    constexpr int LD = HD + X::PAD;
#ifndef BLU_SYNC_TILES
    const int stage = ((r - r0) / BR) & 1;
    if (r + BR < end) {
        T* nx = S0 + (stage ^ 1) * 2 * BR * LD;
        load_tile_async<X, HD>(nx, a, r + BR, n, sta);
        load_tile_async<X, HD>(nx + BR * LD, b, r + BR, n, stb);
        cp_async_commit();
        hook(r + BR, stage ^ 1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    prep_tile<X, HD>(S0 + stage * 2 * BR * LD);
    prep_tile<X, HD>(S0 + stage * 2 * BR * LD + BR * LD);
#else
    const int stage = 0;
    __syncthreads();
    load_tile<X, HD>(S0, a, r, n, sta);
    load_tile<X, HD>(S0 + BR * LD, b, r, n, stb);
    hook(r, 0);
#endif
    return stage;
}

// the hook of a stream without per-pair work
__device__ __forceinline__ void no_hook(int, int) {}

// The two recomputed products of a warp and streamed tile: s = A0 B0^T and dp = A1 B1^T over HD, for the warp's
// 16 own rows r0 .. (A0, A1: own tiles, fragments f0, f1 in registers when KEEP) and NT n-tiles of 8 streamed rows
// from c0 (B0, B1). a0t, a1t (X::NA) and b (X::NB): the caller's fragment scratch.
template <typename X, int HD, int NT, bool KEEP, typename T>
__device__ __forceinline__ void recompute(float (*s)[4], float (*dp)[4], u32* a0t, u32* a1t, u32* b,
                                          const u32 (*f0)[X::NA], const u32 (*f1)[X::NA], const T* A0, const T* A1,
                                          const T* B0, const T* B1, int r0, int c0, int g, int t) {
    constexpr int KS = X::KS, LD = HD + X::PAD;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) { s[n][e] = 0.f; dp[n][e] = 0.f; }
#pragma unroll
    for (int ks = 0; ks < HD / KS; ++ks) {
        const u32* a0 = a0t;
        const u32* a1 = a1t;
        if constexpr (KEEP) {
            a0 = f0[ks];
            a1 = f1[ks];
        } else {
            X::load_a(A0, LD, r0, ks * KS, a0t, g, t);
            X::load_a(A1, LD, r0, ks * KS, a1t, g, t);
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            X::load_bt(B0, LD, c0 + n * 8, ks * KS, b, g, t);
            X::mma(s[n], a0, b);
            X::load_bt(B1, LD, c0 + n * 8, ks * KS, b, g, t);
            X::mma(dp[n], a1, b);
        }
    }
}

// ================================================================ backward: dK, dV (block owns 64 keys)
// smem: Ks, Vs (own keys), two stages of {Qs, Os (=dO)} tiles of 64 queries, then Ls[2][64] (lse * log2 e),
// Ds[2][64]; the next query tile streams in (cp.async) while the current one is used.
// FDQ (fused dQ, fp32 storage): then Ss[64][SLD], the tile's dS as [query][key]; after each tile warp w computes
// rows (w % 4) * 16 .. +15, head-dim columns (w / 4) * HD / (W / 4) .. of dS K (a zeroed accumulator: one
// 64-key sum) and adds it, times scale, into dq32 (zeroed by the caller, layout lq) with fp32 atomics
template <typename X, int HD, int W, bool FDQ = false, typename T = typename X::T>
__device__ void backward_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ D,
                              T* __restrict__ dk, T* __restrict__ dv, int L, int S, float scale, int causal,
                              Lay lq, Lay lk, Lay lo, float* __restrict__ dq32 = nullptr) {
    constexpr int KS = X::KS, LD = HD + X::PAD, DT = HD / 8;
    constexpr int QSUB = BR / 2, NT = QSUB / 8;  // queries per warp and tile: warps 4-7 take the second half
    static_assert(W == 4 || 2 * DT * 4 * 128 * sizeof(float) <= 4 * BR * LD * sizeof(T), "reduction space");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Ks = reinterpret_cast<T*>(smem_raw);
    T* Vs = Ks + BR * LD;
    T* Q0 = Vs + BR * LD;  // stage s: Q at Q0 + s * 2 * BR * LD, dO right after it
    float* L0 = reinterpret_cast<float*>(Q0 + 4 * BR * LD);  // stage s: Ls at L0 + s * 2 * BR, Ds after it
    float* Ss = L0 + 4 * BR;  // FDQ: dS of the current tile, [query][key], row stride SLD
    static_assert(!FDQ || sizeof(T) == 4, "fused dQ: fp32 storage only");
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
    keep_own<X, HD, KEEP>(kreg, vreg, Ks, Vs, wr * 16, g, t);
    float dka[DT][4], dva[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) { dka[d][e] = 0.f; dva[d][e] = 0.f; }
    const int qstart = causal ? kb0 : 0;
    // lse * log2(e) and D of query tile q0 into stage st
    auto stats = [&](int q0, int st) { load_stats(L0 + st * 2 * BR, lse, D, bh, L, q0); };
    stream_start<X, HD>(Q0, qb, ob, L, lq.st, lo.st, qstart, L, stats);
    for (int q0 = qstart; q0 < L; q0 += BR) {
        const int stage = stream_next<X, HD>(Q0, qb, ob, L, lq.st, lo.st, q0, qstart, L, stats);
        __syncthreads();
        const T* Qs = Q0 + stage * 2 * BR * LD;
        const T* Os = Qs + BR * LD;
        const float* Ls = L0 + stage * 2 * BR;
        const float* Ds = Ls + BR;
#pragma unroll 1
        for (int sub = half; sub < 2; sub += W / 4) {  // W = 8: this warp's half; W = 4: both halves
            const int qs0 = sub * QSUB;  // offset of the queries inside the tile
            float st[NT][4], dpt[NT][4];
            u32 akt[X::NA], avt[X::NA], b[X::NB];  // scratch of recompute, declared here (see its note)
            // S^T = K Q^T, dP^T = V dO^T
            recompute<X, HD, NT, KEEP>(st, dpt, akt, avt, b, kreg, vreg, Ks, Vs, Qs, Os, wr * 16, qs0, g, t);
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
                    if constexpr (FDQ) Ss[qi * SLD + wr * 16 + g + (e < 2 ? 0 : 8)] = X::tile_value(dpt[n][e]);
                }
            }
            acc_pv<X, DT, QSUB / KS, false>(dva, st, Os, LD, qs0, 1.f, 1.f, g, t, lane);   // dV += P^T dO
            acc_pv<X, DT, QSUB / KS, false>(dka, dpt, Qs, LD, qs0, 1.f, 1.f, g, t, lane);  // dK += dS^T Q
        }
        if constexpr (FDQ) {
            __syncthreads();  // the whole tile's dS is staged
            dq_atomic<X, HD, W>(Ss, Ks, LD, dq32 + lq.base(bh), lq.st, wr * 16, q0, warp >> 2, L, scale, g, t);
        }
#ifndef BLU_SYNC_TILES
        __syncthreads();  // this stage (and FDQ's Ss) is refilled by the next iteration
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
    keep_own<X, HD, KEEP>(qreg, oreg, Qs, Os, wr * 16, g, t);
    float dqa[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) dqa[d][0] = dqa[d][1] = dqa[d][2] = dqa[d][3] = 0.f;
    int kend = S;
    if (causal) kend = min(S, q0 + BR);
    stream_start<X, HD>(K0, kb, vb, S, lk.st, lk.st, 0, kend, no_hook);
    for (int k0 = 0; k0 < kend; k0 += BR) {
        const int stage = stream_next<X, HD>(K0, kb, vb, S, lk.st, lk.st, k0, 0, kend, no_hook);
        __syncthreads();
        const T* Ks = K0 + stage * 2 * BR * LD;
        const T* Vs = Ks + BR * LD;
        const float l0 = Ls[r0], l1 = Ls[r1], d0 = Ds[r0], d1 = Ds[r1];
#pragma unroll 1
        for (int sub = half; sub < 2; sub += W / 4) {  // W = 8: this warp's half; W = 4: both halves
            const int ks0 = sub * KSUB;  // offset of the keys inside the tile
            float s[NT][4], dp[NT][4];
            u32 aqt[X::NA], aot[X::NA], b[X::NB];  // scratch of recompute, declared here (see its note)
            // S = Q K^T, dP = dO V^T
            recompute<X, HD, NT, KEEP>(s, dp, aqt, aot, b, qreg, oreg, Qs, Os, Ks, Vs, wr * 16, ks0, g, t);
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
    lay(q_sb, q_sh, q_st, H), lay(k_sb, k_sh, k_st, H), lay(o_sb, o_sh, o_st, H)

// Entries of one variant and head dim. FW / BW: warps of a forward / backward block (4 or 8; sdpa.py's MMA_WARPS
// mirrors them); FMIN / BMIN: blocks a multiprocessor the kernels are built for (2 with 8 warps: at most 128
// registers; 1: as many registers as they take). GPT-2 layer fwd+bwd on sm_90: 8 warps for all (faster for tf32;
// bf16 4 and 8 warps within run-to-run noise).
#define MMA_ENTRIES(NAME, X, T, HD, FW, FMIN, BW, BMIN)                                                                \
extern "C" __global__ void __launch_bounds__(FW * 32, FMIN)                                                            \
blu_sdpa_forward_##NAME##_hd##HD(const T* q, const T* k, const T* v, T* o, float* lse, int L, int S,                   \
                                 float scale, int causal) {                                                            \
    mma::forward<mma::X, HD, FW>(q, k, v, o, lse, L, S, scale, causal, dense(L, HD), dense(S, HD),           \
                                 dense(L, HD));                                                                   \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_dkdv_##NAME##_hd##HD(const T* q, const T* k, const T* v, const T* dout, const float* lse,            \
                                       const float* D, T* dk, T* dv, int L, int S, float scale, int causal) {          \
    mma::backward_dkdv<mma::X, HD, BW>(q, k, v, dout, lse, D, dk, dv, L, S, scale, causal, dense(L, HD),          \
                                       dense(S, HD), dense(L, HD));                                          \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_dq_##NAME##_hd##HD(const T* q, const T* k, const T* v, const T* dout, const float* lse,              \
                                     const float* D, T* dq, int L, int S, float scale, int causal) {                   \
    mma::backward_dq<mma::X, HD, BW>(q, k, v, dout, lse, D, dq, L, S, scale, causal, dense(L, HD),                \
                                     dense(S, HD), dense(L, HD));                                            \
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

// The fused backward (dK, dV and, through fp32 atomics, dQ in one pass; fp32 storage): dq must be zeroed first.
#define MMA_FUSED_ENTRIES(NAME, X, HD, BW, BMIN)                                                                     \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_fused_##NAME##_hd##HD(const float* q, const float* k, const float* v, const float* dout,             \
                                        const float* lse, const float* D, float* dq, float* dk, float* dv, int L,      \
                                        int S, float scale, int causal) {                                              \
    mma::backward_dkdv<mma::X, HD, BW, true>(q, k, v, dout, lse, D, dk, dv, L, S, scale, causal, dense(L, HD),    \
                                             dense(S, HD), dense(L, HD), dq);                                \
}                                                                                                                      \
extern "C" __global__ void __launch_bounds__(BW * 32, BMIN)                                                            \
blu_sdpa_backward_fused_strided_##NAME##_hd##HD(const float* q, const float* k, const float* v, const float* dout,     \
                                                const float* lse, const float* D, float* dq, float* dk, float* dv,     \
                                                int L, int S, float scale, int causal, BLU_LAY_PARAMS) {               \
    mma::backward_dkdv<mma::X, HD, BW, true>(q, k, v, dout, lse, D, dk, dv, L, S, scale, causal, BLU_LAYS, dq);      \
}

MMA_ENTRIES(tf32, TF32, float, 64, 8, 2, 8, 2)
MMA_ENTRIES(tf32, TF32, float, 128, 8, 1, 8, 1)
MMA_ENTRIES(tf32x3, TF32X3, float, 64, 8, 1, 8, 1)
MMA_ENTRIES(tf32x3, TF32X3, float, 128, 8, 1, 8, 1)
MMA_ENTRIES(bf16, BF16, bf16_t, 64, 8, 2, 8, 2)
MMA_ENTRIES(bf16, BF16, bf16_t, 128, 8, 1, 8, 1)
MMA_FUSED_ENTRIES(tf32, TF32, 64, 8, 1)
MMA_FUSED_ENTRIES(tf32, TF32, 128, 8, 1)
MMA_FUSED_ENTRIES(tf32x3, TF32X3, 64, 8, 1)
MMA_FUSED_ENTRIES(tf32x3, TF32X3, 128, 8, 1)
