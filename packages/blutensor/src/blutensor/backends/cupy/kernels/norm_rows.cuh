// The row reductions of blutensor's norms, one template per kind, shared by rms_norm.cu, layer_norm.cu (the plain
// norms) and add_rms_norm.cu (the residual add fused in front): a plain norm is the template without the add.
// Inlined into each of those files by blutensor/backends/cupy/_loader.py, like bf16_vec.cuh.
//
// Storage per tensor (math in fp32, bf16 = raw uint16 bits): x the input (with the add: the sublayer output),
// r the residual stream and h = x + r its new value (rounded to h's storage; the norm reads that value, the one
// backward reads), y the normalised output, w / b weight and bias. A plain norm has one storage: TX = TH = TY = TW.

#include "bf16_vec.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm, one warp per row (grid-stride), any C. ADD: h = x + r first (written), the norm of h; else the norm of x.
// Forward: rstd = 1 / sqrt(mean(h^2) + eps), y = h * rstd * w (w may be null); rstd saved (fp32).
template <typename TX, typename TH, typename TY, typename TW, bool ADD>
__device__ void rms_rows_forward(const TX* __restrict__ x, const TH* __restrict__ r, const TW* __restrict__ w,
                                 TH* __restrict__ h, TY* __restrict__ y, float* __restrict__ rstd_out, long long N,
                                 int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const TX* xr = x + row * C;
        float ss = 0.f;
        if constexpr (ADD) {
            const TH* rr = r + row * C;
            TH* hr = h + row * C;
            for (int c = lane; c < C; c += 32) {
                const TH hv = from_f<TH>(to_f(xr[c]) + to_f(rr[c]));
                hr[c] = hv;
                const float v = to_f(hv);
                ss += v * v;
            }
        } else {
            for (int c = lane; c < C; c += 32) { const float v = to_f(xr[c]); ss += v * v; }
        }
        ss = warp_sum(ss);
        const float rs = rsqrtf(ss / (float)C + eps);
        if (lane == 0) rstd_out[row] = rs;
        TY* yr = y + row * C;
        if constexpr (ADD) {
            const TH* hr = h + row * C;
            for (int c = lane; c < C; c += 32) yr[c] = from_f<TY>(to_f(hr[c]) * rs * (w ? to_f(w[c]) : 1.f));
        } else {
            for (int c = lane; c < C; c += 32) yr[c] = from_f<TY>(to_f(xr[c]) * rs * (w ? to_f(w[c]) : 1.f));
        }
    }
}

// Backward, one warp per row: d = rstd * (gy*w - hhat * mean(gy*w*hhat)) [+ gh], hhat = h * rstd, written to dres
// in h's storage. ADD: gy (the gradient of y) and gh (the gradient reaching h directly) may each be null, and d,
// the gradient of both x and r, is also written in x's storage to dx when dx is given.
template <typename TX, typename TH, typename TY, typename TW, bool ADD>
__device__ void rms_rows_backward(const TY* __restrict__ gy, const TH* __restrict__ gh, const TH* __restrict__ h,
                                  const TW* __restrict__ w, const float* __restrict__ rstd, TH* __restrict__ dres,
                                  TX* __restrict__ dx, long long N, int C) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const TH* hr = h + row * C;
        const float rs = rstd[row];
        float m = 0.f;
        if (!ADD || gy) {
            const TY* gr = gy + row * C;
            float dot = 0.f;
            for (int c = lane; c < C; c += 32) dot += to_f(gr[c]) * (w ? to_f(w[c]) : 1.f) * to_f(hr[c]) * rs;
            m = warp_sum(dot) / (float)C;
        }
        TH* dr = dres + row * C;
        if constexpr (ADD) {
            for (int c = lane; c < C; c += 32) {
                float d = gh ? to_f(gh[row * C + c]) : 0.f;
                if (gy) d += rs * (to_f(gy[row * C + c]) * (w ? to_f(w[c]) : 1.f) - to_f(hr[c]) * rs * m);
                dr[c] = from_f<TH>(d);
                if (dx) dx[row * C + c] = from_f<TX>(d);
            }
        } else {
            const TY* gr = gy + row * C;
            for (int c = lane; c < C; c += 32) {
                const float gw = to_f(gr[c]) * (w ? to_f(w[c]) : 1.f);
                dr[c] = from_f<TH>(rs * (gw - to_f(hr[c]) * rs * m));
            }
        }
    }
}

