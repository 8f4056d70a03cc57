// Residual add fused with the pre-norm of a block: RMSNorm (Llama) and LayerNorm (GPT-2, entries blu_add_layer_norm_*,
// at the end of this file), fp32 and bf16 storage (bf16 = raw uint16 bits), math in fp32. Each tensor has its own storage type, so autocast's mix runs without casts: the sublayer output x
// (bf16 from a bf16 GEMM), the residual stream r and its new value h (fp32), the normalised output y (bf16, the
// next GEMM's input) and the weight w (fp32 master). Entry suffix: <x>_<h>_<y>_<w> storage, e.g. bf16_f32_bf16_f32.
//
// Forward, one warp per row (grid-stride):  h = x + r  (rounded to h's storage; y is computed from that value, the
//   one backward reads), rstd = 1 / sqrt(mean(h^2) + eps), y = h * rstd * w (w may be null); rstd saved (fp32).
// Backward, one warp per row:  dsum = rstd * (gy*w - hhat * mean(gy*w*hhat)) + gh,  hhat = h * rstd, where gy is the
//   gradient of y and gh the gradient reaching h directly (either may be null: no such gradient). dsum is the
//   gradient of both x and r: written once in h's storage (dres) and, when x's storage differs, also in x's (dx).
// dw deterministically in two passes, no float atomics: *_dw_<y>_<h> sums its slice of rows per column into
//   part[slice][C] (fp32), *_reduce_<w> adds the slices in a fixed order.
// Shared bf16 helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

template <typename TX, typename TH, typename TY, typename TW>
__device__ void add_rms_forward(const TX* __restrict__ x, const TH* __restrict__ r, const TW* __restrict__ w,
                                TH* __restrict__ h, TY* __restrict__ y, float* __restrict__ rstd_out, long long N,
                                int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const TX* xr = x + row * C;
        const TH* rr = r + row * C;
        TH* hr = h + row * C;
        float ss = 0.f;
        for (int c = lane; c < C; c += 32) {
            const TH hv = from_f<TH>(to_f(xr[c]) + to_f(rr[c]));
            hr[c] = hv;
            const float v = to_f(hv);
            ss += v * v;
        }
        ss = warp_sum(ss);
        const float rs = rsqrtf(ss / (float)C + eps);
        if (lane == 0) rstd_out[row] = rs;
        TY* yr = y + row * C;
        for (int c = lane; c < C; c += 32) yr[c] = from_f<TY>(to_f(hr[c]) * rs * (w ? to_f(w[c]) : 1.f));
    }
}

template <typename TX, typename TH, typename TY, typename TW>
__device__ void add_rms_backward(const TY* __restrict__ gy, const TH* __restrict__ gh, const TH* __restrict__ h,
                                 const TW* __restrict__ w, const float* __restrict__ rstd, TH* __restrict__ dres,
                                 TX* __restrict__ dx, long long N, int C) {
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const TH* hr = h + row * C;
        const float rs = rstd[row];
        float m = 0.f;
        if (gy) {
            const TY* gr = gy + row * C;
            float dot = 0.f;
            for (int c = lane; c < C; c += 32) dot += to_f(gr[c]) * (w ? to_f(w[c]) : 1.f) * to_f(hr[c]) * rs;
            m = warp_sum(dot) / (float)C;
        }
        TH* dr = dres + row * C;
        for (int c = lane; c < C; c += 32) {
            float d = gh ? to_f(gh[row * C + c]) : 0.f;
            if (gy) d += rs * (to_f(gy[row * C + c]) * (w ? to_f(w[c]) : 1.f) - to_f(hr[c]) * rs * m);
            dr[c] = from_f<TH>(d);
            if (dx) dx[row * C + c] = from_f<TX>(d);
        }
    }
}

// part[s][c] = sum over rows r in slice s (rows s, s + S, ...) of gy[r][c] * h[r][c] * rstd[r];
// grid (ceil(C / blockDim.x), S): adjacent threads read adjacent columns (coalesced)
template <typename TY, typename TH>
__device__ void add_rms_backward_dw(const TY* __restrict__ gy, const TH* __restrict__ h,
                                    const float* __restrict__ rstd, float* __restrict__ part, long long N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y, S = gridDim.y;
    if (c >= C) return;
    float acc = 0.f;
    for (long long r = s; r < N; r += S) acc += to_f(gy[r * C + c]) * to_f(h[r * C + c]) * rstd[r];
    part[(long long)s * C + c] = acc;
}

template <typename TW>
__device__ void add_rms_backward_reduce(const float* __restrict__ part, TW* __restrict__ dw, int S, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc += part[(long long)s * C + c];
    dw[c] = from_f<TW>(acc);
}

