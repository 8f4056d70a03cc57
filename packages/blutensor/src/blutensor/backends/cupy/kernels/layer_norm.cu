// Residual-add + LayerNorm, forward and backward, for fp32 and bf16 storage (bf16 = raw uint16 bits).
// Math in fp32. One warp per row. Rows that are 16-byte aligned and up to 32*NV vectors wide use the
// register-resident entries (*_r<NV>_*: the row read once, exact two-pass statistics in registers, dweight/dbias
// accumulated in registers); the generic entries (Welford/Chan statistics merged with warp shuffles, 128-bit
// loads when vec != 0, scalar loads otherwise) cover odd widths and wider rows.
// Backward is deterministic: each block accumulates dweight/dbias for its rows (registers or one shared
// slice per warp, fixed order), writes a per-block partial, and a second kernel sums the partials in a
// fixed order (column-parallel, sliced over blocks). No float atomics anywhere.
// The register-resident entries are norm_rows.cuh's row templates (norm_rows_forward / norm_rows_backward, shared
// with add_rms_norm.cu's fused add + norm) with the residual optional at run time; bf16/vector helpers from
// bf16_vec.cuh (both inlined by the loader).

#include "norm_rows.cuh"

// merge (nb, mb, m2b) into (n, m, m2): Chan et al.
__device__ __forceinline__ void chan_merge(float& n, float& m, float& m2, float nb, float mb, float m2b) {
    float nn = n + nb;
    if (nb == 0.f) return;
    float d = mb - m;
    float f = nb / nn;
    m += d * f;
    m2 += m2b + d * d * n * f;
    n = nn;
}