// dw in two passes, deterministic, no float atomics. part[s][c] = sum over rows r in slice s (rows s, s + S, ...) of
// gy[r][c] * h[r][c] * rstd[r]; grid (ceil(C / blockDim.x), S): adjacent threads read adjacent columns (coalesced)
template <typename TY, typename TH>
__device__ void rms_rows_backward_dw(const TY* __restrict__ gy, const TH* __restrict__ h,
                                     const float* __restrict__ rstd, float* __restrict__ part, long long N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y, S = gridDim.y;
    if (c >= C) return;
    float acc = 0.f;
    for (long long r = s; r < N; r += S) acc += to_f(gy[r * C + c]) * to_f(h[r * C + c]) * rstd[r];
    part[(long long)s * C + c] = acc;
}

// then dw[c] = the S slices added in a fixed order; ACC: dw[c] += that sum (a float32 gradient buffer that already
// holds earlier contributions: no separate add kernel per parameter)
template <typename TW, bool ACC = false>
__device__ void rms_rows_backward_reduce(const float* __restrict__ part, TW* __restrict__ dw, int S, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc += part[(long long)s * C + c];
    dw[c] = ACC ? from_f<TW>(to_f(dw[c]) + acc) : from_f<TW>(acc);
}

// ---------------------------------------------------------------------------------------------------------
// Register-resident rows, one template for both norms (LN = true: LayerNorm; LN = false: RMSNorm, the same without
// the mean and the bias), for rows that are 16-byte aligned and at most 32 * NV vectors wide. Lane l holds vectors
// l, l+32, ... of V = 16 / sizeof(h) elements (NV vectors a lane), so the row crosses HBM once in each direction
// and the statistics are an exact two-pass mean / variance over registers. One warp per row, rows grid-strided.
// One entry per NV, so that each gets its own register allocation.

// V consecutive elements of T <-> floats (16 bytes: one vector; 8 or 32 bytes: half or two vectors)
template <typename T, int V> __device__ __forceinline__ void load_n(const T* p, float* o) {
    if constexpr (sizeof(T) * V == 16) {
        load_vec(p, o);
    } else if constexpr (sizeof(T) * V == 32) {
        load_vec(p, o);
        load_vec(p + V / 2, o + V / 2);
    } else {  // 4 bf16
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        o[0] = __uint_as_float(u.x << 16); o[1] = __uint_as_float(u.x & 0xffff0000u);
        o[2] = __uint_as_float(u.y << 16); o[3] = __uint_as_float(u.y & 0xffff0000u);
    }
}
template <typename T, int V> __device__ __forceinline__ void store_n(T* p, const float* v) {
    if constexpr (sizeof(T) * V == 16) {
        store_vec(p, v);
    } else if constexpr (sizeof(T) * V == 32) {
        store_vec(p, v);
        store_vec(p + V / 2, v + V / 2);
    } else {  // 4 bf16
        *reinterpret_cast<uint2*>(p) = make_uint2(pack2(v[0], v[1]), pack2(v[2], v[3]));
    }
}

// How the forward forms the row it normalises: NORM_RES_ADD h = x + r, always (r and h given: the add_*_norm
// entries); NORM_RES_OPT x, plus r when r is non-null (then h, when non-null, receives the sum: layer_norm.cu).
#define NORM_RES_ADD 1
#define NORM_RES_OPT 2

