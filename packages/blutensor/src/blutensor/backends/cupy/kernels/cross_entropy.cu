// Fused classifier: softmax + cross-entropy + logits gradient, fp32 and bf16 storage (raw uint16 bits).
// blu_cross_entropy_forward_smem_* (rows that fit in shared memory, the usual case): a persistent grid, the row
// held in shared memory between the passes and the next row prefetched by cp.async (see ce_forward_smem).
// blu_cross_entropy_forward_* (wider rows, unaligned, or loss only): one block per row. Pass 1 reads the row
// once (vectorised online max/sum-exp, plus the row sum for label smoothing) -> log-sum-exp and loss. Pass 2 (only when the gradient is wanted) re-reads the row (mostly
// from L2) and writes  (softmax - (1-ls)*onehot - ls/C) * scale  into grad, which may be the logits
// buffer itself (each element is read and then written by the same thread). scale = 1/count for
// reduction 'mean' (count of non-ignored targets, computed on device by blu_cross_entropy_count: no host
// sync), else 1; rows whose target is ignore_index get loss 0 and gradient 0; a target out of [0, C)
// gives a NaN loss for its row (device-side signal, no host sync) and a zero gradient row.
// blu_cross_entropy_backward_* scales the gradient by the incoming grad read from device memory; for a
// scalar grad equal to 1 (the usual loss.backward()) every block exits at once.
// Shared bf16/vector helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

#define BLU_NEG_INF (-__int_as_float(0x7f800000))
#define BLU_NAN __int_as_float(0x7fc00000)

// online (max, sum exp(x - max)) merge
__device__ __forceinline__ void ms_merge(float& m, float& s, float mb, float sb) {
    if (mb == BLU_NEG_INF) return;
    if (m == BLU_NEG_INF) { m = mb; s = sb; return; }
    if (mb > m) { s = s * __expf(m - mb) + sb; m = mb; }
    else s += sb * __expf(mb - m);
}

// valid-target count: one block, fixed order (deterministic)
extern "C" __global__ void blu_cross_entropy_count(const long long* __restrict__ target, long long N,
                                                   long long ignore_index, float* __restrict__ count) {
    __shared__ long long part[32];
    long long c = 0;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) c += (target[i] != ignore_index);
    for (int off = 16; off > 0; off >>= 1) c += __shfl_xor_sync(0xffffffffu, c, off);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long t = 0;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += part[k];
        count[0] = (float)t;
    }
}

// lazy index validation (used by cross_entropy targets and embedding indices, no host sync): the first
// block that meets an index outside [lo, hi) (and != allowed when has_allowed) claims flag[0] with the
// caller's site id and records flag[1] = the index, flag[2] = its position, flag[3] = hi; the host reads
// the flag later (at log time), never in the step
extern "C" __global__ void blu_cross_entropy_check_indices(const long long* __restrict__ idx, long long n, long long lo,
                                                           long long hi, long long allowed, int has_allowed,
                                                           long long site, long long* flag) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long v = idx[i];
        if ((v < lo || v >= hi) && !(has_allowed && v == allowed)) {
            if (atomicCAS(reinterpret_cast<unsigned long long*>(flag), 0ull, (unsigned long long)site) == 0ull) {
                flag[1] = v;
                flag[2] = i;
                flag[3] = hi;
                __threadfence();
            }
        }
    }
}

