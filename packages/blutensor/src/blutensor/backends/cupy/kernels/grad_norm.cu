// Global L2 norm of many gradient tensors without a host sync, and clipping by it, using the same
// chunk table as the multi-tensor AdamW (tensor index, start element per block; flags bit 0: bf16 bits).
// blu_grad_norm_partial: one fp32 sum of squares per chunk (fixed reduction tree; 16-byte loads, 8 in flight
// per thread, for fp32 and bf16);
// blu_grad_norm_finalize: one block sums the partials in fixed order in double and writes sqrt -> out[0];
// blu_grad_norm_scale: g *= max_norm / (norm + 1e-6) when that is < 1, reading norm from device memory (16-byte
// accesses, 4 in flight per thread, when aligned).
// Deterministic: no atomics. bf16 conversions: bf16_vec.cuh.

#include "bf16_vec.cuh"

extern "C" __global__ void __launch_bounds__(512)
blu_grad_norm_partial(const unsigned long long* __restrict__ g_ptr, const int* __restrict__ flags,
                      const long long* __restrict__ numel, const int* __restrict__ chunk_tensor,
                      const long long* __restrict__ chunk_start, long long chunk_size, float* __restrict__ partial) {
    __shared__ float sh[32];
    const int ti = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long n = numel[ti];
    const long long end = start + chunk_size < n ? start + chunk_size : n;
    const bool bf = flags[ti] & 1;
    const float* gf = reinterpret_cast<const float*>(g_ptr[ti]);
    const bf16_t* gb = reinterpret_cast<const bf16_t*>(g_ptr[ti]);
    float s0 = 0.f, s1 = 0.f;
    long long first = start;
    // 16-byte loads, GN_U of them issued per thread before any math (a 16 Ki-element fp32 chunk on 512 threads is
    // one step: the whole chunk in flight at once)
    constexpr int GN_U = 8;
    if ((g_ptr[ti] & 15ull) == 0 && (start & 7) == 0) {
        const int per = bf ? 8 : 4;  // elements per 16 bytes
        const long long nvec = (end - start) / per;
        const uint4* g4 = reinterpret_cast<const uint4*>(bf ? (const void*)(gb + start) : (const void*)(gf + start));
        for (long long j0 = threadIdx.x; j0 < nvec; j0 += GN_U * (long long)blockDim.x) {
            uint4 u[GN_U];
#pragma unroll
            for (int k = 0; k < GN_U; ++k) {
                const long long j = j0 + k * (long long)blockDim.x;
                u[k] = j < nvec ? g4[j] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int k = 0; k < GN_U; ++k) {
                if (bf) {
                    const float a0 = __uint_as_float(u[k].x << 16), a1 = __uint_as_float(u[k].x & 0xffff0000u);
                    const float a2 = __uint_as_float(u[k].y << 16), a3 = __uint_as_float(u[k].y & 0xffff0000u);
                    const float a4 = __uint_as_float(u[k].z << 16), a5 = __uint_as_float(u[k].z & 0xffff0000u);
                    const float a6 = __uint_as_float(u[k].w << 16), a7 = __uint_as_float(u[k].w & 0xffff0000u);
                    s0 += a0 * a0 + a1 * a1 + a2 * a2 + a3 * a3;
                    s1 += a4 * a4 + a5 * a5 + a6 * a6 + a7 * a7;
                } else {
                    const float a0 = __uint_as_float(u[k].x), a1 = __uint_as_float(u[k].y);
                    const float a2 = __uint_as_float(u[k].z), a3 = __uint_as_float(u[k].w);
                    s0 += a0 * a0 + a1 * a1;
                    s1 += a2 * a2 + a3 * a3;
                }
            }
        }
        first = start + nvec * per;
    }
    long long i = first + threadIdx.x;
    for (; i + blockDim.x < end; i += 2LL * blockDim.x) {
        float a = bf ? to_f(gb[i]) : gf[i];
        float b = bf ? to_f(gb[i + blockDim.x]) : gf[i + blockDim.x];
        s0 += a * a;
        s1 += b * b;
    }
    if (i < end) { float a = bf ? to_f(gb[i]) : gf[i]; s0 += a * a; }
    float s = s0 + s1;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += sh[k];
        partial[blockIdx.x] = t;
    }
}

extern "C" __global__ void blu_grad_norm_finalize(const float* __restrict__ partial, int nchunks, float* __restrict__ out) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < nchunks; i += blockDim.x) s += (double)partial[i];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += sh[k];
        out[0] = (float)sqrt(t);
    }
}

extern "C" __global__ void __launch_bounds__(512)
blu_grad_norm_scale(const unsigned long long* __restrict__ g_ptr, const int* __restrict__ flags,
                    const long long* __restrict__ numel, const int* __restrict__ chunk_tensor,
                    const long long* __restrict__ chunk_start, long long chunk_size, const float* __restrict__ norm,
                    float max_norm) {
    const float coef = max_norm / (norm[0] + 1e-6f);
    if (!(coef < 1.f)) return;
    const int ti = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long n = numel[ti];
    const long long end = start + chunk_size < n ? start + chunk_size : n;
    const bool bf = flags[ti] & 1;
    float* gf = reinterpret_cast<float*>(g_ptr[ti]);
    bf16_t* gb = reinterpret_cast<bf16_t*>(g_ptr[ti]);
    long long first = start;
    if ((g_ptr[ti] & 15ull) == 0 && (start & 7) == 0) {  // 16-byte loads/stores, 4 in flight per thread
        constexpr int U = 4;
        const int per = bf ? 8 : 4;
        const long long nvec = (end - start) / per;
        uint4* g4 = reinterpret_cast<uint4*>(bf ? (void*)(gb + start) : (void*)(gf + start));
        for (long long j0 = threadIdx.x; j0 < nvec; j0 += U * (long long)blockDim.x) {
            uint4 u[U];
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const long long j = j0 + k * (long long)blockDim.x;
                if (j < nvec) u[k] = g4[j];
            }
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const long long j = j0 + k * (long long)blockDim.x;
                if (j >= nvec) continue;
                unsigned int* w = &u[k].x;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (bf) {
                        const float lo = __uint_as_float(w[e] << 16) * coef;
                        const float hi = __uint_as_float(w[e] & 0xffff0000u) * coef;
                        w[e] = (unsigned int)from_f<bf16_t>(lo) | ((unsigned int)from_f<bf16_t>(hi) << 16);
                    } else {
                        w[e] = __float_as_uint(__uint_as_float(w[e]) * coef);
                    }
                }
                g4[j] = u[k];
            }
        }
        first = start + nvec * per;
    }
    for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
        if (bf) gb[i] = from_f<bf16_t>(to_f(gb[i]) * coef); else gf[i] *= coef;
    }
}