template <typename TX, typename TH, typename TY, typename TW, int NV, bool LN, int RES>
__device__ __forceinline__ void norm_rows_forward(const TX* __restrict__ x, const TH* __restrict__ r,
                                                  const TW* __restrict__ w, const TW* __restrict__ b,
                                                  TH* __restrict__ h, TY* __restrict__ y,
                                                  float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                                  long long N, int C, float eps) {
    constexpr int V = VecN<TH>::N;
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    const int cv = C / V;
    const float invC = 1.f / (float)C;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const long long base = row * C;
        float v[NV][V];
        if constexpr (RES == NORM_RES_ADD) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int vi = j * 32 + lane;
                if (vi < cv) {
                    float xv[V];
                    load_n<TX, V>(x + base + vi * V, xv);
                    load_n<TH, V>(r + base + vi * V, v[j]);
#pragma unroll
                    for (int k = 0; k < V; ++k) v[j][k] = to_f(from_f<TH>(xv[k] + v[j][k]));
                    store_n<TH, V>(h + base + vi * V, v[j]);
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int vi = j * 32 + lane;
                if (vi < cv) load_n<TX, V>(x + base + vi * V, v[j]);
            }
            if (r) {
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    const int vi = j * 32 + lane;
                    if (vi < cv) {
                        float rv[V];
                        load_n<TH, V>(r + base + vi * V, rv);
#pragma unroll
                        for (int k = 0; k < V; ++k) v[j][k] = to_f(from_f<TH>(v[j][k] + rv[k]));
                        if (h) store_n<TH, V>(h + base + vi * V, v[j]);
                    }
                }
            }
        }
        float mu = 0.f;  // RMSNorm: the "variance" below is then the mean square
        if constexpr (LN) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < NV; ++j)
                if (j * 32 + lane < cv) {
#pragma unroll
                    for (int k = 0; k < V; ++k) s += v[j][k];
                }
            s = warp_sum(s);
            mu = s * invC;
        }
        float q = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j)
            if (j * 32 + lane < cv) {
#pragma unroll
                for (int k = 0; k < V; ++k) { const float d = v[j][k] - mu; q += d * d; }
            }
        q = warp_sum(q);
        const float rs = rsqrtf(q * invC + eps);
        if (lane == 0) {
            if constexpr (LN) mean_out[row] = mu;
            rstd_out[row] = rs;
        }
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int vi = j * 32 + lane;
            if (vi < cv) {
                float wv[V], bv[V];
                if (w) load_n<TW, V>(w + vi * V, wv); else { for (int k = 0; k < V; ++k) wv[k] = 1.f; }
                if (LN && b) load_n<TW, V>(b + vi * V, bv); else { for (int k = 0; k < V; ++k) bv[k] = 0.f; }
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    if constexpr (LN) v[j][k] = (v[j][k] - mu) * rs * wv[k] + bv[k];
                    else v[j][k] = v[j][k] * rs * wv[k];
                }
                store_n<TY, V>(y + base + vi * V, v[j]);
            }
        }
    }
}