#define ADD_RMS_ENTRIES(SUF, TX, TH, TY, TW)                                                                       \
extern "C" __global__ void blu_add_rms_norm_forward_##SUF(const TX* x, const TH* r, const TW* w, TH* h, TY* y,   \
                                                           float* rstd, long long N, int C, float eps) {         \
    add_rms_forward<TX, TH, TY, TW>(x, r, w, h, y, rstd, N, C, eps);                                              \
}                                                                                                                  \
extern "C" __global__ void blu_add_rms_norm_backward_##SUF(const TY* gy, const TH* gh, const TH* h, const TW* w, \
                                                            const float* rstd, TH* dres, TX* dx, long long N,    \
                                                            int C) {                                             \
    add_rms_backward<TX, TH, TY, TW>(gy, gh, h, w, rstd, dres, dx, N, C);                                         \
}

#define ADD_RMS_DW(SUF, TY, TH)                                                                                    \
extern "C" __global__ void blu_add_rms_norm_backward_dw_##SUF(const TY* gy, const TH* h, const float* rstd,      \
                                                               float* part, long long N, int C) {                \
    add_rms_backward_dw<TY, TH>(gy, h, rstd, part, N, C);                                                         \
}

#define ADD_RMS_REDUCE(SUF, TW)                                                                                    \
extern "C" __global__ void blu_add_rms_norm_backward_reduce_##SUF(const float* part, TW* dw, int S, int C) {    \
    add_rms_backward_reduce<TW>(part, dw, S, C);                                                                  \
}

#define ADD_RMS_W(SX, TX, SH, TH, SY, TY)                                                                          \
ADD_RMS_ENTRIES(SX##_##SH##_##SY##_f32, TX, TH, TY, float)                                                         \
ADD_RMS_ENTRIES(SX##_##SH##_##SY##_bf16, TX, TH, TY, bf16_t)

ADD_RMS_W(f32, float, f32, float, f32, float)
ADD_RMS_W(f32, float, f32, float, bf16, bf16_t)
ADD_RMS_W(bf16, bf16_t, f32, float, f32, float)
ADD_RMS_W(bf16, bf16_t, f32, float, bf16, bf16_t)
ADD_RMS_W(f32, float, bf16, bf16_t, f32, float)
ADD_RMS_W(f32, float, bf16, bf16_t, bf16, bf16_t)
ADD_RMS_W(bf16, bf16_t, bf16, bf16_t, f32, float)
ADD_RMS_W(bf16, bf16_t, bf16, bf16_t, bf16, bf16_t)

ADD_RMS_DW(f32_f32, float, float)
ADD_RMS_DW(f32_bf16, float, bf16_t)
ADD_RMS_DW(bf16_f32, bf16_t, float)
ADD_RMS_DW(bf16_bf16, bf16_t, bf16_t)

ADD_RMS_REDUCE(f32, float)
ADD_RMS_REDUCE(bf16, bf16_t)

// ---------------------------------------------------------------------------------------------------------
// Register-resident rows, one template for both norms (LN = true: LayerNorm, GPT-2's ln_1 / ln_2 / ln_f after a
// residual add; LN = false: RMSNorm, the same without the mean and the bias: entries blu_add_rms_norm_*_r<NV>_* /
// *_s<NV>_*, used for the rows they fit, the warp-per-row kernels above for the others). Storage per tensor:
// x (the sublayer output), r and h (the residual stream), y (the normalised output, the next GEMM's input),
// w and b (weight and bias, one storage). Entry suffix: <x>_<h>_<y>_<w>, e.g. bf16_f32_bf16_f32 (autocast).
// Rows live in registers (lane l holds vectors l, l+32, ... of V = 16 / sizeof(h) elements, NV vectors a lane),
// with the arithmetic of kernels/layer_norm.cu's register-resident entries on the same vectors (exact two-pass
// mean / variance, the same expressions), so float32 results are bitwise those of add + layer_norm and bf16
// ones those of add + layer_norm + cast. Backward: dsum = rstd * (gy*w - mean(gy*w) - hhat * mean(gy*w*hhat))
// + gh, written in h's storage (dres) and, when x's differs, in x's (dx); dweight / dbias partials per block
// (each warp's sums in its own shared slice, added in warp order) in layer_norm.cu's layout, reduced by its
// blu_layer_norm_backward_reduce_* kernels (deterministic, no float atomics).

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

template <typename TX, typename TH, typename TY, typename TW, int NV, bool LN>
__device__ __forceinline__ void add_norm_forward(const TX* __restrict__ x, const TH* __restrict__ r,
                                               const TW* __restrict__ w, const TW* __restrict__ b,
                                               TH* __restrict__ h, TY* __restrict__ y, float* __restrict__ mean_out,
                                               float* __restrict__ rstd_out, long long N, int C, float eps) {
    constexpr int V = VecN<TH>::N;
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    const int cv = C / V;
    const float invC = 1.f / (float)C;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const long long base = row * C;
        float v[NV][V];
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

// Dynamic shared memory: warps_per_block * 2 * C floats (each warp's dweight | dbias sums, k-major; RMSNorm's dbias
// half stays zero). RMSNorm: mean is not read (hhat = h * rstd) and the mean(gy*w) term is absent.
template <typename TX, typename TH, typename TY, typename TW, int NV, bool LN>
__device__ __forceinline__ void add_norm_backward(const TY* __restrict__ gy, const TH* __restrict__ gh,
                                                const TH* __restrict__ h, const TW* __restrict__ w,
                                                const float* __restrict__ mean, const float* __restrict__ rstd,
                                                TH* __restrict__ dres, TX* __restrict__ dx, float* __restrict__ part,
                                                long long N, int C, int need_dwdb) {
    extern __shared__ float smem[];
    constexpr int V = VecN<TH>::N;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wpb = blockDim.x >> 5;
    const int cv = C / V;
    const float invC = 1.f / (float)C;
    float* acc = smem + (size_t)warp * 2 * C;
    if (need_dwdb) {
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
                    if (need_dwdb) {
                        acc[k * cv + vi] += gv[j][k] * xh;
                        if constexpr (LN) acc[C + k * cv + vi] += gv[j][k];
                    }
                    const float d = gv[j][k] * wv[k];
                    gv[j][k] = d;
                    s1 += d;
                    s2 += d * xh;
                }
            }
        }
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
                if (dx) store_n<TX, V>(dx + base + vi * V, gs);
            }
        }
    }
    if (!need_dwdb) return;
    __syncthreads();  // the warps' slices summed in warp order (deterministic), layer_norm.cu's partial layout
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        const int cc = c < C ? c : c - C;
        const int idx = (c < C ? 0 : C) + (cc % V) * cv + cc / V;
        float t = 0.f;
        for (int k = 0; k < wpb; ++k) t += smem[(size_t)k * 2 * C + idx];
        part[(size_t)blockIdx.x * 2 * C + c] = t;
    }
}