// y = LN(x [+ resid]) * w + b; when resid is given and sum_out non-null, sum_out = x + resid.
// mean/rstd (fp32, one per row) are saved for backward. w and b may be null.
template <typename T>
__device__ void ln_forward(const T* __restrict__ x, const T* __restrict__ resid, T* __restrict__ sum_out,
                           const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                           float* __restrict__ mean_out, float* __restrict__ rstd_out,
                           long long N, int C, float eps, int vec) {
    constexpr int V = VecN<T>::N;
    const int lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    for (long long row = (long long)blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const T* xr = x + row * C;
        const T* rr = resid ? resid + row * C : nullptr;
        T* sr = (resid && sum_out) ? sum_out + row * C : nullptr;
        float n = 0.f, mu = 0.f, m2 = 0.f;
        if (vec) {
            for (int c = lane * V; c < C; c += 32 * V) {
                float v[V];
                load_vec(xr + c, v);
                if (rr) {
                    float r[V];
                    load_vec(rr + c, r);
#pragma unroll
                    for (int k = 0; k < V; ++k) v[k] = to_f(from_f<T>(v[k] + r[k]));
                    if (sr) store_vec(sr + c, v);
                }
                float s = 0.f;
#pragma unroll
                for (int k = 0; k < V; ++k) s += v[k];
                float vm = s * (1.f / V), vq = 0.f;
#pragma unroll
                for (int k = 0; k < V; ++k) { float d = v[k] - vm; vq += d * d; }
                chan_merge(n, mu, m2, (float)V, vm, vq);
            }
        } else {
            for (int c = lane; c < C; c += 32) {
                float v = to_f(xr[c]);
                if (rr) {
                    v = to_f(from_f<T>(v + to_f(rr[c])));
                    if (sr) sr[c] = from_f<T>(v);
                }
                chan_merge(n, mu, m2, 1.f, v, 0.f);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float nb = __shfl_xor_sync(0xffffffffu, n, off);
            float mb = __shfl_xor_sync(0xffffffffu, mu, off);
            float qb = __shfl_xor_sync(0xffffffffu, m2, off);
            chan_merge(n, mu, m2, nb, mb, qb);
        }
        mu = __shfl_sync(0xffffffffu, mu, 0);
        m2 = __shfl_sync(0xffffffffu, m2, 0);
        const float rs = rsqrtf(m2 / (float)C + eps);
        if (lane == 0) { mean_out[row] = mu; rstd_out[row] = rs; }
        T* yr = y + row * C;
        if (vec) {
            for (int c = lane * V; c < C; c += 32 * V) {
                float v[V], o[V];
                load_vec(xr + c, v);
                if (rr) {
                    float r[V];
                    load_vec(rr + c, r);
#pragma unroll
                    for (int k = 0; k < V; ++k) v[k] = to_f(from_f<T>(v[k] + r[k]));
                }
                float wv[V], bv[V];
                if (w) load_vec(w + c, wv); else { for (int k = 0; k < V; ++k) wv[k] = 1.f; }
                if (b) load_vec(b + c, bv); else { for (int k = 0; k < V; ++k) bv[k] = 0.f; }
#pragma unroll
                for (int k = 0; k < V; ++k) o[k] = (v[k] - mu) * rs * wv[k] + bv[k];
                store_vec(yr + c, o);
            }
        } else {
            for (int c = lane; c < C; c += 32) {
                float v = to_f(xr[c]);
                if (rr) v = to_f(from_f<T>(v + to_f(rr[c])));
                float o = (v - mu) * rs * (w ? to_f(w[c]) : 1.f) + (b ? to_f(b[c]) : 0.f);
                yr[c] = from_f<T>(o);
            }
        }
    }
}

// dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)) [+ g_sum]; per-block partial dw/db into
// part[blockIdx.x][0:C] (dw) and part[blockIdx.x][C:2C] (db). x is the LayerNorm input (the sum when
// the forward added a residual). Dynamic shared memory: warps_per_block * 2 * C floats.
template <typename T>
__device__ void ln_backward(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                            const float* __restrict__ mean, const float* __restrict__ rstd,
                            const T* __restrict__ g_sum, T* __restrict__ dx, float* __restrict__ part,
                            long long N, int C, int vec, int need_dx, int need_dwdb) {
    extern __shared__ float smem[];
    constexpr int V = VecN<T>::N;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wpb = blockDim.x >> 5;
    float* acc = smem + (size_t)warp * 2 * C;  // [dw(C) | db(C)] of this warp
    if (need_dwdb)
        for (int c = lane; c < 2 * C; c += 32) acc[c] = 0.f;
    __syncwarp();
    const float invC = 1.f / (float)C;
    const int cv = C / V;  // vectors per row (vec path)
    for (long long row = (long long)blockIdx.x * wpb + warp; row < N; row += (long long)gridDim.x * wpb) {
        const T* gr = g + row * C;
        const T* xr = x + row * C;
        const float mu = mean[row], rs = rstd[row];
        float s1 = 0.f, s2 = 0.f;
        if (need_dx) {
            if (vec) {
                for (int c = lane * V; c < C; c += 32 * V) {
                    float gv[V], xv[V], wv[V];
                    load_vec(gr + c, gv); load_vec(xr + c, xv);
                    if (w) load_vec(w + c, wv); else { for (int k = 0; k < V; ++k) wv[k] = 1.f; }
#pragma unroll
                    for (int k = 0; k < V; ++k) { float d = gv[k] * wv[k]; s1 += d; s2 += d * (xv[k] - mu) * rs; }
                }
            } else {
                for (int c = lane; c < C; c += 32) {
                    float d = to_f(gr[c]) * (w ? to_f(w[c]) : 1.f);
                    s1 += d; s2 += d * (to_f(xr[c]) - mu) * rs;
                }
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                s1 += __shfl_xor_sync(0xffffffffu, s1, off);
                s2 += __shfl_xor_sync(0xffffffffu, s2, off);
            }
            s1 *= invC; s2 *= invC;
        }
        T* dxr = need_dx ? dx + row * C : nullptr;
        const T* gsr = g_sum ? g_sum + row * C : nullptr;
        if (vec) {
            for (int c = lane * V; c < C; c += 32 * V) {
                float gv[V], xv[V], wv[V], o[V], gs[V];
                load_vec(gr + c, gv); load_vec(xr + c, xv);
                if (w) load_vec(w + c, wv); else { for (int k = 0; k < V; ++k) wv[k] = 1.f; }
                if (gsr) load_vec(gsr + c, gs); else { for (int k = 0; k < V; ++k) gs[k] = 0.f; }
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    float xh = (xv[k] - mu) * rs;
                    o[k] = rs * (gv[k] * wv[k] - s1 - xh * s2) + gs[k];
                    // k-major layout (element c at (c % V) * C/V + c / V): lanes hit consecutive words
                    if (need_dwdb) { acc[k * cv + c / V] += gv[k] * xh; acc[C + k * cv + c / V] += gv[k]; }
                }
                if (need_dx) store_vec(dxr + c, o);
            }
        } else {
            for (int c = lane; c < C; c += 32) {
                float gv = to_f(gr[c]);
                float xh = (to_f(xr[c]) - mu) * rs;
                if (need_dx) dxr[c] = from_f<T>(rs * (gv * (w ? to_f(w[c]) : 1.f) - s1 - xh * s2) + (gsr ? to_f(gsr[c]) : 0.f));
                if (need_dwdb) { acc[c] += gv * xh; acc[C + c] += gv; }
            }
        }
    }
    if (!need_dwdb) return;
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        const int cc = c < C ? c : c - C;
        const int idx = (c < C ? 0 : C) + (vec ? (cc % V) * cv + cc / V : cc);
        float s = 0.f;
        for (int k = 0; k < wpb; ++k) s += smem[(size_t)k * 2 * C + idx];
        part[(size_t)blockIdx.x * 2 * C + c] = s;
    }
}

