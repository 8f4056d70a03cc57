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