#define ADD_NORM_ENTRIES(KIND, LN, SUF, NV, TX, TH, TY, TW)                                                          \
extern "C" __global__ void __launch_bounds__(256) blu_add_##KIND##_norm_forward_r##NV##_##SUF(const TX* x,         \
        const TH* r, const TW* w, const TW* b, TH* h, TY* y, float* mean, float* rstd, long long N, int C,         \
        float eps) {                                                                                               \
    add_norm_forward<TX, TH, TY, TW, NV, LN>(x, r, w, b, h, y, mean, rstd, N, C, eps);                             \
}                                                                                                                  \
extern "C" __global__ void __launch_bounds__(256) blu_add_##KIND##_norm_backward_s##NV##_##SUF(const TY* gy,       \
        const TH* gh, const TH* h, const TW* w, const float* mean, const float* rstd, TH* dres, TX* dx,            \
        float* part, long long N, int C, int need_dwdb) {                                                          \
    add_norm_backward<TX, TH, TY, TW, NV, LN>(gy, gh, h, w, mean, rstd, dres, dx, part, N, C, need_dwdb);          \
}
#define ADD_LN_ENTRIES(SUF, NV, TX, TH, TY, TW)                                                                    \
ADD_NORM_ENTRIES(layer, true, SUF, NV, TX, TH, TY, TW) ADD_NORM_ENTRIES(rms, false, SUF, NV, TX, TH, TY, TW)

// the storage mixes: fp32 throughout, bf16 throughout, and autocast's (bf16 sublayer output, fp32 residual
// stream and weights, bf16 normalised output); NV as layer_norm.cu's (fp32 h: C <= 1024, bf16 h: C <= 1024)
#define ADD_LN_F32H(NV)                                                                                             \
ADD_LN_ENTRIES(f32_f32_f32_f32, NV, float, float, float, float)                                                    \
ADD_LN_ENTRIES(bf16_f32_bf16_f32, NV, bf16_t, float, bf16_t, float)                                                \
ADD_LN_ENTRIES(f32_f32_bf16_f32, NV, float, float, bf16_t, float)
#define ADD_LN_BF16H(NV) ADD_LN_ENTRIES(bf16_bf16_bf16_bf16, NV, bf16_t, bf16_t, bf16_t, bf16_t)

ADD_LN_F32H(1) ADD_LN_F32H(2) ADD_LN_F32H(3) ADD_LN_F32H(4) ADD_LN_F32H(6) ADD_LN_F32H(8)
ADD_LN_BF16H(1) ADD_LN_BF16H(2) ADD_LN_BF16H(3) ADD_LN_BF16H(4)