// dw[c] = sum_b part[b][c], db[c] = sum_b part[b][C + c], deterministic. A block is 32 columns x S slices
// (blockDim.x = 32 * S, S <= 32): slice s sums partial rows s, s+S, ... in order (coalesced 128-byte rows), then
// the S slice sums of a column are added in slice order. Grid: ceil(2C / 32) blocks. ACC: dw[c] += the sum
// (float32 gradient buffers that already hold earlier contributions: no separate add kernel per parameter).
template <typename T, bool ACC = false>
__device__ void ln_reduce(const float* __restrict__ part, int nblocks, int C, T* __restrict__ dw, T* __restrict__ db) {
    __shared__ float sh[32][33];
    const int col = threadIdx.x & 31, sl = threadIdx.x >> 5, ns = blockDim.x >> 5;
    const int c = blockIdx.x * 32 + col;
    float s = 0.f;
    if (c < 2 * C)
        for (int k = sl; k < nblocks; k += ns) s += part[(size_t)k * 2 * C + c];
    sh[sl][col] = s;
    __syncthreads();
    if (sl != 0 || c >= 2 * C) return;
    float t = sh[0][col];
    for (int k = 1; k < ns; ++k) t += sh[k][col];
    if (ACC) {
        if (c < C) { if (dw) dw[c] = from_f<T>(to_f(dw[c]) + t); }
        else if (db) db[c - C] = from_f<T>(to_f(db[c - C]) + t);
        return;
    }
    if (c < C) { if (dw) dw[c] = from_f<T>(t); }
    else if (db) db[c - C] = from_f<T>(t);
}

// Register-resident rows (vec path, C/V <= 32*NV vectors): norm_rows.cuh's templates with one storage type, the
// residual optional (resid null: the plain norm; sum_out, when given, receives x + resid).
#define LN_REG_FWD(SUF, T, NV)                                                                               \
extern "C" __global__ void __launch_bounds__(256) blu_layer_norm_forward_r##NV##_##SUF(const T* x,           \
        const T* resid, T* sum_out, const T* w, const T* b, T* y, float* mean, float* rstd, long long N,     \
        int C, float eps) {                                                                                  \
    norm_rows_forward<T, T, T, T, NV, true, NORM_RES_OPT>(x, resid, w, b, sum_out, y, mean, rstd, N, C, eps); \
}
#define LN_REG_BWD(SUF, T, NV)                                                                               \
extern "C" __global__ void __launch_bounds__(256) blu_layer_norm_backward_r##NV##_##SUF(const T* g,          \
        const T* x, const T* w, const float* mean, const float* rstd, const T* g_sum, T* dx, float* part,    \
        long long N, int C, int need_dx, int need_dwdb) {                                                    \
    norm_rows_backward<T, T, T, T, NV, true, false, false>(g, g_sum, x, w, mean, rstd, dx, nullptr, part, N, C, \
        need_dx, need_dwdb);                                                                                 \
}
// the same with dweight/dbias accumulated in shared memory (dynamic shared memory: warps * 2 * C floats)
#define LN_SMEM_BWD(SUF, T, NV)                                                                              \
extern "C" __global__ void __launch_bounds__(256) blu_layer_norm_backward_s##NV##_##SUF(const T* g,          \
        const T* x, const T* w, const float* mean, const float* rstd, const T* g_sum, T* dx, float* part,    \
        long long N, int C, int need_dx, int need_dwdb) {                                                    \
    norm_rows_backward<T, T, T, T, NV, true, true, false>(g, g_sum, x, w, mean, rstd, dx, nullptr, part, N, C, \
        need_dx, need_dwdb);                                                                                 \
}