template <typename T>
__device__ void ce_forward(const T* logits, const long long* __restrict__ target, long long N, int C,
                           long long ignore_index, float ls, float* __restrict__ loss_rows, float* __restrict__ lse_out,
                           T* grad, const float* __restrict__ count, int mean, int vec) {
    constexpr int V = VecN<T>::N;
    __shared__ float sh_m[32], sh_s[32], sh_z[32];
    __shared__ float sh_lse;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const T* z = logits + row * (long long)C;
        float m = BLU_NEG_INF, s = 0.f, zs = 0.f;
        int c0 = 0;
        if (vec) {
            const int nv = C / V;
            const uint4* z4 = reinterpret_cast<const uint4*>(z);
            for (int i0 = threadIdx.x; i0 < nv; i0 += 4 * blockDim.x) {
                uint4 u[4];  // four 16-byte loads in flight before any use
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int i = i0 + j * blockDim.x;
                    if (i < nv) u[j] = z4[i];
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (i0 + j * blockDim.x < nv) {
                        float v[V];
                        unpack(u[j], v, T());
                        float vm = v[0];
#pragma unroll
                        for (int k = 1; k < V; ++k) vm = fmaxf(vm, v[k]);
                        float vs = 0.f;
#pragma unroll
                        for (int k = 0; k < V; ++k) { vs += __expf(v[k] - vm); zs += v[k]; }
                        ms_merge(m, s, vm, vs);
                    }
                }
            }
            c0 = nv * V;
        }
        for (int i = c0 + threadIdx.x; i < C; i += blockDim.x) {
            float v = to_f(z[i]);
            ms_merge(m, s, v, 1.f);
            zs += v;
        }
        for (int off = 16; off > 0; off >>= 1) {
            float mb = __shfl_xor_sync(0xffffffffu, m, off);
            float sb = __shfl_xor_sync(0xffffffffu, s, off);
            zs += __shfl_xor_sync(0xffffffffu, zs, off);
            ms_merge(m, s, mb, sb);
        }
        if (lane == 0) { sh_m[warp] = m; sh_s[warp] = s; sh_z[warp] = zs; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float M = BLU_NEG_INF, S = 0.f, Z = 0.f;
            for (int k = 0; k < nw; ++k) { ms_merge(M, S, sh_m[k], sh_s[k]); Z += sh_z[k]; }
            const float lse = M + logf(S);
            const long long t = target[row];
            float loss;
            if (t == ignore_index) loss = 0.f;
            else if (t < 0 || t >= C) loss = BLU_NAN;
            else {
                loss = lse - to_f(z[t]);
                if (ls != 0.f) loss = (1.f - ls) * loss + ls * (lse - Z / (float)C);
            }
            loss_rows[row] = loss;
            if (lse_out) lse_out[row] = lse;
            sh_lse = lse;
        }
        __syncthreads();
        if (grad) {
            const float lse = sh_lse;
            const long long t = target[row];
            const bool ok = t != ignore_index && t >= 0 && t < C;
            const float scale = ok ? (mean ? 1.f / count[0] : 1.f) : 0.f;
            const float off_c = ls / (float)C;
            T* gr = grad + row * (long long)C;
            if (vec) {
                const int nv = C / V;
                for (int i = threadIdx.x; i < nv; i += blockDim.x) {
                    float v[V];
                    load_vec(z + (long long)i * V, v);
#pragma unroll
                    for (int k = 0; k < V; ++k) {
                        const int c = i * V + k;
                        v[k] = (__expf(v[k] - lse) - off_c - (c == t ? 1.f - ls : 0.f)) * scale;
                    }
                    store_vec(gr + (long long)i * V, v);
                }
            }
            for (int i = c0 + threadIdx.x; i < C; i += blockDim.x) {
                float v = to_f(z[i]);
                gr[i] = from_f<T>((__expf(v - lse) - off_c - (i == t ? 1.f - ls : 0.f)) * scale);
            }
        }
        __syncthreads();  // sh_* reused by the next row
    }
}

// 16-byte global -> shared copies that bypass registers (sm_80+ cp.async): a thread can have a whole row's share
// in flight without holding it
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Same contract as ce_forward with a gradient wanted, for rows that fit in shared memory (vec path only), on a
// persistent grid (rows blockIdx.x, blockIdx.x + gridDim.x, ...). The row lives in dynamic shared memory and each
// thread only ever touches its own 16-byte slots i = tid, tid + blockDim.x, ... : it cp.async-loads them, reads
// them for the statistics, and in the gradient pass reads each slot, then at once refills it with the NEXT row's
// slot (cp.async) before storing the gradient. So the next row's loads are in flight while this row's gradient
// is written and while the next row's block reduction runs: the logits cross HBM once each way, and memory never
// idles between rows. Slots are thread-private, so cp.async.wait_all is the only wait on them; the shared
// statistics use the two barriers of the block reduction. Deterministic: fixed reduction order.
template <typename T>
__device__ void ce_forward_smem(const T* logits, const long long* __restrict__ target, long long N, int C,
                                long long ignore_index, float ls, float* __restrict__ loss_rows,
                                float* __restrict__ lse_out, T* grad, const float* __restrict__ count, int mean) {
    constexpr int V = VecN<T>::N;
    extern __shared__ __align__(16) unsigned char ce_row_raw[];
    uint4* row_s = reinterpret_cast<uint4*>(ce_row_raw);
    __shared__ float sh_m[32], sh_s[32], sh_z[32];
    __shared__ float sh_lse, sh_zt;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int nv = C / V;
    long long row = blockIdx.x;
    if (row < N) {
        const uint4* z = reinterpret_cast<const uint4*>(logits + row * (long long)C);
        for (int i = threadIdx.x; i < nv; i += blockDim.x) cp_async16(row_s + i, z + i);
    }
    cp_async_commit();
    for (; row < N; row += gridDim.x) {
        const long long t = target[row];
        const bool ok = t != ignore_index && t >= 0 && t < C;
        const int tv = ok ? (int)(t / V) : -1, tk = ok ? (int)(t % V) : 0;
        cp_async_wait_all();  // this thread's slots of this row have landed
        float m = BLU_NEG_INF, s = 0.f, zs = 0.f;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float v[V];
            unpack(row_s[i], v, T());
            float vm = v[0];
#pragma unroll
            for (int k = 1; k < V; ++k) vm = fmaxf(vm, v[k]);
            float vs = 0.f;
#pragma unroll
            for (int k = 0; k < V; ++k) { vs += __expf(v[k] - vm); zs += v[k]; }
            ms_merge(m, s, vm, vs);
            if (i == tv) {
#pragma unroll
                for (int k = 0; k < V; ++k)
                    if (k == tk) sh_zt = v[k];  // the target's logit, for thread 0
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            float mb = __shfl_xor_sync(0xffffffffu, m, off);
            float sb = __shfl_xor_sync(0xffffffffu, s, off);
            zs += __shfl_xor_sync(0xffffffffu, zs, off);
            ms_merge(m, s, mb, sb);
        }
        if (lane == 0) { sh_m[warp] = m; sh_s[warp] = s; sh_z[warp] = zs; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float M = BLU_NEG_INF, S = 0.f, Z = 0.f;
            for (int k = 0; k < nw; ++k) { ms_merge(M, S, sh_m[k], sh_s[k]); Z += sh_z[k]; }
            const float lse = M + logf(S);
            float loss;
            if (t == ignore_index) loss = 0.f;
            else if (t < 0 || t >= C) loss = BLU_NAN;
            else {
                loss = lse - sh_zt;
                if (ls != 0.f) loss = (1.f - ls) * loss + ls * (lse - Z / (float)C);
            }
            loss_rows[row] = loss;
            if (lse_out) lse_out[row] = lse;
            sh_lse = lse;
        }
        __syncthreads();
        const float lse = sh_lse;
        const float scale = ok ? (mean ? 1.f / count[0] : 1.f) : 0.f;
        const float off_c = ls / (float)C;
        const long long next = row + gridDim.x;
        const uint4* zn = next < N ? reinterpret_cast<const uint4*>(logits + next * (long long)C) : nullptr;
        uint4* gr = reinterpret_cast<uint4*>(grad + row * (long long)C);
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float v[V];
            unpack(row_s[i], v, T());
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const int c = i * V + k;
                v[k] = (__expf(v[k] - lse) - off_c - (c == t ? 1.f - ls : 0.f)) * scale;
            }
            // the slot's value is consumed (the math above waited for it): refill it with the next row's slot
            if (zn) cp_async16(row_s + i, zn + i);
            gr[i] = pack(v, T());
        }
        cp_async_commit();
    }
    cp_async_wait_all();
}