// Backward: d = rstd * (gy*w - mean(gy*w) - hhat * mean(gy*w*hhat)) + gh (RMSNorm: without the mean(gy*w) term,
// hhat = h * rstd; gh, the gradient reaching h directly, may be null), written in h's storage to dres when need_dx;
// ADD: also in x's storage to dx when dx is given (the gradient of both x and r). dweight / dbias partials per block
// in part[blockIdx.x][0:2C] (reduced by layer_norm.cu's ln_reduce: deterministic, no float atomics), summed in
// registers across a warp's rows and then added into shared memory warp after warp (SACC = false; dynamic shared
// memory 2 * C floats), or in each warp's own shared slice (SACC = true, k-major: element e of vector vi at
// e * cv + vi, so a warp's lanes hit consecutive words; frees 2*NV*V registers for more rows in flight; dynamic
// shared memory warps_per_block * 2 * C floats; RMSNorm's dbias half stays zero), the slices added in warp order.
template <typename TX, typename TH, typename TY, typename TW, int NV, bool LN, bool SACC, bool ADD>
__device__ __forceinline__ void norm_rows_backward(const TY* __restrict__ gy, const TH* __restrict__ gh,
                                                   const TH* __restrict__ h, const TW* __restrict__ w,
                                                   const float* __restrict__ mean, const float* __restrict__ rstd,
                                                   TH* __restrict__ dres, TX* __restrict__ dx,
                                                   float* __restrict__ part, long long N, int C, int need_dx,
                                                   int need_dwdb) {
    extern __shared__ float smem[];
    constexpr int V = VecN<TH>::N;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wpb = blockDim.x >> 5;
    const int cv = C / V;
    const float invC = 1.f / (float)C;
    float adw[NV][V], adb[NV][V];
    if constexpr (!SACC) {
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int k = 0; k < V; ++k) { adw[j][k] = 0.f; adb[j][k] = 0.f; }
    }
    float* acc = smem + (size_t)warp * 2 * C;
    if (SACC && need_dwdb) {
        for (int c = lane; c < 2 * C; c += 32) acc[c] = 0.f;
        __syncwarp();
    }
    for (long long row = (long long)blockIdx.x * wpb + warp; row < N; row += (long long)gridDim.x * wpb) {
        const long long base = row * C;
        const float mu = LN ? mean[row] : 0.f, rs = rstd[row];
        float gv[NV][V], xv[NV][V];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int vi = j * 32 + lane;
            if (vi < cv) { load_n<TY, V>(gy + base + vi * V, gv[j]); load_n<TH, V>(h + base + vi * V, xv[j]); }
        }
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int vi = j * 32 + lane;
            if (vi < cv) {
                float wv[V];
                if (w) load_n<TW, V>(w + vi * V, wv); else { for (int k = 0; k < V; ++k) wv[k] = 1.f; }
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    const float xh = (xv[j][k] - mu) * rs;
                    xv[j][k] = xh;
                    if constexpr (SACC) {
                        if (need_dwdb) {
                            acc[k * cv + vi] += gv[j][k] * xh;
                            if constexpr (LN) acc[C + k * cv + vi] += gv[j][k];
                        }
                    } else {
                        adw[j][k] += gv[j][k] * xh;
                        adb[j][k] += gv[j][k];
                    }
                    const float d = gv[j][k] * wv[k];
                    gv[j][k] = d;
                    s1 += d;
                    s2 += d * xh;
                }
            }
        }
        if (ADD || need_dx) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                s1 += __shfl_xor_sync(0xffffffffu, s1, off);
                s2 += __shfl_xor_sync(0xffffffffu, s2, off);
            }
            s1 *= invC; s2 *= invC;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int vi = j * 32 + lane;
                if (vi < cv) {
                    float gs[V];
                    if (gh) load_n<TH, V>(gh + base + vi * V, gs); else { for (int k = 0; k < V; ++k) gs[k] = 0.f; }
#pragma unroll
                    for (int k = 0; k < V; ++k) {
                        if constexpr (LN) gs[k] += rs * (gv[j][k] - s1 - xv[j][k] * s2);
                        else gs[k] += rs * (gv[j][k] - xv[j][k] * s2);
                    }
                    store_n<TH, V>(dres + base + vi * V, gs);
                    if constexpr (ADD) {
                        if (dx) store_n<TX, V>(dx + base + vi * V, gs);
                    }
                }
            }
        }
    }
    if (!need_dwdb) return;
    if constexpr (SACC) {  // the warps' slices summed in warp order (deterministic)
        __syncthreads();
        for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
            const int cc = c < C ? c : c - C;
            const int idx = (c < C ? 0 : C) + (cc % V) * cv + cc / V;
            float t = 0.f;
            for (int k = 0; k < wpb; ++k) t += smem[(size_t)k * 2 * C + idx];
            part[(size_t)blockIdx.x * 2 * C + c] = t;
        }
        return;
    }
    // warps add their columns into smem[0:2C] one after another (fixed order: bitwise reproducible)
    for (int k = 0; k < wpb; ++k) {
        if (warp == k) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int vi = j * 32 + lane;
                if (vi < cv) {
#pragma unroll
                    for (int e = 0; e < V; ++e) {
                        const int c = vi * V + e;
                        smem[c] = k ? smem[c] + adw[j][e] : adw[j][e];
                        smem[C + c] = k ? smem[C + c] + adb[j][e] : adb[j][e];
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) part[(size_t)blockIdx.x * 2 * C + c] = smem[c];
}