// NV = 16-byte vectors per lane: forward up to 8 (fp32 C <= 1024, bf16 C <= 2048); backward up to 32 elements a
// lane (fp32 NV <= 8, bf16 NV <= 4: 4 register arrays of NV*V floats, ~170 registers at the top, no spills)
LN_REG_FWD(f32, float, 1) LN_REG_FWD(f32, float, 2) LN_REG_FWD(f32, float, 3) LN_REG_FWD(f32, float, 4)
LN_REG_FWD(f32, float, 6) LN_REG_FWD(f32, float, 8)
LN_REG_FWD(bf16, bf16_t, 1) LN_REG_FWD(bf16, bf16_t, 2) LN_REG_FWD(bf16, bf16_t, 3) LN_REG_FWD(bf16, bf16_t, 4)
LN_REG_FWD(bf16, bf16_t, 6) LN_REG_FWD(bf16, bf16_t, 8)
LN_REG_BWD(f32, float, 1) LN_REG_BWD(f32, float, 2) LN_REG_BWD(f32, float, 3) LN_REG_BWD(f32, float, 4)
LN_REG_BWD(f32, float, 6) LN_REG_BWD(f32, float, 8)
LN_REG_BWD(bf16, bf16_t, 1) LN_REG_BWD(bf16, bf16_t, 2) LN_REG_BWD(bf16, bf16_t, 3) LN_REG_BWD(bf16, bf16_t, 4)
LN_SMEM_BWD(f32, float, 1) LN_SMEM_BWD(f32, float, 2) LN_SMEM_BWD(f32, float, 3) LN_SMEM_BWD(f32, float, 4)
LN_SMEM_BWD(f32, float, 6) LN_SMEM_BWD(f32, float, 8)
LN_SMEM_BWD(bf16, bf16_t, 1) LN_SMEM_BWD(bf16, bf16_t, 2) LN_SMEM_BWD(bf16, bf16_t, 3) LN_SMEM_BWD(bf16, bf16_t, 4)

#define LN_ENTRIES(SUF, T)                                                                                   \
extern "C" __global__ void blu_layer_norm_forward_##SUF(const T* x, const T* resid, T* sum_out, const T* w,  \
        const T* b, T* y, float* mean, float* rstd, long long N, int C, float eps, int vec) {                \
    ln_forward<T>(x, resid, sum_out, w, b, y, mean, rstd, N, C, eps, vec);                                   \
}                                                                                                            \
extern "C" __global__ void blu_layer_norm_backward_##SUF(const T* g, const T* x, const T* w,                 \
        const float* mean, const float* rstd, const T* g_sum, T* dx, float* part, long long N, int C,        \
        int vec, int need_dx, int need_dwdb) {                                                               \
    ln_backward<T>(g, x, w, mean, rstd, g_sum, dx, part, N, C, vec, need_dx, need_dwdb);                     \
}                                                                                                            \
extern "C" __global__ void blu_layer_norm_backward_reduce_##SUF(const float* part, int nblocks, int C,       \
        T* dw, T* db) {                                                                                      \
    ln_reduce<T>(part, nblocks, C, dw, db);                                                                  \
}

LN_ENTRIES(f32, float)
LN_ENTRIES(bf16, bf16_t)

// dw/db (float32 gradient buffers, for f32 and bf16 LayerNorm alike: the partials are float32) += the sums
extern "C" __global__ void blu_layer_norm_backward_reduce_acc(const float* part, int nblocks, int C, float* dw,
                                                              float* db) {
    ln_reduce<float, true>(part, nblocks, C, dw, db);
}