// out[0] = sum(loss_rows) (mode 1) or sum / count (mode 0: mean); one block, fixed order, double accumulation.
template <typename T>
__device__ void ce_reduce(const float* __restrict__ loss_rows, long long N, const float* __restrict__ count, int mean,
                          T* __restrict__ out) {
    __shared__ double part[32];
    double s = 0.0;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) s += (double)loss_rows[i];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += part[k];
        if (mean) t = t / (double)count[0];  // 0/0 -> NaN like the reference
        out[0] = from_f<T>((float)t);
    }
}

// grad *= g (g scalar: per_row = 0, exits when g == 1; per_row = 1: row r scaled by g[r]).
template <typename T>
__device__ void ce_backward(T* grad, long long N, int C, const T* __restrict__ g, int per_row, int vec) {
    constexpr int V = VecN<T>::N;
    if (!per_row) {
        const float gs = to_f(g[0]);
        if (gs == 1.f) return;
        const long long n = N * (long long)C;
        const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x, nth = (long long)gridDim.x * blockDim.x;
        long long done = 0;
        if (vec) {
            const long long nv = n / V;
            for (long long i = tid; i < nv; i += nth) {
                float v[V];
                load_vec(grad + i * V, v);
#pragma unroll
                for (int k = 0; k < V; ++k) v[k] *= gs;
                store_vec(grad + i * V, v);
            }
            done = nv * V;
        }
        for (long long i = done + tid; i < n; i += nth) grad[i] = from_f<T>(to_f(grad[i]) * gs);
        return;
    }
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const float gs = to_f(g[row]);
        T* gr = grad + row * (long long)C;
        for (int i = threadIdx.x; i < C; i += blockDim.x) gr[i] = from_f<T>(to_f(gr[i]) * gs);
    }
}

#define CE_ENTRIES(SUF, T)                                                                                     \
extern "C" __global__ void blu_cross_entropy_forward_##SUF(const T* logits, const long long* target,           \
        long long N, int C, long long ignore_index, float ls, float* loss_rows, float* lse, T* grad,           \
        const float* count, int mean, int vec) {                                                               \
    ce_forward<T>(logits, target, N, C, ignore_index, ls, loss_rows, lse, grad, count, mean, vec);             \
}                                                                                                              \
extern "C" __global__ void __launch_bounds__(1024, 1) blu_cross_entropy_forward_smem_##SUF(const T* logits,         \
        const long long* target, long long N, int C, long long ignore_index, float ls, float* loss_rows,      \
        float* lse, T* grad, const float* count, int mean) {                                                   \
    ce_forward_smem<T>(logits, target, N, C, ignore_index, ls, loss_rows, lse, grad, count, mean);             \
}                                                                                                              \
extern "C" __global__ void blu_cross_entropy_reduce_##SUF(const float* loss_rows, long long N,                 \
        const float* count, int mean, T* out) {                                                                \
    ce_reduce<T>(loss_rows, N, count, mean, out);                                                              \
}                                                                                                              \
extern "C" __global__ void blu_cross_entropy_backward_##SUF(T* grad, long long N, int C, const T* g,           \
        int per_row, int vec) {                                                                                \
    ce_backward<T>(grad, N, C, g, per_row, vec);                                                               \
}

CE_ENTRIES(f32, float)
CE_ENTRIES(bf16, bf16_t)
